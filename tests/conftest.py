"""Shared fixtures and hypothesis profiles.

`HYPOTHESIS_PROFILE=thorough` raises the example counts for a longer local run; CI uses the default.
"""

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=1000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

REPO = Path(__file__).resolve().parents[1]


def workload_dir() -> Path:
    """The shared benchmark workloads (../shared/workloads beside the checkout)."""
    return REPO.parent / "shared" / "workloads"



@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole test session (2 CPUs, no dashboard), started on first use only."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False)
    yield ray
    if started:
        ray.shutdown()
