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

The result goes to benchmarks/results/rank-service.json (template: templates/rank-service.md.j2).

Usage: python benchmarks/rank_service_throughput.py [--samples 40000] [--credits 2,4,8] [--no-profile]
       [--out PATH] [--print]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import (  # noqa: E402
    DEFAULT_WORKLOADS,
    REPO,
    add_common_args,
    command_line,
    finish,
    format_profile,
    idle_share,
    machine,
    merged_stats,
)

SECTION = "rank-service"
MEASURES = ("benchmarks/rank_service_throughput.py", "core", "proto", "service", "client")
# The modules whose cumulative share of the service's CPU the profile reports.
PROFILED = ("_sources.py", "_collate.py", "wire.py")  # and every module of the rank service package
PROFILED_DIRS = ("/service/rank/",)
BUDGET, WINDOW, DEPTH = 8192, 512, 8
# The GPU step this is compared with: a ~100M-parameter model on 8k tokens.
PARAMS, PEAK_TFLOPS, MFU = 1e8, 989.0, 0.5


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def job_spec(samples: int):
    from batchd.core import JobSpec, PolicySpec

    return JobSpec(
        world_size=1,
        token_budget=BUDGET,
        seed=0,
        mode="non-join",
        quota=samples,
        policy=PolicySpec(name="local", window=WINDOW, depth=DEPTH, collate="padded"),
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

    import torch  # noqa: F401 - import torch now (the collation needs it), not in the first round

    spec = job_spec(samples)
    cserver, cport, cstate = create_server("127.0.0.1:0", spec)
    cserver.start()
    source = SyntheticSource(lengths, 0, 1, spec.seed, 0, spec.shuffle, wrap=True)
    coord = CoordinatorClient(f"127.0.0.1:{cport}", 0, spec)
    core = RankServiceCore(0, spec, coord, source)
    sizes: list[tuple[int, int, int]] = []  # (message bytes, tensor bytes, padded tokens)
    orig_batch = core._batch

    def batch(step, payloads, *rest):  # rest: the images of a two-phase step (today's signature)
        msg = orig_batch(step, payloads, *rest)
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
                if filename.endswith(PROFILED) or any(d in filename for d in PROFILED_DIRS):
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
    from batchd.client import BatchClient, ClientOptions

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=service_main, args=(child, lengths, samples, profile), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("rank service did not start")
        port = parent.recv()
        client = BatchClient(f"127.0.0.1:{port}", rank=0, world_size=1, options=ClientOptions(credits))
        n = 0
        real = 0
        t0 = c0 = None
        t_first = time.perf_counter()
        for _batch, info in client:
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


HEADERS = ["credits", "batches", "s", "batches/s", "MB/s", "padded Mtok/s", "real Mtok/s", "KB/batch"]
HEADERS += ["max KB/batch", "service CPU ms/batch", "client CPU ms/batch", "service cores", "client cores"]
HEADERS += ["vs GPU step rate"]


def _row(r: dict[str, Any], need: float) -> list[object]:
    return [r["credits"], r["measured"], f"{r['seconds']:.1f}", f"{r['batches_per_s']:.0f}"] + [
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


def _profile_lines(text: str) -> list[str]:
    site = str(Path(sys.prefix)) + "/lib/python3.11/site-packages/"
    lines = (ln.replace(str(REPO) + "/", "").replace(site, "").rstrip() for ln in text.strip().splitlines())
    return [ln for ln in lines if ln.strip()]


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
    add_common_args(ap)
    args = ap.parse_args(argv)
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
        prof["profile_lines"] = _profile_lines(prof.pop("profile"))
    wall = time.perf_counter() - t_all
    step_flop = 6 * PARAMS * BUDGET
    step_s = step_flop / (PEAK_TFLOPS * 1e12 * MFU)
    need = 1 / step_s
    for r in runs:
        r.pop("profile"), r.pop("profile_cum")
    data = {"headers": HEADERS, "rows": [_row(r, need) for r in runs], "runs": runs, "profile": prof}
    data.update(wall_s=wall, idle_before=idle0, idle_after=idle_share(), need_per_s=need)
    data.update(step_tflop=step_flop / 1e12, step_ms=1000 * step_s)
    data["best"], data["worst"] = max(r["batches_per_s"] for r in runs), min(r["batches_per_s"] for r in runs)
    data["machine"] = machine("the service and client processes")
    config = {"command": command_line(__file__, argv), "samples": args.samples, "credits": args.credits}
    config.update(warmup=args.warmup, budget=BUDGET, window=WINDOW, depth=DEPTH)
    config.update(params=PARAMS, peak_tflops=PEAK_TFLOPS, mfu=MFU)
    finish(args, SECTION, data, measures=MEASURES, config=config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
