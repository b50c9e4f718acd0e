"""Audio in the data plane (issue 25): records' clips decoded (WAV by the standard library, FLAC through
soundfile), resampled to 16 kHz, turned into Whisper log-mel features and Qwen2-Audio tokens by the default
chain, carried as `Sample.audio` and payload arrays, and collated. Clips are generated here (tones, noise).
"""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest
import soundfile
import torch

from batchd.client import token_loss_sum
from batchd.core import collate_padded
from batchd.service.preprocess import Preprocessor, Reject, default_stages, qwen2_audio_tokens, resolve
from batchd.testing import TinyMLLM, clip_tokens, parse_record, read_audio, resample, to_torch

RATE = 16000


def tone(seconds: float, rate: int = RATE, freq: float = 440.0, amp: float = 0.3) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def wav(x: np.ndarray, rate: int = RATE, width: int = 2, channels: int = 1) -> bytes:
    """PCM WAV bytes of `x` (the same signal on every channel)."""
    scale = {1: 127, 2: 32767, 3: 8388607, 4: 2147483647}[width]
    v = np.round(np.repeat(x[:, None], channels, axis=1) * scale).astype(np.int64).reshape(-1)
    if width == 1:
        raw = (v + 128).astype(np.uint8).tobytes()
    elif width == 3:
        u = v & 0xFFFFFF
        raw = np.stack([u & 0xFF, (u >> 8) & 0xFF, (u >> 16) & 0xFF], axis=1).astype(np.uint8).tobytes()
    else:
        raw = v.astype(f"<i{width}").tobytes()
    b = io.BytesIO()
    with wave.open(b, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)
    return b.getvalue()


def flac(x: np.ndarray, rate: int = RATE) -> bytes:
    b = io.BytesIO()
    soundfile.write(b, x, rate, format="FLAC")
    return b.getvalue()


def record(content: str = "<audio>What is this sound?", **fields):
    msgs = [{"role": "user", "content": content}, {"role": "assistant", "content": "A tone, rising."}]
    return parse_record({"messages": msgs, **fields})


@pytest.mark.parametrize("width", [1, 2, 3, 4])
@pytest.mark.parametrize("channels", [1, 2])
def test_pcm_wav_of_every_width_decodes_to_the_same_mono_clip(width, channels):
    x = tone(0.25)
    y, rate = read_audio(wav(x, width=width, channels=channels))
    assert rate == RATE and y.dtype == np.float32 and y.shape == x.shape
    assert np.abs(y - x).max() < (2e-2 if width == 1 else 1e-4)


def test_flac_and_float_wav_decode_through_soundfile():
    x = tone(0.5, freq=1000.0)
    y, rate = read_audio(flac(x))
    assert rate == RATE and np.abs(y - x).max() < 1e-4
    b = io.BytesIO()
    soundfile.write(b, x, RATE, format="WAV", subtype="FLOAT")
    z, _ = read_audio(b.getvalue())
    assert np.abs(z - x).max() < 1e-6
    with pytest.raises(ValueError):
        read_audio(b"definitely not audio")


def test_resampling_keeps_the_tone_and_the_duration():
    x = tone(1.0, rate=44100, freq=440.0)
    y = resample(x, 44100, RATE)
    assert len(y) == RATE
    spectrum = np.abs(np.fft.rfft(y))
    assert np.argmax(spectrum) == 440  # 1 Hz bins over one second
    assert abs(np.sqrt(np.mean(y**2)) - 0.3 / np.sqrt(2)) < 1e-3  # the tone's power is kept
    z = resample(tone(1.0, rate=8000, freq=300.0), 8000, RATE)
    assert len(z) == RATE and np.argmax(np.abs(np.fft.rfft(z))) == 300
    high = resample(tone(1.0, rate=44100, freq=12000.0), 44100, RATE)  # above 8 kHz: filtered out
    assert np.sqrt(np.mean(high**2)) < 1e-3


def test_records_take_audios_like_images():
    r = record(audios=[wav(tone(1.0))])
    assert len(r.audios) == 1 and "<audio>" in r.messages[0]["content"]
    unmarked = record("Listen.", audios=[wav(tone(1.0)), {"path": "clip.flac"}])
    assert unmarked.messages[0]["content"].startswith("<audio><audio>Listen.")
    parts = parse_record(
        {
            "messages": [
                {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "Say?"}]},
                {"role": "assistant", "content": "Hi."},
            ],
            "audios": wav(tone(0.5)),
        }
    )
    assert parts.messages[0]["content"] == "<audio>Say?" and len(parts.audios) == 1
    with pytest.raises(Reject) as exc:
        record("<audio><audio>two?", audios=[wav(tone(1.0))])
    assert exc.value.code == "audio_mismatch"
    with pytest.raises(Reject) as exc:
        record(audios=[{"bytes": "%%%"}])
    assert exc.value.code == "bad_audio"


def test_the_default_chain_turns_a_clip_into_its_tokens_and_whisper_features():
    from transformers import WhisperFeatureExtractor

    pre = Preprocessor()
    clip = tone(2.0) + 0.05 * np.random.default_rng(0).standard_normal(2 * RATE).astype(np.float32)
    meta, payload = pre(record(audios=[wav(clip, rate=RATE)]), 7, 0)
    frames = 2 * RATE // 160
    tokens = qwen2_audio_tokens(frames)
    assert tokens == 50 and meta.audio == ((frames, tokens),)
    assert dict(meta.modality_tokens())["audio"] == tokens and meta.length == len(payload["input_ids"])
    assert meta.text_tokens == meta.length - tokens
    feats = payload["audio_features"]
    assert feats.shape == (frames, 128) and payload["audio_frames"].tolist() == [frames]
    fe = WhisperFeatureExtractor(feature_size=128, sampling_rate=RATE)
    decoded = read_audio(wav(clip))[0]
    ref = fe(decoded, sampling_rate=RATE, padding="longest", return_tensors="np")["input_features"][0]
    np.testing.assert_allclose(feats, ref.T, atol=1e-5)  # the model's own feature extractor's features
    ids, labels = payload["input_ids"], payload["labels"]
    tok = pre.stages[2].tokenizer  # Tokenize's
    audio_id = tok.token_id("<|AUDIO|>")
    run = np.flatnonzero(ids == audio_id)
    assert len(run) == tokens and np.all(np.diff(run) == 1)  # one contiguous run per clip
    assert np.all(labels[run] == -100)
    assert ids[run[0] - 1] == tok.token_id("<|audio_bos|>") and ids[run[-1] + 1] == tok.token_id(
        "<|audio_eos|>"
    )


def test_clip_tokens_follow_qwen2_audios_own_rule():
    import torch
    from transformers import Qwen2AudioEncoderConfig
    from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder

    enc = Qwen2AudioEncoder(
        Qwen2AudioEncoderConfig(
            d_model=8, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=8, num_mel_bins=8
        )
    )
    frames = torch.tensor([4, 5, 99, 100, 101, 1500, 3000])
    _, out = enc._get_feat_extract_output_lengths(frames)
    assert [qwen2_audio_tokens(int(f)) for f in frames] == out.tolist()


def test_bad_clips_are_quarantined_with_a_reason():
    pre = Preprocessor()
    cases = [
        (b"RIFF....WAVEnot really", "bad_audio"),
        (wav(tone(31.0, rate=8000), rate=8000), "bad_audio"),  # longer than Whisper's 30 s window
        (wav(tone(0.01)), "bad_audio"),  # 1 frame: too short for one token
    ]
    for data, reason in cases:
        with pytest.raises(Reject) as exc:
            pre(record(audios=[data]), 0, 0)
        assert exc.value.code == reason, exc.value
    no_audio = Preprocessor(default_stages(audio=None))
    with pytest.raises(Reject) as exc:
        no_audio(record(audios=[wav(tone(1.0))]), 0, 0)
    assert exc.value.code == "unsupported_audio"
    assert no_audio(record("no clip here"), 0, 0)[0].audio == ()
    with pytest.raises(ValueError, match="audio must be"):
        default_stages(audio="whisper")


def test_truncation_drops_a_clip_whole_and_its_features_with_it():
    msgs = [
        {"role": "user", "content": "<audio>first?"},
        {"role": "assistant", "content": "A tone."},
        {"role": "user", "content": "<audio>second?"},
        {"role": "assistant", "content": "A higher one."},
    ]
    two = parse_record({"messages": msgs, "audios": [wav(tone(1.0)), wav(tone(2.0, freq=880.0))]})
    full, payload = Preprocessor()(two, 0, 0)
    assert [t for _, t in full.audio] == [25, 50]
    second = np.flatnonzero(payload["input_ids"] == Preprocessor().stages[2].tokenizer.token_id("<|AUDIO|>"))[
        25:
    ]
    cutoff = int(second[20])  # inside the second clip's tokens
    meta, cut = Preprocessor(default_stages(cutoff=cutoff))(two, 0, 0)
    assert meta.audio == full.audio[:1] and meta.length < second[0]  # cut before the clip (its bos too)
    assert cut["audio_frames"].tolist() == [100] and cut["audio_features"].shape == (100, 128)
    np.testing.assert_array_equal(cut["audio_features"], payload["audio_features"][:100])


def test_collation_concatenates_the_clips_of_a_batch():
    pre = Preprocessor()
    a = pre(record(audios=[wav(tone(1.0))]), 0, 0)[1]
    b = pre(record("no audio"), 1, 0)[1]
    c = pre(record("<audio><audio>?", audios=[wav(tone(0.5)), wav(tone(1.5))]), 2, 0)[1]
    batch = collate_padded([a, b, c])
    assert batch["audio_frames"].tolist() == [100, 50, 150]
    assert batch["audio_features"].shape == (300, 128)
    np.testing.assert_array_equal(batch["audio_features"][100:150], c["audio_features"][:50])


# -- the audio encoder of the tiny MLLM ----------------------------------------------------------------
def _model(tok, seed: int = 0, audio: bool = True):
    torch.manual_seed(seed)
    vocab = len(tok.hf)
    audio_id = tok.token_id("<|AUDIO|>") if audio else None
    return TinyMLLM(
        tok.token_id("<|image_pad|>"), vocab_size=vocab, d_model=32, n_layers=1, audio_token_id=audio_id
    )


def test_the_tiny_mllm_encodes_each_clip_alone_and_writes_it_at_its_tokens():
    pre = Preprocessor()
    tok = pre.stages[2].tokenizer
    model = _model(tok)
    payloads = [
        pre(record(audios=[wav(tone(1.0))]), 0, 0)[1],
        pre(record("no audio"), 1, 0)[1],
        pre(record("<audio><audio>?", audios=[wav(tone(0.5, freq=300.0)), wav(tone(1.3))]), 2, 0)[1],
    ]
    batch = to_torch(collate_padded(payloads))
    rows = model.encode_audio(batch)
    assert (
        rows.shape[0]
        == sum(clip_tokens(f) for f in [100, 50, 130])
        == int((batch["input_ids"] == tok.token_id("<|AUDIO|>")).sum())
    )
    alone = torch.cat([model.encode_audio(to_torch(collate_padded([p]))) for p in (payloads[0], payloads[2])])
    torch.testing.assert_close(rows, alone, rtol=1e-5, atol=1e-6)  # a clip's rows ignore the other clips
    logits = model(batch)
    quiet = dict(batch, audio_features=torch.zeros_like(batch["audio_features"]))
    with torch.no_grad():
        moved = (model(quiet) - logits).abs().amax(dim=-1)  # [B, T]
    first = int((batch["input_ids"][0] == tok.token_id("<|AUDIO|>")).nonzero()[0])
    assert float(moved[0, :first].max()) == 0.0  # causal: nothing before the clip moves
    assert float(moved[0, first:].max()) > 0
    assert float(moved[1].max()) == 0.0  # the sample without audio is untouched
    loss = token_loss_sum(logits, batch["labels"])[0]
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.audio.parameters())


def test_a_step_without_audio_keeps_the_audio_encoder_in_the_graph_and_the_image_model_unchanged():
    pre = Preprocessor()
    tok = pre.stages[2].tokenizer
    model = _model(tok)
    batch = to_torch(collate_padded([pre(record("no audio"), 1, 0)[1]]))
    token_loss_sum(model(batch), batch["labels"])[0].backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.audio.parameters())  # zero, not None
    plain = _model(tok, audio=False)
    assert plain.audio is None
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("audio.")}
    assert all(torch.equal(state[k], v) for k, v in plain.state_dict().items())  # built after the LM
    with pytest.raises(ValueError, match="audio_token_id must be an int"):
        TinyMLLM(5, vocab_size=64, audio_token_id=64)
    with pytest.raises(ValueError, match="audio-token positions"):
        model(dict(batch, input_ids=torch.full_like(batch["input_ids"], tok.token_id("<|AUDIO|>"))))


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_dataset_with_audio_streams_through_the_ray_actors(ray_session, tmp_path, fmt):
    """The demo generator's clips (tones, noise; some at 22.05 kHz) in a Parquet column or WAV files beside
    a JSONL file reach every sample's metadata and payload through the real actor pool."""
    from batchd.service.preprocess import EXHAUSTED, PoolOptions, RaySource, make_demo_dataset

    demo = make_demo_dataset(tmp_path, 64, seed=5, audio_fraction=0.5, bad_fraction=0.0, format=fmt)
    got = {}
    with RaySource(
        demo.path,
        0,
        1,
        seed=0,
        pool=PoolOptions(stages=default_stages(cutoff=4096), num_actors=1, actor_num_cpus=0.5),
    ) as src:
        while (item := src.poll(120.0)) is not EXHAUSTED:
            assert item is not None, "the source stalled"
            sample, ref = item
            got[sample.id] = (sample, resolve(ref))
    assert len(got) == 64
    heard = [(s, p) for s, p in got.values() if s.audio]
    assert 20 <= len(heard) <= 44  # about half
    for s, p in heard:
        assert p["audio_frames"].tolist() == [f for f, _ in s.audio]
        assert p["audio_features"].shape == (sum(f for f, _ in s.audio), 128)
        assert (
            dict(s.modality_tokens)["audio"]
            == sum(t for _, t in s.audio)
            == sum(qwen2_audio_tokens(f) for f, _ in s.audio)
        )
    assert all("audio_features" not in p for s, p in got.values() if not s.audio)
