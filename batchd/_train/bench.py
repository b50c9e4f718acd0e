"""One rank of `batchd bench` (`python -m batchd._train.bench --config FILE`): epochs of the same model on
the same samples, fed by one of four systems.

Systems (the `system` key of the config):

- `fixed`: the rank's sampler view (the same seeded permutation split as batchd's views, ids r, r+N, ...,
  no padding by repetition) cut into fixed batches of B samples, padded; plain per-rank per-token mean
  loss, DDP averages. B is the out-of-memory-safe choice floor(L_max / longest sample).
- `odb-0.1.2`: the seed's own package, run the way its README says: a map-style torch `Dataset` that
  returns exactly the samples batchd's `SyntheticSource` produces for these ids, a multi-worker
  `DataLoader(batch_size=1)` over the rank's view (one loader, re-iterated every epoch after the view
  sampler's `set_epoch`, as ODB expects: it names each iteration's gloo group after an iteration
  count), `odb.apply(loader, token_budget=L, loss_scaling="exact", join=True, buffer_size=window)`,
  the user collate (`collate_padded`, the layout batchd's padded path
  uses), `odb.pop_step_info` + `loss * info.loss_scale`, and the DDP model under torch's `Join` context
  (ODB's join mode lets ranks end on different step counts; its README pairs it with DDP Join).
- `batchd` (policies `odb` / `balanced`, chosen by the rank services): a `BatchClient` against this
  rank's service; loss x `StepInfo.loss_scale`; IDLE steps run a zero-weight forward/backward.

Clock (identical for every system): after process-group init and model build, the rank creates its
data iterator and fetches its first batch (ODB: DataLoader workers, its collate process, its startup
jitter and first grouping round; batchd: connect and first round; fixed: materialize), then all ranks
meet in a barrier; `t0` is taken right after it. Every step records its end time; the rank's wall time
is its last step's end - t0, and the epoch's is the largest over ranks (`time.monotonic`, one clock for
all processes on the machine). The start-up before `t0` is reported separately (`startup_s`), and
`cpu_s` is this trainer process's CPU time over the timed epoch (less sensitive to other load on the
machine than wall time; the data-side processes are not in it).

No collective is added to the timed loop: each step records this rank's loss sum, loss tokens, sample
ids, real and materialized tokens; the parent combines step k across ranks into the global per-token
loss (the k-th backward of every rank is the same DDP all-reduce). After every epoch, rank 0 evaluates
the model on a held-out set of samples (ids beyond the training set) with the clock paused. Epoch e
uses every system's view of epoch e (the same seeded permutation batchd's sources use); batchd's rank
services keep preparing the next epoch during that pause, as they would during a real evaluation.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from batchd.client import (
    collate_padded,
    forward_logits,
    idle_batch,
    loss_tokens,
    scale_gradients,
    scaled_loss_and_mean,
    token_loss_sum,
)
from batchd.launch import StepTicker

from .bench_data import Window, iter_batchd, iter_fixed, iter_odb, payload, slowed
from .models import HF_MODELS, VisionTimer, build_model, hf_pixels, vision_module

ITERS = {"fixed": iter_fixed, "odb-0.1.2": iter_odb}


def _device_batch(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
    }


class _Recorder:
    """Per-step records of one rank (no collectives)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def add(
        self,
        ids: list[int],
        batch: dict[str, Any] | None,
        logits: torch.Tensor | None,
        t0: float,
        wait_s: float,
    ) -> None:
        if batch is None:
            rec = {"ids": [], "real": 0, "materialized": 0, "loss_sum": 0.0, "loss_tokens": 0}
        else:
            mask = batch.get("attention_mask")  # a packed row has none: every position is real
            real = int(mask.sum()) if mask is not None else int(batch["input_ids"].numel())
            with torch.no_grad():
                s, n = token_loss_sum(logits.detach(), batch["labels"])
            rec = {
                "ids": ids,
                "real": real if ids else 0,
                "materialized": int(batch["input_ids"].numel()),
                "loss_sum": float(s),
                "loss_tokens": int(n),
            }
            pixels, frames = batch.get("pixel_values"), batch.get("audio_features")
            rec["patches"] = int(pixels.shape[0]) if pixels is not None else 0  # the encoder's load
            rec["frames"] = int(frames.shape[0]) if frames is not None else 0
        rec["t"] = time.monotonic() - t0
        rec["wait_s"] = wait_s
        self.steps.append(rec)


def step_lr(base_lr: float, global_tokens: int, ref_tokens: int | None, power: float = 0.5) -> float:
    """The square-root scaling rule for adaptive optimizers, the same for every system: a step that
    trains on `global_tokens` real tokens (all ranks) uses `base_lr * sqrt(global_tokens / ref_tokens)`
    (`power` 1.0: the linear rule).
    `ref_tokens` is fixed batching's mean tokens per step, so fixed batching keeps `base_lr` on average
    while token-budget batchers, whose steps carry several times more tokens, take proportionally
    larger (sqrt) steps instead of fewer steps of the same size. None: constant `base_lr`."""
    if not ref_tokens or global_tokens <= 0:
        return base_lr
    return base_lr * (global_tokens / ref_tokens) ** power


def _backward(
    ddp: torch.nn.Module, batch: dict[str, Any], scale: float | None, tokens: int, sync: bool
) -> torch.Tensor:
    """Forward, loss (x scale; None: plain per-token mean) and backward; `sync` False skips DDP's
    all-reduce (``no_sync``: a micro-step inside an optimizer update, its gradient kept locally)."""
    with nullcontext() if sync else ddp.no_sync():
        logits = forward_logits(ddp, batch)
        if scale is None:
            s, n = token_loss_sum(logits, batch["labels"])
            loss = s / n if n else logits.sum() * 0.0
        else:
            loss = scaled_loss_and_mean(logits, batch["labels"], scale, tokens)[0]
        loss.backward()
    return logits


def _update(ddp: torch.nn.Module, opt: torch.optim.Optimizer, lr: float, grad_scale: float) -> None:
    """The optimizer step at `lr`, after scaling the accumulated gradient by `grad_scale`."""
    scale_gradients(ddp, grad_scale)
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()


def evaluate(model: torch.nn.Module, cfg: dict[str, Any], device: torch.device) -> dict[str, Any] | None:
    """Per-token loss of `model` on the held-out samples (padded batches under the token budget)."""
    ids = cfg.get("heldout_ids") or []
    if not ids:
        return None
    lengths, seed, token_budget = cfg["all_lengths"], cfg["seed"], cfg["token_budget"]
    order = sorted(ids, key=lambda i: lengths[i])
    total, count, group = 0.0, 0, []
    model.eval()
    with torch.no_grad():

        def flush(g):
            nonlocal total, count
            batch = _device_batch(
                collate_padded([payload(i, lengths, seed, cfg.get("images"), cfg.get("audio")) for i in g]),
                device,
            )
            if cfg.get("model") in HF_MODELS:
                batch = hf_pixels(batch)
            s, n = token_loss_sum(forward_logits(model, batch).float(), batch["labels"])
            total += float(s)
            count += n

        for i in order:
            if group and (len(group) + 1) * lengths[i] > token_budget:
                flush(group)
                group = []
            group.append(i)
        if group:
            flush(group)
    model.train()
    return {"samples": len(ids), "tokens": count, "loss": total / count if count else float("nan")}


class _BenchRank:
    """One rank's model, optimizer, update window and records over its epochs (`run`)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg, self.rank, self.system = cfg, cfg["rank"], cfg["system"]
        if self.system not in ITERS and not self.system.startswith("batchd"):
            raise ValueError(
                f"unknown system, expected fixed, odb-0.1.2 or batchd-*, got system={self.system!r}"
            )
        torch.set_num_threads(cfg.get("threads", 1))
        self.cuda = cfg.get("device", "cpu") == "cuda"
        index = self.rank % max(torch.cuda.device_count(), 1)
        self.device = torch.device("cuda", index) if self.cuda else torch.device("cpu")
        if self.cuda:
            torch.cuda.set_device(self.device)
        self.t_proc = time.monotonic()
        dist.init_process_group(
            "nccl" if self.cuda else "gloo",
            init_method=f"tcp://127.0.0.1:{cfg['master_port']}",
            rank=self.rank,
            world_size=cfg["world_size"],
            timeout=timedelta(seconds=cfg.get("gloo_timeout_s", 600)),
        )
        images, audio = bool(cfg.get("images")), bool(cfg.get("audio"))
        model = build_model(cfg["model"], cfg["seed"], max(cfg["all_lengths"]) + 1, images, audio).to(
            self.device
        )
        self.hf = cfg["model"] in HF_MODELS
        tower = vision_module(model)
        self.timers = {
            "vision_s": VisionTimer(tower) if tower is not None and images else None,
            "audio_s": VisionTimer(model.audio)
            if audio and getattr(model, "audio", None) is not None
            else None,
            # the rank's own forward + backward, for the cost check (`batchd.core.cost_check`)
            "compute_s": VisionTimer(model, sync=self.cuda),
        }
        if self.cuda:
            model = model.to(torch.bfloat16)
        self.model = model
        self.ddp = DDP(model, device_ids=[self.device.index] if self.cuda else None)
        self.base_lr, self.ref_tokens = cfg.get("lr", 1e-3), cfg.get("lr_ref_tokens")
        self.opt = torch.optim.AdamW(model.parameters(), lr=self.base_lr)
        self.holder: dict[str, Any] = {"window": Window(cfg.get("accumulate", 1))}
        if self.system == "fixed" and cfg.get("accumulate", 1) > 1:  # fixed knows every rank's batches
            self.holder["loss_tokens"] = {
                i: loss_tokens(
                    payload(i, cfg["lengths"], cfg["seed"], cfg.get("images"), cfg.get("audio"))["labels"]
                )
                for i in range(cfg["num_samples"])
            }
        self.window, self.update_tokens, self.lr = self.holder["window"], 0, self.base_lr
        self.updates: list[int] = []  # per optimizer update: its global real tokens
        self.rec = _Recorder()
        self.ticker = StepTicker(
            cfg["out"]
        )  # `batchd bench`'s progress: this rank's samples and steps so far
        # ODB's join mode and a fixed view that does not split evenly end ranks on different step counts:
        # torch's Join shadows the finished rank's all-reduces (ODB's README pairs join=True with it), one
        # Join per epoch so that the per-epoch evaluation's barriers meet.
        self.uneven = self.system == "odb-0.1.2" or (
            self.system == "fixed" and cfg["num_samples"] % (cfg["world_size"] * cfg["batch_size"])
        )
        self.t0 = 0.0

    def batches(self, epoch: int):
        """The system's batches of `epoch`, each after `step_time` (a stand-in for a real model's step)."""
        epoch_batches = ITERS.get(self.system, iter_batchd)
        return slowed(epoch_batches(self.cfg, self.holder, epoch), float(self.cfg.get("step_time", 0.0)))

    def step(self, item: tuple[Any, ...], epoch: int, wait_s: float) -> None:
        """One step: its forward / backward (a zero-weight one for a batchd IDLE step, which keeps DDP
        aligned), the update when it ends one, and its record."""
        ids, batch, scale, tokens = item
        window, holder = self.window, self.holder
        if window.start:
            self.opt.zero_grad(set_to_none=True)
            self.update_tokens = 0
        self.update_tokens += holder.get("global_tokens", 0)
        self.lr = step_lr(self.base_lr, self.update_tokens, self.ref_tokens, self.cfg.get("lr_power", 0.5))
        # ODB: every micro-step all-reduces (no no_sync beside its Join); the others only at an update's
        # last step
        sync = window.end or self.system == "odb-0.1.2"
        if batch is None:
            _backward(self.ddp, _device_batch(idle_batch(), self.device), 0.0, 0, sync)
            self.rec.add([], None, None, self.t0, wait_s)
        else:
            batch = _device_batch(batch, self.device)
            if self.hf:
                batch = hf_pixels(batch)
            self._timing(True)
            logits = _backward(self.ddp, batch, scale, tokens, sync)
            self._timing(False)
            self.rec.add(ids, batch, logits, self.t0, wait_s)
            for key, timer in self.timers.items():
                if timer is not None:
                    self.rec.steps[-1][key] = timer.take()
            # planned cost: the batchd plan's; fixed and ODB plan nothing: their padded rows x longest
            planned = self.holder.pop("cost", None)
            self.rec.steps[-1]["cost"] = (
                planned if planned is not None else self.rec.steps[-1]["materialized"]
            )
        if window.end:
            self._update(window.end_scale)
            self.rec.steps[-1]["update_end"] = True
        self.ticker.tick(len(ids))
        last = self.rec.steps[-1]
        last["lr"], last["global_tokens"], last["epoch"] = self.lr, holder.get("global_tokens", 0), epoch

    def _timing(self, on: bool) -> None:
        for timer in self.timers.values():
            if timer is not None:
                timer.on = on

    def _update(self, grad_scale: float) -> None:
        _update(self.ddp, self.opt, self.lr, grad_scale)
        self.updates.append(self.update_tokens)
        self.rec.steps[-1]["t"] = time.monotonic() - self.t0  # the step ends with its update

    def epoch(self, batches, first: Any, epoch: int) -> None:
        """Trains `epoch` from its `first` item on; closes the update ODB's epoch left open."""
        with torch.distributed.algorithms.Join([self.ddp]) if self.uneven else nullcontext():
            item = first
            while item is not None:
                self.step(item, epoch, 0.0 if item is first and not epoch else self.holder.get("wait", 0.0))
                t_wait = time.monotonic()
                item = next(batches, None)
                self.holder["wait"] = time.monotonic() - t_wait
            if not self.window.end:  # ODB with accumulation: the epoch left an update open
                self._update(self.window.close_open())
        if self.cuda:
            torch.cuda.synchronize()

    def evaluate(self, epoch: int) -> dict[str, Any]:
        """The held-out loss after `epoch` (rank 0), outside the clock: every rank's t0 moves by the same
        span, from the moment all ranks finished the epoch to the end of the evaluation."""
        dist.barrier()
        t_pause = time.monotonic()
        ev = evaluate(self.ddp.module, self.cfg, self.device) if self.rank == 0 else None
        dist.barrier()
        entry = {"epoch": epoch, "t": t_pause - self.t0, "eval": ev}
        self.t0 += time.monotonic() - t_pause
        return entry

    def close(self) -> None:
        if "close" in self.holder:
            self.holder["close"]()
        if "client" in self.holder:
            self.holder["client"].close()
        dist.destroy_process_group()


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """Trains `cfg["epochs"]` epochs on this rank (module docstring); writes and returns the result."""
    me = _BenchRank(cfg)
    try:
        batches = me.batches(0)
        first = next(batches, None)  # start-up: the pipeline's first batch, outside the clock
        dist.barrier()
        me.t0 = time.monotonic()
        cpu0 = time.process_time()
        startup_s = me.t0 - me.t_proc
        evals: list[dict[str, Any]] = []
        for epoch in range(cfg.get("epochs", 1)):
            if epoch:
                batches = me.batches(epoch)
                t_wait = time.monotonic()
                first = next(batches, None)
                me.holder["wait"] = time.monotonic() - t_wait
            me.epoch(batches, first, epoch)
            evals.append(me.evaluate(epoch))
        me.ticker.write()
        result = {
            "rank": me.rank,
            "system": me.system,
            "wall_s": me.rec.steps[-1]["t"] if me.rec.steps else 0.0,
            "startup_s": startup_s,
            "cpu_s": time.process_time() - cpu0,
            "steps": me.rec.steps,
            "eval": evals[-1]["eval"] if evals else None,
            "epoch_evals": evals,
            "params": me.model.num_parameters(),
            "updates": me.updates,
        }
        Path(cfg["out"]).write_text(json.dumps(result))
        return result
    finally:
        me.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="batchd bench trainer (one rank; started by `batchd bench`)")
    p.add_argument("--config", required=True, help="JSON file with the rank's configuration")
    args = p.parse_args(argv)
    cfg = json.loads(Path(args.config).read_text())
    run(cfg)


if __name__ == "__main__":
    main()
