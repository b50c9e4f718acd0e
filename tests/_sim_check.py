"""Runs a simulated epoch and checks every protocol invariant on the way (shared by the property tests)."""

from __future__ import annotations

import math
from collections import Counter

from batchd.core import JobSpec, Simulator
from batchd.testing import synthetic_token_loss


def run_checked(lengths, config: JobSpec, local_ranks=None):
    """Runs `config` over `lengths` (`local_ranks`: the simulator's topology), asserting the per-step
    invariants; returns (sim, schedule)."""
    sim = Simulator(lengths, config, local_ranks=local_ranks)
    n = config.world_size
    cost = config.cost
    budget = config.token_budget
    schedule = []
    for index, step in enumerate(sim):
        assert len(step) == n
        assert [s.info.rank for s in step] == list(range(n))
        assert all(s.info.step == index for s in step), "ranks disagree on the step index"
        g_tokens = sum(s.info.local_tokens for s in step)
        g_loss = sum(s.info.local_loss_tokens for s in step)
        for s in step:
            assert s.info.is_idle == (not s.samples)
            assert s.info.global_tokens == g_tokens and s.info.global_loss_tokens == g_loss
            assert s.info.global_samples == sum(len(x.samples) for x in step)
            lengths_s = [x.length for x in s.samples]
            if s.samples and sim.coordinator.policy.enforces_budget:
                over = cost.cost(lengths_s) > budget
                assert not over or len(lengths_s) == 1, f"group over budget: {lengths_s} > {budget}"
            if config.policy.over_budget != "singleton":
                assert all(cost.item(x) <= budget for x in lengths_s)
            if not sim.coordinator.policy.pooled:
                assert all(x.home_rank == s.info.rank for x in s.samples), "a local policy moved a sample"
        if g_loss:
            # Loss scaling: DDP's mean of scaled rank means == the global per-token mean.
            scaled = 0.0
            for s in step:
                if s.info.local_loss_tokens:
                    rank_mean = math.fsum(synthetic_token_loss(x.id) * x.loss_tokens for x in s.samples)
                    scaled += rank_mean / s.info.local_loss_tokens * s.info.loss_scale
            ref = (
                math.fsum(synthetic_token_loss(x.id) * x.loss_tokens for s in step for x in s.samples)
                / g_loss
            )
            assert abs(scaled / n - ref) <= 1e-9 * max(1.0, abs(ref))
            assert abs(sum(s.info.loss_scale for s in step) - n) <= 1e-9 * n
        schedule.append(tuple((tuple(x.id for x in s.samples)) for s in step))
    return sim, schedule


def check_epoch(lengths, config: JobSpec, sim, schedule):
    """End-of-epoch invariants: coverage (join) or quota closure (non-join), termination bound."""
    n = config.world_size
    views = [len(range(r, len(lengths), n)) for r in range(n)]
    counts = Counter(i for step in schedule for group in step for i in group)
    rejected = {i for r in sim.ranks for i, _ in r.rejected}
    assert sim.coordinator.done
    if config.policy.over_budget == "reject":
        cost = config.cost
        over = {i for i, x in enumerate(lengths) if cost.item(x) > config.token_budget}
        # join reads every record; non-join may close its quota before reaching some of them
        assert rejected == over if config.mode == "join" else rejected <= over
    assert not (rejected & set(counts)), "a rejected sample was emitted"
    if config.mode == "join":
        expected = {i for i in range(len(lengths)) if i not in rejected}
        assert set(counts) == expected, f"missing ids: {sorted(expected - set(counts))[:10]}"
        assert all(c == 1 for c in counts.values()), "an id was emitted twice"
        assert len(schedule) <= max(views, default=0), (
            f"{len(schedule)} steps > bound {max(views, default=0)}"
        )
    else:
        quota = config.quota if config.quota is not None else len(lengths)
        emitted = sum(counts.values())
        reachable = any(views) and not rejected
        if reachable:
            assert emitted == quota, f"non-join emitted {emitted} samples, quota {quota}"
        assert emitted <= quota
