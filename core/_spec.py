"""`JobSpec`: the one description of a job that every party agrees on, and the simulator runs.

The coordinator, every rank service and `batchd simulate` take the same frozen dataclass: a few
fields every job has, and four nested parts that own their knobs (`policy`: `PolicySpec`, `cost`:
`CostModel`, `phases`: `Phases`, `updates`: `Updates`; `_spec_parts`). The config file's `[job]`
section (its nested tables `[job.policy]`, ...), the command line's job flags and the wire message are
all derived from these fields: `KEYS` names every leaf by its unique key (the flag's name, e.g.
`window` for `policy.window`). A rank registering with a spec that differs from the coordinator's is
refused, naming the fields (`diff`, e.g. `policy.window`): a silent mismatch (another window, seed or
token_budget on one rank) would break the protocol's guarantees.

Every default has its one home here. Validation happens in the parts' and the spec's
`__post_init__`; every error names the field and the bad value.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from ._choices import MODES
from ._cost import CostModel
from ._encoders import AudioCost, VisionCost
from ._policy import Policy
from ._spec_parts import Phases, PolicySpec, Updates, leaf
from ._types import check_bool, check_choice, check_int
from ._updates import UpdateWindows, denominator


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """The batching configuration of one job (see the module docstring).

    Leaves are listed with their help text in `batchd config --example` and `--help`. The two fields
    without defaults are `world_size` and `token_budget` (L_max: the most one rank's step may cost, in
    the cost model's tokens). `JobSpec(world_size=2, token_budget=64)` is a balanced job
    (`PolicySpec`'s docstring says why its window and depth).
    """

    world_size: int = dataclasses.field(metadata={"help": "number of trainer ranks", "metavar": "N"})
    token_budget: int = dataclasses.field(
        metadata={"help": "L_max: the most one rank's step may cost, in tokens", "metavar": "L"}
    )
    mode: str = leaf(
        "join", "termination: join (every sample once) or non-join (a sample quota)", choices=MODES
    )
    quota: int | None = leaf(None, "non-join: samples per epoch (the simulator's default: all samples)")
    epochs: int = leaf(1, "epochs the job runs; each is a new seeded view of the data per rank", metavar="E")
    seed: int = leaf(0, "seeds sampler views and the emission order")
    shuffle: bool = leaf(True, "a seeded permutation of ids per epoch (off: rank r owns ids r, r+N, ...)")
    deterministic: bool = leaf(
        False,
        "the same data, seed, config and world size give the same batches, steps and "
        "loss on every run, whatever the speed of preprocessing and trainers: a rank reports "
        "only a full window (or its source's end) and a fixed capacity (costs wall time: "
        "docs/benchmarks.md)",
    )
    policy: PolicySpec = dataclasses.field(default_factory=PolicySpec)
    cost: CostModel = dataclasses.field(default_factory=CostModel)
    phases: Phases = dataclasses.field(default_factory=Phases)
    updates: Updates = dataclasses.field(default_factory=Updates)

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, lo=1)
        check_int("token_budget", self.token_budget, lo=1)
        check_choice("mode", self.mode, MODES)
        if self.quota is not None:
            check_int("quota", self.quota, lo=0)
        check_int("epochs", self.epochs, lo=1)
        check_int("seed", self.seed)
        check_bool("shuffle", self.shuffle)
        check_bool("deterministic", self.deterministic)
        for name, cls in GROUPS.items():
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"{name} must be a {cls.__name__}, got {name}={getattr(self, name)!r}")
        if self.phases.count == 2 and (self.policy.name != "balanced" or self.mode != "join"):
            raise ValueError(
                f"phases=2 needs policy='balanced' and mode='join' (the coordinator plans every "
                f"rank's step), got policy={self.policy.name!r} mode={self.mode!r}"
            )
        if self.phases.count == 2 and self.policy.over_budget == "truncate":
            raise ValueError(
                "phases=2 cannot truncate over-budget samples (a cut would split an image's "
                "tokens from its pixels); use over_budget='singleton' or 'reject', got "
                "over_budget='truncate'"
            )

    @classmethod
    def from_keys(cls, **keys: Any) -> JobSpec:
        """The spec of flat keys (`KEYS`: the command line's names, e.g. `window=64, nodes="blind"`);
        a whole part may also be given by its field name (`policy=PolicySpec(...)`). Unknown keys raise
        ValueError naming them."""
        return _place(cls, None, keys)

    def replace(self, **changes: Any) -> JobSpec:
        """A copy with `changes` by key (`KEYS`, e.g. `window=64`) or whole parts by field name."""
        return _place(JobSpec, self, changes)

    def keys(self) -> dict[str, Any]:
        """{key: value} of every leaf (`KEYS` order): what `from_keys` takes back."""
        return {
            k: getattr(getattr(self, p.group) if p.group else self, p.field.name) for k, p in KEYS.items()
        }

    def policy_object(self) -> Policy:
        """The grouping policy these fields describe."""
        return self.policy.build()

    def cost_model(self) -> CostModel:
        return self.cost

    def audio_cost(self) -> AudioCost:
        """The audio encoder's per-clip cost model (N-phase balancing; `Phases.audio_quadratic`)."""
        return self.phases.audio_cost()

    def vision_cost(self) -> VisionCost:
        """The vision encoder's per-image cost model (two-phase balancing)."""
        return self.phases.vision_cost()

    def check_daemon(self) -> JobSpec:
        """Raises ValueError if the daemon cannot run this spec (the simulator can): non-join needs a
        quota."""
        if self.mode == "non-join" and self.quota is None:
            raise ValueError("non-join mode needs an explicit sample quota in the job spec, got quota=None")
        return self

    def update_windows(self) -> UpdateWindows:
        """A fresh epoch's update boundaries (`UpdateWindows`) for these fields."""
        u = self.updates
        if u.samples_per_update is not None:
            return UpdateWindows(u.samples_per_update, "samples", u.update_rule)
        return UpdateWindows(u.tokens_per_update, "tokens", u.update_rule)

    def update_denominator(self) -> int | None:
        """D of the loss scale with updates of a fixed count (`batchd.core._updates`), else None."""
        u = self.updates
        return denominator(u.tokens_per_update, u.samples_per_update, self.world_size, self.token_budget)

    def diff(self, other: JobSpec) -> dict[str, tuple[Any, Any]]:
        """Leaves where `other` differs: {dotted field, e.g. "policy.window": (self's, other's)}."""
        a, b = _dotted(self), _dotted(other)
        return {k: (a[k], b[k]) for k in a if a[k] != b[k]}


GROUPS: dict[str, type] = {"policy": PolicySpec, "cost": CostModel, "phases": Phases, "updates": Updates}


class SpecKey(NamedTuple):
    """A leaf of `JobSpec`: its part (`group`, None at the top level) and its dataclass field."""

    group: str | None
    field: dataclasses.Field[Any]

    @property
    def path(self) -> str:
        """The dotted field name ("policy.window"; "seed" at the top level)."""
        return f"{self.group}.{self.field.name}" if self.group else self.field.name


def _keys() -> dict[str, SpecKey]:
    out: dict[str, SpecKey] = {}
    for f in dataclasses.fields(JobSpec):
        parts = [SpecKey(f.name, g) for g in dataclasses.fields(GROUPS[f.name])] if f.name in GROUPS else []
        for key, item in (
            [(f.name, SpecKey(None, f))]
            if not parts
            else [(g.field.metadata.get("key", g.field.name), g) for g in parts]
        ):
            if key in out:
                raise AssertionError(f"two JobSpec leaves share the key {key!r}")
            out[key] = item
    return out


KEYS: dict[str, SpecKey] = _keys()  # every leaf by its key (the flag's name), in field order
REQUIRED = ("world_size", "token_budget")


def _place(cls: type[JobSpec], base: JobSpec | None, keys: dict[str, Any]) -> JobSpec:
    top: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {}
    for key, value in keys.items():
        if key in GROUPS and isinstance(value, GROUPS[key]):
            top[key] = value
        elif key in KEYS:
            item = KEYS[key]
            if item.group is None:
                top[key] = value
            else:
                parts.setdefault(item.group, {})[item.field.name] = value
        else:
            raise ValueError(f"unknown JobSpec key {key!r}; the keys are {sorted(KEYS)}")
    for group, changes in parts.items():
        if group in top:
            raise ValueError(f"give {group} whole or by its keys, not both, got {sorted(changes)}")
        current = getattr(base, group) if base is not None else GROUPS[group]()
        top[group] = dataclasses.replace(current, **changes)
    return dataclasses.replace(base, **top) if base is not None else cls(**top)


def _dotted(spec: JobSpec) -> dict[str, Any]:
    return {p.path: getattr(getattr(spec, p.group) if p.group else spec, p.field.name) for p in KEYS.values()}
