"""`batchd bench`: a small real side-by-side run (gloo DDP trainers, real rank services, the real ODB
0.1.2 package when installed) through `python -m batchd.bench --json`, plus its argument checks.

The run uses a short-length workload written here (48 samples of 16..300 tokens, L=600) so the four
systems finish in well under a minute on two cores; what it checks is the bench's contract: the JSON
schema, every system trained on exactly the same ids once, padding efficiencies in (0, 1], the
speedup ratios, the progress lines, and non-empty PNGs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from batchd import bench

NUM = 48


def _workload(tmp_path: Path, n: int) -> Path:
    rng = np.random.default_rng(3)
    lengths = np.concatenate([rng.integers(16, 80, n - n // 4), rng.integers(150, 300, n // 4)])
    rng.shuffle(lengths)
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(map(str, lengths.tolist())) + "\n")
    return path


@pytest.mark.slow
@pytest.mark.beside
def test_bench_at_equal_update_semantics_counts_every_systems_updates(tmp_path):
    """`--accumulate K` (fixed: one update per K steps) against `--tokens-per-update auto` (batchd:
    one per G = fixed's mean global loss tokens per update): the JSON reports each system's updates,
    fixed's exactly ceil(steps / K) per rank, batchd's about fixed's count (the cumulative rule)."""
    workload = _workload(tmp_path, NUM + 8)
    k = 3
    proc = subprocess.run(
        [sys.executable, "-m", "batchd.bench", "--json", "--workload", str(workload)]
        + ["--num-samples", str(NUM), "--heldout", "8", "--token-budget", "600", "--window", "16"]
        + ["--systems", "fixed,batchd-balanced", "--accumulate", str(k), "--tokens-per-update", "auto"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = json.loads(proc.stdout)
    fixed, bd = s["systems"]["fixed"], s["systems"]["batchd-balanced"]
    assert s["accumulate"] == k and s["tokens_per_update"] > 0
    assert fixed["updates"] == -(-fixed["steps"] // k)
    assert bd["steps"] > bd["updates"] >= 1  # updates of several steps
    assert abs(bd["updates"] - fixed["updates"]) <= 1
    for r in (fixed, bd):
        assert (r["samples"], r["missing"], r["duplicates"]) == (NUM, 0, 0)
        assert r["update_tokens_min"] <= r["update_tokens_mean"] <= r["update_tokens_max"]
        assert r["tokens_curve"][-1] == r["real_tokens"] and np.isfinite(r["heldout_loss"])
        assert 0 < r["update_length_cv"] < 2  # the updates' composition spread, from their cut points
        check = r["cost_check"]  # the planned cost against each rank's measured compute
        assert check["steps"] > 0 and check["planned_imbalance"] >= 1 and check["measured_imbalance"] >= 1


@pytest.mark.slow
@pytest.mark.beside
def test_bench_runs_all_systems_on_the_same_samples(tmp_path):
    workload = _workload(tmp_path, NUM + 8)
    out = tmp_path / "out"
    text = [s for s in bench.SYSTEMS if s != "batchd-2phase"]  # a text workload: no vision phase
    systems = text if bench.odb_available() is None else ["fixed", "batchd-odb", "batchd-balanced"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "batchd.bench",
            "--json",
            "--workload",
            str(workload),
            "--num-samples",
            str(NUM),
            "--heldout",
            "8",
            "--token-budget",
            "600",
            "--window",
            "16",
            "--depth",
            "4",
            "--epochs",
            "2",
            "--systems",
            ",".join(systems),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])

    assert list(s["systems"]) == systems
    assert s["num_samples"] == NUM and s["world_size"] == 2 and s["token_budget"] == 600 and s["epochs"] == 2
    assert s["fixed_batch_size"] == 600 // s["longest"]
    for name, r in s["systems"].items():
        assert f"[bench] {name}:" in proc.stderr
        for key, kind in (
            ("wall_s", float),
            ("samples", int),
            ("steps", int),
            ("padding_efficiency", float),
            ("final_loss", float),
        ):
            assert isinstance(r[key], kind), (name, key, r[key])
        # exactly the same ids, each once per epoch: all of 0..NUM-1 present twice, none more, nothing else
        assert (r["samples"], r["missing"], r["duplicates"], r["unexpected"]) == (2 * NUM, 0, 0, 0), (name, r)
        assert 0 < r["padding_efficiency"] <= 1, (name, r["padding_efficiency"])
        assert r["wall_s"] > 0 and r["steps"] == len(r["loss_curve"]) == len(r["step_times"]) > 0
        assert r["step_times"] == sorted(r["step_times"]) and r["step_times"][-1] == pytest.approx(
            r["wall_s"]
        )
        assert np.isfinite(r["final_loss"]) and 0 < r["final_loss"] < 10
        assert r["heldout_samples"] == 8 and np.isfinite(r["heldout_loss"])
        evals = r["heldout_by_epoch"]  # after each epoch, on the clock of the steps (paused while evaluating)
        assert [e["epoch"] for e in evals] == [0, 1] and evals[-1]["loss"] == r["heldout_loss"]
        assert 0 < evals[0]["t"] < evals[1]["t"] and r["wall_s"] <= evals[1]["t"] < r["wall_s"] + 10
        assert r["speedup_vs_fixed"] == pytest.approx(s["systems"]["fixed"]["wall_s"] / r["wall_s"])
    assert s["systems"]["fixed"]["steps"] == 2 * -(-NUM // 2 // s["fixed_batch_size"])
    bd = s["systems"]["batchd-balanced"]
    assert bd["steps_per_rank"][0] == bd["steps_per_rank"][1]  # batchd aligns the ranks' step counts
    if "odb-0.1.2" in systems:
        assert s["systems"]["batchd-odb"]["speedup_vs_odb-0.1.2"] == pytest.approx(
            s["systems"]["odb-0.1.2"]["wall_s"] / s["systems"]["batchd-odb"]["wall_s"]
        )

    names = {Path(p).name for p in s["plots"]}
    assert names == {
        "bench_loss_vs_step.png",
        "bench_loss_vs_time.png",
        "bench_loss_vs_tokens.png",
        "bench_wall_time.png",
    }
    for p in s["plots"]:
        data = Path(p).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, p
    assert json.loads((out / "bench.json").read_text())["systems"].keys() == s["systems"].keys()


def test_bench_help_and_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    for flag in (
        "--workload",
        "--num-samples",
        "--world-size",
        "--token-budget",
        "--systems",
        "--device",
        "--model",
        "--out",
        "--json",
        "--seed",
        "--window",
    ):
        assert flag in help_text, flag

    workload = _workload(tmp_path, 16)
    with pytest.raises(ValueError, match="systems"):
        bench.parse_systems("fixed,nope")
    with pytest.raises(ValueError, match="systems"):
        bench.parse_systems("fixed,fixed")
    with pytest.raises(ValueError, match="num_samples"):
        bench.run_bench(workload=workload, num_samples=17)
    with pytest.raises(ValueError, match="window"):
        bench.run_bench(workload=workload, num_samples=8, window=0)
    with pytest.raises(ValueError, match="model"):
        bench.run_bench(workload=workload, num_samples=8, model="gpt5")
    with pytest.raises(ValueError, match="device"):
        bench.run_bench(workload=workload, num_samples=8, device="tpu")
    with pytest.raises(ValueError, match="workload"):
        bench.run_bench(workload=tmp_path / "missing.txt", num_samples=8)
    assert bench.main(["--workload", str(workload), "--num-samples", "99"]) == 2
    assert "num_samples=99" in capsys.readouterr().err


def test_odb_missing_is_skipped_with_a_message(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "odb_available", lambda: "online-dynamic-batching is not installed")
    lines: list[str] = []
    s = bench.run_bench(
        workload=_workload(tmp_path, 16),
        num_samples=8,
        systems=["odb-0.1.2"],
        out=tmp_path / "o",
        progress=lines.append,
    )
    assert s["systems"] == {"odb-0.1.2": {"skipped": "online-dynamic-batching is not installed"}}
    assert lines == ["[bench] odb-0.1.2: skipped: online-dynamic-batching is not installed"]
    assert s["plots"] == [] and (tmp_path / "o" / "bench.json").exists()


def test_learning_rate_rule_is_one_rule_for_every_system():
    from batchd.testing import step_lr

    assert step_lr(1e-3, 400, 100) == pytest.approx(2e-3)  # sqrt: 4x the tokens, 2x the lr
    assert step_lr(1e-3, 400, 100, power=1.0) == pytest.approx(4e-3)  # linear
    assert step_lr(1e-3, 400, None) == 1e-3 and step_lr(1e-3, 0, 100) == 1e-3  # off; IDLE step


@pytest.mark.slow
@pytest.mark.beside
def test_bench_batchd_systems_with_trainers_that_take_5s_per_step(tmp_path):
    """`batchd bench` once failed at the end of every batchd system when the machine was busy (the
    coordinator left before the trainers' last steps); with 5 s steps it ends cleanly."""
    workload = _workload(tmp_path, 16)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "batchd.bench",
            "--json",
            "--workload",
            str(workload),
            "--num-samples",
            "16",
            "--heldout",
            "0",
            "--token-budget",
            "600",
            "--window",
            "8",
            "--depth",
            "2",
            "--step-time",
            "5",
            "--systems",
            "batchd-odb",
        ],
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "BATCHD_PROGRESS_S": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    systems = json.loads(proc.stdout.strip().splitlines()[-1])["systems"]
    for name in ("batchd-odb",):
        s = systems[name]
        assert s["samples"] == 16 and not s.get("missing") and not s.get("duplicates"), (name, s)
        assert s["steps"] >= 2 and s["wall_s"] >= 5 * (s["steps"] - 1), (name, s)
    # off a terminal, a progress line every 1 s: 1310 tokens do not fit one step of 2 ranks x 600, and
    # steps take >= 5 s, so a line falls between the first two; then the end
    assert re.search(r"\[bench\] batchd-odb: \d+/16 samples \(\d+%\), .*ETA", proc.stderr), proc.stderr[
        -4000:
    ]
    assert re.search(r"\[bench\] batchd-odb: 16/16 samples \(100%\), \d+ steps, done in", proc.stderr), (
        proc.stderr[-4000:]
    )


@pytest.mark.slow
@pytest.mark.beside
def test_bench_trains_vision_and_audio_with_one_phase_and_every_phase_alike(tmp_path):
    """`batchd bench` on a workload with images and audio clips (the first 40 samples of audio-visual.csv):
    the tiny MLLM gets its audio encoder, every system trains every sample once, each reports rank 0's
    vision-tower and audio-encoder shares, and balancing every encoder phase (batchd-2phase: images and
    clips encoded where the plans put them, returned by the exchanges) trains the same steps to the same
    loss as one phase (every rank encoding its own)."""
    from batchd.core import format_workload, parse_workload

    source = Path(bench.__file__).resolve().parents[1] / "benchmarks" / "workloads" / "audio-visual.csv"
    samples = parse_workload(source.read_text().splitlines())[:40]
    assert any(s.audio for s in samples) and any(s.images for s in samples)
    workload = tmp_path / "av.csv"
    workload.write_text(format_workload(samples))
    argv = [
        sys.executable,
        "-m",
        "batchd.bench",
        "--json",
        "--workload",
        str(workload),
        "--num-samples",
        "32",
    ]
    argv += ["--heldout", "0", "--token-budget", "4096", "--systems", "fixed,batchd-balanced,batchd-2phase"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, r in s["systems"].items():
        assert (r["samples"], r["missing"], r["duplicates"]) == (32, 0, 0), (name, r)
        assert r["audio_share"] > 0 and r["vision_share"] > 0, (name, r)
        assert f"audio encoder {100 * r['audio_share']:.1f}%" in proc.stderr
    one, every = s["systems"]["batchd-balanced"], s["systems"]["batchd-2phase"]
    assert one["steps"] == every["steps"]
    np.testing.assert_allclose(every["loss_curve"], one["loss_curve"], rtol=1e-4)
