"""Ray, imported on its first use: the synthetic and ingest sources, `batchd calibrate` and `batchd bench`
run where Ray is not installed (a GPU machine with PyTorch alone), and a process that never starts Ray
never pays for its import.

Modules write ``if TYPE_CHECKING: import ray`` / ``else: from ._lazy_ray import ray`` and use ``ray.x`` as
before; the first attribute read imports it. `loaded()` tells whether any Ray object can exist yet.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

__all__ = ["loaded", "ray"]


class _Ray:
    """Reads each attribute of the real `ray` module, importing it the first time."""

    def __getattr__(self, name: str) -> Any:
        return getattr(importlib.import_module("ray"), name)


ray: Any = _Ray()


def loaded() -> bool:
    """True once Ray was imported in this process (before that no ObjectRef exists)."""
    return sys.modules.get("ray") is not None
