"""The reference trainer's checkpoints (`--checkpoint DIR`, batchd/train.py's docstring): `ddp`'s file per
rank, `fsdp2` / `deepspeed`'s sharded directory named by DIR/latest.json, and where a restarted group
resumes."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .strategy import wait_released

POINTER = "latest.json"  # fsdp2 / deepspeed: names the last complete checkpoint directory of --checkpoint


def read_pointer(directory: Path) -> dict[str, Any] | None:
    """DIR/latest.json (`ShardedCheckpoint`): {"strategy", "dir", "seq", "world_size", "epoch",
    "next_step"}, or None when DIR holds no sharded checkpoint."""
    try:
        return json.loads((directory / POINTER).read_text())
    except FileNotFoundError:
        return None


def check_checkpoint_dir(directory: Path, strategy: str, world_size: int) -> None:
    """Refuses, before the rendezvous, a `--checkpoint` DIR this run cannot resume from: one that another
    `--strategy` saved into, or a sharded (fsdp2 / deepspeed) checkpoint of another world size."""
    pointer = read_pointer(directory)
    saved_by = pointer["strategy"] if pointer else ("ddp" if any(directory.glob("rank-*.pt")) else None)
    if saved_by is not None and saved_by != strategy:
        raise ValueError(
            f"--checkpoint {directory} holds a --strategy {saved_by} checkpoint, got --strategy {strategy}: "
            "resume with the strategy that saved it, or give another directory"
        )
    if pointer is not None and int(pointer["world_size"]) != world_size:
        raise ValueError(
            f"--strategy {strategy} resumes at the world size it saved at (resizing needs --strategy ddp): "
            f"--checkpoint {directory} was saved at world size {pointer['world_size']}, got {world_size=}"
        )


class ShardedCheckpoint:
    """`--checkpoint DIR` of `--strategy fsdp2 / deepspeed` (see module docstring): every save a new
    directory DIR/<strategy>-<n>, written by every rank together, then named by DIR/latest.json. All its
    methods are collectives: every rank calls them at the same step.

    Args:
        directory: DIR.
        strategy: "fsdp2" or "deepspeed".
        rank: This rank.
        engine: The DeepSpeed engine (deepspeed), else None.
    """

    def __init__(self, directory: Path, strategy: str, rank: int, engine: Any = None) -> None:
        self.directory, self.strategy, self.rank, self.engine = directory, strategy, rank, engine
        self.seq = 0  # the number n of the last complete save, DIR/<strategy>-<n>

    def load(self, model: torch.nn.Module, opt: torch.optim.Optimizer, client: Any) -> None:
        """Loads the model, the optimizer and `client`'s position of the directory latest.json names, when
        there is one; removes the directories of saves that did not complete."""
        pointer = None
        if self.rank == 0:
            pointer = read_pointer(self.directory)
            self._remove_others(pointer["dir"] if pointer else None)
        box = [pointer]
        dist.broadcast_object_list(box, src=0)  # every rank the same checkpoint, whatever it sees of DIR
        pointer = box[0]
        if pointer is None:
            return
        self.seq, where = int(pointer["seq"]), self.directory / pointer["dir"]
        if self.strategy == "fsdp2":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            model_state, optim_state = get_state_dict(model, opt)  # this rank's shards, filled in place
            state = {"model": model_state, "optimizer": optim_state}
            dcp.load(state, checkpoint_id=str(where))
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        else:
            path, _ = self.engine.load_checkpoint(str(self.directory), tag=pointer["dir"])
            if path is None:
                raise FileNotFoundError(f"DeepSpeed found no checkpoint in {where} (named by {POINTER})")
        client.load_state_dict(json.loads((where / f"data-rank-{self.rank}.json").read_text()))
        print(
            f"[rank {self.rank}] resumed from {where} at epoch {client.epoch} step {client.next_step}",
            file=sys.stderr,
            flush=True,
        )

    def save(self, model: torch.nn.Module, opt: torch.optim.Optimizer, client: Any) -> None:
        data = client.state_dict()  # once: it tells the rank service a checkpoint is taken here
        name = f"{self.strategy}-{self.seq + 1:06d}"
        where = self.directory / name
        where.mkdir(parents=True, exist_ok=True)
        if self.strategy == "fsdp2":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_state, optim_state = get_state_dict(model, opt)
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(where))
        else:
            self.engine.save_checkpoint(str(self.directory), tag=name, save_latest=False)
        (where / f"data-rank-{self.rank}.json").write_text(json.dumps(data))
        dist.barrier()  # every rank's part is written
        if self.rank == 0:
            pointer = {
                "strategy": self.strategy,
                "dir": name,
                "seq": self.seq + 1,
                "world_size": data["world_size"],
                "epoch": data["epoch"],
                "next_step": data["next_step"],
            }
            tmp = self.directory / f"{POINTER}.tmp"
            tmp.write_text(json.dumps(pointer))
            tmp.replace(self.directory / POINTER)  # atomic: a crash before it resumes from the one before
        dist.barrier()  # the save is complete on every rank
        self.seq += 1
        pos, tmp = self.directory / f"rank-{self.rank}.pos.json", self.directory / f"rank-{self.rank}.pos.tmp"
        tmp.write_text(json.dumps(data))  # its position, as ddp's (`batchd torchrun`'s note reads it)
        tmp.replace(pos)
        client.checkpointed()  # the rank service frees the steps before it
        if self.rank == 0:
            self._remove_others(name)

    def _remove_others(self, keep: str | None) -> None:
        """Removes DIR/<strategy>-* but `keep`: older saves, and saves that did not complete."""
        for old in self.directory.glob(f"{self.strategy}-*"):
            if old.is_dir() and old.name != keep:
                shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(
    ckpt: Path | ShardedCheckpoint, model: torch.nn.Module, opt: torch.optim.Optimizer, client: Any
) -> None:
    if isinstance(ckpt, ShardedCheckpoint):
        ckpt.save(model, opt, client)
        return
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    tmp = ckpt.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "data": client.state_dict()}, tmp)
    tmp.replace(ckpt)  # atomic: a crash mid-save keeps the previous checkpoint
    pos, tmp = ckpt.with_suffix(".pos.json"), ckpt.with_suffix(".pos.tmp")
    tmp.write_text(json.dumps(client.state_dict()))  # its position, read without loading the model
    tmp.replace(pos)


def _position(data: dict[str, Any]) -> tuple[int, int, int]:
    return int(data["epoch"]), int(data["next_step"]), int(data["finished"])


def checkpoint_to_load(ckpt: Path | None, world_size: int) -> tuple[Path | None, bool]:
    """`--strategy ddp`'s (the checkpoint this rank resumes from, whether the job was resized since it was
    saved). Every rank's file holds the same model and optimizer at an update's end (DDP replicates them); the
    furthest position saved in the directory says where the job stands. Saved at this world size: each
    rank its own file (`agree_position` evens out a step between them). Saved at another (the job was
    resized, `batchd coordinator --resize`): every rank the furthest one, its data state at that size."""
    if ckpt is None:
        return None, False
    saved = {}
    for pos in ckpt.parent.glob("rank-*.pos.json"):
        try:
            saved[pos] = json.loads(pos.read_text())
        except ValueError:
            continue
    if not saved:
        return (ckpt if ckpt.exists() else None), False
    newest = max(saved, key=lambda p: _position(saved[p]))
    if int(saved[newest]["world_size"]) == world_size:
        return (ckpt if ckpt.exists() else None), False
    return newest.with_name(newest.name.replace(".pos.json", ".pt")), True


def agree_position(client: Any, device: torch.device) -> None:
    """Moves this rank to the furthest (epoch, next_step, finished) any rank saved. Checkpoints are per
    rank, so a group killed between one rank's save and another's resumes up to one step apart; the step
    in between went through the all-reduce on every rank, so the rank behind skips it."""
    mine = torch.tensor(
        [client.epoch, client.next_step, int(client.finished)], dtype=torch.int64, device=device
    )
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    wait_released([dist.all_gather(every, mine, async_op=True)], [mine, *every])  # all_reduce_released
    epoch, next_step, finished = max(tuple(int(x) for x in t.tolist()) for t in every)
    if (epoch, next_step, finished) != (client.epoch, client.next_step, int(client.finished)):
        print(
            f"[rank {client.rank}] a peer saved a later position: epoch {epoch} step {next_step} "
            f"(mine: epoch {client.epoch} step {client.next_step})",
            file=sys.stderr,
            flush=True,
        )
        client.epoch, client.next_step, client.finished = epoch, next_step, bool(finished)
