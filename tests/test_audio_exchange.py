"""Two encoder phases exchanged (issue 25): the plans of the vision and the audio phase (`plan_phase` with
`VisionCost`, `AudioCost`), the rank service's batches (`batchd.service.collate`: the LLM samples without
their pixels and clips, the pixels and features of the images and clips this rank encodes, both phases'
exchange arrays) and `TinyMLLM`'s two encoders with `exchange_image_embeddings` and
`exchange_audio_embeddings`, trained by DDP on gloo at world sizes 2-4, give the loss and every gradient
of one process training every rank's one-phase batch (each rank encoding its own images and clips).

Cases: images and clips on every rank, some moved; a step with images and no clip; one rank holding every
image and clip. A control swaps two received clips of equal size on rank 0: valid arrays, a wrong step,
and the comparison sees it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _procs import gloo_ranks
from test_exchange import RTOL, grads, max_error  # the vision exchange's tests: the same comparisons
from torch.nn.parallel import DistributedDataParallel as DDP

from batchd import core
from batchd.client import exchange_audio_embeddings, scaled_loss, token_loss_sum
from batchd.core import (
    AUDIO_EXCHANGE_KEYS,
    AudioCost,
    JobSpec,
    PolicySpec,
    Sample,
    Step,
    StepInfo,
    VisionCost,
    loss_scale,
)
from batchd.service import collate
from batchd.testing import IGNORE_INDEX, TinyMLLM, clip_tokens, plan_phase, to_torch

pytestmark = pytest.mark.slow

WORLDS = (2, 3, 4)
SPAWN_DEADLINE_S = 300.0  # liveness backstop for a world's spawned ranks (`_procs.gloo_ranks`)
PG_TIMEOUT_S = 60
VOCAB, IMG, AUD, N_MELS, PATCH = 64, 3, 2, 16, 12  # text tokens are drawn from [4, VOCAB)
GRIDS = ((1, 2, 2), (1, 2, 4), (1, 4, 4))  # 1, 2 and 4 image tokens


def make_sample(
    sid: int, home: int, frames: list[int], grids: list[int]
) -> tuple[Sample, dict[str, np.ndarray]]:
    """Deterministic per id: text around each image's and each clip's tokens (labels -100 there), random
    pixels and features. `grids`: indices into GRIDS."""
    rng = np.random.default_rng([777, sid])
    ids: list[int] = []
    labels: list[int] = []
    items = [(IMG, int(np.prod(GRIDS[g])) // 4) for g in grids] + [(AUD, clip_tokens(f)) for f in frames]
    for item in [*items, None]:
        text = rng.integers(4, VOCAB, int(rng.integers(3, 8))).tolist()
        ids, labels = ids + text, labels + text
        if item is None:
            break
        ids += [item[0]] * item[1]
        labels += [IGNORE_INDEX] * item[1]
    labels[:2] = [IGNORE_INDEX] * 2
    payload = {"input_ids": np.asarray(ids, np.int64), "labels": np.asarray(labels, np.int64)}
    if grids:
        patches = [int(np.prod(GRIDS[g])) for g in grids]
        payload["pixel_values"] = rng.standard_normal((sum(patches), PATCH)).astype(np.float32)
        payload["image_grid_thw"] = np.asarray([GRIDS[g] for g in grids], np.int64)
    if frames:
        payload["audio_features"] = rng.standard_normal((sum(frames), N_MELS)).astype(np.float32)
        payload["audio_frames"] = np.asarray(frames, np.int64)
    images = tuple((int(np.prod(GRIDS[g])), int(np.prod(GRIDS[g])) // 4) for g in grids)
    audio = tuple((f, clip_tokens(f)) for f in frames)
    loss = core.loss_tokens(payload["labels"])
    return Sample(sid, len(ids), loss, home_rank=home, images=images, audio=audio), payload


def make_case(name: str, groups: list[list[tuple[list[int], list[int]]]]) -> dict:
    """groups[r] = rank r's LLM samples, each (its clips' frame counts, its images' GRIDS indices); homes
    rotate so payloads move."""
    world = len(groups)
    row, payloads, sid = [], {}, 0
    for r, group in enumerate(groups):
        row.append([])
        for frames, grids in group:
            sample, payload = make_sample(sid, (r + sid) % world, frames, grids)
            row[r].append(sample)
            payloads[sid] = payload
            sid += 1
    exchanges = plan_phase(row, AudioCost())
    vision = plan_phase(row, VisionCost())
    t_tok = sum(s.loss_tokens for g in row for s in g)
    return {
        "name": name,
        "world": world,
        "row": row,
        "payloads": payloads,
        "exchanges": exchanges,
        "vision": vision,
        "t_tok": t_tok,
    }


def cases_for(world: int) -> list[dict]:
    rng = np.random.default_rng(world)

    def sample(clips: int, images: int) -> tuple[list[int], list[int]]:
        return rng.integers(8, 200, clips).tolist(), rng.integers(0, len(GRIDS), images).tolist()

    moved = [
        [sample(int(rng.integers(0, 3)), int(rng.integers(0, 3))) for _ in range(2)] for _ in range(world)
    ]
    moved[0][0] = ([300, 180, 90], [2, 2, 1])  # rank 0 crowded: some of its clips and images go elsewhere
    silent = [[sample(0, 2), sample(0, 1)] for _ in range(world)]  # images, no clip
    crowded = [[([120, 64], [0, 2]), ([200], [1]), ([48, 48, 96], [2, 0])]] + [
        [([], []), ([], [])] for _ in range(1, world)
    ]
    return [make_case("moved", moved), make_case("no_audio", silent), make_case("one_rank_all", crowded)]


def info(rank: int) -> StepInfo:
    return StepInfo(rank, 0, 0, False, 0, 0, 0, 0, 0, 0, 1.0, 0.0)


def one_phase_batch(case: dict, rank: int) -> dict[str, np.ndarray]:
    spec = JobSpec(
        world_size=case["world"], token_budget=4096, policy=PolicySpec(name="local", window=512, depth=8)
    )
    return collate(spec, [case["payloads"][s.id] for s in case["row"][rank]])


def two_phase_batch(case: dict, rank: int) -> dict[str, np.ndarray]:
    spec = JobSpec(
        world_size=case["world"], token_budget=4096, policy=PolicySpec(name="local", window=512, depth=8)
    )
    ex, vision = case["exchanges"][rank], case["vision"][rank]
    step = Step(tuple(case["row"][rank]), info(rank), vision, ex)
    clips = [case["payloads"][c.sample_id] for c in ex.encode]
    images = [case["payloads"][im.sample_id] for im in vision.encode]
    payloads = [case["payloads"][s.id] for s in case["row"][rank]]
    return collate(spec, payloads, step=step, images=images, clips=clips)


def make_model() -> TinyMLLM:
    torch.manual_seed(99)
    return TinyMLLM(
        IMG, vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=2, d_vision=16, n_vision_layers=1,
        n_vision_heads=2, patch_dim=PATCH, audio_token_id=AUD, n_mels=N_MELS, d_audio=16,
    )  # fmt: skip


def reference(case: dict) -> tuple[float, dict[str, np.ndarray]]:
    model = make_model()
    total = 0
    for r in range(case["world"]):
        batch = to_torch(one_phase_batch(case, r))
        total = total + token_loss_sum(model(batch), batch["labels"])[0]
    (total / case["t_tok"]).backward()
    return float(total.detach()) / case["t_tok"], grads(model)


def swapped(case: dict) -> dict[str, np.ndarray]:
    """Rank 0's placement with two received clips of equal tokens swapped (a valid, wrong exchange)."""
    arrays = two_phase_batch(case, 0)
    place, tokens = arrays["audio_placement"].copy(), arrays["audio_clip_tokens"]
    pairs = [
        (i, j)
        for i in range(len(place))
        for j in range(i + 1, len(place))
        if tokens[place[i]] == tokens[place[j]]
    ]
    i, j = pairs[0]
    place[[i, j]] = place[[j, i]]
    return {**arrays, "audio_placement": place}


def run_rank(rank: int, world: int, cases: list[dict]) -> dict:
    ddp = DDP(make_model())
    out: dict = {}
    for case in [*cases, {**cases[2], "name": "control"}]:
        ddp.zero_grad(set_to_none=True)
        arrays = swapped(case) if case["name"] == "control" and rank == 0 else two_phase_batch(case, rank)
        batch = to_torch(arrays)
        t_r = sum(s.loss_tokens for s in case["row"][rank])
        logits = ddp(batch)
        scaled_loss(logits, batch["labels"], loss_scale(t_r, case["t_tok"], world), t_r).backward()
        with torch.no_grad():
            share = float(token_loss_sum(logits, batch["labels"])[0]) / case["t_tok"]
        out[case["name"]] = (
            share,
            grads(ddp.module),
            int(arrays.get("audio_features", np.zeros((0,))).shape[0]),
        )
    return out


@pytest.fixture(scope="module", params=WORLDS, ids=lambda n: f"world{n}")
def run(request, tmp_path_factory) -> dict:
    world = request.param
    cases = cases_for(world)
    out_dir = tmp_path_factory.mktemp(f"audio{world}")
    ranks = gloo_ranks(run_rank, (world, cases), world, out_dir, SPAWN_DEADLINE_S, PG_TIMEOUT_S)
    return {"cases": {c["name"]: c for c in cases}, "ranks": ranks}


@pytest.mark.parametrize("name", ["moved", "no_audio", "one_rank_all"])
def test_an_exchanged_audio_phase_trains_like_one_process(run, name):
    case = run["cases"][name]
    want_loss, want = reference(case)
    got_loss = sum(r[name][0] for r in run["ranks"])
    assert abs(got_loss - want_loss) <= RTOL * max(1.0, abs(want_loss)), (got_loss, want_loss)
    for rank, res in enumerate(run["ranks"]):
        err, tol = max_error(res[name][1], want)
        assert err <= tol, (name, rank, err, tol)
    audio, vision = ([n for n in want if n.startswith(p)] for p in ("audio.", "vision."))
    encoded = [c for ex in case["exchanges"] for c in ex.encode]
    clips = [(s.id, k) for g in case["row"] for s in g for k in range(len(s.audio))]
    assert sorted((c.sample_id, c.index) for c in encoded) == sorted(clips)  # each clip encoded once
    images = [im for ex in case["vision"] for im in ex.encode]
    assert sorted((im.sample_id, im.index) for im in images) == sorted(
        (s.id, k) for g in case["row"] for s in g for k in range(len(s.images))
    )  # each image encoded once
    images_moved = any(im.owner != ex.rank for ex in case["vision"] for im in ex.encode)
    assert images and (images_moved or name == "no_audio")  # both phases move items at once
    assert all(want[n].any() for n in vision)  # the vision encoder learns in every case
    if name == "no_audio":
        assert not encoded and not any(want[n].any() for n in audio)
    else:  # clips moved, and the audio encoder learns from them
        assert any(c.owner != ex.rank for ex in case["exchanges"] for c in ex.encode)
        assert all(want[n].any() for n in audio)
    if name == "one_rank_all":  # the crowded rank's clips were spread: every rank encoded some frames
        assert all(r[name][2] > 0 for r in run["ranks"])


def test_a_wrong_audio_placement_is_caught(run):
    _, want = reference(run["cases"]["one_rank_all"])
    errs = [max_error(r["control"][1], want) for r in run["ranks"]]
    assert any(err > 100 * tol for err, tol in errs), errs


def test_the_audio_exchange_arrays_are_the_phase_keys():
    case = cases_for(2)[0]
    arrays = two_phase_batch(case, 1)
    assert set(AUDIO_EXCHANGE_KEYS) <= set(arrays)
    own_clips = sum(len(s.audio) for s in case["row"][1])
    assert len(arrays["audio_placement"]) == own_clips == len(arrays["audio_clip_tokens"])
    assert int(arrays["audio_frames"].sum()) == arrays["audio_features"].shape[0]  # the clips it encodes
    assert arrays["audio_frames"].tolist() == [c.patches for c in case["exchanges"][1].encode]
    single = exchange_audio_embeddings(torch.zeros(3, 2), {})  # one-phase batch: nothing to exchange
    assert single.shape == (3, 2)
