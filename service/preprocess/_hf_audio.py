"""`HFProcessor`'s audio side: a processor's own audio feature extractor (Qwen2-Audio...) on a record's clips.

    AudioSide       what HFProcessor reads off a processor with an audio feature extractor, once per process
    audio_side      proc -> AudioSide, or None for a processor without one (its records with clips are then
                    rejected as "unsupported_audio")
    prepare_clips   ex.audios (16 kHz) -> the clips at the extractor's rate; Reject("bad_audio") for one
                    longer than its window (the extractor would cut it silently), not mono, not finite
    with_clips      a conversation's audio parts given their clips (for `apply_chat_template`)
    audio_runs      input_ids -> one run of the audio token per clip, else a named Reject
    clip_reject     on a processor error: Reject("bad_audio") naming the clip the extractor fails on
    audio_tensors   the processor's outputs -> per clip (frames, tokens) and the pipeline's tensors

The processor pads every clip's features to its window (Whisper, Qwen2-Audio: 30 s = 3000 log-mel frames)
and says which frames are the clip's in a mask (`feature_attention_mask`). Kept per clip: only those frames,
`audio_features` float [frames, n_mels] (the processor's own values, transposed to the pipeline's
time-major layout) and `audio_frames` int64 [1], the same tensors the built-in `Qwen2Audio` stage writes.
The padding frames are masked out of the model's audio tower (that mask): a trainer feeding a model that
wants the padded shape (transformers' Qwen2-Audio) pads each clip back to the window with Whisper's
silence, the clip's max - 2, and builds the mask from `audio_frames`. That gives back the processor's own
tensor except the one or two frames right after the clip, whose windows overlap its end (masked; only the
encoder's first convolution reads the first of them, at the clip's last frame). Each clip's tokens are the
length of the run the processor expanded its placeholder to, never a rule of ours.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._audio import SAMPLE_RATE, resample
from ._quarantine import Reject

FEATURES = "input_features"  # what Whisper-style feature extractors name their features
MASKS = ("feature_attention_mask", "input_features_mask", "audio_attention_mask")


def _first_line(exc: BaseException, limit: int = 300) -> str:
    """`TypeName: the first line of the message`, cut to `limit` characters (for Reject details)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {(text[0] if text else '')[:limit]}"


class AudioSide:
    """A processor's audio feature extractor, its audio token and the tokens around each clip's run.

    Attributes:
        fe: The feature extractor (a transformers `SequenceFeatureExtractor`).
        rate: Its sampling rate (Hz).
        max_samples: The longest clip it takes whole (Whisper: `n_samples`, 30 s), or None.
        token, token_id: The placeholder each clip's run is made of (Qwen2-Audio: `<|AUDIO|>`).
        wrap: (tokens before, tokens after) each run that belong to the clip (Qwen2-Audio:
            `<|audio_bos|>`, `<|audio_eos|>`), from the processor's `audio_bos_token` / `audio_eos_token`;
            `Truncate` drops them with the clip.

    Raises:
        ValueError: naming `path` when the processor names no audio token the tokenizer knows.
    """

    def __init__(self, proc: Any, fe: Any, tok: Any, path: str) -> None:
        self.fe = fe
        self.rate = int(fe.sampling_rate)
        n = getattr(fe, "n_samples", None)
        self.max_samples = int(n) if n else None
        token = getattr(proc, "audio_token", None)
        tid = getattr(proc, "audio_token_id", None)
        if tid is None and token is not None:
            tid = tok.convert_tokens_to_ids(token)
        if token is None or tid is None or tid == tok.unk_token_id:
            raise ValueError(f"the processor at {path} names no audio token (audio_token / audio_token_id)")
        self.token, self.token_id = str(token), int(tid)
        around = []
        for name in ("audio_bos_token", "audio_eos_token"):
            t = getattr(proc, name, None)
            i = tok.convert_tokens_to_ids(t) if isinstance(t, str) else None
            around.append([int(i)] if i is not None and i != tok.unk_token_id else [])
        self.wrap: tuple[list[int], list[int]] = (around[0], around[1])


def audio_side(proc: Any, tok: Any, path: str) -> AudioSide | None:
    """The processor's `AudioSide`, or None when it has no audio feature extractor (`audio_processor` or
    `feature_extractor` holding a transformers `SequenceFeatureExtractor`)."""
    from transformers import SequenceFeatureExtractor

    fe = getattr(proc, "audio_processor", None) or getattr(proc, "feature_extractor", None)
    if not isinstance(fe, SequenceFeatureExtractor) or not getattr(fe, "sampling_rate", None):
        return None
    return AudioSide(proc, fe, tok, path)


def prepare_clips(side: AudioSide, clips: list[np.ndarray]) -> list[np.ndarray]:
    """The clips (mono float32 at `SAMPLE_RATE`, as `decode_audios` gives them) at the extractor's rate.

    Raises:
        Reject: "bad_audio" naming a clip that is not mono ([samples]), has samples that are not finite,
            or is longer than the extractor's window (it would be cut silently).
    """
    out = []
    for k, clip in enumerate(clips):
        x = np.asarray(clip, dtype=np.float32)
        if x.ndim != 1:  # a [samples, channels] array would be taken for a batch of clips
            raise Reject("bad_audio", f"audios[{k}]: shape {x.shape}, expected mono samples [n]")
        if not np.isfinite(x).all():
            raise Reject("bad_audio", f"audios[{k}]: samples that are not finite")
        x = resample(x, SAMPLE_RATE, side.rate)
        if side.max_samples is not None and len(x) > side.max_samples:
            raise Reject(
                "bad_audio",
                f"audios[{k}]: {len(x) / side.rate:.2f} s is longer than the processor's "
                f"{side.max_samples / side.rate:g} s window (split it into clips in the record)",
            )
        out.append(x)
    return out


def with_clips(conv: list[dict[str, Any]], clips: list[np.ndarray]) -> list[dict[str, Any]]:
    """`conv` with the clips in its `{"type": "audio"}` parts, in order (what transformers'
    `apply_chat_template(tokenize=True)` takes audio from)."""
    it = iter(clips)
    return [
        {
            **m,
            "content": [{**p, "audio": next(it)} if p.get("type") == "audio" else p for p in m["content"]]
            if isinstance(m["content"], list)
            else m["content"],
        }
        for m in conv
    ]


def _token_count(side: AudioSide, proc: Any, clip: np.ndarray) -> int:
    """How many audio tokens the processor expands one clip alone to."""
    out = proc(text=[side.token], audio=[clip], sampling_rate=side.rate, return_tensors="np")
    return int(np.count_nonzero(np.asarray(out["input_ids"])[0] == side.token_id))


def audio_runs(side: AudioSide, proc: Any, ids: np.ndarray, clips: list[np.ndarray]) -> list[tuple[int, int]]:
    """Token spans of the runs of the audio token in `ids`: one per clip, in order.

    Raises:
        Reject: "bad_audio" naming a clip the processor gives no token (too short), else
            "audio_mismatch" when the runs are not one per clip.
    """
    is_tok = np.concatenate([[False], ids == side.token_id, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(is_tok))
    runs = [(int(s), int(e)) for s, e in zip(edges[0::2], edges[1::2], strict=False)]
    if len(runs) == len(clips):
        return runs
    for k, clip in enumerate(clips):  # which clip? (only on the error path)
        try:
            n = _token_count(side, proc, clip)
        except Exception as exc:  # noqa: BLE001 - whatever the processor raises on this clip alone
            raise Reject("bad_audio", f"audios[{k}]: {_first_line(exc)}") from None
        if n == 0:
            raise Reject(
                "bad_audio",
                f"audios[{k}]: {len(clip) / side.rate:.3f} s is too short for one {side.token} token",
            )
    raise Reject(
        "audio_mismatch",
        f"{len(runs)} runs of {side.token} tokens for {len(clips)} clips "
        f"(HFProcessor needs one run per clip)",
    )


def clip_reject(side: AudioSide, clips: list[np.ndarray]) -> Reject | None:
    """Reject("bad_audio") naming the first clip the feature extractor fails on alone, or None."""
    for k, clip in enumerate(clips):
        try:
            side.fe(clip, sampling_rate=side.rate, return_tensors="np")
        except Exception as exc:  # noqa: BLE001 - whatever the extractor raises on this clip
            return Reject("bad_audio", f"audios[{k}]: {_first_line(exc)}")
    return None


def audio_tensors(
    out: dict[str, Any], runs: list[tuple[int, int]]
) -> tuple[list[int], list[dict[str, np.ndarray]]]:
    """(tokens, tensors) per clip from the processor's outputs, whose feature keys it pops from `out`.

    tokens[k] = the length of run k. tensors[k] = {"audio_features": float [frames, n_mels] (clip k's rows
    of `input_features` [clips, n_mels, window] where its mask is set; all of them without a mask),
    "audio_frames": int64 [1] = [frames]} (module docstring).

    Raises:
        Reject: "processor_error" when the outputs hold no features for the clips.
    """
    feats = out.pop(FEATURES, None)
    masks = [out.pop(k) for k in MASKS if out.get(k) is not None]
    if feats is None or len(np.asarray(feats)) != len(runs):
        raise Reject("processor_error", f"the processor returned no {FEATURES} for the {len(runs)} clips")
    feats = np.asarray(feats)
    mask = np.asarray(masks[0]).astype(bool) if masks else np.ones(feats.shape[::2], dtype=bool)
    tensors = []
    for k in range(len(runs)):
        rows = np.ascontiguousarray(feats[k][:, mask[k]].T)
        tensors.append({"audio_features": rows, "audio_frames": np.array([len(rows)], dtype=np.int64)})
    return [e - s for s, e in runs], tensors
