"""Delivery rate of ONE rank service to its trainer client: batches/s and MB/s for 8k-token batches.

Setup: one child process (multiprocessing, spawn) runs the coordinator server (`create_server`,
world size 1) and the rank service (`RankServiceCore` + `create_rank_server`) over a
`SyntheticSource` of the odb-synthetic lengths (4096 samples, wrapping around: non-join mode with a
sample quota of `--samples`), job spec L=8192, policy local, window 512, depth 8, padded collation.
This process is the trainer: a `BatchClient` (credits as given) iterates over the batches and does
nothing with them (pure delivery; the client still decodes every batch into torch tensors).

The service does all of its real per-batch work: it materializes each sample's payload (synthetic
token ids and labels, numpy), runs the alignment round against the coordinator over gRPC, collates
the step (padded: input_ids, attention_mask, labels, position_ids, int64 [B, T]), encodes it into a
protobuf `Batch` and streams it.

Measured client-side from the arrival of batch `--warmup` (default 20) to the last one: batches/s,
MB/s (message bytes on the wire / s) and tokens/s. Wire bytes per batch are the exact
`pb.Batch.ByteSize()` of each message, taken in the service (a wrapper around `RankServiceCore._batch`);
gRPC adds 5 bytes of message framing plus HTTP/2 frame headers. CPU seconds per batch of the service
and client processes come from `os.times()` in each over the same window.

Results go to docs/benchmarks.md between `<!-- rank-service:begin -->` and `<!-- rank-service:end -->`.

Usage: python benchmarks/rank_service_throughput.py [--samples 40000] [--credits 2,4,8] [--no-write]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _mdsection import DEFAULT_WORKLOADS, format_profile, idle_share, merged_stats, publish, revision, table  # noqa: E402

SECTION = "rank-service"
BUDGET, WINDOW, DEPTH = 8192, 512, 8
# The GPU step this is compared with: a ~100M-parameter model on 8k tokens.
PARAMS, PEAK_TFLOPS, MFU = 1e8, 989.0, 0.5


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def job_spec(samples: int):
    from batchd.core import JobSpec

    return JobSpec(
        world_size=1,
        token_budget=BUDGET,
        policy="local",
        window=WINDOW,
        depth=DEPTH,
        seed=0,
        mode="non-join",
        quota=samples,
        collate="padded",
    )


def service_main(conn, lengths: list[int], samples: int, profile: bool = False) -> None:
    """Coordinator + rank service of rank 0 in this process until told to stop."""
    import threading

    from batchd.service import CoordinatorClient, RankServiceCore, create_rank_server, create_server
    from batchd.service.preprocess import SyntheticSource

    profiles: list = []
    if profile:
        import cProfile

        def install(frame, event, arg):  # first event of a new thread: a per-thread CPU-time profiler
            prof = cProfile.Profile(time.thread_time)
            profiles.append(prof)
            prof.enable()

        threading.setprofile(install)

    from batchd.client import _collate  # noqa: F401 - import torch now, not in the first round

    spec = job_spec(samples)
    cserver, cport, cstate = create_server("127.0.0.1:0", spec)
    cserver.start()
    source = SyntheticSource(lengths, 0, 1, spec.seed, 0, spec.shuffle, wrap=True)
    coord = CoordinatorClient(f"127.0.0.1:{cport}", 0, spec)
    core = RankServiceCore(0, spec, coord, source)
    sizes: list[tuple[int, int, int]] = []  # (message bytes, tensor bytes, padded tokens)
    orig_batch = core._batch

    def batch(step, payloads):
        msg = orig_batch(step, payloads)
        sizes.append(
            (
                msg.ByteSize(),
                sum(len(t.data) for t in msg.tensors),
                int(msg.tensors[0].shape[0] * msg.tensors[0].shape[1]) if payloads else 0,
            )
        )
        return msg

    core._batch = batch
    server, port = create_rank_server("127.0.0.1:0", core)
    server.start()
    core.start(f"127.0.0.1:{port}")
    conn.send(port)
    cpu0 = 0.0
    while True:
        msg = conn.recv()
        if msg == "mark":
            cpu0 = cpu_s()
            conn.send(None)
        elif msg == "stop":
            break
    out = {"cpu_s": cpu_s() - cpu0, "sizes": sizes, "failure": core.failure}
    if profiles:
        threading.setprofile(None)
        stats = merged_stats(profiles)
        out["profile"] = format_profile(stats, 12) if stats is not None else ""
        if stats is not None:
            total = sum(row[2] for row in stats.stats.values()) or 1.0
            cum = {}
            for (filename, _line, func), row in stats.stats.items():
                if filename.endswith(
                    ("_sources.py", "_collate.py", "wire.py", "_rank_service.py", "_rank_server.py")
                ):
                    cum[f"{Path(filename).name}:{func}"] = row[3] / total
            out["profile_cum"] = sorted(cum.items(), key=lambda kv: -kv[1])[:9]
    conn.send(out)
    core.stop()
    coord.close()
    server.stop(0)
    cserver.stop(0)
    cstate.close()


def run_once(
    lengths: list[int], samples: int, credits: int, warmup: int, profile: bool = False
) -> dict[str, Any]:
    from batchd.client import BatchClient

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=service_main, args=(child, lengths, samples, profile), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("rank service did not start")
        port = parent.recv()
        client = BatchClient(f"127.0.0.1:{port}", rank=0, world_size=1, credits=credits)
        n = 0
        real = 0
        t0 = c0 = None
        t_first = time.perf_counter()
        for batch, info in client:
            n += 1
            real += info.local_tokens
            if n == warmup:
                t0, c0 = time.perf_counter(), cpu_s()
                real_at_warm = real
                parent.send("mark")
                parent.recv()
        t1, c1 = time.perf_counter(), cpu_s()
        client.close()
        parent.send("stop")
        svc = parent.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
    if svc["failure"]:
        raise RuntimeError(f"rank service failed: {svc['failure']}")
    if t0 is None:
        raise RuntimeError(f"only {n} batches; raise --samples")
    measured = n - warmup
    sizes = svc["sizes"][warmup:n]
    dt = t1 - t0
    msg_bytes = sum(s[0] for s in sizes)
    data = [s for s in sizes if s[2] > 0]
    return {
        "credits": credits,
        "batches": n,
        "measured": measured,
        "seconds": dt,
        "startup_s": t0 - t_first,
        "batches_per_s": measured / dt,
        "mb_per_s": msg_bytes / dt / 1e6,
        "real_tokens_per_s": (real - real_at_warm) / dt,
        "padded_tokens_per_s": sum(s[2] for s in sizes) / dt,
        "bytes_per_batch": statistics.mean(s[0] for s in sizes),
        "max_bytes_per_batch": max(s[0] for s in sizes),
        "tensor_bytes_per_batch": statistics.mean(s[1] for s in sizes),
        "padded_tokens_per_batch": statistics.mean(s[2] for s in data) if data else 0,
        "service_cpu_ms_per_batch": 1000 * svc["cpu_s"] / measured,
        "client_cpu_ms_per_batch": 1000 * (c1 - c0) / measured,
        "service_cores": svc["cpu_s"] / dt,
        "client_cores": (c1 - c0) / dt,
        "profile": svc.get("profile", ""),
        "profile_cum": svc.get("profile_cum", []),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--samples", type=int, default=40000, help="non-join sample quota (4096 lengths, wrapping)"
    )
    ap.add_argument(
        "--credits", default="2,4,8", help="BatchClient credits to try (comma-separated; 4 is the default)"
    )
    ap.add_argument("--warmup", type=int, default=20, help="batches before the clock starts")
    ap.add_argument("--workloads", type=Path, default=DEFAULT_WORKLOADS)
    ap.add_argument("--no-profile", action="store_true", help="skip the cProfile run of the service")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    raw = argv if argv is not None else sys.argv[1:]
    cmd = "python benchmarks/rank_service_throughput.py" + (" " + " ".join(raw) if raw else "")
    from batchd import read_lengths

    lengths = read_lengths(str(args.workloads / "odb-synthetic.txt"))
    t_all = time.perf_counter()
    idle0 = idle_share()
    runs = []
    for c in (int(x) for x in args.credits.split(",")):
        r = run_once(lengths, args.samples, c, args.warmup)
        runs.append(r)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
    prof = None
    if not args.no_profile:
        prof = run_once(lengths, max(args.samples // 3, 4000), runs[0]["credits"], args.warmup, profile=True)
        print(prof["profile"], flush=True)
    wall = time.perf_counter() - t_all
    idle1 = idle_share()

    step_flop = 6 * PARAMS * BUDGET
    step_s = step_flop / (PEAK_TFLOPS * 1e12 * MFU)
    need = 1 / step_s
    best = max(r["batches_per_s"] for r in runs)
    worst = min(r["batches_per_s"] for r in runs)
    rows = [
        [
            r["credits"],
            r["measured"],
            f"{r['seconds']:.1f}",
            f"{r['batches_per_s']:.0f}",
            f"{r['mb_per_s']:.0f}",
            f"{r['padded_tokens_per_s'] / 1e6:.2f}",
            f"{r['real_tokens_per_s'] / 1e6:.2f}",
            f"{r['bytes_per_batch'] / 1e3:.0f}",
            f"{r['max_bytes_per_batch'] / 1e3:.0f}",
            f"{r['service_cpu_ms_per_batch']:.2f}",
            f"{r['client_cpu_ms_per_batch']:.2f}",
            f"{r['service_cores']:.2f}",
            f"{r['client_cores']:.2f}",
            f"{r['batches_per_s'] / need:.1f}x",
        ]
        for r in runs
    ]
    headers = [
        "credits",
        "batches",
        "s",
        "batches/s",
        "MB/s",
        "padded Mtok/s",
        "real Mtok/s",
        "KB/batch",
        "max KB/batch",
        "service CPU ms/batch",
        "client CPU ms/batch",
        "service cores",
        "client cores",
        "vs GPU step rate",
    ]
    r0 = runs[0]
    machine = (
        f"{platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} CPU(s) "
        f"shared by the service and client processes, {platform.machine()}"
    )
    body = [
        "## Rank service delivery rate (one rank, trainer doing nothing)",
        "",
        f"Generated by `{cmd}` ({wall:.0f} s in all; {revision()}; {machine}; "
        f"CPU idle {idle0:.0%} in the 3 s before, {idle1:.0%} in the 3 s after). "
        "Machine note: 2 shared cores, noisy; compare figures within one run.",
        "",
        f"One rank service (world size 1; coordinator server in the same process, its own process) over "
        f"the odb-synthetic lengths (4096 samples, wrapping; non-join quota {args.samples:,} samples), "
        f"L={BUDGET}, policy local, window {WINDOW}, depth {DEPTH}, **padded** collation (4 int64 tensors "
        f"[B, T]: input_ids, attention_mask, labels, position_ids). The trainer is a `BatchClient` in "
        f"the parent process that only iterates (it still decodes each batch into torch tensors). "
        f"Figures from batch {args.warmup} to the last; the service's per-batch work includes "
        "materializing the synthetic payloads, the alignment round, collation and protobuf encoding.",
        "",
        "- **KB/batch**: the exact protobuf `Batch` size (`ByteSize()`, measured in the service) = bytes "
        "on the wire per batch before gRPC's 5-byte framing and HTTP/2 frame headers; "
        f"{r0['tensor_bytes_per_batch'] / 1e3:.0f} KB of it is raw tensor data, for "
        f"{r0['padded_tokens_per_batch']:.0f} padded tokens per batch on average "
        "(8 bytes x 4 tensors per token).",
        "- **service/client cores**: process CPU seconds / wall seconds over the window (1.00 = one core "
        "busy).",
        f"- **vs GPU step rate**: batches/s / {need:.0f} steps/s. A ~100M-parameter model on an 8k-token "
        f"batch costs ~6 x 1e8 x {BUDGET} = {step_flop / 1e12:.1f} TFLOP, i.e. ~{1000 * step_s:.0f} ms on an "
        f"H100-class GPU at {MFU:.0%} MFU of ~{PEAK_TFLOPS:.0f} TFLOP/s bf16 dense (an estimate, not "
        "measured here).",
        "",
        table(headers, rows),
        "",
        f"At {worst:.0f}-{best:.0f} batches/s one rank service delivers {worst / need:.1f}-{best / need:.1f}x "
        f"the ~{need:.0f} batches/s that such a GPU step consumes, using "
        f"{r0['service_cpu_ms_per_batch']:.1f} ms of service CPU per batch, i.e. ~"
        f"{r0['service_cpu_ms_per_batch'] * need / 1000:.2f} of a core at {need:.0f} steps/s "
        f"(plus {r0['client_cpu_ms_per_batch']:.1f} ms/batch of decoding in the trainer process). "
        + (
            "It is not the bottleneck of such a step."
            if worst > need
            else "**It would be the bottleneck of such a step.**"
        ),
        "",
    ]
    if prof is not None:
        from _mdsection import REPO

        site = str(Path(sys.prefix)) + "/lib/python3.11/site-packages/"
        lines = [
            ln.replace(str(REPO) + "/", "").replace(site, "").rstrip()
            for ln in prof["profile"].strip().splitlines()
            if ln.strip()
        ]
        body += [
            f"### Where the service's CPU goes (cProfile, separate run of {prof['measured'] + args.warmup} "
            f"batches, credits {prof['credits']}, top 12 by tottime)",
            "",
            "Every thread of the service process is profiled with `time.thread_time` (its own CPU time; "
            "blocking does not count) and the profiles are merged; gRPC's C-core threads are not visible. "
            f"Under cProfile: {prof['batches_per_s']:.0f} batches/s, {prof['service_cpu_ms_per_batch']:.2f} "
            "ms service CPU per batch. Cumulative shares of the profiled CPU time (a function's time "
            "including what it calls; nested, so they overlap): "
            + ", ".join(f"`{name}` {share:.0%}" for name, share in prof["profile_cum"])
            + ".",
            "",
            "```",
            *lines,
            "```",
            "",
        ]
    publish(SECTION, body, args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
