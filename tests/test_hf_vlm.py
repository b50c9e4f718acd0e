"""Stock HF Qwen2-VL and LLaVA through `batchd.two_phase`: a DDP step equals one process calling the
model the HF way.

Per-sample payloads come from the real `HFProcessor` stage on the tiny processors of `batchd._vlm_tiny`
(saved to a tmp dir), with the `Sample` metadata `finalize` reports. One set of gloo processes (3 ranks,
spawned once for the module; the 2-rank steps run on the subgroup {0, 1}), for each family, builds the
same seeded tiny model, wraps it in `two_phase` then DDP, and runs every step in sequence: the batch of
each rank is built by the rank service's own `collate` (one-phase: padded / packed of its samples;
two-phase: the LLM samples without pixels, ``llm_image_grid_thw``, the pixels of its `Exchange.encode`
images from the real `plan_vision`, the exchange arrays), the loss is batchd's
``scaled_loss(forward_logits(ddp, batch), labels, N t_r / T_tok, t_r)``, then backward. The parent
compares each rank's loss share and every parameter's gradient with a single process that calls the
unadapted stock model per sample (``model(input_ids=..., pixel_values=..., image_grid_thw=...,
mm_token_type_ids=..., use_cache=False)``) and backwards the summed shifted CE over the global loss
tokens T_tok.

Steps: one- and two-phase, padded and packed, an image-free rank (it neither owns nor encodes an image:
its exchange is empty and it does not run the tower), one rank holding every image (the plan moves some
to the other ranks: checked), and that step on 3 ranks. Controls must fail the same comparison: a
swapped placement of two equal-size received images, and a loss scale of 1.0.

In process: a packed row's loss is the sum of its samples' unpacked losses on eager and sdpa (flex
attention is skipped where it cannot train on this CPU), the stock Qwen2-VL on the packed row is not;
and the refusals of `check_packed_attention`, `check_model_batch` and `two_phase`.
"""

from __future__ import annotations

import time
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _procs import gloo_ranks  # tests/ is on sys.path (pytest; spawn copies it)
from test_exchange import swapped as swapped_placement  # the same control as batchd's own TinyMLLM's
from test_hf_processor import _img, _run  # tests/ is on sys.path (pytest; spawn copies it)
from torch.nn.parallel import DistributedDataParallel as DDP

from batchd import core
from batchd.client import (
    check_model_batch,
    check_packed_attention,
    forward_logits,
    scaled_loss,
    token_loss_sum,
    two_phase,
)
from batchd.core import Sample, VisionCost, loss_scale, plan_vision
from batchd.service import collate
from batchd.service.preprocess import HFProcessor
from batchd.testing import TINY_VLM_FAMILIES, finalize, is_two_phase, tiny_processor, tiny_vlm, to_torch

SEED = 1234
ATOL, RTOL = 1e-5, 1e-4  # float32 models
COST = VisionCost()
SPAWN_DEADLINE_S = 240.0  # the parent kills the ranks past it
PG_TIMEOUT_S = 60  # a collective that waits longer fails the step (a hang is a failure, not a stall)
# image sizes (h, w): Qwen2-VL grids (1, 4, 4) = 16 patches / 4 tokens, (1, 4, 6) = 24 / 6,
# (1, 8, 8) = 64 / 16; LLaVA resizes every image to 28 x 28: 4 patches / 4 tokens
SMALL, MID, BIG = (56, 56), (56, 84), (112, 112)
WORDS = [
    "red",
    "green",
    "blue",
    "cat",
    "dog",
    "sun",
    "moon",
    "tree",
    "river",
    "stone",
    "bird",
    "fish",
    "cloud",
    "rain",
    "snow",
    "wind",
]

# workloads: per rank, per sample, its images. One-phase and two-phase steps of a workload share its samples.
WORKLOADS = {
    # both ranks own images; rank 0 is crowded (two SMALL images of equal size: the swap control)
    "mixed": [[[SMALL, BIG], [SMALL]], [[MID], []]],
    # rank 1 owns no image, and rank 0's single image stays with it: rank 1 never runs the tower
    "imagefree": [[[MID], []], [[], []]],
    # rank 0 owns every image: the two-phase plan moves some to the others
    "allimages": [[[BIG, SMALL], [MID, SMALL], [SMALL]], [[]], [[]]],
}
# (name, workload, world, layout, phases)
STEPS = [
    ("mixed-padded-1", "mixed", 2, "padded", 1),
    ("mixed-padded-2", "mixed", 2, "padded", 2),
    ("mixed-packed-1", "mixed", 2, "packed", 1),
    ("mixed-packed-2", "mixed", 2, "packed", 2),
    ("imagefree-padded-2", "imagefree", 2, "padded", 2),
    ("imagefree-packed-1", "imagefree", 2, "packed", 1),
    ("allimages-padded-2", "allimages", 2, "padded", 2),
    ("allimages-packed-2", "allimages", 2, "packed", 2),
    ("allimages-padded-2-world3", "allimages", 3, "padded", 2),
]
CONTROLS = {"swapped": "mixed-padded-2", "scale1": "mixed-padded-1"}  # control -> the step it alters


# -- workload ---------------------------------------------------------------------------------------------
def _messages(sid: int, n_images: int) -> list[dict]:
    rng = np.random.default_rng([77, sid])
    words = [WORDS[i] for i in rng.integers(0, len(WORDS), int(rng.integers(3, 9)))]
    answer = [WORDS[i] for i in rng.integers(0, len(WORDS), int(rng.integers(3, 12)))]
    prompt = "<image> " * n_images + f"sample {sid}: please reverse " + " ".join(words) + "."
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": " ".join(answer) + "."}]


def _sample(stage, sid: int, owner: int, sizes: list[tuple[int, int]]) -> tuple[Sample, dict]:
    """The payload HFProcessor + finalize produce, and its batchd Sample (images = (patches, tokens))."""
    images = [_img(h, w, seed=1000 * sid + k) for k, (h, w) in enumerate(sizes)]
    meta, payload = finalize(_run(stage, _messages(sid, len(sizes)), images=images))
    assert len(meta.images) == len(sizes)
    return Sample(sid, meta.length, meta.loss_tokens, home_rank=owner, images=meta.images), payload


def _workload(stage, name: str, world: int) -> dict:
    """The workload's samples distributed over `world` ranks (the 3-rank layout of `allimages` spreads
    the text-only samples of ranks >= 1 over ranks 1..world-1; same samples, so the same reference)."""
    groups = WORKLOADS[name]
    flat = [(r, sizes) for r, g in enumerate(groups) for sizes in g]
    if name == "allimages":
        text = [i for i, (r, _) in enumerate(flat) if r > 0]
        owner = {i: 0 for i, (r, _) in enumerate(flat) if r == 0}
        owner |= {i: 1 + k % (world - 1) for k, i in enumerate(text)}
    else:
        assert world == len(groups)
        owner = {i: r for i, (r, _) in enumerate(flat)}
    row: list[list[int]] = [[] for _ in range(world)]
    samples, payloads = {}, {}
    for sid, (_, sizes) in enumerate(flat):
        samples[sid], payloads[sid] = _sample(stage, sid, owner[sid], sizes)
        row[owner[sid]].append(sid)
    return {
        "row": row,
        "samples": samples,
        "payloads": payloads,
        "t_tok": sum(s.loss_tokens for s in samples.values()),
    }


def _steps(stage) -> list[dict]:
    out = []
    for name, load, world, layout, phases in STEPS:
        w = _workload(stage, load, world)
        row = [[w["samples"][i] for i in ids] for ids in w["row"]]
        exchanges = plan_vision(row, COST) if phases == 2 else None
        out.append(
            {
                "name": name,
                "workload": load,
                "world": world,
                "layout": layout,
                "phases": phases,
                "exchanges": exchanges,
                "override": {},
                "scale": None,
                **w,
            }
        )
    by_name = {s["name"]: s for s in out}
    swapped = dict(by_name[CONTROLS["swapped"]], name="swapped")
    swapped["override"] = {0: swapped_placement(swapped["exchanges"][0])}
    scale1 = dict(by_name[CONTROLS["scale1"]], name="scale1", scale=1.0)
    return out + [swapped, scale1]


def rank_batch(step: dict, rank: int, pad_id: int) -> dict:
    """What the rank service delivers to `rank` for this step (its own `collate`), as torch tensors."""
    spec = types.SimpleNamespace(policy=types.SimpleNamespace(collate=step["layout"]))
    payloads = [step["payloads"][i] for i in step["row"][rank]]
    if step["phases"] == 2:
        ex = step["exchanges"][rank]
        planned = types.SimpleNamespace(exchange=ex, audio_exchange=None, info=types.SimpleNamespace(step=0))
        batch = collate(spec, payloads, pad_id, planned, [step["payloads"][im.sample_id] for im in ex.encode])
    else:
        batch = collate(spec, payloads, pad_id)
    batch.update(step["override"].get(rank, {}))
    return to_torch(batch)


# -- model, reference ----------------------------------------------------------------------------------------
def flat_grads(model: torch.nn.Module) -> np.ndarray:
    return (
        torch.cat(
            [
                (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
                for p in model.parameters()
            ]
        )
        .numpy()
        .copy()
    )


def hf_kwargs(payload: dict) -> dict:
    """One sample's processor output as the stock model's keyword arguments (a batch of 1)."""
    kw = {"input_ids": torch.from_numpy(payload["input_ids"].astype(np.int64))[None], "use_cache": False}
    if "mm_token_type_ids" in payload:
        kw["mm_token_type_ids"] = torch.from_numpy(payload["mm_token_type_ids"].astype(np.int64))[None]
    if "pixel_values" in payload:
        kw["pixel_values"] = torch.from_numpy(payload["pixel_values"])
    if "image_grid_thw" in payload:
        kw["image_grid_thw"] = torch.from_numpy(payload["image_grid_thw"])
    return kw


def sample_loss(model: torch.nn.Module, payload: dict) -> torch.Tensor:
    labels = torch.from_numpy(payload["labels"].astype(np.int64))[None]
    return token_loss_sum(model(**hf_kwargs(payload)).logits, labels)[0]


def reference(family: str, tokenizer, step: dict) -> tuple[float, np.ndarray]:
    """One process, the stock model called the HF way per sample: sum of CE / T_tok, and its gradients."""
    model = tiny_vlm(family, tokenizer, SEED)
    loss = sum(sample_loss(model, p) for p in step["payloads"].values()) / step["t_tok"]
    loss.backward()
    return float(loss.detach()), flat_grads(model)


# -- the distributed worker ----------------------------------------------------------------------------------
def ddp_step(ddp: DDP, step: dict, rank: int, pad_id: int) -> dict:
    ddp.zero_grad(set_to_none=True)
    batch = rank_batch(step, rank, pad_id)
    t_r = sum(step["samples"][i].loss_tokens for i in step["row"][rank])
    scale = loss_scale(t_r, step["t_tok"], step["world"]) if step["scale"] is None else step["scale"]
    logits = forward_logits(ddp, batch)
    loss = scaled_loss(logits, batch["labels"], scale, t_r)
    loss.backward()
    missing = [n for n, p in ddp.module.named_parameters() if p.grad is None]
    share = float(token_loss_sum(logits.detach(), batch["labels"])[0]) / step["t_tok"]
    return {
        "loss": float(loss.detach()),
        "share": share,
        "scale": scale,
        "grads": flat_grads(ddp.module),
        "missing": missing,
    }


def run_rank(rank: int, spec: dict) -> dict:
    sub = dist.new_group([0, 1])  # every rank takes part in creating it
    out: dict = {}
    for family, fam in spec.items():
        for world, group in ((3, None), (2, sub)):
            if rank >= world:
                continue
            model = two_phase(tiny_vlm(family, fam["tokenizer"], SEED), group=group)
            ddp = DDP(model, process_group=group)
            for step in fam["steps"]:
                if step["world"] == world:
                    out[(family, step["name"])] = ddp_step(ddp, step, rank, fam["tokenizer"].pad_token_id)
    return out


# -- fixtures ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict:
    """Per family: its tokenizer, an HFProcessor stage on the saved tiny processor, and every step."""
    out = {}
    for family in TINY_VLM_FAMILIES:
        path = tmp_path_factory.mktemp(f"proc-{family}")
        proc = tiny_processor(family)
        proc.save_pretrained(path)
        stage = HFProcessor(path)
        steps = _steps(stage)
        out[family] = {"tokenizer": proc.tokenizer, "stage": stage, "steps": {s["name"]: s for s in steps}}
    return out


@pytest.fixture(scope="module")
def ranks(families, tmp_path_factory) -> dict:
    spec = {f: {"tokenizer": v["tokenizer"], "steps": list(v["steps"].values())} for f, v in families.items()}
    t0 = time.perf_counter()
    results = gloo_ranks(
        run_rank, (spec,), 3, tmp_path_factory.mktemp("gloo"), SPAWN_DEADLINE_S, PG_TIMEOUT_S
    )
    wall = time.perf_counter() - t0
    print(f"gloo ranks: {wall:.1f} s")
    return {"results": results}


@pytest.fixture(scope="module")
def references(families) -> dict:
    """The single-process reference of each (family, workload): the same for every step of the workload."""
    cache: dict = {}

    def get(family: str, step: dict) -> tuple[float, np.ndarray]:
        key = (family, step["workload"])
        if key not in cache:
            cache[key] = reference(family, families[family]["tokenizer"], step)
        return cache[key]

    return get


def step_results(ranks: dict, family: str, step: dict) -> list[dict]:
    return [ranks["results"][r][(family, step["name"])] for r in range(step["world"])]


def errors(got: list[dict], want_loss: float, want: np.ndarray) -> tuple[float, float]:
    """(|sum of loss shares - reference loss|, largest gradient error beyond the allclose tolerance)."""
    loss_err = abs(sum(g["share"] for g in got) - want_loss)
    grad_err = max(float(np.max(np.abs(g["grads"] - want) - RTOL * np.abs(want))) for g in got)
    return loss_err, grad_err


# -- 1. a DDP step through batchd equals the single-process stock model --------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("family", TINY_VLM_FAMILIES)
@pytest.mark.parametrize("name", [s[0] for s in STEPS])
def test_ddp_step_equals_stock_model_per_sample(families, ranks, references, family, name):
    step = families[family]["steps"][name]
    got = step_results(ranks, family, step)
    want_loss, want = references(family, step)
    assert all(not g["missing"] for g in got), [g["missing"] for g in got]  # DDP: every parameter, every rank
    n = step["world"]
    # the loss as batchd's trainers compute it: mean over ranks of the scaled losses = the global
    # per-token loss
    assert abs(sum(g["loss"] for g in got) / n - want_loss) <= ATOL + RTOL * abs(want_loss)
    loss_err, grad_err = errors(got, want_loss, want)
    assert loss_err <= ATOL + RTOL * abs(want_loss), (loss_err, want_loss)
    assert grad_err <= ATOL, (name, grad_err)
    for g in got[1:]:  # DDP: one gradient on every rank
        assert np.array_equal(g["grads"], got[0]["grads"])
    # the images really train the vision tower (where the step has any)
    model = tiny_vlm(family, families[family]["tokenizer"], SEED)
    sizes = [p.numel() for p in model.parameters()]
    vision = np.concatenate(
        [
            np.full(
                k, pname.startswith(("model.visual.", "model.vision_tower.", "model.multi_modal_projector."))
            )
            for (pname, _), k in zip(model.named_parameters(), sizes, strict=False)
        ]
    )
    assert vision.any()
    assert np.any(want[vision] != 0) == any(s.images for s in step["samples"].values())


@pytest.mark.parametrize("family", TINY_VLM_FAMILIES)
def test_plans_move_images_where_the_steps_need_it(families, family):
    steps = families[family]["steps"]
    for name, step in steps.items():
        if step["phases"] != 2:
            continue
        moved = [im for ex in step["exchanges"] for im in ex.encode if im.owner != ex.rank]
        if step["workload"] in ("allimages", "mixed"):
            assert moved, name  # the exchange really carries embeddings across ranks
            if step["workload"] == "allimages":  # every other rank encodes images it does not own
                assert all(ex.encode for ex in step["exchanges"]), name
        if step["workload"] == "imagefree":
            assert step["exchanges"][1].empty, name  # rank 1: no image to encode, none to receive
    sw = steps["swapped"]
    assert sw["exchanges"][0].sources.count(1) >= 1  # rank 0 receives images from rank 1
    scales = [loss_scale(sum(sw["samples"][i].loss_tokens for i in ids), sw["t_tok"], 2) for ids in sw["row"]]
    assert all(abs(s - 1.0) > 0.05 for s in scales), scales  # a scale of 1.0 is really wrong there


# -- 2. controls: the same comparison fails -----------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("family", TINY_VLM_FAMILIES)
@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_controls_fail_the_comparison(families, ranks, references, family, control):
    step = families[family]["steps"][control]
    got = step_results(ranks, family, step)
    want_loss, want = references(family, step)
    loss_err, grad_err = errors(got, want_loss, want)
    assert grad_err > 100 * ATOL, (control, grad_err)
    if control == "scale1":  # the scale enters the backward only: the loss shares still match, the loss not
        assert loss_err <= ATOL + RTOL * abs(want_loss), (loss_err, want_loss)
        assert abs(sum(g["loss"] for g in got) / step["world"] - want_loss) > 100 * ATOL


# -- 3. packed rows keep samples apart --------------------------------------------------------------------
def _group(families, family) -> list[dict]:
    step = families[family]["steps"]["mixed-packed-1"]
    return [step["payloads"][i] for ids in step["row"] for i in ids]


def _loss(model, batch) -> float:
    with torch.no_grad():
        return float(token_loss_sum(forward_logits(model, batch), batch["labels"])[0])


@pytest.mark.parametrize("family", TINY_VLM_FAMILIES)
@pytest.mark.parametrize("impl", ["eager", "sdpa", "flex_attention"])
def test_packed_loss_is_the_sum_of_unpacked_losses(families, family, impl):
    tok = families[family]["tokenizer"]
    group = _group(families, family)
    try:
        model = two_phase(tiny_vlm(family, tok, SEED, attn_implementation=impl))
        packed = to_torch(core.collate_packed(group))
        logits = forward_logits(model, packed)  # with gradients: a training forward
    except (ValueError, NotImplementedError) as exc:
        if impl != "flex_attention":
            raise
        pytest.skip(
            f"flex_attention cannot train {family} on this CPU: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200]}"
        )
    got = float(token_loss_sum(logits.detach(), packed["labels"])[0])
    alone = sum(_loss(model, to_torch(core.collate_padded([p], pad_id=tok.pad_token_id))) for p in group)
    assert abs(got - alone) <= ATOL + RTOL * abs(alone), (got, alone)
    # and the sum is the stock model's, sample by sample
    stock = tiny_vlm(family, tok, SEED, attn_implementation=impl)
    with torch.no_grad():
        want = sum(float(sample_loss(stock, p)) for p in group)
    assert abs(got - want) <= ATOL + RTOL * abs(want), (got, want)


def test_stock_qwen2vl_on_a_packed_row_crosses_samples(families):
    """Control: the unadapted model on the packed row (1-D restarting position_ids, no mask) treats it as one
    sequence (its positions and attention run across the samples): a later sample's logits are not its own.
    (Compared per sample and per logit: the loss sum of random tiny weights barely moves, and partly
    cancels across samples.)"""
    tok = families["qwen2_vl"]["tokenizer"]
    group = _group(families, "qwen2_vl")
    packed = to_torch(core.collate_packed(group))
    stock = tiny_vlm("qwen2_vl", tok, SEED)
    with torch.no_grad():
        out = stock(
            input_ids=packed["input_ids"],
            position_ids=packed["position_ids"],
            pixel_values=packed["pixel_values"],
            image_grid_thw=packed["image_grid_thw"],
            mm_token_type_ids=packed["mm_token_type_ids"],
            use_cache=False,
        )
        bounds = packed["cu_seqlens"].tolist()
        gaps = []  # per sample: how far its logits in the packed row lie from its logits alone
        for p, lo, hi in zip(group, bounds, bounds[1:], strict=False):
            alone = stock(**hf_kwargs(p)).logits[0]
            gaps.append(float((out.logits[0, lo:hi] - alone).abs().max()))
    # A later sample attends across the boundary: its logits move by tenths (measured ~0.5), 20x and more
    # beyond the first sample's, which only its image's flattened positions move (~0.003); the adapted
    # model meets the per-sample losses within float32 noise (the test above).
    assert max(gaps[1:]) > 0.1 and max(gaps[1:]) > 20 * gaps[0], gaps
    with pytest.raises(ValueError, match="two_phase"):  # and batchd refuses to train it so
        forward_logits(stock, packed)


# -- 4. refusals -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", TINY_VLM_FAMILIES)
def test_packed_row_refused_on_an_attention_that_crosses_samples(families, family):
    tok = families[family]["tokenizer"]
    model = two_phase(tiny_vlm(family, tok, SEED))
    check_packed_attention(model)  # sdpa: fine
    model.config._attn_implementation = "paged|eager"
    model.config.get_text_config()._attn_implementation = "paged|eager"
    packed = to_torch(core.collate_packed(_group(families, family)))
    with pytest.raises(ValueError, match=r"attn_implementation='paged\|eager'"):
        check_packed_attention(model)
    with pytest.raises(ValueError, match=r"attn_implementation='paged\|eager'"):
        model(packed)  # the adapted forward itself
    with pytest.raises(ValueError, match=r"attn_implementation='paged\|eager'"):
        check_model_batch(model, packed)
    with pytest.raises(ValueError, match=r"attn_implementation='paged\|eager'"):
        forward_logits(model, packed)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )


@pytest.mark.parametrize("family", TINY_VLM_FAMILIES)
def test_check_model_batch_refuses_an_unadapted_model(families, family):
    tok = families[family]["tokenizer"]
    step = families[family]["steps"]["mixed-padded-2"]
    batch = rank_batch(step, 0, tok.pad_token_id)
    stock = tiny_vlm(family, tok, SEED)
    with pytest.raises(ValueError, match="batchd.two_phase"):
        check_model_batch(stock, batch)
    with pytest.raises(ValueError, match="batchd.two_phase"):
        check_model_batch(stock, rank_batch(families[family]["steps"]["mixed-padded-1"], 0, tok.pad_token_id))
    adapted = two_phase(stock)
    assert two_phase(adapted) is adapted and is_two_phase(adapted)  # idempotent
    check_model_batch(adapted, batch)


def test_check_model_batch_refuses_a_two_phase_batch_for_an_hf_model_without_the_exchange(families):
    step = families["qwen2_vl"]["steps"]["mixed-padded-2"]
    batch = rank_batch(step, 0, 0)
    llama = _tiny_llama()
    with pytest.raises(ValueError, match="vision_send_splits"):
        check_model_batch(llama, batch)
    check_model_batch(llama, {k: v for k, v in batch.items() if not k.startswith(("vision_", "llm_"))})


def test_two_phase_refuses_an_unsupported_model():
    llama = _tiny_llama()
    with pytest.raises(ValueError, match="model_type='llama'"):
        two_phase(llama)
    assert not is_two_phase(llama) and not getattr(llama, "takes_batch", False)
