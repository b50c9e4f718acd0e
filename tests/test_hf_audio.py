"""HFProcessor on audio: a model's own audio processor (Qwen2-Audio: Whisper features, `<|AUDIO|>` runs).

Every processor here is built in a temp dir from the demo-trained tokenizer (which holds Qwen2-Audio's
special tokens) and a `WhisperFeatureExtractor`, and `save_pretrained`; nothing is downloaded. Clips are
tones written as WAV with the standard library. The reference is always the processor object the test
built, called directly on the same rendered text and the same decoded clips.
"""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest

from batchd.core import collate_padded
from batchd.preprocess import (
    Example,
    HFProcessor,
    Preprocessor,
    Reject,
    StageContext,
    Truncate,
    default_stages,
)
from batchd.service.preprocess import qwen2_audio_tokens
from batchd.testing import parse_record, read_audio, resample, tiny_processor, tiny_tokenizer

RATE = 16000

# Qwen2-Audio's rendering with the assistant's content and <|im_end|> in {% generation %} blocks.
GENERATION_TEMPLATE = (
    "{%- set audio_count = namespace(value=0) -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{%- set text = message['content'] -%}{%- else -%}"
    "{%- set text = namespace(value='') -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'audio' -%}{%- set audio_count.value = audio_count.value + 1 -%}"
    "{%- set text.value = text.value + 'Audio ' + audio_count.value|string"
    " + ': <|audio_bos|><|AUDIO|><|audio_eos|>\\n' -%}"
    "{%- elif part['type'] == 'text' -%}{%- set text.value = text.value + part['text'] -%}{%- endif -%}"
    "{%- endfor -%}{%- set text = text.value -%}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- text + '<|im_end|>' -}}{%- endgeneration -%}{{- '\\n' -}}"
    "{%- else -%}{{- text + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


# ---------------------------------------------------------------------------------------------------
# Processors and clips, built locally
# ---------------------------------------------------------------------------------------------------
def _qwen2_audio(template: str | None = None, chunk_length: int = 30):
    """A Qwen2AudioProcessor: Whisper's feature extractor (128 mel bins) and the demo tokenizer."""
    from transformers import Qwen2AudioProcessor, WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=128, chunk_length=chunk_length)
    tok = tiny_tokenizer(eos_token="<|im_end|>")
    return Qwen2AudioProcessor(feature_extractor=fe, tokenizer=tok, chat_template=template)


def _saved(factory, proc):
    path = factory.mktemp("processor")
    proc.save_pretrained(path)
    return path, proc


@pytest.fixture(scope="module")
def qwen_audio(tmp_path_factory):
    """(directory, processor) with Qwen2-Audio's own chat template (no generation blocks: prefix labels)."""
    return _saved(tmp_path_factory, _qwen2_audio())


@pytest.fixture(scope="module")
def qwen_audio_gen(tmp_path_factory):
    """The same processor with a chat template that has {% generation %} blocks."""
    return _saved(tmp_path_factory, _qwen2_audio(GENERATION_TEMPLATE))


def tone(seconds: float, freq: float = 440.0, rate: int = RATE) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def wav(x: np.ndarray, rate: int = RATE) -> bytes:
    """16-bit PCM mono WAV bytes of `x`, by the standard library."""
    b = io.BytesIO()
    with wave.open(b, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.round(x * 32767).astype("<i2").tobytes())
    return b.getvalue()


ONE = [
    {"role": "user", "content": "<audio>What is this sound?"},
    {"role": "assistant", "content": "A tone, rising."},
]
TWO = [
    {"role": "user", "content": "<audio>first?"},
    {"role": "assistant", "content": "A low tone."},
    {"role": "user", "content": "And this one: <audio>"},
    {"role": "assistant", "content": "A higher one."},
]
TEXT = [{"role": "user", "content": "Say hi."}, ONE[1]]
CASES = {
    "one_clip": (ONE, [wav(tone(2.0))], None),
    "two_clips": (TWO, [wav(tone(1.0, 300.0)), wav(tone(2.7, 880.0, rate=22050), rate=22050)], None),
    "system": (ONE, [wav(tone(0.5))], "Be brief."),
}


def _hf_messages(messages, system=None):
    """The records' messages as HF content parts (what HFProcessor must build)."""
    msgs = ([{"role": "system", "content": system}] if system is not None else []) + messages
    out = []
    for m in msgs:
        parts = []
        for k, piece in enumerate(m["content"].split("<audio>")):
            if k:
                parts.append({"type": "audio"})
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append({"role": m["role"], "content": parts})
    return out


def _record(messages, clips, system=None):
    return parse_record(
        {"messages": messages, "audios": list(clips), **({"system": system} if system else {})}
    )


def _decoded(clips):
    """The clips as the chain gives them to the stage: decoded, mono, resampled to 16 kHz."""
    return [resample(x, rate, RATE) for x, rate in (read_audio(c) for c in clips)]


def _run(stage, messages, clips=(), system=None):
    """The stage alone on an Example with decoded clips (what the chain gives it)."""
    ex = Example(0, 0, "", [dict(m) for m in messages], system, [], audios=list(clips))
    return stage(ex, StageContext(0, 0, 0, 0))


def _runs(ids, token_id):
    is_tok = np.concatenate([[0], (ids == token_id).astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(is_tok))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True))


# ---------------------------------------------------------------------------------------------------
# Bit-exact outputs, audio runs, labels, features
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["qwen_audio", "qwen_audio_gen"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_chain_gives_the_processors_own_ids_runs_labels_and_features(which, case, request):
    path, proc = request.getfixturevalue(which)
    tok = proc.tokenizer
    messages, clips, system = CASES[case]
    stage = HFProcessor(path)
    assert stage.label_mode == ("generation" if which == "qwen_audio_gen" else "prefix")
    meta, payload = Preprocessor([stage, Truncate(4096)])(_record(messages, clips, system), 0, 0)

    text = proc.apply_chat_template(_hf_messages(messages, system), tokenize=False)
    ref = proc(text=[text], audio=_decoded(clips), sampling_rate=RATE, return_tensors="np")
    ids, labels = payload["input_ids"], payload["labels"]
    assert np.array_equal(ids, ref["input_ids"][0]) and ids.dtype == np.int32

    audio_id, bos, eos = tok.convert_tokens_to_ids(["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"])
    runs = _runs(ids, audio_id)
    frames = ref["feature_attention_mask"].sum(-1).tolist()
    assert [e - s for s, e in runs] == [t for _, t in meta.audio] == [qwen2_audio_tokens(f) for f in frames]
    assert meta.audio == tuple((int(f), e - s) for f, (s, e) in zip(frames, runs, strict=True))
    assert all(ids[s - 1] == bos and ids[e] == eos for s, e in runs)
    assert np.all(labels[ids == audio_id] == -100) and np.all(labels[np.isin(ids, [bos, eos])] == -100)
    supervised = tok.decode(ids[labels != -100].tolist(), skip_special_tokens=False)
    assert supervised == "".join(m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant")
    assert meta.text_tokens == meta.length - sum(t for _, t in meta.audio) and meta.vision_tokens == 0

    # features: the processor's own, each clip's frames without the padding to 30 s, time-major
    assert payload["audio_frames"].tolist() == frames
    want = np.concatenate([ref["input_features"][k][:, : frames[k]].T for k in range(len(clips))], axis=0)
    feats = payload["audio_features"]
    assert feats.dtype == np.float32 and feats.shape == (sum(frames), 128) and np.array_equal(feats, want)
    assert set(payload) == {"input_ids", "labels", "audio_features", "audio_frames"}


def test_both_label_paths_agree_and_the_stage_writes_audio_spans(qwen_audio, qwen_audio_gen):
    messages, clips, _ = CASES["two_clips"]
    x16 = _decoded(clips)
    plain = _run(HFProcessor(qwen_audio[0]), messages, x16)
    gen = _run(HFProcessor(qwen_audio_gen[0]), messages, x16)
    forced = _run(HFProcessor(qwen_audio_gen[0], labels="prefix"), messages, x16)
    for other in (gen, forced):
        assert np.array_equal(other.input_ids, plain.input_ids) and np.array_equal(other.labels, plain.labels)
    tok = qwen_audio[1].tokenizer
    audio_id, bos, eos = tok.convert_tokens_to_ids(["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"])
    for ex in (plain, gen):
        assert ex.audios == []  # consumed: the clips' tensors take their place
        assert len(ex.audio_spans) == len(ex.audio_tokens) == len(ex.audio_tensors) == 2
        for (s, e), n in zip(ex.audio_spans, ex.audio_tokens, strict=True):
            assert ex.input_ids[s] == bos and ex.input_ids[e - 1] == eos and n == e - s - 2
            assert np.all(ex.input_ids[s + 1 : e - 1] == audio_id) and np.all(ex.labels[s:e] == -100)
        assert ex.image_spans == [] and ex.image_tensors == []


def test_truncation_drops_a_clip_whole_and_its_features_with_it(qwen_audio):
    path, proc = qwen_audio
    messages, clips, _ = CASES["two_clips"]
    record = _record(messages, clips)
    full, whole = Preprocessor([HFProcessor(path), Truncate(100000)])(record, 0, 0)
    bos, eos = proc.tokenizer.convert_tokens_to_ids(["<|audio_bos|>", "<|audio_eos|>"])
    seen = set()
    for cutoff in range(10, full.length + 1, 7):
        try:
            meta, cut = Preprocessor([HFProcessor(path), Truncate(cutoff)])(record, 0, 0)
        except Reject as exc:
            assert exc.code == "no_loss_tokens"
            continue
        ids = cut["input_ids"]
        kept = len(meta.audio)
        seen.add(kept)
        assert len(ids) <= cutoff and np.array_equal(ids, whole["input_ids"][: len(ids)])
        assert meta.audio == full.audio[:kept]
        assert int((ids == bos).sum()) == int((ids == eos).sum()) == kept  # never a dangling <|audio_bos|>
        frames = sum(f for f, _ in meta.audio)
        assert cut.get("audio_frames", np.zeros(0)).tolist() == [f for f, _ in meta.audio]
        if kept:
            np.testing.assert_array_equal(cut["audio_features"], whole["audio_features"][:frames])
    assert seen == {1, 2}


def test_default_stages_with_an_audio_processor_and_collation(qwen_audio):
    chain = default_stages(processor=qwen_audio[0], cutoff=4096)
    assert [type(s).__name__ for s in chain] == ["HFProcessor", "_NoAudio", "Truncate"]
    pre = Preprocessor(chain)
    a = pre(_record(ONE, [wav(tone(1.0))]), 0, 0)
    b = pre(_record(TEXT, []), 1, 0)
    c = pre(_record(TWO, [wav(tone(0.5)), wav(tone(1.5, 660.0))]), 2, 0)
    clip = [(f, qwen2_audio_tokens(f)) for f in (100, 50, 150)]
    assert [m.audio for m, _ in (a, b, c)] == [(clip[0],), (), (clip[1], clip[2])]
    batch = collate_padded([p for _, p in (a, b, c)])
    assert batch["audio_frames"].tolist() == [100, 50, 150] and batch["audio_features"].shape == (300, 128)
    np.testing.assert_array_equal(batch["audio_features"][100:150], c[1]["audio_features"][:50])
    # a text-only record through an audio processor: the tokenizer's own ids
    tok = qwen_audio[1].tokenizer
    text = qwen_audio[1].apply_chat_template(_hf_messages(TEXT), tokenize=False)
    assert np.array_equal(b[1]["input_ids"], tok(text, add_special_tokens=False)["input_ids"])


# ---------------------------------------------------------------------------------------------------
# Rejects: no audio side, bad clips
# ---------------------------------------------------------------------------------------------------
def test_a_processor_without_an_audio_feature_extractor_rejects_unsupported_audio(tmp_path):
    vl = tmp_path / "qwen2vl"
    tiny_processor("qwen2_vl").save_pretrained(vl)
    only_tok = tmp_path / "tokenizer"
    tok = tiny_tokenizer(eos_token="<|im_end|>")
    tok.chat_template = _qwen2_audio().chat_template
    tok.save_pretrained(only_tok)
    record = _record(ONE, [wav(tone(1.0))])
    for path in (vl, only_tok):
        for pre in (
            Preprocessor([HFProcessor(path), Truncate(4096)]),
            Preprocessor(default_stages(processor=path)),
        ):
            with pytest.raises(Reject, match="unsupported_audio: .*has no audio feature extractor"):
                pre(record, 0, 0)
        assert Preprocessor(default_stages(processor=path))(_record(TEXT, []), 0, 0)[0].audio == ()


def test_bad_clips_are_quarantined_with_a_reason(qwen_audio, tmp_path_factory):
    path, _ = qwen_audio
    pre = Preprocessor(default_stages(processor=path))
    cases = [
        (b"RIFF....WAVEnot really", "bad_audio", "cannot decode"),  # corrupt: never reaches the stage
        (wav(tone(31.0, rate=8000), rate=8000), "bad_audio", "longer than 30 s"),
        (wav(tone(0.005)), "bad_audio", r"audios\[0\]: 0.005 s is too short for one <\|AUDIO\|> token"),
    ]
    for data, code, detail in cases:
        with pytest.raises(Reject, match=f"{code}: .*{detail}"):
            pre(_record(ONE, [data]), 0, 0)
    # a processor whose window is 2 s: a 3 s clip would be cut silently, so it is refused, naming the clip
    short_path, _ = _saved(tmp_path_factory, _qwen2_audio(chunk_length=2))
    short = Preprocessor([HFProcessor(short_path), Truncate(4096)])
    with pytest.raises(
        Reject, match=r"bad_audio: audios\[1\]: 3.00 s is longer than the processor's 2 s window"
    ):
        short(_record(TWO, [wav(tone(1.0)), wav(tone(3.0))]), 0, 0)
    assert short(_record(TWO, [wav(tone(1.0)), wav(tone(2.0))]), 0, 0)[0].audio == ((100, 25), (200, 50))
    # on the stage alone: clips the processor cannot take, markers and clips that disagree
    stage = HFProcessor(path)
    with pytest.raises(Reject, match=r"bad_audio: audios\[1\]: shape \(16000, 2\), expected mono"):
        _run(stage, TWO, [tone(1.0), np.zeros((RATE, 2), dtype=np.float32)])  # a stereo array
    with pytest.raises(Reject, match=r"bad_audio: audios\[0\]: samples that are not finite"):
        _run(stage, ONE, [np.full(RATE, np.nan, dtype=np.float32)])
    with pytest.raises(Reject, match="audio_mismatch: 1 <audio> markers but 2 audios"):
        _run(stage, ONE, [tone(1.0), tone(1.0)])
    # any other error the processor raises on a record quarantines it, never the actor
    clash = HFProcessor(path, processor_kwargs={"audio_kwargs": {"sampling_rate": 8000}})
    with pytest.raises(Reject, match="processor_error: ValueError: .*sampling_rate"):
        _run(clash, ONE, [tone(1.0)])
