"""HFProcessor: a model's own HF processor as a stage (Qwen2-VL, LLaVA, tokenizer-only), built locally.

Every processor here is built in a temp dir from a tokenizer trained on the demo text plus the models'
special tokens, and `save_pretrained`; nothing is downloaded. The reference is always the processor
object the test built, called directly on the same rendered text and images.
"""

from __future__ import annotations

import io
import pickle

import numpy as np
import pytest
from _hf_templates import QWEN2VL_GENERATION_TEMPLATE, QWEN2VL_TEMPLATE
from PIL import Image

from batchd.cli import build_parser
from batchd.config import load_config
from batchd.preprocess import (
    ChatTemplate,
    Example,
    HFProcessor,
    Preprocessor,
    Qwen2VLImageConfig,
    Qwen2VLVision,
    Reject,
    StageContext,
    Tokenize,
    TokenizerRef,
    Truncate,
    default_stages,
    demo_records,
)
from batchd.testing import LLAVA_TEMPLATE, parse_record, tiny_tokenizer

MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 64

# ---------------------------------------------------------------------------------------------------
# Building processors locally
# ---------------------------------------------------------------------------------------------------
_hf_tokenizer = tiny_tokenizer  # the demo-trained BPE with batchd's special tokens


def _qwen2vl(template: str):
    """A Qwen2VLProcessor (image processor + tokenizer); without torchvision, transformers cannot build its
    video processor, so the same class is instantiated without one (HFProcessor loads it the same way)."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor

    tok = _hf_tokenizer(("<|video_pad|>",), eos_token="<|im_end|>")
    ip = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    try:
        from transformers import Qwen2VLVideoProcessor

        return Qwen2VLProcessor(
            image_processor=ip, tokenizer=tok, video_processor=Qwen2VLVideoProcessor(), chat_template=template
        )
    except (ImportError, AttributeError, TypeError, ValueError):
        no_video = type(
            "Qwen2VLProcessor",
            (Qwen2VLProcessor,),
            {"get_attributes": classmethod(lambda c: ["image_processor", "tokenizer"])},
        )
        return no_video(image_processor=ip, tokenizer=tok, chat_template=template)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(directory, processor) of a Qwen2-VL processor with Qwen2-VL's own chat template."""
    proc = _qwen2vl(QWEN2VL_TEMPLATE)
    path = tmp_path_factory.mktemp("qwen2vl")
    proc.save_pretrained(path)
    return path, proc


@pytest.fixture(scope="module")
def qwen_gen(tmp_path_factory):
    """The same processor with a chat template that has {% generation %} blocks."""
    proc = _qwen2vl(QWEN2VL_GENERATION_TEMPLATE)
    path = tmp_path_factory.mktemp("qwen2vl-gen")
    proc.save_pretrained(path)
    return path, proc


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    tok = _hf_tokenizer(("<|video_pad|>",), eos_token="<|im_end|>")  # the Qwen2-VL processor's tokenizer
    tok.chat_template = QWEN2VL_TEMPLATE
    path = tmp_path_factory.mktemp("tokenizer-only")
    tok.save_pretrained(path)
    return path


def _img(h, w, seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def _png(h, w, seed=0):
    buf = io.BytesIO()
    _img(h, w, seed).save(buf, format="PNG")
    return buf.getvalue()


MULTI = [
    {"role": "user", "content": "<image>Look at this. <image>Please reverse: red green blue."},
    {"role": "assistant", "content": "Here are your words in reverse order: blue green red."},
    {"role": "user", "content": "And now: cat dog."},
    {"role": "assistant", "content": "Here are your words in reverse order: dog cat."},
]
TEXT = [
    {"role": "user", "content": "Please reverse: red green blue."},
    {"role": "assistant", "content": "Here are your words in reverse order: blue green red."},
]


def _example(messages, images=(), system=None):
    return Example(0, 0, "", [dict(m) for m in messages], system, list(images))


def _run(stage, messages, images=(), system=None):
    return stage(_example(messages, images, system), StageContext(0, 0, 0, 0))


def _hf_messages(messages, system=None):
    """The records' messages as HF content parts (what HFProcessor must build)."""
    msgs = ([{"role": "system", "content": system}] if system is not None else []) + messages
    out = []
    for m in msgs:
        parts = []
        for k, piece in enumerate(m["content"].split("<image>")):
            if k:
                parts.append({"type": "image"})
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append({"role": m["role"], "content": parts})
    return out


def _supervised(tok, ex):
    return tok.decode(ex.input_ids[ex.labels != -100].tolist(), skip_special_tokens=False)


# ---------------------------------------------------------------------------------------------------
# Qwen2-VL: bit-exact outputs, labels, spans
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["qwen", "qwen_gen"])
@pytest.mark.parametrize("case", ["multi_image", "text_only", "system"])
def test_outputs_equal_the_processor_called_directly(which, case, request):
    path, proc = request.getfixturevalue(which)
    messages, images, system = {
        "multi_image": (MULTI, [_img(100, 150), _img(60, 300, 1)], None),
        "text_only": (TEXT, [], None),
        "system": (MULTI[:2], [_img(90, 90), _img(200, 120, 2)], "Be brief."),
    }[case]
    stage = HFProcessor(path)
    assert stage.label_mode == ("generation" if which == "qwen_gen" else "prefix")
    ex = _run(stage, messages, images, system)
    text = proc.apply_chat_template(_hf_messages(messages, system), tokenize=False)
    ref = proc(text=[text], images=images or None, return_tensors="np")
    assert ex.text == text
    assert np.array_equal(ex.input_ids, ref["input_ids"][0]) and ex.input_ids.dtype == np.int32
    assert np.array_equal(ex.extra["mm_token_type_ids"], ref["mm_token_type_ids"][0])
    assert "attention_mask" not in ex.extra
    if images:
        pixels = np.concatenate([t["pixel_values"] for t in ex.image_tensors])
        grid = np.concatenate([t["image_grid_thw"] for t in ex.image_tensors])
        assert pixels.dtype == ref["pixel_values"].dtype and np.array_equal(pixels, ref["pixel_values"])
        assert np.array_equal(grid, ref["image_grid_thw"])
        assert [len(t["pixel_values"]) for t in ex.image_tensors] == np.prod(grid, axis=1).tolist()
        assert set(ex.extra) == {"mm_token_type_ids"}
    else:
        assert ex.image_tensors == [] and ex.image_spans == [] and ex.image_tokens == []
    # and the pixels are the image processor's own, called alone
    if images:
        direct = proc.image_processor(images=images, return_tensors="np")
        assert np.array_equal(pixels, direct["pixel_values"])


@pytest.mark.parametrize("which", ["qwen", "qwen_gen"])
def test_labels_are_exactly_the_assistant_turns(which, request):
    path, proc = request.getfixturevalue(which)
    tok = proc.tokenizer
    stage = HFProcessor(path)
    ex = _run(stage, MULTI, [_img(100, 150), _img(60, 300, 1)])
    labelled = ex.labels != -100
    assert np.array_equal(ex.labels[labelled], ex.input_ids[labelled])
    assert _supervised(tok, ex) == "".join(
        m["content"] + "<|im_end|>" for m in MULTI if m["role"] == "assistant"
    )
    # contiguous per turn: one run of labelled tokens per assistant turn, each ending at <|im_end|>
    edges = np.flatnonzero(np.diff(np.concatenate([[0], labelled.astype(np.int8), [0]])))
    assert len(edges) == 2 * 2
    assert all(tok.convert_ids_to_tokens(int(ex.input_ids[e - 1])) == "<|im_end|>" for e in edges[1::2])


def test_both_label_paths_agree_and_match_the_builtin_chain(qwen, qwen_gen):
    """ "prefix" (derived) and "generation" (HF's mask) labels are equal; and on this template the
    built-in ChatTemplate("qwen2") + Tokenize + Qwen2VLVision chain gives the same ids and labels."""
    images = [_img(100, 150), _img(60, 300, 1)]
    gen = _run(HFProcessor(qwen_gen[0]), MULTI, images)
    forced = _run(HFProcessor(qwen_gen[0], labels="prefix"), MULTI, images)
    plain = _run(HFProcessor(qwen[0]), MULTI, images)
    for other in (forced, plain):
        assert np.array_equal(other.input_ids, gen.input_ids) and np.array_equal(other.labels, gen.labels)
    tok = TokenizerRef(qwen[0])
    record = parse_record({"messages": MULTI, "images": [_png(100, 150), _png(60, 300, 1)]})
    images = [Image.open(io.BytesIO(b)).convert("RGB") for b in (_png(100, 150), _png(60, 300, 1))]
    vision = Qwen2VLVision(tok, Qwen2VLImageConfig(MIN_PIXELS, MAX_PIXELS))
    _, builtin = Preprocessor([ChatTemplate("qwen2"), Tokenize(tok), vision])(record, 0, 0)
    hf = _run(HFProcessor(qwen[0]), MULTI, images)
    assert np.array_equal(builtin["input_ids"], hf.input_ids) and np.array_equal(builtin["labels"], hf.labels)
    grid = np.concatenate([t["image_grid_thw"] for t in hf.image_tensors])
    assert np.array_equal(builtin["image_grid_thw"], grid)


def test_image_spans_cover_the_image_pad_runs(qwen):
    path, proc = qwen
    tok = proc.tokenizer
    pad, vs, ve = tok.convert_tokens_to_ids(["<|image_pad|>", "<|vision_start|>", "<|vision_end|>"])
    ex = _run(HFProcessor(path), MULTI, [_img(100, 150), _img(60, 300, 1)])
    assert len(ex.image_spans) == 2
    covered = np.zeros(len(ex.input_ids), dtype=bool)
    for (s, e), n, t in zip(ex.image_spans, ex.image_tokens, ex.image_tensors, strict=False):
        assert ex.input_ids[s] == vs and ex.input_ids[e - 1] == ve
        assert np.all(ex.input_ids[s + 1 : e - 1] == pad)
        assert n == e - s - 2 == int(np.prod(t["image_grid_thw"])) // 4
        assert np.all(ex.labels[s:e] == -100)
        covered[s:e] = True
    assert np.all(covered[ex.input_ids == pad]) and int((ex.input_ids == pad).sum()) == sum(ex.image_tokens)


# ---------------------------------------------------------------------------------------------------
# Text-only processors, truncation, rejects, pickling, validation
# ---------------------------------------------------------------------------------------------------
def test_tokenizer_only_directory_is_a_text_only_processor(tok_dir, qwen):
    stage = HFProcessor(tok_dir)
    from transformers import PreTrainedTokenizerBase

    assert isinstance(stage.processor, PreTrainedTokenizerBase) and stage.label_mode == "prefix"
    ex = _run(stage, TEXT, system="Be brief.")
    assert ex.text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    tok = stage.processor
    assert np.array_equal(ex.input_ids, tok(ex.text, add_special_tokens=False)["input_ids"])
    assert _supervised(tok, ex) == TEXT[1]["content"] + "<|im_end|>"
    assert ex.image_tensors == [] and ex.extra == {}
    # the same ids and labels as the multimodal processor on a text-only record
    mm = _run(HFProcessor(qwen[0]), TEXT, system="Be brief.")
    assert np.array_equal(mm.input_ids, ex.input_ids) and np.array_equal(mm.labels, ex.labels)
    with pytest.raises(Reject, match="unsupported_image: .*has no image processor"):
        _run(stage, MULTI, [_img(50, 50), _img(50, 50)])


def test_truncate_after_it_never_cuts_inside_an_image(qwen):
    path, _ = qwen
    record = parse_record(
        {
            "messages": [
                {"role": "user", "content": "red green <image> blue <image> cat"},
                {"role": "assistant", "content": "dog " * 30},
            ],
            "images": [_png(100, 150), _png(60, 300, 1)],
        }
    )
    stage = HFProcessor(path)
    _, whole = Preprocessor([stage, Truncate(100000)])(record, 0, 0)
    n = len(whole["input_ids"])
    vs, ve = (TokenizerRef(path).token_id(t) for t in ("<|vision_start|>", "<|vision_end|>"))
    for cutoff in range(20, n + 1, 3):
        try:
            meta, payload = Preprocessor([stage, Truncate(cutoff)])(record, 0, 0)
        except Reject as exc:
            assert exc.code == "no_loss_tokens"
            continue
        ids = payload["input_ids"]
        assert len(ids) <= cutoff and np.array_equal(ids, whole["input_ids"][: len(ids)])
        kept = len(meta.images)
        grid = payload.get("image_grid_thw", np.zeros((0, 3), dtype=np.int64))
        pixels = payload.get("pixel_values", np.zeros((0,)))
        assert len(grid) == kept and pixels.shape[0] == int(np.prod(grid, 1).sum())
        assert meta.vision_tokens == int(np.prod(grid, 1).sum()) // 4
        assert len(payload["mm_token_type_ids"]) == len(ids)  # per-token extras are cut with the tokens
        assert int((ids == vs).sum()) == int((ids == ve).sum()) == kept  # never a dangling <|vision_start|>


def test_a_bad_image_or_template_error_is_a_reject(qwen, tok_dir):
    stage = HFProcessor(qwen[0])
    with pytest.raises(Reject, match=r"bad_image: images\[1\]: ValueError: .*aspect ratio"):
        _run(stage, MULTI, [_img(100, 150), _img(1, 400)])
    with pytest.raises(Reject, match=r"bad_image: images\[0\]"):
        _run(stage, MULTI, ["not an image", _img(60, 60)])
    with pytest.raises(Reject, match="image_mismatch: 2 <image> markers but 1 images"):
        _run(stage, MULTI, [_img(100, 150)])
    # through the chain: an undecodable image never reaches the stage, any other error is a reject too
    bad = parse_record({"messages": MULTI[:2], "images": [b"\x89PNG not an image", _png(50, 50)]})
    with pytest.raises(Reject, match="bad_image"):
        Preprocessor([HFProcessor(qwen[0]), Truncate(4096)])(bad, 0, 0)
    strict = "{{ raise_exception('roles must alternate') }}"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    tok.chat_template = strict
    strict_dir = tok_dir.parent / "strict-template"
    tok.save_pretrained(strict_dir)
    with pytest.raises(Reject, match="template_error: .*roles must alternate"):
        _run(HFProcessor(strict_dir), TEXT)


def test_prefix_unstable_template_is_rejected_per_record(tok_dir):
    """A template that rewrites earlier turns when later ones follow cannot give prefix labels."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    tok.chat_template = (
        "{%- for m in messages -%}{{- m['role'] + ': ' + (m['content'][:3] if m['role'] == "
        "'assistant' and not loop.last else m['content']) + '<|im_end|>' -}}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- 'assistant: ' -}}{%- endif -%}"
    )
    path = tok_dir.parent / "unstable-template"
    tok.save_pretrained(path)
    with pytest.raises(Reject, match="template_error: .*not prefix-stable at message 1"):
        _run(HFProcessor(path), TEXT + TEXT)
    ex = _run(HFProcessor(path), TEXT)  # the last turn is rendered whole: fine
    assert _supervised(tok, ex) == TEXT[1]["content"] + "<|im_end|>"


def test_stage_pickles_without_the_loaded_processor(qwen):
    stage = HFProcessor(qwen[0])
    images = [_img(100, 150), _img(60, 300, 1)]
    before = _run(stage, MULTI, images)  # loaded now
    blob = pickle.dumps(stage)
    assert len(blob) < 2000 and b"tokenizer" not in blob
    clone = pickle.loads(blob)
    assert clone._loaded is None and clone.path == stage.path and repr(clone) == repr(stage)
    after = _run(clone, MULTI, images)
    assert np.array_equal(before.input_ids, after.input_ids) and np.array_equal(before.labels, after.labels)


def test_bad_arguments(tmp_path, qwen):
    with pytest.raises(FileNotFoundError, match="processor directory not found"):
        HFProcessor(tmp_path / "missing")
    with pytest.raises(ValueError, match="labels must be one of"):
        HFProcessor(qwen[0], labels="all")
    with pytest.raises(ValueError, match="generation"):
        HFProcessor(qwen[0], labels="generation").setup()  # Qwen2-VL's template has no generation blocks
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="loads neither"):
        HFProcessor(tmp_path / "empty").setup()


# ---------------------------------------------------------------------------------------------------
# In the chain: default_stages, SampleMeta; another processor family; config and CLI
# ---------------------------------------------------------------------------------------------------
def test_default_stages_with_a_processor_give_consistent_payload_and_meta(qwen):
    path, _ = qwen
    chain = default_stages(processor=path, cutoff=2048)
    assert [type(s).__name__ for s in chain] == ["HFProcessor", "_NoAudio", "Truncate"]  # audio: refused
    augmented = default_stages(processor=path, augment=True)
    names = [type(s).__name__ for s in augmented]
    assert names[-3:] == ["HFProcessor", "_NoAudio", "Truncate"] and len(augmented) == 6
    records, _ = demo_records(24, seed=2, image_fraction=0.7, bad_fraction=0.0)
    pre = Preprocessor(chain)
    pre.setup()
    with_images = 0
    for i, raw in enumerate(records):
        meta, payload = pre(parse_record(raw), i, 0)
        ids, labels = payload["input_ids"], payload["labels"]
        assert meta.length == len(ids) == len(labels) == len(payload["mm_token_type_ids"])
        assert meta.loss_tokens == int(np.count_nonzero(labels[1:] != -100)) > 0
        grid = payload.get("image_grid_thw")
        if grid is None:
            assert meta.images == () and meta.vision_tokens == 0 and "pixel_values" not in payload
            continue
        with_images += 1
        patches = np.prod(grid, axis=1)
        assert meta.images == tuple((int(p), int(p) // 4) for p in patches)  # (patches, tokens) per image
        assert payload["pixel_values"].shape == (int(patches.sum()), 3 * 2 * 14 * 14)
        assert meta.vision_tokens == int(patches.sum()) // 4 == meta.length - meta.text_tokens
    assert with_images >= 8


def test_llava_processor_splits_per_image_along_the_first_dimension(tmp_path):
    from transformers import CLIPImageProcessor, LlavaProcessor

    tok = _hf_tokenizer(eos_token="</s>")
    ip = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    proc = LlavaProcessor(
        image_processor=ip,
        tokenizer=tok,
        patch_size=14,
        num_additional_image_tokens=1,
        vision_feature_select_strategy="default",
        chat_template=LLAVA_TEMPLATE,
    )
    proc.save_pretrained(tmp_path)
    images = [_img(100, 150), _img(60, 300, 1)]
    ex = _run(HFProcessor(tmp_path), MULTI, images)
    text = proc.apply_chat_template(_hf_messages(MULTI), tokenize=False)
    ref = proc(text=[text], images=images, return_tensors="np")
    assert np.array_equal(ex.input_ids, ref["input_ids"][0])
    assert [t["pixel_values"].shape for t in ex.image_tensors] == [(1, 3, 28, 28)] * 2
    assert np.array_equal(np.concatenate([t["pixel_values"] for t in ex.image_tensors]), ref["pixel_values"])
    assert ex.image_tokens == [4, 4]
    assert _supervised(tok, ex) == "".join(m["content"] + "</s>" for m in MULTI if m["role"] == "assistant")
    meta, _ = Preprocessor([HFProcessor(tmp_path), Truncate(4096)])(
        parse_record({"messages": MULTI, "images": [_png(100, 150), _png(60, 300, 1)]}), 0, 0
    )
    assert meta.images == ((4, 4), (4, 4))


def test_config_and_cli_take_a_processor_directory(tmp_path, qwen):
    (tmp_path / "model").symlink_to(qwen[0], target_is_directory=True)
    cfg_file = tmp_path / "job.toml"
    cfg_file.write_text('[job]\nworld_size = 1\ntoken_budget = 1024\n[pipeline]\nprocessor = "model"\n')
    cfg = load_config(cfg_file)
    assert cfg.pipeline.processor == str(tmp_path / "model")  # relative to the config file
    assert cfg.pipeline.stage_kwargs()["processor"] == str(tmp_path / "model")
    assert [type(s).__name__ for s in default_stages(cutoff=512, **cfg.pipeline.stage_kwargs())] == [
        "HFProcessor",
        "_NoAudio",
        "Truncate",
    ]
    cfg_file.write_text('[job]\nworld_size = 1\ntoken_budget = 1024\n[pipeline]\nprocessor = "nope"\n')
    with pytest.raises(ValueError, match="pipeline.processor names a file that does not exist"):
        load_config(cfg_file)
    parser = build_parser()
    for argv in (
        ["rank", "--rank", "0", "--processor", "d"],
        ["node", "--processor", "d"],
        ["demo", "--processor", "d"],
    ):
        assert parser.parse_args(argv).processor == "d"


@pytest.mark.slow
def test_ray_actors_run_the_processor(ray_session, qwen, tmp_path):
    from batchd.preprocess import EXHAUSTED, PoolOptions, RaySource, make_demo_dataset, resolve

    demo = make_demo_dataset(tmp_path, num_samples=16, seed=4, image_fraction=0.5, bad_fraction=0.0)
    src = RaySource(
        demo.path,
        0,
        1,
        0,
        0,
        pool=PoolOptions(
            stages=default_stages(processor=qwen[0], cutoff=2048), num_actors=1, actor_num_cpus=0.5
        ),
    )
    try:
        got = []
        while (item := src.poll(60.0)) is not EXHAUSTED:
            assert item is not None, "the source stalled"
            got.append(item)
    finally:
        src.close()
    assert len(got) == 16 and src.reasons == {}
    pre = Preprocessor(default_stages(processor=qwen[0], cutoff=2048))
    records, _ = demo_records(16, seed=4, image_fraction=0.5, bad_fraction=0.0)
    for sample, ref in got:
        _, local = pre(parse_record(records[sample.id]), sample.id, 0)
        payload = resolve(ref)
        assert payload.keys() == local.keys() and all(np.array_equal(payload[k], local[k]) for k in local)
