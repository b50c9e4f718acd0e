"""A cluster in a box: cross-host traffic against the simulator, and what each network fault costs.

Hosts are network namespaces on this machine (tests/_netcluster.py: own addresses, host names and ports;
faults cut at a router between them); a head runs the coordinator, two trainer hosts each a node agent
with 2 ranks and 2 gloo trainers (tests/_netjobs.py). Needs root (`sudo`); it exits 2 naming why not.

Part 1, traffic: the synthetic balanced job (the default policy, `nodes = local`, padded cost) over the
first `--samples` lengths of the ultrachat-like workload at L = `--budget`, one epoch. Per rank: the samples
the plan moved to it from the other rank of its host (handed over in process) and from the other host
(`Fetch` over the network, with the bytes of the replies on the wire), against `batchd simulate
--local-ranks 2` of the same lengths and spec, which runs the same planner.

Part 1b, two-phase traffic: the same job over the first `--mm-samples` samples of the mixed multimodal
workload (benchmarks/workloads/mixed.csv: synthetic images), every length divided by `--mm-scale` (text
and image tokens rounded up, 4 patches per image token as the synthetic images need: CPU trainers encode
them), at L = `--budget` / `--mm-scale`, with `--phases 2`, trainers on `TinyMLLM`
(`--images`): per host, the samples and bytes its agent fetched from the other host, and the image-embedding
rows its trainers sent to the other host's ranks in the vision exchange (each row d_model float32 values,
sent once forward and once backward), against `batchd simulate --workload ... --phases 2 --local-ranks 2`.

Part 2, faults (tests/_netfaults.py, the scenarios tests/test_netcluster.py asserts): each short fault
(5 s: a trainer host's link, the two trainer hosts partitioned, the coordinator's host) at lease 12 s,
the time from the fault and from its end until every rank trained 2 more steps; a trainer host cut for
12 s at lease 8 s, and the head (Ray head and coordinator) lost, the time after the fault at which each
party exited; under the torchrun elastic recipe across the two hosts (lease 5 s), host2 lost mid-epoch:
the time until host1's torchrun finished the epoch at world size 2; samples lost and duplicated in each
job that completes (each must be 0: every id is checked
once in the trainers' ids logs, and a job that failed trained nothing twice).

Usage: sudo python benchmarks/cluster.py [--samples 2048] [--mm-samples 256] [--mm-scale 8] [--budget 4096]
    [--out PATH] [--print]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import add_common_args, command_line, finish, machine  # noqa: E402

SECTION = "cluster"
MEASURES = (
    "benchmarks/cluster.py",
    "benchmarks/workloads/mixed.csv",
    "tests/_netcluster.py",
    "tests/_netjobs.py",
    "tests/_netfaults.py",
    "service",
    "batchd/_train",
    "core",
)
WORKLOAD = Path(__file__).resolve().parents[1] / "batchd" / "workloads" / "ultrachat-like.txt"
MM_WORKLOAD = Path(__file__).resolve().parent / "workloads" / "mixed.csv"


def scaled_workload(path: Path, samples: int, scale: int) -> Path:
    """The first `samples` of MM_WORKLOAD with every length divided by `scale` (rounded up; 4 patches per
    image token, the synthetic images' 2x2 merge), written to `path`."""
    lines = MM_WORKLOAD.read_text().splitlines()
    out = [lines[0]]
    for line in lines[1 : samples + 1]:
        text, _, tokens = line.split(",")
        toks = [-(-int(t) // scale) for t in tokens.split()]
        patches = " ".join(str(4 * t) for t in toks)
        out.append(f"{-(-int(text) // scale)},{patches},{' '.join(map(str, toks))}")
    path.write_text("\n".join(out) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = add_common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    ap.add_argument("--samples", type=int, default=2048, help="lengths of the traffic job (default 2048)")
    ap.add_argument(
        "--mm-samples", type=int, default=256, help="samples of the two-phase traffic job (default 256)"
    )
    ap.add_argument(
        "--mm-scale", type=int, default=8, help="the two-phase job's lengths divided by this (default 8)"
    )
    ap.add_argument("--budget", type=int, default=4096, help="token budget of the traffic job (default 4096)")
    args = ap.parse_args(argv)
    from _netcluster import NetCluster
    from _netfaults import (
        elastic_host_lost,
        head_lost,
        past_the_lease,
        ride_through,
        traffic,
        traffic_two_phase,
    )

    why = NetCluster.unavailable()
    if why:
        print(f"benchmarks/cluster.py: cannot build the cluster here: {why}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    data: dict = {"machine": machine("every host's processes")}
    with tempfile.TemporaryDirectory(prefix="bdbench-") as tmp:
        work = Path(tmp)
        lengths = work / "lengths.txt"
        lengths.write_text("\n".join(WORKLOAD.read_text().split()[: args.samples]) + "\n")
        spec = ["--token-budget", str(args.budget), "--seed", "5"]
        mm = scaled_workload(work / "mixed.csv", args.mm_samples, args.mm_scale)
        mm_spec = ["--token-budget", str(args.budget // args.mm_scale), "--seed", "5"]
        scenarios = {
            "traffic": lambda net, w: traffic(net, w, lengths, spec),
            "traffic_two_phase": lambda net, w: traffic_two_phase(net, w, mm, mm_spec),
            "ride_through": ride_through,
            "past_the_lease": past_the_lease,
            "head_lost": head_lost,
            "elastic": elastic_host_lost,
        }
        for name, run in scenarios.items():
            print(f"cluster: {name} ...", file=sys.stderr, flush=True)
            w = work / name
            with NetCluster(["head", "host1", "host2"], w) as net:
                got = run(net, w)
            if name == "elastic":
                seen = got.pop("trained")
                got["lost"] = got["samples"] - len(seen)
                got["duplicated"] = sum(c - 1 for c in seen.values())
            for bulky in ("logs", "log", "lines"):
                got.pop(bulky, None)
            data[name] = got
    data["wall_s"] = round(time.monotonic() - t0, 1)
    config = {
        "command": command_line("cluster.py", argv),
        "samples": args.samples,
        "mm_samples": args.mm_samples,
        "mm_scale": args.mm_scale,
        "budget": args.budget,
    }
    finish(args, SECTION, data, measures=MEASURES, config=config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
