"""The encoders' cost models (N-phase balancing): what one item (an image, an audio clip) costs its encoder.

Each encoder phase of a multimodal step is planned on its own (`batchd.core.plan_phases`): its items are
re-dispatched over the ranks so that every rank's encoder cost is near the step's bound, and the
embeddings go back to the rank whose LLM sample holds them. An encoder is described by an `EncoderCost`:
its `name` (the phase), `items(sample)` (the sample's (size, tokens) pairs it encodes) and `item(size)`
(its cost of one). Costs are relative units (an item of size 1 costs about 1); only ratios between
ranks matter. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar, Protocol

from ._types import Sample, check_int, check_number


class EncoderCost(Protocol):
    """An encoder phase's cost model (module docstring)."""

    @property
    def name(self) -> str: ...

    def item(self, size: int) -> float:
        """The encoder's cost of one item of this size (patches, frames)."""
        ...

    def items(self, sample: Sample) -> tuple[tuple[int, int], ...]:
        """The sample's items this encoder encodes, as (size, tokens in the sequence) pairs."""
        ...


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
    name: ClassVar[str] = "vision"

    def __post_init__(self) -> None:
        check_number("vision_linear", self.linear, gt=0.0)
        check_int("vision_quadratic", self.quadratic, lo=0)

    def image(self, patches: int) -> float:
        """Encoder cost of one image."""
        quad = patches * patches / self.quadratic if self.quadratic else 0.0
        return self.linear * patches + quad

    def item(self, size: int) -> float:
        """`image`: the cost of one image of `size` patches."""
        return self.image(size)

    def items(self, sample: Sample) -> tuple[tuple[int, int], ...]:
        """The sample's images, (patches, tokens)."""
        return sample.images

    def samples(self, samples: Sequence[Sample]) -> float:
        """Encoder cost of every image of these samples."""
        return sum(self.image(p) for s in samples for p, _ in s.images)


@dataclasses.dataclass(frozen=True, slots=True)
class AudioCost:
    """The audio encoder's cost of one clip of f log-mel frames (100 per second):
    `frontend` x f + `linear` x (f / `stride`) + (f / `stride`)^2 / `quadratic`.

    A Whisper-style encoder runs a convolutional front end over every frame (the first term; its second
    convolution has stride `stride`, 2 in Whisper: 30 s = 3,000 frames become 1,500 positions), then
    transformer layers over the positions (the second term) whose self-attention stays within the clip
    (the third). `quadratic` is the position count at which attention costs as much as the rest of a
    layer: ~6 x hidden size (a 1,280-wide encoder: ~8k; the default suits a 1,024-wide one). 0 turns
    the quadratic term off.
    """

    frontend: float = 0.25
    linear: float = 1.0
    stride: int = 2
    quadratic: int = 6144
    name: ClassVar[str] = "audio"

    def __post_init__(self) -> None:
        if isinstance(self.frontend, bool) or not isinstance(self.frontend, int | float) or self.frontend < 0:
            raise ValueError(f"audio_frontend must be a number >= 0, got audio_frontend={self.frontend!r}")
        check_number("audio_linear", self.linear, gt=0.0)
        check_int("audio_stride", self.stride, lo=1)
        check_int("audio_quadratic", self.quadratic, lo=0)

    def item(self, size: int) -> float:
        """The cost of one clip of `size` frames."""
        positions = size / self.stride
        quad = positions * positions / self.quadratic if self.quadratic else 0.0
        return self.frontend * size + self.linear * positions + quad

    def items(self, sample: Sample) -> tuple[tuple[int, int], ...]:
        """The sample's audio clips, (frames, tokens)."""
        return sample.audio
