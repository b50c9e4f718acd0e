"""Pipeline microbatches: `batchd.core.balanced_split` (pure, property-tested against brute force) and
`batchd.client.microbatches` (a real step split into parts whose losses and gradients add up exactly to
the step's, padded and packed, IDLE and short steps included)."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import batchd
from batchd.client import collate_packed, collate_padded, forward_logits, microbatches, scaled_loss
from batchd.core import StepInfo, balanced_split
from batchd.testing import chunk_split


def _loads(costs, parts):
    return [sum(costs[i] for i in p) for p in parts]


@given(costs=st.lists(st.integers(0, 1000), max_size=7), m=st.integers(1, 3))
def test_balanced_split_is_a_partition_within_the_lpt_bound_of_the_optimum(costs, m):
    parts = balanced_split(costs, m)
    assert len(parts) == m and all(p == sorted(p) for p in parts)
    assert sorted(i for p in parts for i in p) == list(range(len(costs)))
    loads = _loads(costs, parts)
    best = min(
        (
            max(_loads(costs, [[i for i, a in enumerate(assign) if a == j] for j in range(m)]))
            for assign in itertools.product(range(m), repeat=len(costs))
        ),
        default=0,
    )
    assert max(loads) <= (4 / 3 - 1 / (3 * m)) * best + 1e-9
    hi = max(range(m), key=lambda j: loads[j])
    assert max(loads) - min(loads) <= max((costs[i] for i in parts[hi]), default=0)


@given(costs=st.lists(st.floats(0, 1e4, allow_nan=False), max_size=60), m=st.integers(1, 8))
def test_balanced_split_is_never_worse_than_lpt_and_deterministic(costs, m):
    parts = balanced_split(costs, m)
    assert parts == balanced_split(list(costs), m)
    lpt = [0.0] * m
    for c in sorted(costs, reverse=True):
        lpt[lpt.index(min(lpt))] += c
    assert max(_loads(costs, parts)) <= max(lpt) + 1e-6


def test_chunk_split_and_refusals():
    assert chunk_split(7, 3) == [[0, 1, 2], [3, 4], [5, 6]] and chunk_split(1, 3) == [[0], [], []]
    with pytest.raises(ValueError, match="m"):
        balanced_split([1.0], 0)
    with pytest.raises(ValueError, match="costs must be >= 0"):
        balanced_split([1.0, -2.0], 2)


# -- microbatches of a real collated step ----------------------------------------------------------------

VOCAB = 64


def _payloads(lengths, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(1, VOCAB, n)
        labels = ids.copy()
        labels[: max(1, n // 3)] = -100  # a masked prompt: loss tokens differ from lengths
        out.append({"input_ids": ids, "labels": labels})
    return out


def _info(payloads, scale=1.7, idle=False) -> StepInfo:
    t = 0 if idle else sum(batchd.loss_tokens(p["labels"]) for p in payloads)
    n = 0 if idle else sum(len(p["input_ids"]) for p in payloads)
    return StepInfo(
        rank=0,
        step=3,
        round=1,
        is_idle=idle,
        local_samples=0 if idle else len(payloads),
        local_tokens=n,
        local_loss_tokens=t,
        global_samples=9,
        global_tokens=999,
        global_loss_tokens=500,
        loss_scale=0.0 if idle else scale,
        cost=float(n),
    )


def _grad(model, parts):
    model.zero_grad(set_to_none=True)
    total = 0.0
    for micro, mi in parts:
        loss = scaled_loss(forward_logits(model, micro), micro["labels"], mi.loss_scale, mi.local_loss_tokens)
        loss.backward()
        total += float(loss.detach())
    return total, torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_microbatches_add_up_to_the_step_exactly(layout):
    torch.manual_seed(0)
    model = batchd.TinyCausalLM(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=2).double()
    payloads = _payloads([37, 5, 90, 12, 64, 3, 41])
    batch = (collate_packed if layout == "packed" else collate_padded)(payloads)
    batch["sample_ids"] = torch.arange(10, 17)
    info = _info(payloads)
    whole, g_whole = _grad(model, [(batch, info)])
    parts = microbatches(batch, info, 3)
    assert sorted(int(i) for micro, _ in parts for i in micro["sample_ids"]) == list(range(10, 17))
    assert sum(mi.local_loss_tokens for _, mi in parts) == info.local_loss_tokens
    assert all(mi.global_loss_tokens == info.global_loss_tokens for _, mi in parts)
    split, g_split = _grad(model, parts)
    assert split == pytest.approx(whole, rel=1e-12) and torch.allclose(
        g_split, g_whole, rtol=1e-10, atol=1e-12
    )
    # control: the step's scale on every part (not x t_m / t_r) gives another gradient
    wrong = [(micro, dataclasses.replace(mi, loss_scale=info.loss_scale)) for micro, mi in parts]
    _, g_wrong = _grad(model, wrong)
    assert (g_wrong - g_whole).abs().max() > 1e-3


def test_microbatches_balance_by_cost_and_pad_short_and_idle_steps():
    payloads = _payloads([400, 390, 30, 20, 20, 10, 10, 10])
    batch = collate_packed(payloads)
    batch["sample_ids"] = torch.arange(8)
    parts = microbatches(batch, _info(payloads), 2, cost="packed")
    assert sorted(mi.local_tokens for _, mi in parts) == [440, 450], "by tokens, not by count"
    assert [int(micro["cu_seqlens"][-1]) for micro, _ in parts] == [mi.local_tokens for _, mi in parts]
    few = microbatches(batch, _info(payloads), 10)
    assert sum(mi.is_idle for _, mi in few) == 2 and all(mi.loss_scale == 0 for _, mi in few if mi.is_idle)
    idle = microbatches(collate_padded(_payloads([1])), _info([], idle=True), 3)
    assert len(idle) == 3 and all(mi.is_idle and micro["input_ids"].shape == (1, 1) for micro, mi in idle)
    with pytest.raises(ValueError, match="loss tokens"):
        microbatches(batch, _info(payloads[:3]), 2)
    with pytest.raises(ValueError, match="images"):
        microbatches({**batch, "pixel_values": torch.zeros(1, 3)}, _info(payloads), 2)


def test_pipeline_steps_weigh_each_step_by_its_share_of_the_pipeline_steps_tokens():
    """Over a pipeline step of m batchd steps on N ranks, rank r's step j gets scale N t_rj / sum_j T_j:
    the summed gradient is the per-token mean over every loss token of the pipeline step."""
    n, m = 2, 3
    t = [[5, 0, 7, 2], [3, 9, 0, 4]]  # per rank, per step: local loss tokens (0: IDLE)
    totals = [t[0][j] + t[1][j] for j in range(4)]
    for r in range(n):
        steps = [
            (
                {"sample_ids": torch.tensor([j])},
                StepInfo(
                    rank=r,
                    step=j,
                    round=0,
                    is_idle=t[r][j] == 0,
                    local_samples=int(t[r][j] > 0),
                    local_tokens=t[r][j],
                    local_loss_tokens=t[r][j],
                    global_samples=2,
                    global_tokens=totals[j],
                    global_loss_tokens=totals[j],
                    loss_scale=n * t[r][j] / totals[j],
                    cost=1.0,
                ),
            )
            for j in range(4)
        ]
        windows = list(batchd.pipeline_steps(steps, m))
        assert [len(w) for w in windows] == [m, m], "the epoch's last pipeline step is filled with IDLE steps"
        assert [mi.is_idle for _, mi in windows[1]][1:] == [True, True]
        for w, first in zip(windows, (0, 3), strict=False):
            window_total = sum(totals[first : first + m])
            for j, (_, mi) in enumerate(w):
                expect = n * t[r][first + j] / window_total if first + j < 4 else 0.0
                assert mi.loss_scale == pytest.approx(expect)
    with pytest.raises(ValueError, match="m"):
        batchd.pipeline_steps([], 0)
