"""Two-phase balancing (OrchMLLM): a vision-encoder plan per step beside the LLM plan, and the exchange.

In a multimodal model a step has two phases with different costs. The vision encoder's cost follows the
images (per image: its patches, plus attention quadratic within the image); the LLM's follows whole
sequences (the `CostModel` of the job). A balanced LLM plan (`plan_round`) can leave one rank encoding
most of the step's images while the others wait ("modality composition incoherence"). So for every step
the images of all ranks' groups are re-dispatched for the encoder phase, and after the encoder the
image embeddings travel back to the rank whose LLM sample holds them: one `all_to_all` per step.

`plan_vision(row, cost, nodes)` plans one step (row[r] = rank r's LLM group):

1. Capacity. The images' encoder costs c_i sum to C over N ranks; no plan beats
   c* = max(C / N, max_i c_i). Try caps c* x (1 + d) for d in `SLACKS` (0 first) and keep the first
   cap under which the greedy below places every image.
2. Keep. Each rank keeps its own LLM images, costliest first, while its load stays within the cap:
   an image encoded where its LLM sample is crosses no link (its embedding is used in place).
3. Spill. The rest, costliest first, go to the least-loaded rank of the owner's node that has room,
   else to the least-loaded rank anywhere with room. Embeddings then cross nodes only when the owner's
   node is full (OrchMLLM's node-wise all-to-all preference).
4. Fallback. If no cap in `SLACKS` fits (a few huge images), LPT: costliest first to the least-loaded
   rank, ties to the owner, then to the owner's node. LPT is within 4/3 of the optimum.

The exchange of a step, per rank (`Exchange`): `encode`, the images it encodes, ordered by owner rank
and then by the owner's LLM image order; `sources`, for each image of its own LLM samples (samples in
group order, images in sample order), the rank that encodes it. Both orders are fixed, so each side
derives the same split sizes and placement: an encoder's output rows for owner d are contiguous
(`send_splits`), an owner receives the rows of source 0, 1, ... in turn (`recv_splits`), and `placement`
puts each received image back at its position in the LLM batch. Rows are image tokens (the embeddings
the LLM consumes, after the encoder's merger/projector).

Invariants (property-tested): every image of the row is encoded exactly once; every rank's received
images are exactly its LLM images; with a topology, no image leaves its owner's node unless that node
has no room under the cap. Pure and deterministic: no rng, no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._types import Sample, check_int, check_number

SLACKS = (0.0, 0.01, 0.02, 0.035, 0.05, 0.1, 0.2, 0.5)
PHASES = (1, 2)


@dataclasses.dataclass(frozen=True, slots=True)
class VisionCost:
    """The vision encoder's cost of one image of p patches: `linear` x p + p^2 / `quadratic`.

    The linear term is the encoder's per-patch layers (patch embedding, MLPs, projections), the
    quadratic one its self-attention within the image (a ViT attends over one image's patches).
    `quadratic` is the patch count at which the two terms are equal for linear = 1: ~6 x hidden size for a
    ViT (a 1,280-wide encoder: ~8k). 0 turns the quadratic term off.
    """

    linear: float = 1.0
    quadratic: int = 8192

    def __post_init__(self) -> None:
        check_number("vision_linear", self.linear, gt=0.0)
        check_int("vision_quadratic", self.quadratic, lo=0)

    def image(self, patches: int) -> float:
        """Encoder cost of one image."""
        quad = patches * patches / self.quadratic if self.quadratic else 0.0
        return self.linear * patches + quad

    def samples(self, samples: Sequence[Sample]) -> float:
        """Encoder cost of every image of these samples."""
        return sum(self.image(p) for s in samples for p, _ in s.images)


@dataclasses.dataclass(frozen=True, slots=True)
class ImageRef:
    """One image of a step's exchange.

    Attributes:
        sample_id: The sample holding it.
        index: Its index among the sample's images.
        home_rank: The sample's home rank (where its payload, and so the image's pixels, live).
        owner: The rank whose LLM group holds the sample (where its embedding goes).
        patches: Encoder patches (the encoder's cost).
        tokens: Image tokens in the LLM sequence: rows of its embedding in the exchange.
    """

    sample_id: int
    index: int
    home_rank: int
    owner: int
    patches: int
    tokens: int

    def __post_init__(self) -> None:
        for name in ("sample_id", "index", "home_rank", "owner", "patches"):
            check_int(name, getattr(self, name), lo=0)
        check_int("tokens", self.tokens, lo=1)

    def to_json(self) -> list[int]:
        return [self.sample_id, self.index, self.home_rank, self.owner, self.patches, self.tokens]

    @staticmethod
    def from_json(obj: Sequence[int]) -> ImageRef:
        return ImageRef(*obj)


@dataclasses.dataclass(frozen=True, slots=True)
class Exchange:
    """One rank's part of one step's vision exchange (module docstring).

    Attributes:
        rank: This rank.
        world_size: N.
        encode: The images this rank encodes, ordered by (owner, the owner's LLM image order).
        sources: For each image of this rank's LLM samples, in LLM order, the rank that encodes it.
        tokens: The token count of each of those images (same order as `sources`).
    """

    rank: int
    world_size: int
    encode: tuple[ImageRef, ...] = ()
    sources: tuple[int, ...] = ()
    tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, lo=1)
        check_int("rank", self.rank, lo=0, hi=self.world_size - 1)
        if len(self.sources) != len(self.tokens):
            raise ValueError(f"sources and tokens must have one entry per image, got "
                             f"{len(self.sources)=} {len(self.tokens)=}")
        for s in self.sources:
            check_int("source", s, lo=0, hi=self.world_size - 1)
        owners = [im.owner for im in self.encode]
        if owners != sorted(owners) or any(o >= self.world_size for o in owners):
            raise ValueError(f"encode must be ordered by owner rank < {self.world_size}, got owners {owners}")

    @property
    def empty(self) -> bool:
        """No image to encode and none to receive (the exchange still runs: it is a collective)."""
        return not self.encode and not self.sources

    def send_splits(self) -> list[int]:
        """Rows (image tokens) this rank's encoder output sends to each rank."""
        out = [0] * self.world_size
        for im in self.encode:
            out[im.owner] += im.tokens
        return out

    def recv_splits(self) -> list[int]:
        """Rows this rank receives from each rank."""
        out = [0] * self.world_size
        for src, n in zip(self.sources, self.tokens, strict=True):
            out[src] += n
        return out

    def placement(self) -> list[int]:
        """placement[j] = the LLM-order index of the j-th received image (received: source by source,
        each source's images in LLM order)."""
        order = sorted(range(len(self.sources)), key=lambda i: (self.sources[i], i))
        return order

    def to_json(self) -> dict[str, Any]:
        return {"r": self.rank, "n": self.world_size, "e": [im.to_json() for im in self.encode],
                "s": list(self.sources), "t": list(self.tokens)}

    @staticmethod
    def from_json(obj: dict[str, Any]) -> Exchange:
        return Exchange(obj["r"], obj["n"], tuple(ImageRef.from_json(e) for e in obj["e"]),
                        tuple(obj["s"]), tuple(obj["t"]))


def _images(row: Sequence[Sequence[Sample]]) -> list[ImageRef]:
    """The row's images in LLM order: rank by rank, samples in group order, images in sample order."""
    out = []
    for owner, group in enumerate(row):
        for s in group:
            for k, (patches, tokens) in enumerate(s.images):
                out.append(ImageRef(s.id, k, s.home_rank, owner, patches, tokens))
    return out


def _greedy(images: list[ImageRef], costs: list[float], nodes: list[int], cap: float) -> list[int] | None:
    """Keep, then spill (module docstring) under `cap`; None when some image has no room."""
    n = len(nodes)
    load = [0.0] * n
    where = [-1] * len(images)
    order = sorted(range(len(images)), key=lambda i: -costs[i])
    eps = 1e-9 * max(cap, 1.0)
    for i in order:  # keep: costliest own images first
        o = images[i].owner
        if load[o] + costs[i] <= cap + eps:
            load[o] += costs[i]
            where[i] = o
    members: dict[int, list[int]] = {}
    for r, node in enumerate(nodes):
        members.setdefault(node, []).append(r)
    for i in order:  # spill
        if where[i] >= 0:
            continue
        c = costs[i]
        best = -1
        for pool in (members[nodes[images[i].owner]], range(n)):
            best = min((r for r in pool if load[r] + c <= cap + eps), key=lambda r: (load[r], r), default=-1)
            if best >= 0:
                break
        if best < 0:
            return None
        load[best] += c
        where[i] = best
    return where


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


def plan_vision(row: Sequence[Sequence[Sample]], cost: VisionCost,
                nodes: Sequence[int] | None = None) -> list[Exchange]:
    """The vision-phase plan of one step (module docstring).

    Args:
        row: row[r] is rank r's LLM group at this step (empty = IDLE).
        cost: The encoder's cost model.
        nodes: nodes[r] is rank r's node; None = every rank its own node.

    Returns:
        One `Exchange` per rank.
    """
    n = len(row)
    where_node = list(nodes) if nodes is not None else list(range(n))
    if len(where_node) != n:
        raise ValueError(f"nodes must hold one node index per rank ({n=}), got {len(where_node)=}")
    images = _images(row)
    if not images:
        return [Exchange(r, n) for r in range(n)]
    costs = [cost.image(im.patches) for im in images]
    floor = max(sum(costs) / n, max(costs))
    where = None
    for slack in SLACKS:
        where = _greedy(images, costs, where_node, floor * (1.0 + slack))
        if where is not None:
            break
    if where is None:
        where = _lpt(images, costs, where_node)
    encode: list[list[ImageRef]] = [[] for _ in range(n)]
    sources: list[list[int]] = [[] for _ in range(n)]
    tokens: list[list[int]] = [[] for _ in range(n)]
    for im, enc in zip(images, where, strict=True):  # images are in (owner, LLM order): both orders hold
        encode[enc].append(im)
        sources[im.owner].append(enc)
        tokens[im.owner].append(im.tokens)
    return [Exchange(r, n, tuple(encode[r]), tuple(sources[r]), tuple(tokens[r])) for r in range(n)]


def plan_vision_round(plan: Sequence[Sequence[Sequence[Sample]]], cost: VisionCost,
                      nodes: Sequence[int] | None = None) -> tuple[tuple[Exchange, ...], ...]:
    """`plan_vision` for every step of a round's plan (plan[rank][step]): vision[rank][step]."""
    n = len(plan)
    steps = len(plan[0]) if n else 0
    per_step = [plan_vision([plan[r][s] for r in range(n)], cost, nodes) for s in range(steps)]
    return tuple(tuple(per_step[s][r] for s in range(steps)) for r in range(n))


def single_phase(row: Sequence[Sequence[Sample]]) -> list[Exchange]:
    """The exchange of a one-phase step: every rank encodes its own LLM samples' images (no row moves)."""
    n = len(row)
    images = _images(row)
    encode: list[list[ImageRef]] = [[] for _ in range(n)]
    for im in images:
        encode[im.owner].append(im)
    return [Exchange(r, n, tuple(encode[r]), (r,) * len(encode[r]), tuple(im.tokens for im in encode[r]))
            for r in range(n)]


def phase_loads(exchanges: Sequence[Exchange], cost: VisionCost) -> list[float]:
    """Each rank's encoder cost under `exchanges` (one step)."""
    return [sum(cost.image(im.patches) for im in ex.encode) for ex in exchanges]


def imbalance(loads: Sequence[float]) -> float | None:
    """max / mean of a step's rank loads; None when the step has no load at all."""
    total = sum(loads)
    if total <= 0:
        return None
    return max(loads) / (total / len(loads))


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


def exchange_arrays(exchange: Exchange) -> dict[str, np.ndarray]:
    """A rank's part of a step's exchange as the int64 arrays its batch carries (beside `StepInfo`):

    - `vision_send_splits` [N]: rows of this rank's encoder output (images in `encode` order) for each rank;
    - `vision_recv_splits` [N]: rows it receives from each rank;
    - `vision_placement` [I]: for the j-th received image (source by source), its index in LLM order;
    - `vision_image_tokens` [I]: the rows of each of its LLM images, in LLM order.

    `batchd.client.exchange_image_embeddings` runs the exchange from these.
    """
    return {
        "vision_send_splits": np.asarray(exchange.send_splits(), dtype=np.int64),
        "vision_recv_splits": np.asarray(exchange.recv_splits(), dtype=np.int64),
        "vision_placement": np.asarray(exchange.placement(), dtype=np.int64),
        "vision_image_tokens": np.asarray(exchange.tokens, dtype=np.int64),
    }
