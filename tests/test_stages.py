"""Preprocessing stages: chat templates and loss masks, tokenization, visual tokens, truncation,
seeding, plug-ins."""

from __future__ import annotations

import io
import sys
import textwrap

import numpy as np
import pytest
from PIL import Image

from batchd.preprocess import (
    Augmentation,
    ChatTemplate,
    Example,
    LlavaVision,
    Preprocessor,
    Qwen2VLImageConfig,
    Qwen2VLVision,
    RandomResizedCrop,
    Reject,
    Stage,
    StageContext,
    Tokenize,
    TokenizerRef,
    Truncate,
    TurnSubsample,
    default_stages,
    demo_tokenizer,
)
from batchd.testing import TEMPLATES, Record, demo_record, parse_record, smart_resize


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return TokenizerRef(demo_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


def _png(h, w, seed=0):
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


CONV = [
    {"role": "user", "content": "Please reverse: red green blue."},
    {"role": "assistant", "content": "Here are your words in reverse order: blue green red."},
    {"role": "user", "content": "And now: cat dog."},
    {"role": "assistant", "content": "Here are your words in reverse order: dog cat."},
]


def _run(stages, record, sample_id=0, epoch=0, seed=0):
    return Preprocessor(stages)(record, sample_id, epoch, seed=seed)


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_chat_template_matches_hf_apply_chat_template_and_masks_only_assistant_tokens(tok, template):
    ct = ChatTemplate(template)
    meta, payload = _run([ct, Tokenize(tok)], Record([dict(m) for m in CONV], "Be brief.", []))
    ids, labels = payload["input_ids"], payload["labels"]
    hf = tok.hf.apply_chat_template(
        [{"role": "system", "content": "Be brief."}] + CONV,
        chat_template=ct.jinja,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        default_system=ct.default_system,
    )
    assert ids.tolist() == list(hf["input_ids"])
    assert (labels != -100).astype(int).tolist() == list(hf["assistant_masks"])
    assert np.all(labels[labels != -100] == ids[labels != -100])
    end = "<|eot_id|>" if template == "llama3" else "<|im_end|>"
    supervised = tok.hf.decode(ids[labels != -100].tolist(), skip_special_tokens=False)
    assert supervised == "".join(m["content"] + end for m in CONV if m["role"] == "assistant")
    assert meta.length == len(ids) and meta.loss_tokens == int(np.count_nonzero(labels[1:] != -100))
    assert meta.modality_tokens() == (("text", len(ids)), ("vision", 0))
    text = tok.hf.decode(ids.tolist(), skip_special_tokens=False)
    assert "Be brief." in text and ("You are a helpful assistant." in text) is False


def test_qwen2_default_system_prompt(tok):
    _, payload = _run([ChatTemplate("qwen2"), Tokenize(tok)], Record([dict(m) for m in CONV], None, []))
    text = tok.hf.decode(payload["input_ids"].tolist())
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    _, payload = _run([ChatTemplate("chatml"), Tokenize(tok)], Record([dict(m) for m in CONV], None, []))
    assert tok.hf.decode(payload["input_ids"].tolist()).startswith("<|im_start|>user\n")


def test_smart_resize_against_hand_computed_values():
    # 1024 x 768 (W x H), default min/max pixels: round(768/28)=27 -> 756, round(1024/28)=37 -> 1036.
    assert smart_resize(768, 1024) == (756, 1036)
    assert (756 // 28) * (1036 // 28) == 999
    assert Qwen2VLVision(None).num_tokens(768, 1024) == 999
    # Too small: scaled up to min_pixels = 56 * 56 -> 2 x 2 tokens.
    assert smart_resize(20, 20) == (56, 56)
    # Too large: 4000 x 3000 (12 MP) scaled down under max_pixels = 1003520: beta = sqrt(12e6 / 1003520).
    assert smart_resize(3000, 4000) == (840, 1148)
    assert 840 * 1148 <= 14 * 14 * 4 * 1280
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2500)


def test_smart_resize_and_pixel_values_match_transformers():
    pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    for h, w in [(768, 1024), (20, 20), (3000, 4000), (333, 517), (28, 28 * 150), (1, 100)]:
        assert smart_resize(h, w) == pil.smart_resize(h, w), (h, w)
    img = Image.open(io.BytesIO(_png(300, 500)))
    ref = pil.Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=14 * 14 * 4 * 1280)(
        images=[img], return_tensors="np"
    )
    n, tensors = Qwen2VLVision(None).tokens_and_tensors(img)
    assert n == 11 * 18 and tensors["image_grid_thw"].tolist() == ref["image_grid_thw"].tolist() == [
        [1, 22, 36]
    ]
    np.testing.assert_allclose(tensors["pixel_values"], ref["pixel_values"], atol=1e-5)


def test_a_qwen2vl_image_config_bounds_the_chains_visual_tokens_and_names_a_bad_value(tok):
    small = Qwen2VLImageConfig(min_pixels=28 * 28, max_pixels=28 * 28 * 4)
    assert smart_resize(768, 1024, 28, 28 * 28, 28 * 28 * 4) == (28, 56)  # 1 x 2 merges
    assert Qwen2VLVision(None, small).num_tokens(768, 1024) == 2
    chat = [{"role": "user", "content": "<image>Hi"}, {"role": "assistant", "content": "Noise."}]
    rec = parse_record({"messages": chat, "images": [_png(768, 1024)]})
    wide, _ = _run(default_stages(tok), rec)
    capped, _ = _run(default_stages(tok, vision=small), rec)
    assert wide.vision_tokens == 999 and capped.vision_tokens == 2
    for bad, named in [
        (dict(min_pixels=0), "min_pixels=0"),
        (dict(min_pixels=100, max_pixels=99), "max_pixels=99"),
        (dict(image_std=(1.0, 0.0, 1.0)), "image_std="),
    ]:
        with pytest.raises(ValueError, match=named):
            Qwen2VLImageConfig(**bad)
    with pytest.raises(ValueError, match="vision must be"):
        default_stages(tok, vision="qwen3")


def test_qwen2vl_expansion_of_a_1024x768_image(tok):
    rec = parse_record(
        {
            "messages": [
                {"role": "user", "content": "<image>What is it?"},
                {"role": "assistant", "content": "Noise."},
            ],
            "images": [_png(768, 1024)],
        }
    )
    text_only = _run(
        [ChatTemplate("qwen2"), Tokenize(tok)],
        parse_record(
            {
                "messages": [
                    {"role": "user", "content": "What is it?"},
                    {"role": "assistant", "content": "Noise."},
                ]
            }
        ),
    )[0]
    meta, payload = _run(default_stages(tok, cutoff=4096), rec)
    ids, labels = payload["input_ids"], payload["labels"]
    pad, vs, ve = (tok.token_id(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"))
    assert int((ids == pad).sum()) == 999
    start = int(np.flatnonzero(ids == vs)[0])
    assert ids[start + 1000] == ve and np.all(ids[start + 1 : start + 1000] == pad)
    assert np.all(labels[ids == pad] == -100)
    # length = text tokens (with vision start/end) + 999 visual tokens
    assert meta.length == len(ids) == text_only.length + 2 + 999
    assert meta.modality_tokens() == (("text", len(ids) - 999), ("vision", 999))
    assert meta.images == ((54 * 74, 999),)  # per image: encoder patches, tokens (two-phase balancing)
    assert payload["image_grid_thw"].tolist() == [[1, 54, 74]]
    assert (
        payload["pixel_values"].shape == (54 * 74, 3 * 2 * 14 * 14)
        and payload["pixel_values"].dtype == np.float32
    )


def test_llava_fixed_576_tokens(tok):
    rec = parse_record(
        {
            "messages": [{"role": "user", "content": "Describe."}, {"role": "assistant", "content": "Dots."}],
            "images": [_png(100, 300), _png(500, 200, seed=1)],
        }
    )
    meta, payload = _run(default_stages(tok, template="llama3", vision="llava"), rec)
    assert LlavaVision(tok).num_tokens() == 576
    ids = payload["input_ids"]
    assert int((ids == tok.token_id("<image>")).sum()) == 2 * 576
    assert payload["pixel_values"].shape == (2, 3, 336, 336)
    assert meta.modality_tokens()[1] == ("vision", 1152)
    assert meta.images == ((576, 576), (576, 576))  # LLaVA: one patch per visual token
    assert tok.hf.decode(ids[:5].tolist()).startswith("<|begin_of_text|><|start_header_id|>user")


def test_truncation_policies(tok):
    rec = parse_record(
        {
            "messages": [
                {"role": "user", "content": "<image>Look. " + "red " * 40},
                {"role": "assistant", "content": "blue " * 200},
            ],
            "images": [_png(112, 112)],
        }
    )
    full, _ = _run(default_stages(tok, cutoff=100000), rec)
    assert full.vision_tokens == 16 and full.length > 150
    meta, payload = _run(default_stages(tok, cutoff=150), rec)
    assert meta.length == len(payload["input_ids"]) == len(payload["labels"]) == 150
    assert meta.vision_tokens == 16 and payload["pixel_values"].shape[0] == 64
    with pytest.raises(Reject, match="over_cutoff: .* > cutoff 150"):
        _run(default_stages(tok, cutoff=150, policy="reject"), rec)
    # Cut before any assistant token: nothing carries loss, so the sample is quarantined.
    with pytest.raises(Reject, match="no_loss_tokens"):
        _run(default_stages(tok, cutoff=12), rec)
    # A cut inside an image drops the image whole (its tokens and its pixels), never half of it.
    two = parse_record(
        {
            "messages": [
                {"role": "user", "content": "red green"},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "<image>Look."},
                {"role": "assistant", "content": "blue " * 50},
            ],
            "images": [_png(112, 112)],
        }
    )
    _, whole = _run(default_stages(tok, cutoff=100000), two)
    start = int(np.flatnonzero(whole["input_ids"] == tok.token_id("<|vision_start|>"))[0])
    meta, payload = _run(default_stages(tok, cutoff=start + 5), two)
    assert meta.vision_tokens == 0 and "pixel_values" not in payload and meta.length == start
    assert payload["input_ids"].tolist() == whole["input_ids"][:start].tolist() and meta.loss_tokens > 0
    with pytest.raises(ValueError):
        Truncate(10, policy="drop")


def test_stages_are_seeded_per_sample_and_epoch(tok):
    stages = default_stages(tok, augment=True)
    recs = [parse_record(demo_record(i, seed=5, image_fraction=1.0)) for i in range(12)]

    def run(i, epoch):
        meta, payload = _run(stages, recs[i], sample_id=i, epoch=epoch)
        return meta, {k: v.copy() for k, v in payload.items()}

    for i in range(12):
        a, b = run(i, 0), run(i, 0)
        assert a[0] == b[0] and a[1].keys() == b[1].keys()
        assert all(np.array_equal(a[1][k], b[1][k]) for k in a[1])
    changed = sum(run(i, 0)[0] != run(i, 1)[0] for i in range(12))
    assert changed >= 3  # a new epoch draws new augmentations
    never = default_stages(tok, augment=Augmentation(p_system=0.0, p_turns=0.0, p_crop=0.0))
    assert all(
        _run(never, recs[i], sample_id=i)[0] == _run(default_stages(tok), recs[i], sample_id=i)[0]
        for i in range(12)
    )
    with pytest.raises(ValueError, match="p_crop=2"):
        Augmentation(p_crop=2)


def test_random_resized_crop_and_turn_subsample(tok):
    img = Image.open(io.BytesIO(_png(200, 300)))
    crop = RandomResizedCrop(scale=(0.3, 0.5), p=1.0)
    ex = Example(0, 0, "", [], images=[img])
    out = crop(ex, StageContext(0, 0, 0, 0)).images[0]
    assert 0.25 * 60000 <= out.width * out.height <= 0.55 * 60000
    assert crop(Example(0, 0, "", [], images=[img]), StageContext(0, 0, 0, 0)).images[0].size == out.size
    msgs = [
        {"role": "user", "content": "<image>a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "<image>c"},
        {"role": "assistant", "content": "d"},
    ]
    kept = set()
    for sid in range(20):
        ex = TurnSubsample(p=1.0)(
            Example(sid, 0, "", [dict(m) for m in msgs], images=["i0", "i1"]), StageContext(sid, 0, 0, 1)
        )
        assert len(ex.images) == len(ex.messages) // 2 and ex.messages[-1]["role"] == "assistant"
        kept.add(len(ex.messages))
    assert kept == {2, 4}


def test_plugin_stages_class_function_and_module_string(tok, tmp_path, monkeypatch):
    class Upper(Stage):
        def __call__(self, ex, ctx):
            ex.messages = [dict(m, content=m["content"].upper()) for m in ex.messages]
            return ex

    def mark(ex):  # a plain function taking the example only
        ex.extra["weights"] = np.ones(len(ex.input_ids), dtype=np.float32)

    def with_ctx(ex, ctx):
        ex.extra["draw"] = np.array([ctx.rng.integers(1 << 30)])
        return ex

    (tmp_path / "my_stages.py").write_text(
        textwrap.dedent("""
        class Double:
            def __call__(self, ex, ctx):
                ex.messages = ex.messages + ex.messages
                return ex
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rec = Record([dict(m) for m in CONV[:2]], None, [])
    chain = [Upper, "my_stages:Double", ChatTemplate("chatml"), Tokenize(tok), mark, with_ctx]
    _, payload = _run(chain, rec)
    text = tok.hf.decode(payload["input_ids"].tolist())
    assert text.count("PLEASE REVERSE") == 2
    assert payload["weights"].shape == payload["input_ids"].shape
    assert payload["draw"][0] == _run(chain, rec)[1]["draw"][0]
    sys.modules.pop("my_stages", None)

    def broken(ex):
        raise RuntimeError("boom")

    with pytest.raises(Reject, match="stage_error: .*broken: RuntimeError: boom"):
        _run([ChatTemplate("chatml"), Tokenize(tok), broken], rec)
    with pytest.raises(ValueError, match="module:attr"):
        Preprocessor(["not_a_spec"])
