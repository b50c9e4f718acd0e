"""Audio: decoding a record's clips, and the stage that turns each audio token into the clip's tokens.

    decode_audios     record.audios                  -> mono float32 clips at 16 kHz (Reject "bad_audio")
    Qwen2Audio        input_ids, labels, audios      -> expanded input_ids/labels, audio_spans,
                                                        audio_tensors (log-mel features)
      | _NoAudio      (a chain without an audio stage: a record with audio is rejected as "unsupported_audio")

Decoding reads WAV (PCM 8/16/24/32-bit, float 32/64-bit) with the standard library and every other
format libsndfile reads (FLAC, OGG/Vorbis, ...) through `soundfile`; channels are averaged to mono and the
clip resampled to the stage's rate (band-limited, by FFT). The audio stage runs after `Tokenize`: each
audio token becomes as many tokens as the clip gets (labels -100 there) and the clip's log-mel features
(Whisper's: 25 ms Hann windows every 10 ms, so 100 frames per second, log10 mel power clamped to 8 dB below
its peak and scaled, by transformers' `WhisperFeatureExtractor`, not padded to 30 s) go to
`audio_tensors` for the payload.
"""

from __future__ import annotations

import functools
import io
import os
import wave
from typing import Any

import numpy as np

from ._parse import Record
from ._quarantine import Reject
from ._stage import Example, Stage, StageContext, _as_ref, expand_placeholders
from ._tokenizer import TokenizerRef

SAMPLE_RATE = 16000
HOP = 160  # samples between log-mel frames at 16 kHz: 100 frames per second
MAX_AUDIO_S = 30.0  # Whisper's window: a longer clip is rejected (split it into clips in the record)
QWEN2_AUDIO = "<|audio_bos|><|AUDIO|><|audio_eos|>"  # what an `<audio>` marker becomes in the text


# ---------------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------------
def _read_wav(data: bytes) -> tuple[np.ndarray, int]:
    """PCM or float WAV bytes as float32 [samples, channels] in [-1, 1], and the sample rate."""
    with wave.open(io.BytesIO(data)) as w:
        width, channels, rate, n = w.getsampwidth(), w.getnchannels(), w.getframerate(), w.getnframes()
        raw = w.readframes(n)
    if width == 1:  # 8-bit WAV is unsigned
        x = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        x = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    elif width == 3:
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        x = (np.where(v >= 1 << 23, v - (1 << 24), v)).astype(np.float32) / float(1 << 23)
    elif width == 4:
        x = np.frombuffer(raw, dtype="<i4").astype(np.float32) / float(1 << 31)
    else:
        raise ValueError(f"unsupported WAV sample width {width} bytes")
    return x.reshape(-1, channels), rate


def read_audio(data: bytes) -> tuple[np.ndarray, int]:
    """Audio bytes as a mono float32 clip and its sample rate: WAV by the standard library (PCM), anything
    else (FLAC, OGG, float WAV) through `soundfile`. Raises ValueError when the bytes are no audio."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        try:
            x, rate = _read_wav(data)
            return x.mean(axis=1).astype(np.float32), rate
        except Exception:  # noqa: BLE001 - wave raises Error, EOFError, RuntimeError on malformed chunks
            pass  # a float WAV (format 3) or a malformed one: soundfile reads it or says why not
    try:
        import soundfile
    except ImportError:  # pragma: no cover - soundfile is a dependency
        raise ValueError("not PCM WAV, and soundfile (FLAC, OGG) is not installed") from None
    try:
        x, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as exc:  # soundfile raises its own LibsndfileError (a RuntimeError) and others
        raise ValueError(f"{type(exc).__name__}: {exc}") from None
    return x.mean(axis=1).astype(np.float32), int(rate)


def resample(x: np.ndarray, src: int, dst: int) -> np.ndarray:
    """`x` (mono) from `src` Hz to `dst` Hz, band-limited: its spectrum cut (or zero-padded) at the lower
    Nyquist frequency, by FFT. O(n log n)."""
    if src == dst or not len(x):
        return x.astype(np.float32)
    n_out = max(1, round(len(x) * dst / src))
    spectrum = np.fft.rfft(x.astype(np.float64))
    keep = min(len(spectrum), n_out // 2 + 1)
    out = np.fft.irfft(spectrum[:keep], n=n_out) * (n_out / len(x))
    return out.astype(np.float32)


def decode_audios(record: Record, base_dir: str, rate: int = SAMPLE_RATE) -> list[np.ndarray]:
    """The record's audio clips as mono float32 at `rate` Hz; Reject('bad_audio') when one cannot be read,
    decoded, or is longer than `MAX_AUDIO_S` or too short for one token."""
    out = []
    for k, ref in enumerate(record.audios):
        try:
            data = ref.read(base_dir)
        except (OSError, ValueError) as exc:
            raise Reject("bad_audio", f"audios[{k}]: cannot read {ref.path!r}: {exc}") from None
        try:
            x, src = read_audio(data)
        except ValueError as exc:
            raise Reject("bad_audio", f"audios[{k}]: cannot decode: {exc}") from None
        seconds = len(x) / src if src else 0.0
        if seconds > MAX_AUDIO_S:
            raise Reject("bad_audio", f"audios[{k}]: {seconds:.1f} s is longer than {MAX_AUDIO_S:g} s")
        if not np.isfinite(x).all():
            raise Reject("bad_audio", f"audios[{k}]: samples that are not finite")
        out.append(resample(x, src, rate))
    return out


# ---------------------------------------------------------------------------------------------------
# Audio-token expansion
# ---------------------------------------------------------------------------------------------------
def qwen2_audio_tokens(frames: int) -> int:
    """Tokens of a clip of `frames` log-mel frames in Qwen2-Audio: its encoder's stride-2 convolution, then
    a stride-2 average pool (transformers' `_get_feat_extract_output_lengths`); about one per 40 ms."""
    after_conv = (frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


@functools.lru_cache(maxsize=4)
def _feature_extractor(n_mels: int, rate: int) -> Any:
    from transformers import WhisperFeatureExtractor

    # transformers declares this constructor untyped.
    return WhisperFeatureExtractor(  # type: ignore[no-untyped-call]
        feature_size=n_mels, sampling_rate=rate, hop_length=HOP
    )


def log_mel(x: np.ndarray, n_mels: int = 128, rate: int = SAMPLE_RATE) -> np.ndarray:
    """Whisper's log-mel features of a clip, float32 [frames, n_mels] with frames = len(x) // 160 (not
    padded to 30 s)."""
    fe = _feature_extractor(n_mels, rate)
    feats = fe(x, sampling_rate=rate, padding="longest", return_tensors="np")["input_features"][0]
    return np.ascontiguousarray(feats.T, dtype=np.float32)


class Qwen2Audio(Stage):
    """Qwen2-Audio audio tokens: each `<|AUDIO|>` token becomes `qwen2_audio_tokens(frames)` copies (between
    the template's `<|audio_bos|>` / `<|audio_eos|>`), labels -100 there. Payload per clip:
    `audio_features` float [frames, n_mels] (`log_mel`; a sample's clips concatenated along frames) and
    `audio_frames` int64 [clips]; the sample's `audio` metadata is (frames, tokens) per clip.

    Args:
        tokenizer: Tokenizer holding the audio token (default: the demo tokenizer). A tokenizer without it
            rejects records with audio ("unsupported_audio"), and passes every other record.
        n_mels: Mel bins (Qwen2-Audio: 128; Whisper v1-v2: 80).
        feature_dtype: "float32" or "float16" for `audio_features`.
    """

    def __init__(
        self,
        tokenizer: str | os.PathLike[str] | TokenizerRef | None = None,
        audio_token: str = "<|AUDIO|>",
        audio_bos: str = "<|audio_bos|>",
        audio_eos: str = "<|audio_eos|>",
        n_mels: int = 128,
        feature_dtype: str = "float32",
    ) -> None:
        self.tokenizer = _as_ref(tokenizer)
        self.audio_token, self.audio_bos, self.audio_eos = audio_token, audio_bos, audio_eos
        self.n_mels, self.feature_dtype = int(n_mels), np.dtype(feature_dtype).name

    def _token_id(self, token: str) -> int | None:
        try:
            return self.tokenizer.token_id(token)
        except (KeyError, ValueError):
            return None

    def __call__(self, ex: Example, ctx: StageContext) -> Example:
        if ex.input_ids is None or ex.labels is None:
            raise ValueError(f"{self.name} needs input_ids: put it after Tokenize")
        if not ex.audios:
            return ex
        token_id = self._token_id(self.audio_token)
        if token_id is None:
            raise Reject("unsupported_audio", f"the tokenizer has no {self.audio_token} token")
        positions = np.flatnonzero(ex.input_ids == token_id)
        if len(positions) != len(ex.audios):
            raise Reject(
                "audio_mismatch", f"{len(positions)} {self.audio_token} tokens but {len(ex.audios)} clips"
            )
        tokens, tensors = [], []
        for k, clip in enumerate(ex.audios):
            n = qwen2_audio_tokens(len(clip) // HOP)
            if n < 1:
                raise Reject("bad_audio", f"audios[{k}]: {len(clip)} samples is too short for one token")
            feats = log_mel(clip, self.n_mels)
            tokens.append(n)
            tensors.append(
                {
                    "audio_features": feats.astype(self.feature_dtype),
                    "audio_frames": np.array([len(feats)], dtype=np.int64),
                }
            )
        bos, eos = self._token_id(self.audio_bos), self._token_id(self.audio_eos)
        spans = expand_placeholders(ex, positions, tokens, bos, eos)
        ex.audio_tokens, ex.audio_tensors, ex.audio_spans = tokens, tensors, spans
        return ex


class _NoAudio(Stage):
    def __call__(self, ex: Example, ctx: StageContext) -> Example:
        if ex.audios:
            raise Reject("unsupported_audio", "the chain has no audio stage")
        return ex
