"""Phase balancing (OrchMLLM): a plan per encoder and step beside the LLM plan, and the exchange.

Every encoder phase is planned on its own by the same function (`plan_phase`, also named `plan_vision`;
`plan_phases` runs it for each encoder of a step): its items (images for `VisionCost`, audio clips for
`AudioCost`, `batchd.core._encoders`) and their costs are all that differ. The text below says images;
it holds for clips alike.

In a multimodal model a step has two phases with different costs. The vision encoder's cost follows the
images (per image: its patches, plus attention quadratic within the image); the LLM's follows whole
sequences (the `CostModel` of the job). A balanced LLM plan (`plan_round`) can leave one rank encoding
most of the step's images while the others wait ("modality composition incoherence"). So for every step
the images of all ranks' groups are re-dispatched for the encoder phase, and after the encoder the
image embeddings travel back to the rank whose LLM sample holds them: one `all_to_all` per step.

`plan_vision(row, cost, nodes)` plans one step (row[r] = rank r's LLM group):

1. Capacity. The images' encoder costs c_i sum to C over N ranks; no plan beats
   c* = `vision_bound` >= max(C / N, max_i c_i) (images are whole). Try caps c* x (1 + d) for d in
   `SLACKS` (0 first) until a greedy below places every image; then bisect `REFINE` times between the
   last cap that failed and the first that fit, keeping the placement of least peak load. Keep-first
   is searched so, and unless its peak is within `ACCEPT` (2%) of c* one-pass too; the plan of lower
   peak wins, keep-first on a tie (it moves fewer images).
2. Greedy keep-first. Keep: each rank keeps its own LLM images, costliest first, while its load stays
   within the cap: an image encoded where its LLM sample is crosses no link (its embedding is used in
   place). Spill: the rest, costliest first, go to the least-loaded rank of the owner's node if it has
   room, else to the least-loaded rank anywhere if it has room.
3. Greedy one-pass. All images costliest first (LPT order), each to its owner if it has room, else
   spilled as above. Kept images no longer claim room before larger ones are placed, which packs
   tighter (docs/benchmarks.md, two-phase balancing) at the price of more exchanged images.
   In both greedies an embedding crosses nodes only when no rank of the owner's node has room for it
   when it is placed (OrchMLLM's node-wise all-to-all preference).
4. Fallback. If no cap in `SLACKS` fits either greedy (a few huge images), LPT: costliest first to the
   least-loaded rank, ties to the owner, then to the owner's node. LPT is within 4/3 of the optimum.
5. Local search (`batchd.core._phase_search.improve`): moves and swaps off the most loaded rank while
   they lower it, until the peak is within 0.5% of the bound; first only those that put no image off its
   owner's node, then (if still above) any. The greedies stop where first-fit runs out of room; the
   search takes the plan the rest of the way to its bound (docs/benchmarks.md, two-phase balancing).
6. Second start (`batchd.core._phase_ldm`). Still above that tolerance, a step of at most `LDM_MAX_WORK`
   items x ranks is also partitioned by the largest differencing method (Karmarkar-Karp), each bin on the
   rank owning most of its items, and searched the same way; it replaces the plan where its peak is lower
   by `LDM_GAIN` (many nearly equal big images, where first fit stops short; it moves more images).
7. Exact option (`exact_nodes` > 0): a step of at most `EXACT_MAX_RANKS` ranks and `EXACT_MAX_ITEMS`
   items is also solved as a MILP (`exact_placement`) within a node budget; the lower peak wins.

The exchange of a step, per rank (`Exchange`): `encode`, the images it encodes, ordered by owner rank
and then by the owner's LLM image order; `sources`, for each image of its own LLM samples (samples in
group order, images in sample order), the rank that encodes it. Both orders are fixed, so each side
derives the same split sizes and placement: an encoder's output rows for owner d are contiguous
(`send_splits`), an owner receives the rows of source 0, 1, ... in turn (`recv_splits`), and `placement`
puts each received image back at its position in the LLM batch. Rows are image tokens (the embeddings
the LLM consumes, after the encoder's merger/projector).

Invariants (property-tested): every image of the row is encoded exactly once; every rank's received
images are exactly its LLM images; the peak load is within the first fitting `SLACKS` cap (with the
greedy) and never above the single-phase plan's (every rank encodes its own); in the greedy's placement,
under its cap B, an image of cost c is encoded off its owner only if the owner ends above B - c, and off
its owner's node only if every rank of that node ends above B - c (it had no room when placed; loads
only grow); the local search never raises the peak, and its node-preserving pass puts no image off its
owner's node. A node
whose images' total would fit its ranks can still send some out (packing is not fluid, and other
nodes' spills may take its room first). Pure and deterministic: no rng, no I/O.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence

import numpy as np

from ._encoders import EncoderCost
from ._exchange import Exchange, ImageRef
from ._phase_ldm import LDM_GAIN, LDM_MAX_WORK, ldm_place
from ._phase_search import TOL, improve
from ._types import Sample, check_int

SLACKS = (0.0, 0.01, 0.02, 0.035, 0.05, 0.1, 0.2, 0.5)
REFINE = 6  # bisection steps between the last slack cap that failed and the first that fit
# Keep-first's plan is taken when its peak is within this fraction of the bound: the one-pass greedy packs
# tighter but moves about twice the images (cross-node too) and plans 3-4x slower (docs/benchmarks.md).
ACCEPT = 0.02
# The exact option (`exact_nodes` > 0): steps of at most this many ranks and items are also solved as a
# MILP (`exact_placement`), within the node budget; its placement is taken when its peak is lower.
EXACT_MAX_RANKS, EXACT_MAX_ITEMS = 8, 64
EXACT_GUARD_S = 60.0  # a wall-clock guard per solve (the node budget is what bounds the work)


def _images(row: Sequence[Sequence[Sample]], cost: EncoderCost | None = None) -> list[ImageRef]:
    """The row's items of `cost`'s encoder (default: images) in LLM order: rank by rank, samples in group
    order, items in sample order."""
    items = cost.items if cost is not None else (lambda s: s.images)
    out = []
    for owner, group in enumerate(row):
        for s in group:
            for k, (size, tokens) in enumerate(items(s)):
                out.append(ImageRef(s.id, k, s.home_rank, owner, size, tokens))
    return out


def _greedy(
    images: list[ImageRef],
    costs: list[float],
    nodes: list[int],
    cap: float,
    order: list[int],
    keep_first: bool = True,
) -> list[int] | None:
    """Places images in `order` (costliest first) under `cap` (module docstring); None when some image
    has no room. `keep_first`: every rank keeps its own images first, then the rest spill; else one pass
    in which each image goes to its owner if it has room, else spills.

    The least-loaded rank of a pool (ties: lowest rank) has room for an image iff any rank of the pool
    has, so each pool keeps a heap of (load, rank); an entry is stale once its rank's load has grown.
    """
    n = len(nodes)
    load = [0.0] * n
    where = [-1] * len(images)
    eps = 1e-9 * max(cap, 1.0)
    if keep_first:
        for i in order:  # keep: costliest own images first
            o = images[i].owner
            if load[o] + costs[i] <= cap + eps:
                load[o] += costs[i]
                where[i] = o
    heaps: dict[int, list[tuple[float, int]]] = {}
    for r, node in enumerate(nodes):
        heaps.setdefault(node, []).append((load[r], r))
    everyone = [(load[r], r) for r in range(n)]
    heapq.heapify(everyone)
    for h in heaps.values():
        heapq.heapify(h)
    for i in order:  # spill (keep_first=False: keep or spill)
        if where[i] >= 0:
            continue
        c = costs[i]
        best = images[i].owner if not keep_first and load[images[i].owner] + c <= cap + eps else -1
        if best < 0:
            for pool in (heaps[nodes[images[i].owner]], everyone):
                while pool[0][0] != load[pool[0][1]]:  # stale entry
                    heapq.heappop(pool)
                if pool[0][0] + c <= cap + eps:
                    best = pool[0][1]
                    break
        if best < 0:
            return None
        load[best] += c
        where[i] = best
        heapq.heappush(heaps[nodes[best]], (load[best], best))
        heapq.heappush(everyone, (load[best], best))
    return where


def _peak(where: list[int], costs: list[float], n: int) -> float:
    load = [0.0] * n
    for r, c in zip(where, costs, strict=True):
        load[r] += c
    return max(load)


def _lpt(images: list[ImageRef], costs: list[float], nodes: list[int]) -> list[int]:
    n = len(nodes)
    load = [0.0] * n
    where = [-1] * len(images)
    for i in sorted(range(len(images)), key=lambda i: -costs[i]):
        o = images[i].owner
        best = min(range(n), key=lambda r: (load[r], r != o, nodes[r] != nodes[o], r))
        load[best] += costs[i]
        where[i] = best
    return where


def _search(
    images: list[ImageRef], costs: list[float], where_node: list[int], order: list[int], keep_first: bool
) -> tuple[list[int], float, float] | None:
    """The first `SLACKS` cap the greedy fits under, refined by bisection: (placement, its peak, its cap),
    the placement of least peak among those that fit; None when no slack fits."""
    n = len(where_node)
    floor = vision_bound(costs, n)
    for k, slack in enumerate(SLACKS):  # noqa: B007 - k is read after the loop
        where = _greedy(images, costs, where_node, floor * (1.0 + slack), order, keep_first)
        if where is not None:
            break
    else:
        return None
    cap = hi = floor * (1.0 + slack)
    best = _peak(where, costs, n)
    if k > 0:  # refine: bisect between the last cap that failed and the one that fit
        lo = floor * (1.0 + SLACKS[k - 1])
        for _ in range(REFINE):
            mid = (lo + hi) / 2
            trial = _greedy(images, costs, where_node, mid, order, keep_first)
            if trial is None:
                lo = mid
                continue
            hi = mid
            peak = _peak(trial, costs, n)
            if peak < best:
                where, best, cap = trial, peak, mid
    return where, best, cap


def _place(
    images: list[ImageRef], costs: list[float], where_node: list[int]
) -> tuple[list[int], float | None]:
    """The encoding rank of every image, and the cap the chosen greedy plan met (None: LPT placed them)."""
    order = sorted(range(len(images)), key=lambda i: -costs[i])
    keep = _search(images, costs, where_node, order, True)
    if keep is not None and keep[1] <= vision_bound(costs, len(where_node)) * (1.0 + ACCEPT):
        return keep[0], keep[2]  # within ACCEPT of the bound: good enough, and it moves the fewest images
    one_pass = _search(images, costs, where_node, order, False)
    if keep is None and one_pass is None:
        return _lpt(images, costs, where_node), None
    if keep is None or (one_pass is not None and one_pass[1] < keep[1] * (1.0 - 1e-9)):
        keep = one_pass  # strictly lower peak; on a tie keep-first, which moves fewer images
    assert keep is not None  # both None returned above
    return keep[0], keep[2]


def _second_start(
    where: list[int], costs: list[float], owners: list[int], nodes: list[int], floor: float
) -> list[int]:
    """`where`, or the LDM partition after the same local search where its peak is lower by `LDM_GAIN`
    (step 6 of the module docstring); tried only on steps still above the search's tolerance and within
    `LDM_MAX_WORK`."""
    n = len(nodes)
    peak = _peak(where, costs, n)
    if len(costs) * n > LDM_MAX_WORK or peak <= floor * (1.0 + TOL):
        return where
    other = improve(ldm_place(costs, owners, n), costs, owners, nodes, floor)
    return other if _peak(other, costs, n) < peak * (1.0 - LDM_GAIN) else where


def _exact(where: list[int], costs: list[float], owners: list[int], n: int, exact_nodes: int) -> list[int]:
    """`where`, or the exact solver's placement when the step is small enough and it peaks lower."""
    if exact_nodes <= 0 or n > EXACT_MAX_RANKS or len(costs) > EXACT_MAX_ITEMS or min(costs) <= 0:
        return where
    from ._phase_exact import exact_placement

    res = exact_placement(costs, n, owners, time_limit_s=EXACT_GUARD_S, node_limit=exact_nodes)
    if res is None or res.peak >= _peak(where, costs, n) * (1.0 - 1e-9):
        return where
    return list(res.where)


def plan_vision(
    row: Sequence[Sequence[Sample]],
    cost: EncoderCost,
    nodes: Sequence[int] | None = None,
    exact_nodes: int = 0,
) -> list[Exchange]:
    """The plan of one encoder phase of one step (module docstring): the vision phase with a `VisionCost`,
    any other encoder's with its cost model (`AudioCost`: the samples' audio clips). `plan_phase` is the
    same function.

    Args:
        row: row[r] is rank r's LLM group at this step (empty = IDLE).
        cost: The encoder's cost model; it also names the items it encodes (`EncoderCost.items`).
        nodes: nodes[r] is rank r's node; None = every rank its own node.
        exact_nodes: > 0: a step of at most `EXACT_MAX_RANKS` ranks and `EXACT_MAX_ITEMS` items is also
            solved exactly (`exact_placement`: least peak, then fewest items off their owners; at most this
            many branch-and-bound nodes per solve, so the plan stays a function of its inputs), and that
            placement is taken where its peak is lower. Needs scipy (`batchd[exact]`).

    Returns:
        One `Exchange` per rank.
    """
    n = len(row)
    where_node = list(nodes) if nodes is not None else list(range(n))
    if len(where_node) != n:
        raise ValueError(f"nodes must hold one node index per rank ({n=}), got {len(where_node)=}")
    images = _images(row, cost)
    if not images:
        return [Exchange(r, n) for r in range(n)]
    costs = [cost.item(im.patches) for im in images]
    where, _cap = _place(images, costs, where_node)
    owners, floor = [im.owner for im in images], vision_bound(costs, n)
    where = improve(where, costs, owners, where_node, floor)
    where = _second_start(where, costs, owners, where_node, floor)
    where = _exact(where, costs, owners, n, exact_nodes)
    encode: list[list[ImageRef]] = [[] for _ in range(n)]
    sources: list[list[int]] = [[] for _ in range(n)]
    tokens: list[list[int]] = [[] for _ in range(n)]
    for im, enc in zip(images, where, strict=True):  # images are in (owner, LLM order): both orders hold
        encode[enc].append(im)
        sources[im.owner].append(enc)
        tokens[im.owner].append(im.tokens)
    return [Exchange(r, n, tuple(encode[r]), tuple(sources[r]), tuple(tokens[r])) for r in range(n)]


def vision_bound(costs: Sequence[float], n: int) -> float:
    """A lower bound on the max rank load of any placement of images of these costs on n ranks:
    max(C / n, c_1, and for k >= 1 the sum c_(kn-k+1) + ... + c_(kn+1)) with c_1 >= c_2 >= ... (of the kn + 1
    costliest images, some rank encodes k + 1; an image is never split). 0 without images."""
    check_int("n", n, lo=1)
    c = sorted(costs, reverse=True)
    if not c:
        return 0.0
    prefix = [0.0, *itertools.accumulate(c)]
    out = max(prefix[-1] / n, c[0])
    k = 1
    while k * n < len(c):
        out = max(out, prefix[k * n + 1] - prefix[k * n - k])
        k += 1
    return out


plan_phase = plan_vision


def plan_phases(
    row: Sequence[Sequence[Sample]],
    encoders: Sequence[EncoderCost],
    nodes: Sequence[int] | None = None,
    exact_nodes: int = 0,
) -> dict[str, list[Exchange]]:
    """Every encoder phase of one step, each planned on its own (`plan_phase`): {encoder name: one
    `Exchange` per rank}. The LLM plan (the row) is shared; each encoder's exchange is composed with it
    (its embeddings go back to the rank whose LLM sample holds them), one all-to-all per encoder."""
    names = [e.name for e in encoders]
    if len(set(names)) != len(names):
        raise ValueError(f"encoders must have distinct names, got {names=}")
    return {e.name: plan_phase(row, e, nodes, exact_nodes) for e in encoders}


def plan_vision_round(
    plan: Sequence[Sequence[Sequence[Sample]]],
    cost: EncoderCost,
    nodes: Sequence[int] | None = None,
    exact_nodes: int = 0,
) -> tuple[tuple[Exchange, ...], ...]:
    """`plan_vision` for every step of a round's plan (plan[rank][step]): vision[rank][step]."""
    n = len(plan)
    steps = len(plan[0]) if n else 0
    per_step = [plan_vision([plan[r][s] for r in range(n)], cost, nodes, exact_nodes) for s in range(steps)]
    return tuple(tuple(per_step[s][r] for s in range(steps)) for r in range(n))


def single_phase(row: Sequence[Sequence[Sample]], cost: EncoderCost | None = None) -> list[Exchange]:
    """The exchange of a one-phase step: every rank encodes its own LLM samples' items of `cost`'s encoder
    (default: images); no row moves."""
    n = len(row)
    images = _images(row, cost)
    encode: list[list[ImageRef]] = [[] for _ in range(n)]
    for im in images:
        encode[im.owner].append(im)
    return [
        Exchange(r, n, tuple(encode[r]), (r,) * len(encode[r]), tuple(im.tokens for im in encode[r]))
        for r in range(n)
    ]


def phase_loads(exchanges: Sequence[Exchange], cost: EncoderCost) -> list[float]:
    """Each rank's encoder cost under `exchanges` (one step)."""
    return [sum(cost.item(im.patches) for im in ex.encode) for ex in exchanges]


def imbalance(loads: Sequence[float]) -> float | None:
    """max / mean of a step's rank loads; None when the step has no load at all."""
    total = sum(loads)
    if total <= 0:
        return None
    return max(loads) / (total / len(loads))


def mean_imbalance(steps: Iterable[Sequence[float]]) -> float | None:
    """The mean over steps of `imbalance` (each step: its ranks' loads), steps without load skipped; None
    when no step had any."""
    ratios = [r for r in (imbalance(loads) for loads in steps) if r is not None]
    return sum(ratios) / len(ratios) if ratios else None


def exchanged(exchanges: Sequence[Exchange], nodes: Sequence[int] | None = None) -> dict[str, int]:
    """Images and embedding rows that cross a rank boundary in one step, split intra-node / cross-node."""
    n = len(exchanges)
    where = list(nodes) if nodes is not None else list(range(n))
    out = {"intra_node_images": 0, "intra_node_rows": 0, "cross_node_images": 0, "cross_node_rows": 0}
    for ex in exchanges:
        for im in ex.encode:
            if im.owner == ex.rank:
                continue
            scope = "intra_node" if where[im.owner] == where[ex.rank] else "cross_node"
            out[f"{scope}_images"] += 1
            out[f"{scope}_rows"] += im.tokens
    return out


EXCHANGE_KEYS = ("vision_send_splits", "vision_recv_splits", "vision_placement", "vision_image_tokens")
AUDIO_EXCHANGE_KEYS = ("audio_send_splits", "audio_recv_splits", "audio_placement", "audio_clip_tokens")


def exchange_arrays(exchange: Exchange, keys: tuple[str, ...] = EXCHANGE_KEYS) -> dict[str, np.ndarray]:
    """A rank's part of a step's exchange as the int64 arrays its batch carries (beside `StepInfo`):

    - `vision_send_splits` [N]: rows of this rank's encoder output (images in `encode` order) for each rank;
    - `vision_recv_splits` [N]: rows it receives from each rank;
    - `vision_placement` [I]: for the j-th received image (source by source), its index in LLM order;
    - `vision_image_tokens` [I]: the rows of each of its LLM images, in LLM order.

    `batchd.client.exchange_image_embeddings` runs the exchange from these. Another phase's exchange under
    its own `keys` (`AUDIO_EXCHANGE_KEYS`: the audio clips; `batchd.client.exchange_audio_embeddings`).
    """
    values = (exchange.send_splits(), exchange.recv_splits(), exchange.placement(), exchange.tokens)
    return {k: np.asarray(v, dtype=np.int64) for k, v in zip(keys, values, strict=True)}
