"""The committed gRPC stubs match proto/batchd.proto (regenerated with the pinned grpcio-tools)."""

import pytest

from batchd.proto import batchd_pb2 as pb


def test_stubs_are_not_stale():
    pytest.importorskip("grpc_tools")
    from batchd.proto.generate import main

    assert main(["--check"]) == 0, "run: python -m batchd.proto.generate"


def test_schema_is_versioned_and_pickle_free():
    assert pb.DESCRIPTOR.package == "batchd.v1"
    fields = {f.type for m in pb.DESCRIPTOR.message_types_by_name.values() for f in m.fields}
    # Payloads travel as raw tensor bytes in `Tensor.data`; no opaque pickled blobs elsewhere.
    bytes_fields = [
        f"{m.name}.{f.name}"
        for m in pb.DESCRIPTOR.message_types_by_name.values()
        for f in m.fields
        if f.type == f.TYPE_BYTES
    ]
    assert bytes_fields == ["Tensor.data"]
    assert fields
