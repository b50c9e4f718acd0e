"""Chains: `default_stages` builds the standard chain; `Preprocessor` runs a chain on a parsed record.

The default chain and what each stage reads -> writes:

    [SystemPrompt, TurnSubsample, RandomResizedCrop]   messages/system/images -> same (augment=True)
    ChatTemplate      messages, system             -> text, assistant_spans (char spans that carry loss)
    Tokenize          text, assistant_spans        -> input_ids, labels (-100 outside assistant spans)
    Qwen2VLVision     input_ids, labels, images    -> expanded input_ids/labels, image_spans, image_tensors
      | LlavaVision
    Qwen2Audio        input_ids, labels, audios    -> expanded input_ids/labels, audio_spans, audio_tensors
    Truncate          everything above             -> cut to the cutoff (never inside an image or a clip)
                                                      or Reject

With `processor=DIR` the model's own Hugging Face processor replaces the middle stages, audio included when
it has an audio feature extractor (Qwen2-Audio); without one, a record with clips is quarantined as
"unsupported_audio":

    HFProcessor       messages, system, images,    -> input_ids, labels, image_spans, image_tensors,
                      audios                          audio_spans, audio_tensors, extra
    _NoAudio          audios                       -> a guard: clips left are rejected (HFProcessor empties
                                                      `audios` once it has taken them)

`Preprocessor` runs a chain on a parsed record and returns the sample's metadata and payload: the
payload is a dict of numpy arrays (`input_ids` and `labels` int32, plus `pixel_values` and, for
Qwen2-VL, `image_grid_thw` when the sample has images, `audio_features` and `audio_frames` when it has
audio clips, plus any `example.extra` arrays a plug-in adds). The realized length is `len(input_ids)`
after every stage; `loss_tokens = count(labels[1:] != -100)`; modality tokens: ("text", length - vision
- audio), ("vision", expanded image placeholder tokens) and, with clips, ("audio", their tokens). Any other
error a stage raises becomes `Reject("stage_error", ...)`: it quarantines the record, not the actor.

The only module that imports every built-in stage (`_augment`, `_text`, `_vision`, `_hf`; the augmentation
stages through `Augmentation`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._audio import QWEN2_AUDIO, Qwen2Audio, _NoAudio, decode_audios
from ._augment import Augmentation
from ._hf import HFProcessor
from ._parse import IMAGE_MARKER, Record
from ._quarantine import Reject
from ._stage import IGNORE_INDEX, Example, Stage, StageContext, _as_ref, resolve_stage
from ._text import QWEN2VL_IMAGE, ChatTemplate, Tokenize, Truncate
from ._tokenizer import TokenizerRef
from ._vision import LlavaVision, Qwen2VLImageConfig, Qwen2VLVision, _NoImages, decode_images


def default_stages(
    tokenizer: str | os.PathLike[str] | TokenizerRef | None = None,
    template: str = "qwen2",
    vision: str | Qwen2VLImageConfig | None = "qwen2_vl",
    cutoff: int = 4096,
    policy: str = "truncate",
    augment: bool | Augmentation = False,
    processor: str | os.PathLike[str] | None = None,
    audio: str | None = "qwen2_audio",
) -> list[Stage]:
    """The standard chain: [augmentation] -> chat template -> tokenize -> vision -> truncate, or with
    `processor`: [augmentation] -> HFProcessor(processor) -> truncate.

    Args:
        tokenizer: Local tokenizer.json (default: the demo tokenizer, trained locally on first use).
        template: "chatml", "qwen2", "llama3" or Jinja text.
        vision: "qwen2_vl" (Qwen2-VL with transformers' pixel bounds), a `Qwen2VLImageConfig` (Qwen2-VL
            with its `min_pixels`, `max_pixels`, ...), "llava" or None (text only; records with images
            are then quarantined).
        cutoff, policy: The Truncate stage.
        augment: True: add SystemPrompt, TurnSubsample and RandomResizedCrop (`Augmentation()`); an
            `Augmentation`: those with its prompts and probabilities.
        processor: A Hugging Face processor directory (the model's own, read offline): its chat template,
            tokenizer, image processor and audio feature extractor replace `tokenizer`, `template`,
            `vision` and `audio`.
        audio: "qwen2_audio" (records' audio clips become Qwen2-Audio tokens and log-mel features) or None
            (records with audio are quarantined as "unsupported_audio").
    """
    if audio not in ("qwen2_audio", None):
        raise ValueError(f"audio must be 'qwen2_audio' or None, got {audio=}")
    placeholder = QWEN2_AUDIO if audio is not None else "<audio>"
    tok = _as_ref(tokenizer) if processor is None else None
    chain: list[Stage] = []
    if augment is not False:
        if augment is not True and not isinstance(augment, Augmentation):
            raise ValueError(f"augment must be a bool or an Augmentation, got {augment=!r}")
        chain += (Augmentation() if augment is True else augment).stages()
    if processor is not None:  # HFProcessor takes (and consumes) the clips or refuses them; _NoAudio: a guard
        chain += [HFProcessor(processor), _NoAudio()]
    elif vision in ("qwen2_vl", "llava", None) or isinstance(vision, Qwen2VLImageConfig):
        qwen2_vl = Qwen2VLImageConfig() if vision == "qwen2_vl" else vision
        stage: Stage = (
            Qwen2VLVision(tok, qwen2_vl)
            if isinstance(qwen2_vl, Qwen2VLImageConfig)
            else LlavaVision(tok)
            if vision == "llava"
            else _NoImages()
        )
        image = QWEN2VL_IMAGE if isinstance(qwen2_vl, Qwen2VLImageConfig) else IMAGE_MARKER
        chain += [
            ChatTemplate(template, image_placeholder=image, audio_placeholder=placeholder),
            Tokenize(tok),
        ]
        chain += [stage, Qwen2Audio(tok) if audio is not None else _NoAudio()]
    else:
        raise ValueError(f"vision must be 'qwen2_vl', a Qwen2VLImageConfig, 'llava' or None, got {vision=}")
    chain.append(Truncate(cutoff, policy))
    return chain


@dataclasses.dataclass(frozen=True)
class SampleMeta:
    """Metadata of a preprocessed sample (what travels to the batching service)."""

    length: int
    loss_tokens: int
    text_tokens: int
    vision_tokens: int
    images: tuple[tuple[int, int], ...] = ()  # per image: (encoder patches, tokens in the sequence)
    audio: tuple[tuple[int, int], ...] = ()  # per audio clip: (encoder frames, tokens in the sequence)

    def modality_tokens(self) -> tuple[tuple[str, int], ...]:
        out = (("text", self.text_tokens), ("vision", self.vision_tokens))
        heard = sum(t for _, t in self.audio)
        return (*out, ("audio", heard)) if heard else out


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

    def __call__(
        self,
        record: Record,
        sample_id: int,
        epoch: int,
        source: str = "",
        base_dir: str = "",
        seed: int | None = None,
    ) -> tuple[SampleMeta, dict[str, np.ndarray]]:
        seed = self.seed if seed is None else seed
        ex = Example(
            sample_id,
            epoch,
            source,
            [dict(m) for m in record.messages],
            record.system,
            decode_images(record, base_dir),
            audios=decode_audios(record, base_dir),
        )
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
                    raise Reject(
                        "stage_error", f"stage {k} returned {type(out).__name__}, expected Example or None"
                    )
                ex = out
        return finalize(ex)


def finalize(ex: Example) -> tuple[SampleMeta, dict[str, np.ndarray]]:
    """The payload dict and metadata of a finished example; Reject when it carries no loss."""
    if ex.input_ids is None or ex.labels is None:
        raise Reject("stage_error", "the chain produced no input_ids/labels (no Tokenize stage?)")
    ids = np.ascontiguousarray(ex.input_ids, dtype=np.int32)
    labels = np.ascontiguousarray(ex.labels, dtype=np.int32)
    if ids.ndim != 1 or labels.shape != ids.shape:
        raise Reject(
            "stage_error", f"input_ids {ids.shape} and labels {labels.shape} must be equal 1-D shapes"
        )
    n = len(ids)
    if n == 0:
        raise Reject("empty_sample", "no tokens after the stages")
    loss = int(np.count_nonzero(labels[1:] != IGNORE_INDEX))
    if loss == 0:
        raise Reject("no_loss_tokens", f"{n} tokens, none carries loss (after truncation?)")
    payload: dict[str, np.ndarray] = {"input_ids": ids, "labels": labels}
    for tensors in (ex.image_tensors, ex.audio_tensors):
        for key in tensors[0] if tensors else ():
            payload[key] = np.concatenate([t[key] for t in tensors], axis=0)
    for key, value in ex.extra.items():
        if key in payload:
            raise Reject("stage_error", f"extra payload key {key!r} clashes with a built-in key")
        payload[key] = np.asarray(value)
    vision, heard = int(sum(ex.image_tokens)), int(sum(ex.audio_tokens))
    images = tuple(
        (_patches(t, n_tok), int(n_tok)) for t, n_tok in zip(ex.image_tensors, ex.image_tokens, strict=False)
    )
    audio = tuple(
        (int(t["audio_frames"].sum()), int(n_tok))
        for t, n_tok in zip(ex.audio_tensors, ex.audio_tokens, strict=True)
    )
    return SampleMeta(n, loss, n - vision - heard, vision, images, audio), payload


def _patches(tensors: dict[str, np.ndarray], tokens: int) -> int:
    """An image's vision-encoder patches: t x h x w of its Qwen2-VL grid; without a grid (LLaVA: one patch
    per visual token, no merge) its token count."""
    grid = tensors.get("image_grid_thw")
    return int(np.prod(grid)) if grid is not None else int(tokens)
