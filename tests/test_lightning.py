"""PyTorch Lightning integration: `BatchdDataModule` + `batchd_lightning_loss`, against real rank services.

The same tiny randomly initialised ``LlamaForCausalLM`` and per-sample reference as tests/test_integrations.py
(each sample of a step forwarded alone, unpadded; the plain per-token mean over the step's samples).

* slow: Lightning's own DDP strategy (``strategy="ddp"``, 2 gloo CPU processes, started by the test with
  ``LOCAL_RANK`` set so Lightning does not launch them) on two in-process jobs (balanced, padded; skewed
  with rank 1 IDLE from its second step, packed): every checked step's all-reduced gradient equals the
  single-process per-token gradient over both ranks' samples; the control (DDP's plain mean of the ranks'
  unscaled per-token means) differs measurably; the whole epoch runs, every id exactly once, the same
  number of steps on both ranks, and Lightning stops with the job's stream.
* World size 1: a Lightning checkpoint after ``max_steps=3`` resumes the stream at the step after the last
  one trained on (not the one Lightning fetched ahead); the job's epochs become Lightning epochs, each
  every id once, and training stops after the last; bad setups are refused.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from _jobs import job_pool
from test_integrations import ATOL, SEED, VOCAB, flat_grad, lengths_for, max_err, reference_grad, tiny_llama

from batchd.client import BatchClient
from batchd.core import JobSpec, PolicySpec, Updates

pl = pytest.importorskip("pytorch_lightning")


def make_job(
    start,
    world_size: int = 1,
    collate: str = "padded",
    policy: str = "local",
    n: int = 40,
    budget: int = 200,
    skewed: bool = False,
    epochs: int = 1,
    tokens_per_update: int | None = None,
):
    spec = JobSpec(
        world_size=world_size,
        token_budget=budget,
        seed=SEED,
        shuffle=not skewed,
        epochs=epochs,
        policy=PolicySpec(name=policy, window=16, depth=3, collate=collate),
        updates=Updates(tokens_per_update=tokens_per_update),
    )
    lengths = [150 if i % 2 == 0 else 5 for i in range(n)] if skewed else lengths_for(n)
    return start(spec, lengths)


@pytest.fixture
def jobs():
    with job_pool(vocab_size=VOCAB) as start:
        yield start


def loss_tokens(payloads: list[dict]) -> int:
    return sum(int((torch.as_tensor(p["labels"])[1:] != -100).sum()) for p in payloads)


def _params(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def lit_module(grad_steps: int = 0, lr: float = 0.1, updates: bool = False):
    """`updates`: manual optimization through batchd_lightning_step (for tokens_per_update)."""
    from batchd.client import batchd_lightning_loss, batchd_lightning_step

    class Lit(pl.LightningModule):
        """The tiny Llama; records each step's ids / IDLE flag / batchd step, and the first gradients."""

        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_llama()
            self.steps: list[dict] = []
            self.grads: list[tuple[list[float], list[float]]] = []
            self.wrapper = ""
            self.automatic_optimization = not updates

        def on_train_start(self):
            self.wrapper = type(self.trainer.strategy.model).__name__  # DDP while training (unwrapped after)

        def training_step(self, step, batch_idx):
            batch, info = step
            self.steps.append(
                {
                    "ids": batch["sample_ids"].tolist(),
                    "idle": info.is_idle,
                    "step": info.step,
                    "end": info.update_end,
                }
            )
            if updates:
                return batchd_lightning_step(self, self.model, batch, info)
            return batchd_lightning_loss(self.model, batch, info)

        optimizer_steps = 0

        def on_before_optimizer_step(self, optimizer):
            self.optimizer_steps += 1
            if len(self.grads) < grad_steps:  # DDP has all-reduced; the parameters are those of the forward
                self.grads.append((flat_grad(self.model).tolist(), _params(self.model)))

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=lr)
            if not updates:
                return opt
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Lit()


def lit_trainer(**kwargs):
    kwargs = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": -1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        **kwargs,
    }
    return pl.Trainer(**kwargs)


# -- two processes, Lightning's DDP over gloo --------------------------------------------------------------
def _rank_main(
    rank: int, world: int, port: int, addresses: dict[str, list[str]], out_dir: str, grad_steps: int
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        NODE_RANK="0",
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        RANK=str(rank),
    )
    torch.set_num_threads(1)
    import warnings

    from batchd.client import BatchdDataModule

    warnings.filterwarnings("ignore")
    out = {}
    for kind, addrs in addresses.items():
        module = lit_module(grad_steps, updates=kind == "updates")
        dm = BatchdDataModule(lambda a=addrs[rank]: BatchClient(a, rank, world))
        trainer = lit_trainer(devices=world, strategy="ddp")
        trainer.fit(module, datamodule=dm)
        out[kind] = {
            "world_size": trainer.world_size,
            "ddp": module.wrapper,
            "steps": module.steps,
            "grads": module.grads,
            "finished": dm.client.finished,
            "should_stop": trainer.should_stop,
            "global_step": trainer.global_step,
        }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(out, f)
    # both ranks are done with every collective (the fits ended); a normal interpreter exit here takes
    # ~10 s (gloo and gRPC threads winding down), which this test does not need
    os._exit(0)


@pytest.mark.slow
def test_lightning_ddp_gradients_equal_single_process_reference(jobs, tmp_path):
    from _procs import spawn
    from test_integrations import _free_port

    made = {
        "balanced": make_job(jobs, world_size=2, policy="balanced"),
        "skewed": make_job(jobs, world_size=2, policy="local", skewed=True, collate="packed"),
        # tokens_per_update: updates of ~3 steps, rank 1 IDLE inside them (batchd_lightning_step)
        "updates": make_job(jobs, world_size=2, policy="local", skewed=True, tokens_per_update=450),
    }
    addresses = {kind: [job.rank_address(r) for r in range(2)] for kind, job in made.items()}
    grad_steps = 3
    spawn(_rank_main, (2, _free_port(), addresses, str(tmp_path), grad_steps), nprocs=2, limit_s=60)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for kind, job in made.items():
        if kind == "updates":
            continue
        res = [r[kind] for r in ranks]
        assert [r["world_size"] for r in res] == [2, 2] and res[0]["ddp"] == "DistributedDataParallel", res[
            0
        ]["ddp"]
        # the end-to-end epoch: equal steps on both ranks, every id exactly once, Lightning stops with
        # the stream
        n = len(res[0]["steps"])
        assert n == len(res[1]["steps"]) > grad_steps and [r["global_step"] for r in res] == [n, n]
        assert all(r["finished"] and r["should_stop"] for r in res)
        assert [s["step"] for s in res[0]["steps"]] == list(range(n))
        assert sorted(i for r in res for s in r["steps"] for i in s["ids"]) == list(range(len(job.lengths)))
        gaps = []
        for k in range(grad_steps):
            (g0, w0), (g1, w1) = res[0]["grads"][k], res[1]["grads"][k]
            assert g0 == g1 and w0 == w1  # DDP: the same all-reduced gradient and parameters on both ranks
            model = tiny_llama()
            with torch.no_grad():
                torch.nn.utils.vector_to_parameters(torch.tensor(w0), model.parameters())
            p0, p1 = ([job.payload(i) for i in r["steps"][k]["ids"]] for r in res)
            assert res[0]["steps"][k]["idle"] == (not p0) and res[1]["steps"][k]["idle"] == (not p1)
            # each rank's samples forwarded alone: the per-token-mean gradient over them and their loss tokens
            means = [(reference_grad(model, p), loss_tokens(p)) if p else (0.0, 0) for p in (p0, p1)]
            want = sum(g * n for g, n in means) / sum(n for _, n in means)  # the step's per-token mean
            assert max_err(torch.tensor(g0), want) <= ATOL, (kind, k, max_err(torch.tensor(g0), want))
            # control: the unscaled per-rank means averaged by DDP (an IDLE rank contributes zeros)
            gaps.append(max_err((means[0][0] + means[1][0]) / 2 + 0 * want, want))
        assert max(gaps) > 100 * ATOL, (kind, gaps)
    skewed = ranks[1]["skewed"]["steps"]
    assert any(s["idle"] for s in skewed[:grad_steps]) and sum(s["idle"] for s in skewed) > 5, (
        "IDLE steps checked"
    )
    _check_ddp_updates([r["updates"] for r in ranks], made["updates"], grad_steps)


def _check_ddp_updates(res: list[dict], job, grad_steps: int) -> None:
    """batchd_lightning_step under DDP: one optimizer step per update on both ranks, and each checked
    update's all-reduced gradient is the per-token mean over all its samples on both ranks."""
    assert res[0]["ddp"] == "DistributedDataParallel" and len(res[0]["steps"]) == len(res[1]["steps"])
    assert sorted(i for r in res for s in r["steps"] for i in s["ids"]) == list(range(len(job.lengths)))
    ends = [k for k, s in enumerate(res[0]["steps"]) if s["end"]]
    assert [s["end"] for s in res[0]["steps"]] == [s["end"] for s in res[1]["steps"]]
    assert [r["global_step"] for r in res] == [len(ends)] * 2 and len(ends) > grad_steps and ends[0] > 0
    starts = [0, *(e + 1 for e in ends)]
    for k in range(grad_steps):
        (g0, w0), (g1, w1) = res[0]["grads"][k], res[1]["grads"][k]
        assert g0 == g1 and w0 == w1
        model = tiny_llama()
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(torch.tensor(w0), model.parameters())
        window = [job.payload(i) for r in res for s in r["steps"][starts[k] : ends[k] + 1] for i in s["ids"]]
        want = reference_grad(model, window)
        assert max_err(torch.tensor(g0), want) <= ATOL, (k, max_err(torch.tensor(g0), want))
    first = res[1]["steps"][: ends[0] + 1]
    assert any(s["idle"] for s in first) and not all(s["idle"] for s in first), "an IDLE step inside"


# -- one process -----------------------------------------------------------------------------------------
def test_lightning_checkpoint_resumes_after_the_last_trained_step(jobs, tmp_path):
    from batchd.client import BatchdDataModule

    job = make_job(jobs)
    module, dm = lit_module(), BatchdDataModule(job.client(0))
    trainer = lit_trainer(max_steps=3)
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 3 and len(module.steps) == 3
    assert dm.client.next_step == 4, "Lightning fetched one batch ahead"
    state = dm.state_dict()
    assert state["next_step"] == 3 and not state["finished"] and "rank" not in state
    ckpt = tmp_path / "three.ckpt"
    trainer.save_checkpoint(ckpt)
    assert torch.load(ckpt, weights_only=False)["BatchdDataModule"] == state

    resumed, dm2 = lit_module(), BatchdDataModule(lambda: job.client(0))
    trainer2 = lit_trainer()
    trainer2.fit(resumed, datamodule=dm2, ckpt_path=str(ckpt))
    assert resumed.steps[0]["step"] == 3 and dm2.client.finished and trainer2.should_stop
    ids = [i for s in module.steps + resumed.steps for i in s["ids"]]
    assert sorted(ids) == list(range(len(job.lengths))), "every id exactly once across the resume"
    assert trainer2.global_step == 3 + len(resumed.steps)


def test_lightning_epochs_follow_the_job_and_bad_setups_are_refused(jobs):
    from batchd.client import BatchdDataModule

    job = make_job(jobs, n=16, epochs=2)
    module, dm = lit_module(lr=0.01), BatchdDataModule(lambda: job.client(0))
    trainer = lit_trainer()  # max_epochs=-1: the data module stops Lightning after the job's 2 epochs
    trainer.fit(module, datamodule=dm)
    steps = [s["step"] for s in module.steps]
    starts = [k for k, s in enumerate(steps) if s == 0]
    assert len(starts) == 2 and starts[0] == 0, steps
    for a, b in zip(starts, [starts[1], len(steps)], strict=True):
        assert sorted(i for s in module.steps[a:b] for i in s["ids"]) == list(range(16)), (
            "every id once per epoch"
        )
    assert dm.client.epoch == 1 and dm.client.finished and trainer.should_stop and trainer.current_epoch == 2

    with pytest.raises(ValueError, match="epochs must be None or an integer >= 1"):
        BatchdDataModule(job.client(0), epochs=0)
    with pytest.raises(ValueError, match="rank 1 of 2"):
        lit_trainer().fit(lit_module(), datamodule=BatchdDataModule(BatchClient("127.0.0.1:1", 1, 2)))
    with pytest.raises(ValueError, match="accumulate_grad_batches=1"):
        lit_trainer(accumulate_grad_batches=2).fit(lit_module(), datamodule=BatchdDataModule(job.client(0)))


def test_lightning_updates_of_a_fixed_token_count_step_once_per_update(jobs, tmp_path):
    """tokens_per_update, manual optimization through batchd_lightning_step: one optimizer and scheduler
    step (one global_step) per batchd update; the first update's gradient is the per-token mean over all
    its samples (the steps' equal weighting is not); a checkpoint after two updates resumes at the next
    one, every id exactly once; automatic optimization is refused."""
    from batchd.client import BatchdDataModule

    job = make_job(jobs, n=96, budget=256, tokens_per_update=300)
    initial = tiny_llama()
    module, dm = lit_module(grad_steps=1, updates=True), BatchdDataModule(job.client(0))
    trainer = lit_trainer()
    trainer.fit(module, datamodule=dm)
    ends = [k for k, s in enumerate(module.steps) if s["end"]]
    assert ends[-1] == len(module.steps) - 1 and ends[0] > 0 and len(ends) > 2, ends
    assert trainer.global_step == len(ends) == module.optimizer_steps
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == len(ends)
    assert sorted(i for s in module.steps for i in s["ids"]) == list(range(96)), "every id once"
    first = [job.payload(i) for s in module.steps[: ends[0] + 1] for i in s["ids"]]
    want = reference_grad(initial, first)
    assert max_err(torch.tensor(module.grads[0][0]), want) <= ATOL
    per_step = [
        reference_grad(initial, [job.payload(i) for i in s["ids"]]) for s in module.steps[: ends[0] + 1]
    ]
    assert max_err(sum(per_step) / len(per_step), want) > 10 * ATOL, "the control must differ"

    again = make_job(jobs, n=96, budget=256, tokens_per_update=300)
    part, dm = lit_module(updates=True), BatchdDataModule(again.client(0))
    stopped = lit_trainer(max_steps=2)  # two updates
    stopped.fit(part, datamodule=dm)
    assert part.optimizer_steps == 2 and part.steps[-1]["end"]
    ckpt = tmp_path / "two.ckpt"
    stopped.save_checkpoint(ckpt)
    rest, dm2 = lit_module(updates=True), BatchdDataModule(lambda: again.client(0))
    resumed = lit_trainer()
    resumed.fit(rest, datamodule=dm2, ckpt_path=str(ckpt))
    assert (
        rest.steps[0]["step"] == part.steps[-1]["step"] + 1
        and resumed.global_step == 2 + rest.optimizer_steps
    )
    assert sorted(i for s in part.steps + rest.steps for i in s["ids"]) == list(range(96))

    plain = make_job(jobs, n=96, budget=256, tokens_per_update=300)
    with pytest.raises(ValueError, match="automatic optimization cannot follow"):
        lit_trainer().fit(lit_module(), datamodule=BatchdDataModule(plain.client(0)))
