"""Collation: per-sample payloads to the tensors a causal LM consumes, padded or packed.

A sample payload is a dict of 1-D numpy arrays: ``"input_ids"`` (int32/int64, shape [n]) and an
optional ``"labels"`` (same shape, -100 = no loss). Without labels the sample is plain causal-LM
data: ``labels = input_ids`` with position 0 set to -100 (nothing predicts the first token).

Two layouts, matching `batchd.core.CostModel`'s ``padded`` and ``packed`` costs:

* **padded** (`collate_padded`): B rows right-padded to the longest sample T. Works with any
  attention kernel; costs B x T tokens of compute, so it relies on batchd grouping similar lengths.
  Pads get ``attention_mask == 0``, ``labels == -100`` and ``position_ids == 0``.
* **packed** (`collate_packed`): one row of S = sum(n_i) tokens with ``cu_seqlens`` boundaries and
  ``position_ids`` that restart at 0 per sample. No padding compute, but attention must be
  block-diagonal (varlen kernels take ``cu_seqlens``; the demo model `batchd.TinyCausalLM` derives the
  blocks from the position restarts). The first label of every sample is -100, so the last token of
  sample i never learns to predict the first token of sample i + 1.

The loss is the *shifted* causal-LM loss (logits at t predict labels at t + 1), so a sample of
length n contributes ``count(labels[1:] != -100)`` tokens (`loss_tokens`). batchd's
``Sample.loss_tokens`` must be set to exactly that number: the per-step loss scale
``N * t_r / T_tok`` (`batchd.core.loss_scale`) is exact only when every t_r counts the tokens the
loss actually averages over. Label position 0 never counts, so setting it to -100 in the packed
layout changes no sample's count.

Vision inputs: when samples carry ``pixel_values`` (and, for Qwen2-VL, ``image_grid_thw``), both
layouts add them to the batch, concatenated along dim 0 over the samples that have them, in row
order: Qwen2-VL ``pixel_values`` [sum of patches, C] and ``image_grid_thw`` [images, 3] (the model
splits them per image with the grid, as Qwen2-VL's own collator does), LLaVA ``pixel_values``
[images, 3, S, S]. Their dtype is kept (float32/float16). Samples without images add nothing. Audio
clips alike (`AUDIO_KEYS`): ``audio_features`` [sum of frames, mel bins] and ``audio_frames`` [clips], the
frames of each clip (the model splits the features per clip with them).

Per-token model inputs (`TOKEN_KEYS`: HF Qwen2-VL's ``mm_token_type_ids``, 0 text / 1 image / 2 video)
are collated like input_ids: [B, T] with 0 at pads, or the [1, S] packed row. A two-phase step's LLM part
also carries ``llm_image_grid_thw`` (`llm_grids`): the grids of its own LLM images, which its M-RoPE
positions need while the pixels travel to the ranks that encode them.

All functions are pure: numpy in, fresh numpy arrays out (int64 unless stated). The rank service
collates with them (the daemon needs no torch); `batchd.client` turns the arrays into torch tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

IGNORE_INDEX = -100
VISION_KEYS = ("pixel_values", "image_grid_thw")
AUDIO_KEYS = ("audio_features", "audio_frames")
TOKEN_KEYS = ("mm_token_type_ids",)
"""Per-token integer arrays a payload may carry beside input_ids (HF processors' outputs the model takes):
collated like input_ids, 0 at pads."""
LLM_GRID_KEY = "llm_image_grid_thw"

Payload = Mapping[str, np.ndarray]


def _input_ids(sample: Payload, index: int) -> np.ndarray:
    """Returns sample `index`'s input_ids as int64, validating shape and dtype."""
    if "input_ids" not in sample:
        raise ValueError(f"sample {index} has no 'input_ids': keys={sorted(sample)}")
    ids = np.asarray(sample["input_ids"])
    if ids.ndim != 1 or ids.shape[0] < 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            f"sample {index}: input_ids must be a non-empty 1-D integer array, got {ids.shape=} {ids.dtype=}"
        )
    return ids.astype(np.int64, copy=False)


def _labels(sample: Payload, ids: np.ndarray, index: int) -> np.ndarray:
    """Returns sample `index`'s labels as a fresh int64 array (default: shifted input_ids)."""
    if sample.get("labels") is None:
        labels = ids.copy()
        labels[0] = IGNORE_INDEX
        return labels
    labels = np.asarray(sample["labels"])
    if labels.shape != ids.shape or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            f"sample {index}: labels must be an integer array shaped like input_ids, got "
            f"{labels.shape=} {labels.dtype=} vs {ids.shape=}"
        )
    return labels.astype(np.int64, copy=True)


def _parse(samples: Sequence[Payload]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Validates `samples` and returns (input_ids, labels) int64 pairs."""
    if isinstance(samples, Mapping) or len(samples) == 0:
        raise ValueError(
            f"samples must be a non-empty sequence of payload dicts, got "
            f"{type(samples).__name__} with {len(samples)=}"
        )
    out = []
    for i, sample in enumerate(samples):
        ids = _input_ids(sample, i)
        out.append((ids, _labels(sample, ids, i)))
    return out


def _vision(samples: Sequence[Payload]) -> dict[str, np.ndarray]:
    """The samples' vision and audio tensors, concatenated along dim 0 in sample order (see the module
    docstring)."""
    out: dict[str, np.ndarray] = {}
    for key in VISION_KEYS + AUDIO_KEYS:
        parts = [np.asarray(s[key]) for s in samples if s.get(key) is not None]
        if parts:
            try:
                out[key] = np.ascontiguousarray(np.concatenate(parts, axis=0))
            except ValueError as exc:
                raise ValueError(f"{key}: samples disagree on the trailing shape: {exc}") from None
    return out


def _tokens(
    samples: Sequence[Payload], parsed: list[tuple[np.ndarray, np.ndarray]]
) -> dict[str, list[np.ndarray]]:
    """Per `TOKEN_KEYS` key, each sample's int64 array (every sample must carry it, shaped like input_ids)."""
    out: dict[str, list[np.ndarray]] = {}
    for key in TOKEN_KEYS:
        have = [s.get(key) is not None for s in samples]
        if not any(have):
            continue
        if not all(have):
            raise ValueError(
                f"{key}: some samples carry it and some do not (samples {have.index(False)} "
                f"and {have.index(True)})"
            )
        arrays = []
        for i, (s, (ids, _)) in enumerate(zip(samples, parsed, strict=False)):
            arr = np.asarray(s[key])
            if arr.shape != ids.shape or not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(
                    f"sample {i}: {key} must be an integer array shaped like input_ids, got "
                    f"{arr.shape=} {arr.dtype=} vs {ids.shape=}"
                )
            arrays.append(arr.astype(np.int64, copy=False))
        out[key] = arrays
    return out


def _check_pad_id(pad_id: int) -> int:
    if isinstance(pad_id, bool) or not isinstance(pad_id, int) or pad_id < 0:
        raise ValueError(f"pad_id must be a non-negative int, got {pad_id=}")
    return pad_id


def collate_padded(samples: Sequence[Payload], pad_id: int = 0) -> dict[str, np.ndarray]:
    """Right-pads samples into a [B, T] batch, T = the longest sample.

    Args:
        samples: Payload dicts (see the module docstring).
        pad_id: Token id written at pad positions (never attended to, never in the loss).

    Returns:
        ``input_ids``, ``attention_mask`` (1 real, 0 pad), ``labels`` (-100 at pads) and
        ``position_ids`` (0..n-1 on real tokens, 0 on pads), all int64 [B, T]; plus ``pixel_values``
        / ``image_grid_thw`` when samples carry them (see the module docstring).

    Raises:
        ValueError: on an empty list, a malformed payload or a negative `pad_id`.
    """
    _check_pad_id(pad_id)
    parsed = _parse(samples)
    b, t = len(parsed), max(ids.shape[0] for ids, _ in parsed)
    input_ids = np.full((b, t), pad_id, dtype=np.int64)
    labels = np.full((b, t), IGNORE_INDEX, dtype=np.int64)
    mask = np.zeros((b, t), dtype=np.int64)
    positions = np.zeros((b, t), dtype=np.int64)
    for row, (ids, lab) in enumerate(parsed):
        n = ids.shape[0]
        input_ids[row, :n], labels[row, :n], mask[row, :n] = ids, lab, 1
        positions[row, :n] = np.arange(n)
    tokens = {}
    for key, arrays in _tokens(samples, parsed).items():
        tokens[key] = np.zeros((b, t), dtype=np.int64)
        for row, arr in enumerate(arrays):
            tokens[key][row, : arr.shape[0]] = arr
    return {
        "input_ids": input_ids,
        "attention_mask": mask,
        "labels": labels,
        "position_ids": positions,
        **tokens,
        **_vision(samples),
    }


def collate_packed(samples: Sequence[Payload]) -> dict[str, np.ndarray | int]:
    """Concatenates samples into one [1, S] row with varlen boundaries, S = sum of lengths.

    Args:
        samples: Payload dicts (see the module docstring).

    Returns:
        ``input_ids``, ``labels`` (first token of every sample -100) and ``position_ids``
        (restarting at 0 per sample), int64 [1, S]; ``cu_seqlens`` int32 [B + 1] (cumulative
        lengths, starting at 0); ``max_seqlen`` (a Python int); plus ``pixel_values`` /
        ``image_grid_thw`` when samples carry them (see the module docstring).

    Raises:
        ValueError: on an empty list or a malformed payload.
    """
    parsed = _parse(samples)
    lengths = np.array([ids.shape[0] for ids, _ in parsed], dtype=np.int64)
    labels = [lab for _, lab in parsed]
    for lab in labels:
        lab[0] = IGNORE_INDEX
    cu = np.zeros(len(parsed) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
    return {
        "input_ids": np.concatenate([ids for ids, _ in parsed])[None],
        "labels": np.concatenate(labels)[None],
        "position_ids": positions[None],
        "cu_seqlens": cu,
        "max_seqlen": int(lengths.max()),
        **{key: np.concatenate(arrays)[None] for key, arrays in _tokens(samples, parsed).items()},
        **_vision(samples),
    }


def idle_batch(pad_id: int = 0) -> dict[str, np.ndarray]:
    """A 1-token dummy batch for IDLE steps: padded layout, real token `pad_id`, no loss.

    The token is marked real (``attention_mask == 1``) so the forward is well defined; its label is
    -100, so the batch carries no loss tokens and the trainer weights it by zero.
    """
    _check_pad_id(pad_id)
    return collate_padded(
        [
            {
                "input_ids": np.array([pad_id], dtype=np.int64),
                "labels": np.array([IGNORE_INDEX], dtype=np.int64),
            }
        ],
        pad_id=pad_id,
    )


def loss_tokens(labels_row: np.ndarray) -> int:
    """Tokens of one sample that enter the shifted causal-LM loss: count(labels[1:] != -100).

    Set ``batchd.core.Sample.loss_tokens`` to exactly this value (on the sample's own labels, before
    any packing): the loss scale is exact only then. Position 0 never counts (nothing predicts it).

    Args:
        labels_row: One sample's 1-D labels (any integer dtype; anything `np.asarray` takes).

    Raises:
        ValueError: if `labels_row` is not 1-D.
    """
    shape = tuple(labels_row.shape)
    if len(shape) != 1:
        raise ValueError(f"labels_row must be 1-D (one sample), got {shape=}")
    return int(np.count_nonzero(np.asarray(labels_row)[1:] != IGNORE_INDEX))


def image_of(sample: Payload, index: int) -> dict[str, np.ndarray]:
    """Image `index` of a sample's payload, as a one-image payload: Qwen2-VL's ``pixel_values`` rows of that
    image (its grid's t x h x w patches, located by ``image_grid_thw``) and its grid row; LLaVA's
    [1, 3, S, S] slice (no grid).

    Raises:
        ValueError: the payload has no image `index` (naming both counts).
    """
    pixels = sample.get("pixel_values")
    if pixels is None:
        raise ValueError(f"image {index} requested of a payload without pixel_values: keys={sorted(sample)}")
    pixels = np.asarray(pixels)
    grid = sample.get("image_grid_thw")
    if grid is None:
        if not 0 <= index < pixels.shape[0]:
            raise ValueError(f"image {index} requested of a payload with {pixels.shape[0]} images")
        return {"pixel_values": pixels[index : index + 1]}
    grid = np.asarray(grid).reshape(-1, 3)
    if not 0 <= index < grid.shape[0]:
        raise ValueError(f"image {index} requested of a payload with {grid.shape[0]} images")
    sizes = np.prod(grid, axis=1)
    start = int(sizes[:index].sum())
    return {
        "pixel_values": pixels[start : start + int(sizes[index])],
        "image_grid_thw": grid[index : index + 1],
    }


def collate_images(images: Sequence[Payload]) -> dict[str, np.ndarray]:
    """The vision-encoder input of a two-phase step: one-image payloads (`image_of`) concatenated in order.
    No image: no key (the trainer's encoder then runs on nothing and the exchange sends zero rows)."""
    return _vision(images)


def collate_clips(clips: Sequence[Payload]) -> dict[str, np.ndarray]:
    """The audio-encoder input of a step whose audio phase is exchanged: one-clip payloads (`clip_of`)
    concatenated in order. No clip: no key."""
    return {k: v for k, v in _vision(clips).items() if k in AUDIO_KEYS}


def strip_vision(samples: Sequence[Payload]) -> list[dict[str, np.ndarray]]:
    """The payloads without their vision tensors (a two-phase step's LLM part: the images travel to the
    ranks that encode them, `collate_images`)."""
    return [{k: v for k, v in s.items() if k not in VISION_KEYS} for s in samples]


def clip_of(sample: Payload, index: int) -> dict[str, np.ndarray]:
    """Audio clip `index` of a sample's payload, as a one-clip payload: its ``audio_features`` rows (located
    by ``audio_frames``) and its frame count.

    Raises:
        ValueError: the payload has no clip `index` (naming both counts).
    """
    feats, frames = sample.get("audio_features"), sample.get("audio_frames")
    if feats is None or frames is None:
        raise ValueError(f"clip {index} requested of a payload without audio: keys={sorted(sample)}")
    frames = np.asarray(frames).reshape(-1)
    if not 0 <= index < frames.shape[0]:
        raise ValueError(f"clip {index} requested of a payload with {frames.shape[0]} clips")
    start = int(frames[:index].sum())
    return {
        "audio_features": np.asarray(feats)[start : start + int(frames[index])],
        "audio_frames": frames[index : index + 1],
    }


def strip_audio(samples: Sequence[Payload]) -> list[dict[str, np.ndarray]]:
    """The payloads without their audio tensors (a step whose audio phase is exchanged: the clips travel
    to the ranks that encode them, concatenated by `collate`'s rules from `clip_of` payloads)."""
    return [{k: v for k, v in s.items() if k not in AUDIO_KEYS} for s in samples]


def llm_grids(samples: Sequence[Payload]) -> dict[str, np.ndarray]:
    """A two-phase step's ``llm_image_grid_thw`` [images, 3]: the grids of the LLM samples' own images, in
    LLM order (samples in batch order, images in sample order), which M-RoPE positions need while the
    pixels travel to other ranks. No key when no sample has a grid (LLaVA, text-only steps)."""
    parts = [
        np.asarray(s["image_grid_thw"]).reshape(-1, 3) for s in samples if s.get("image_grid_thw") is not None
    ]
    return {LLM_GRID_KEY: np.ascontiguousarray(np.concatenate(parts).astype(np.int64))} if parts else {}
