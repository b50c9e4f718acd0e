"""batchd with PyTorch Lightning: `BatchdDataModule`, `batchd_lightning_loss`, `batchd_lightning_step`.

``trainer.fit(module, datamodule=BatchdDataModule(lambda: BatchClient(address, rank, world_size)))``
trains on this rank's batchd stream:

* **Data.** ``train_dataloader()`` is the rank's stream itself (an iterable of `BatchdStep`: the batch
  dict and its StepInfo, ``batch, info = step``), not a ``DataLoader``: Lightning adds no
  ``DistributedSampler`` and no worker processes (every rank already reads its own aligned stream; a
  sampler would shard it a second time). `transfer_batch_to_device` moves the batch's tensors and keeps
  the StepInfo as is. The client may be a zero-argument factory, called in ``setup`` (after the process
  group exists); its rank and world size must be the trainer's ``global_rank`` / ``world_size``.
* **Loss.** In ``training_step`` return ``batchd_lightning_loss(self.model, batch, info)``: the model is
  called the Hugging Face way (``hf_model_inputs``: no labels, ``use_cache=False``), and the loss is the
  rank's per-token mean x ``loss_scale`` (N t_r / T_tok, `batchd.client.batchd_loss`), so DDP's average
  over ranks is the gradient of the global per-token mean. IDLE steps arrive with the rank service's
  1-token dummy batch and give a zero-weight loss (``logits.sum() * 0``) that still reaches every
  parameter, so DDP's all-reduce fires on every rank. Other models: return
  ``batchd_loss(forward_logits(self.model, batch), batch, info)``.
* **Epochs.** Each Lightning epoch reads the rest of the client's batchd epoch, or, once that is
  finished, the next one (``set_epoch``): a fresh client's Lightning epoch e is batchd epoch e. When the
  job's last epoch (``client.job_epochs()``, or ``epochs=``: batchd epochs 0 .. epochs-1) ends, the data
  module sets ``trainer.should_stop``, so ``max_epochs=-1`` (or any bound >= the job's epochs) ends with
  the job; a smaller ``max_epochs`` stops earlier. Every epoch ends when the stream does (the same step
  on every rank); ``max_steps`` stops mid-epoch on every rank at the same step, and a later ``fit``
  continues that batchd epoch (Lightning counts the interrupted epoch as done, so its epoch numbers then
  run one ahead of batchd's).
* **Checkpoints.** The data module's ``state_dict`` (saved by Lightning in every checkpoint) is the
  stream position after the last batch *trained on*: Lightning fetches one batch ahead, so the client's
  own position is one step further. Rank 0 writes Lightning's checkpoint, but the position holds for
  every rank (the streams are aligned: same epoch, same step count), so each rank restores its own
  client from it in ``trainer.fit(..., ckpt_path=...)``. ``state_dict`` also tells the rank service
  that a checkpoint is taken at that position (`BatchClient.state_dict`, "Rewind to a checkpoint"): it
  keeps the batches after it, so trainers that crash after a checkpoint and resume from it get the same
  batches again. Lightning saves synchronously (then a barrier), so when the next batch reaches the
  device the save has completed on every rank and the data module says so (`BatchClient.checkpointed`:
  the service frees the batches before it); not with an ``AsyncCheckpointIO``. Lightning calls
  ``state_dict`` only to save a checkpoint; do not call it for anything else. A failed ``fit`` closes
  the stream (``on_exception``), so a retry in the same process can connect again.

* **Optimizer updates of a fixed token count** (the job's ``tokens_per_update`` /
  ``samples_per_update``): an update spans a varying number of steps, which Lightning's automatic
  optimization cannot follow, so the module uses manual optimization, as Lightning recommends for
  custom accumulation: ``self.automatic_optimization = False`` in ``__init__`` and
  ``return batchd_lightning_step(self, self.model, batch, info)`` in ``training_step``. It zeroes the
  gradients at an update's first step, runs forward and backward inside the update under the
  strategy's ``block_backward_sync`` (DDP: no all-reduce until the update's last step), and at the
  update's end multiplies the gradient by ``info.update_scale`` (the update's per-token mean), clips
  (``gradient_clip_val``), steps the optimizer and every scheduler once. ``trainer.global_step``
  counts optimizer steps, i.e. updates, so ``max_steps``, ``every_n_train_steps`` checkpoints (which
  then fall between updates) and the schedule are in updates. A job whose updates span several steps
  trained by a module with automatic optimization is refused at its first such step.

Trade-offs: ``accumulate_grad_batches`` must be 1 (Lightning's accumulation would weigh every step of a
window equally, which is not the window's per-token mean: use the Accelerate or HF Trainer integration
for accumulation); Lightning's ``batch_idx`` counts the steps of the current Lightning run, while
``info.step`` is batchd's step in the epoch.

Imports Lightning (``lightning.pytorch`` when installed, else ``pytorch_lightning``) at import time; the
package ``batchd.client`` imports this module lazily.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterator, Mapping
from typing import Any

import torch

try:  # the unified package when present (its Trainer checks against its own LightningDataModule)
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - depends on what is installed
    import pytorch_lightning as pl

from batchd.core import StepInfo

from ._accelerate import batchd_loss, hf_model_inputs
from ._client import BatchClient
from ._train import _to_device, scale_gradients
from ._vlm import check_model_batch

AsyncCheckpointIO = pl.plugins.io.AsyncCheckpointIO  # saves in a thread: its completion is not known here


class BatchdStep:
    """One step of the stream: ``batch`` (dict of tensors) and ``info`` (its `batchd.core.StepInfo`).

    Unpacks as ``batch, info = step``. A plain object, not a tuple or a dataclass, so Lightning's
    collection helpers (precision input conversion, device moves) leave the frozen StepInfo alone."""

    __slots__ = ("batch", "info")

    def __init__(self, batch: dict[str, Any], info: Any) -> None:
        self.batch, self.info = batch, info

    def __iter__(self) -> Iterator[Any]:
        return iter((self.batch, self.info))

    def __repr__(self) -> str:
        return f"BatchdStep(step={self.info.step}, keys={sorted(self.batch)})"


class _Stream:
    """The iterable Lightning gets each epoch; iterating reads one batchd epoch (module docstring)."""

    def __init__(self, dm: BatchdDataModule) -> None:
        self.dm = dm

    def __iter__(self) -> Iterator[BatchdStep]:
        return self.dm._epoch()


class BatchdDataModule(pl.LightningDataModule):  # type: ignore[misc]  # Lightning: not type-checked here
    """A ``LightningDataModule`` over this rank's batchd stream (module docstring).

    Args:
        client: This rank's `BatchClient`, or a zero-argument factory returning it (called in ``setup``).
        epochs: Train batchd epochs up to epochs - 1 (from the client's); by default all the job's, asked
            of the rank service.

    Raises:
        ValueError: on bad arguments; in ``setup``: a client whose rank / world size are not the trainer's,
            or ``accumulate_grad_batches`` != 1.
    """

    def __init__(self, client: BatchClient | Callable[[], BatchClient], epochs: int | None = None) -> None:
        super().__init__()
        if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1):
            raise ValueError(f"epochs must be None or an integer >= 1, got {epochs=}")
        if not (isinstance(client, BatchClient) or callable(client)):
            raise ValueError(  # noqa: TRY004 - bad arguments raise ValueError in this project
                f"client must be a BatchClient or a factory returning one, got {client=}"
            )
        self._source, self.epochs = client, epochs
        self._client: BatchClient | None = client if isinstance(client, BatchClient) else None
        self._it: Generator[tuple[dict[str, Any], StepInfo], None, None] | None = None
        self._trained: tuple[int, int] | None = None  # (epoch, step) of the last batch sent to training
        self._saving = False  # a checkpoint's state_dict was taken; its save completes before the next batch
        self._pending: Mapping[str, Any] | None = None  # a state loaded before the client existed

    # -- the client ----------------------------------------------------------------------------------
    @property
    def client(self) -> BatchClient:
        """This rank's client (made by the factory on first use)."""
        if self._client is None:
            source = self._source
            client = source if isinstance(source, BatchClient) else source()
            if not isinstance(client, BatchClient):
                raise ValueError(f"the client factory must return a BatchClient, got {type(client).__name__}")
            self._client = client
            if self._pending is not None:
                self._restore(self._pending)
        return self._client

    def setup(self, stage: str) -> None:
        trainer = self.trainer
        if trainer is None:
            return
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"BatchdDataModule needs accumulate_grad_batches=1 (Lightning would weigh the window's "
                f"steps equally), got {trainer.accumulate_grad_batches}"
            )
        client = self.client
        want = (trainer.global_rank, trainer.world_size)
        if (client.rank, client.world_size) != want:
            raise ValueError(
                f"the BatchClient is for rank {client.rank} of {client.world_size} but this Lightning "
                f"process is rank {want[0]} of {want[1]}: {client.rank=} {client.world_size=}"
            )

    def teardown(self, stage: str) -> None:
        self._close()

    def on_exception(self, exception: BaseException) -> None:
        self._close()  # the stream ends with the failed fit: a retry in this process may connect again

    def _close(self) -> None:
        if self._it is not None:
            self._it.close()
            self._it = None

    # -- data ----------------------------------------------------------------------------------------
    def train_dataloader(self) -> _Stream:
        """This rank's stream (no DataLoader, no sampler, no workers)."""
        return _Stream(self)

    def _epoch(self) -> Iterator[BatchdStep]:
        self._close()
        client, trainer = self.client, self.trainer
        if self.epochs is None:
            self.epochs = client.job_epochs()
        if client.finished:  # the client's epoch is done: the next one, if the job has it
            if client.epoch + 1 >= self.epochs:
                if trainer is not None:
                    trainer.should_stop = True
                return
            client.set_epoch(client.epoch + 1)
        self._it = iter(client)
        for batch, info in self._it:
            yield BatchdStep(batch, info)
        self._it = None
        if trainer is not None and client.finished and client.epoch + 1 >= self.epochs:
            trainer.should_stop = True  # the job's last epoch has ended: no empty Lightning epochs after it

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Moves a `BatchdStep`'s tensors to `device` (the StepInfo stays) and notes it as trained on.

        Raises:
            ValueError: a step of an update of several steps for a module with automatic optimization.
        """
        if not isinstance(batch, BatchdStep):
            return super().transfer_batch_to_device(batch, device, dataloader_idx)
        info = batch.info
        trainer = self.trainer
        if (
            (info.update_step != 0 or not info.update_end)
            and trainer is not None
            and trainer.lightning_module.automatic_optimization
        ):
            raise ValueError(
                f"the job's optimizer updates span several steps (tokens_per_update / samples_per_update), "
                f"which Lightning's automatic optimization cannot follow: set automatic_optimization = "
                f"False in {type(trainer.lightning_module).__name__} and return batchd.client."
                f"batchd_lightning_step(self, model, batch, info) from training_step; got step "
                f"{info.step} of update {info.update}"
            )
        if self._saving and trainer is not None:  # the checkpoint taken since the last batch is written
            self._saving = False
            if not isinstance(trainer.strategy.checkpoint_io, AsyncCheckpointIO):
                self.client.checkpointed()
        self._trained = (self.client.epoch, info.step)
        return BatchdStep(_to_device(batch.batch, device), batch.info)

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The stream position after the last batch trained on (rank-independent: see module docstring),
        which the client tells its rank service as the checkpoint's position."""
        client = self.client
        ahead = (client.epoch, client.next_step, client.finished)
        if self._trained is not None and (self._trained[0], self._trained[1] + 1) < ahead[:2]:
            # the fetched-ahead batch is not trained: the checkpoint, and the service's mark, are before it
            client.epoch, client.next_step, client.finished = self._trained[0], self._trained[1] + 1, False
        try:
            state = client.state_dict()
        finally:
            client.epoch, client.next_step, client.finished = ahead
        self._saving = True
        return {k: state[k] for k in ("version", "world_size", "epoch", "next_step", "finished")}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if self._client is None:
            self._pending = dict(state_dict)
            return
        self._restore(state_dict)

    def _restore(self, state: Mapping[str, Any]) -> None:
        client = self.client  # made already: a state loaded before it waits in `_pending`
        client.load_state_dict({**state, "rank": client.rank})  # refuses another world size or version
        self._trained, self._pending = None, None


def batchd_lightning_loss(model: torch.nn.Module, batch: Mapping[str, Any], info: Any) -> torch.Tensor:
    """The loss a ``training_step`` returns for a batchd step: ``model(**hf_model_inputs(batch))``, then
    the per-token mean x ``info.loss_scale`` (`batchd_loss`; IDLE steps: zero weight, every parameter
    reached, so DDP's all-reduce fires).

    Raises:
        ValueError: on a bad scale, labels that disagree with ``info.local_loss_tokens``, or a model the
            batch does not fit (`batchd.client.check_model_batch`).
    """
    check_model_batch(model, batch)
    return batchd_loss(model(**hf_model_inputs(batch)), batch, info)


def batchd_lightning_step(
    module: Any,
    model: torch.nn.Module,
    batch: Mapping[str, Any],
    info: Any,
    *,
    gradient_clip_val: float | None = None,
) -> torch.Tensor:
    """The ``training_step`` of a module with ``automatic_optimization = False`` (module docstring):
    forward and `batchd_loss` (as `batchd_lightning_loss`), ``module.manual_backward``; inside an
    optimizer update without the gradient all-reduce; at its end the update's scale, clipping, the
    optimizer step and every scheduler's step. Works for one-step updates too (every step ends one).

    Args:
        module: The ``LightningModule`` (its ``optimizers()``, ``lr_schedulers()``, trainer).
        model: What it calls the HF way, ``model(**hf_model_inputs(batch))``.
        batch, info: The `BatchdStep`'s batch and StepInfo.
        gradient_clip_val: Clip the update's gradient norm to this (None: no clipping).

    Returns:
        The detached scaled loss (its sum over an update's steps, averaged over ranks, is the update's
        global per-token mean loss times D / W; 0 on IDLE steps).

    Raises:
        ValueError: a module with automatic optimization, or what `batchd_lightning_loss` raises.
    """
    if module.automatic_optimization:
        raise ValueError(
            f"batchd_lightning_step steps the optimizer itself: set automatic_optimization = False in "
            f"{type(module).__name__}.__init__"
        )
    opt = module.optimizers()
    if info.update_step == 0:
        opt.zero_grad()
    sync = contextlib.nullcontext if info.update_end else _block_sync(module)
    with sync():
        check_model_batch(model, batch)
        loss = batchd_loss(model(**hf_model_inputs(batch)), batch, info)
        module.manual_backward(loss)
    if info.update_end:
        scale_gradients(module, float(info.update_scale))
        if gradient_clip_val is not None:
            module.clip_gradients(opt, gradient_clip_val=gradient_clip_val)
        opt.step()
        schedulers = module.lr_schedulers()
        for sched in schedulers if isinstance(schedulers, list) else [schedulers] if schedulers else []:
            sched.step()
    return loss.detach()


def _block_sync(module: Any) -> Callable[[], Any]:
    """The strategy's context that skips DDP's gradient all-reduce (nothing for a single device)."""
    return getattr(module.trainer.strategy, "block_backward_sync", contextlib.nullcontext)
