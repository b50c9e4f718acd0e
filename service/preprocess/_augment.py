"""Augmentation stages: `SystemPrompt`, `TurnSubsample`, `RandomResizedCrop`; `Augmentation`, the three as
`default_stages(augment=...)` puts them.

Each applies with probability `p` and draws only from ``ctx.rng``, so an augmentation is a pure
function of (seed, epoch, sample id, stage index): the same within an epoch, fresh in the next one.
They edit the conversation and its images before the chat template runs (`default_stages(augment=True)`
puts them first in the chain); none of them tokenizes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from ._parse import IMAGE_MARKER
from ._stage import Example, Stage, StageContext


class SystemPrompt(Stage):
    """With probability `p`, sets the system prompt to one of `prompts` (uniformly).

    Args:
        prompts: Candidate system prompts.
        p: Probability of applying.
        replace: Also replace a system prompt the record already has (default: keep it).
    """

    def __init__(self, prompts: Sequence[str], p: float = 0.5, replace: bool = False) -> None:
        if not prompts:
            raise ValueError("SystemPrompt needs at least one prompt")
        self.prompts, self.p, self.replace = list(prompts), float(p), replace

    def __call__(self, ex: Example, ctx: StageContext) -> Example:
        draw, pick = ctx.rng.random(), int(ctx.rng.integers(len(self.prompts)))
        if draw < self.p and (ex.system is None or self.replace):
            ex.system = self.prompts[pick]
        return ex


class TurnSubsample(Stage):
    """With probability `p`, keeps only the first k rounds (a round = a user message and its replies).

    k is uniform over the prefixes that still contain an assistant message and at least `min_rounds`
    rounds. Images whose `<image>` markers fall in dropped rounds are dropped with them.
    """

    def __init__(self, p: float = 0.5, min_rounds: int = 1) -> None:
        self.p, self.min_rounds = float(p), max(int(min_rounds), 1)

    def __call__(self, ex: Example, ctx: StageContext) -> Example:
        draw = ctx.rng.random()
        starts = [i for i, m in enumerate(ex.messages) if m["role"] == "user"]
        if starts and starts[0] != 0:
            starts[0] = 0
        bounds = starts[1:] + [len(ex.messages)]
        valid = [
            k + 1
            for k, end in enumerate(bounds)
            if k + 1 >= self.min_rounds and any(m["role"] == "assistant" for m in ex.messages[:end])
        ]
        if draw >= self.p or len(valid) <= 1:
            return ex
        k = valid[int(ctx.rng.integers(len(valid)))]
        kept = ex.messages[: bounds[k - 1]]
        n_markers = sum(m["content"].count(IMAGE_MARKER) for m in kept)
        ex.messages, ex.images = kept, ex.images[:n_markers]
        return ex


class RandomResizedCrop(Stage):
    """With probability `p`, crops each image to a random area fraction in `scale` and aspect in `ratio`.

    torchvision's sampling (10 tries, then a center crop), driven by the stage's seeded generator. With
    `size=None` the crop keeps its own size, so the visual token count (and the realized length) changes
    with the augmentation, which is the point of batching after preprocessing; `size=(h, w)` resizes the
    crop to a fixed size instead.
    """

    def __init__(
        self,
        scale: tuple[float, float] = (0.5, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        p: float = 0.5,
        size: tuple[int, int] | None = None,
    ) -> None:
        self.scale, self.ratio, self.p, self.size = tuple(scale), tuple(ratio), float(p), size

    def box(self, height: int, width: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
        """(top, left, h, w) of the crop."""
        area = height * width
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target = area * rng.uniform(self.scale[0], self.scale[1])
            aspect = math.exp(rng.uniform(*log_ratio))
            w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            w, h = width, round(width / self.ratio[0])
        elif in_ratio > self.ratio[1]:
            h, w = height, round(height * self.ratio[1])
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, ex: Example, ctx: StageContext) -> Example:
        from PIL import Image

        out = []
        for img in ex.images:
            if ctx.rng.random() >= self.p:
                out.append(img)
                continue
            top, left, h, w = self.box(img.height, img.width, ctx.rng)
            crop = img.crop((left, top, left + w, top + h))
            if self.size is not None:
                crop = crop.resize((self.size[1], self.size[0]), Image.Resampling.BILINEAR)
            out.append(crop)
        ex.images = out
        return ex


DEFAULT_SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "Answer concisely.",
    "You are a careful, precise assistant.",
)


@dataclasses.dataclass(frozen=True)
class Augmentation:
    """The augmentation `default_stages(augment=...)` puts first in the chain: `SystemPrompt(system_prompts,
    p=p_system)`, `TurnSubsample(p=p_turns)`, `RandomResizedCrop(p=p_crop)` (`augment=True`: these
    defaults). `system_prompts` is stored as a tuple.

    Raises:
        ValueError: naming the value, on no system prompt or a probability outside [0, 1].
    """

    system_prompts: Sequence[str] = DEFAULT_SYSTEM_PROMPTS
    p_system: float = 0.3
    p_turns: float = 0.3
    p_crop: float = 0.5

    def __post_init__(self) -> None:
        prompts = tuple(self.system_prompts)
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError(f"system_prompts must be one or more strings, got system_prompts={prompts!r}")
        object.__setattr__(self, "system_prompts", prompts)
        for name in ("p_system", "p_turns", "p_crop"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {name}={value}")

    def stages(self) -> list[Stage]:
        """The three stages, in chain order."""
        return [
            SystemPrompt(self.system_prompts, p=self.p_system),
            TurnSubsample(p=self.p_turns),
            RandomResizedCrop(p=self.p_crop),
        ]
