"""The decisive loss-scaling test: real DDP gradients equal the single-process per-token gradient.

Four gloo processes (spawned once for the module) replay steps produced by the real batching core
(`batchd.core.Simulator`, policies "local" and "balanced") over 62 random lengths. Sample payloads are
generated deterministically per id (random tokens, a random-length prompt masked with -100, a few
samples with no loss at all), so a sample's true loss tokens differ from its length; each step's
`Sample.loss_tokens`, totals and `loss_scale` are therefore rebuilt from the payloads with
`batchd.core.loss_scale`. Every rank runs `train_step` on its group (padded and packed layouts
alternate; IDLE ranks run the zero-weight dummy step) under DDP in float64, and after each step the
averaged gradients must equal, within 1e-5, the gradient of a reference copy of the model on the union
of the step's samples (each sample alone, unpadded) with the global per-token mean loss. A control
checks the test can fail: plain DDP averaging of the per-rank means is measurably different.

Single-process unit tests of `token_loss_sum` / `scaled_loss` / `train_step` argument handling sit at
the end.
"""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _procs import gloo_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

from batchd.client import collate_packed, collate_padded, loss_tokens, scaled_loss, token_loss_sum, train_step
from batchd.core import JobSpec, PolicySpec, Simulator, Step, loss_scale
from batchd.testing import IGNORE_INDEX, TinyCausalLM, UpdateWindows, update_scale

WORLD = 4
SPAWN_DEADLINE_S = 300.0  # liveness backstop for the spawned ranks (`_procs.gloo_ranks`)
PG_TIMEOUT_S = 60
UPDATE_TOKENS = 900  # tokens_per_update of the update case: about three steps of 4 ranks
VOCAB = 128
NUM_SAMPLES = 62
MAX_STEPS = 8
ATOL = 1e-5
POLICIES = ("local", "balanced")


# -- workload: the real core's steps, rescaled with the payloads' true loss tokens -------------------
def make_payload(sample_id: int, length: int) -> dict[str, np.ndarray]:
    """Deterministic per id: random tokens, a masked prompt; every 13th sample carries no loss."""
    rng = np.random.default_rng([20240531, sample_id])
    ids = rng.integers(0, VOCAB, length).astype(np.int32)
    labels = ids.astype(np.int64)
    labels[: int(rng.integers(0, length))] = IGNORE_INDEX
    if sample_id % 13 == 5:
        labels[:] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels}


def rescale(step: tuple[Step, ...], true_loss: dict[int, int]) -> list[Step]:
    """The global step with each Sample's loss_tokens, the totals and the loss scales recomputed."""
    groups = [tuple(s.replace(loss_tokens=true_loss[s.id]) for s in st.samples) for st in step]
    local = [sum(s.loss_tokens for s in g) for g in groups]
    total = sum(local)
    return [
        Step(
            g,
            dataclasses.replace(
                st.info,
                local_loss_tokens=t,
                global_loss_tokens=total,
                loss_scale=loss_scale(t, total, len(step)),
            ),
        )
        for g, st, t in zip(groups, step, local, strict=False)
    ]


def build_case(policy: str) -> dict:
    """The first seed whose simulated epoch has an IDLE rank: up to MAX_STEPS steps (two IDLE ones
    included), rescaled, in epoch order, and the payloads."""
    for seed in range(64):
        rng = random.Random(seed)
        lengths = [rng.randint(4, 96) for _ in range(NUM_SAMPLES)]
        config = JobSpec(
            shuffle=False,
            world_size=WORLD,
            token_budget=192,
            policy=PolicySpec(name=policy, window=8, depth=8),
        )
        steps = list(Simulator(lengths, config))
        idle = [j for j, st in enumerate(steps) if any(s.info.is_idle for s in st)]
        if idle:
            break
    else:
        raise AssertionError(f"no seed gives an IDLE rank for {policy=}")
    payloads = {i: make_payload(i, n) for i, n in enumerate(lengths)}
    true_loss = {i: loss_tokens(p["labels"]) for i, p in payloads.items()}
    chosen = sorted(set(idle[:2]) | (set(range(MAX_STEPS - len(idle[:2]))) & set(range(len(steps)))))
    return {
        "policy": policy,
        "seed": seed,
        "steps": [rescale(steps[j], true_loss) for j in chosen],
        "payloads": payloads,
        "step_ids": chosen,
        "all_steps": len(steps),
    }


def build_update_case() -> dict:
    """Optimizer updates of a fixed token count: a simulated epoch (policy local) whose steps carry the
    payloads' true loss tokens, and update boundaries, loss scales and update scales recomputed from
    them by the core's `UpdateWindows` (as the coordinator and the rank state do). The first seed whose
    epoch has an update of several steps with an IDLE rank inside."""
    g = UPDATE_TOKENS
    for seed in range(64):
        rng = random.Random(1000 + seed)
        lengths = [rng.randint(4, 96) for _ in range(NUM_SAMPLES)]
        spec = JobSpec(
            shuffle=False,
            world_size=WORLD,
            token_budget=192,
            policy=PolicySpec(name="local", window=8, depth=8),
        )
        payloads = {i: make_payload(i, n) for i, n in enumerate(lengths)}
        true_loss = {i: loss_tokens(p["labels"]) for i, p in payloads.items()}
        steps = [rescale(st, true_loss) for st in Simulator(lengths, spec)]
        totals = [st[0].info.global_loss_tokens for st in steps]
        ends = UpdateWindows(g, "tokens").close(
            [sum(s.info.local_samples for s in st) for st in steps], totals, True
        )
        out, update, position = [], 0, 0
        for st, end, window in zip(steps, ends.ends, ends.loss_tokens, strict=True):
            out.append(
                [
                    Step(
                        x.samples,
                        dataclasses.replace(
                            x.info,
                            loss_scale=WORLD * x.info.local_loss_tokens / g,
                            update=update,
                            update_step=position,
                            update_end=end,
                            update_scale=update_scale(g, window) if end else 1.0,
                            update_loss_tokens=window if end else 0,
                        ),
                    )
                    for x in st
                ]
            )
            update, position = (update + 1, 0) if end else (update, position + 1)
        first = [j for j, st in enumerate(out) if st[0].info.update_end]
        windows = list(zip([0] + [j + 1 for j in first], [j + 1 for j in first], strict=False))
        if any(b - a >= 3 and any(x.info.is_idle for st in out[a:b] for x in st) for a, b in windows):
            return {"policy": "updates", "seed": seed, "steps": out, "payloads": payloads}
    raise AssertionError("no seed gives an update of several steps with an IDLE rank inside")


# -- the distributed worker -----------------------------------------------------------------------------
def make_model() -> TinyCausalLM:
    torch.manual_seed(1234)
    return TinyCausalLM(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2).double()


def sample_loss_sums(model: TinyCausalLM, payloads: list[dict]) -> list[torch.Tensor]:
    """Each sample's summed shifted CE, computed alone (no padding, no packing)."""
    out = []
    for p in payloads:
        batch = collate_padded([p])
        out.append(token_loss_sum(model(batch["input_ids"]), batch["labels"])[0])
    return out


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in model.parameters()]
    )


def reference_grad(model: TinyCausalLM, step: list[Step], payloads: dict) -> torch.Tensor:
    """Gradient of the global per-token mean over the union of the step's samples, one process."""
    model.zero_grad(set_to_none=True)
    union = [payloads[s.id] for st in step for s in st.samples]
    total = step[0].info.global_loss_tokens
    if total:
        (torch.stack(sample_loss_sums(model, union)).sum() / total).backward()
    return flat_grad(model)


def naive_grad(model: TinyCausalLM, step: list[Step], payloads: dict) -> torch.Tensor:
    """The control: plain DDP averaging of unscaled per-rank means (what batchd's scale corrects)."""
    model.zero_grad(set_to_none=True)
    means = [
        torch.stack(sample_loss_sums(model, [payloads[s.id] for s in st.samples])).sum()
        / st.info.local_loss_tokens
        for st in step
        if st.info.local_loss_tokens
    ]
    if means:
        (torch.stack(means).sum() / len(step)).backward()
    return flat_grad(model)


def run_case(rank: int, case: dict) -> dict:
    model, ref = make_model(), make_model()
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
    out = {"errors": [], "naive_gaps": [], "idle": [], "mean_errors": [], "grad_norms": []}
    for j, step in enumerate(case["steps"]):
        mine = step[rank]
        ref.load_state_dict(model.state_dict())  # the pre-step weights
        group = [case["payloads"][s.id] for s in mine.samples]
        batch = None if mine.info.is_idle else (collate_padded if j % 2 == 0 else collate_packed)(group)
        mean = train_step(ddp, optimizer, batch, mine.info)
        got, want = flat_grad(model), reference_grad(ref, step, case["payloads"])
        out["errors"].append(float((got - want).abs().max()))
        out["grad_norms"].append(float(want.norm()))
        out["naive_gaps"].append(float((naive_grad(ref, step, case["payloads"]) - want).abs().max()))
        out["idle"].append(mine.info.is_idle)
        if mine.info.local_loss_tokens:
            with torch.no_grad():
                expected = float(sum(sample_loss_sums(ref, group))) / mine.info.local_loss_tokens
            out["mean_errors"].append(abs(mean - expected))
        else:
            out["mean_errors"].append(0.0 if math.isnan(mean) else math.inf)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rank0 = params.clone()
    dist.broadcast(rank0, src=0)
    out["param_drift"] = float((params - rank0).abs().max())
    return out


def run_update_case(rank: int, case: dict) -> dict:
    """`train_step` over updates of several steps: after each update's last step, the gradient it
    stepped with against the single-process per-token mean over all of the update's samples (from the
    weights before the update), and the control's: each step scaled by its own tokens."""
    model, ref = make_model(), make_model()
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    out = {"errors": [], "control_gaps": [], "window_steps": [], "optimizer_steps": 0, "lr_steps": 0}
    window: list[list[Step]] = []
    counted = optimizer.step

    def counting_step(*args, **kwargs):
        out["optimizer_steps"] += 1
        return counted(*args, **kwargs)

    optimizer.step = counting_step
    for step in case["steps"]:
        mine = step[rank]
        if mine.info.update_step == 0:
            ref.load_state_dict(model.state_dict())  # the weights before the update
            window = []
        window.append(step)
        group = [case["payloads"][s.id] for s in mine.samples]
        batch = None if mine.info.is_idle else collate_padded(group)
        train_step(ddp, optimizer, batch, mine.info, scheduler)
        if not mine.info.update_end:
            continue
        union = [case["payloads"][s.id] for st in window for x in st for s in x.samples]
        ref.zero_grad(set_to_none=True)
        (torch.stack(sample_loss_sums(ref, union)).sum() / mine.info.update_loss_tokens).backward()
        want = flat_grad(ref)
        ref.zero_grad(set_to_none=True)
        per_step = [
            torch.stack(sample_loss_sums(ref, [case["payloads"][s.id] for x in st for s in x.samples])).sum()
            / st[0].info.global_loss_tokens
            for st in window
            if st[0].info.global_loss_tokens
        ]
        torch.stack(per_step).sum().backward()
        out["errors"].append(float((flat_grad(model) - want).abs().max()))
        out["control_gaps"].append(float((flat_grad(ref) - want).abs().max()))
        out["window_steps"].append(len(window))
    out["lr_steps"] = scheduler.last_epoch
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rank0 = params.clone()
    dist.broadcast(rank0, src=0)
    out["param_drift"] = float((params - rank0).abs().max())
    return out


def run_rank(rank: int, cases: list[dict]) -> dict:
    """One spawned rank's results per case (`_procs.gloo_rank` runs it in the gloo group: a file
    rendezvous, since a port picked free by the parent could be taken before rank 0 binds it, and
    faulthandler on, so a native SIGABRT in gloo prints where every thread was)."""
    return {
        case["policy"]: (run_update_case if case["policy"] == "updates" else run_case)(rank, case)
        for case in cases
    }


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> dict:
    cases = [*(build_case(p) for p in POLICIES), build_update_case()]
    out_dir = tmp_path_factory.mktemp("ddp")
    ranks = gloo_ranks(run_rank, (cases,), WORLD, out_dir, SPAWN_DEADLINE_S, PG_TIMEOUT_S)
    return {"cases": {c["policy"]: c for c in cases}, "ranks": ranks}


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_ddp_gradient_equals_global_per_token_gradient(ddp_run, policy):
    case, per_rank = ddp_run["cases"][policy], [r[policy] for r in ddp_run["ranks"]]
    steps = case["steps"]
    # the workload exercises what the scale is for: an IDLE rank, unequal token counts
    assert any(st.info.is_idle for step in steps for st in step), case["step_ids"]
    assert any(len({st.info.local_loss_tokens for st in step}) > 1 for step in steps)
    assert any(s.loss_tokens != s.length for step in steps for st in step for s in st.samples)
    for step in steps:
        scales = sum(st.info.loss_scale for st in step)
        assert math.isclose(scales, WORLD) or step[0].info.global_loss_tokens == 0
    for rank, res in enumerate(per_rank):
        assert res["idle"] == [step[rank].info.is_idle for step in steps]
        assert max(res["errors"]) <= ATOL, (rank, res["errors"])
        assert max(res["mean_errors"]) <= 1e-9, (rank, res["mean_errors"])
        assert res["param_drift"] == 0.0
    # control: without the scale DDP's gradient is measurably different, so the check above can fail
    assert max(per_rank[0]["naive_gaps"]) > 100 * ATOL, per_rank[0]["naive_gaps"]


@pytest.mark.slow
def test_an_update_of_several_steps_steps_with_the_per_token_mean_over_all_of_them(ddp_run):
    case, per_rank = ddp_run["cases"]["updates"], [r["updates"] for r in ddp_run["ranks"]]
    updates = sum(st[0].info.update_end for st in case["steps"])
    for rank, res in enumerate(per_rank):
        assert len(res["errors"]) == updates and max(res["window_steps"]) >= 3, res["window_steps"]
        assert max(res["errors"]) <= ATOL, (rank, res["errors"])
        assert res["optimizer_steps"] == res["lr_steps"] == updates  # one step per update, not per step
        assert res["param_drift"] == 0.0
    # control: scaling each step by its own tokens inside an update is measurably off
    assert max(per_rank[0]["control_gaps"]) > 100 * ATOL, per_rank[0]["control_gaps"]


# -- single-process unit tests -------------------------------------------------------------------------
@pytest.fixture
def tiny() -> tuple[TinyCausalLM, dict]:
    model = make_model()
    batch = collate_padded([make_payload(1, 9), make_payload(2, 5)])
    return model, batch


def test_token_loss_sum_matches_mean_cross_entropy(tiny):
    model, batch = tiny
    logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    loss_sum, n = token_loss_sum(logits, batch["labels"])
    assert n == loss_tokens(batch["labels"][0]) + loss_tokens(batch["labels"][1])
    mean = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1)
    )
    assert torch.allclose(loss_sum / n, mean)
    assert token_loss_sum(logits.float(), batch["labels"])[0].dtype == torch.float32
    assert token_loss_sum(logits.half(), batch["labels"])[0].dtype == torch.float32
    with pytest.raises(ValueError, match="labels"):
        token_loss_sum(logits, batch["labels"][:, :3])


def test_scaled_loss_is_scaled_mean(tiny):
    model, batch = tiny
    logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    loss_sum, n = token_loss_sum(logits, batch["labels"])
    assert torch.allclose(scaled_loss(logits, batch["labels"], 2.5, n), loss_sum / n * 2.5)
    with pytest.raises(ValueError, match="Sample.loss_tokens"):
        scaled_loss(logits, batch["labels"], 1.0, n + 1)
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="loss_scale"):
            scaled_loss(logits, batch["labels"], bad, n)
    with pytest.raises(ValueError, match="local_loss_tokens=-1"):
        scaled_loss(logits, batch["labels"], 1.0, -1)


def test_zero_weight_loss_reaches_every_parameter(tiny):
    model, batch = tiny
    logits = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    loss = scaled_loss(logits, batch["labels"], 0.0, 0)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and not p.grad.any(), name


def test_train_step_idle_and_errors(tiny):
    model, batch = tiny
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    info = (
        Simulator(
            [3],
            JobSpec(
                shuffle=False,
                world_size=2,
                token_budget=8,
                policy=PolicySpec(name="local", window=512, depth=8),
            ),
        )
        .next_step()[1]
        .info
    )
    assert info.is_idle
    assert math.isnan(train_step(model, optimizer, None, info))
    assert all(
        torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=False)
    )  # zero gradient, no move
    busy = dataclasses.replace(info, is_idle=False, local_loss_tokens=3, loss_scale=1.0)
    with pytest.raises(ValueError, match="batch=None"):
        train_step(model, optimizer, None, busy)
    with pytest.raises(ValueError, match="Sample.loss_tokens"):
        train_step(model, optimizer, batch, busy)
