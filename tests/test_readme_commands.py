"""Every command the README shows, and every command a `--help` names, runs as written.

A broken default must not land again (`batchd bench` failed exactly as the README showed it). Three
layers:

- `test_every_readme_command_is_run_by_a_test`: every command line of the README's ```bash blocks and
  every inline `batchd ...` / `python -m batchd...` / `torchrun ...` span is listed in `RUN_BY`, with
  the test that runs it; that test must exist. A command added to the README without a test fails here.
- `test_readme_and_help_commands_parse`: each of those commands, and each command a `--help` text
  names, is parsed by the real argument parser, placeholders (FILE, N, L, ...) filled in: a renamed or
  removed flag fails here, in-process and fast.
- The commands no other test runs are run here as a user types them, through the real CLI, with a
  small sample count where a flag allows it: `batchd bench` (the default systems and workload),
  `batchd simulate`, the per-rank "Processes" block (coordinator, two `batchd rank`, two trainers), and
  the README's Python blocks (records files, a model's own processor; the training loops are imported).
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from _procs import free_block, processes_with_marker
from _readme_job import RECORDS

from batchd.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
COMMAND_START = ("batchd ", "python -m batchd", "torchrun ")


def readme_text() -> str:
    return README.read_text()


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def block_commands(block: str) -> list[str]:
    """The command lines of a bash block: comments cut, continuation lines joined, heredoc bodies skipped."""
    out, lines, heredoc = [], block.splitlines(), None
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if heredoc is not None:
            if line.strip() == heredoc:
                heredoc = None
            continue
        while line.rstrip().endswith("\\") and i < len(lines):
            line = line.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
        m = re.search(r"<<'?(\w+)'?", line)
        if m:
            heredoc = m.group(1)
        cmd = " ".join(_strip_comment(line).split())
        if cmd:
            out.append(cmd)
    return out


def _strip_comment(line: str) -> str:
    """The line without a trailing `# comment` (a '#' inside quotes is kept)."""
    quote = None
    for k, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1].isspace()):
            return line[:k]
    return line


def readme_commands(text: str | None = None) -> list[str]:
    """Every command the README shows: the bash blocks' command lines and the inline code spans that
    start like a command, without a trailing `&`, `> FILE` or `...`; in order, once each."""
    text = readme_text() if text is None else text
    found = [c for b in bash_blocks(text) for c in block_commands(b)]
    # inline spans that start like a command; not the messages the README quotes ("batchd CMD: error: ...")
    prose = re.sub(r"```.*?```", "", text, flags=re.S)  # spans may wrap a line; fenced blocks are not spans
    spans = [" ".join(m.split()) for m in re.findall(r"`([^`]+)`", prose)]
    found += [m for m in spans if m.startswith(COMMAND_START) and ": " not in m]
    out = []
    for cmd in found:
        cmd = " ".join(re.sub(r"\s*(&|>\s*\S+|\.\.\.)\s*$", "", cmd).split())
        if cmd not in out:
            out.append(cmd)
    return out


# Each README command and the test that runs it as a user would (file::function). Placeholders as the
# README writes them (FILE, PATH, K, G, r).
RUN_BY = {
    (
        "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install "
        "-e '.[dev,bench]'"
    ): "tests/test_readme_commands.py::test_install_line_is_what_ci_runs",
    "batchd demo": "tests/test_demo.py::test_demo_runs_through_the_ray_pipeline",
    "python -m pytest -q": "tests/test_readme_commands.py::test_install_line_is_what_ci_runs",
    "batchd config --example": "tests/test_readme_job.py::test_readme_real_job_runs_as_written",
    "python - <<'EOF'": "tests/test_readme_job.py::test_readme_real_job_runs_as_written",
    "batchd tokenizer tok.json": "tests/test_readme_job.py::test_readme_real_job_runs_as_written",
    "batchd config job.toml": "tests/test_readme_job.py::test_readme_real_job_runs_as_written",
    "batchd coordinator --config job.toml": "tests/test_readme_job.py::test_readme_real_job_runs_as_written",
    "batchd node --config job.toml --local-ranks 2 --node-rank 0": (
        "tests/test_readme_job.py::test_readme_real_job_runs_as_written"
    ),
    (
        "batchd torchrun --nproc-per-node 2 --max-restarts 3 -m batchd.train --node-agent 127.0.0.1:7100 "
        "--tokenizer tok.json --checkpoint ckpt"
    ): "tests/test_readme_job.py::test_readme_real_job_runs_as_written",
    "python -m batchd.train --checkpoint DIR --checkpoint-every N": (
        "tests/test_restart.py::test_torchrun_max_restarts_resume_every_crash_and_every_party_recovers"
    ),
    "batchd torchrun": (
        "tests/test_restart.py::test_ctrl_c_of_batchd_torchrun_ends_in_one_line_and_the_same_command_resumes"
    ),
    (
        "batchd coordinator --world-size 2 --token-budget 8192 --policy balanced --port 7000 "
        "--state-dir /tmp/batchd-coord"
    ): "tests/test_readme_commands.py::test_readme_processes_block_runs",
    "batchd rank --world-size 2 --token-budget 8192 --policy balanced --rank 0 --coordinator 127.0.0.1:7000 "
    "--dataset data.parquet --num-actors 2 --ray-address HEAD:6379 --quarantine bad.jsonl --state-dir "
    "/tmp/batchd --port 7100": "tests/test_readme_commands.py::test_readme_processes_block_runs",
    "batchd rank --dataset": "tests/test_readme_commands.py::test_readme_processes_block_runs",
    "batchd simulate --help": "tests/test_readme_commands.py::test_readme_and_help_commands_parse",
    "batchd simulate --deterministic": (
        "tests/test_deterministic.py::"
        "test_a_deterministic_job_makes_the_same_batches_whatever_the_speed_of_sources_and_trainers"
    ),
    "python -m batchd.train --base-port 7100 --tokenizer tok.json": (
        "tests/test_readme_commands.py::test_readme_processes_block_runs"
    ),
    "python -m batchd.train": "tests/test_readme_job.py::test_readme_real_job_runs_as_written",
    "python -m batchd.train --strategy fsdp2": (
        "tests/test_fsdp_deepspeed.py::test_batchd_train_strategy_runs_an_epoch"
    ),
    "python -m batchd.train --strategy deepspeed": (
        "tests/test_fsdp_deepspeed.py::test_batchd_train_strategy_runs_an_epoch"
    ),
    "python -m batchd.train --startup-timeout S": (
        "tests/test_trainer_start.py::"
        "test_a_trainer_pointed_at_nobody_says_whom_it_waits_for_then_exits_2_in_one_line"
    ),
    "batchd node": "tests/test_readme_job.py::test_readme_real_job_runs_as_written",
    "batchd node --local-ranks K --node-rank G": (
        "tests/test_readme_job.py::test_readme_real_job_runs_as_written"
    ),
    "batchd coordinator": "tests/test_readme_job.py::test_readme_real_job_runs_as_written",
    "batchd rank": "tests/test_readme_commands.py::test_readme_processes_block_runs",
    "batchd rank --rank r": "tests/test_readme_commands.py::test_readme_processes_block_runs",
    "torchrun --node-rank G": "tests/test_readme_job.py::test_readme_real_job_runs_as_written",
    "batchd node --node-rank G --advertise <its address> --ray-address <the cluster's Ray>": (
        "tests/test_node_cluster.py::test_node_agents_on_a_multi_node_ray_cluster_survive_an_agent_kill"
    ),
    "batchd coordinator --config job.toml --world-size 2 --state-dir /shared/batchd-coord --resize": (
        "tests/test_elastic.py::test_an_agent_killed_job_resumes_at_2_ranks_then_grows_to_3"
    ),
    "batchd node --config job.toml --world-size 2 --local-ranks 2 --node-rank 0 --state-dir /var/batchd": (
        "tests/test_elastic.py::test_an_agent_killed_job_resumes_at_2_ranks_then_grows_to_3"
    ),
    "torchrun --nproc-per-node 2 -m batchd.train --node-agent 127.0.0.1:7100 --checkpoint /shared/ckpt": (
        "tests/test_elastic.py::test_an_agent_killed_job_resumes_at_2_ranks_then_grows_to_3"
    ),
    (
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:2 --nproc-per-node 2 --max-restarts 3 "
        "--rdzv-backend c10d --rdzv-endpoint "
        "HEAD:29400 -m batchd.train --elastic /shared/batchd --config job.toml --checkpoint /shared/ckpt"
    ): "tests/test_elastic_torchrun.py::test_torchrun_elastic_resizes_the_job_by_itself_when_a_host_is_lost",
    "batchd coordinator --world-size $WORLD_SIZE --resize": (
        "tests/test_elastic_torchrun.py::test_torchrun_elastic_resizes_the_job_by_itself_when_a_host_is_lost"
    ),
    "python -m batchd.train --checkpoint DIR": (
        "tests/test_elastic.py::test_an_agent_killed_job_resumes_at_2_ranks_then_grows_to_3"
    ),
    "batchd simulate --resize STEP:W": (
        "tests/test_resize.py::test_batchd_simulate_resize_prints_each_world_size_and_change"
    ),
    "batchd bench": "tests/test_readme_commands.py::test_bench_runs_as_the_readme_shows_it",
    "batchd bench --workload benchmarks/workloads/audio-visual.csv": (
        "tests/test_bench.py::test_bench_trains_vision_and_audio_with_one_phase_and_every_phase_alike"
    ),
    "batchd bench --epochs 3": "tests/test_readme_commands.py::test_bench_runs_as_the_readme_shows_it",
    "batchd demo --help": "tests/test_readme_commands.py::test_readme_and_help_commands_parse",
    "batchd simulate": "tests/test_readme_commands.py::test_simulate_runs_as_the_readme_shows_it",
    "batchd config": "tests/test_readme_job.py::test_readme_real_job_runs_as_written",
    "batchd tokenizer FILE": (
        "tests/test_inputs.py::"
        "test_tokenizer_command_writes_the_demo_tokenizer_and_a_directory_loads_the_same"
    ),
    "batchd tokenizer --check PATH": (
        "tests/test_inputs.py::"
        "test_tokenizer_command_writes_the_demo_tokenizer_and_a_directory_loads_the_same"
    ),
    "python -m batchd.proto.generate": "tests/test_proto.py::test_stubs_are_not_stale",
    "batchd tiny-vlm vlm": (
        "tests/test_hf_vlm_daemon.py::test_stock_qwen2_vl_trains_two_phase_through_the_daemon"
    ),
    "cat > job.toml <<'EOF'": (
        "tests/test_hf_vlm_daemon.py::test_stock_qwen2_vl_trains_two_phase_through_the_daemon"
    ),
    "torchrun --nproc-per-node 2 -m batchd.train --node-agent 127.0.0.1:7100 --hf-model vlm": (
        "tests/test_hf_vlm_daemon.py::test_stock_qwen2_vl_trains_two_phase_through_the_daemon"
    ),
    "python -m batchd.train --hf-model DIR": (
        "tests/test_hf_vlm_daemon.py::test_stock_qwen2_vl_trains_two_phase_through_the_daemon"
    ),
    "batchd tiny-vlm DIR": "tests/test_hf_vlm_daemon.py::test_tiny_vlm_command_writes_what_a_checkout_holds",
}


def _test_exists(ref: str) -> bool:
    path, _, name = ref.partition("::")
    tree = ast.parse((REPO / path).read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body)


def test_every_readme_command_is_run_by_a_test():
    commands = readme_commands()
    assert len(commands) > 20, commands  # the extraction found the README's commands
    missing = [c for c in commands if c not in RUN_BY]
    assert not missing, f"README commands no test runs (add one to RUN_BY with its test): {missing}"
    gone = {ref for ref in RUN_BY.values() if not _test_exists(ref)}
    assert not gone, f"RUN_BY names tests that do not exist: {gone}"
    stale = [c for c in RUN_BY if c not in commands]
    assert not stale, f"RUN_BY lists commands the README no longer shows: {stale}"


def test_block_commands_join_lines_cut_comments_and_skip_heredocs():
    block = (
        "a --x 1 \\\n    --y 2   # why\npython - <<'EOF'  # make data\nbody # not a command\nEOF\nb '#not'\n"
    )
    assert block_commands(block) == ["a --x 1 --y 2", "python - <<'EOF'", "b '#not'"]


# -- every command parses ----------------------------------------------------------------------------
PLACEHOLDERS = {
    "FILE": "f.txt",
    "PATH": "p",
    "K": "2",
    "G": "0",
    "r": "0",
    "N": "2",
    "L": "8192",
    "HEAD:6379": "127.0.0.1:6379",
    "S": "5",
    "DIR": "d",
    "ADDR": "127.0.0.1:1",
    "HOST:PORT": "127.0.0.1:1",
    "STEP:W": "3:2",
    "$WORLD_SIZE": "2",
}


def _argv(cmd: str) -> list[str]:
    return [PLACEHOLDERS.get(w, w) for w in shlex.split(re.sub(r"<[^>]+>", "127.0.0.1", cmd))]


def _parse(argv: list[str]) -> None:
    """Parses a `batchd ...` or `python -m batchd.train ...` / `torchrun ... -m batchd.train ...` argv."""
    if argv[0] == "batchd":
        rest = argv[1:]
        if rest[:1] == ["simulate"] and not {"--lengths", "--workload", "--help"} & set(rest):
            rest += [
                "--lengths",
                "f.txt",
                "--world-size",
                "2",
                "--token-budget",
                "8192",
            ]  # prose names a flag
        if rest[:1] == ["rank"] and "--rank" not in rest:
            rest += ["--rank", "0"]
        build_parser().parse_args(rest)
        return
    if "batchd.train" in argv:
        from batchd.train import build_parser as train_parser

        train_parser().parse_args(argv[argv.index("batchd.train") + 1 :])
        return
    if argv[:3] == ["python", "-m", "batchd.proto.generate"]:
        return
    raise AssertionError(f"not a batchd command: {argv}")


def help_commands() -> list[str]:
    """The commands that `batchd CMD --help` and `python -m batchd.train --help` name in backticks."""
    from batchd.train import build_parser as train_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    texts = [p.format_help() for p in sub.choices.values()] + [train_parser().format_help()]
    found = []
    for text in texts:
        flat = " ".join(text.split())
        found += [m for m in re.findall(r"`([^`]+)`", flat) if m.startswith(COMMAND_START)]
        found += [m for m in re.findall(r"\((python -m batchd\.train [^)]+)\)", flat)]
    return sorted(set(found))


def test_readme_and_help_commands_parse():
    helps = help_commands()
    assert any(c.startswith("batchd config --example") for c in helps), helps
    for cmd in readme_commands() + helps:
        if cmd.startswith(("python3 -m venv", "python -m pytest", "python - <<", "cat > ")):
            # the install and test lines (test_install_line_is_what_ci_runs), heredocs that write files
            continue
        words = cmd.replace("|", " ").split()
        if cmd.startswith(("torchrun", "batchd torchrun")):
            if "-m" not in words:
                continue  # torchrun's own flags only
            words = ["python"] + words[words.index("-m") :]
        argv = _argv(" ".join(words))
        tries = (
            [argv, argv + ["p"]] if argv[-1].startswith("--") else [argv]
        )  # prose names a flag: `rank --dataset`
        errors = []
        for attempt in tries:
            try:
                with (
                    contextlib.redirect_stdout(io.StringIO()),
                    contextlib.redirect_stderr(io.StringIO()) as err,
                ):
                    _parse(attempt)
                break
            except SystemExit as exc:
                if exc.code == 0:
                    break
                errors.append(err.getvalue())
        else:
            raise AssertionError(f"{cmd!r} does not parse: {errors}")


def test_install_line_is_what_ci_runs():
    """The README's first lines are what `.ci/run` runs on a clean clone: the install, then the suite
    split by the `slow` marker into two runs, the fast one beside the slow one (together: every test
    once)."""
    first = bash_blocks(readme_text())[0]
    install, demo, suite = block_commands(first)
    ci = (REPO / ".ci" / "run").read_text()
    steps = [s.strip() for s in install.split("&&")]
    assert steps[0] == "python3 -m venv .venv" and "python3 -m venv .venv" in ci
    for step in steps[2:]:  # pip install ... ; CI runs the same through `python -m pip --quiet`
        assert step.replace("pip install", "python -m pip install --quiet") in ci, (step, ci)
    assert demo == "batchd demo" and suite == "python -m pytest -q"
    runs = [line.strip() for line in ci.splitlines() if line.strip().startswith("python -m pytest")]
    assert len(runs) == 2, runs
    assert runs[0].startswith(f'{suite} -m "not slow" ') and runs[0].endswith("&"), runs
    assert runs[1].startswith(f"{suite} -m slow "), runs
    assert ".ci/run" in readme_text() and "two stages" in readme_text()


# -- the commands no other test runs ----------------------------------------------------------------
def _env(marker: str | None = None) -> dict[str, str]:
    bindir = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": f"{bindir}:{os.environ.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS"):
        env.pop(var, None)
    if marker:
        env[marker.split("=")[0]] = marker.split("=")[1]
    return env


def test_simulate_runs_as_the_readme_shows_it(tmp_path):
    usage = re.search(r"### `batchd simulate`\n\n```\n(.*?)```", readme_text(), re.S).group(1)
    required = usage
    while "[" in required:  # drop the optional parts (nested brackets from the inside out)
        required = re.sub(r"\[[^\[\]]*\]", "", required)
    required = required.replace("|", "").split()  # batchd simulate --lengths FILE --workload FILE ...
    assert required[:2] == ["batchd", "simulate"], usage
    (tmp_path / "lengths.txt").write_text("\n".join(str(16 + 37 * i % 900) for i in range(300)) + "\n")
    argv = ["batchd", "simulate", "--lengths", "lengths.txt"]
    for flag in ("--world-size", "--token-budget"):
        assert flag in required, usage
        argv += [flag, PLACEHOLDERS[required[required.index(flag) + 1]]]
    proc = subprocess.run(
        argv + ["--json"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["missing"] == result["duplicates"] == 0 and result["emitted"] == 300, result


@pytest.mark.slow
def test_bench_runs_as_the_readme_shows_it(tmp_path):
    """`batchd bench` with its defaults: the default systems on the default workload (odb-synthetic), only
    fewer samples and epochs than the README's figures; every system trains every id once."""
    proc = subprocess.run(
        ["batchd", "bench", "--epochs", "3", "--num-samples", "24", "--heldout", "4"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    table = proc.stdout.strip().splitlines()
    systems = {line.split()[0] for line in table[1:]}
    assert {"fixed", "batchd-odb", "batchd-balanced", "batchd-packed"} <= systems, proc.stdout
    assert "error" not in proc.stderr.lower(), proc.stderr[-4000:]
    for line in proc.stderr.splitlines():  # "[bench] SYSTEM: ... (missing 0, dup 0) ..."
        if "(missing " in line:
            assert "(missing 0, dup 0)" in line and "72 samples" in line, line


def _processes_block() -> list[str]:
    text = readme_text()
    start = text.index("Processes, for a job of N ranks")
    return block_commands(bash_blocks(text[start:])[0])


@pytest.mark.slow
def test_readme_processes_block_runs(tmp_path):
    """The README's per-rank processes (a coordinator, `batchd rank` per trainer rank) and the per-rank
    trainer `python -m batchd.train --base-port 7100`, as written: ports made free, the state dirs under
    this test's directory, a small dataset, and no `--ray-address HEAD:6379` (there is no cluster here:
    the rank services run their own Ray)."""
    from batchd.preprocess import make_demo_dataset

    coord_cmd, rank_cmd = _processes_block()
    assert rank_cmd.startswith("batchd rank ") and "--rank 0" in rank_cmd, rank_cmd
    cport, rport = free_block(1), free_block(2)
    make_demo_dataset(tmp_path, RECORDS).path.rename(tmp_path / "data.parquet")

    def fill(cmd: str) -> list[str]:
        cmd = (
            cmd.replace("--port 7000", f"--port {cport}")
            .replace("127.0.0.1:7000", f"127.0.0.1:{cport}")
            .replace("--port 7100", f"--port {rport}")
            .replace("--ray-address HEAD:6379", "")
            .replace("/tmp/batchd-coord", str(tmp_path / "coord"))
            .replace("/tmp/batchd", str(tmp_path / "rank"))
            .replace("--token-budget 8192", "--token-budget 1024")
        )
        return shlex.split(cmd) + (
            ["--window", "32"] if cmd.startswith(("batchd coordinator", "batchd rank")) else []
        )

    train_inline = "python -m batchd.train --base-port 7100 --tokenizer tok.json"
    assert f"`{train_inline}`" in " ".join(readme_text().split())
    assert subprocess.run(["batchd", "tokenizer", "tok.json"], cwd=tmp_path, env=_env()).returncode == 0
    marker = f"BATCHD_TEST_PROCS={uuid.uuid4().hex}"
    env = _env(marker)
    procs: list[tuple[str, subprocess.Popen]] = []

    def start(name: str, argv: list[str], extra_env: dict[str, str] | None = None) -> None:
        log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        procs.append(
            (
                name,
                subprocess.Popen(
                    argv, cwd=tmp_path, env={**env, **(extra_env or {})}, stdout=log, stderr=subprocess.STDOUT
                ),
            )
        )

    try:
        start("coordinator", fill(coord_cmd))
        for r in range(2):  # "one per trainer rank": rank r listens on base port + r
            start(f"rank-{r}", _rank_argv(fill(rank_cmd), r, rport, tmp_path))
        master = free_block(1)  # what torchrun would set: one rendezvous for both trainers
        for r in range(2):
            argv = [
                sys.executable,
                "-m",
                "batchd.train",
                "--base-port",
                str(rport),
                "--tokenizer",
                "tok.json",
                "--d-model",
                "32",
                "--n-layers",
                "1",
                "--n-heads",
                "2",
                "--summary",
                str(tmp_path / f"summary-{r}.json"),
            ]
            start(
                f"trainer-{r}",
                argv,
                {
                    "RANK": str(r),
                    "WORLD_SIZE": "2",
                    "LOCAL_RANK": str(r),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(master),
                },
            )
        deadline = time.monotonic() + 400
        for _name, p in procs:
            p.wait(max(deadline - time.monotonic(), 1))
        logs = {name: (tmp_path / f"{name}.log").read_text() for name, _ in procs}
        for name, p in procs:
            assert p.returncode == 0, (name, logs[name][-4000:])
            assert "Traceback" not in logs[name], (name, logs[name][-4000:])
        results = [json.loads((tmp_path / f"summary-{r}.json").read_text()) for r in range(2)]
        assert results[0]["steps"] == results[1]["steps"] > 0, results
        assert (tmp_path / "coord").is_dir() and (tmp_path / "rank0").is_dir(), "the state dirs were used"
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.kill()
        deadline = time.monotonic() + 15
        while processes_with_marker(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = processes_with_marker(marker)
        for entry in left:
            with contextlib.suppress(OSError):
                os.kill(int(entry.split(":", 1)[0]), 9)
    assert not left, "processes outlived the job:\n" + "\n".join(left)


def _rank_argv(argv: list[str], rank: int, base_port: int, tmp_path: Path) -> list[str]:
    """The README's rank-0 line for rank `rank`: its rank, its port (base + rank), its own state dir."""
    out = list(argv)
    out[out.index("--rank") + 1] = str(rank)
    out[out.index("--port") + 1] = str(base_port + rank)
    out[out.index("--state-dir") + 1] = str(tmp_path / f"rank{rank}")
    return out


# -- the README's Python blocks ---------------------------------------------------------------------
def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", readme_text(), re.S)


def test_every_python_block_compiles_and_its_imports_resolve():
    """Every Python block is valid Python and every name it imports from batchd (or a library) exists."""
    import importlib

    blocks = python_blocks()
    assert len(blocks) >= 6, len(blocks)
    for block in blocks:
        tree = ast.parse(block)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                mod = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(mod, alias.name), f"{node.module}.{alias.name} (README block:\n{block})"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)


def test_records_blocks_write_files_batchd_reads(tmp_path, monkeypatch):
    """The README's Parquet and Arrow IPC blocks, run as written (with the image they name), write files
    that `RecordDataset` opens and parses."""
    from batchd.preprocess import RecordDataset

    monkeypatch.chdir(tmp_path)
    (tmp_path / "img").mkdir()
    from PIL import Image

    Image.new("RGB", (32, 32), (255, 0, 0)).save(tmp_path / "img" / "0001.png")
    parquet = next(b for b in python_blocks() if "pq.write_table" in b)
    arrow = next(b for b in python_blocks() if "pa.ipc.new_file" in b)
    scope: dict = {}
    exec(compile(parquet, "README:parquet", "exec"), scope)  # noqa: S102 - the README's own code
    exec(compile(arrow, "README:arrow", "exec"), scope)  # noqa: S102 - it uses the block before (`rows`)
    for name in ("train.parquet", "train.arrow"):
        ds = RecordDataset(tmp_path / name)
        assert len(ds) == 1, name


def test_processor_block_runs_with_a_local_processor(tmp_path, monkeypatch):
    """`default_stages(processor="Qwen2-VL-7B-Instruct", cutoff=4096)` on a locally built Qwen2-VL
    processor saved under that name (what a model's checkout holds): [HFProcessor, Truncate]."""
    from test_hf_processor import QWEN2VL_TEMPLATE, _qwen2vl

    block = next(b for b in python_blocks() if "default_stages(processor=" in b)
    name = re.search(r'processor="([^"]+)"', block).group(1)
    _qwen2vl(QWEN2VL_TEMPLATE).save_pretrained(tmp_path / name)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(block, "README:processor", "exec"), scope)  # noqa: S102 - the README's own code
    assert [type(s).__name__ for s in scope["stages"]] == ["HFProcessor", "_NoAudio", "Truncate"], scope[
        "stages"
    ]
