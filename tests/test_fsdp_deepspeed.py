"""FSDP2 (`fully_shard`) and DeepSpeed ZeRO-2/3 train on batchd batches with the exact loss scale.

One group of two gloo processes (spawned once for the module, deepspeed imported once per process) trains
batchd's tiny LM (`batchd.TinyCausalLM`, untied head, seeded, float32) on real in-process jobs (a
coordinator and two rank services over loopback gRPC, synthetic lengths with masked prompts), one epoch per
job, each with its own real `BatchClient`s:

* FSDP2, float32, the docs loop (`train_step` unchanged) on a skewed job whose rank 1 is IDLE from its
  second step: the first steps' unsharded gradients (``DTensor.full_tensor()``) and the ranks' mean scaled
  loss equal a single-process reference on the same global batch (each sample forwarded alone, the
  per-token mean over every sample of the step) within fp32 tolerance; DDP-style plain averaging of the
  ranks' per-token means (the wrong scale) differs measurably.
* FSDP2 with ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``: the gradient is the
  reference's to bf16 rounding, far closer than the wrong scale's.
* DeepSpeed ZeRO-2 (skewed job, IDLE steps) and ZeRO-3 (balanced job) through
  `batchd_deepspeed_backward` + ``engine.step()``: full gradients (``deepspeed.utils.safe_get_full_grad``)
  equal the reference, the control does not.
* End to end: ``python -m batchd.train --strategy fsdp2`` and ``--strategy deepspeed`` (its `main`, in the
  same processes) on two more jobs: one epoch, every id exactly once, the same steps on both ranks.

Every job: every id exactly once across the ranks, equal step counts on both ranks.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from _jobs import job_pool
from _procs import free_block, spawn

from batchd import TinyCausalLM
from batchd.client import (
    BatchClient,
    batchd_deepspeed_backward,
    token_loss_sum,
    train_step,
    weighted_steps,
)
from batchd.core import JobSpec, PolicySpec, Updates

deepspeed = pytest.importorskip("deepspeed")  # the dev extra pins it; the helper itself needs no deepspeed

VOCAB, N, BUDGET, SEED = 512, 40, 200, 7
K = 3  # steps whose gradients are checked, per run
ATOL = 2e-5  # float32; the controls differ by > 100x this
JOBS = {
    "fsdp2": True,
    "fsdp2_mp": False,
    "zero2": True,
    "zero3": False,
    "train_fsdp2": True,
    "train_deepspeed": True,
    "fsdp2_updates": True,
    "zero2_updates": True,
}
UPDATE_TOKENS = {"fsdp2_updates": 450, "zero2_updates": 450, "train_deepspeed": 450}  # updates of ~3 steps
# value: skewed (rank 0 long samples, rank 1 a few tokens each: IDLE from its second step), else balanced


def tiny_model(seed: int = 0) -> TinyCausalLM:
    torch.manual_seed(seed)
    return TinyCausalLM(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, tie_embeddings=False)


# -- the ranks -------------------------------------------------------------------------------------------
def _ds_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _fsdp2_epoch(address: str, rank: int, mixed: bool) -> dict:
    """The docs' FSDP2 loop; the optimizer records the first K steps' full gradients and parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = tiny_model()
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed
        else MixedPrecisionPolicy()
    )
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    named = list(model.named_parameters())
    records: list = []

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            if len(records) < K:  # collectives: both ranks record the same steps
                records.append(
                    {
                        "grad": {n: p.grad.full_tensor().detach().clone() for n, p in named},
                        "param": {n: p.full_tensor().detach().clone() for n, p in named},
                    }
                )
            return super().step(closure)

    optimizer = Recording(model.parameters(), lr=0.1)
    steps = []
    with BatchClient(address, rank, 2) as client:
        for batch, info in client:
            ids = batch["sample_ids"].tolist() if batch is not None and "sample_ids" in batch else []
            mean = train_step(model, optimizer, batch, info)
            steps.append(_step_log(ids, info, mean))
    return {"steps": steps, "records": records}


def _step_log(ids: list[int], info, mean: float) -> dict:
    loss = 0.0 if info.is_idle else mean * info.loss_scale
    return {
        "ids": ids,
        "idle": info.is_idle,
        "loss": loss,
        "update": info.update,
        "end": info.update_end,
        "scale": info.update_scale,  # at the update's end: what train_step multiplies the gradient by
    }


def _deepspeed_epoch(address: str, rank: int, stage: int) -> dict:
    """The docstring's DeepSpeed loop (`weighted_steps`); the gradients and parameters at the first K
    updates' ends (every step's, without tokens_per_update)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    model = tiny_model()
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=_ds_config(stage)
    )
    named = list(engine.module.named_parameters())
    records, steps = [], []
    with BatchClient(address, rank, 2) as client:
        for batch, info in weighted_steps(client):
            ids = batch["sample_ids"].tolist() if batch is not None and "sample_ids" in batch else []
            mean = batchd_deepspeed_backward(engine, batch, info)
            if len(records) < K and info.update_end:  # collectives (ZeRO gathers): both ranks record
                records.append(
                    {
                        "grad": {n: safe_get_full_grad(p).detach().clone() for n, p in named},
                        "param": {n: safe_get_full_fp32_param(p).detach().clone() for n, p in named},
                    }
                )
            engine.step()
            steps.append(_step_log(ids, info, mean))
    engine.destroy()
    return {"steps": steps, "records": records}


def _train_main(strategy: str, addresses: list[str], out_dir: str, rank: int) -> dict:
    from batchd import train

    argv = [
        "--rank-services",
        ",".join(addresses),
        "--strategy",
        strategy,
        "--epochs",
        "1",
        "--d-model",
        "64",
        "--log-every",
        "0",
        "--summary",
        os.path.join(out_dir, f"{strategy}-{{rank}}.json"),
        "--ids-log",
        os.path.join(out_dir, f"{strategy}-ids-{{rank}}.jsonl"),
    ]
    code = train.main(argv)
    assert code == 0, (strategy, code)
    summary = json.loads(Path(out_dir, f"{strategy}-{rank}.json").read_text(encoding="utf-8"))
    lines = Path(out_dir, f"{strategy}-ids-{rank}.jsonl").read_text(encoding="utf-8").splitlines()
    return {"summary": summary, "ids": [json.loads(line)["ids"] for line in lines]}


def _rank_main(rank: int, ports: list[int], addresses: dict[str, list[str]], out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
        DS_ACCELERATOR="cpu",
    )
    torch.set_num_threads(1)
    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op on its first init (~40 s, cached in
    # ~/.cache/torch_extensions), used only by inference_all_reduce: off, training reduces over gloo
    deepspeed.ops.__compatible_ops__ = {**deepspeed.ops.__compatible_ops__, "deepspeed_shm_comm": False}
    out: dict = {"wall_s": {}}
    # batchd.train runs first: it makes and destroys its own process group, once per strategy
    for strategy, port in zip(("fsdp2", "deepspeed"), ports[1:], strict=True):
        os.environ["MASTER_PORT"] = str(port)
        t0 = time.perf_counter()
        out[f"train_{strategy}"] = _train_main(strategy, addresses[f"train_{strategy}"], out_dir, rank)
        out["wall_s"][f"train_{strategy}"] = time.perf_counter() - t0
    os.environ["MASTER_PORT"] = str(ports[0])
    dist.init_process_group("gloo")
    for name, run in (
        ("fsdp2", lambda a: _fsdp2_epoch(a, rank, mixed=False)),
        ("fsdp2_mp", lambda a: _fsdp2_epoch(a, rank, mixed=True)),
        ("zero2", lambda a: _deepspeed_epoch(a, rank, 2)),
        ("zero3", lambda a: _deepspeed_epoch(a, rank, 3)),
        ("fsdp2_updates", lambda a: _fsdp2_epoch(a, rank, mixed=False)),
        ("zero2_updates", lambda a: _deepspeed_epoch(a, rank, 2)),
    ):
        t0 = time.perf_counter()
        out[name] = run(addresses[name][rank])
        out["wall_s"][name] = time.perf_counter() - t0
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    deepspeed.comm.destroy_process_group()  # DeepSpeed wraps the group: it releases what it cached of it


# -- the reference ---------------------------------------------------------------------------------------
def reference(params: dict[str, torch.Tensor], payloads: list[dict]) -> tuple[dict[str, torch.Tensor], float]:
    """The gradient (by name) and value of the per-token mean loss over `payloads`, each forwarded alone."""
    model = tiny_model()
    model.load_state_dict({n: p.float() for n, p in params.items()})
    sums, count = [], 0
    for p in payloads:
        logits = model(torch.as_tensor(p["input_ids"], dtype=torch.int64)[None])
        s, n = token_loss_sum(logits, torch.as_tensor(p["labels"], dtype=torch.int64)[None])
        sums.append(s)
        count += n
    loss = torch.stack(sums).sum() / count
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}, float(loss.detach())


def max_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    return max(float((got[n].float() - want[n]).abs().max()) for n in want)


def rel_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    num = sum(float(((got[n].float() - want[n]) ** 2).sum()) for n in want)
    return (num / sum(float((w**2).sum()) for w in want.values())) ** 0.5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both ranks' results of every run, and the jobs (spawned once for the module)."""
    out_dir = tmp_path_factory.mktemp("fsdp_ds")
    with job_pool(vocab_size=VOCAB) as start:
        jobs = {}
        for name, skewed in JOBS.items():
            spec = JobSpec(
                world_size=2,
                token_budget=BUDGET,
                seed=SEED,
                shuffle=not skewed,
                policy=PolicySpec(
                    name="local" if skewed else "balanced", window=16, depth=3, collate="padded"
                ),
                updates=Updates(tokens_per_update=UPDATE_TOKENS.get(name)),
            )
            rng = np.random.default_rng(3)
            lengths = (
                [150 if i % 2 == 0 else 5 for i in range(N)]
                if skewed
                else np.clip(rng.lognormal(3.3, 0.6, N), 3, 120).astype(int).tolist()
            )
            jobs[name] = start(spec, lengths)
        addresses = {name: [f"127.0.0.1:{port}" for port in job.ports] for name, job in jobs.items()}
        base = free_block(3)
        spawn(_rank_main, ([base + i for i in range(3)], addresses, str(out_dir)), nprocs=2, limit_s=120)
    # the jobs are stopped (their threads would compete with the references); payload() needs only the lengths
    ranks = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return {"jobs": jobs, "ranks": ranks}


def _check_epoch(runs: dict, name: str) -> list[tuple[dict, dict]]:
    """Every id once, the same steps on both ranks; the steps pairwise."""
    r0, r1 = (r[name]["steps"] for r in runs["ranks"])
    assert len(r0) == len(r1) > K, (name, len(r0), len(r1))
    assert sorted(i for s in r0 + r1 for i in s["ids"]) == list(range(N)), name
    return list(zip(r0, r1, strict=True))


def _check_gradients(runs: dict, name: str, atol: float | None) -> tuple[list[float], list[float]]:
    """The first K updates (steps, without tokens_per_update): the full gradient and the mean scaled
    loss against the reference over every sample of the update on both ranks; the control's gap.
    Returns (errors, gaps) (relative errors when `atol` is None: mixed precision)."""
    job, steps = runs["jobs"][name], _check_epoch(runs, name)
    rec0, rec1 = (r[name]["records"] for r in runs["ranks"])
    updates: list[list[tuple[dict, dict]]] = [[]]
    for s0, s1 in steps:
        assert (s0["update"], s0["end"]) == (s1["update"], s1["end"]), "the ranks agree on the updates"
        updates[-1].append((s0, s1))
        if s0["end"]:
            updates.append([])
    errors, gaps = [], []
    for k in range(K):
        assert (
            max_err(rec0[k]["grad"], rec1[k]["grad"]) == 0
            and max_err(rec0[k]["param"], rec1[k]["param"]) == 0
        )
        p0, p1 = (
            [job.payload(i) for s in (pair[r] for pair in updates[k]) for i in s["ids"]] for r in (0, 1)
        )
        for s0, s1 in updates[k]:
            assert s0["idle"] == (not s0["ids"]) and s1["idle"] == (not s1["ids"])
        params = rec0[k]["param"]
        want, loss = reference(params, p0 + p1)
        got = rec0[k]["grad"]
        errors.append(max_err(got, want) if atol is not None else rel_err(got, want))
        if atol is not None:
            got_loss = sum(s0["loss"] + s1["loss"] for s0, s1 in updates[k]) / 2 * updates[k][-1][0]["scale"]
            assert abs(got_loss - loss) < 1e-5, (name, k, got_loss, loss)
        # the control: the plain mean of the ranks' per-token means (an IDLE rank contributes zeros)
        per_rank = [
            reference(params, p)[0] if p else {n: torch.zeros_like(w) for n, w in want.items()}
            for p in (p0, p1)
        ]
        naive = {n: (per_rank[0][n] + per_rank[1][n]) / 2 for n in want}
        gaps.append(max_err(naive, want) if atol is not None else rel_err(naive, want))
    if atol is not None:
        assert max(errors) <= atol, (name, errors)
        assert max(gaps) > 100 * atol, (name, gaps)
    return errors, gaps


@pytest.mark.slow
def test_fsdp2_gradients_equal_the_single_process_reference(runs):
    """FSDP2 float32 through train_step, IDLE steps included: gradient and loss are the global per-token
    mean's; the plain average of the ranks' means is not."""
    _check_gradients(runs, "fsdp2", ATOL)
    assert any(s0["idle"] or s1["idle"] for s0, s1 in _check_epoch(runs, "fsdp2")[:K]), "no IDLE step checked"


@pytest.mark.slow
def test_fsdp2_mixed_precision_keeps_the_scale(runs):
    """bf16 parameters, fp32 reduce: the gradient is the reference's to bf16 rounding; the wrong scale is
    many times further."""
    errors, gaps = _check_gradients(runs, "fsdp2_mp", None)  # relative: ~0.007 and 0.04-0.4 here
    assert max(errors) < 0.02 and all(g > 3 * e for e, g in zip(errors, gaps, strict=True)), (errors, gaps)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_gradients_equal_the_single_process_reference(runs, stage):
    """DeepSpeed ZeRO-2 (IDLE steps included) and ZeRO-3 via batchd_deepspeed_backward: the full gradient
    is the global per-token mean's."""
    _check_gradients(runs, f"zero{stage}", ATOL)
    if stage == 2:
        assert any(s0["idle"] or s1["idle"] for s0, s1 in _check_epoch(runs, "zero2")[:K]), (
            "no IDLE step checked"
        )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp2_updates", "zero2_updates"])
def test_updates_of_several_steps_give_the_updates_per_token_mean(runs, name):
    """tokens_per_update: FSDP2 through train_step (local accumulation, one reduce-scatter per update,
    the gradient rescaled at the end) and ZeRO-2 through weighted_steps (each step weighed over its
    update, the engine's accumulation boundary at the update's end): each update's gradient is the
    per-token mean over all its samples on both ranks, an IDLE step inside included."""
    steps = _check_epoch(runs, name)
    ends = [k for k, (s0, _) in enumerate(steps) if s0["end"]]
    assert len(ends) > K and ends[0] > 0, ("updates of several steps", ends)
    assert len(runs["ranks"][0][name]["records"]) == K  # recorded at update ends only
    _check_gradients(runs, name, ATOL)
    first = steps[: ends[K - 1] + 1]
    assert any(s1["idle"] for _, s1 in first) and any(not s1["idle"] for _, s1 in first), (
        "an IDLE step inside"
    )


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp2", "deepspeed"])
def test_batchd_train_strategy_runs_an_epoch(runs, strategy):
    """`python -m batchd.train --strategy fsdp2|deepspeed` against a real job: one epoch, every id once,
    the same steps on both ranks, a finite last loss on a rank that trained."""
    res = [r[f"train_{strategy}"] for r in runs["ranks"]]
    s0, s1 = (r["summary"] for r in res)
    assert s0["steps"] == s1["steps"] == len(res[0]["ids"]) == len(res[1]["ids"]) > 2
    assert s0["epoch_steps"] == [s0["steps"]] and s1["idle"] > 0  # the skewed job: rank 1 IDLE
    assert sorted(i for r in res for ids in r["ids"] for i in ids) == list(range(N))
    assert s0["strategy"] == strategy and np.isfinite(s0["last_loss"])


def test_batchd_deepspeed_backward_refuses_gradient_accumulation():
    class Engine:
        def gradient_accumulation_steps(self):
            return 4

    class Info:
        is_idle, loss_scale, local_loss_tokens = False, 1.0, 3

    with pytest.raises(ValueError, match="gradient_accumulation_steps = 1.*steps=4"):
        batchd_deepspeed_backward(Engine(), None, Info)


def test_batchd_train_refuses_a_strategy_it_cannot_run(monkeypatch, capsys, tmp_path):
    """--strategy fsdp2/deepspeed with --hf-model, a --checkpoint DIR another strategy saved into, or a
    sharded checkpoint of another world size (a resize): exit 2 in one line, before the rendezvous."""
    from batchd import train

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert train.main(["--base-port", "7100", "--strategy", "fsdp2", "--hf-model", "x"]) == 2
    err = capsys.readouterr().err
    assert "batchd.train: error: --strategy fsdp2 trains the tiny LM only" in err, err
    ddp = tmp_path / "ddp"
    ddp.mkdir()
    (ddp / "rank-0.pt").write_bytes(b"")
    assert train.main(["--base-port", "7100", "--strategy", "fsdp2", "--checkpoint", str(ddp)]) == 2
    err = capsys.readouterr().err
    assert f"--checkpoint {ddp} holds a --strategy ddp checkpoint, got --strategy fsdp2" in err, err
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    pointer = {"strategy": "deepspeed", "dir": "deepspeed-3", "seq": 3, "world_size": 4, "epoch": 0}
    (sharded / "latest.json").write_text(json.dumps({**pointer, "next_step": 9}))
    assert train.main(["--base-port", "7100", "--strategy", "deepspeed", "--checkpoint", str(sharded)]) == 2
    err = capsys.readouterr().err
    assert "--strategy deepspeed resumes at the world size it saved at" in err, err
