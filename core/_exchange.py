"""One rank's part of one step's vision exchange (two-phase balancing), as data.

`plan_vision` (`batchd.core._phases`) decides which rank encodes each image of a step; the result, per
rank, is an `Exchange`: `encode`, the images it encodes (`ImageRef`s), ordered by owner rank and then
by the owner's LLM image order; `sources`, for each image of its own LLM samples (samples in group
order, images in sample order), the rank that encodes it. Both orders are fixed, so every side derives
the same split sizes (`send_splits`, `recv_splits`) and `placement`. A `Step` carries its rank's
`Exchange` (`batchd.core._step`).

Pure data: this module imports only the validation helpers, so the planner (`_phases`), the step
(`_step`), the coordinator and the rank state all import it without importing each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ._types import check_int


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
            raise ValueError(
                f"sources and tokens must have one entry per image, got "
                f"{len(self.sources)=} {len(self.tokens)=}"
            )
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
        return {
            "r": self.rank,
            "n": self.world_size,
            "e": [im.to_json() for im in self.encode],
            "s": list(self.sources),
            "t": list(self.tokens),
        }

    @staticmethod
    def from_json(obj: dict[str, Any]) -> Exchange:
        return Exchange(
            obj["r"],
            obj["n"],
            tuple(ImageRef.from_json(e) for e in obj["e"]),
            tuple(obj["s"]),
            tuple(obj["t"]),
        )
