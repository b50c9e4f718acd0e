"""Datasets read by blocks in bounded memory: `BlockView` (hypothesis), the JSONL byte-offset index and its
cache, each format's blocks, `BlockReader`'s budget, `RaySource` over many blocks (every id once, each
rank reading only its blocks, exact resume), and bad records (quarantined per record; too many of them
fail with a message that names the reasons and the file).
"""

from __future__ import annotations

import json
import os
import random
import threading

import numpy as np
import pyarrow as pa
import pyarrow.ipc as paipc
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_pipeline import drain  # the shared poll-until-EXHAUSTED helper, with its stall check

from batchd.core import BlockLayout, BlockView
from batchd.preprocess import (
    BlockReader,
    PoolOptions,
    RaySource,
    RecordDataset,
    Reject,
    SchemaError,
    StreamOptions,
    SyntheticSource,
    TooManyBadRecords,
    default_stages,
    demo_tokenizer,
)
from batchd.testing import iter_records, line_index, line_numbers, scan_lines


# -- BlockView ---------------------------------------------------------------------------------------
@st.composite
def layouts(draw):
    rows = draw(st.lists(st.integers(0, 40), min_size=1, max_size=12))
    nbytes = draw(st.lists(st.integers(1, 100), min_size=len(rows), max_size=len(rows)))
    world = draw(st.integers(1, 5))
    window = draw(st.one_of(st.none(), st.integers(1, 300)))
    return rows, nbytes, world, window, draw(st.integers(0, 3)), draw(st.booleans())


@given(layouts())
def test_blockview_views_partition_the_dataset_and_respect_the_window_budget(layout):
    rows, nbytes, world, window, seed, shuffle = layout
    views = [BlockView(BlockLayout(rows, nbytes, window), r, world, seed, 0, shuffle) for r in range(world)]
    ids = [i for v in views for i in v.ids()]
    assert sorted(ids) == list(range(sum(rows)))  # every id in exactly one rank's view
    for v in views:
        assert len(v) == len(v.ids())
        for w, units in enumerate(v.windows):
            blocks = v.window_blocks(w)
            held = sum(nbytes[b] for b in blocks)
            assert len(units) == 1 or held <= (window if window is not None else sum(nbytes))
            # a window's ids all lie in its blocks: a reader holding them has every record it needs
            ends = v.block_rows.cumsum()
            assert {int(np.searchsorted(ends, i, "right")) for i in v.window_ids(w)} <= set(blocks)
    sizes = [len(v) for v in views]
    assert max(sizes) - min(sizes) <= max(max(rows), 1)  # dealt by rows: at most one unit apart
    if not shuffle:
        for v in views:
            assert v.ids() == sorted(v.ids())


@given(layouts(), st.data())
def test_blockview_resumes_exactly_from_any_position(layout, data):
    rows, nbytes, world, window, seed, shuffle = layout
    rank = data.draw(st.integers(0, world - 1))
    wrap = data.draw(st.booleans())
    v = BlockView(BlockLayout(rows, nbytes, window), rank, world, seed, 1, shuffle, wrap)
    n = len(v)
    k = data.draw(st.integers(0, 2 * n + 1 if wrap else n))
    got = [v.next() for _ in range(k)]
    if not wrap:
        assert [i for i in got if i is not None] == v.ids()[:k]
    state = json.loads(json.dumps(v.state_dict()))
    at = json.loads(json.dumps(v.state_at(k if wrap else min(k, n))))  # what RaySource saves
    rest = [v.next() for _ in range(n + 3)]
    for saved in (state, at):
        w = BlockView(BlockLayout(rows, nbytes, window), rank, world, seed, 1, shuffle, wrap)
        w.load_state_dict(saved)
        assert [w.next() for _ in range(n + 3)] == rest
    if wrap and n:  # every pass holds the view's ids once, each in its own order
        fresh = BlockView(BlockLayout(rows, nbytes, window), rank, world, seed, 1, shuffle, wrap)
        passes = [[fresh.next() for _ in range(n)] for _ in range(3)]
        assert all(sorted(p) == sorted(fresh.ids()) for p in passes) and passes[0] == fresh.ids()


def test_blockview_state_of_another_layout_or_rank_is_refused():
    v = BlockView(BlockLayout([10, 10, 10], [5, 5, 5], 5), 0, 2, seed=1)
    state = v.state_dict()
    with pytest.raises(ValueError, match="layout"):
        BlockView(BlockLayout([10, 10, 10], [5, 5, 5], 10), 0, 2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="rank"):
        BlockView(BlockLayout([10, 10, 10], [5, 5, 5], 5), 1, 2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="one entry per block"):
        BlockView(BlockLayout([10, 10], [5]), 0, 2)


def test_blockview_splits_a_lone_block_so_every_rank_gets_a_share_and_epochs_reshuffle():
    one = [BlockView(BlockLayout([1000], [10]), r, 4, seed=0) for r in range(4)]
    sizes = [len(v) for v in one]  # units of ceil(1000 / (8 x 4)) = 32 rows: views differ by < one unit
    assert sum(sizes) == 1000 and max(sizes) - min(sizes) <= 32 and min(sizes) > 0
    assert (
        BlockView(BlockLayout([1000], [10]), 0, 4, epoch=0).ids()
        != BlockView(BlockLayout([1000], [10]), 0, 4, epoch=1).ids()
    )
    # small windows keep a block's rows together: each window reads one block
    v = BlockView(BlockLayout([50] * 8, [100] * 8, 100), 0, 1, seed=3)
    assert len(v.windows) == 8 and all(len(v.window_blocks(w)) == 1 for w in range(8))
    ids = v.ids()
    assert all(len({i // 50 for i in ids[k : k + 50]}) == 1 for k in range(0, 400, 50))


# -- the JSONL index -----------------------------------------------------------------------------------
@given(
    st.lists(st.sampled_from(["", " ", "\t", "{}", '{"a": 1}', "x" * 7, "  {}  ", "\r"]), max_size=30),
    st.booleans(),
    st.integers(1, 9),
)
def test_jsonl_index_finds_every_non_blank_line(tmp_path_factory, lines, newline_at_end, chunk):
    text = "\n".join(lines) + ("\n" if newline_at_end else "")
    p = tmp_path_factory.mktemp("idx") / "f.jsonl"
    p.write_bytes(text.encode())
    starts, ends = scan_lines(str(p), chunk_bytes=chunk)  # lines across chunk boundaries
    got = [text.encode()[s:e].decode() for s, e in zip(starts, ends, strict=False)]
    assert got == [ln for ln in text.split("\n") if ln.strip()]
    # each record's line as an editor numbers it: 1-based, blank lines counted
    numbers = line_numbers(str(p), starts, chunk_bytes=chunk)
    assert numbers.tolist() == [k + 1 for k, ln in enumerate(text.split("\n")) if ln.strip()]


def test_jsonl_index_is_cached_beside_the_data_and_rebuilt_when_the_file_changes(tmp_path, monkeypatch):
    p = tmp_path / "d.jsonl"
    p.write_text('{"a": 1}\n\n{"b": 2}\n')
    starts, ends, where = line_index(str(p))
    assert where == str(tmp_path / ".d.jsonl.batchd-index.npy") and len(starts) == 2
    # Same size and mtime, other lines: the cache answers (a scan would find the second line at 9).
    before = os.stat(p)
    p.write_text('{"a": 1}\n{"b": 2}\n\n')
    os.utime(p, ns=(before.st_atime_ns, before.st_mtime_ns))
    cached, _, where2 = line_index(str(p))
    assert where2 == where and cached.tolist() == starts.tolist() == [0, 10]  # read from the cache
    p.write_text('{"a": 1}\n{"b": 2}\n{"c": 3}\n')
    st_ = os.stat(p)
    os.utime(p, ns=(st_.st_atime_ns, st_.st_mtime_ns + 1_000_000))
    starts2, _, _ = line_index(str(p))
    assert len(starts2) == 3  # stale cache (size and mtime changed): rebuilt
    # A URI cannot have an index beside it: the cache dir holds it.
    monkeypatch.setenv("BATCHD_CACHE_DIR", str(tmp_path / "cache"))
    _, _, where = line_index(f"file://{p}")
    assert where is not None and where.startswith(str(tmp_path / "cache"))


# -- blocks of each format -----------------------------------------------------------------------------
def _conv(i: int, words: int = 4) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": f"question {i} " + "w " * words},
        {"role": "assistant", "content": f"answer {i} " + "v " * (words + i % 7)},
    ]


def _write_parquet(path, n: int, group: int, bad: dict[int, list] | None = None) -> None:
    msgs = [(bad or {}).get(i, _conv(i)) for i in range(n)]
    pq.write_table(pa.table({"messages": msgs}), path, row_group_size=group)


def test_blocks_of_parquet_arrow_file_and_stream_and_jsonl_read_the_same_records(tmp_path):
    n = 53
    _write_parquet(tmp_path / "a.parquet", n, 10)
    table = pa.table({"messages": [_conv(i) for i in range(n)]})
    with paipc.new_file(tmp_path / "b.arrow", table.schema) as w:
        for b in table.to_batches(max_chunksize=20):
            w.write_batch(b)
    with paipc.new_stream(tmp_path / "c.arrows", table.schema) as w:
        for b in table.to_batches(max_chunksize=7):
            w.write_batch(b)
    (tmp_path / "d.jsonl").write_text("\n\n".join(json.dumps({"messages": _conv(i)}) for i in range(n)))
    expected = [_conv(i) for i in range(n)]
    for name, blocks in (("a.parquet", 6), ("b.arrow", 3), ("c.arrows", 8), ("d.jsonl", 1)):
        ds = RecordDataset(tmp_path / name)
        assert len(ds) == n and len(ds.blocks) == blocks, (name, ds.blocks)
        got = []
        for k, b in enumerate(ds.blocks):
            items = ds.items(k, ds.read_block(k), range(b.offset, b.offset + b.rows))
            got += [ds.record(i).messages for i, _, _, _ in items]
            rows = range(b.offset, b.offset + b.rows)
            assert [s for _, s, _, _ in items] == [f"{ds.files[0].path}:{i}" for i in rows]
        assert got == expected, name
    # Several files: global ids run on, blocks do not cross files.
    both = RecordDataset([tmp_path / "a.parquet", tmp_path / "c.arrows"])
    assert len(both) == 2 * n and both.locate(n + 3) == (1, 3) and both.blocks[6].offset == n


def test_opening_reads_metadata_only_and_a_wrong_column_fails_at_once_naming_it(tmp_path, monkeypatch):
    _write_parquet(tmp_path / "a.parquet", 30, 10)
    monkeypatch.setattr(RecordDataset, "read_block", lambda self, k: pytest.fail("read a block at open"))
    ds = RecordDataset(tmp_path / "a.parquet")
    assert ds.block_rows == [10, 10, 10] and all(b > 0 for b in ds.block_bytes)
    pq.write_table(pa.table({"messages": [1, 2]}), tmp_path / "bad.parquet")
    with pytest.raises(SchemaError, match=r"bad.parquet: field 'messages'") as e:
        RecordDataset([tmp_path / "a.parquet", tmp_path / "bad.parquet"])
    assert e.value.file.endswith("bad.parquet") and e.value.field == "messages"


def test_jsonl_values_of_the_wrong_type_or_shape_are_quarantined_per_record(tmp_path):
    lines = [
        json.dumps({"messages": _conv(0)}),
        json.dumps({"messages": "hello"}),  # wrong type
        "{not json",  # invalid JSON
        json.dumps({"messages": [{"role": "user", "content": 5}]}),  # wrong type, nested
        json.dumps({"messages": [{"role": "user", "content": "q"}]}),  # no assistant turn
        json.dumps({"messages": _conv(5), "images": [3]}),  # wrong image type
        json.dumps([1, 2]),  # not an object
        json.dumps({"messages": _conv(7)}),
    ]
    (tmp_path / "mixed.jsonl").write_text("\n".join(lines) + "\n")
    ds = RecordDataset(tmp_path / "mixed.jsonl")  # opening never parses: no error here
    reasons = {i: r.reason for i, r in iter_records(ds) if isinstance(r, Reject)}
    assert sorted(reasons) == [1, 2, 3, 4, 5, 6]
    assert reasons[1] == "schema: field 'messages': expected a list of messages, got str"
    assert reasons[2].startswith("invalid_json: ")
    assert reasons[3] == "schema: field 'messages[0].content': expected string or list of parts, got int"
    assert reasons[4].startswith("no_assistant")
    assert reasons[5].startswith("schema: field 'images[0]'")
    assert reasons[6] == "schema: field '<row>': expected a JSON object, got list"


# -- BlockReader ---------------------------------------------------------------------------------------
def test_block_reader_holds_at_most_its_budget_and_drops_what_is_no_longer_wanted(tmp_path):
    _write_parquet(tmp_path / "a.parquet", 200, 20)
    ds = RecordDataset(tmp_path / "a.parquet")
    one = max(ds.block_bytes)
    reader = BlockReader(ds, budget=3 * one)
    try:
        reader.want(range(10))
        assert reader.settle(30)
        # The first wanted, in order, as many as fit (Parquet's estimate is under Arrow's count: 2 or 3).
        assert sorted(reader._held) in ([0, 1], [0, 1, 2])
        assert reader.stats()["peak_held_bytes"] <= reader.budget
        items = reader.items([199, 0, 45])  # a block not held is read on demand
        assert [i for i, _, _, _ in items] == [199, 0, 45]
        assert [ds.record(i).messages for i, _, _, _ in items] == [_conv(199), _conv(0), _conv(45)]
        reader.want([5, 6])
        assert set(reader._held) <= {5, 6}
    finally:
        reader.close()


# -- RaySource over many blocks ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def text_stages(tmp_path_factory):
    tok = demo_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    return default_stages(tok, vision=None, cutoff=1024)


@pytest.mark.slow
def test_ray_source_streams_each_rank_its_own_blocks_in_bounded_memory_and_resumes_exactly(
    ray_session, tmp_path, text_stages
):
    n, group = 480, 20
    bad = {7: [], 100: [{"role": "user", "content": "q"}], 333: []}
    _write_parquet(tmp_path / "a.parquet", n, group, bad)
    ds = RecordDataset(tmp_path / "a.parquet")
    budget = 4 * 2 * max(ds.block_bytes)  # windows of two blocks, the reader holds four at most
    common = dict(
        pool=PoolOptions(stages=text_stages, num_actors=1, actor_num_cpus=0.5),
        options=StreamOptions(memory_budget=budget, max_bad_fraction=0.5, quarantine=tmp_path / "q.jsonl"),
    )
    got: list[int] = []
    for rank in range(2):
        src = RaySource(ds, rank, 2, seed=4, epoch=0, **common)
        try:
            assert len(src.view.windows) >= 5
            half = [sample.id for sample, _ in drain(src, limit=len(src) // 2)]
            assert len(half) == len(src) // 2
            state = json.loads(json.dumps(src.state_dict()))
            rest = [sample.id for sample, _ in drain(src)]
            st_ = src.stats()
            own = {ds.block_of(i) for i in src.view.ids()}
            assert st_["blocks_read"] <= len(own) + 2, (st_, len(own))  # reads only its own view's blocks
            assert st_["peak_held_bytes"] <= budget // 2 + max(ds.block_bytes), st_
        finally:
            src.close()
        again = RaySource(ds, rank, 2, seed=4, epoch=0, **common)
        try:
            again.load_state_dict(state)
            assert [sample.id for sample, _ in drain(again)] == rest  # exact resume
        finally:
            again.close()
        got += half + rest
    assert sorted(got) == sorted(set(range(n)) - set(bad))


@pytest.mark.slow
def test_too_many_bad_records_fail_with_their_reasons_and_the_file(ray_session, tmp_path, text_stages):
    lines = [
        json.dumps({"messages": "oops"}) if i % 4 == 0 else json.dumps({"messages": _conv(i)})
        for i in range(150)
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    q = tmp_path / "quarantine.jsonl"
    ok = RaySource(
        tmp_path / "d.jsonl",
        0,
        1,
        pool=PoolOptions(stages=text_stages, num_actors=1, actor_num_cpus=0.5),
        options=StreamOptions(max_bad_fraction=0.3, quarantine=q),
    )
    try:  # 25% bad, under 0.3: the epoch runs, every bad record quarantined with its reason
        assert len(drain(ok)) == 112 and ok.quarantined == 38 and ok.reasons == {"schema": 38}
    finally:
        ok.close()
    lines_q = [json.loads(x) for x in q.read_text().splitlines()]
    assert lines_q[0]["reason"] == "schema: field 'messages': expected a list of messages, got str"
    # `file:line` as an editor shows it: 1-based
    assert {x["source"] for x in lines_q} == {f"{tmp_path / 'd.jsonl'}:{i + 1}" for i in range(0, 150, 4)}
    strict = RaySource(
        tmp_path / "d.jsonl",
        0,
        1,
        pool=PoolOptions(stages=text_stages, num_actors=1, actor_num_cpus=0.5),
        options=StreamOptions(max_bad_fraction=0.1, quarantine=q),
    )
    try:
        with pytest.raises(TooManyBadRecords) as e:
            drain(strict)
    finally:
        strict.close()
    msg = str(e.value)
    assert "more than [data] max_bad_fraction = 0.1" in msg and "schema" in msg and str(q) in msg, msg
    assert e.value.bad > 0.1 * max(e.value.read, 100)


def test_a_block_larger_than_a_window_fails_at_start_naming_file_and_block(tmp_path, text_stages):
    _write_parquet(tmp_path / "a.parquet", 100, 100)
    ds = RecordDataset(tmp_path / "a.parquet")
    with pytest.raises(ValueError, match=r"a.parquet: row group 0 holds .* raise \[data\] memory_budget"):
        RaySource(
            ds,
            0,
            1,
            pool=PoolOptions(stages=text_stages),
            options=StreamOptions(memory_budget=4 * ds.block_bytes[0] - 4),
        )


# -- a restarted rank replays the rounds decided before its crash on the buffer it reported -------------
CRASH_ROUND = 3


class _TimingSource(SyntheticSource):
    """A synthetic source whose samples are ready or not by chance (unseeded), like a RaySource's: a rank
    that fills its buffer again after a restart gets other samples than before the crash."""

    def poll(self, timeout: float = 0.0):
        if random.random() < 0.5:
            return None
        return super().poll(timeout)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["balanced", "local"])
def test_a_rank_killed_after_its_round_was_decided_replays_it_exactly(tmp_path, policy):
    """Rank 1 dies right after the coordinator decided a round it reported, before it journaled the round.
    Restarted, it reports that round again and gets the stored decision: it must apply it to the buffer
    it reported then (journaled before the report), not to a buffer filled again from a source whose
    readiness is timing. Every sample exactly once, and every step's totals match the ranks' batches."""
    from _jobs import InProcessJob, drain_clients

    from batchd.core import CoordinatorError, JobSpec, PolicySpec

    n = 240
    lengths = [int(x) for x in np.random.default_rng(3).integers(8, 200, n)]
    spec = JobSpec(world_size=2, token_budget=512, seed=5, policy=PolicySpec(name=policy, window=24, depth=2))
    sources = [_TimingSource(lengths, r, 2, spec.seed, 0, spec.shuffle) for r in range(2)]
    crashed = threading.Event()
    with InProcessJob(spec, sources=sources, rank_state_dir=tmp_path, grace=30.0) as job:
        core = job.cores[1]
        align = core.coord.align

        def align_then_die(epoch, report):
            decision = align(epoch, report)
            if report.round == CRASH_ROUND and not crashed.is_set():
                crashed.set()  # decided and not yet applied or journaled: the crash the replay must survive
                threading.Thread(
                    target=job.restart_rank, args=(1, _TimingSource(lengths, 1, 2, spec.seed)), daemon=True
                ).start()
                core._stop.set()
                raise CoordinatorError("killed")
            return decision

        core.coord.align = align_then_die
        results = drain_clients(
            lambda r: job.client(r, reconnect_timeout_s=30),
            2,
            1,
            90.0,
            lambda b, info: (
                np.asarray(b["sample_ids"]).tolist(),
                int(np.count_nonzero(np.asarray(b["labels"])[..., 1:] != -100)),
                info.global_loss_tokens,
            ),
        )
    assert crashed.is_set()
    ids = [i for r in results for ids_, _, _ in r[0] for i in ids_]
    assert sorted(ids) == list(range(n)), "a sample lost or trained twice after the replay"
    for (_, t0, g0), (_, t1, g1) in zip(results[0][0], results[1][0], strict=True):
        assert g0 == g1 == t0 + t1, "a step's global loss-token total does not match its batches"


def test_parquet_rows_of_the_wrong_shape_are_quarantined_naming_the_field(tmp_path):
    """Arrow types fix a column's type, not a row's shape: null and empty values are that row's problem."""
    msg = pa.struct([("role", pa.string()), ("content", pa.string())])
    rows = [
        _conv(0),
        [],  # an empty conversation
        [{"role": "user", "content": None}, {"role": "assistant", "content": "a"}],  # a null content
        [{"role": None, "content": "q"}, {"role": "assistant", "content": "a"}],  # a null role
        None,  # no messages at all
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
    ]
    images = [None, None, None, None, None, [b"not an image"]]
    pq.write_table(
        pa.table(
            {"messages": pa.array(rows, pa.list_(msg)), "images": pa.array(images, pa.list_(pa.binary()))}
        ),
        tmp_path / "p.parquet",
    )
    ds = RecordDataset(tmp_path / "p.parquet")
    reasons = {i: r.reason for i, r in iter_records(ds) if isinstance(r, Reject)}
    assert reasons == {
        1: "empty_conversation: messages is empty",
        2: "missing_field: messages[0].content",
        3: "missing_field: messages[0].role",
        4: "missing_field: messages",
    }
    # The undecodable image is the vision stage's to find (it decodes): the record parses.
    assert len(ds.record(5).images) == 1
