"""A new user's first day (issue 19): the CLI behaves as the README says, in the small things too.

Real commands in subprocesses where the behaviour is the process's (exit status, what reaches the
terminal); in-process where it is a function's (the bench's argument checks).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchd import bench
from batchd.cli import build_parser
from batchd.core import RESULT_FIELDS

REPO = Path(__file__).resolve().parents[1]


def _lengths(path: Path, n: int = 300) -> Path:
    path.write_text("\n".join(str(16 + 37 * i % 900) for i in range(n)) + "\n")
    return path


def test_a_closed_pipe_ends_simulate_quietly(tmp_path):
    """`batchd simulate ... | head -1`: the reader goes away; no `Broken pipe` error, the SIGPIPE status."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen(
        [
            "batchd",
            "simulate",
            "--lengths",
            str(_lengths(tmp_path / "l.txt")),
            "--world-size",
            "2",
            "--token-budget",
            "2048",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    proc.stdout.close()  # before it writes a byte: every write it makes meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert err == "", err


def test_bench_without_systems_gets_past_its_checks(tmp_path, monkeypatch):
    """The README's `batchd bench` gives no --systems: the defaults must pass the argument checks (they
    raised unconditionally). The run itself is stubbed out here; test_readme_commands runs it for real."""
    ran = []

    def run_system(system, *args, **kwargs):
        ran.append(system)
        raise KeyboardInterrupt  # stop after the checks, before any process starts

    monkeypatch.setattr(bench, "run_system", run_system)
    with pytest.raises(KeyboardInterrupt):
        bench.run_bench(workload=_lengths(tmp_path / "l.txt", 64), num_samples=16, out=tmp_path / "o")
    assert ran == ["fixed"]
    with pytest.raises(ValueError, match="fewer than num_samples=65"):
        bench.run_bench(workload=tmp_path / "l.txt", num_samples=65)


def _simulate_help() -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return sub.choices["simulate"].format_help()


def test_simulate_help_explains_every_output_field(tmp_path):
    """Every key `batchd simulate` prints, text and multimodal (images, audio), two-phase, with a topology and
    resized, is in RESULT_FIELDS, and `batchd simulate --help` lists each with its meaning."""
    from batchd.core import JobSpec, Phases, PolicySpec, parse_workload, simulate

    text = simulate(
        [16 + 37 * i % 900 for i in range(200)],
        JobSpec(world_size=2, token_budget=2048, policy=PolicySpec(name="local", window=512, depth=8)),
    )
    workload = (REPO / "benchmarks" / "workloads" / "bimodal.csv").read_text().splitlines()[:201]
    mm = simulate(
        parse_workload(workload),
        JobSpec(
            world_size=4,
            token_budget=8192,
            policy=PolicySpec(name="balanced", window=512, depth=8),
            phases=Phases(count=2),
        ),
        local_ranks=2,
    )
    resized = simulate(
        [16 + 37 * i % 900 for i in range(200)],
        JobSpec(world_size=2, token_budget=2048, policy=PolicySpec(name="local", window=512, depth=8)),
        resize=[(3, 3)],
    )
    audio = (REPO / "benchmarks" / "workloads" / "audio-visual.csv").read_text().splitlines()[:201]
    heard = simulate(
        parse_workload(audio),
        JobSpec(
            world_size=4,
            token_budget=8192,
            policy=PolicySpec(name="balanced", window=512, depth=8),
            phases=Phases(count=2),
        ),
    )
    assert heard["audio_imbalance_two"] <= heard["audio_imbalance_single"], heard
    keys = set(text) | set(mm) | set(resized) | set(heard)
    assert keys - set(RESULT_FIELDS) == set(), keys - set(RESULT_FIELDS)
    assert set(RESULT_FIELDS) - keys == set(), "RESULT_FIELDS describes keys simulate never prints"
    help_text = " ".join(_simulate_help().split())
    for key, meaning in RESULT_FIELDS.items():
        assert f"{key} {' '.join(meaning.split())}" in help_text, key


def test_the_demos_own_bad_records_never_fail_a_small_demo():
    """The generated dataset has at least one bad record of each kind, however small: the demo's default
    max_bad_fraction leaves room for all of them on one rank's view, and is the README's 0.1 otherwise."""
    from batchd.demo import generated_bad_fraction
    from batchd.testing import demo_bad_ids

    for n, world in ((16, 2), (64, 2), (96, 2), (128, 4), (1024, 2)):
        bad = len(demo_bad_ids(n, 0))
        f = generated_bad_fraction(bad, n, world)
        assert f * (n / world) >= bad and 0.1 <= f <= 1.0, (n, world, bad, f)
    assert generated_bad_fraction(len(demo_bad_ids(1024, 0)), 1024, 2) == 0.1
