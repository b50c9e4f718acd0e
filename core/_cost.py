"""Cost models: what a group of samples costs a training step, in tokens.

- `padded`: rows x longest. Standard attention over a padded [rows, longest] batch; the token budget
  L_max bounds the padded tensor, which is what sets activation memory.
- `packed`: sum of lengths. Varlen/flash attention over a packed sequence (`cu_seqlens`); no padding.
- `attention`: sum of (len + len^2 / q), Lhotse's `quadratic_duration` idea: attention's quadratic FLOPs
  become visible to the token budget, so one 8k sample costs more than eight 1k samples. q ~ the length at
  which the quadratic term equals the linear one (a few thousand tokens for typical hidden sizes).

Each model also says how its groups are formed (contiguous runs of the sorted window for `padded`,
best-fit decreasing for the additive ones) and how good a formed group is relative to the best group
its longest sample allows (`quality`), which the policies use to decide what to emit now.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ._choices import COST_MODELS
from ._types import check_choice, check_int


@dataclasses.dataclass(frozen=True, slots=True)
class CostModel:
    """A group cost function.

    Attributes:
        name: One of `COST_MODELS`.
        quadratic: The `q` of the attention-aware model (ignored by the others).
    """

    name: str = dataclasses.field(
        default="padded", metadata={"help": "cost model of a group", "choices": COST_MODELS, "key": "cost"}
    )
    quadratic: int = dataclasses.field(
        default=4096, metadata={"help": "q of the attention cost model (len + len^2 / q)", "metavar": "Q"}
    )

    def __post_init__(self) -> None:
        check_choice("cost", self.name, COST_MODELS)
        check_int("quadratic", self.quadratic, lo=1)

    @property
    def additive(self) -> bool:
        """True when a group's cost is the sum of its samples' costs (packed, attention)."""
        return self.name != "padded"

    def item(self, length: int) -> float:
        """Cost of one sample alone."""
        if self.name == "attention":
            return length + length * length / self.quadratic
        return float(length)

    def cost(self, lengths: Sequence[int]) -> float:
        """Cost of a group with these lengths (any order)."""
        if not lengths:
            return 0.0
        if self.name == "padded":
            return float(len(lengths) * max(lengths))
        if self.name == "packed":
            return float(sum(lengths))
        q = self.quadratic
        return float(sum(n + n * n / q for n in lengths))

    def materialized_tokens(self, lengths: Sequence[int]) -> int:
        """Tokens the step actually computes on: padded rows x longest, or the packed sum."""
        if not lengths:
            return 0
        if self.name == "padded":
            return len(lengths) * max(lengths)
        return sum(lengths)

    def complete(self, lengths: Sequence[int], token_budget: int) -> bool:
        """True when no further sample like its own shortest one fits: waiting cannot improve the group.

        Padded: rows == floor(L / longest). Additive: the room left is less than its shortest sample's
        cost. A lone over-budget sample is complete.
        """
        longest = max(lengths)
        if self.item(longest) > token_budget:
            return True
        if self.name == "padded":
            return len(lengths) >= token_budget // longest
        return token_budget - self.cost(lengths) < self.item(min(lengths))

    def quality(self, lengths: Sequence[int], token_budget: int) -> float:
        """How close a group is to the best group its longest sample allows, in (0, 1].

        Padded: real tokens / (floor(L / longest) x longest): a full group of near-equal lengths scores 1
        whatever the length class, so long-sample groups (which can never fill L) are not starved.
        Additive: cost / L. A lone over-budget sample scores 1 (it is as good as it will ever be).
        """
        longest = max(lengths)
        if self.item(longest) > token_budget:
            return 1.0
        if self.name == "padded":
            return sum(lengths) / ((token_budget // longest) * longest)
        return min(self.cost(lengths) / token_budget, 1.0)
