"""The state contract of core's stateful parts: their `state_dict` keys, version and load check.

Every stateful part (`Coordinator`, `RankState`, `ViewSource`, `BlockView`, `Delivery`, `Liveness`)
saves a JSON-safe dict at a round boundary and restores it with `load_state_dict`. The keys are
defined here, each once, so two parts that save the same field (the rank, the epoch) agree on its
name. The parts that carry their configuration in the state (`STATE_VERSION` under `K_VERSION`, plus
the fields that must match) refuse a state of another configuration with `check_state`.

This module imports nothing from core: every stateful part imports it, never the reverse.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

# The version every versioned state carries under K_VERSION; `check_state` reads only this one.
STATE_VERSION = 1

# Keys shared by the coordinator, the rank state and the sampler views.
K_VERSION, K_WORLD, K_SEED, K_EPOCH, K_MODE = "version", "world_size", "seed", "epoch", "mode"
K_POLICY, K_ROUND, K_EMITTED, K_QUOTA, K_BUDGET = "policy", "round", "emitted", "quota", "token_budget"
K_DONE = "done"
# RankState
K_RANK, K_BUFFER, K_STEP, K_EXHAUSTED, K_REJECTED, K_COUNTERS = (
    "rank",
    "buffer",
    "step",
    "exhausted",
    "rejected",
    "counters",
)
# ViewSource and BlockView (K_RESIZE: [generation, step] of the resize whose remainder the view reads)
K_POS, K_PASS, K_NUM, K_LAYOUT, K_RESIZE = "position", "pass", "num_samples", "layout", "resize"
# Delivery (besides K_EPOCH and K_DONE)
K_READY, K_MADE, K_ACKED, K_END_SENT, K_PREV, K_GROUP, K_ENDS = (
    "ready",
    "made",
    "acked",
    "end_sent",
    "prev_epoch_steps",
    "group_size",
    "ends_sent",
)
# Delivery's rewind to a checkpoint: the earliest (epoch, step) a trainer may resume at, the epochs before
# the current one whose steps are still held ({epoch: steps made}), each member's last checkpoints
K_FLOOR, K_PAST, K_POINTS = "floor", "past_epochs", "checkpoints"
# Coordinator: the epoch's optimizer updates (`UpdateWindows`)
K_UPDATES, K_UPDATE_SEEN, K_UPDATE_OPEN, K_UPDATE_LOSS, K_UPDATE_STEPS = (
    "updates",
    "update_seen",
    "update_open",
    "update_open_loss_tokens",
    "update_open_steps",
)
# Liveness
K_REGISTERED, K_FINISHED = "registered", "finished"
# StepLedger (besides K_EPOCH)
K_LEDGER_IDS, K_LEDGER_ENDS, K_LEDGER_LOSS = "ids", "ends", "loss_tokens"


@runtime_checkable
class Stateful(Protocol):
    """A part restored from its own `state_dict()` alone (`Coordinator`, `RankState`, the views).

    Contract: `load_state_dict(state_dict())` on an object of the same configuration restores it
    exactly; a state of another configuration raises ValueError (`check_state`)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@runtime_checkable
class ClockedStateful(Protocol):
    """A part whose restore also takes the clock (`Delivery`, `Liveness`): deadlines restart at `now`."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any], now: float) -> None: ...


def check_state(state: Mapping[str, Any], expect: Mapping[str, Any], owner: str) -> None:
    """Raises ValueError naming every field where `state` disagrees with this object's configuration.

    `state` must carry `K_VERSION == STATE_VERSION`; `expect` maps keys to the current values;
    `owner` names the object in the message. O(len(expect))."""
    if state.get(K_VERSION) != STATE_VERSION:
        raise ValueError(
            f"{owner} state has version {state.get(K_VERSION)!r}; this build reads version {STATE_VERSION}"
        )
    bad = [f"{k}: saved {state.get(k)!r}, current {v!r}" for k, v in expect.items() if state.get(k) != v]
    if bad:
        raise ValueError(f"{owner} state does not match this configuration ({'; '.join(bad)})")
