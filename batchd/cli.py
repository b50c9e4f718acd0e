"""The `batchd` command line: simulate, coordinator, rank, demo."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from batchd.core import COST_MODELS, MODES, OVER_BUDGET, POLICIES, SimConfig, read_lengths, simulate


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="run N virtual ranks and the coordinator over a length file (the daemon's core code)",
        description="Simulates one epoch of batchd over realized lengths (one integer per line; the sample "
        "id is the 0-based line number) and prints the batching metrics.",
    )
    p.add_argument("--lengths", required=True, metavar="FILE", help="one integer length per line")
    p.add_argument("--world-size", type=_positive, required=True, metavar="N", help="number of ranks")
    p.add_argument("--token-budget", type=_positive, required=True, metavar="L", help="L_max per rank step")
    p.add_argument("--policy", choices=POLICIES, default="local", help="grouping policy (default: local)")
    p.add_argument("--window", type=_positive, default=512, metavar="W", help="per-rank buffer in samples")
    p.add_argument("--batch-size", type=_positive, default=8, metavar="B", help="B of fixed/sorted")
    p.add_argument("--mode", choices=MODES, default="join", help="termination mode (default: join)")
    p.add_argument("--cost", choices=COST_MODELS, default="padded", help="cost model (default: padded)")
    p.add_argument("--over-budget", choices=OVER_BUDGET, default="singleton",
                   help="samples longer than L (default: singleton)")
    p.add_argument("--seed", type=int, default=0, help="seeds views and emission order")
    p.add_argument("--shuffle", action="store_true", help="permute ids before splitting them over ranks")
    p.add_argument("--depth", type=_positive, default=8, metavar="D",
                   help="output slots per rank (alignment capacity)")
    p.add_argument("--max-wait", type=_positive, default=16, help="rounds a sample may wait in a window")
    p.add_argument("--align", choices=("min", "odb"), default="min",
                   help="DGAP target rule (policy odb always uses odb)")
    p.add_argument("--quota", type=int, default=None, help="non-join sample quota (default: all samples)")
    p.add_argument("--no-refine", action="store_true", help="balanced: skip the capacity binary search")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_simulate)


def _simulate(args: argparse.Namespace) -> int:
    lengths = read_lengths(args.lengths)
    config = SimConfig(
        world_size=args.world_size, token_budget=args.token_budget, policy=args.policy, window=args.window,
        batch_size=args.batch_size, mode=args.mode, cost=args.cost, over_budget=args.over_budget,
        seed=args.seed, shuffle=args.shuffle, depth=args.depth, max_wait=args.max_wait, align=args.align,
        refine=not args.no_refine, quota=args.quota,
    )
    result = simulate(lengths, config)
    if args.json:
        print(json.dumps(result))
    else:
        width = max(len(k) for k in result)
        for key, value in result.items():
            if isinstance(value, float):
                value = f"{value:.4f}"
            print(f"{key:<{width}}  {value}")
    return 0


def _add_spec(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("job spec (identical on the coordinator and every rank)")
    g.add_argument("--world-size", type=_positive, required=True, metavar="N", help="number of ranks")
    g.add_argument("--token-budget", type=_positive, required=True, metavar="L", help="L_max per rank step")
    g.add_argument("--policy", choices=POLICIES, default="local", help="grouping policy (default: local)")
    g.add_argument("--window", type=_positive, default=512, metavar="W", help="per-rank buffer in samples")
    g.add_argument("--depth", type=_positive, default=8, metavar="D", help="batches a rank keeps ready")
    g.add_argument("--batch-size", type=_positive, default=8, metavar="B", help="B of fixed/sorted")
    g.add_argument("--mode", choices=MODES, default="join", help="termination mode (default: join)")
    g.add_argument("--quota", type=int, default=None, help="non-join sample quota (required in non-join)")
    g.add_argument("--cost", choices=COST_MODELS, default="padded", help="cost model (default: padded)")
    g.add_argument("--over-budget", choices=OVER_BUDGET, default="singleton", help="samples longer than L")
    g.add_argument("--collate", choices=("padded", "packed"), default="padded", help="batch layout")
    g.add_argument("--seed", type=int, default=0, help="seeds sampler views and emission order")
    g.add_argument("--no-shuffle", action="store_true", help="rank r owns ids r, r+N, ... in file order")


def _spec(args: argparse.Namespace):
    from batchd.service import JobSpec

    return JobSpec(world_size=args.world_size, token_budget=args.token_budget, policy=args.policy,
                   window=args.window, batch_size=args.batch_size, mode=args.mode, cost=args.cost,
                   over_budget=args.over_budget, seed=args.seed, shuffle=not args.no_shuffle, depth=args.depth,
                   quota=args.quota, collate=args.collate)


def _add_server(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=0, help="port (0 picks a free one)")
    p.add_argument("--port-file", default=None, help="write the bound port here as JSON")
    p.add_argument("--log-level", default="INFO", help="logging level")


def _logging(args: argparse.Namespace) -> None:
    import logging

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")


def _coordinator(args: argparse.Namespace) -> int:
    from batchd.service import run_coordinator

    _logging(args)
    return run_coordinator(_spec(args), args.host, args.port, args.port_file, args.lease, args.round_timeout)


def _rank(args: argparse.Namespace) -> int:
    from batchd.service import run_rank

    _logging(args)
    lengths = read_lengths(args.lengths) if args.lengths else None
    return run_rank(_spec(args), args.rank, args.coordinator, lengths, args.host, args.port, args.port_file,
                    args.state_dir, args.client_grace, dataset=args.dataset, tokenizer=args.tokenizer,
                    num_actors=args.num_actors, ray_address=args.ray_address, quarantine=args.quarantine,
                    stats_file=args.stats_file)


def _demo(args: argparse.Namespace) -> int:
    from batchd.demo import run_demo

    progress = None if args.json else (lambda msg: print(f"[batchd demo] {msg}", file=sys.stderr, flush=True))
    summary = run_demo(args.world_size, args.num_samples, args.token_budget, args.policy, args.window, args.depth,
                       args.seed, baseline=not args.no_baseline, progress=progress, synthetic=args.synthetic,
                       dataset=args.dataset, num_actors=args.num_actors, ray_address=args.ray_address,
                       tokenizer=args.tokenizer)
    pre = summary.get("preprocess")
    ok = pre is None or pre["accounting_ok"]
    if not ok:
        print(f"batchd demo: error: emitted + quarantined != records read: {pre}", file=sys.stderr)
    if args.json:
        print(json.dumps(summary))
        return 0 if ok else 1
    print(f"steps per rank      {summary['steps_per_rank']}  (idle rank-steps: {summary['idle']})")
    print(f"samples             {summary['emitted']} emitted, {summary['missing']} missing, "
          f"{summary['duplicates']} duplicated")
    print(f"padding efficiency  {summary['padding_efficiency']:.3f}")
    print(f"loss                {summary['loss_first']:.3f} -> {summary['loss_last']:.3f}")
    print(f"epoch wall time     {summary['wall_s']:.2f}s")
    if pre is not None:
        print(f"preprocessing       {pre['actors']} Ray actors: {pre['samples']} samples + {pre['quarantined']} "
              f"quarantined = {pre['records_read']} of {pre['records']} records read; "
              f"{pre['samples_per_s']:.0f} samples/s; trainers waited for data "
              f"{100 * pre['stall_fraction']:.1f}% of their time (slowest rank)")
    if "baseline" in summary:
        b = summary["baseline"]
        print(f"fixed batching      {b['wall_s']:.2f}s, {b['steps']} steps of {b['batch_size']}, padding "
              f"efficiency {b['padding_efficiency']:.3f}")
        print(f"speedup             {summary['speedup']:.2f}x")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchd", description="batchd: token-budget batching as a service.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_simulate(sub)

    p = sub.add_parser("coordinator", help="run the gRPC alignment coordinator",
                       description="Runs the DGAP alignment coordinator for one job until the epoch ends.")
    _add_spec(p)
    _add_server(p)
    p.add_argument("--lease", type=float, default=30.0, help="seconds a rank may stay silent")
    p.add_argument("--round-timeout", type=float, default=120.0, help="seconds a round barrier waits")
    p.set_defaults(func=_coordinator)

    p = sub.add_parser("rank", help="run one rank's batching service",
                       description="Runs the batching service of one trainer rank.")
    _add_spec(p)
    _add_server(p)
    p.add_argument("--rank", type=int, required=True, help="this service's rank")
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT", help="the coordinator's address")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--lengths", default=None, metavar="FILE",
                     help="serve a synthetic tokenized dataset with these realized lengths")
    src.add_argument("--dataset", default=None, metavar="PATH",
                     help="preprocess these records (Parquet/JSONL/Arrow) with a Ray actor pool "
                     "(neither --lengths nor --dataset: producers push samples through Ingest)")
    g = p.add_argument_group("preprocessing (with --dataset)")
    g.add_argument("--tokenizer", default=None, metavar="FILE",
                   help="tokenizer.json (default: the demo tokenizer, trained locally on first use)")
    g.add_argument("--num-actors", type=_positive, default=2, metavar="K", help="this rank's actors (default 2)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (default: start a local Ray)")
    g.add_argument("--quarantine", default=None, metavar="FILE", help="append bad records here (JSONL)")
    g.add_argument("--stats-file", default=None, metavar="FILE",
                   help="write the source's counters here as JSON on exit")
    p.add_argument("--state-dir", default=None, help="journal here after every round (restartable)")
    p.add_argument("--client-grace", type=float, default=30.0,
                   help="seconds a disconnected trainer has to come back")
    p.set_defaults(func=_rank)

    p = sub.add_parser("demo", help="run the main job end to end on this machine",
                       description="Starts a local Ray, a coordinator, N rank services (each preprocessing its "
                       "view of the dataset with Ray actors: chat template, tokenizer, Qwen2-VL visual tokens) "
                       "and N gloo DDP trainers, trains a tiny causal LM for one epoch through batchd, then "
                       "with fixed batching on the same preprocessed samples, and compares. Default data: a "
                       "generated demo dataset (conversations, images and a few bad records).")
    p.add_argument("--world-size", type=_positive, default=2, metavar="N", help="trainer ranks (default 2)")
    p.add_argument("--num-samples", type=_positive, default=1024, metavar="M",
                   help="records of the generated dataset, or synthetic samples (default 1024)")
    p.add_argument("--token-budget", type=_positive, default=1024, metavar="L", help="L_max (default 1024)")
    p.add_argument("--policy", choices=POLICIES, default="balanced", help="grouping policy (default balanced)")
    p.add_argument("--window", type=_positive, default=128, help="per-rank window (default 128)")
    p.add_argument("--depth", type=_positive, default=4, help="batches kept ready per rank (default 4)")
    p.add_argument("--seed", type=int, default=0, help="data and sampling seed")
    p.add_argument("--no-baseline", action="store_true", help="skip the fixed-batching comparison run")
    data = p.add_mutually_exclusive_group()
    data.add_argument("--dataset", default=None, metavar="PATH",
                      help="your records (Parquet/JSONL/Arrow IPC) instead of the generated demo dataset")
    data.add_argument("--synthetic", action="store_true",
                      help="no Ray: synthetic tokenized samples with long-tail lengths (`batchd rank --lengths`)")
    p.add_argument("--num-actors", type=_positive, default=2, metavar="K",
                   help="preprocessing actors in all, spread over the rank services (default 2)")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (default: start one local Ray that every rank service joins)")
    p.add_argument("--tokenizer", default=None, metavar="FILE", help="tokenizer.json (default: the demo's)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"batchd {args.command}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, RuntimeError, TimeoutError) as exc:
        print(f"batchd {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
