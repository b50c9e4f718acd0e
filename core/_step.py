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

    Optimizer updates (`batchd.core._updates`): `update` is the epoch's index of the update this step
    belongs to, `update_step` the step's index inside it (0: the trainer zeroes gradients before its
    backward), `update_end` whether the trainer steps its optimizer after this step (every step when
    the job does not count updates), and there `update_scale` multiplies the accumulated gradient
    before the optimizer step and `update_loss_tokens` is the update's global loss tokens (0 on the
    other steps). With updates of a fixed count, `loss_scale` is N t_r / D for the job's constant D, so
    the gradient after `update_scale` is the per-token mean over the whole update; without them
    `update_scale` is 1.0 and `loss_scale` N t_r / T_tok, as before. `token_budget`: the job's budget when
    the step was planned (it is lowered after an out-of-memory step, `batchd.core.lowered_budget`).
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
    update: int = 0
    update_step: int = 0
    update_end: bool = True
    update_scale: float = 1.0
    update_loss_tokens: int = 0
    token_budget: int = 0  # the job's token budget the step was planned under (0: not said)


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """One aligned step on one rank: the samples of its group (empty when IDLE), the step info, and with
    phase balancing the rank's part of the step's vision exchange (`batchd.core.Exchange`) and, when the
    round has audio clips, of its audio exchange (`audio_exchange`)."""

    samples: tuple[Sample, ...]
    info: StepInfo
    exchange: Exchange | None = None
    audio_exchange: Exchange | None = None

    def payload_refs(self) -> list[tuple[int, int]]:
        """(sample id, home rank) of every sample whose payload the rank running this step needs: its LLM
        samples, then the samples of the images and clips it encodes for the exchanges, in that order,
        repeats kept. The rank fetches those whose home rank is another rank (the daemon's `Fetch`)."""
        refs = [(s.id, s.home_rank) for s in self.samples]
        for ex in (self.exchange, self.audio_exchange):
            refs += [(im.sample_id, im.home_rank) for im in ex.encode] if ex is not None else []
        return refs

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "samples": [s.to_json() for s in self.samples],
            "info": dataclasses.asdict(self.info),
        }
        if self.exchange is not None:
            out["exchange"] = self.exchange.to_json()
        if self.audio_exchange is not None:
            out["audio_exchange"] = self.audio_exchange.to_json()
        return out

    @staticmethod
    def from_json(obj: Mapping[str, Any]) -> Step:
        exchange, audio = (
            Exchange.from_json(obj[k]) if k in obj else None for k in ("exchange", "audio_exchange")
        )
        samples = tuple(Sample.from_json(s) for s in obj["samples"])
        return Step(samples, StepInfo(**obj["info"]), exchange, audio)
