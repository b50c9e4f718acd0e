"""No length curriculum: within an epoch the order of steps must not trend with sample length.

The ODB paper found that length-sorted batching hurts answer quality; grouping avoids it only if the
groups leave in a seeded random order. Spearman's rank correlation between step index and the step's
mean sample length, averaged over seeds, must stay near 0 for batchd's policies. Two positive
controls show the check can fail: a length-sorted schedule, and ODB 0.1.2's own overflow rule (it
keeps the groups with the most samples, so long samples drift to the end of the epoch).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import workload_dir

from batchd import read_lengths
from batchd.core import JobSpec, PolicySpec, Simulator


def _lengths(name: str) -> list[int]:
    return read_lengths(str(workload_dir() / f"{name}.txt"))


def spearman(values: list[float]) -> float:
    ranks = np.argsort(np.argsort(values))
    return float(np.corrcoef(np.arange(len(values)), ranks)[0, 1])


def step_trend(lengths: list[int], config: JobSpec) -> float:
    means = []
    for step in Simulator(lengths, config):
        ls = [x.length for s in step for x in s.samples]
        means.append(sum(ls) / len(ls))
    return spearman(means)


def mean_trend(name: str, policy: str, seeds=range(3)) -> float:
    lengths = _lengths(name)
    return float(
        np.mean(
            [
                step_trend(
                    lengths,
                    JobSpec(
                        world_size=4,
                        token_budget=8192,
                        seed=s,
                        shuffle=True,
                        policy=PolicySpec(name=policy, window=128, depth=8),
                    ),
                )
                for s in seeds
            ]
        )
    )


@pytest.mark.parametrize("policy", ["local", "balanced", "sorted", "fixed"])
@pytest.mark.parametrize("workload", ["odb-synthetic", "sharegpt4o-like"])
def test_step_order_does_not_trend_with_length(policy, workload):
    assert abs(mean_trend(workload, policy)) < 0.15


def test_positive_controls_show_the_check_can_fail():
    lengths = _lengths("odb-synthetic")
    assert spearman(sorted(lengths)[::16]) > 0.99
    assert mean_trend("odb-synthetic", "odb") > 0.3
