"""Shared fixtures and hypothesis profiles.

`HYPOTHESIS_PROFILE=thorough` raises the example counts for a longer local run; CI uses the default.
"""

import os
from pathlib import Path

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
