"""Steps: what one rank emits for one aligned step (its samples, `StepInfo`, its vision `Exchange`).

`RankState.finalize` builds them at the end of a round; the rank service serves them and the simulator
counts them. A step is JSON-safe through `to_json` / `from_json` (the rank service's and the
simulator's saved states hold the steps not yet delivered).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ._exchange import Exchange
from ._types import Sample


@dataclasses.dataclass(frozen=True, slots=True)
class StepInfo:
    """What a trainer needs to know about one aligned step on one rank.

    `loss_scale` multiplies the rank's per-token mean loss so that DDP's gradient mean equals the
    gradient of the global per-token mean loss (see `batchd.core.loss_scale`). An IDLE step has no
    samples and `loss_scale == 0`: the trainer runs a zero-weight forward/backward so collectives align.
    """

    rank: int
    step: int
    round: int
    is_idle: bool
    local_samples: int
    local_tokens: int
    local_loss_tokens: int
    global_samples: int
    global_tokens: int
    global_loss_tokens: int
    loss_scale: float
    cost: float


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """One aligned step on one rank: the samples of its group (empty when IDLE), the step info, and with
    two-phase balancing the rank's part of the step's vision exchange (`batchd.core.Exchange`)."""

    samples: tuple[Sample, ...]
    info: StepInfo
    exchange: Exchange | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "samples": [s.to_json() for s in self.samples],
            "info": dataclasses.asdict(self.info),
        }
        if self.exchange is not None:
            out["exchange"] = self.exchange.to_json()
        return out

    @staticmethod
    def from_json(obj: Mapping[str, Any]) -> Step:
        exchange = Exchange.from_json(obj["exchange"]) if "exchange" in obj else None
        return Step(tuple(Sample.from_json(s) for s in obj["samples"]), StepInfo(**obj["info"]), exchange)
