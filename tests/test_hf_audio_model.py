"""Stock HF Qwen2-Audio through `batchd.two_phase`: a DDP step with the balanced audio phase equals one
process calling the stock model the HF way.

The model is a tiny ``Qwen2AudioForConditionalGeneration`` built locally from its config (16 mel bins, a
1-layer audio encoder of width 16 whose fixed window is 2 x 64 = 128 frames, a 1-layer Qwen2 LM of width 32,
vocabulary 64, sdpa). Clips are real Whisper log-mel features (`batchd.testing.log_mel` of
synthetic waveforms, not padded, as batchd's ``Qwen2Audio`` stage stores them), their audio tokens expanded
by Qwen2-Audio's rule. A pair of gloo processes (spawned once for the module) wraps the adapted model in
DDP and runs every step in sequence: each rank's batch is built by the rank service's own `collate`
(one-phase: padded / packed of its samples; two-phase: its LLM samples without their clips, the features of
the clips its `Exchange.encode` lists from the real `plan_phase(row, AudioCost())`, the audio exchange
arrays), the loss is ``scaled_loss(forward_logits(ddp, batch), labels, N t_r / T_tok, t_r)``, then backward.

The reference is one process running the unadapted stock model per sample,
``model(input_ids=..., input_features=[clips, mels, 128], feature_attention_mask=..., use_cache=False)``
with each clip padded to the window with Whisper's silence (the clip's max - 2, written out here on its own),
summing the shifted CE over the global loss tokens T_tok. Every rank's loss share and every parameter's
gradient must match it.

Steps: one- and two-phase padded, two-phase packed (clips moved between ranks), a step where rank 0 holds
every clip (the plan spreads them: every rank encodes some), a step without clips (the tower is not run,
its parameters still get a zero gradient), a two-phase step where rank 1 encodes and receives nothing (its
exchange still runs, empty), and two of these steps again with the tower and projector frozen after
`two_phase` (no gradient there, the LLM's as the reference's, no rank left waiting in an exchange backward
the others skip). A control swaps two of rank 0's received clips of equal tokens
(valid arrays, a wrong step) and must fail the same comparison. In process: the adapted model's logits on a
one-phase batch equal the stock forward's, and the refusals of `two_phase` and `check_model_batch`.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from _procs import gloo_ranks  # tests/ is on sys.path (pytest; spawn copies it)
from torch.nn.parallel import DistributedDataParallel as DDP

from batchd import core
from batchd.client import (
    AUDIO_FAMILIES,
    check_model_batch,
    forward_logits,
    scaled_loss,
    token_loss_sum,
    two_phase,
)
from batchd.core import AudioCost, Sample, Step, StepInfo, loss_scale
from batchd.service import collate
from batchd.service.preprocess import qwen2_audio_tokens
from batchd.testing import IGNORE_INDEX, is_two_phase, log_mel, plan_phase, to_torch

SEED = 4321
WORLD = 2
VOCAB, AUDIO, PAD = 64, 2, 0  # text tokens are drawn from [4, VOCAB)
N_MELS, MAX_POSITIONS = 16, 64
WINDOW = 2 * MAX_POSITIONS  # the stock encoder's fixed input: conv strides 1 and 2
ATOL, RTOL = 1e-5, 1e-4  # float32
SPAWN_DEADLINE_S = 150.0
PG_TIMEOUT_S = 60

# workloads: per rank, its LLM samples, each its clips' frame counts. Rank 0 of "moved" has two 64-frame
# clips (equal tokens: the swap control).
WORKLOADS = {
    "moved": [[[120, 96], [64], [64, 40]], [[30], []]],
    "allclips": [[[128, 40], [100], [72, 72, 24]], [[], []]],
    "silent": [[[], []], [[]]],
    "single": [[[64], []], [[], []]],  # one clip, kept by its owner: rank 1 encodes and receives nothing
}
# (name, workload, layout, phases)
STEPS = [
    ("moved-padded-1", "moved", "padded", 1),
    ("moved-padded-2", "moved", "padded", 2),
    ("moved-packed-2", "moved", "packed", 2),
    ("allclips-padded-2", "allclips", "padded", 2),
    ("allclips-packed-2", "allclips", "packed", 2),
    ("silent-padded-1", "silent", "padded", 1),
    ("single-padded-2", "single", "padded", 2),
]
AUDIO_PREFIXES = ("model.audio_tower.", "model.multi_modal_projector.")
CONTROL = ("swapped", "moved-padded-2")  # the control and the step it alters
FROZEN = ("moved-padded-2", "single-padded-2")  # steps also run with the audio tower and projector frozen


# -- model -----------------------------------------------------------------------------------------------
def make_model(attn: str = "sdpa") -> torch.nn.Module:
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    config = Qwen2AudioConfig(
        audio_config={
            "model_type": "qwen2_audio_encoder",
            "num_mel_bins": N_MELS,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 32,
            "d_model": 16,
            "max_source_positions": MAX_POSITIONS,
        },
        text_config={
            "model_type": "qwen2",
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 1024,
        },
        audio_token_index=AUDIO,
        attn_implementation=attn,
    )
    torch.manual_seed(SEED)
    return Qwen2AudioForConditionalGeneration(config)


# -- workload ----------------------------------------------------------------------------------------------
def make_clip(seed: tuple[int, ...], frames: int) -> np.ndarray:
    """Whisper log-mel features [frames, N_MELS] of a synthetic waveform (a tone and noise), unpadded."""
    rng = np.random.default_rng(list(seed))
    n = frames * 160 + 100  # log_mel gives len // 160 frames
    t = np.arange(n)
    x = 0.3 * np.sin(t * rng.uniform(0.02, 0.4)) + rng.uniform(0.01, 0.2) * rng.standard_normal(n)
    feats = log_mel(x.astype(np.float32), N_MELS)
    assert feats.shape == (frames, N_MELS)
    return feats


def make_sample(sid: int, owner: int, frames: list[int]) -> tuple[Sample, dict[str, np.ndarray]]:
    """Text around each clip's expanded audio tokens (labels -100 there, and on a 2-token prompt)."""
    rng = np.random.default_rng([99, sid])
    ids: list[int] = []
    labels: list[int] = []
    for f in [*frames, None]:
        text = rng.integers(4, VOCAB, int(rng.integers(3, 9))).tolist()
        ids, labels = ids + text, labels + text
        if f is None:
            break
        ids += [AUDIO] * qwen2_audio_tokens(f)
        labels += [IGNORE_INDEX] * qwen2_audio_tokens(f)
    labels[:2] = [IGNORE_INDEX] * 2
    payload = {"input_ids": np.asarray(ids, np.int64), "labels": np.asarray(labels, np.int64)}
    if frames:
        payload["audio_features"] = np.concatenate([make_clip((sid, k), f) for k, f in enumerate(frames)])
        payload["audio_frames"] = np.asarray(frames, np.int64)
    audio = tuple((f, qwen2_audio_tokens(f)) for f in frames)
    sample = Sample(sid, len(ids), core.loss_tokens(payload["labels"]), home_rank=owner, audio=audio)
    return sample, payload


def make_steps() -> list[dict]:
    steps = []
    for name, load, layout, phases in STEPS:
        row: list[list[Sample]] = []
        payloads, sid = {}, 0
        for rank, group in enumerate(WORKLOADS[load]):
            row.append([])
            for frames in group:
                sample, payloads[sid] = make_sample(sid, rank, frames)
                row[rank].append(sample)
                sid += 1
        steps.append(
            {
                "name": name,
                "workload": load,
                "layout": layout,
                "row": row,
                "payloads": payloads,
                "exchanges": plan_phase(row, AudioCost()) if phases == 2 else None,
                "t_tok": sum(s.loss_tokens for g in row for s in g),
                "override": {},
            }
        )
    control = dict(next(s for s in steps if s["name"] == CONTROL[1]), name=CONTROL[0])
    control["override"] = {0: swapped(rank_arrays(control, 0))}
    return [*steps, control]


def rank_arrays(step: dict, rank: int) -> dict[str, np.ndarray]:
    """What the rank service delivers to `rank` for this step (its own `collate`)."""
    spec = types.SimpleNamespace(policy=types.SimpleNamespace(collate=step["layout"]))
    payloads = [step["payloads"][s.id] for s in step["row"][rank]]
    if step["exchanges"] is None:
        return collate(spec, payloads, PAD)
    ex = step["exchanges"][rank]
    info = StepInfo(rank, 0, 0, False, 0, 0, 0, 0, 0, 0, 1.0, 0.0)
    planned = Step(tuple(step["row"][rank]), info, None, ex)
    clips = [step["payloads"][c.sample_id] for c in ex.encode]
    return collate(spec, payloads, PAD, planned, clips=clips)


def swapped(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays with two of the rank's clips of equal tokens swapped in the placement: valid, wrong."""
    place, tokens = arrays["audio_placement"].copy(), arrays["audio_clip_tokens"]
    i, j = next(
        (i, j)
        for i in range(len(place))
        for j in range(i + 1, len(place))
        if tokens[place[i]] == tokens[place[j]]
    )
    place[[i, j]] = place[[j, i]]
    return {"audio_placement": place}


def rank_batch(step: dict, rank: int) -> dict:
    return to_torch({**rank_arrays(step, rank), **step["override"].get(rank, {})})


# -- the reference -------------------------------------------------------------------------------------------
def flat_grads(model: torch.nn.Module) -> np.ndarray:
    return np.concatenate(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).numpy()
            for p in model.parameters()
        ]
    )


def hf_kwargs(payload: dict) -> dict:
    """One sample the HF way: its clips padded to the window with Whisper's silence (the value the stock
    feature extractor gives the zero samples it pads with: the clip's max - 2, at least -1.5)."""
    kw = {"input_ids": torch.from_numpy(payload["input_ids"])[None], "use_cache": False}
    if "audio_frames" in payload:
        frames = payload["audio_frames"].tolist()
        features = np.zeros((len(frames), N_MELS, WINDOW), np.float32)
        mask = np.zeros((len(frames), WINDOW), np.int64)
        for k, clip in enumerate(np.split(payload["audio_features"], np.cumsum(frames)[:-1])):
            features[k] = max(float(clip.max()) - 2.0, -1.5)
            features[k, :, : len(clip)] = clip.T
            mask[k, : len(clip)] = 1
        kw["input_features"] = torch.from_numpy(features)
        kw["feature_attention_mask"] = torch.from_numpy(mask)
    return kw


def reference(step: dict) -> tuple[float, np.ndarray]:
    model = make_model()
    loss = 0
    for payload in step["payloads"].values():
        labels = torch.from_numpy(payload["labels"])[None]
        loss = loss + token_loss_sum(model(**hf_kwargs(payload)).logits, labels)[0]
    loss = loss / step["t_tok"]
    loss.backward()
    return float(loss.detach()), flat_grads(model)


# -- the distributed worker ----------------------------------------------------------------------------------
def run_rank(rank: int, steps: list[dict]) -> dict:
    out = run_model(rank, two_phase(make_model()), steps)
    frozen = two_phase(make_model())
    for name, p in frozen.named_parameters():  # frozen after the adaptation: two_phase sees it per step
        p.requires_grad_(not name.startswith(AUDIO_PREFIXES))
    out |= {
        ("frozen", k): v
        for k, v in run_model(rank, frozen, [s for s in steps if s["name"] in FROZEN]).items()
    }
    return out


def run_model(rank: int, model: torch.nn.Module, steps: list[dict]) -> dict:
    ddp = DDP(model)
    out = {}
    for step in steps:
        ddp.zero_grad(set_to_none=True)
        batch = rank_batch(step, rank)
        t_r = sum(s.loss_tokens for s in step["row"][rank])
        logits = forward_logits(ddp, batch)
        scaled_loss(logits, batch["labels"], loss_scale(t_r, step["t_tok"], WORLD), t_r).backward()
        out[step["name"]] = {
            "share": float(token_loss_sum(logits.detach(), batch["labels"])[0]) / step["t_tok"],
            "grads": flat_grads(model),
            "missing": [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None],
            "frames": int(batch["audio_features"].shape[0]) if "audio_features" in batch else 0,
        }
    return out


@pytest.fixture(scope="module")
def steps() -> dict:
    return {s["name"]: s for s in make_steps()}


@pytest.fixture(scope="module")
def ranks(steps, tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("gloo-audio")
    return gloo_ranks(run_rank, (list(steps.values()),), WORLD, out_dir, SPAWN_DEADLINE_S, PG_TIMEOUT_S)


@pytest.fixture(scope="module")
def references(steps) -> dict:
    cache: dict = {}
    for step in steps.values():
        if step["workload"] not in cache:
            cache[step["workload"]] = reference(step)
    return cache


def errors(got: list[dict], want_loss: float, want: np.ndarray) -> tuple[float, float]:
    """(|sum of loss shares - reference loss|, largest gradient error beyond the relative tolerance)."""
    loss_err = abs(sum(g["share"] for g in got) - want_loss)
    grad_err = max(float(np.max(np.abs(g["grads"] - want) - RTOL * np.abs(want))) for g in got)
    return loss_err, grad_err


def audio_mask() -> np.ndarray:
    """Per flattened parameter element: whether it belongs to the audio tower or its projector."""
    model = make_model()
    return np.concatenate(
        [np.full(p.numel(), n.startswith(AUDIO_PREFIXES)) for n, p in model.named_parameters()]
    )


# -- 1. the DDP step equals the stock model, and the control does not -------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", [s[0] for s in STEPS])
def test_ddp_step_equals_stock_model_per_sample(steps, ranks, references, name):
    step = steps[name]
    got = [r[name] for r in ranks]
    want_loss, want = references[step["workload"]]
    assert all(not g["missing"] for g in got), [g["missing"] for g in got]  # DDP: every parameter
    loss_err, grad_err = errors(got, want_loss, want)
    assert loss_err <= ATOL + RTOL * abs(want_loss), (name, loss_err, want_loss)
    assert grad_err <= ATOL, (name, grad_err)
    assert np.array_equal(got[0]["grads"], got[1]["grads"])  # DDP: one gradient on every rank
    has_clips = step["workload"] != "silent"
    assert np.any(want[audio_mask()] != 0) == has_clips  # the clips train the audio tower
    if step["exchanges"] is not None:
        moved = [c for ex in step["exchanges"] for c in ex.encode if c.owner != ex.rank]
        assert bool(moved) == (step["workload"] != "single"), name  # embeddings really cross ranks
        encoded = sorted((c.sample_id, c.index) for ex in step["exchanges"] for c in ex.encode)
        clips = sorted((s.id, k) for g in step["row"] for s in g for k in range(len(s.audio)))
        assert encoded == clips  # each clip encoded exactly once
    if step["workload"] == "allclips" and step["exchanges"] is not None:
        assert all(g["frames"] > 0 for g in got)  # rank 1 owns no clip and encodes some of rank 0's
    if step["workload"] == "single":  # rank 1 does not run the tower; its exchange still runs, empty
        assert step["exchanges"][1].empty and got[1]["frames"] == 0 and got[0]["frames"] == 64


@pytest.mark.slow
@pytest.mark.parametrize("name", FROZEN)
def test_a_frozen_audio_tower_trains_the_rest_alike(steps, ranks, references, name):
    """The tower and projector frozen (after `two_phase`): no gradient there, the LLM's as the reference's,
    and a rank with nothing to encode does not wait in an exchange backward the others skip."""
    got = [r[("frozen", name)] for r in ranks]
    want_loss, want = references[steps[name]["workload"]]
    audio = audio_mask()
    assert all(not g["missing"] for g in got)
    assert not any(g["grads"][audio].any() for g in got)
    frozen_want = np.where(audio, 0.0, want)
    loss_err, grad_err = errors(got, want_loss, frozen_want)
    assert loss_err <= ATOL + RTOL * abs(want_loss) and grad_err <= ATOL, (name, loss_err, grad_err)


@pytest.mark.slow
def test_a_wrong_placement_fails_the_comparison(steps, ranks, references):
    name = CONTROL[0]
    got = [r[name] for r in ranks]
    want_loss, want = references[steps[name]["workload"]]
    _, grad_err = errors(got, want_loss, want)
    assert grad_err > 100 * ATOL, grad_err


# -- 2. in process ------------------------------------------------------------------------------------------
def test_adapted_forward_equals_the_stock_forward(steps):
    step = steps["moved-padded-1"]
    payload = step["payloads"][0]  # two clips
    stock = make_model()
    adapted = two_phase(make_model())
    assert is_two_phase(adapted) and two_phase(adapted) is adapted
    with torch.no_grad():
        want = stock(**hf_kwargs(payload)).logits
        padded = forward_logits(adapted, to_torch(core.collate_padded([payload], pad_id=PAD)))
        packed = forward_logits(adapted, to_torch(core.collate_packed([payload, payload])))
    n = len(payload["input_ids"])
    assert torch.allclose(padded, want, atol=1e-6)
    assert torch.allclose(packed[:, :n], want, atol=1e-5) and torch.allclose(packed[:, n:], want, atol=1e-5)


def test_refusals(steps):
    batch = rank_batch(steps["moved-padded-2"], 0)
    assert "qwen2_audio" in AUDIO_FAMILIES
    stock = make_model()
    with pytest.raises(ValueError, match="batchd.two_phase"):
        check_model_batch(stock, batch)
    with pytest.raises(ValueError, match="batchd.two_phase"):
        forward_logits(stock, batch)
    adapted = two_phase(make_model())
    check_model_batch(adapted, batch)
    with pytest.raises(ValueError, match="pixel_values"):  # an image batch for an audio model
        check_model_batch(adapted, {**batch, "pixel_values": torch.zeros(4, 8)})
    payload = make_sample(100, 0, [WINDOW + 8])[1]  # longer than the stock encoder's window
    with pytest.raises(ValueError, match=f"at most {WINDOW} frames"):
        forward_logits(adapted, to_torch(core.collate_padded([payload])))
    short = dict(steps["moved-padded-1"]["payloads"][2])
    ids = short["input_ids"]
    short["input_ids"] = np.where(ids == AUDIO, 5, ids)  # no audio-token positions left for its clips
    with pytest.raises(ValueError, match="audio-token positions"):
        forward_logits(adapted, to_torch(core.collate_padded([short])))
    packed = to_torch(core.collate_packed([steps["moved-padded-1"]["payloads"][0]]))
    eager = two_phase(make_model())
    eager.config._attn_implementation = "paged|eager"
    eager.config.get_text_config()._attn_implementation = "paged|eager"
    with pytest.raises(ValueError, match="paged"):
        forward_logits(eager, packed)


def test_an_hf_model_without_the_exchange_refuses_an_audio_two_phase_batch(steps):
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1)
    )  # fmt: skip
    with pytest.raises(ValueError, match="audio_send_splits"):
        check_model_batch(llama, rank_batch(steps["moved-padded-2"], 0))
    with pytest.raises(ValueError, match="model_type='llama'"):
        two_phase(llama)
