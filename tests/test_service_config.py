"""The service layer's configuration objects: `ServiceConfig` (`SourceOptions`, `Endpoint`, `Limits`) that
`run_rank` / `run_node` take, and `RaySource`'s `PoolOptions` / `StreamOptions`. Each validates as it is
made, naming the bad value; the defaults are the service's."""

from __future__ import annotations

import dataclasses

import pytest

from batchd.core import JobSpec
from batchd.service import Endpoint, Limits, ServiceConfig, SourceOptions, run_coordinator
from batchd.service.preprocess import PoolOptions, StreamOptions, SyntheticData
from batchd.service.rank import RETAIN_BYTES


def test_defaults_are_the_services():
    config = ServiceConfig()
    source, endpoint = config.source, config.endpoint
    assert source == SourceOptions() and source.lengths is None and source.dataset is None
    assert (endpoint.host, endpoint.port, endpoint.metrics_port) == ("127.0.0.1", 0, None)
    assert config.limits == Limits(600.0, 1800.0, 600.0, RETAIN_BYTES)
    assert (config.state_dir, config.stats_file) == (None, None)
    assert StreamOptions().budget_bytes == 2 << 30 and PoolOptions().num_actors == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.state_dir = "/tmp/x"  # type: ignore[misc]


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: SourceOptions(lengths=[3, 4], dataset="d.parquet"), "not both.*dataset='d.parquet'"),
        (lambda: SourceOptions(num_actors=0), "num_actors=0"),
        (lambda: SourceOptions(vocab_size=0), "vocab_size=0"),
        (lambda: SourceOptions(cutoff=0), "cutoff=0"),
        (lambda: SourceOptions(source_options={"chunk": 3}), r"unknown key\(s\) \['chunk'\]"),
        (lambda: SourceOptions(source_options={"max_bad_fraction": 2.0}), "max_bad_fraction=2.0"),
        (lambda: SourceOptions(source_options={"memory_budget": "lots"}), "lots"),
        (lambda: Endpoint(port=70000), "port=70000"),
        (lambda: Endpoint(host=""), "host=''"),
        (lambda: Endpoint(metrics_port=-1), "metrics_port=-1"),
        (lambda: Endpoint(advertise=""), "advertise=''"),
        (lambda: Limits(client_grace_s=0), "client_grace_s=0"),
        (lambda: Limits(trainer_timeout_s=-1.0), "trainer_timeout_s=-1.0"),
        (lambda: Limits(retain_bytes=-1), "retain_bytes=-1"),
        (lambda: Limits(fill_timeout_s=0.0), "fill_timeout_s=0.0"),
        (lambda: SyntheticData([4, 5], vocab_size=1), "vocab_size=1"),
        (lambda: SyntheticData([4, 5], images=[()]), r"len\(images\)=1"),
        (lambda: SyntheticData([4, 5], audio=[(), (), ()]), r"len\(audio\)=3"),
        (lambda: run_coordinator(JobSpec(world_size=1, token_budget=8), "127.0.0.1:0"), "endpoint must be"),
        (lambda: ServiceConfig(limits=None), "limits=None"),  # type: ignore[arg-type]
        (lambda: PoolOptions(num_actors=0), "num_actors=0"),
        (lambda: PoolOptions(actor_num_cpus=0), "actor_num_cpus=0"),
        (lambda: StreamOptions(payload="bytes"), "payload='bytes'"),
        (lambda: StreamOptions(wrap=True, ordered=False), "wrap=True ordered=False"),
        (lambda: StreamOptions(chunk_size=0), "chunk_size=0"),
        (lambda: StreamOptions(max_in_flight=-1), "max_in_flight=-1"),
        (lambda: StreamOptions(max_bad_fraction=True), "max_bad_fraction=True"),
    ],
)
def test_a_bad_value_is_refused_by_name(make, match):
    with pytest.raises(ValueError, match=match):
        make()
