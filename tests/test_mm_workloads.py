"""Multimodal workloads: the CSV format's parser, the simulator's per-phase metrics, `batchd simulate
--workload ... --phases 2`, and the committed workloads of benchmarks/workloads/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchd import read_workload
from batchd.cli import main
from batchd.core import (
    JobSpec,
    Phases,
    PolicySpec,
    Sample,
    Simulator,
    format_workload,
    imbalance,
    parse_lengths,
    parse_workload,
    simulate,
)
from batchd.testing import WORKLOAD_HEADER, phase_loads, single_phase

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = REPO / "benchmarks" / "workloads"
HEADER = ",".join(WORKLOAD_HEADER)


def test_parse_workload_reads_samples_in_order():
    samples = parse_workload([HEADER + "\n", "120,576,576\n", "300,,\n", "10,1024 64,256 16\n"])
    assert [s.id for s in samples] == [0, 1, 2]
    assert [s.length for s in samples] == [696, 300, 282]
    assert [s.images for s in samples] == [((576, 576),), (), ((1024, 256), (64, 16))]
    assert samples[2].modality_tokens == (("text", 10), ("vision", 272))
    assert parse_workload([HEADER]) == []
    assert parse_workload([" text_tokens , image_patches , image_tokens ", "0,4,1"])[0].length == 1


@pytest.mark.parametrize(
    "lines, match",
    [
        ([], r"w\.csv:1: the header must be"),
        (["length\n", "5\n"], r"w\.csv:1: the header must be"),
        ([HEADER, "5,1,1", ""], r"w\.csv:3: empty line"),
        ([HEADER, "5,1"], r"w\.csv:2: expected 3 comma-separated columns"),
        ([HEADER, "x,1,1"], r"w\.csv:2: text_tokens must be an integer, got 'x'"),
        ([HEADER, "-1,1,1"], r"w\.csv:2: text_tokens must be >= 0"),
        ([HEADER, "5,1 a,1 1"], r"w\.csv:2: image_patches must be space-separated integers, got 'a'"),
        ([HEADER, "5,0,1"], r"w\.csv:2: every image_patches entry must be >= 1"),
        ([HEADER, "5,1,0"], r"w\.csv:2: every image_tokens entry must be >= 1"),
        (
            [HEADER, "5,1 2,1"],
            r"w\.csv:2: image_patches and image_tokens must list one entry per image, got 2 and 1",
        ),
        ([HEADER, "0,,"], r"w\.csv:2: a sample needs at least one token"),
    ],
)
def test_parse_workload_errors_name_the_line(lines, match):
    with pytest.raises(ValueError, match=match):
        parse_workload(lines, "w.csv")


def mm_samples(n: int) -> list[Sample]:
    out = []
    for i in range(n):
        images = tuple((64 + (i * 37 * (k + 1)) % 3000, 16 + (i * 11 + k) % 700) for k in range(i % 4))
        text = 20 + (i * 53) % 900
        out.append(Sample(i, text + sum(t for _, t in images), images=images))
    return out


def test_simulator_reports_per_phase_balance_by_hand():
    samples = mm_samples(400)
    spec = JobSpec(world_size=4, token_budget=4096, policy=PolicySpec(name="balanced", window=32, depth=4))
    vision = spec.vision_cost()
    llm, single, bound, steps = [], [], [], 0

    def check(step):
        nonlocal steps
        steps += 1
        llm.append(imbalance([s.info.cost for s in step]))
        loads = phase_loads(single_phase([s.samples for s in step]), vision)
        if sum(loads):
            single.append(imbalance(loads))
            mean = sum(loads) / len(loads)
            bound.append(
                max(mean, max(vision.image(p) for s in step for x in s.samples for p, _ in x.images)) / mean
            )

    one = simulate(samples, spec, on_step=check, local_ranks=2)
    assert one["phases"] == 1 and one["missing"] == 0 and one["duplicates"] == 0
    assert one["images"] == sum(len(s.images) for s in samples)
    assert one["llm_imbalance"] == pytest.approx(sum(x for x in llm if x) / len([x for x in llm if x]))
    assert one["vision_imbalance_single"] == pytest.approx(sum(single) / len(single))
    assert one["vision_bound"] == pytest.approx(sum(bound) / len(bound))
    assert one["vision_steps"] == len(single) and one["vision_imbalance_two"] is None
    assert one["exchanged_intra_node_images_per_step"] == 0 and one["vision_plan_rounds"] == 0
    two = simulate(samples, spec.replace(phases=2), local_ranks=2)
    # the LLM plan does not depend on phases: same steps, same LLM balance, same single-phase vision
    for key in (
        "steps",
        "llm_imbalance",
        "vision_imbalance_single",
        "vision_bound",
        "images",
        "compute_vs_limit",
    ):
        assert two[key] == one[key], key
    assert 1.0 <= two["vision_bound"] <= two["vision_bound_pigeonhole"] <= two["vision_imbalance_two"]
    assert two["vision_imbalance_two"] < one["vision_imbalance_single"]
    moved = sum(two[f"exchanged_{k}_per_step"] for k in ("intra_node_images", "cross_node_images"))
    assert moved > 0 and two["vision_plan_rounds"] == two["rounds"] and two["vision_plan_per_round_s"] > 0


def test_the_vision_plan_uses_the_simulators_topology_without_changing_the_llm_plan():
    samples = mm_samples(300)
    spec = JobSpec(
        world_size=8,
        token_budget=4096,
        policy=PolicySpec(name="balanced", window=32, depth=4),
        phases=Phases(count=2),
    )
    flat = Simulator(samples, spec)
    nodes = Simulator(samples, spec, local_ranks=4)
    assert flat.coordinator.vision_nodes is None and nodes.coordinator.vision_nodes == [0] * 4 + [1] * 4
    # nodes="local" (the default) hands the topology to the LLM plan; under padded cost its rounds stay
    # node-blind, so the plans below are the same
    assert nodes.coordinator.nodes == [0] * 4 + [1] * 4
    assert Simulator(samples, spec.replace(nodes="blind"), local_ranks=4).coordinator.nodes is None
    for a, b in zip(flat, nodes, strict=True):
        assert [s.samples for s in a] == [s.samples for s in b]


def test_text_only_results_keep_their_keys():
    result = simulate(
        [5, 9, 30, 2] * 10,
        JobSpec(world_size=2, token_budget=64, policy=PolicySpec(name="local", window=512, depth=8)),
    )
    assert "vision_imbalance_single" not in result and "llm_imbalance" not in result


def test_simulator_rejects_samples_out_of_order():
    spec = JobSpec(world_size=2, token_budget=64, policy=PolicySpec(name="local", window=512, depth=8))
    with pytest.raises(ValueError, match=r"lengths\[1\] must be a Sample with id 1"):
        Simulator([Sample(0, 5), Sample(2, 5)], spec)
    with pytest.raises(ValueError, match=r"lengths\[1\] must be a Sample with id 1"):
        Simulator([Sample(0, 5), 7], spec)


def write_workload(tmp_path: Path, n: int = 200) -> Path:
    path = tmp_path / "mm.csv"
    rows = [HEADER] + [
        f"{s.modality_tokens[0][1] if s.modality_tokens else s.length - sum(t for _, t in s.images)},"
        f"{' '.join(str(p) for p, _ in s.images)},{' '.join(str(t) for _, t in s.images)}"
        for s in mm_samples(n)
    ]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_cli_simulate_prints_per_phase_balance(tmp_path, capsys):
    path = write_workload(tmp_path)
    assert [s.images for s in read_workload(path)] == [s.images for s in mm_samples(200)]
    args = [
        "simulate",
        "--workload",
        str(path),
        "--world-size",
        "4",
        "--token-budget",
        "4096",
        "--policy",
        "balanced",
        "--window",
        "32",
        "--local-ranks",
        "2",
        "--quiet",
    ]
    assert main([*args, "--phases", "2"]) == 0
    out = capsys.readouterr().out
    assert "per-phase balance" in out and "embeddings exchanged per step: intra-node" in out
    vision = next(line for line in out.splitlines() if line.strip().startswith("vision ")).split()
    single, two = float(vision[1]), float(vision[2])
    assert two < single
    assert main([*args, "--phases", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["phases"] == 2 and result["vision_imbalance_two"] == pytest.approx(two, abs=1e-4)
    assert main([*args, "--json"]) == 0  # one phase: single-phase only, nothing exchanged
    one = json.loads(capsys.readouterr().out)
    assert one["phases"] == 1 and one["vision_imbalance_two"] is None
    assert one["vision_imbalance_single"] == pytest.approx(single, abs=1e-4)


def test_cli_simulate_phases_flag_and_errors(tmp_path, capsys):
    path = write_workload(tmp_path, 40)
    base = ["simulate", "--workload", str(path), "--world-size", "2", "--token-budget", "4096", "--quiet"]
    assert main([*base, "--policy", "local", "--phases", "2"]) == 2  # phases=2 needs balanced
    assert "phases=2 needs policy='balanced'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--phases", "3"])
    assert "invalid choice: 3" in capsys.readouterr().err
    bad = tmp_path / "bad.csv"
    bad.write_text(HEADER + "\n5,1 2,1\n")
    assert main(["simulate", "--workload", str(bad), "--world-size", "2", "--token-budget", "64"]) == 2
    assert "bad.csv:2: image_patches and image_tokens" in capsys.readouterr().err


def test_cli_simulate_reads_length_files_as_before(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("5\n9\n30\n2\n" * 10)
    for flag in ("--lengths", "--workload"):
        assert (
            main(["simulate", flag, str(lengths), "--world-size", "2", "--token-budget", "64", "--json"]) == 0
        )
        result = json.loads(capsys.readouterr().out)
        assert result["samples"] == 40 and "vision_imbalance_single" not in result


@pytest.mark.parametrize(
    "name", ["llava-like", "sharegpt4o-like", "bimodal", "document-like", "mixed", "audio-visual"]
)
def test_committed_workloads_parse_and_match_their_generator(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_mm", REPO / "benchmarks" / "make_mm_workloads.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = WORKLOADS / f"{name}.csv"
    assert path.read_text() == module.render(module.WORKLOADS[name]()), (
        "rerun benchmarks/make_mm_workloads.py"
    )
    samples = read_workload(path)
    assert 2000 <= len(samples) <= 10000 and path.stat().st_size < 200_000
    assert all(p >= 1 and t >= 1 for s in samples for p, t in s.images)
    if name == "llava-like":
        assert {s.images for s in samples} == {(), ((576, 576),)}
        assert 0.05 < sum(not s.images for s in samples) / len(samples) < 0.15
    if name == "sharegpt4o-like":
        assert all(t == p // 4 and p <= 4096 for s in samples for p, t in s.images)
        assert max(len(s.images) for s in samples) == 4
    if name == "bimodal":
        counts = {len(s.images) for s in samples}
        assert 1 in counts and max(counts) >= 12 and not counts & {2, 3}
    if name == "document-like":
        assert {len(s.images) for s in samples} == set(range(1, 9))
        assert sum(t >= 900 for s in samples for _, t in s.images) > 0.8 * sum(len(s.images) for s in samples)
    if name == "mixed":
        counts = [len(s.images) for s in samples]
        assert 0.2 < counts.count(0) / len(counts) < 0.3 and max(counts) == 32


def test_parse_lengths_is_unchanged():
    assert parse_lengths(["3", "4"]) == [3, 4]


def test_format_workload_is_the_inverse_of_parse_workload():
    samples = parse_workload(
        Path(REPO / "benchmarks" / "workloads" / "bimodal.csv").read_text().splitlines()
    )[:300]
    text = format_workload(samples)
    assert parse_workload(text.splitlines()) == samples
    assert text.splitlines()[0] == "text_tokens,image_patches,image_tokens"
