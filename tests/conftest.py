"""Shared fixtures and hypothesis profiles.

`HYPOTHESIS_PROFILE=thorough` raises the example counts for a longer local run; CI uses the default.
"""

import logging
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

REPO = Path(__file__).resolve().parents[1]


def workload_dir() -> Path:
    """The public length workloads, committed as package data (batchd/workloads/*.txt)."""
    return REPO / "batchd" / "workloads"


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """A command run in-process (`batchd.cli.main`, `batchd.train.main`) replaces the root logger's handlers
    with one on this test's captured stderr; put the previous ones back, so that a later test's threads do not
    log into a closed capture file ("--- Logging error --- ValueError: I/O operation on closed file")."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    for h in handlers:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(level)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole test session (2 CPUs, no dashboard), started on first use only."""
    import ray

    started = not ray.is_initialized()
    if started:
        from batchd.service.preprocess import start_local_ray

        start_local_ray(num_cpus=2, include_dashboard=False)
    yield ray
    if started:
        ray.shutdown()


def pytest_collection_modifyitems(config, items):
    """.ci/run's lanes split the suite by marker: every `cluster` and `beside` test must also be `slow`, and
    none both, or CI would run it twice or never."""
    for item in items:
        marks = {m.name for m in item.iter_markers()}
        lane = {"beside", "cluster"} & marks
        if lane and ("slow" not in marks or len(lane) == 2):
            raise pytest.UsageError(
                f"{item.nodeid}: a {' and '.join(sorted(lane))} test must be slow, and not both"
            )
