"""A crash after a checkpoint, and the resume from it, through each trainer integration, end to end.

Every test trains the tiny ``LlamaForCausalLM`` of tests/test_integrations.py with AdamW (its moments must
come back from the checkpoint too) on a deterministic job at world size 1 (real in-process coordinator
and rank service; 48 samples, 2 epochs: 10 + 9 steps) and saves a checkpoint every `EVERY` = 4 steps
the integration's own way (HF Trainer: ``save_steps``; Lightning: ``ModelCheckpoint(every_n_train_steps)``;
Accelerate: ``accelerator.save_state`` with the client's ``state_dict()`` beside it). It crashes after
`CRASH` = 11 steps: one step into epoch 1, three after the last checkpoint (step 8 of epoch 0). The
model, optimizer, trainer and client are thrown away; a new model (initialised differently), optimizer,
trainer and `BatchClient` restart from the last checkpoint and train to the job's end. Asserted:

* the rank service's floor is the last checkpoint's position when the crash comes: the integration told
  the service each checkpoint's position (the step after the last one trained) and that its save
  completed (`BatchClient.checkpointed`), so the batches before it are freed and the ones after it kept;
* the resume gets the steps after the checkpoint again (across the epoch boundary): the surviving lineage
  (the crashed run's steps before the checkpoint, then the resumed run's) is the uninterrupted run's,
  step for step and batch for batch (an identical fresh job), so it trains every id exactly once per
  epoch;
* the final parameters equal those of the uninterrupted run (float32 tolerance).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from _jobs import InProcessJob, job_pool
from test_integrations import SEED, VOCAB, lengths_for, tiny_llama, trainer_args

from batchd.client import BatchClient, batchd_backward, batchd_batches
from batchd.core import JobSpec, PolicySpec

transformers = pytest.importorskip("transformers")

N, EPOCHS = 48, 2
EVERY = 4  # steps between checkpoints
CRASH = 11  # steps trained when the crash comes: 3 after the checkpoint at 8, one into epoch 1
AT = (0, 8)  # the last checkpoint's position: (epoch, next step)
LR = 5e-3
RTOL, ATOL = 1e-5, 1e-6


class Crash(Exception):
    """The simulated crash of the trainer process."""


@pytest.fixture
def make_job():
    spec = JobSpec(
        world_size=1,
        token_budget=256,
        seed=SEED,
        epochs=EPOCHS,
        deterministic=True,
        policy=PolicySpec(name="local", window=16, depth=3),
    )
    with job_pool(vocab_size=VOCAB) as start:
        yield lambda: start(spec, lengths_for(N))


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def wait_floor(job: InProcessJob, want: tuple[int, int], limit_s: float = 10.0) -> None:
    """Waits until rank 0's service holds batches from `want` (epoch, step) on, i.e. it received the last
    checkpoint's position and that its save completed; fails naming the floor it has instead."""
    delivery = job.cores[0].delivery
    deadline = time.monotonic() + limit_s
    while delivery.floor != want:
        assert time.monotonic() < deadline, (
            f"rank 0's floor is {delivery.floor} after {limit_s:g}s, not the last checkpoint's {want}"
        )
        time.sleep(0.01)


def check_resume(reference: list, first: list, resumed: list) -> None:
    """`reference`: the uninterrupted run's steps, (epoch, step, sample ids) in training order; `first`:
    the crashed run's; `resumed`: the run restarted from the checkpoint at `AT`."""
    epoch0 = sum(e == 0 for e, _, _ in reference)
    assert AT[1] % EVERY == 0 and AT[1] < epoch0 < CRASH < AT[1] + EVERY, (
        f"the scenario needs the last checkpoint before the crash in epoch 0, the crash in epoch 1: {epoch0=}"
    )
    assert first == reference[:CRASH], "the crashed run trained what the uninterrupted one did"
    replayed = [x for x in first if x[:2] >= AT]
    assert len(replayed) == CRASH - AT[1] and resumed[: len(replayed)] == replayed, (
        "the steps after the checkpoint come again, the same batches"
    )
    lineage = [x for x in first if x[:2] < AT] + resumed
    assert lineage == reference, "the surviving lineage is the uninterrupted run, step for step"
    for e in range(EPOCHS):
        ids = sorted(i for epoch, _, step_ids in lineage if epoch == e for i in step_ids)
        assert ids == list(range(N)), f"epoch {e}: every id exactly once"


# -- HF Trainer ------------------------------------------------------------------------------------------
def hf_trainer(job: InProcessJob, out: Path, model: torch.nn.Module, crash_hook=None, **overrides):
    from batchd.client import BatchdTrainer

    class Recording(BatchdTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            info = inputs["batchd_info"]
            self.seen.append((self.client.epoch, info.step, inputs["sample_ids"].tolist()))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    class CrashAt(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == CRASH:
                crash_hook()
                raise Crash(f"after step {state.global_step}")

    trainer = Recording(
        model=model,
        args=trainer_args(out, optim="adamw_torch", **overrides),
        client=lambda: job.client(0),
        callbacks=[CrashAt()] if crash_hook else [],
    )
    trainer.seen = []
    return trainer


def test_hf_trainer_resumes_from_its_last_checkpoint_after_a_crash(make_job, tmp_path):
    ref = hf_trainer(make_job(), tmp_path / "reference", tiny_llama())
    ref.train()
    assert ref.client.finished and ref.client.epoch == EPOCHS - 1

    job = make_job()
    checkpoints = {"save_strategy": "steps", "save_steps": EVERY}
    run = hf_trainer(job, tmp_path / "run", tiny_llama(), lambda: wait_floor(job, AT), **checkpoints)
    with pytest.raises(Crash):
        run.train()
    first = run.seen
    run.client.close()  # the process is gone: its client, model and optimizer with it
    del run

    out = tmp_path / "run" / "out"
    saved = json.loads((out / f"checkpoint-{AT[1]}" / "batchd_client_rank0.json").read_text())
    assert (saved["epoch"], saved["next_step"], saved["finished"]) == (*AT, False)
    resumed = hf_trainer(job, tmp_path / "run", tiny_llama(seed=1), **checkpoints)
    resumed.train(resume_from_checkpoint=True)  # the last checkpoint: checkpoint-8
    assert resumed.state.global_step == len(ref.seen) and resumed.client.finished

    check_resume(ref.seen, first, resumed.seen)
    torch.testing.assert_close(flat_params(resumed.model), flat_params(ref.model), rtol=RTOL, atol=ATOL)


# -- Lightning -------------------------------------------------------------------------------------------
def lit_module(seed: int = 0):
    """The tiny Llama with AdamW; records each trained step as (batchd epoch, step, sample ids) in `seen`."""
    pl = pytest.importorskip("pytorch_lightning")
    from batchd.client import batchd_lightning_loss

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_llama(seed)
            self.seen: list = []

        def training_step(self, step, batch_idx):
            batch, info = step
            # Lightning reads one batch ahead, never into the next epoch: the client's is this batch's
            client = self.trainer.datamodule.client
            self.seen.append((client.epoch, info.step, batch["sample_ids"].tolist()))
            return batchd_lightning_loss(self.model, batch, info)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR)

    return Lit()


def lit_fit(job: InProcessJob, module, tmp_path: Path, crash_hook=None, ckpt_path: str | None = None):
    """``trainer.fit`` on the job's stream with a checkpoint every `EVERY` steps into `tmp_path` (after a
    crash the same callback goes on saving, Lightning restores its state); crashes after `CRASH` steps with
    a `crash_hook`."""
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint

    from batchd.client import BatchdDataModule

    class CrashAt(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == CRASH:
                crash_hook()
                raise Crash(f"after step {trainer.global_step}")

    every = ModelCheckpoint(
        dirpath=tmp_path, filename="step{step}", every_n_train_steps=EVERY, save_top_k=-1,
        auto_insert_metric_name=False,
    )  # fmt: skip
    dm = BatchdDataModule(lambda: job.client(0))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=-1,  # the data module stops Lightning after the job's last epoch
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[every, CrashAt()] if crash_hook else [every],
    )
    try:
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    finally:
        dm.client.close()  # after a crash: the process is gone, its client with it
    return trainer, dm


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")  # resumed there
def test_lightning_resumes_from_its_last_checkpoint_after_a_crash(make_job, tmp_path):
    ref = lit_module()
    lit_fit(make_job(), ref, tmp_path / "reference")

    job = make_job()
    crashed = lit_module()
    with pytest.raises(Crash):
        lit_fit(job, crashed, tmp_path / "run", lambda: wait_floor(job, AT))
    first = crashed.seen
    del crashed

    last = max((tmp_path / "run").glob("step*.ckpt"), key=lambda p: int(p.stem.removeprefix("step")))
    assert last.name == f"step{AT[1]}.ckpt"
    assert torch.load(last, weights_only=False)["BatchdDataModule"]["next_step"] == AT[1]
    resumed = lit_module(seed=1)
    trainer, dm = lit_fit(job, resumed, tmp_path / "run", ckpt_path=str(last))
    assert dm.client.finished and dm.client.epoch == EPOCHS - 1 and trainer.should_stop
    assert trainer.global_step == len(ref.seen)

    check_resume(ref.seen, first, resumed.seen)
    torch.testing.assert_close(flat_params(resumed.model), flat_params(ref.model), rtol=RTOL, atol=ATOL)


# -- Accelerate ------------------------------------------------------------------------------------------
def save_checkpoint(accelerator, client: BatchClient, folder: Path) -> None:
    """Accelerate's state, then this rank's client state beside it; once every rank's save completed, the
    client says so (the rank service frees the batches before the checkpoint)."""
    accelerator.save_state(str(folder))
    path = folder / f"batchd_client_rank{client.rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(client.state_dict()))
    os.replace(path.with_suffix(".tmp"), path)
    accelerator.wait_for_everyone()
    client.checkpointed()


def accelerate_train(job: InProcessJob, seen: list, seed: int = 0, folder=None, resume=None, crash_hook=None):
    """An Accelerate loop over the job's epochs, a checkpoint every `EVERY` steps into `folder`/step-<n>;
    from the checkpoint folder `resume`; crashes after `CRASH` steps with a `crash_hook`. Appends each
    trained step to `seen` and returns the trained model."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = tiny_llama(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)  # never the stream
    done = 0  # steps trained, over the epochs
    with job.client(accelerator.process_index) as client:
        if resume is not None:
            accelerator.load_state(str(resume))
            client.load_state_dict(json.loads((resume / f"batchd_client_rank{client.rank}.json").read_text()))
            done = int(resume.name.removeprefix("step-"))
        for epoch in range(client.epoch, client.job_epochs()):
            client.set_epoch(epoch)  # a restored client keeps its position in its epoch
            batches = batchd_batches(accelerator, client)
            try:
                for batch, info in batches:
                    optimizer.zero_grad()
                    batchd_backward(accelerator, model, batch, info)
                    optimizer.step()
                    seen.append((epoch, info.step, batch["sample_ids"].tolist()))
                    done += 1
                    if folder is not None and done % EVERY == 0:
                        save_checkpoint(accelerator, client, folder / f"step-{done}")
                    if crash_hook is not None and done == CRASH:
                        crash_hook()
                        raise Crash(f"after step {done}")
            finally:
                batches.close()  # ends the stream now, also on the crash
    assert client.finished
    return accelerator.unwrap_model(model)


def test_accelerate_loop_resumes_from_its_last_checkpoint_after_a_crash(make_job, tmp_path):
    reference: list = []
    ref_model = accelerate_train(make_job(), reference)

    job = make_job()
    first: list = []
    with pytest.raises(Crash):
        accelerate_train(job, first, folder=tmp_path, crash_hook=lambda: wait_floor(job, AT))

    last = max(tmp_path.glob("step-*"), key=lambda p: int(p.name.removeprefix("step-")))
    assert last.name == f"step-{AT[1]}"
    resumed: list = []
    model = accelerate_train(job, resumed, seed=1, folder=tmp_path, resume=last)

    check_resume(reference, first, resumed)
    torch.testing.assert_close(flat_params(model), flat_params(ref_model), rtol=RTOL, atol=ATOL)
