"""Optimizer updates of a fixed global count: where each update of an epoch ends, as a state machine.

With `JobSpec.tokens_per_update` = G (or `samples_per_update`), a trainer accumulates gradients over
several aligned steps and steps its optimizer once per update, as a recipe with a global batch and
gradient accumulation does. The coordinator is the one party that sees every step's global counts
(the commits), so it decides the boundaries, one round at a time, and sends them with the round's
totals (`RoundTotals.update_end`); every rank therefore agrees on them, and they are journaled with
the totals. Counts are global loss tokens (`tokens_per_update`) or global samples
(`samples_per_update`); IDLE steps count 0.

Rules (`JobSpec.update_rule`), over the steps of one epoch, c_j the count of step j:

- `cumulative` (default): update k (k = 1, 2, ...) ends at the first step at which the epoch's
  running count reaches k x G. Updates hold G on average, each between G - c_max and G + c_max, and
  an epoch of C counted units makes floor(C / G) or ceil(C / G) updates (with every c_j <= G), as
  the fixed recipe with G per update does (the count a learning-rate schedule is calibrated on).
  When a step alone holds more than G, every step ends an update (as without the setting) until the
  running count is back under the next k x G.
- `at_least`: an update ends at the first step whose count since the last update reaches G, so
  each update holds between G and G + c_max; an epoch then makes fewer updates than C / G (about
  C / (G + c/2)).

The last step of an epoch ends the open update whatever its count, so an epoch's updates never span
epochs (a resume at an epoch boundary holds no gradient). When an epoch closes in a round that
emitted no step while an update is open, the coordinator adds one step every rank spends IDLE
(`closing_step`), so that the update has a step to end on, on every rank (the gradient all-reduce
of an accumulated update happens in its last step's backward). An open update that holds neither a
counted unit nor a loss token (steps of samples without loss tokens, after the last update ended on
an exact multiple) is not closed: its gradient is zero, and an optimizer step on a zero gradient is
not a no-op (momentum, weight decay).

Loss scale. A window's global loss-token count W is known only at its last step, after its first
steps were trained. Each step is therefore scaled against a constant D of the job (`denominator`:
G with `tokens_per_update`, N x L with `samples_per_update`), loss_scale = N t_r / D, and the last
step carries update_scale = D / W, the factor the trainer applies to the accumulated gradient before
the optimizer step: sum_j (N t_rj / D) m_rj x D / W, averaged over the N ranks, is the per-token mean
over all of the window's samples on all ranks. Without the setting every step is its own update:
D = W = the step's global loss tokens, update_scale = 1, loss_scale = N t_r / T_tok as before.

All of it is pure: `UpdateWindows.close` is O(steps) per round, its state JSON-safe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from ._state import K_UPDATE_LOSS, K_UPDATE_OPEN, K_UPDATE_SEEN, K_UPDATE_STEPS, K_UPDATES


@dataclasses.dataclass(frozen=True, slots=True)
class UpdateEnds:
    """Where the updates of one round's steps end.

    Attributes:
        first: The epoch's update index of the round's first step (updates are numbered from 0).
        open_steps: Steps of that update before the round (0: the round's first step starts it).
        ends: Per step, whether an update ends there.
        loss_tokens: Per step, the ended update's global loss tokens W (0 where none ends).
    """

    first: int
    open_steps: int
    ends: tuple[bool, ...]
    loss_tokens: tuple[int, ...]


class UpdateWindows:
    """The update boundaries of one epoch (module docstring), fed one round at a time.

    `per_update` None (the setting off) ends an update at every step. `unit` is "tokens" (counts are
    loss tokens) or "samples"; `rule` one of `UPDATE_RULES`.
    """

    def __init__(self, per_update: int | None, unit: str = "tokens", rule: str = "cumulative") -> None:
        if per_update is not None and (isinstance(per_update, bool) or per_update < 1):
            raise ValueError(f"per_update must be None or an int >= 1, got {per_update=}")
        if unit not in ("tokens", "samples"):
            raise ValueError(f"unit must be 'tokens' or 'samples', got {unit=}")
        if rule not in ("at_least", "cumulative"):
            raise ValueError(f"rule must be 'at_least' or 'cumulative', got {rule=}")
        self.per_update, self.unit, self.rule = per_update, unit, rule
        self.updates = 0  # updates ended this epoch
        self.seen = 0  # counted units this epoch
        self.open_count = 0  # counted units of the open update
        self.open_loss = 0  # global loss tokens of the open update
        self.open_steps = 0  # steps of the open update

    def closing_step(self, steps: int, final: bool) -> bool:
        """True when a round that closes the epoch (`final`) with `steps` steps must add one IDLE step
        so that the open update ends on a step (module docstring)."""
        return final and steps == 0 and self._weighty()

    def _weighty(self) -> bool:
        return self.open_count > 0 or self.open_loss > 0

    def close(self, step_samples: Sequence[int], step_loss_tokens: Sequence[int], final: bool) -> UpdateEnds:
        """Feeds one round's steps (their global samples and loss tokens); `final`: the round closes the
        epoch, so its last step ends the open update. Returns where updates end."""
        if len(step_samples) != len(step_loss_tokens):
            raise ValueError(f"one count per step, got {len(step_samples)=} {len(step_loss_tokens)=}")
        first, open_steps, ends, loss = self.updates, self.open_steps, [], []
        last = len(step_samples) - 1
        for j, (samples, tokens) in enumerate(zip(step_samples, step_loss_tokens, strict=True)):
            count = tokens if self.unit == "tokens" else samples
            self.seen += count
            self.open_count += count
            self.open_loss += tokens
            self.open_steps += 1
            end = (final and j == last and self._weighty()) or self._ends()
            ends.append(end)
            loss.append(self.open_loss if end else 0)
            if end:
                self.updates += 1
                self.open_count = self.open_loss = self.open_steps = 0
        return UpdateEnds(first, open_steps, tuple(ends), tuple(loss))

    def _ends(self) -> bool:
        g = self.per_update
        if g is None:
            return True
        if self.rule == "cumulative":
            return self.seen >= (self.updates + 1) * g
        return self.open_count >= g

    def state_dict(self) -> dict[str, Any]:
        return {
            K_UPDATES: self.updates,
            K_UPDATE_SEEN: self.seen,
            K_UPDATE_OPEN: self.open_count,
            K_UPDATE_LOSS: self.open_loss,
            K_UPDATE_STEPS: self.open_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores `state_dict()`; a state without these keys (saved before the setting existed) is an
        epoch start with no open update."""
        self.updates = int(state.get(K_UPDATES, 0))
        self.seen = int(state.get(K_UPDATE_SEEN, 0))
        self.open_count = int(state.get(K_UPDATE_OPEN, 0))
        self.open_loss = int(state.get(K_UPDATE_LOSS, 0))
        self.open_steps = int(state.get(K_UPDATE_STEPS, 0))


def denominator(
    per_update_tokens: int | None, per_update_samples: int | None, world_size: int, token_budget: int
) -> int | None:
    """D of the module docstring: G with `tokens_per_update`, N x L with `samples_per_update`, None
    without either (each step is then scaled by its own global loss tokens)."""
    if per_update_tokens is not None:
        return per_update_tokens
    if per_update_samples is not None:
        return world_size * token_budget
    return None


def update_scale(denom: int | None, window_loss_tokens: int) -> float:
    """The factor for the accumulated gradient at an update's last step: D / W (1.0 when W is 0, where
    every gradient of the window is 0, or without updates of a fixed count)."""
    if denom is None or window_loss_tokens <= 0:
        return 1.0
    return denom / window_loss_tokens
