"""The pure parts of benchmarks/stream_scale.py (no Ray, no processes) on a tiny generated dataset: the
noise PNGs, the dataset generator's contract (records, cached reuse, the bad records' quarantine codes),
one reading pass, the shuffle-quality metrics and the report. A few seconds; the full run (`python
benchmarks/stream_scale.py`) covers the service, the resume and the time to first batch.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import stream_scale

from batchd.service.preprocess import RecordDataset, Reject
from batchd.testing import decode_images, iter_records, parse_record


def test_noise_pngs_are_valid_distinct_and_incompressible():
    from PIL import Image

    rng = np.random.default_rng(0)
    a, b = stream_scale.png_noise(rng, 48, 40), stream_scale.png_noise(rng, 48, 40)
    assert a != b
    img = Image.open(io.BytesIO(a))
    img.load()
    assert img.size == (40, 48) and img.mode == "RGB"
    assert len(a) > 48 * 40 * 3  # stored deflate: nothing to compress in noise


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    images = stream_scale.make_image_dataset(root, 16 << 20, 2 << 20, file_bytes=8 << 20, say=lambda _: None)
    text = stream_scale.make_text_dataset(root, 3000, say=lambda _: None)
    return root, images, text


def test_generated_dataset_has_its_bad_records_and_is_reused(tiny):
    root, images, _ = tiny
    ds = RecordDataset(images.path)
    assert len(ds) == images.records >= (16 << 20) // stream_scale.AVG_IMAGE_BYTES
    assert ds.block_rows[:-1] == [2] * (len(ds.blocks) - 1) and len(ds.files) == 3  # 4 row groups a file
    assert max(ds.block_bytes) <= 2 << 20
    assert set(images.bad.values()) == set(stream_scale.BAD_KINDS)
    for i, rec in iter_records(ds):
        kind = images.bad.get(i)
        if kind == "bad_image":
            assert not isinstance(rec, Reject)
            with pytest.raises(Reject, match="^bad_image"):
                decode_images(rec, "")
        elif kind is not None:
            assert isinstance(rec, Reject) and rec.code == kind, (i, kind, rec)
        else:
            assert not isinstance(rec, Reject) and len(decode_images(rec, "")) == 1
    again = stream_scale.make_image_dataset(root, 16 << 20, 2 << 20, file_bytes=8 << 20, say=lambda _: None)
    assert again.cached and again.bad == images.bad and again.files == images.files


def test_text_records_parse():
    rng = np.random.default_rng(1)
    rec = parse_record(stream_scale.text_record(rng, stream_scale._words()), "")
    assert len(rec.messages) >= 2 and not rec.images


def test_order_metrics_of_known_orders():
    block_of = np.repeat(np.arange(4), 16)  # 4 blocks of 16 ids
    rho, distinct, same = stream_scale.order_metrics(np.arange(64), block_of)
    assert rho == pytest.approx(1.0) and distinct == 4 and same == pytest.approx(60 / 63)
    rho, _, same = stream_scale.order_metrics(np.arange(64)[::-1], block_of)
    assert rho == pytest.approx(1.0) and same == pytest.approx(60 / 63)
    interleaved = np.arange(64).reshape(4, 16).T.ravel()  # 0, 16, 32, 48, 1, 17, ...
    assert stream_scale.order_metrics(interleaved, block_of)[2] == 0.0


def test_reading_shuffle_and_report(tiny):
    _, images, text = tiny
    reads = []
    for name, gen in (("images", images), ("text", text)):
        p = stream_scale.read_pass(gen, cold=name == "images")
        assert p["records"] == gen.records and p["records_per_s"] > 0
        reads.append({**p, "dataset": name})
    lay = {"images": stream_scale.layout(images), "text": stream_scale.layout(text)}
    budget = 4 << 20
    rows = stream_scale.shuffle_quality("images", lay["images"], [budget // 4, budget], (1, 2))
    by = {(q["N"], q["budget"]): q for q in rows}
    assert len(rows) == 2 * 4
    for q in rows:
        assert 0 <= q["rho"] <= 1 and 0 <= q["same"] <= 1
    # small windows keep consecutive samples in one block far more often than a global permutation
    assert by[(1, "1 MiB")]["same"] > by[(1, "global permutation")]["same"]
    result = {
        "budget": budget,
        "layout": lay,
        "reads": reads,
        "shuffle": rows,
        "meta": {"flags": " --pure", "revision": "test", "python": "CPython", "cores": 2, "seconds": 1.0},
    }
    text_md = "\n".join(stream_scale.render(result))
    assert (
        text_md.startswith("## Streaming")
        and "Shuffle quality" in text_md
        and "data >= 4x the budget" in text_md
    )
