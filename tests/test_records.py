"""Record input: the three readers, URIs and directories, schema errors, per-record quarantine."""

from __future__ import annotations

import base64
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchd.preprocess import Quarantine, RecordDataset, Reject, SchemaError, make_demo_dataset
from batchd.testing import iter_records, parse_record


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    root = tmp_path_factory.mktemp("records")
    return {
        fmt: make_demo_dataset(root / fmt, num_samples=60, seed=3, format=fmt, max_image_side=64)
        for fmt in ("parquet", "jsonl", "arrow")
    }


def _summary(rec):
    return rec.messages, rec.system, [im.read("") if im.data is not None else None for im in rec.images]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "arrow"])
def test_every_reader_reads_every_record_and_rejects_exactly_the_bad_ones(demos, fmt):
    demo = demos[fmt]
    ds = RecordDataset(demo.path)
    assert len(ds) == demo.num_records == 60
    assert ds.files[0].format == fmt
    rejected = {}
    for i, rec in iter_records(ds):
        if isinstance(rec, Reject):
            rejected[i] = rec.code
        else:
            assert rec.messages and any(m["role"] == "assistant" for m in rec.messages)
            markers = sum(m["content"].count("<image>") for m in rec.messages)
            assert markers == len(rec.images)
    # A bad image is found when it is decoded (in the pipeline), not when the record is parsed.
    assert rejected == {i: c for i, c in demo.bad.items() if c != "bad_image"}
    assert ("invalid_json" in rejected.values()) == (fmt == "jsonl")


def test_readers_agree_on_good_records(demos):
    pq_ds, js_ds, ar_ds = (RecordDataset(demos[f].path) for f in ("parquet", "jsonl", "arrow"))
    good = [i for i in range(60) if i not in demos["parquet"].bad and i not in demos["jsonl"].bad]
    assert len(good) > 40
    for i in good:
        a, c = pq_ds.record(i), ar_ds.record(i)
        assert _summary(a) == _summary(c)
        b = js_ds.record(i)
        assert (b.messages, b.system) == (a.messages, a.system)
        # JSONL references the PNG files by relative path: same bytes once read.
        assert [im.read(js_ds.files[0].base_dir) for im in b.images] == [im.data for im in a.images]


def test_filesystem_uri_and_directory_inputs(demos, tmp_path):
    uri = demos["parquet"].path.resolve().as_uri()
    assert uri.startswith("file://")
    ds = RecordDataset(uri)
    assert len(ds) == 60 and ds.record(0).messages == RecordDataset(demos["parquet"].path).record(0).messages
    # A directory: its supported files in sorted order, ids concatenated, sources name file and row.
    for k in range(2):
        pq.write_table(pq.read_table(demos["parquet"].path).slice(k * 10, 10), tmp_path / f"part-{k}.parquet")
    multi = RecordDataset(tmp_path)
    assert len(multi) == 20 and [f.offset for f in multi.files] == [0, 10]
    assert multi.source(13) == f"{tmp_path / 'part-1.parquet'}:3"
    assert multi.record(13).messages == ds.record(13).messages


def _msgs(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


def test_schema_errors_name_file_row_and_field(tmp_path):
    p = tmp_path / "no_messages.parquet"
    pq.write_table(pa.table({"text": ["hi"]}), p)
    with pytest.raises(SchemaError, match="messages") as e:
        RecordDataset(p)
    assert e.value.file == str(p) and e.value.field == "messages" and e.value.row is None

    p = tmp_path / "strings.parquet"
    pq.write_table(pa.table({"messages": [["hi", "there"]]}), p)
    with pytest.raises(SchemaError, match=r"list<struct<role: string, content: string>>") as e:
        RecordDataset(p)
    assert e.value.field == "messages" and str(p) in str(e.value)

    p = tmp_path / "images.arrow"
    table = pa.table({"messages": [_msgs(("user", "a"), ("assistant", "b"))], "images": [[1, 2]]})
    with pa.ipc.new_file(p, table.schema) as w:
        w.write_table(table)
    with pytest.raises(SchemaError) as e:
        RecordDataset(p)
    assert e.value.field == "images"

    p = tmp_path / "rows.jsonl"
    rows = [
        {"messages": _msgs(("user", "a"), ("assistant", "b"))},
        {"messages": _msgs(("user", "a"), ("assistant", "b"))},
        {"messages": [{"role": "user", "content": "a"}, {"role": 7, "content": "b"}]},
    ]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    # In JSONL a wrongly typed value is the record's problem, not the file's: that row is quarantined
    # with a reason naming the field, the others read (a Parquet/Arrow column's type is the file's).
    ds = RecordDataset(p)
    with pytest.raises(Reject, match="^schema: field 'messages\\[1\\].role': expected string, got int$"):
        ds.record(2)
    assert ds.record(0).messages[1]["content"] == "b"


def test_unknown_extension_and_missing_file(tmp_path):
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="cannot tell the format"):
        RecordDataset(tmp_path / "x.csv")
    with pytest.raises(FileNotFoundError):
        RecordDataset(tmp_path / "nope.parquet")


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        ({"messages": []}, "empty_conversation"),
        ({"messages": None}, "missing_field"),
        ({"other": 1}, "missing_field"),
        ({"messages": [{"role": "user"}]}, "missing_field"),
        ({"messages": _msgs(("user", "a"))}, "no_assistant"),
        ({"messages": _msgs(("user", "a"), ("wizard", "b"))}, "bad_role"),
        (
            {"messages": _msgs(("user", "<image><image>a"), ("assistant", "b")), "images": [b"x"]},
            "image_mismatch",
        ),
        (
            {
                "messages": _msgs(
                    ("system", "s"),
                )
            },
            "empty_conversation",
        ),
    ],
)
def test_bad_records_are_rejected_with_a_code(raw, code):
    with pytest.raises(Reject) as e:
        parse_record(raw)
    assert e.value.code == code


def test_record_variants_are_normalized():
    png = base64.b64encode(b"\x89PNGfake").decode()
    rec = parse_record(
        {
            "conversations": [
                {"from": "system", "value": "be nice"},
                {"from": "human", "value": "hi"},
                {"from": "gpt", "value": "hello"},
            ],
            "images": f"data:image/png;base64,{png}",
        }
    )
    assert rec.system == "be nice"
    assert rec.messages == [
        {"role": "user", "content": "<image>hi"},
        {"role": "assistant", "content": "hello"},
    ]
    assert rec.images[0].read("") == b"\x89PNGfake"
    rec = parse_record(
        {
            "messages": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]},
                {"role": "assistant", "content": "a cat"},
            ],
            "images": [{"bytes": png, "path": None}],
        }
    )
    assert rec.messages[0]["content"] == "<image>what?" and rec.images[0].read("") == b"\x89PNGfake"


def test_quarantine_appends_lines_and_counts_by_reason(tmp_path):
    q = Quarantine(tmp_path / "sub" / "q.jsonl")
    q.add(3, "a.jsonl:3", "invalid_json: Expecting value at column 1")
    q.add(9, "a.jsonl:9", "bad_image: images[0]: cannot decode", epoch=1)
    q.add(11, "a.jsonl:11", "bad_image: images[1]: cannot decode")
    assert q.counts == {"invalid_json": 1, "bad_image": 2} and q.total == 3
    lines = Quarantine.read(q.path)
    assert lines[0] == {"id": 3, "source": "a.jsonl:3", "reason": "invalid_json: Expecting value at column 1"}
    assert lines[1]["epoch"] == 1 and [ln["id"] for ln in lines] == [3, 9, 11]
    q2 = Quarantine(q.path)
    q2.load_state_dict(q.state_dict())
    assert q2.counts == q.counts
