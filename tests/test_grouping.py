"""Grouping functions: budget respected, every index once, count-optimality against brute force."""

import functools

from hypothesis import given
from hypothesis import strategies as st

from batchd.core import contiguous_greedy
from batchd.testing import best_fit_decreasing, fixed_chunks, odb_greedy, odb_split, split_largest

lengths_st = st.lists(st.integers(1, 600), min_size=0, max_size=40).map(lambda xs: sorted(xs, reverse=True))
budget_st = st.integers(1, 2000)


def _is_partition(groups, n):
    flat = sorted(i for g in groups for i in g)
    return flat == list(range(n)) and all(groups)


@given(lengths_st, budget_st)
def test_contiguous_greedy_respects_budget_and_partitions(lengths, budget):
    groups = contiguous_greedy(lengths, budget)
    assert _is_partition(groups, len(lengths))
    for g in groups:
        assert len(g) * max(lengths[i] for i in g) <= budget or len(g) == 1


@given(
    st.lists(st.integers(1, 300), max_size=14).map(lambda xs: sorted(xs, reverse=True)), st.integers(1, 900)
)
def test_contiguous_greedy_is_count_optimal(lengths, budget):
    """Brute force over every contiguous partition (optimal partitions of a sorted list are contiguous)."""

    @functools.cache
    def best(i):
        if i == len(lengths):
            return 0
        out = None
        for j in range(i + 1, len(lengths) + 1):
            if (j - i) * lengths[i] <= budget or j == i + 1:
                cand = 1 + best(j)
                out = cand if out is None else min(out, cand)
        return out

    assert len(contiguous_greedy(lengths, budget)) == best(0)


@given(lengths_st, budget_st)
def test_odb_greedy_respects_budget(lengths, budget):
    groups = odb_greedy(lengths, budget)
    assert _is_partition(groups, len(lengths))
    for g in groups:
        assert len(g) * max(lengths[i] for i in g) <= budget or len(g) == 1
    assert len(groups) >= len(contiguous_greedy(lengths, budget))


def test_odb_greedy_matches_the_published_rule():
    # 20 x 1000 at L=8192: the longest stands alone, then floor(8192/1000)=8, 8, and the rest (3).
    assert [len(g) for g in odb_greedy([1000] * 20, 8192)] == [1, 8, 8, 3]
    # [4000] + [100]*10: 4000 alone, then floor(8192/4000)=2, then floor(8192/100)=81 -> the last 8.
    assert [len(g) for g in odb_greedy([4000] + [100] * 10, 8192)] == [1, 2, 8]


@given(st.lists(st.floats(1, 500), max_size=40).map(lambda xs: sorted(xs, reverse=True)), st.floats(1, 1500))
def test_best_fit_decreasing(costs, budget):
    groups = best_fit_decreasing(costs, budget)
    assert _is_partition(groups, len(costs))
    for g in groups:
        assert sum(costs[i] for i in g) <= budget + 1e-9 or len(g) == 1
    # No two groups could be merged... BFD guarantees fewer than 2*OPT+1 bins; OPT >= ceil(sum/budget).
    fitting = [c for c in costs if c <= budget]
    assert len(groups) - (len(costs) - len(fitting)) <= 2 * (sum(fitting) / budget) + 1


@given(st.integers(0, 50), st.integers(1, 9))
def test_fixed_chunks(n, b):
    groups = fixed_chunks(n, b)
    assert _is_partition(groups, n)
    assert all(len(g) == b for g in groups[:-1])


@given(st.lists(st.integers(1, 6), min_size=1, max_size=8), st.integers(1, 40))
def test_splits_reach_target_or_singletons(sizes, target):
    groups, i = [], 0
    for s in sizes:
        groups.append(list(range(i, i + s)))
        i += s
    for out in (split_largest(groups, target, key=len), odb_split(groups, target)):
        assert _is_partition(out, i)
        assert len(out) == max(len(groups), min(target, i))
