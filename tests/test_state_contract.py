"""The state contract of core's stateful parts (`batchd.core._state`): one definition of each state key,
the `Stateful` / `ClockedStateful` protocols every part meets, and `check_state`'s refusals.

The save/load round trips themselves are in test_roundtrip.py; this file pins down the contract they share.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from batchd.core import (
    STATE_VERSION,
    BlockLayout,
    BlockView,
    Coordinator,
    Delivery,
    JobSpec,
    Liveness,
    PolicySpec,
    RankState,
    Remainder,
    Stateful,
    StepLedger,
    ViewSource,
    check_state,
)
from batchd.testing import ClockedStateful

CORE = Path(__file__).resolve().parents[1] / "core"


def test_each_state_key_is_defined_once_in_the_state_module():
    where: dict[str, list[str]] = {}
    for path in sorted(CORE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name) and name.id.startswith("K_"):
                            where.setdefault(name.id, []).append(path.name)
    assert where, "no state key found: the scan is broken"
    assert {k: v for k, v in where.items() if v != ["_state.py"]} == {}


def _parts():
    spec = JobSpec(world_size=2, token_budget=64, policy=PolicySpec(name="local", window=512, depth=8))
    return [
        Coordinator(spec),
        RankState(spec, rank=0),
        ViewSource(10, rank=0, world_size=2),
        BlockView(BlockLayout([5, 5], [50, 50]), rank=1, world_size=2),
        ViewSource(10, rank=1, world_size=2, remainder=Remainder(0, 3, 2, 1, {4, 7})),
        StepLedger(),
    ], [
        Delivery(rank=0, epochs=1, depth=4, grace_s=1.0, trainer_timeout_s=1.0, now=0.0),
        Liveness(world_size=2, lease_s=1.0, startup_timeout_s=1.0, now=0.0),
    ]


def test_every_stateful_part_meets_its_protocol():
    plain, clocked = _parts()
    for part in plain:
        assert isinstance(part, Stateful), type(part).__name__
        assert list(inspect.signature(part.load_state_dict).parameters) == ["state"]
        part.load_state_dict(part.state_dict())
    for part in clocked:
        assert isinstance(part, ClockedStateful), type(part).__name__
        assert list(inspect.signature(part.load_state_dict).parameters) == ["state", "now"]
        part.load_state_dict(part.state_dict(), 0.0)


def test_a_versioned_state_carries_the_current_version():
    plain, _ = _parts()
    assert {part.state_dict()["version"] for part in plain} == {STATE_VERSION}


def test_check_state_names_the_version_and_every_differing_field():
    with pytest.raises(ValueError, match=r"X state has version 0; this build reads version 1"):
        check_state({"version": 0}, {}, "X")
    with pytest.raises(ValueError, match=r"seed: saved 1, current 2; epoch: saved 0, current 3"):
        check_state({"version": 1, "seed": 1, "epoch": 0, "rank": 0}, {"seed": 2, "epoch": 3, "rank": 0}, "X")
    check_state({"version": 1, "seed": 2}, {"seed": 2}, "X")


def test_a_state_of_another_configuration_is_refused():
    a = ViewSource(10, rank=0, world_size=2, seed=1)
    b = ViewSource(10, rank=0, world_size=2, seed=2)
    with pytest.raises(
        ValueError, match=r"ViewSource\(rank=0\) state does not match .*seed: saved 1, current 2"
    ):
        b.load_state_dict(a.state_dict())
