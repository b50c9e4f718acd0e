"""Steps per second of a PyTorch Lightning DDP loop over batchd vs a plain DDP loop on the same batches.

Two gloo CPU processes train the same tiny LlamaForCausalLM (as in tests/test_integrations.py) for one
epoch of two identical in-process jobs (same spec, same lengths, the `local` policy: the same groups),
first with a plain loop (``DistributedDataParallel`` + `batchd_loss` + SGD), then with Lightning
(``Trainer(strategy="ddp")`` + `BatchdDataModule` + `batchd_lightning_loss`). The training loop is timed
from its first to its last step (Lightning: ``on_train_start`` to ``on_train_end``, so Trainer
construction, process-group setup and teardown are left out); Lightning's whole ``fit`` is reported too.

    python benchmarks/lightning_overhead.py [--samples 240] [--hidden 64] [--repeat 2]

It prints its figures; the docs' section "integrations" records them through integrations.py (which calls
`measure` for each `--lightning-hidden` size).

Trade-off: a tiny model on CPU makes each step short, so Lightning's fixed per-step cost (hooks,
logging, progress tracking) weighs more than on a real model; the ratio is an upper bound on the overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from _harness import free_port  # noqa: E402


def tiny_llama(hidden: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
    )
    return transformers.LlamaForCausalLM(cfg).train()


def plain_epoch(address: str, rank: int, world: int, hidden: int) -> dict:
    from batchd.client import BatchClient, batchd_loss
    from batchd.testing import hf_model_inputs

    model = torch.nn.parallel.DistributedDataParallel(tiny_llama(hidden))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    steps, t0 = 0, None
    with BatchClient(address, rank, world) as client:
        for batch, info in client:
            if t0 is None:
                t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            batchd_loss(model(**hf_model_inputs(batch)), batch, info).backward()
            optimizer.step()
            steps += 1
    return {"steps": steps, "loop_s": time.perf_counter() - t0}


def lightning_epoch(address: str, rank: int, world: int, hidden: int) -> dict:
    import pytorch_lightning as pl

    from batchd.client import BatchClient, BatchdDataModule, batchd_lightning_loss

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.steps, self.t0, self.t1 = tiny_llama(hidden), 0, 0.0, 0.0

        def on_train_start(self) -> None:
            self.t0 = time.perf_counter()

        def on_train_end(self) -> None:
            self.t1 = time.perf_counter()

        def training_step(self, step, batch_idx):
            batch, info = step
            self.steps += 1
            return batchd_lightning_loss(self.model, batch, info)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    module = Lit()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp",
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    t = time.perf_counter()
    trainer.fit(module, datamodule=BatchdDataModule(lambda: BatchClient(address, rank, world)))
    return {"steps": module.steps, "loop_s": module.t1 - module.t0, "fit_s": time.perf_counter() - t}


def rank_main(
    rank: int, world: int, port: int, addresses: list[dict[str, str]], hidden: int, out: str
) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        NODE_RANK="0",
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        RANK=str(rank),
    )
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)  # Lightning reuses it
    results = []
    for a in addresses:
        plain = plain_epoch(a["plain"][rank], rank, world, hidden)
        results.append(
            {"plain": plain, "lightning": lightning_epoch(a["lightning"][rank], rank, world, hidden)}
        )
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    os._exit(0)  # skip the slow interpreter shutdown of gloo / gRPC threads


def measure(samples: int, hidden: int, repeat: int) -> list[dict[str, Any]]:
    """`repeat` runs of one epoch each, plain DDP then Lightning DDP on the same batches: per run the
    steps, both loops' steps/s (the slower rank's), their ratio and Lightning's whole `fit` time."""
    import torch.multiprocessing as mp
    from _jobs import job_pool

    from batchd.core import JobSpec, PolicySpec

    rng = np.random.default_rng(3)
    lengths = np.clip(rng.lognormal(3.3, 0.6, samples), 3, 120).astype(int).tolist()
    spec = JobSpec(
        world_size=2,
        token_budget=256,
        seed=7,
        policy=PolicySpec(name="local", window=16, depth=3, collate="padded"),
    )
    with job_pool(vocab_size=512) as make, tempfile.TemporaryDirectory() as out:
        jobs = [{kind: make(spec, lengths) for kind in ("plain", "lightning")} for _ in range(repeat)]
        addresses = [
            {kind: [job.rank_address(r) for r in range(2)] for kind, job in run.items()} for run in jobs
        ]
        mp.spawn(rank_main, args=(2, free_port(), addresses, hidden, out), nprocs=2, join=True)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    runs = []
    for r0, r1 in zip(*ranks, strict=True):
        steps = {r[k]["steps"] for r in (r0, r1) for k in ("plain", "lightning")}
        assert len(steps) == 1, steps
        plain = r0["plain"]["steps"] / max(r["plain"]["loop_s"] for r in (r0, r1))
        lit = r0["lightning"]["steps"] / max(r["lightning"]["loop_s"] for r in (r0, r1))
        runs.append(
            {
                "steps": r0["plain"]["steps"],
                "plain_steps_per_s": plain,
                "lightning_steps_per_s": lit,
                "ratio": lit / plain,
                "fit_s": max(r["lightning"]["fit_s"] for r in (r0, r1)),
                "loop_s": max(r["lightning"]["loop_s"] for r in (r0, r1)),
            }
        )
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=240)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args(argv)
    for i, run in enumerate(measure(args.samples, args.hidden, args.repeat)):
        print(
            f"run {i}: {run['steps']} steps; plain DDP {run['plain_steps_per_s']:.1f} steps/s, Lightning DDP "
            f"{run['lightning_steps_per_s']:.1f} steps/s (ratio {run['ratio']:.3f}); Lightning fit() "
            f"{run['fit_s']:.1f} s vs its loop {run['loop_s']:.1f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
