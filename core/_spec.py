"""`JobSpec`: the one description of a job that every party agrees on, and the simulator runs.

The coordinator, every rank service and `batchd simulate` take the same frozen dataclass; the
config file's `[job]` keys, the command line's job flags and the wire message are all derived from
its fields (`FIELDS`, each field's `metadata["help"]`). A rank registering with a spec that differs
from the coordinator's is refused, naming the fields (`diff`): a silent mismatch (another window,
seed or token_budget on one rank) would break the protocol's guarantees.

Validation happens once, here, in `__post_init__`; every error names the field and the bad value.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ._choices import (
    ALIGN_RULES,
    COLLATE,
    COST_MODELS,
    MODES,
    OVER_BUDGET,
    PHASES,
    POLICIES,
    UPDATE_RULES,
)
from ._cost import CostModel
from ._encoders import AudioCost, VisionCost
from ._policy import Policy
from ._types import check_bool, check_choice, check_int
from ._updates import UpdateWindows, denominator


def _field(default: Any, help: str, **meta: Any) -> Any:
    return dataclasses.field(default=default, metadata={"help": help, **meta})


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """The batching configuration of one job (see the module docstring).

    Attributes are listed with their help text in `batchd config --example` and `--help`. The two
    without defaults are `world_size` and `token_budget` (L_max: the most one rank's step may cost, in
    the cost model's tokens).
    """

    world_size: int = dataclasses.field(metadata={"help": "number of trainer ranks", "metavar": "N"})
    token_budget: int = dataclasses.field(
        metadata={"help": "L_max: the most one rank's step may cost, in tokens", "metavar": "L"}
    )
    policy: str = _field("local", "grouping policy", choices=POLICIES)
    window: int = _field(512, "samples a rank buffers before grouping", metavar="W")
    batch_size: int = _field(8, "B of the fixed and sorted baselines", metavar="B")
    mode: str = _field(
        "join", "termination: join (every sample once) or non-join (a sample quota)", choices=MODES
    )
    cost: str = _field("padded", "cost model of a group", choices=COST_MODELS)
    over_budget: str = _field("singleton", "what a sample longer than token_budget does", choices=OVER_BUDGET)
    seed: int = _field(0, "seeds sampler views and the emission order")
    shuffle: bool = _field(True, "a seeded permutation of ids per epoch (off: rank r owns ids r, r+N, ...)")
    depth: int = _field(8, "batches a rank keeps ready (the alignment capacity)", metavar="D")
    max_wait: int = _field(16, "rounds a sample may wait in a window", metavar="R")
    align: str = _field(
        "min", "DGAP target rule: min (batchd's) or odb (ODB 0.1.2's max-target rule)", choices=ALIGN_RULES
    )
    refine: bool = _field(True, "balanced: shrink the round's group capacity so groups cost alike")
    level_rows: bool = _field(
        True,
        "balanced: take a round's groups row by row so each step's ranks cost alike, outliers waiting "
        "a few rounds for peers (off: the first groups in ranked order, as before them; "
        "docs/design/balancing.md)",
    )
    node_aware: bool = _field(
        False,
        "balanced, ranks served by node agents: balance inside each node first, so "
        "fewer samples cross nodes; steps may cost a little more (docs/benchmarks.md)",
    )
    node_local: bool = _field(
        True,
        "balanced, ranks served by node agents, packed or attention cost: plan a round per "
        "node, so few samples leave their node, where its cost per token is within 1 percent of "
        "node-blind (docs/design/balancing.md); node_aware forces a per-node plan instead",
    )
    quota: int | None = _field(None, "non-join: samples per epoch (the simulator's default: all samples)")
    quadratic: int = _field(4096, "q of the attention cost model (len + len^2 / q)", metavar="Q")
    collate: str = _field("padded", "batch layout the rank service builds", choices=COLLATE)
    epochs: int = _field(
        1, "epochs the job runs; each is a new seeded view of the data per rank", metavar="E"
    )
    phases: int = _field(
        1,
        "balanced, join: 2 also balances the vision encoder per step (OrchMLLM two-phase: "
        "images are encoded on other ranks and their embeddings exchanged with one all-to-all)",
        choices=PHASES,
    )
    vision_quadratic: int = _field(
        8192, "q of the vision encoder's cost per image (patches + patches^2 / q; 0: linear)", metavar="Q"
    )
    audio_quadratic: int = _field(
        6144,
        "q of the audio encoder's cost per clip of f frames (f / 4 + f / 2 + (f / 2)^2 / q; 0: linear)",
        metavar="Q",
    )
    phase_exact_nodes: int = _field(
        0,
        "phases=2: also solve each small step's encoder placement exactly (a MILP through scipy's HiGHS, "
        "steps of <= 8 ranks and <= 64 items, at most this many branch-and-bound nodes per solve) and "
        "take it where it peaks lower; 0: off (seconds per step: docs/benchmarks.md, encoder-phases)",
        metavar="K",
    )
    deterministic: bool = _field(
        False,
        "the same data, seed, config and world size give the same batches, steps and "
        "loss on every run, whatever the speed of preprocessing and trainers: a rank reports "
        "only a full window (or its source's end) and a fixed capacity (costs wall time: "
        "docs/benchmarks.md)",
    )
    tokens_per_update: int | None = _field(
        None,
        "G: one optimizer update per G global loss tokens (gradients accumulate over the steps of an "
        "update; off: one update per step)",
        metavar="G",
    )
    samples_per_update: int | None = _field(
        None, "one optimizer update per this many global samples (instead of tokens_per_update)", metavar="S"
    )
    update_rule: str = _field(
        "cumulative",
        "where an update ends: cumulative (update k at the epoch's running count k x G: G per update on "
        "average) or at_least (each update >= G)",
        choices=UPDATE_RULES,
    )

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, lo=1)
        check_int("token_budget", self.token_budget, lo=1)
        check_int("window", self.window, lo=1)
        check_int("depth", self.depth, lo=1)
        check_int("seed", self.seed)
        check_int("epochs", self.epochs, lo=1)
        check_choice("mode", self.mode, MODES)
        check_choice("over_budget", self.over_budget, OVER_BUDGET)
        check_choice("collate", self.collate, COLLATE)
        check_bool("shuffle", self.shuffle)
        check_bool("refine", self.refine)
        check_bool("level_rows", self.level_rows)
        check_bool("node_aware", self.node_aware)
        check_bool("node_local", self.node_local)
        check_bool("deterministic", self.deterministic)
        check_choice("phases", self.phases, PHASES)
        if self.phases == 2 and (self.policy != "balanced" or self.mode != "join"):
            raise ValueError(
                f"phases=2 needs policy='balanced' and mode='join' (the coordinator plans every "
                f"rank's step), got policy={self.policy!r} mode={self.mode!r}"
            )
        if self.phases == 2 and self.over_budget == "truncate":
            raise ValueError(
                "phases=2 cannot truncate over-budget samples (a cut would split an image's "
                "tokens from its pixels); use over_budget='singleton' or 'reject', got "
                "over_budget='truncate'"
            )
        check_int("vision_quadratic", self.vision_quadratic, lo=0)
        check_int("audio_quadratic", self.audio_quadratic, lo=0)
        check_int("phase_exact_nodes", self.phase_exact_nodes, lo=0)
        if self.phase_exact_nodes and self.phases != 2:
            raise ValueError(f"phase_exact_nodes needs phases=2, got phases={self.phases}")
        if self.quota is not None:
            check_int("quota", self.quota, lo=0)
        for name in ("tokens_per_update", "samples_per_update"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), lo=1)
        if self.tokens_per_update is not None and self.samples_per_update is not None:
            raise ValueError(
                f"set tokens_per_update or samples_per_update, not both, got "
                f"tokens_per_update={self.tokens_per_update} samples_per_update={self.samples_per_update}"
            )
        check_choice("update_rule", self.update_rule, UPDATE_RULES)
        self.policy_object()
        self.cost_model()

    def policy_object(self) -> Policy:
        """The grouping policy these fields describe."""
        return Policy(self.policy, self.batch_size, self.max_wait, self.align, self.refine)

    def cost_model(self) -> CostModel:
        return CostModel(self.cost, self.quadratic)

    def audio_cost(self) -> AudioCost:
        """The audio encoder's per-clip cost model (N-phase balancing; `AudioCost` with `audio_quadratic`)."""
        return AudioCost(quadratic=self.audio_quadratic)

    def vision_cost(self) -> VisionCost:
        """The vision encoder's per-image cost model (two-phase balancing)."""
        return VisionCost(quadratic=self.vision_quadratic)

    def check_daemon(self) -> JobSpec:
        """Raises ValueError if the daemon cannot run this spec (the simulator can): non-join needs a
        quota."""
        if self.mode == "non-join" and self.quota is None:
            raise ValueError("non-join mode needs an explicit sample quota in the job spec, got quota=None")
        return self

    def update_windows(self) -> UpdateWindows:
        """A fresh epoch's update boundaries (`UpdateWindows`) for these fields."""
        if self.samples_per_update is not None:
            return UpdateWindows(self.samples_per_update, "samples", self.update_rule)
        return UpdateWindows(self.tokens_per_update, "tokens", self.update_rule)

    def update_denominator(self) -> int | None:
        """D of the loss scale with updates of a fixed count (`batchd.core._updates`), else None."""
        return denominator(
            self.tokens_per_update, self.samples_per_update, self.world_size, self.token_budget
        )

    def diff(self, other: JobSpec) -> dict[str, tuple[Any, Any]]:
        """Fields where `other` differs: {field: (self's, other's)}."""
        a, b = dataclasses.asdict(self), dataclasses.asdict(other)
        return {k: (a[k], b[k]) for k in a if a[k] != b[k]}

    def replace(self, **changes: Any) -> JobSpec:
        return dataclasses.replace(self, **changes)


FIELDS: tuple[dataclasses.Field[Any], ...] = dataclasses.fields(JobSpec)
REQUIRED = ("world_size", "token_budget")
