"""batchd.v1 wire schema: generated protobuf and gRPC stubs (see generate.py)."""
