"""`JobSpec`'s shape: a few top-level fields and four parts, one default (balanced) that every command
takes from the spec, flags / config tables / the wire derived from the leaves, old flat configs migrated."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchd.cli import build_parser, main
from batchd.config import ConfigError, load_config
from batchd.core import KEYS, CostModel, JobSpec, Phases, PolicySpec, Updates, simulate
from batchd.launch import spec_argv
from batchd.proto.wire import spec_from_pb, spec_to_pb

DEFAULT = JobSpec(world_size=2, token_budget=64)


def test_at_most_twelve_top_level_fields_and_the_default_is_balanced():
    assert len(dataclasses.fields(JobSpec)) <= 12
    assert DEFAULT.policy == PolicySpec() and DEFAULT.policy.name == "balanced"
    assert (DEFAULT.policy.window, DEFAULT.policy.depth, DEFAULT.policy.nodes) == (128, 4, "local")
    assert DEFAULT.cost == CostModel() and DEFAULT.phases == Phases() and DEFAULT.updates == Updates()
    assert DEFAULT.shuffle is True


def test_every_leaf_has_one_key_and_the_known_flags_stay():
    assert len(KEYS) == len({(k.group, k.field.name) for k in KEYS.values()})
    for key in ("policy", "window", "depth", "cost", "quadratic", "phases", "phase_exact_nodes", "nodes"):
        assert key in KEYS
    assert KEYS["window"].path == "policy.window" and KEYS["phases"].path == "phases.count"
    assert not {"node_aware", "node_local"} & set(KEYS)
    assert JobSpec.from_keys(**DEFAULT.keys()) == DEFAULT
    with pytest.raises(ValueError, match="node_aware"):
        JobSpec.from_keys(world_size=2, token_budget=64, node_aware=True)


def test_a_knob_of_another_policy_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"policy.batch_size .* fixed / sorted.*policy='balanced'"):
        PolicySpec(batch_size=16)
    with pytest.raises(ValueError, match=r"policy.nodes .*balanced.*policy='local'"):
        DEFAULT.replace(policy="local", nodes="aware")
    with pytest.raises(ValueError, match=r"policy.refine"):
        PolicySpec(name="odb", refine=False)
    assert PolicySpec(name="sorted", batch_size=16).build().batch_size == 16
    with pytest.raises(ValueError, match=r"policy.window must be >= 1, got policy.window=0"):
        DEFAULT.replace(window=0)
    with pytest.raises(ValueError, match=r"phases.exact_nodes needs phases=2"):
        Phases(exact_nodes=5)


def test_a_mismatch_names_the_nested_fields():
    other = DEFAULT.replace(window=64, nodes="blind", cost="packed")
    assert DEFAULT.diff(other) == {
        "policy.window": (128, 64),
        "policy.nodes": ("local", "blind"),
        "cost.name": ("padded", "packed"),
    }


def _job_keys(args) -> dict:
    return {k: getattr(args, k) for k in KEYS if getattr(args, k, None) is not None}


def test_the_service_flags_default_to_the_spec_through_the_real_parser():
    args = build_parser().parse_args(["coordinator", "--world-size", "2", "--token-budget", "64"])
    assert _job_keys(args) == {"world_size": 2, "token_budget": 64}  # the rest: not given
    given = {f"job.{k}": v for k, v in _job_keys(args).items()}
    assert load_config(None, given, check_files=False).job == DEFAULT


def test_demo_and_bench_flags_default_to_the_spec():
    demo = build_parser().parse_args(["demo"])
    for key in ("policy", "window", "depth", "seed", "deterministic"):
        assert getattr(demo, key) == DEFAULT.keys()[key], key
    bench = build_parser().parse_args(["bench"])
    for key in ("window", "depth", "seed", "epochs", "deterministic"):
        assert getattr(bench, key) == DEFAULT.keys()[key], key


def test_simulate_runs_the_spec_default(tmp_path, capsys):
    lengths = [5 + (37 * i) % 60 for i in range(300)]
    path = tmp_path / "l.txt"
    path.write_text("\n".join(map(str, lengths)) + "\n")
    argv = ["simulate", "--lengths", str(path), "--world-size", "2", "--token-budget", "64", "--json"]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    want = simulate(lengths, DEFAULT)
    assert got["policy"] == "balanced" and got["window"] == 128
    drop = [k for k in want if "time" in k or k.endswith("_s") or "per_s" in k]
    assert {k: v for k, v in got.items() if k not in drop} == {k: v for k, v in want.items() if k not in drop}


def test_spec_argv_gives_back_the_spec_through_the_service_flags():
    spec = JobSpec.from_keys(
        world_size=4, token_budget=512, nodes="aware", window=32, cost="attention", quadratic=999, phases=2,
        tokens_per_update=4096, shuffle=False, quota=7,
    )  # fmt: skip
    args = build_parser().parse_args(["coordinator", *spec_argv(spec)])
    assert (
        load_config(None, {f"job.{k}": v for k, v in _job_keys(args).items()}, check_files=False).job == spec
    )


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_an_old_flat_config_migrates_with_one_warning_line_per_key(tmp_path, caplog):
    flat = _write(
        tmp_path / "flat.toml",
        '[job]\nworld_size = 2\ntoken_budget = 64\npolicy = "balanced"\nwindow = 32\nnode_aware = true\n'
        "phase_exact_nodes = 0\ntokens_per_update = 512\n",
    )
    nested = _write(
        tmp_path / "nested.toml",
        '[job]\nworld_size = 2\ntoken_budget = 64\n[job.policy]\nname = "balanced"\nwindow = 32\n'
        'nodes = "aware"\n[job.phases]\nexact_nodes = 0\n[job.updates]\ntokens_per_update = 512\n',
    )
    with caplog.at_level(logging.WARNING, logger="batchd.config"):
        old = load_config(flat, check_files=False).job
    assert old == load_config(nested, check_files=False).job
    assert old.policy.nodes == "aware" and old.updates.tokens_per_update == 512
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 5 and all("\n" not in line for line in lines)
    for new in ("job.policy.name", "job.policy.window", "job.policy.nodes", "job.phases.exact_nodes"):
        assert any(new in line for line in lines), (new, lines)
    assert any("job.node_local" in line and "job.policy.nodes" in line for line in lines)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="batchd.config"):
        load_config(nested, check_files=False)
    assert not caplog.records  # the nested form loads silently


def test_nested_config_errors_name_the_key(tmp_path):
    bad = _write(tmp_path / "a.toml", "[job]\nworld_size = 2\ntoken_budget = 64\n[job.policy]\nwindw = 3\n")
    with pytest.raises(ConfigError, match=r"unknown key job.policy.windw; \[job.policy\] takes"):
        load_config(bad, check_files=False)
    bad = _write(tmp_path / "b.toml", "[job]\nworld_size = 2\ntoken_budget = 64\n[job.policy]\ndepth = 0\n")
    with pytest.raises(ConfigError, match=r"b.toml: job.policy.depth must be >= 1, got policy.depth=0"):
        load_config(bad, check_files=False)
    both = _write(
        tmp_path / "c.toml",
        "[job]\nworld_size = 2\ntoken_budget = 64\nwindow = 3\n[job.policy]\nwindow = 4\n",
    )
    with pytest.raises(ConfigError, match=r"job.window is set twice.*job.policy.window"):
        load_config(both, check_files=False)


_SPECS = st.builds(
    JobSpec,
    world_size=st.integers(1, 64),
    token_budget=st.integers(1, 1 << 20),
    quota=st.one_of(st.none(), st.integers(0, 1000)),
    epochs=st.integers(1, 5),
    seed=st.integers(0, 1 << 40),
    shuffle=st.booleans(),
    deterministic=st.booleans(),
    policy=st.builds(
        PolicySpec,
        window=st.integers(1, 4096),
        depth=st.integers(1, 64),
        max_wait=st.integers(1, 64),
        align=st.sampled_from(["min", "odb"]),
        over_budget=st.sampled_from(["singleton", "reject"]),
        collate=st.sampled_from(["padded", "packed"]),
        refine=st.booleans(),
        level_rows=st.booleans(),
        nodes=st.sampled_from(["local", "blind", "aware"]),
    ),
    cost=st.builds(CostModel, st.sampled_from(["padded", "packed", "attention"]), st.integers(1, 1 << 16)),
    phases=st.builds(
        Phases,
        count=st.just(2),
        vision_quadratic=st.integers(0, 1 << 16),
        audio_quadratic=st.integers(0, 1 << 16),
        exact_nodes=st.integers(0, 100),
    ),
    updates=st.builds(
        Updates,
        tokens_per_update=st.one_of(st.none(), st.integers(1, 1 << 40)),
        update_rule=st.sampled_from(["cumulative", "at_least"]),
    ),
)


@settings(max_examples=60, deadline=None)
@given(spec=_SPECS)
def test_the_wire_round_trip_is_lossless(spec):
    assert spec_from_pb(spec_to_pb(spec)) == spec
    fixed = spec.replace(policy=PolicySpec(name="fixed", batch_size=3), phases=Phases())
    assert spec_from_pb(spec_to_pb(fixed)) == fixed
    per_samples = spec.replace(updates=Updates(samples_per_update=9))
    assert spec_from_pb(spec_to_pb(per_samples)) == per_samples
