"""RaySource over the demo dataset: coverage, quarantine, determinism, resume, backpressure, actor faults.

Ray runs once per test session (the `ray_session` fixture, 2 CPUs); the pools here reserve 0.5 CPU per
actor so two pools of two actors fit.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from batchd.preprocess import (
    EXHAUSTED,
    ChatTemplate,
    Quarantine,
    RaySource,
    StreamOptions,
    Tokenize,
    TokenizerRef,
    default_stages,
    demo_tokenizer,
    make_demo_dataset,
    resolve,
    resolve_many,
)
from batchd.testing import PreprocessPool, payload_nbytes

NUM = 120


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return make_demo_dataset(
        tmp_path_factory.mktemp("demo"), num_samples=NUM, seed=1, format="jsonl", max_image_side=160
    )


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return TokenizerRef(demo_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


@pytest.fixture(scope="module")
def pool(ray_session, demo, tok):
    with PreprocessPool(demo.path, default_stages(tok, cutoff=1024), num_actors=2, actor_num_cpus=0.5) as p:
        yield p


def drain(src, limit=None, timeout=120.0):
    """Polls until EXHAUSTED (or `limit` items): [(Sample, payload)]. Fails if no item (nor the end) came
    for `timeout` seconds: a stall, not slowness (an actor restart on a busy machine takes many seconds)."""
    out, deadline = [], time.monotonic() + timeout
    while limit is None or len(out) < limit:
        item = src.poll(0.5)
        if item is EXHAUSTED:
            break
        if item is not None:
            out.append(item)
            deadline = time.monotonic() + timeout
        assert time.monotonic() < deadline, (
            f"source stalled: nothing for {timeout:g}s after {len(out)} item(s)"
        )
        assert src.in_flight <= src.max_in_flight
    return out


def test_every_id_exactly_once_or_quarantined(pool, demo, tmp_path):
    qpath = tmp_path / "quarantine.jsonl"
    quarantine = Quarantine(qpath)
    sources = [
        RaySource(None, rank, 2, seed=3, epoch=0, pool=pool, options=StreamOptions(quarantine=quarantine))
        for rank in range(2)
    ]
    assert [src.unread() for src in sources] == [len(src) for src in sources]  # what the rank reports
    emitted = {rank: drain(src) for rank, src in enumerate(sources)}
    ids = [s.id for items in emitted.values() for s, _ in items]
    assert len(ids) == len(set(ids)) == demo.num_good
    assert set(ids) == set(range(NUM)) - set(demo.bad)
    for rank, src in enumerate(sources):
        assert src.emitted + src.quarantined == len(src) == src.records_read
        assert src.unread() == 0
        assert all(s.home_rank == rank for s, _ in emitted[rank])
        assert src.poll(0) is EXHAUSTED
    assert quarantine.counts == {code: list(demo.bad.values()).count(code) for code in set(demo.bad.values())}
    lines = Quarantine.read(qpath)
    assert {ln["id"]: ln["reason"].split(":")[0] for ln in lines} == demo.bad
    assert all(ln["source"] == f"{demo.path}:{ln['id'] + 1}" for ln in lines)  # JSONL: the 1-based line
    # Metadata agrees with the payloads it describes; payloads stay in the object store until resolved.
    items = emitted[0] + emitted[1]
    payloads = resolve_many([p for _, p in items])
    assert all(type(p).__name__ == "ObjectRef" for _, p in items)
    vision_seen = 0
    for (s, _), payload in zip(items, payloads, strict=False):
        ids_, labels = payload["input_ids"], payload["labels"]
        assert s.length == len(ids_) == len(labels) <= 1024
        assert s.loss_tokens == int(np.count_nonzero(labels[1:] != -100)) > 0
        mod = dict(s.modality_tokens)
        assert mod["text"] + mod["vision"] == s.length
        if mod["vision"]:
            vision_seen += 1
            assert payload["pixel_values"].shape[0] == 4 * mod["vision"]
        # Per image (two-phase balancing): its grid's patches and its tokens, as the payload holds them.
        grids = payload.get("image_grid_thw", np.zeros((0, 3), np.int64))
        assert s.images == tuple((int(np.prod(g)), int(np.prod(g)) // 4) for g in grids)
    assert vision_seen > 10


def test_deterministic_order_payloads_and_materialize(pool):
    a = drain(RaySource(None, 1, 2, seed=9, epoch=2, pool=pool, options=StreamOptions(chunk_size=3)))
    b = drain(
        RaySource(
            None, 1, 2, seed=9, epoch=2, pool=pool, options=StreamOptions(chunk_size=5, max_in_flight=7)
        )
    )
    assert [s for s, _ in a] == [s for s, _ in b]  # same view order and metadata, whatever the chunking
    src = RaySource(None, 1, 2, seed=9, epoch=2, pool=pool)
    for (s, ref), (_, ref2) in list(zip(a, b, strict=False))[:6]:
        x, y, z = resolve(ref), resolve(ref2), src.materialize(s.id)
        assert all(np.array_equal(x[k], y[k]) and np.array_equal(x[k], z[k]) for k in x)
        assert s.nbytes == payload_nbytes(x) == payload_nbytes(z) > 0  # the bytes the payload carries
    bad = next(i for i in range(NUM) if i % 2 == 1 and i not in {s.id for s, _ in a})
    with pytest.raises(KeyError, match="quarantined"):
        src.materialize(bad)
    as_dicts = drain(
        RaySource(None, 1, 2, seed=9, epoch=2, pool=pool, options=StreamOptions(payload="dict")), limit=3
    )
    assert isinstance(as_dicts[0][1], dict) and as_dicts[0][0] == a[0][0]


def test_actors_run_on_the_node_of_the_process_that_made_the_pool(pool, ray_session):
    here = ray_session.get_runtime_context().get_node_id()
    assert pool.node_id == here  # the default: this process's node
    assert [a["node_id"] for a in pool.stats()] == pool.actor_nodes() == [here, here]
    src = RaySource(None, 0, 2, seed=1, epoch=0, pool=pool)
    assert src.stats()["node_id"] == here and src.actor_nodes() == [here, here]


@pytest.mark.parametrize("ordered", [True, False])
def test_resume_from_a_saved_state_gives_exactly_the_rest(pool, ordered):
    first = RaySource(
        None, 0, 1, seed=4, epoch=1, pool=pool, options=StreamOptions(ordered=ordered, max_in_flight=24)
    )
    head = drain(first, limit=37)
    state = json.loads(json.dumps(first.state_dict()))  # what a journal would hold (tasks still in flight)
    assert first.in_flight > 0
    first.close()
    second = RaySource(None, 0, 1, seed=4, epoch=1, pool=pool, options=StreamOptions(ordered=ordered))
    second.load_state_dict(state)
    tail = drain(second)
    ids = [s.id for s, _ in head + tail]
    assert len(ids) == len(set(ids))
    full = drain(RaySource(None, 0, 1, seed=4, epoch=1, pool=pool))
    assert set(ids) == {s.id for s, _ in full}
    if ordered:
        assert ids == [s.id for s, _ in full]
    assert second.emitted + second.quarantined == len(second) == NUM
    with pytest.raises(ValueError):
        RaySource(None, 0, 1, seed=5, epoch=1, pool=pool).load_state_dict(state)


def test_one_epoch_reads_each_block_once(ray_session, tok, tmp_path):
    """Chunks of samples straddle windows: the window a chunk starts in stays held until the chunk's records
    are read, so with windows of a few blocks an epoch reads every block once (not twice: blocks dropped
    when the pull crossed into the next window were read again, synchronously, to submit the chunk)."""
    import pyarrow.parquet as pq

    data = make_demo_dataset(
        tmp_path, num_samples=96, seed=3, format="parquet", max_image_side=64, bad_fraction=0.0
    )
    path = tmp_path / "small-row-groups.parquet"
    pq.write_table(pq.read_table(data.path), path, row_group_size=6)
    with PreprocessPool(str(path), default_stages(tok, cutoff=1024), num_actors=2, actor_num_cpus=0.5) as p:
        window = 2 * max(p.dataset.block_bytes)
        src = RaySource(
            None, 0, 1, seed=0, epoch=0, pool=p, options=StreamOptions(memory_budget=4 * window, chunk_size=4)
        )
        assert len(p.dataset.blocks) == 16 and len(src.view.windows) >= 5
        assert len(drain(src)) == 96
        st = src.stats()
        assert st["blocks_read"] == 16, st
        assert st["peak_held_bytes"] <= 2 * window


def test_start_epoch_gives_the_next_epochs_view_with_cumulative_counters(pool, demo):
    src = RaySource(None, 0, 2, seed=6, epoch=0, pool=pool, options=StreamOptions(chunk_size=4))
    first = drain(src)
    src.start_epoch(1)
    second = drain(src)
    expected = [s for s, _ in drain(RaySource(None, 0, 2, seed=6, epoch=1, pool=pool))]
    assert [s for s, _ in second] == expected  # exactly a fresh epoch-1 source's samples, in its order
    assert [s.id for s, _ in first] != [s.id for s, _ in second]  # a new seeded permutation and split
    assert src.emitted + src.quarantined == 2 * len(src) and src.emitted == len(first) + len(second)
    # mid-view (non-join stops at a quota with work in flight): dropped, and the next view starts clean
    src.start_epoch(2)
    drain(src, limit=5)
    assert src.in_flight > 0
    src.start_epoch(3)
    assert [s for s, _ in drain(src)] == [
        s for s, _ in drain(RaySource(None, 0, 2, seed=6, epoch=3, pool=pool))
    ]


def test_wrap_mode_starts_a_new_pass_and_resumes_in_it(pool, demo):
    src = RaySource(None, 1, 4, seed=0, epoch=0, pool=pool, options=StreamOptions(wrap=True, max_in_flight=8))
    assert src.unread() is None  # an endless view: unknown
    good = [i for i in src.view.ids() if i not in demo.bad]
    items = drain(src, limit=len(good) + 10)
    ids = [s.id for s, _ in items]
    assert ids[: len(good)] == good and len(set(ids[len(good) :])) == 10
    assert set(ids[len(good) :]) <= set(good)  # the second pass, in a fresh order
    state = src.state_dict()
    nxt = src.poll(5.0)
    src2 = RaySource(None, 1, 4, seed=0, epoch=0, pool=pool, options=StreamOptions(wrap=True))
    src2.load_state_dict(state)
    assert src2.poll(5.0)[0] == nxt[0]


@pytest.mark.slow
def test_actor_killed_mid_epoch_and_a_record_that_crashes_its_worker(ray_session, demo, tok, tmp_path):
    """An actor killed while it holds tasks is restarted and its samples processed again; a record that
    kills every worker that touches it is quarantined after max_attempts; nothing is lost or duplicated."""
    poison = next(i for i in range(NUM) if i not in demo.bad and i > 60)

    def slow_or_poison(ex):
        if ex.id == poison:
            os._exit(1)
        time.sleep(0.004)

    stages = [ChatTemplate("qwen2"), Tokenize(tok), slow_or_poison] + default_stages(tok, cutoff=1024)[2:]
    with PreprocessPool(demo.path, stages, num_actors=2, actor_num_cpus=0.5) as kpool:
        src = RaySource(
            None,
            0,
            1,
            seed=0,
            epoch=0,
            pool=kpool,
            options=StreamOptions(max_in_flight=16, max_attempts=2, quarantine=tmp_path / "q.jsonl"),
        )
        head = drain(src, limit=20)
        assert src.in_flight > 0
        ray_session.kill(kpool.actors[0], no_restart=False)  # dies with its in-flight tasks
        rest = drain(src, timeout=120)
        ids = [s.id for s, _ in head + rest]
        assert len(ids) == len(set(ids))
        assert set(ids) == set(range(NUM)) - set(demo.bad) - {poison}
        assert src.retries > 0 and src.quarantined == len(demo.bad) + 1
        assert src.reasons["worker_crashed"] == 1
        lines = {ln["id"]: ln["reason"] for ln in Quarantine.read(tmp_path / "q.jsonl")}
        assert lines[poison].startswith("worker_crashed: the actor died 2 times")
        # The killed actor came back and works.
        # (an eighth of the data: its share of bad records is not what this judges)
        assert (
            len(
                drain(
                    RaySource(
                        None, 0, 8, seed=0, epoch=1, pool=kpool, options=StreamOptions(max_bad_fraction=1.0)
                    )
                )
            )
            > 0
        )


def test_backpressure_bounds_outstanding_work(pool):
    src = RaySource(
        None, 0, 1, seed=0, epoch=3, pool=pool, options=StreamOptions(max_in_flight=5, chunk_size=2)
    )
    assert src.poll(5.0) is not None
    time.sleep(0.3)  # the actors finish what they hold; nothing more is requested without polls
    assert src.in_flight <= 5 and len(src._tasks) <= 3
    assert len(drain(src)) + 1 == src.emitted
    st = src.stats()
    assert st["actors"] == 2 and st["samples"] == src.emitted and st["records_read"] == NUM


def test_rank_services_on_ray_sources_run_several_epochs(pool, demo):
    """Two in-process rank services read RaySources on one pool through a 2-epoch balanced job: every good
    record reaches a trainer exactly once per epoch, and each source's counters cover both epochs."""
    from _jobs import InProcessJob

    from batchd.core import JobSpec, PolicySpec

    spec = JobSpec(
        world_size=2,
        token_budget=2048,
        seed=2,
        epochs=2,
        policy=PolicySpec(name="balanced", window=16, depth=3),
    )
    sources = [RaySource(None, r, 2, seed=spec.seed, epoch=0, pool=pool) for r in range(2)]
    good = sorted(set(range(NUM)) - set(demo.bad))
    with InProcessJob(spec, sources=sources, startup_timeout_s=120) as job:
        got = job.drain_epochs(2, 120, lambda b, info: b["sample_ids"].tolist())
    for e in range(2):
        assert len(got[0][e]) == len(got[1][e]) > 0, "the same steps on every rank"
        assert sorted(i for r in range(2) for ids in got[r][e] for i in ids) == good, f"epoch {e}"
    for src in sources:
        assert src.emitted + src.quarantined == 2 * len(src) and src.epoch == 1
