"""Steps per second of FSDP2 and DeepSpeed ZeRO-2/3 against plain DDP on the same batchd batches.

Setup: one in-process job per strategy (`tests/_jobs.InProcessJob`: a coordinator and 2 rank services over
loopback gRPC), all with the same spec (L=`--budget`, policy balanced, padded, seed 7) over the same
synthetic lengths (lognormal, `--samples`), so every strategy trains the same steps on the same batches.
Two gloo processes (torch.multiprocessing, one thread each) train batchd's `TinyCausalLM` (d_model 128,
2 layers, seeded, float32; AdamW) through batchd's loops: `train_step` for DDP and FSDP2 (`fully_shard`
per block, then the root), `batchd_deepspeed_backward` + ``engine.step()`` for DeepSpeed (CPU accelerator,
torch optimizer, DeepSpeed's shared-memory op off, as in the tests). Each rank times its epoch from step
`--warmup` to the last; a strategy's figure is the slower rank's steps/s, and the ratio is against DDP's.

This measures the frameworks' per-step overhead on a tiny CPU model (sharding, all-gathers, reduce-scatters,
DeepSpeed's bookkeeping), not their memory savings, which are what they are for on large models.

The section also records PyTorch Lightning's loop against a plain DDP loop (lightning_overhead.py's
`measure`, once per `--lightning-hidden` size; `--lightning-hidden ""` skips it).

Result: benchmarks/results/integrations.json (template benchmarks/templates/integrations.md.j2).

Usage: python benchmarks/integrations.py [--samples 600] [--budget 512] [--warmup 3]
       [--lightning-hidden 64,256] [--lightning-samples 240] [--out PATH] [--print]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cli_runs import command, machine  # noqa: E402
from _harness import free_port  # noqa: E402
from _report import add_common_args, finish  # noqa: E402

SECTION = "integrations"
MEASURES = ["client", "batchd/_model.py"]
STRATEGIES = ("ddp", "fsdp2", "zero2", "zero3")


def _epoch(strategy: str, address: str, rank: int, warmup: int) -> tuple[int, float]:
    from batchd import TinyCausalLM
    from batchd.client import BatchClient, batchd_deepspeed_backward, train_step

    torch.manual_seed(0)
    model = TinyCausalLM(vocab_size=512, d_model=128, n_layers=2, n_heads=4)
    if strategy == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if strategy.startswith("zero"):
        import deepspeed

        engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            config={
                "train_micro_batch_size_per_gpu": 1,
                "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": int(strategy[-1])},
                "zero_allow_untested_optimizer": True,
                "steps_per_print": 10**9,
            },
        )
    steps, t0 = 0, None
    with BatchClient(address, rank, 2) as client:
        for batch, info in client:
            if strategy.startswith("zero"):
                batchd_deepspeed_backward(engine, batch, info)
                engine.step()
            else:
                train_step(model, optimizer, batch, info)
            steps += 1
            if steps == warmup:
                t0 = time.perf_counter()
    torch.distributed.barrier()
    return steps, (steps - warmup) / (time.perf_counter() - t0)


def _rank(rank: int, port: int, addresses: dict[str, list[str]], warmup: int, out: str) -> None:
    import deepspeed
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
        DS_ACCELERATOR="cpu",
    )
    torch.set_num_threads(1)
    deepspeed.ops.__compatible_ops__ = {**deepspeed.ops.__compatible_ops__, "deepspeed_shm_comm": False}
    dist.init_process_group("gloo")
    rates = {s: _epoch(s, addresses[s][rank], rank, warmup) for s in STRATEGIES}
    torch.save(rates, os.path.join(out, f"rank{rank}.pt"))
    deepspeed.comm.destroy_process_group()


def strategies(samples: int, budget: int, warmup: int) -> dict[str, Any]:
    """Each strategy's steps/s (the slower rank's) on the same batches, and its ratio to DDP's."""
    import tempfile

    import torch.multiprocessing as mp
    from _jobs import job_pool

    from batchd.core import JobSpec, PolicySpec

    rng = np.random.default_rng(3)
    lengths = np.clip(rng.lognormal(4.0, 0.7, samples), 8, budget).astype(int).tolist()
    spec = JobSpec(
        world_size=2,
        token_budget=budget,
        seed=7,
        policy=PolicySpec(name="balanced", window=64, depth=4, collate="padded"),
    )
    with job_pool(vocab_size=512) as start, tempfile.TemporaryDirectory() as out:
        jobs = {s: start(spec, lengths) for s in STRATEGIES}
        addresses = {s: [f"127.0.0.1:{port}" for port in job.ports] for s, job in jobs.items()}
        mp.spawn(_rank, args=(free_port(), addresses, warmup, out), nprocs=2, join=True)
        ranks = [torch.load(Path(out) / f"rank{r}.pt") for r in range(2)]
    steps = {s: {r[s][0] for r in ranks} for s in STRATEGIES}
    assert all(len(v) == 1 for v in steps.values()) and len({v.pop() for v in steps.values()}) == 1, steps
    rate = {s: min(r[s][1] for r in ranks) for s in STRATEGIES}
    for s in STRATEGIES:
        print(f"{s:6s} {rate[s]:7.2f} steps/s   x{rate[s] / rate['ddp']:.2f} of ddp", flush=True)
    return {
        "steps": ranks[0]["ddp"][0],
        "steps_per_s": rate,
        "vs_ddp": {s: rate[s] / rate["ddp"] for s in STRATEGIES},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=600)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lightning-hidden", default="64,256", help="Lightning model sizes ('': skip)")
    p.add_argument("--lightning-samples", type=int, default=240)
    p.add_argument("--lightning-repeat", type=int, default=2)
    add_common_args(p)
    args = p.parse_args(argv)
    data: dict[str, Any] = {
        "strategies": strategies(args.samples, args.budget, args.warmup),
        "machine": machine(),
    }
    if args.lightning_hidden:
        import lightning_overhead
        import pytorch_lightning

        data["lightning_version"] = pytorch_lightning.__version__
        data["lightning"] = [
            {
                "hidden": int(h),
                "runs": lightning_overhead.measure(args.lightning_samples, int(h), args.lightning_repeat),
            }
            for h in args.lightning_hidden.split(",")
        ]
    config = {
        "command": command("integrations.py", list(argv if argv is not None else sys.argv[1:])),
        **{k: v for k, v in vars(args).items() if k not in ("out", "print")},
    }
    finish(args, SECTION, data, measures=MEASURES, config=config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
