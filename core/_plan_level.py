"""Level rows: which groups a node-blind round takes, so that each step's ranks cost alike.

A round takes N x T of the pool's G candidate groups (G is often 2-3 x that). Taking the first N x T
in ranked order, then cutting the cost-sorted groups into rows of N, leaves each step's max / mean at
the spread of N consecutive costs of a random sample: rigid singletons (2 x length > L under padding)
between L/2 and L then make 1.07-1.16. `level_choice` instead builds the round row by row: each row is
anchored at the first group in ranked order whose best window (N consecutive groups of the untaken
ones in cost order, the anchor among them) has max / mean <= `LEVEL_TOLERANCE`, and takes that window.
A group whose window is worse waits for peers, at most `patience` rounds (then it anchors its row
whatever its window). So outliers wait a few rounds for their kind rather than spread over every step.

Kept from `choose` (`_plan_blind`): every group that has waited `max_wait` rounds is taken (they anchor
first, and any left over replace the taken group of nearest cost), and every rank r gets at least
q_r = min(T, B_r) of its B_r pooled samples (a swap repair; None where it cannot, and the caller falls
back to `choose`). Cost: O(T x G x N) per round.

`final_rows` cuts the last round of an epoch (fewer groups than N x T) into T rows of at most N groups
(an exact DP over the cost-sorted groups, minimizing the sum of rows' max / mean), so the stub row of
an epoch's end is spread over its steps rather than left to one.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._policy import Group

LEVEL_TOLERANCE = 1.02  # a row whose max / mean is at most this is level enough to take now
_REPAIR_ROUNDS = 4  # swap-repair passes per rank


def _window(
    avail: Sequence[int], pre: Sequence[float], aged_pre: Sequence[int], p: int, n: int
) -> tuple[tuple[int, float], int] | None:
    """The best window of `n` consecutive entries of `avail` holding position `p`: most aged groups,
    then least max / mean (`avail` is cost-descending, so a window's max is its first). None if fewer
    than `n` remain."""
    best: tuple[tuple[int, float], int] | None = None
    for s in range(max(0, p - n + 1), min(p, len(avail) - n) + 1):
        total = pre[s + n] - pre[s]
        ratio = (pre[s + 1] - pre[s]) * n / total if total > 0 else 1.0
        key = (-(aged_pre[s + n] - aged_pre[s]), ratio)
        if best is None or key < best[0]:
            best = (key, s)
    return best


def level_choice(
    groups: Sequence[Group],
    costs: Sequence[float],
    ages: Sequence[int],
    slots: int,
    world_size: int,
    quota: dict[int, int],
    max_wait: int,
    patience: int,
) -> list[Group] | None:
    """The round's `slots` (= N x T) groups of the ranked `groups` (`costs[j]`, `ages[j]`: group j's
    cost and its oldest sample's age in rounds), chosen row by row as the module says; None where the
    groups cannot fill the slots, more than `slots` have waited `max_wait`, or a rank's quota cannot be
    met."""
    n, g_count = world_size, len(groups)
    aged = [a >= max_wait for a in ages]
    if g_count <= slots or sum(aged) > slots:
        return None
    order = sorted(range(g_count), key=lambda j: (-costs[j], j))
    taken: set[int] = set()
    for _ in range(slots // n):
        avail = [k for k in order if k not in taken]
        pos = {k: i for i, k in enumerate(avail)}
        pre, aged_pre = [0.0], [0]
        for k in avail:
            pre.append(pre[-1] + costs[k])
            aged_pre.append(aged_pre[-1] + aged[k])
        pick: int | None = None
        fallback: tuple[tuple[int, float], int] | None = None
        for j in range(g_count):  # anchors in ranked order
            if j in taken:
                continue
            best = _window(avail, pre, aged_pre, pos[j], n)
            if best is None:
                continue
            if aged[j] or ages[j] >= patience or best[0][1] <= LEVEL_TOLERANCE:
                pick = best[1]
                break
            if fallback is None or best[0] < fallback[0]:
                fallback = best
        if pick is None:
            if fallback is None:
                return None
            pick = fallback[1]
        taken.update(avail[pick : pick + n])
    for a in (k for k in range(g_count) if aged[k] and k not in taken):  # an aged group left out
        out = min((k for k in taken if not aged[k]), key=lambda k: (abs(costs[k] - costs[a]), k))
        taken.discard(out)
        taken.add(a)
    if not _repair(groups, costs, aged, taken, quota):
        return None
    return [groups[j] for j in sorted(taken)]


def _counts(groups: Sequence[Group], chosen: set[int]) -> dict[int, int]:
    got: dict[int, int] = {}
    for j in chosen:
        for e in groups[j]:
            got[e.sample.home_rank] = got.get(e.sample.home_rank, 0) + 1
    return got


def _repair(
    groups: Sequence[Group],
    costs: Sequence[float],
    aged: Sequence[bool],
    taken: set[int],
    quota: dict[int, int],
) -> bool:
    """Swaps groups into `taken` (in place) until every rank r holds `quota[r]` samples: in goes an
    untaken group holding one of a short rank's samples, out the taken non-aged group of nearest cost
    whose loss leaves no other rank short. False where no such swap is left."""
    for _ in range(_REPAIR_ROUNDS * max(len(quota), 1)):
        got = _counts(groups, taken)
        short = sorted(r for r, q in quota.items() if got.get(r, 0) < q)
        if not short:
            return True
        r, best = short[0], None
        for k in range(len(groups)):
            if k in taken or not any(e.sample.home_rank == r for e in groups[k]):
                continue
            for o in taken:
                if aged[o] or (best is not None and abs(costs[k] - costs[o]) >= best[0]):
                    continue
                after = dict(got)
                for e in groups[o]:
                    after[e.sample.home_rank] -= 1
                for e in groups[k]:
                    after[e.sample.home_rank] = after.get(e.sample.home_rank, 0) + 1
                if after.get(r, 0) > got.get(r, 0) and all(
                    after.get(x, 0) >= q for x, q in quota.items() if got.get(x, 0) >= q
                ):
                    best = (abs(costs[k] - costs[o]), k, o)
        if best is None:
            return False
        taken.discard(best[2])
        taken.add(best[1])
    return not any(_counts(groups, taken).get(r, 0) < q for r, q in quota.items())


def final_rows(costs: Sequence[float], world_size: int, steps: int) -> list[int]:
    """Cut points of `costs` (descending, len G <= N x `steps`) into `steps` rows of at most N (each
    non-empty where G >= `steps`) minimizing the sum over rows of max / mean (mean over N ranks):
    `bounds` with row t = costs[bounds[t]:bounds[t + 1]]. Exact DP, O(steps x G x N)."""
    n, g_count = world_size, len(costs)
    rows = min(steps, g_count)
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + c)
    inf = float("inf")
    best = [[inf] * (g_count + 1) for _ in range(rows + 1)]
    cut = [[0] * (g_count + 1) for _ in range(rows + 1)]
    best[0][0] = 0.0
    for t in range(1, rows + 1):
        for j in range(1, g_count + 1):
            for i in range(max(0, j - n), j):
                if best[t - 1][i] == inf:
                    continue
                total = pre[j] - pre[i]
                v = best[t - 1][i] + (costs[i] * n / total if total > 0 else 1.0)
                if v < best[t][j]:
                    best[t][j], cut[t][j] = v, i
    bounds, j = [g_count], g_count
    for t in range(rows, 0, -1):
        j = cut[t][j]
        bounds.append(j)
    return bounds[::-1]
