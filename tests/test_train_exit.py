"""The reference trainer's last collectives leave nothing to the backend's threads (batchd/_train).

A gloo worker thread drops its own reference to a collective after the caller's `wait()` returned; for
a tensor made in Python that drop needs the GIL, and done while the interpreter finalizes it aborts the
process (a trainer's core dump in CI). `all_reduce_released` returns only once the backend let go of the
tensor. Real gloo, one process, on a file store."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from batchd.testing import all_reduce_released


@pytest.fixture
def gloo(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_backend_let_go_of_each_tensor_when_it_returns(gloo):
    for n in (1, 7, 4096):
        t = torch.arange(n, dtype=torch.int64)
        all_reduce_released(t, dist.ReduceOp.SUM)
        assert t._use_count() == 1, f"the collective's work still holds the tensor ({n=})"
        assert t.tolist() == list(range(n))  # world size 1: the sum is the tensor itself
