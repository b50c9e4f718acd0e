"""Local search that lowers an encoder placement's peak towards its lower bound (moves and swaps).

The greedies of `batchd.core._phases` place each item (image, audio clip) under a cap found by bisection:
MULTIFIT-style, they stop where the first-fit order runs out of room, typically 1-3% above the per-step
lower bound `vision_bound` on workloads with many items per rank. `improve` then repeats, on the most
loaded rank p, the best of

- a move: item i from p to rank q, if load[q] + c_i < load[p];
- a swap: item i on p with item j on q, c_j < c_i, if load[q] + c_i - c_j < load[p];

choosing, among the allowed ones, the one that leaves max(load[p], load[q]) least (the ideal transfer is
half the pair's gap). Partners q are the `PARTNERS` least loaded ranks and the ranks of p's node and of
the item's owner's node, which keeps a step's search O(items on p x (PARTNERS + ranks per node)).
Each step lowers the sum of squared loads, so the search ends; it also stops once the peak is within
`tol` of the bound, or after `max_steps`.

Node awareness: the first pass allows only transfers that put no new item off its owner's node (an item
goes to a rank of its owner's node, or it was off that node already); only if the peak is still above
the bound's tolerance does a second pass allow any rank. Without a topology every rank is its own node,
so the first pass only returns items to their owners.

Pure and deterministic: ties go to the lowest rank and item index.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

TOL = 0.005  # stop once the peak is within this fraction of the bound
MAX_STEPS = 4096
PARTNERS = 8  # the least loaded ranks each item of the peak rank is tried against (besides its nodes')


def _allowed(i: int, q: int, where: list[int], owners: Sequence[int], nodes: Sequence[int]) -> bool:
    """Node-preserving: item i may go to rank q without putting a new item off its owner's node."""
    home = nodes[owners[i]]
    return nodes[q] == home or nodes[where[i]] != home


def _best_transfer(
    p: int,
    load: list[float],
    held: list[list[tuple[float, int]]],
    where: list[int],
    owners: Sequence[int],
    nodes: Sequence[int],
    peers: dict[int, list[int]],
    local: bool,
) -> tuple[float, int, int, int] | None:
    """The best move or swap off rank p: (resulting pair max, i, j or -1, q); None if none lowers p's load
    without raising q's to p's. Partners q: the `PARTNERS` least loaded ranks, and the ranks of p's node
    and of the item's owner's node (the node-preserving pass: only those that keep the item's node)."""
    peak = load[p]
    eps = 1e-12 * max(peak, 1.0)
    light = sorted(range(len(load)), key=lambda r: (load[r], r))[:PARTNERS]
    best: tuple[float, int, int, int] | None = None
    for ci, i in held[p]:
        home = nodes[owners[i]]
        if local and nodes[p] == home:
            qs: Sequence[int] = peers[home]
        else:
            qs = sorted({*light, *peers[nodes[p]], *peers[home]})
        for q in qs:
            gap = peak - load[q]
            if q == p or gap <= eps:
                continue
            if ci < gap - eps:  # a move
                cand = (max(peak - ci, load[q] + ci), i, -1, q)
                if best is None or cand < best:
                    best = cand
            # a swap: j on q with ci - gap < c_j < ci, ideally c_j = ci - gap / 2
            lst = held[q]
            k = bisect.bisect_left(lst, (ci - gap / 2, -1))
            for kk in (k - 1, k):
                if not 0 <= kk < len(lst):
                    continue
                cj, j = lst[kk]
                d = ci - cj
                if not eps < d < gap - eps:
                    continue
                if local and not _allowed(j, p, where, owners, nodes):
                    continue
                cand = (max(peak - d, load[q] + d), i, j, q)
                if best is None or cand < best:
                    best = cand
    if best is not None and best[0] >= peak - eps:
        return None
    return best


def improve(
    where: Sequence[int],
    costs: Sequence[float],
    owners: Sequence[int],
    nodes: Sequence[int],
    floor: float,
    tol: float = TOL,
    max_steps: int = MAX_STEPS,
    cross_nodes: bool = True,
) -> list[int]:
    """A placement of the same items with a peak no higher than `where`'s (module docstring).

    Args:
        where: where[i] = the rank encoding item i.
        costs: costs[i] = item i's encoder cost.
        owners: owners[i] = the rank whose LLM sample holds item i.
        nodes: nodes[r] = rank r's node.
        floor: A lower bound on any placement's peak (`vision_bound`).
        tol: Stop once the peak is within this fraction of `floor`.
        max_steps: At most this many transfers.
        cross_nodes: False: only the node-preserving pass.
    """
    n = len(nodes)
    out = list(where)
    load = [0.0] * n
    held: list[list[tuple[float, int]]] = [[] for _ in range(n)]
    for i, r in enumerate(out):
        load[r] += costs[i]
        held[r].append((costs[i], i))
    for lst in held:
        lst.sort()
    peers: dict[int, list[int]] = {}
    for r, node in enumerate(nodes):
        peers.setdefault(node, []).append(r)
    steps = 0
    for local in (True, False) if cross_nodes else (True,):
        while steps < max_steps:
            p = max(range(n), key=lambda r: (load[r], -r))
            if load[p] <= floor * (1.0 + tol):
                return out
            t = _best_transfer(p, load, held, out, owners, nodes, peers, local)
            if t is None:
                break
            _, i, j, q = t
            steps += 1
            for item, src, dst in ((i, p, q), (j, q, p)):
                if item < 0:
                    continue
                held[src].remove((costs[item], item))
                bisect.insort(held[dst], (costs[item], item))
                load[src] -= costs[item]
                load[dst] += costs[item]
                out[item] = dst
    return out
