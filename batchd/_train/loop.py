"""The reference trainer's batchd loop (`python -m batchd.train`): epochs of (batch, StepInfo) from its
`BatchClient` through `train_step`, its checkpoints at an update's end, its test hooks, and its summary."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from batchd.client import BatchdError, JobFailed, weighted_steps
from batchd.core import cost_check
from batchd.proto import Progress

from .checkpoint import save_checkpoint
from .failure import FailureWatch, exit_stuck, raise_job_failure
from .models import VisionTimer, patches
from .strategy import all_reduce_released


def _maybe_crash(spec: str | None, rank: int, steps: int) -> None:
    """`--crash-at`: dies like an OOM kill would, without a word, when this run reached its step."""
    if not spec:
        return
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    for item in spec.split(","):
        r, k, *who = (int(x) for x in item.split(":"))
        if r == restart and k == steps and (not who or who[0] == rank):
            os._exit(1)


def _log_step(fd: int | None, epoch: int, info: Any, ids: list[int], patches: int) -> None:
    if fd is not None:  # one write per line: a kill leaves whole lines
        line = {"epoch": epoch, "step": info.step, "ids": ids, "patches": patches, "t": round(time.time(), 3)}
        line |= {
            "cost": info.cost,
            "token_budget": info.token_budget,
            "world": dist.get_world_size(),
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        }
        os.write(fd, (json.dumps(line) + "\n").encode())
        os.fsync(fd)


class VocabularyError(ValueError):
    """A batch holds token ids the model's embedding has no row for: the trainer's vocabulary is not the
    rank services' tokenizer's."""


def _check_vocabulary(batch: dict[str, Any], vocab: int | None, args: argparse.Namespace) -> None:
    ids = batch.get("input_ids")
    if vocab is None or ids is None or ids.numel() == 0:
        return
    top = int(ids.max())
    if top >= vocab:
        if args.hf_model is not None:
            raise VocabularyError(
                f"token id {top} is past the vocabulary of --hf-model {args.hf_model} ({vocab} ids): "
                "the rank services' processor ([pipeline] processor) must be this model's"
            )
        given = f"--tokenizer {args.tokenizer}" if args.tokenizer else "no --tokenizer"
        raise VocabularyError(
            f"token id {top} is past the model's vocabulary of {vocab} ({given}): give --tokenizer the "
            "rank services' tokenizer (`batchd tokenizer tok.json` writes the default one) or a larger "
            "--vocab-size"
        )


def _vocabulary(model: torch.nn.Module) -> int | None:
    """Rows of the model's token embedding: `vocab_size` of the tiny LM, the input embedding's of an
    HF model."""
    if hasattr(model, "vocab_size") and isinstance(model.vocab_size, int):
        return model.vocab_size
    embeddings = getattr(model, "get_input_embeddings", None)
    return embeddings().num_embeddings if embeddings is not None else None


def _vision_imbalance(patches: list[int], device: torch.device) -> float | None:
    """The mean over steps with images of max / mean rank patches, over every rank's `patches` (one entry
    per step of this run; collectives: every rank calls it). Two all-reduces (max, sum) of one number per
    step, so each rank holds one vector, not every rank's. None without images, or when the ranks ran
    different numbers of steps (a resumed run whose ranks restarted at different points).

    These are the run's last collectives, on tensors made here: each returns only once the backend let go
    of its tensor (`all_reduce_released`), so no gloo worker still holds one when the process group is
    destroyed (joining the worker while holding the GIL it needs: a hang) or the interpreter finalizes (an
    abort)."""
    world = dist.get_world_size()

    n = torch.tensor([len(patches), -len(patches)], dtype=torch.int64, device=device)
    all_reduce_released(n, dist.ReduceOp.MAX)  # the longest run, and minus the shortest
    longest, shortest = int(n[0]), -int(n[1])
    high = torch.zeros(longest, dtype=torch.int64, device=device)
    high[: len(patches)] = torch.tensor(patches, dtype=torch.int64)
    total = high.clone()
    all_reduce_released(high, dist.ReduceOp.MAX)
    all_reduce_released(total, dist.ReduceOp.SUM)
    if longest != shortest:
        return None
    ratios = [
        h * world / t for h, t in zip(high.tolist(), total.tolist(), strict=False) if t > 0
    ]  # = batchd.core.imbalance
    return sum(ratios) / len(ratios) if ratios else None


class _Loop:
    """One rank's epochs (`train_loop`): its counts, the encoder loads and the last loss."""

    def __init__(self, client: Any, ddp: Any, opt: Any, args: argparse.Namespace, ckpt: Any) -> None:
        self.client, self.ddp, self.opt, self.args, self.ckpt = client, ddp, opt, args, ckpt
        self.rank = client.rank
        self.steps = self.idle = self.exchange_steps = 0  # exchange: steps that carried a vision exchange
        self.rows_to: list[int] = []  # encoder output rows this rank sent to each rank in the exchanges
        self.due = False  # a checkpoint is due at the next update's end
        self.epoch_steps: list[int] = []
        self.loads: list[int] = []  # per step of this run: the encoder's load on this rank
        self.loss = float("nan")
        self.budget = 0  # the token budget of the last step trained
        self.module = getattr(
            ddp, "module", ddp
        )  # DDP's and DeepSpeed's wrapped model; FSDP2 shards in place
        self.vocab = _vocabulary(self.module)
        self.watch = FailureWatch(client, on_stuck=exit_stuck(self.rank))
        # the cost check: each step's planned cost and this rank's own compute (forward + backward)
        self.costs: list[float] = []
        self.compute: list[float] = []
        self.timer = None
        if args.strategy == "ddp":  # FSDP2 / DeepSpeed gather parameters inside the backward: not timed
            cuda = next(self.module.parameters()).device.type == "cuda"
            self.timer = VisionTimer(self.module, sync=cuda)
            self.timer.on = True
        self.ids_log = (
            os.open(args.ids_log.format(rank=self.rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            if args.ids_log
            else None
        )

    def epoch(self, epoch: int, epochs: int, total: int | None, train_step: Any) -> None:
        client, args = self.client, self.args
        client.set_epoch(epoch)  # the checkpoint's epoch keeps its position
        n = 0
        # closed only after a failure was asked about (see demo._run_batchd); DeepSpeed cannot
        # rescale a gradient after the backward: it reads each update ahead, weighed over it
        batches = weighted_steps(client) if args.strategy == "deepspeed" else iter(client)
        bar = Progress(f"rank 0: epoch {epoch + 1}/{epochs}", total, "samples", enabled=self.rank == 0)
        try:
            for batch, info in batches:
                bar.update(info.global_samples, steps=1)
                self.step(batch, info, epoch, train_step)
                n += 1
        except VocabularyError:
            raise
        except BatchdError as exc:  # the client's own diagnosis (JobFailed, or its service unreachable)
            if not isinstance(exc, JobFailed) and self.watch.failure:  # the service failed the job first
                raise JobFailed(f"{self.watch.failure} (this trainer saw: {exc})") from exc
            raise
        except Exception as exc:  # a collective broke because a peer died: ask the rank service which
            raise_job_failure(client, self.watch, exc)
            raise
        finally:
            bar.close()
            batches.close()
        self.epoch_steps.append(n)

    def step(self, batch: dict[str, Any], info: Any, epoch: int, train_step: Any) -> None:
        args = self.args
        ids = batch.pop("sample_ids", None)
        self.loads.append(patches(batch))
        self.exchange_steps += int("vision_send_splits" in batch)
        if batch.get("vision_send_splits") is not None:
            sent = [int(v) for v in batch["vision_send_splits"].tolist()]
            self.rows_to += [0] * (len(sent) - len(self.rows_to))
            for r, rows in enumerate(sent):
                self.rows_to[r] += rows
        _log_step(self.ids_log, epoch, info, ids.tolist() if ids is not None else [], self.loads[-1])
        _maybe_crash(args.crash_at, self.rank, self.steps + 1)
        if args.step_time > 0:
            time.sleep(args.step_time)
        _check_vocabulary(batch, self.vocab, args)
        try:
            if args.inject_oom_above is not None and info.cost > args.inject_oom_above:
                what = f"planned cost {info.cost:g} > {args.inject_oom_above:g}"
                raise torch.OutOfMemoryError(f"injected (--inject-oom-above): {what}")
            self.loss = train_step(self.ddp, self.opt, batch, info)
        except torch.OutOfMemoryError as exc:  # the job lowers its budget and restarts (`report_oom`)
            raise self.client.report_oom(info, exc) from exc
        self.budget = info.token_budget
        if self.timer is not None:
            self.costs.append(0.0 if info.is_idle else float(info.cost))
            self.compute.append(self.timer.take())
        self.steps += 1
        self.idle += int(info.is_idle)
        if self.rank == 0 and args.log_every and self.steps % args.log_every == 0:
            print(
                f"[rank 0] epoch {epoch} step {info.step} loss {self.loss:.4f}", file=sys.stderr, flush=True
            )
        self.due = self.due or self.steps % args.checkpoint_every == 0
        if self.ckpt is not None and self.due and info.update_end:  # no gradient held
            save_checkpoint(self.ckpt, self.module, self.opt, self.client)
            self.due = False

    def close(self) -> None:
        self.watch.stop()
        if self.ids_log is not None:
            os.close(self.ids_log)


def _cost_check(run: _Loop) -> dict[str, Any] | None:
    """How well the job's cost model predicted this rank's own measured compute (`batchd.core.cost_check`
    over its steps alone: no collective at the end of the run; `batchd bench` compares the ranks). None
    without timed steps."""
    if run.timer is None or not run.costs:
        return None
    got = cost_check([[c] for c in run.costs], [[t] for t in run.compute])
    return {k: got[k] for k in ("steps", "r2", "slope_s", "intercept_s")}


def train_loop(client, ddp, opt, args, ckpt, train_step) -> dict[str, Any]:
    """Trains epochs `client.epoch` .. E-1 (`--epochs`, else the job's); saves the last checkpoint; returns
    the rank's summary (`batchd/train.py`'s docstring)."""
    t0 = time.perf_counter()
    run = _Loop(client, ddp, opt, args, ckpt)
    rank = client.rank
    try:
        epochs = args.epochs or client.job_epochs()
        total = client.job_samples() if rank == 0 else None  # the job's samples per epoch, all ranks
        for epoch in range(client.epoch, epochs):
            run.epoch(epoch, epochs, total, train_step)
    finally:
        run.close()
    if ckpt is not None:
        save_checkpoint(ckpt, run.module, opt, client)
    client.close()
    wall = round(time.perf_counter() - t0, 3)
    device = next(run.module.parameters()).device
    vision = _vision_imbalance(run.loads, device)
    check = _cost_check(run)
    if rank == 0 and check is not None and check["r2"] is not None:
        print(
            f"[rank 0] cost model check: R^2 of this rank's compute on its planned cost {check['r2']:.3f} "
            f"over {check['steps']} steps (`batchd calibrate` measures a cost model)",
            file=sys.stderr,
            flush=True,
        )
    if rank == 0 and vision is not None:
        print(
            f"[rank 0] vision encoder: slowest rank / mean, in encoder patches: {vision:.3f} (mean over "
            f"steps with images)",
            file=sys.stderr,
            flush=True,
        )
    return {
        "steps": run.steps,
        "idle": run.idle,
        "epoch_steps": run.epoch_steps,
        "epoch": client.epoch,
        "next_step": client.next_step,
        "last_loss": run.loss,
        "wall_s": wall,
        "vision_imbalance": vision,
        "exchange_steps": run.exchange_steps,
        "exchange_rows_to": run.rows_to,
        "cost_check": check,
        "token_budget": run.budget,
    }
