"""Preprocessing stages: augmentation, chat template, tokenization, visual-token expansion, truncation.

A stage is a small object called as ``stage(example, ctx)``; it reads and writes fields of the
`Example` and returns it (or None after editing it in place). It raises `Reject(code, detail)` to
quarantine the record. Randomness comes only from ``ctx.rng``, a generator seeded by
(seed, epoch, sample id, stage index): rerunning a sample in the same epoch is bit-identical, on any
actor, after any restart, in any order, and the next epoch draws fresh augmentations.

The default chain (`default_stages`) and what each stage reads -> writes:

    [SystemPrompt, TurnSubsample, RandomResizedCrop]   messages/system/images -> same (augment=True)
    ChatTemplate      messages, system             -> text, assistant_spans (char spans that carry loss)
    Tokenize          text, assistant_spans        -> input_ids, labels (-100 outside assistant spans)
    Qwen2VLVision     input_ids, labels, images    -> expanded input_ids/labels, image_spans, image_tensors
      | LlavaVision
    Truncate          everything above             -> cut to the cutoff (never inside an image) or Reject

`Preprocessor` runs a chain on a parsed record and returns the sample's metadata and payload: the
payload is a dict of numpy arrays (`input_ids` and `labels` int32, plus `pixel_values` and, for
Qwen2-VL, `image_grid_thw` when the sample has images, plus any `example.extra` arrays a plug-in adds).
The realized length is `len(input_ids)` after every stage; `loss_tokens = count(labels[1:] != -100)`;
modality tokens: ("text", length - vision) and ("vision", expanded image placeholder tokens).

Plug in a stage of your own without forking: pass an instance, a class (built with no arguments), a
function `f(example)` or `f(example, ctx)`, or a "package.module:attr" string (imported where the
chain runs, i.e. in each Ray actor) anywhere in the `stages` list.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import io
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._records import IMAGE_MARKER, Record, Reject
from ._tokenizer import TokenizerRef

IGNORE_INDEX = -100
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
QWEN2VL_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


# ---------------------------------------------------------------------------------------------------
# The example that flows through a chain
# ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Example:
    """One sample on its way through the stages (fields are filled in chain order)."""

    id: int
    epoch: int
    source: str
    messages: list[dict[str, str]]
    system: str | None = None
    images: list[Any] = dataclasses.field(default_factory=list)          # PIL images (RGB)
    text: str | None = None
    assistant_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    input_ids: np.ndarray | None = None
    labels: np.ndarray | None = None
    image_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)   # token spans per image
    image_tokens: list[int] = dataclasses.field(default_factory=list)             # expanded tokens per image
    image_tensors: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)
    extra: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


class StageContext:
    """What a stage knows besides the example: ids and a generator seeded per (seed, epoch, id, stage)."""

    __slots__ = ("_rng", "epoch", "sample_id", "seed", "stage_index")

    def __init__(self, sample_id: int, epoch: int, seed: int, stage_index: int) -> None:
        self.sample_id, self.epoch, self.seed, self.stage_index = sample_id, epoch, seed, stage_index
        self._rng: np.random.Generator | None = None

    @property
    def rng(self) -> np.random.Generator:
        if self._rng is None:
            self._rng = np.random.default_rng([self.seed, self.epoch, self.sample_id, self.stage_index])
        return self._rng


class Stage:
    """Base class of the built-in stages (subclassing it is optional for plug-ins)."""

    def __call__(self, ex: Example, ctx: StageContext) -> Example | None:
        raise NotImplementedError

    def setup(self) -> None:
        """Loads what the stage needs (imports, tokenizers) ahead of the first sample; optional."""

    @property
    def name(self) -> str:
        return type(self).__name__

    def __repr__(self) -> str:
        fields = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return f"{self.name}({', '.join(f'{k}={v!r}' for k, v in fields.items())})"


# ---------------------------------------------------------------------------------------------------
# Augmentation
# ---------------------------------------------------------------------------------------------------
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
        valid = [k + 1 for k, end in enumerate(bounds)
                 if k + 1 >= self.min_rounds and any(m["role"] == "assistant" for m in ex.messages[:end])]
        if draw >= self.p or len(valid) <= 1:
            return ex
        k = valid[int(ctx.rng.integers(len(valid)))]
        kept = ex.messages[:bounds[k - 1]]
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

    def __init__(self, scale: tuple[float, float] = (0.5, 1.0), ratio: tuple[float, float] = (3 / 4, 4 / 3),
                 p: float = 0.5, size: tuple[int, int] | None = None) -> None:
        self.scale, self.ratio, self.p, self.size = tuple(scale), tuple(ratio), float(p), size

    def box(self, height: int, width: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
        """(top, left, h, w) of the crop."""
        area = height * width
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target = area * rng.uniform(*self.scale)
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


# ---------------------------------------------------------------------------------------------------
# Chat template
# ---------------------------------------------------------------------------------------------------
# Both templates wrap what carries loss in {% generation %} blocks (the assistant's content and its
# end-of-turn token), the mechanism behind HF `apply_chat_template(return_assistant_tokens_mask=True)`.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' and default_system -%}"
    "{{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}{{- '\\n' -}}"
    "{%- else -%}"
    "{{- message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
LLAMA3_TEMPLATE = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] | trim + '<|eot_id|>' -}}{%- endgeneration -%}"
    "{%- else -%}"
    "{{- message['content'] | trim + '<|eot_id|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)
# name -> (Jinja template, default system prompt, image placeholder text)
TEMPLATES: dict[str, tuple[str, str | None, str]] = {
    "chatml": (CHATML_TEMPLATE, None, QWEN2VL_IMAGE),
    "qwen2": (CHATML_TEMPLATE, "You are a helpful assistant.", QWEN2VL_IMAGE),
    "llama3": (LLAMA3_TEMPLATE, None, IMAGE_MARKER),
}
_UNSET = object()


class ChatTemplate(Stage):
    """Renders the conversation with a Jinja chat template (HF `apply_chat_template` semantics).

    Rendering goes through transformers' own renderer (`render_jinja_template`, what
    `apply_chat_template` calls), which also reports the character spans inside `{% generation %}`
    blocks: those spans, and only those, carry loss after `Tokenize`. A custom template without
    generation blocks would give a sample no loss tokens (quarantined as `no_loss_tokens`).

    Args:
        template: "chatml", "qwen2" (ChatML with Qwen2's default system prompt), "llama3", or Jinja text.
        default_system: System prompt when the record has none (default: the template's).
        image_placeholder: What each `<image>` marker becomes in the text (default: the template's;
            set it to match the vision stage: `QWEN2VL_IMAGE` for Qwen2-VL, "<image>" for LLaVA).
        template_kwargs: Extra variables for the template.
    """

    def __init__(self, template: str = "qwen2", default_system: Any = _UNSET, image_placeholder: str | None = None,
                 template_kwargs: dict[str, Any] | None = None) -> None:
        if template in TEMPLATES:
            jinja, sys_default, placeholder = TEMPLATES[template]
        elif "{%" in template or "{{" in template:
            jinja, sys_default, placeholder = template, None, IMAGE_MARKER
        else:
            raise ValueError(f"template must be one of {sorted(TEMPLATES)} or Jinja text, got {template!r}")
        self.template = template
        self.jinja = jinja
        self.default_system = sys_default if default_system is _UNSET else default_system
        self.image_placeholder = placeholder if image_placeholder is None else image_placeholder
        self.template_kwargs = dict(template_kwargs or {})

    def messages_of(self, ex: Example) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": ex.system}] if ex.system is not None else []
        msgs += [dict(m) for m in ex.messages]
        if self.image_placeholder != IMAGE_MARKER:
            for m in msgs:
                m["content"] = m["content"].replace(IMAGE_MARKER, self.image_placeholder)
        return msgs

    def setup(self) -> None:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        _compile_jinja_template(self.jinja)

    def __call__(self, ex: Example, ctx: StageContext) -> Example:
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, spans = render_jinja_template(
            conversations=[self.messages_of(ex)], chat_template=self.jinja, return_assistant_tokens_mask=True,
            add_generation_prompt=False, default_system=self.default_system, **self.template_kwargs)
        ex.text, ex.assistant_spans = rendered[0], [tuple(s) for s in spans[0]]
        return ex


# ---------------------------------------------------------------------------------------------------
# Tokenization
# ---------------------------------------------------------------------------------------------------
def _as_ref(tokenizer: str | os.PathLike | TokenizerRef | None) -> TokenizerRef:
    return tokenizer if isinstance(tokenizer, TokenizerRef) else TokenizerRef(tokenizer)


class Tokenize(Stage):
    """Tokenizes `text` with an HF fast tokenizer; labels = ids on tokens overlapping an assistant span.

    The masking rule is `apply_chat_template(return_assistant_tokens_mask=True)`'s: a token carries loss
    when its character offsets overlap a `{% generation %}` span. Special tokens written by the template
    are matched as whole tokens; no BOS/EOS is added beyond what the template writes.

    Args:
        tokenizer: Path to a local tokenizer.json, or a TokenizerRef (default: the demo tokenizer).
    """

    def __init__(self, tokenizer: str | os.PathLike | TokenizerRef | None = None) -> None:
        self.tokenizer = _as_ref(tokenizer)

    def setup(self) -> None:
        self.tokenizer.hf

    def __call__(self, ex: Example, ctx: StageContext) -> Example:
        if ex.text is None:
            raise ValueError("Tokenize needs example.text: put a ChatTemplate stage before it")
        enc = self.tokenizer.hf.backend_tokenizer.encode(ex.text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int32)
        mask = np.zeros(len(ids), dtype=bool)
        spans, s = ex.assistant_spans, 0
        for t, (start, end) in enumerate(enc.offsets):
            while s < len(spans) and start >= spans[s][1]:
                s += 1
            if s == len(spans):
                break
            if end > spans[s][0]:
                mask[t] = True
        ex.input_ids = ids
        ex.labels = np.where(mask, ids, IGNORE_INDEX).astype(np.int32)
        return ex


# ---------------------------------------------------------------------------------------------------
# Visual-token expansion
# ---------------------------------------------------------------------------------------------------
def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 14 * 14 * 4 * 1280) -> tuple[int, int]:
    """Qwen2-VL's resize rule: both sides multiples of `factor`, pixels within [min_pixels, max_pixels],
    aspect ratio kept as closely as possible (transformers' `image_processing_qwen2_vl.smart_resize`).

    Raises:
        ValueError: if the aspect ratio exceeds 200.
    """
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _normalize(img, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """A PIL RGB image as a normalized float32 array [3, H, W]."""
    arr = np.asarray(img, dtype=np.float32) * (1.0 / 255.0)
    arr = (arr - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    return np.ascontiguousarray(arr.transpose(2, 0, 1))


class _VisionStage(Stage):
    """Shared expansion: each image token in input_ids becomes `n_i` copies (labels -100 there)."""

    image_token: str
    tokenizer: TokenizerRef

    def tokens_and_tensors(self, img) -> tuple[int, dict[str, np.ndarray]]:
        raise NotImplementedError

    def setup(self) -> None:
        self.tokenizer.token_id(self.image_token)

    def _span_extra(self, ids: np.ndarray, pos: int) -> tuple[int, int]:
        return 0, 0

    def __call__(self, ex: Example, ctx: StageContext) -> Example:
        if ex.input_ids is None or ex.labels is None:
            raise ValueError(f"{self.name} needs input_ids: put it after Tokenize")
        token_id = self.tokenizer.token_id(self.image_token)
        positions = np.flatnonzero(ex.input_ids == token_id)
        if len(positions) != len(ex.images):
            raise Reject("image_mismatch", f"{len(positions)} {self.image_token} tokens but {len(ex.images)} images")
        if not len(positions):
            return ex
        counts = np.ones(len(ex.input_ids), dtype=np.int64)
        tokens, tensors = [], []
        for img in ex.images:
            n, t = self.tokens_and_tensors(img)
            tokens.append(n)
            tensors.append(t)
        counts[positions] = tokens
        ids = np.repeat(ex.input_ids, counts)
        labels = np.repeat(ex.labels, counts)
        starts = np.cumsum(counts) - counts  # new position of each old token
        spans = []
        for pos, n in zip(positions, tokens):
            lo, hi = self._span_extra(ex.input_ids, int(pos))
            s = int(starts[pos])
            labels[s:s + n] = IGNORE_INDEX
            spans.append((s - lo, s + n + hi))
        ex.input_ids, ex.labels = ids.astype(np.int32), labels.astype(np.int32)
        ex.image_tokens, ex.image_tensors, ex.image_spans = tokens, tensors, spans
        return ex


class Qwen2VLVision(_VisionStage):
    """Qwen2-VL visual tokens: `smart_resize` to multiples of 28 px, one token per 2x2 merge of 14-px patches.

    An image of H x W becomes H' x W' = smart_resize(H, W) and (H'/28)(W'/28) `<|image_pad|>` tokens
    between the template's `<|vision_start|>` / `<|vision_end|>`. Payload: `pixel_values` float
    [sum of patches, 3 * temporal_patch_size * 14 * 14] (CLIP-normalized, flattened in Qwen2-VL's patch
    order, the image repeated over the temporal patch) and `image_grid_thw` int64 [images, 3].

    Args:
        tokenizer: Tokenizer holding the image tokens (default: the demo tokenizer).
        min_pixels, max_pixels: Pixel bounds of smart_resize (transformers' defaults).
        patch_size, merge_size, temporal_patch_size: The vision encoder's geometry.
        pixel_dtype: "float32" or "float16" for `pixel_values`.
    """

    def __init__(self, tokenizer: str | os.PathLike | TokenizerRef | None = None, image_token: str = "<|image_pad|>",
                 vision_start: str = "<|vision_start|>", vision_end: str = "<|vision_end|>",
                 min_pixels: int = 56 * 56, max_pixels: int = 14 * 14 * 4 * 1280, patch_size: int = 14,
                 merge_size: int = 2, temporal_patch_size: int = 2, pixel_dtype: str = "float32",
                 mean: Sequence[float] = OPENAI_CLIP_MEAN, std: Sequence[float] = OPENAI_CLIP_STD) -> None:
        self.tokenizer = _as_ref(tokenizer)
        self.image_token, self.vision_start, self.vision_end = image_token, vision_start, vision_end
        self.min_pixels, self.max_pixels = int(min_pixels), int(max_pixels)
        self.patch_size, self.merge_size, self.temporal_patch_size = patch_size, merge_size, temporal_patch_size
        self.pixel_dtype, self.mean, self.std = np.dtype(pixel_dtype).name, tuple(mean), tuple(std)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def num_tokens(self, height: int, width: int) -> int:
        """Visual tokens of an H x W image (without the start/end tokens)."""
        h, w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return (h // self.factor) * (w // self.factor)

    def tokens_and_tensors(self, img) -> tuple[int, dict[str, np.ndarray]]:
        from PIL import Image

        try:
            h, w = smart_resize(img.height, img.width, self.factor, self.min_pixels, self.max_pixels)
        except ValueError as exc:
            raise Reject("bad_image", str(exc)) from None
        arr = _normalize(img.resize((w, h), Image.Resampling.BICUBIC), self.mean, self.std)
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = h // p, w // p
        frames = np.broadcast_to(arr[None], (t, 3, h, w))
        patches = frames.reshape(1, t, 3, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        flat = patches.reshape(gh * gw, 3 * t * p * p).astype(self.pixel_dtype)
        return (gh // m) * (gw // m), {"pixel_values": flat,
                                       "image_grid_thw": np.array([[1, gh, gw]], dtype=np.int64)}

    def _span_extra(self, ids: np.ndarray, pos: int) -> tuple[int, int]:
        vs, ve = self.tokenizer.token_id(self.vision_start), self.tokenizer.token_id(self.vision_end)
        lo = 1 if pos > 0 and ids[pos - 1] == vs else 0
        hi = 1 if pos + 1 < len(ids) and ids[pos + 1] == ve else 0
        return lo, hi


class LlavaVision(_VisionStage):
    """LLaVA-1.5 visual tokens: a fixed (image_size / patch_size)^2 = 576 tokens per image.

    The image is padded to a square with the mean color, resized to image_size (336) and CLIP-normalized.
    Payload: `pixel_values` float [images, 3, image_size, image_size].
    """

    def __init__(self, tokenizer: str | os.PathLike | TokenizerRef | None = None, image_token: str = IMAGE_MARKER,
                 image_size: int = 336, patch_size: int = 14, pixel_dtype: str = "float32",
                 mean: Sequence[float] = OPENAI_CLIP_MEAN, std: Sequence[float] = OPENAI_CLIP_STD) -> None:
        self.tokenizer = _as_ref(tokenizer)
        self.image_token, self.image_size, self.patch_size = image_token, int(image_size), int(patch_size)
        self.pixel_dtype, self.mean, self.std = np.dtype(pixel_dtype).name, tuple(mean), tuple(std)

    def num_tokens(self, height: int = 0, width: int = 0) -> int:
        return (self.image_size // self.patch_size) ** 2

    def tokens_and_tensors(self, img) -> tuple[int, dict[str, np.ndarray]]:
        from PIL import Image

        side = max(img.width, img.height)
        square = Image.new("RGB", (side, side), tuple(int(255 * c) for c in self.mean))
        square.paste(img, ((side - img.width) // 2, (side - img.height) // 2))
        sq = square.resize((self.image_size, self.image_size), Image.Resampling.BICUBIC)
        arr = _normalize(sq, self.mean, self.std)[None].astype(self.pixel_dtype)
        return self.num_tokens(), {"pixel_values": arr}


# ---------------------------------------------------------------------------------------------------
# Truncation
# ---------------------------------------------------------------------------------------------------
TRUNCATE_POLICIES = ("truncate", "reject")


class Truncate(Stage):
    """Keeps samples within `cutoff` tokens.

    policy "truncate": cut to `cutoff` tokens; an image whose tokens would be cut is dropped whole (the cut
    moves to just before it, and its pixel values leave the payload), so the payload stays consistent.
    policy "reject": a sample over the cutoff is quarantined (`over_cutoff`).
    """

    def __init__(self, cutoff: int, policy: str = "truncate") -> None:
        if cutoff < 1:
            raise ValueError(f"cutoff must be >= 1, got {cutoff=}")
        if policy not in TRUNCATE_POLICIES:
            raise ValueError(f"policy must be one of {list(TRUNCATE_POLICIES)}, got {policy=}")
        self.cutoff, self.policy = int(cutoff), policy

    def __call__(self, ex: Example, ctx: StageContext) -> Example:
        n = len(ex.input_ids)
        if n <= self.cutoff:
            return ex
        if self.policy == "reject":
            raise Reject("over_cutoff", f"{n} tokens > cutoff {self.cutoff}")
        cut, keep = self.cutoff, len(ex.image_spans)
        for k, (s, e) in enumerate(ex.image_spans):
            if e > cut:
                cut, keep = min(cut, s), k
                break
        ex.input_ids, ex.labels = ex.input_ids[:cut], ex.labels[:cut]
        ex.image_spans, ex.image_tokens = ex.image_spans[:keep], ex.image_tokens[:keep]
        ex.image_tensors, ex.images = ex.image_tensors[:keep], ex.images[:keep]
        return ex


# ---------------------------------------------------------------------------------------------------
# Chains
# ---------------------------------------------------------------------------------------------------
class _FunctionStage(Stage):
    def __init__(self, fn: Callable, wants_ctx: bool) -> None:
        self.fn, self.wants_ctx = fn, wants_ctx

    @property
    def name(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))

    def __call__(self, ex: Example, ctx: StageContext) -> Example | None:
        return self.fn(ex, ctx) if self.wants_ctx else self.fn(ex)


def _import_attr(spec: str) -> Any:
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"a stage given as a string must be 'package.module:attr', got {spec!r}")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def resolve_stage(spec: Any) -> Stage | Callable:
    """A callable stage from an instance, a class (built without arguments), a function or 'module:attr'."""
    if isinstance(spec, str):
        spec = _import_attr(spec)
    if isinstance(spec, type):
        spec = spec()
    if isinstance(spec, Stage):
        return spec
    if not callable(spec):
        raise TypeError(f"a stage must be callable as stage(example, ctx), got {spec!r}")
    target = spec if inspect.isfunction(spec) or inspect.ismethod(spec) else getattr(spec, "__call__", spec)
    try:
        params = [p for p in inspect.signature(target).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        wants_ctx = len(params) >= 2 or any(p.kind == p.VAR_POSITIONAL
                                            for p in inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        wants_ctx = True
    return _FunctionStage(spec, wants_ctx)


def default_stages(tokenizer: str | os.PathLike | TokenizerRef | None = None, template: str = "qwen2",
                   vision: str | None = "qwen2_vl", cutoff: int = 4096, policy: str = "truncate",
                   augment: bool = False, system_prompts: Sequence[str] | None = None,
                   min_pixels: int = 56 * 56, max_pixels: int = 14 * 14 * 4 * 1280) -> list[Stage]:
    """The standard chain: [augmentation] -> chat template -> tokenize -> vision -> truncate.

    Args:
        tokenizer: Local tokenizer.json (default: the demo tokenizer, trained locally on first use).
        template: "chatml", "qwen2", "llama3" or Jinja text.
        vision: "qwen2_vl", "llava" or None (text only; records with images are then quarantined).
        cutoff, policy: The Truncate stage.
        augment: Add SystemPrompt, TurnSubsample and RandomResizedCrop.
        system_prompts: Candidates for SystemPrompt (default: three generic prompts).
        min_pixels, max_pixels: Qwen2-VL's smart_resize bounds.
    """
    tok = _as_ref(tokenizer)
    chain: list[Stage] = []
    if augment:
        chain += [SystemPrompt(system_prompts or ["You are a helpful assistant.", "Answer concisely.",
                                                  "You are a careful, precise assistant."], p=0.3),
                  TurnSubsample(p=0.3), RandomResizedCrop(p=0.5)]
    if vision == "qwen2_vl":
        chain += [ChatTemplate(template, image_placeholder=QWEN2VL_IMAGE), Tokenize(tok),
                  Qwen2VLVision(tok, min_pixels=min_pixels, max_pixels=max_pixels)]
    elif vision == "llava":
        chain += [ChatTemplate(template, image_placeholder=IMAGE_MARKER), Tokenize(tok), LlavaVision(tok)]
    elif vision is None:
        chain += [ChatTemplate(template, image_placeholder=IMAGE_MARKER), Tokenize(tok), _NoImages()]
    else:
        raise ValueError(f"vision must be 'qwen2_vl', 'llava' or None, got {vision=}")
    chain.append(Truncate(cutoff, policy))
    return chain


class _NoImages(Stage):
    def __call__(self, ex: Example, ctx: StageContext) -> Example:
        if ex.images:
            raise Reject("unsupported_image", "the chain has no vision stage")
        return ex


def decode_images(record: Record, base_dir: str) -> list[Any]:
    """The record's images as RGB PIL images; Reject('bad_image') when one cannot be read or decoded."""
    from PIL import Image, UnidentifiedImageError

    out = []
    for k, ref in enumerate(record.images):
        try:
            data = ref.read(base_dir)
        except (OSError, ValueError) as exc:
            raise Reject("bad_image", f"images[{k}]: cannot read {ref.path!r}: {exc}") from None
        try:
            img = Image.open(io.BytesIO(data))
            if img.width * img.height > MAX_IMAGE_PIXELS:
                raise Reject("bad_image", f"images[{k}]: {img.width}x{img.height} exceeds {MAX_IMAGE_PIXELS} pixels")
            img.load()
            out.append(img.convert("RGB"))
        except Reject:
            raise
        except Exception as exc:
            why = "unrecognized image format" if isinstance(exc, UnidentifiedImageError) else \
                f"{type(exc).__name__}: {exc}"
            raise Reject("bad_image", f"images[{k}]: cannot decode: {why}") from None
    return out


@dataclasses.dataclass(frozen=True)
class SampleMeta:
    """Metadata of a preprocessed sample (what travels to the batching service)."""

    length: int
    loss_tokens: int
    text_tokens: int
    vision_tokens: int

    def modality_tokens(self) -> tuple[tuple[str, int], ...]:
        return (("text", self.text_tokens), ("vision", self.vision_tokens))


class Preprocessor:
    """Runs a stage chain on records: `(record, id, epoch) -> (SampleMeta, payload)` or raises Reject.

    Args:
        stages: The chain (see `resolve_stage` for what an entry may be); None = `default_stages()`.
        seed: Seeds every stage's generator together with (epoch, sample id, stage index).
    """

    def __init__(self, stages: Sequence[Any] | None = None, seed: int = 0) -> None:
        self.specs = list(default_stages() if stages is None else stages)
        self.stages = [resolve_stage(s) for s in self.specs]
        self.seed = seed

    def setup(self) -> None:
        """Runs every stage's `setup` (imports, tokenizer builds), so the first sample is not slow."""
        for stage in self.stages:
            fn = getattr(stage, "setup", None)
            if callable(fn):
                fn()

    def __call__(self, record: Record, sample_id: int, epoch: int, source: str = "", base_dir: str = "",
                 seed: int | None = None) -> tuple[SampleMeta, dict[str, np.ndarray]]:
        seed = self.seed if seed is None else seed
        ex = Example(sample_id, epoch, source, [dict(m) for m in record.messages], record.system,
                     decode_images(record, base_dir))
        for k, stage in enumerate(self.stages):
            ctx = StageContext(sample_id, epoch, seed, k)
            try:
                out = stage(ex, ctx)
            except Reject:
                raise
            except Exception as exc:
                name = getattr(stage, "name", type(stage).__name__)
                raise Reject("stage_error", f"{name}: {type(exc).__name__}: {exc}") from None
            if out is not None:
                if not isinstance(out, Example):
                    raise Reject("stage_error", f"stage {k} returned {type(out).__name__}, expected Example or None")
                ex = out
        return finalize(ex)


def finalize(ex: Example) -> tuple[SampleMeta, dict[str, np.ndarray]]:
    """The payload dict and metadata of a finished example; Reject when it carries no loss."""
    if ex.input_ids is None or ex.labels is None:
        raise Reject("stage_error", "the chain produced no input_ids/labels (no Tokenize stage?)")
    ids = np.ascontiguousarray(ex.input_ids, dtype=np.int32)
    labels = np.ascontiguousarray(ex.labels, dtype=np.int32)
    if ids.ndim != 1 or labels.shape != ids.shape:
        raise Reject("stage_error", f"input_ids {ids.shape} and labels {labels.shape} must be equal 1-D shapes")
    n = len(ids)
    if n == 0:
        raise Reject("empty_sample", "no tokens after the stages")
    loss = int(np.count_nonzero(labels[1:] != IGNORE_INDEX))
    if loss == 0:
        raise Reject("no_loss_tokens", f"{n} tokens, none carries loss (after truncation?)")
    payload: dict[str, np.ndarray] = {"input_ids": ids, "labels": labels}
    if ex.image_tensors:
        for key in ex.image_tensors[0]:
            payload[key] = np.concatenate([t[key] for t in ex.image_tensors], axis=0)
    for key, value in ex.extra.items():
        if key in payload:
            raise Reject("stage_error", f"extra payload key {key!r} clashes with a built-in key")
        payload[key] = np.asarray(value)
    vision = int(sum(ex.image_tokens))
    return SampleMeta(n, loss, n - vision, vision), payload
