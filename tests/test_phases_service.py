"""Two-phase balancing through the daemon: a real gRPC coordinator and rank services (one per rank, and node
agents), synthetic samples with images. Each rank's batch carries the pixels of the images it encodes and
its part of the exchange; the tests run the exchange in numpy (an all-to-all of split rows, then the
placement) with a stand-in encoder, and check that every rank ends with exactly its own LLM samples' image
embeddings, in order: every image encoded exactly once, nothing lost across restarts. The torch exchange
and the model are tested in test_exchange.py.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from _jobs import InProcessJob, job_pool

from batchd.core import JobSpec, Phases, PolicySpec
from batchd.service.preprocess import SyntheticData, SyntheticSource
from batchd.testing import synthetic_audio_payload, synthetic_image_payload

PATCH_DIM = 4  # small pixel rows: the data path, not the pixels, is under test
VOCAB = 512


def _workload(n: int, seed: int, all_images_on: set[int] | None = None) -> tuple[list[int], list[tuple]]:
    """Lengths and per-sample images (patches = 4 x tokens): ~60% of samples carry 1-3 images."""
    rng = np.random.default_rng(seed)
    lengths, images = [], []
    for i in range(n):
        k = int(rng.choice([0, 0, 1, 1, 2, 3])) if all_images_on is None else (2 if i in all_images_on else 0)
        ims = tuple((4 * t, t) for t in (int(rng.choice([4, 16, 40])) for _ in range(k)))
        text = int(rng.integers(8, 120))
        lengths.append(text + sum(t for _, t in ims))
        images.append(ims)
    return lengths, images


def _sources(spec: JobSpec, lengths, images):
    return [
        SyntheticSource(
            SyntheticData(lengths, VOCAB, images=images, patch_dim=PATCH_DIM),
            r,
            spec.world_size,
            spec.seed,
            0,
            spec.shuffle,
        )
        for r in range(spec.world_size)
    ]


def _encode(pixels: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """The stand-in vision encoder: each 4 consecutive patch rows -> one token row (the 2x2 merge)."""
    if len(grid) == 0:
        return np.zeros((0, 4 * PATCH_DIM), dtype=np.float32)
    return pixels.reshape(-1, 4 * PATCH_DIM)


def _exchange(batches: list[dict]) -> list[np.ndarray]:
    """One step's all-to-all in numpy, from each rank's batch: per rank, its LLM images' rows in LLM order."""
    n = len(batches)
    out_rows = []
    sent = []
    for b in batches:
        enc = _encode(
            b.get("pixel_values", np.zeros((0, PATCH_DIM), np.float32)),
            b.get("image_grid_thw", np.zeros((0, 3), np.int64)),
        )
        splits = b["vision_send_splits"].tolist()
        assert enc.shape[0] == sum(splits), (enc.shape, splits)
        offs = np.cumsum([0] + splits)
        sent.append([enc[offs[d] : offs[d + 1]] for d in range(n)])
    for o, b in enumerate(batches):
        recv = [sent[e][o] for e in range(n)]
        assert [len(x) for x in recv] == b["vision_recv_splits"].tolist()
        tokens = b["vision_image_tokens"].tolist()
        placement = b["vision_placement"].tolist()
        assert sorted(placement) == list(range(len(tokens)))
        received = np.concatenate(recv) if recv else np.zeros((0, 4 * PATCH_DIM), np.float32)
        # Received images, source by source: their sizes in received order, then placed.
        sizes = [tokens[p] for p in placement]
        chunks = np.split(received, np.cumsum(sizes)[:-1]) if sizes else []
        ordered = [None] * len(tokens)
        for j, p in enumerate(placement):
            ordered[p] = chunks[j]
        out_rows.append(np.concatenate(ordered) if ordered else np.zeros((0, 4 * PATCH_DIM), np.float32))
    return out_rows


def _expected(sample_ids, lengths, images, seed) -> np.ndarray:
    """A rank's LLM images' rows, encoded by the owner itself from the samples' own payloads."""
    rows = []
    for i in sample_ids:
        p = synthetic_image_payload(i, lengths[i], images[i], seed, VOCAB, PATCH_DIM)
        if images[i]:
            rows.append(_encode(p["pixel_values"], p["image_grid_thw"]))
    return np.concatenate(rows) if rows else np.zeros((0, 4 * PATCH_DIM), np.float32)


def _check(results, lengths, images, seed) -> int:
    """Runs every step's exchange; checks ids exactly once, images exactly once, rows where they belong.
    Returns the number of images that were encoded off their LLM rank."""
    world = len(results)
    steps = {len(r) for r in results}
    assert len(steps) == 1, steps
    seen, moved = [], 0
    for s in range(steps.pop()):
        batches = [results[r][s] for r in range(world)]
        assert len({b["info_step"] for b in batches}) == 1
        got = _exchange(batches)
        encoded = sum(len(b.get("image_grid_thw", ())) for b in batches)
        owned = sum(len(images[i]) for b in batches for i in b["sample_ids"])
        assert encoded == owned, f"step {s}: {encoded} images encoded, {owned} in the step"
        for r, b in enumerate(batches):
            ids = b["sample_ids"].tolist()
            seen += ids
            np.testing.assert_array_equal(got[r], _expected(ids, lengths, images, seed))
            own_grids = [
                synthetic_image_payload(i, lengths[i], images[i], seed, VOCAB, PATCH_DIM).get(
                    "image_grid_thw", np.zeros((0, 3), np.int64)
                )
                for i in ids
            ]
            want = np.concatenate(own_grids).tolist() if own_grids else []
            assert b.get("llm_image_grid_thw", np.zeros((0, 3), np.int64)).tolist() == want, "llm grids"
            assert not (b["input_ids"] == 0).all() or not ids
            recv = b["vision_recv_splits"].tolist()
            moved += sum(1 for e, n in enumerate(recv) if e != r and n)
    assert sorted(seen) == list(range(len(lengths)))
    return moved


def _project(batch, info):
    out = {k: np.asarray(v) for k, v in batch.items() if not isinstance(v, (int, float))}
    out["sample_ids"] = np.asarray(batch["sample_ids"])
    out["info_step"] = info.step
    return out


@pytest.fixture
def job_factory():
    with job_pool() as make:
        yield make


@pytest.mark.parametrize("world", [2, 3])
def test_two_phase_job_encodes_every_image_once_and_returns_it_to_its_owner(job_factory, world):
    lengths, images = _workload(160, seed=world)
    spec = JobSpec(
        world_size=world,
        token_budget=512,
        seed=5,
        policy=PolicySpec(name="balanced", window=16, depth=3),
        phases=Phases(count=2),
    )
    job = job_factory(spec, sources=_sources(spec, lengths, images))
    results = job.drain(project=_project)
    moved = _check(results, lengths, images, spec.seed)
    assert moved > 0, "no image was encoded off its LLM rank: the exchange is untested"


def test_one_rank_holding_every_image_spreads_them_and_image_free_steps_run(job_factory):
    # Only samples of rank 0's view carry images: its LLM groups hold them all, the plan spreads the encoding.
    spec = JobSpec(
        world_size=3,
        token_budget=512,
        seed=2,
        shuffle=False,
        policy=PolicySpec(name="balanced", window=8, depth=2),
        phases=Phases(count=2),
    )
    n = 90
    lengths, images = _workload(n, seed=1, all_images_on={i for i in range(n) if i % 3 == 0 and i < 45})
    job = job_factory(spec, sources=_sources(spec, lengths, images))
    results = job.drain(project=_project)
    _check(results, lengths, images, spec.seed)
    steps = list(zip(*results, strict=False))
    with_images = [row for row in steps if any(len(b.get("image_grid_thw", ())) for b in row)]
    spread = [row for row in with_images if sum(1 for b in row if len(b.get("image_grid_thw", ()))) > 1]
    image_free = [row for row in steps if not any(len(b.get("image_grid_thw", ())) for b in row)]
    assert spread, "no step spread one rank's images over several encoders"
    assert image_free, "no image-free step: the empty exchange is untested"


def test_a_rank_restarted_mid_epoch_reproduces_the_rest_of_the_exchange(tmp_path):
    lengths, images = _workload(150, seed=7)
    spec = JobSpec(
        world_size=3,
        token_budget=512,
        seed=3,
        policy=PolicySpec(name="balanced", window=12, depth=2),
        phases=Phases(count=2),
    )
    restarted = threading.Event()
    with InProcessJob(
        spec, sources=_sources(spec, lengths, images), rank_state_dir=tmp_path, grace=30.0
    ) as job:

        def on_step(rank: int, n: int) -> None:
            if rank == 1 and n == 5 and not restarted.is_set():
                restarted.set()
                threading.Thread(
                    target=job.restart_rank, args=(1, _sources(spec, lengths, images)[1]), daemon=True
                ).start()

        from _jobs import drain_clients

        results = [
            e[0]
            for e in drain_clients(
                lambda r: job.client(r, reconnect_timeout_s=30), 3, 1, 90.0, _project, on_step
            )
        ]
    assert restarted.is_set()
    _check(results, lengths, images, spec.seed)


def test_node_agents_exchange_images_with_a_cut_plan(tmp_path):
    from test_node import NodeJob, _drain  # noqa: F401 - the node-agent harness

    lengths, images = _workload(200, seed=11)
    spec = JobSpec(
        world_size=4,
        token_budget=512,
        seed=8,
        policy=PolicySpec(name="balanced", window=12, depth=2),
        phases=Phases(count=2),
    )
    job = NodeJob(spec, lengths, nodes=2, images=images, patch_dim=PATCH_DIM, vocab_size=VOCAB)
    try:
        from _jobs import drain_clients

        from batchd.client import BatchClient, ClientOptions

        results = [
            e[0]
            for e in drain_clients(
                lambda r: BatchClient(job.address(r), r, 4, options=ClientOptions(reconnect_timeout_s=30)),
                4,
                1,
                90.0,
                _project,
            )
        ]
    finally:
        job.stop()
    _check(results, lengths, images, spec.seed)
    assert job.state.core.vision_nodes == [0, 0, 1, 1]
    # The coordinator's exchange counters agree with the rows the ranks received from other ranks.
    rows = {"intra_node": 0, "cross_node": 0}
    for r, steps in enumerate(results):
        for b in steps:
            for e, n in enumerate(b["vision_recv_splits"].tolist()):
                if e != r:
                    rows["intra_node" if e // 2 == r // 2 else "cross_node"] += n
    scraped = {
        s.labels.get("scope"): s.value
        for m in job.metrics.registry.collect()
        for s in m.samples
        if s.name == "batchd_job_exchanged_rows_total"
    }
    assert scraped == rows and rows["intra_node"] > 0, (scraped, rows)


# -- the audio phase beside the vision phase ------------------------------------------------------------
MELS = 8


def _audio_workload(n: int, seed: int) -> tuple[list[int], list[tuple], list[tuple]]:
    """Lengths, images and audio clips (frames = 4 x tokens): ~half the samples carry 1-2 clips."""
    lengths, images = _workload(n, seed)
    rng = np.random.default_rng([seed, 5])
    audio = []
    for i in range(n):
        clips = tuple(
            (4 * t, t) for t in (int(rng.choice([4, 10, 25])) for _ in range(int(rng.choice([0, 1, 1, 2]))))
        )
        lengths[i] += sum(t for _, t in clips)
        audio.append(clips)
    return lengths, images, audio


def _audio_rows(batches: list[dict]) -> list[np.ndarray]:
    """One step's audio all-to-all in numpy with a stand-in encoder (4 frame rows -> one token row)."""
    n = len(batches)
    sent = []
    for b in batches:
        enc = b.get("audio_features", np.zeros((0, MELS), np.float32)).reshape(-1, 4 * MELS)
        splits = b["audio_send_splits"].tolist()
        assert enc.shape[0] == sum(splits), (enc.shape, splits)
        offs = np.cumsum([0] + splits)
        sent.append([enc[offs[d] : offs[d + 1]] for d in range(n)])
    out = []
    for o, b in enumerate(batches):
        received = np.concatenate([sent[e][o] for e in range(n)])
        assert [len(sent[e][o]) for e in range(n)] == b["audio_recv_splits"].tolist()
        tokens, placement = b["audio_clip_tokens"].tolist(), b["audio_placement"].tolist()
        chunks = np.split(received, np.cumsum([tokens[p] for p in placement])[:-1]) if placement else []
        ordered = [None] * len(tokens)
        for j, p in enumerate(placement):
            ordered[p] = chunks[j]
        out.append(np.concatenate(ordered) if ordered else np.zeros((0, 4 * MELS), np.float32))
    return out


def test_the_audio_phase_is_exchanged_beside_the_vision_phase_across_a_rank_restart(tmp_path):
    """Images and audio clips, phases 2, through the daemon, rank 1 restarted mid-epoch from its journal:
    in every step with clips each rank's batch carries the features of the clips it encodes and the audio
    exchange arrays; after the all-to-all each rank holds exactly its own LLM samples' clip rows, in order
    (every clip encoded exactly once), and every sample id is trained exactly once."""
    from _jobs import drain_clients

    lengths, images, audio = _audio_workload(150, seed=9)
    spec = JobSpec(
        world_size=3,
        token_budget=512,
        seed=4,
        policy=PolicySpec(name="balanced", window=12, depth=2),
        phases=Phases(count=2),
    )

    def sources():
        return [
            SyntheticSource(
                SyntheticData(lengths, VOCAB, images=images, audio=audio, patch_dim=PATCH_DIM),
                r,
                3,
                spec.seed,
                0,
                spec.shuffle,
            )
            for r in range(3)
        ]

    restarted = threading.Event()
    with InProcessJob(spec, sources=sources(), rank_state_dir=tmp_path, grace=30.0, metrics=True) as job:

        def on_step(rank: int, n: int) -> None:
            if rank == 1 and n == 4 and not restarted.is_set():
                restarted.set()
                threading.Thread(target=job.restart_rank, args=(1, sources()[1]), daemon=True).start()

        results = [
            e[0]
            for e in drain_clients(
                lambda r: job.client(r, reconnect_timeout_s=30), 3, 1, 90.0, _project, on_step
            )
        ]
    assert restarted.is_set()
    seen, moved, with_clips = [], 0, 0
    for s in range(len(results[0])):
        batches = [results[r][s] for r in range(3)]
        seen += [i for b in batches for i in b["sample_ids"].tolist()]
        if not any("audio_send_splits" in b for b in batches):
            assert not any(audio[i] for b in batches for i in b["sample_ids"].tolist()), f"step {s}"
            continue
        with_clips += 1
        got = _audio_rows(batches)
        for r, b in enumerate(batches):
            want = [
                synthetic_audio_payload(
                    {"input_ids": np.zeros(1), "labels": np.zeros(1)}, i, audio[i], spec.seed, VOCAB
                )
                for i in b["sample_ids"].tolist()
                if audio[i]
            ]
            rows = [p["audio_features"].reshape(-1, 4 * MELS) for p in want]
            np.testing.assert_array_equal(got[r], np.concatenate(rows) if rows else np.zeros((0, 4 * MELS)))
            assert "audio_features" not in b or b["audio_frames"].sum() == b["audio_features"].shape[0]
            moved += sum(n for e, n in enumerate(b["audio_recv_splits"].tolist()) if e != r)
    assert sorted(seen) == list(range(len(lengths)))
    assert with_clips > 0 and moved > 0, (with_clips, moved)
    scraped = {  # the coordinator counts the clip rows it had cross ranks (every rank its own node here)
        s.labels.get("scope"): s.value
        for m in job.cmetrics.registry.collect()
        for s in m.samples
        if s.name == "batchd_job_exchanged_clip_rows_total"
    }
    assert scraped == {"intra_node": 0, "cross_node": moved}, (scraped, moved)
