"""The nested parts of `JobSpec`: each owns its knobs and validates them, naming the bad value.

- `PolicySpec` (`JobSpec.policy`): the grouping policy and its knobs; a knob only one policy reads
  (`POLICY_KNOBS`) is refused under another unless it keeps its default.
- `Phases` (`JobSpec.phases`): one- or two-phase balancing and the encoders' cost models.
- `Updates` (`JobSpec.updates`): optimizer updates of several steps.
The cost model (`JobSpec.cost`) is `CostModel` itself.

Every leaf field carries `metadata["help"]` (and `choices`, `metavar`); its *key* (the command-line flag
and the flat name `JobSpec.from_keys` takes) is its name unless `metadata["key"]` gives another one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ._choices import ALIGN_RULES, COLLATE, NODE_PLANS, OVER_BUDGET, PHASES, POLICIES, UPDATE_RULES
from ._encoders import AudioCost, VisionCost
from ._policy import Policy
from ._types import check_bool, check_choice, check_int


def leaf(default: Any, help: str, **meta: Any) -> Any:
    """A spec field with its help text and argparse metadata (`choices`, `metavar`, `key`)."""
    return dataclasses.field(default=default, metadata={"help": help, **meta})


# The knobs only some policies read: set to another value under any other policy, they are refused.
POLICY_KNOBS: dict[str, tuple[str, ...]] = {
    "batch_size": ("fixed", "sorted"),
    "refine": ("balanced",),
    "level_rows": ("balanced",),
    "nodes": ("balanced",),
}


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """The grouping policy and its knobs (`JobSpec.policy`).

    The default is `balanced` with window 128 and depth 4: the configuration `batchd demo` and every
    end-to-end balanced benchmark of docs/benchmarks.md ran (demo, demo-pipeline, deterministic,
    restart), and window 128 is the benchmarks' online case (config B; at 512 a rank's whole share of a
    small data set fits its first window, and the coordinator plans a pool 4x as large every round).
    Depth 4 keeps a trainer fed (a step is ready while the next round is planned) at half the
    memory of 8; `deterministic` reports a capacity of depth // 2.

    Which policy reads which knob: window, depth, over_budget, collate: all; max_wait: local and
    balanced; align: the target rule of the per-rank policies (odb forces `odb`); batch_size: fixed,
    sorted; refine, level_rows, nodes: balanced (`POLICY_KNOBS`: changed from its default under another
    policy, such a knob is refused, naming it).
    """

    name: str = leaf("balanced", "grouping policy", choices=POLICIES, key="policy")
    window: int = leaf(128, "samples a rank buffers before grouping", metavar="W")
    depth: int = leaf(4, "batches a rank keeps ready (the alignment capacity)", metavar="D")
    max_wait: int = leaf(16, "rounds a sample may wait in a window", metavar="R")
    align: str = leaf(
        "min", "DGAP target rule: min (batchd's) or odb (ODB 0.1.2's max-target rule)", choices=ALIGN_RULES
    )
    over_budget: str = leaf("singleton", "what a sample longer than token_budget does", choices=OVER_BUDGET)
    collate: str = leaf("padded", "batch layout the rank service builds", choices=COLLATE)
    batch_size: int = leaf(8, "B of the fixed and sorted baselines", metavar="B")
    refine: bool = leaf(True, "balanced: shrink the round's group capacity so groups cost alike")
    level_rows: bool = leaf(
        True,
        "balanced: take a round's groups row by row so each step's ranks cost alike, outliers waiting "
        "a few rounds for peers (off: the first groups in ranked order; docs/design/balancing.md)",
    )
    nodes: str = leaf(
        "local",
        "balanced, ranks served by node agents: local plans a round per node where its cost per token is "
        "within 1 percent of node-blind (packed, attention cost; padded plans node-blind), blind ignores "
        "nodes, aware balances inside each node first (padded cost, when cross-node bytes dominate: "
        "docs/benchmarks.md, node-balance)",
        choices=NODE_PLANS,
    )
    """How `balanced` plans once node agents registered the topology: `local`, `blind` or `aware`.

    Rule for `aware` (docs/benchmarks.md, "Node-aware balancing", padded cost, 1,024 ranks, 8 per node):
    it costs +0.02 to +0.08 compute_vs_limit at window 128 (+0.20 to +0.30 at window 32) for 1.9x to
    3.5x fewer cross-node bytes, i.e. it saves about half to two thirds of node-blind's cross-node
    transfer. It helps a padded-cost job only where that transfer, not hidden behind compute, takes more
    than about 15% of a step at window 128 (about 55% at window 32); below that, and under packed or
    attention cost (where `local` moves 6x to 64x fewer samples at <= +0.03), keep `local`.
    """

    def __post_init__(self) -> None:
        check_choice("policy", self.name, POLICIES)
        check_int("policy.window", self.window, lo=1)
        check_int("policy.depth", self.depth, lo=1)
        check_int("policy.max_wait", self.max_wait, lo=1)
        check_choice("policy.align", self.align, ALIGN_RULES)
        check_choice("policy.over_budget", self.over_budget, OVER_BUDGET)
        check_choice("policy.collate", self.collate, COLLATE)
        check_int("policy.batch_size", self.batch_size, lo=1)
        check_bool("policy.refine", self.refine)
        check_bool("policy.level_rows", self.level_rows)
        check_choice("policy.nodes", self.nodes, NODE_PLANS)
        for knob, readers in POLICY_KNOBS.items():
            value, default = getattr(self, knob), _DEFAULTS[knob]
            if self.name not in readers and value != default:
                raise ValueError(
                    f"policy.{knob} is read only by policy {' / '.join(readers)}, not by "
                    f"policy={self.name!r}: leave it at {default!r}, got policy.{knob}={value!r}"
                )

    def build(self) -> Policy:
        """The grouping policy (`Policy`) these knobs describe."""
        return Policy(self.name, self.batch_size, self.max_wait, self.align, self.refine)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(PolicySpec)}


@dataclasses.dataclass(frozen=True)
class Phases:
    """One- or two-phase balancing and the encoders' cost models (`JobSpec.phases`)."""

    count: int = leaf(
        1,
        "balanced, join: 2 also balances the vision encoder per step (OrchMLLM two-phase: "
        "images are encoded on other ranks and their embeddings exchanged with one all-to-all)",
        choices=PHASES,
        key="phases",
    )
    vision_quadratic: int = leaf(
        8192, "q of the vision encoder's cost per image (patches + patches^2 / q; 0: linear)", metavar="Q"
    )
    audio_quadratic: int = leaf(
        6144,
        "q of the audio encoder's cost per clip of f frames (f / 4 + f / 2 + (f / 2)^2 / q; 0: linear)",
        metavar="Q",
    )
    exact_nodes: int = leaf(
        0,
        "phases=2: also solve each small step's encoder placement exactly (a MILP through scipy's HiGHS, "
        "steps of <= 8 ranks and <= 64 items, at most this many branch-and-bound nodes per solve) and "
        "take it where it peaks lower; 0: off (seconds per step: docs/benchmarks.md, encoder-phases)",
        metavar="K",
        key="phase_exact_nodes",
    )

    def __post_init__(self) -> None:
        check_choice("phases", self.count, PHASES)
        check_int("phases.vision_quadratic", self.vision_quadratic, lo=0)
        check_int("phases.audio_quadratic", self.audio_quadratic, lo=0)
        check_int("phases.exact_nodes", self.exact_nodes, lo=0)
        if self.exact_nodes and self.count != 2:
            raise ValueError(f"phases.exact_nodes needs phases=2, got phases={self.count}")

    def vision_cost(self) -> VisionCost:
        """The vision encoder's per-image cost model (two-phase balancing)."""
        return VisionCost(quadratic=self.vision_quadratic)

    def audio_cost(self) -> AudioCost:
        """The audio encoder's per-clip cost model (N-phase balancing)."""
        return AudioCost(quadratic=self.audio_quadratic)


@dataclasses.dataclass(frozen=True)
class Updates:
    """Optimizer updates of several steps (`JobSpec.updates`; off: one update per step)."""

    tokens_per_update: int | None = leaf(
        None,
        "G: one optimizer update per G global loss tokens (gradients accumulate over the steps of an "
        "update; off: one update per step)",
        metavar="G",
    )
    samples_per_update: int | None = leaf(
        None, "one optimizer update per this many global samples (instead of tokens_per_update)", metavar="S"
    )
    update_rule: str = leaf(
        "cumulative",
        "where an update ends: cumulative (update k at the epoch's running count k x G: G per update on "
        "average) or at_least (each update >= G)",
        choices=UPDATE_RULES,
    )

    def __post_init__(self) -> None:
        for name in ("tokens_per_update", "samples_per_update"):
            if getattr(self, name) is not None:
                check_int(f"updates.{name}", getattr(self, name), lo=1)
        if self.tokens_per_update is not None and self.samples_per_update is not None:
            raise ValueError(
                f"set updates.tokens_per_update or updates.samples_per_update, not both, got "
                f"tokens_per_update={self.tokens_per_update} samples_per_update={self.samples_per_update}"
            )
        check_choice("updates.update_rule", self.update_rule, UPDATE_RULES)

    @property
    def enabled(self) -> bool:
        """True when an update spans a fixed count of tokens or samples (not one per step)."""
        return self.tokens_per_update is not None or self.samples_per_update is not None
