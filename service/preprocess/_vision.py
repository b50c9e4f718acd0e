"""Vision: decoding a record's images, and the stages that turn image tokens into visual tokens.

    decode_images     record.images                -> RGB PIL images (Reject "bad_image"), before the chain
    Qwen2VLVision     input_ids, labels, images    -> expanded input_ids/labels, image_spans, image_tensors
      | LlavaVision
      | _NoImages     (a text-only chain: a record with images is rejected as "unsupported_image")

A vision stage runs after `Tokenize`: each image token becomes as many visual tokens as the image gets
(labels -100 there), and the image's pixel values go to `image_tensors` for the payload. `smart_resize`
is Qwen2-VL's resize rule, usable on its own to count an image's tokens.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from PIL import Image

from ._parse import IMAGE_MARKER, Record
from ._quarantine import Reject
from ._stage import Example, Stage, StageContext, _as_ref, expand_placeholders
from ._tokenizer import TokenizerRef

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


# ---------------------------------------------------------------------------------------------------
# Image decoding
# ---------------------------------------------------------------------------------------------------
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
                raise Reject(
                    "bad_image", f"images[{k}]: {img.width}x{img.height} exceeds {MAX_IMAGE_PIXELS} pixels"
                )
            img.load()
            out.append(img.convert("RGB"))
        except Reject:
            raise
        except Exception as exc:
            why = (
                "unrecognized image format"
                if isinstance(exc, UnidentifiedImageError)
                else f"{type(exc).__name__}: {exc}"
            )
            raise Reject("bad_image", f"images[{k}]: cannot decode: {why}") from None
    return out


# ---------------------------------------------------------------------------------------------------
# Visual-token expansion
# ---------------------------------------------------------------------------------------------------
def smart_resize(
    height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56, max_pixels: int = 14 * 14 * 4 * 1280
) -> tuple[int, int]:
    """Qwen2-VL's resize rule: both sides multiples of `factor`, pixels within [min_pixels, max_pixels],
    aspect ratio kept as closely as possible (transformers' `image_processing_qwen2_vl.smart_resize`).

    Raises:
        ValueError: if the aspect ratio exceeds 200.
    """
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
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


def _normalize(img: Image.Image, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """A PIL RGB image as a normalized float32 array [3, H, W]."""
    arr: np.ndarray = np.asarray(img, dtype=np.float32) * (1.0 / 255.0)
    arr = (arr - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    return np.ascontiguousarray(arr.transpose(2, 0, 1))


class _VisionStage(Stage):
    """Shared expansion: each image token in input_ids becomes `n_i` copies (labels -100 there)."""

    image_token: str
    tokenizer: TokenizerRef

    def tokens_and_tensors(self, img: Image.Image) -> tuple[int, dict[str, np.ndarray]]:
        raise NotImplementedError

    def setup(self) -> None:
        self.tokenizer.token_id(self.image_token)

    def _markers(self) -> tuple[int | None, int | None]:
        """The ids of the template's start / end tokens around an image's tokens (None: none)."""
        return None, None

    def __call__(self, ex: Example, ctx: StageContext) -> Example:
        if ex.input_ids is None or ex.labels is None:
            raise ValueError(f"{self.name} needs input_ids: put it after Tokenize")
        token_id = self.tokenizer.token_id(self.image_token)
        positions = np.flatnonzero(ex.input_ids == token_id)
        if len(positions) != len(ex.images):
            raise Reject(
                "image_mismatch", f"{len(positions)} {self.image_token} tokens but {len(ex.images)} images"
            )
        if not len(positions):
            return ex
        tokens, tensors = [], []
        for img in ex.images:
            n, t = self.tokens_and_tensors(img)
            tokens.append(n)
            tensors.append(t)
        spans = expand_placeholders(ex, positions, tokens, *self._markers())
        ex.image_tokens, ex.image_tensors, ex.image_spans = tokens, tensors, spans
        return ex


@dataclasses.dataclass(frozen=True)
class Qwen2VLImageConfig:
    """How Qwen2-VL sizes and cuts an image, as its Hugging Face image processor's config says
    (`Qwen2VLImageProcessor`; these defaults are transformers'): `min_pixels`, `max_pixels`, the bounds of
    `smart_resize`; `patch_size`, `merge_size`, `temporal_patch_size`, the vision encoder's geometry;
    `image_mean`, `image_std`, the per-channel normalization (stored as tuples).

    Raises:
        ValueError: naming the value, on a size < 1, `max_pixels` < `min_pixels`, or a mean / std that is
            not 3 numbers (a std of 0).
    """

    min_pixels: int = 56 * 56
    max_pixels: int = 14 * 14 * 4 * 1280
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: Sequence[float] = OPENAI_CLIP_MEAN
    image_std: Sequence[float] = OPENAI_CLIP_STD

    def __post_init__(self) -> None:
        for name in ("min_pixels", "max_pixels", "patch_size", "merge_size", "temporal_patch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {name}={value!r}")
        if self.max_pixels < self.min_pixels:
            raise ValueError(
                f"max_pixels must be >= min_pixels, got max_pixels={self.max_pixels} "
                f"min_pixels={self.min_pixels}"
            )
        for name in ("image_mean", "image_std"):
            value = tuple(float(v) for v in getattr(self, name))
            if len(value) != 3 or (name == "image_std" and 0.0 in value):
                raise ValueError(f"{name} must be 3 numbers (a std non-zero), got {name}={value}")
            object.__setattr__(self, name, value)


class Qwen2VLVision(_VisionStage):
    """Qwen2-VL visual tokens: `smart_resize` to multiples of 28 px, one token per 2x2 merge of 14-px patches.

    An image of H x W becomes H' x W' = smart_resize(H, W) and (H'/28)(W'/28) `<|image_pad|>` tokens
    between the template's `<|vision_start|>` / `<|vision_end|>`. Payload: `pixel_values` float
    [sum of patches, 3 * temporal_patch_size * 14 * 14] (CLIP-normalized, flattened in Qwen2-VL's patch
    order, the image repeated over the temporal patch) and `image_grid_thw` int64 [images, 3].

    Args:
        tokenizer: Tokenizer holding the image tokens (default: the demo tokenizer).
        images: The pixel bounds of smart_resize, the encoder's geometry and the normalization
            (`Qwen2VLImageConfig`; default: transformers' Qwen2-VL defaults).
        image_token, vision_start, vision_end: The template's image tokens.
        pixel_dtype: "float32" or "float16" for `pixel_values`.

    Raises:
        ValueError: naming the value when `images` is not a `Qwen2VLImageConfig`.
    """

    def __init__(
        self,
        tokenizer: str | os.PathLike[str] | TokenizerRef | None = None,
        images: Qwen2VLImageConfig | None = None,
        image_token: str = "<|image_pad|>",
        vision_start: str = "<|vision_start|>",
        vision_end: str = "<|vision_end|>",
        pixel_dtype: str = "float32",
    ) -> None:
        images = Qwen2VLImageConfig() if images is None else images
        if not isinstance(images, Qwen2VLImageConfig):
            raise ValueError(f"images must be a Qwen2VLImageConfig, got {images=!r}")
        self.tokenizer = _as_ref(tokenizer)
        self.images = images
        self.image_token, self.vision_start, self.vision_end = image_token, vision_start, vision_end
        self.min_pixels, self.max_pixels = images.min_pixels, images.max_pixels
        self.patch_size, self.merge_size = images.patch_size, images.merge_size
        self.temporal_patch_size = images.temporal_patch_size
        self.pixel_dtype, self.mean, self.std = (
            np.dtype(pixel_dtype).name,
            images.image_mean,
            images.image_std,
        )

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def num_tokens(self, height: int, width: int) -> int:
        """Visual tokens of an H x W image (without the start/end tokens)."""
        h, w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return (h // self.factor) * (w // self.factor)

    def tokens_and_tensors(self, img: Image.Image) -> tuple[int, dict[str, np.ndarray]]:
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
        return (gh // m) * (gw // m), {
            "pixel_values": flat,
            "image_grid_thw": np.array([[1, gh, gw]], dtype=np.int64),
        }

    def _markers(self) -> tuple[int | None, int | None]:
        return self.tokenizer.token_id(self.vision_start), self.tokenizer.token_id(self.vision_end)


class LlavaVision(_VisionStage):
    """LLaVA-1.5 visual tokens: a fixed (image_size / patch_size)^2 = 576 tokens per image.

    The image is padded to a square with the mean color, resized to image_size (336) and CLIP-normalized.
    Payload: `pixel_values` float [images, 3, image_size, image_size].
    """

    def __init__(
        self,
        tokenizer: str | os.PathLike[str] | TokenizerRef | None = None,
        image_token: str = IMAGE_MARKER,
        image_size: int = 336,
        patch_size: int = 14,
        pixel_dtype: str = "float32",
        mean: Sequence[float] = OPENAI_CLIP_MEAN,
        std: Sequence[float] = OPENAI_CLIP_STD,
    ) -> None:
        self.tokenizer = _as_ref(tokenizer)
        self.image_token, self.image_size, self.patch_size = image_token, int(image_size), int(patch_size)
        self.pixel_dtype, self.mean, self.std = np.dtype(pixel_dtype).name, tuple(mean), tuple(std)

    def num_tokens(self, height: int = 0, width: int = 0) -> int:
        return (self.image_size // self.patch_size) ** 2

    def tokens_and_tensors(self, img: Image.Image) -> tuple[int, dict[str, np.ndarray]]:
        from PIL import Image

        side = max(img.width, img.height)
        square = Image.new("RGB", (side, side), tuple(int(255 * c) for c in self.mean))
        square.paste(img, ((side - img.width) // 2, (side - img.height) // 2))
        sq = square.resize((self.image_size, self.image_size), Image.Resampling.BICUBIC)
        arr = _normalize(sq, self.mean, self.std)[None].astype(self.pixel_dtype)
        return self.num_tokens(), {"pixel_values": arr}


class _NoImages(Stage):
    def __call__(self, ex: Example, ctx: StageContext) -> Example:
        if ex.images:
            raise Reject("unsupported_image", "the chain has no vision stage")
        return ex
