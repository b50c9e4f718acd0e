"""The job every party agrees on (`JobSpec`) and its wire form.

A rank registering with a spec that differs from the coordinator's is refused, naming the fields: a
silent mismatch (another window, seed or budget on one rank) would break the protocol's guarantees.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from batchd.core import CostModel, SimConfig
from batchd.core._types import check_choice
from batchd.proto import batchd_pb2 as pb

COLLATE = ("packed", "padded")


@dataclasses.dataclass(frozen=True)
class JobSpec(SimConfig):
    """Batching configuration shared by the coordinator and every rank service.

    The simulator's fields (`batchd.core.SimConfig`, validated by it) plus the collation layout, the
    attention cost model's quadratic constant and the number of epochs (each epoch a new seeded view of
    the dataset per rank); sampler views are shuffled by default.
    """

    shuffle: bool = True
    quadratic: int = 4096
    collate: str = "padded"
    epochs: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("collate", self.collate, COLLATE)
        if isinstance(self.epochs, bool) or not isinstance(self.epochs, int) or self.epochs < 1:
            raise ValueError(f"epochs must be an integer >= 1, got epochs={self.epochs!r}")
        if self.mode == "non-join" and self.quota is None:
            raise ValueError("non-join mode needs an explicit sample quota in the job spec, got quota=None")
        CostModel(self.cost, self.quadratic)

    def cost_model(self) -> CostModel:
        return CostModel(self.cost, self.quadratic)

    def diff(self, other: JobSpec) -> dict[str, tuple[Any, Any]]:
        """Fields where `other` differs: {field: (self's, other's)}."""
        a, b = dataclasses.asdict(self), dataclasses.asdict(other)
        return {k: (a[k], b[k]) for k in a if a[k] != b[k]}

    def replace(self, **changes: Any) -> JobSpec:
        return dataclasses.replace(self, **changes)

    def to_pb(self) -> pb.JobSpec:
        d = dataclasses.asdict(self)
        d["quota"] = -1 if self.quota is None else self.quota
        return pb.JobSpec(**d)

    @staticmethod
    def from_pb(m: pb.JobSpec) -> JobSpec:
        return JobSpec(
            world_size=m.world_size, token_budget=m.token_budget, policy=m.policy, window=m.window,
            batch_size=m.batch_size, mode=m.mode, cost=m.cost, over_budget=m.over_budget, seed=m.seed,
            shuffle=m.shuffle, depth=m.depth, max_wait=m.max_wait, align=m.align, refine=m.refine,
            quota=None if m.quota < 0 else int(m.quota), quadratic=m.quadratic, collate=m.collate,
            epochs=max(m.epochs, 1),
        )
