"""`IngestSource.ingest`: the validation of pushed records, without a server.

A well-formed record is queued as a sample of the receiving rank, with its payload's bytes; a malformed
one (bytes that do not decode, a payload that contradicts its metadata) is quarantined: its reason is
returned and nothing is queued; a duplicate id or a record after end_of_epoch refuses the stream
(`IngestRefused`, naming the rank). The gRPC path is covered by tests/test_daemon.py and
tests/test_metrics.py (`Ingest`).
"""

from __future__ import annotations

import numpy as np
import pytest

from batchd.core import Sample
from batchd.service.preprocess import (
    EXHAUSTED,
    IngestRefused,
    IngestSource,
    loss_tokens_of,
    synthetic_payload,
)
from batchd.testing import check_pushed, payload_nbytes


def pushed(i: int, n: int, home_rank: int = 7, **changes):
    payload = synthetic_payload(i, n, 0, 100)
    sample = Sample(i, n, loss_tokens_of(payload["labels"]), home_rank)
    return lambda: (sample.replace(**changes), payload)


def test_a_well_formed_record_is_queued_as_a_sample_of_the_receiving_rank():
    src = IngestSource(4)
    assert src.ingest(pushed(3, 10), home_rank=1) is None
    sample, payload = src.poll()
    assert (sample.id, sample.length, sample.home_rank) == (3, 10, 1)
    assert sample.nbytes == payload_nbytes(payload) > 0
    src.end()
    assert src.poll() is EXHAUSTED


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"length": 11}, "input_ids has 10 tokens, metadata says length=11"),
        ({"loss_tokens": 0}, "metadata says loss_tokens=0"),
    ],
)
def test_a_record_that_contradicts_its_metadata_is_quarantined_not_queued(changes, reason):
    src = IngestSource(4)
    assert reason in src.ingest(pushed(3, 10, **changes), home_rank=0)
    assert src.poll() is None and src.stats()["ingested"] == 0 and not src.reasons


def test_a_record_whose_bytes_do_not_decode_is_quarantined_with_the_decoders_reason():
    def decode():
        raise ValueError("tensor input_ids: 2 bytes, expected 40")

    src = IngestSource(4)
    assert src.ingest(decode, home_rank=0) == "tensor input_ids: 2 bytes, expected 40"
    assert src.poll() is None


def test_check_pushed_needs_1d_input_ids_and_labels_of_their_shape():
    sample = Sample(0, 4, 3)
    with pytest.raises(ValueError, match="1-D input_ids"):
        check_pushed(sample, {"input_ids": np.zeros((2, 2), np.int32)})
    with pytest.raises(ValueError, match="labels shape"):
        check_pushed(sample, {"input_ids": np.ones(4, np.int32), "labels": np.ones(3, np.int32)})
    check_pushed(sample, {"input_ids": np.ones(4, np.int32)})  # labels are optional


def test_a_duplicate_or_late_record_refuses_the_stream_naming_the_rank():
    src = IngestSource(4)
    assert src.ingest(pushed(3, 10), home_rank=2) is None
    with pytest.raises(IngestRefused, match=r"^rank 2: duplicate sample id 3 in this epoch$"):
        src.ingest(pushed(3, 10), home_rank=2)
    src.end()
    with pytest.raises(IngestRefused, match=r"^rank 2: sample 4 arrived after end_of_epoch$"):
        src.ingest(pushed(4, 10), home_rank=2)
    src.start_epoch(1)  # ids may repeat across epochs
    assert src.ingest(pushed(3, 10), home_rank=2) is None
