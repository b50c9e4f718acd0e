"""The job config file, the CLI's flag-over-config precedence, structured logs and the progress bar."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _procs import free_block

from batchd.cli import build_parser, main
from batchd.config import DROP, EXAMPLE, ConfigError, JsonFormatter, build_config, load_config
from batchd.core import JobSpec
from batchd.service.preprocess import Qwen2VLImageConfig

WORKLOAD = Path(__file__).resolve().parents[1] / "batchd" / "workloads" / "odb-synthetic.txt"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def example(tmp_path) -> Path:
    return write(tmp_path / "job.toml", EXAMPLE)


def test_example_config_loads_with_defaults_and_relative_paths(example, tmp_path):
    cfg = load_config(example, check_files=False)
    job = cfg.job
    assert (job.world_size, job.token_budget, job.policy.name, job.policy.window) == (
        2,
        8192,
        "balanced",
        128,
    )
    assert job == JobSpec.from_keys(world_size=2, token_budget=8192)  # the example shows the defaults
    assert cfg.data.dataset == str(tmp_path / "train.parquet")  # relative to the config file
    assert cfg.coordinator.dial_address() == "127.0.0.1:7000"
    assert cfg.rank.port_of(1) == 7101 and cfg.rank.metrics_port_of(1) is None
    assert cfg.security_object() is None
    assert cfg.pipeline.stage_kwargs()["vision"] == Qwen2VLImageConfig()  # qwen2_vl, transformers' bounds


def test_missing_input_files_fail_at_load_naming_the_field(example):
    with pytest.raises(ConfigError, match=r"job.toml: data.dataset names a file that does not exist"):
        load_config(example)


def test_yaml_and_toml_give_the_same_config(tmp_path):
    toml = write(
        tmp_path / "a.toml",
        '[job]\nworld_size = 4\ntoken_budget = 2048\npolicy = "odb"\n'
        '[rank]\nbase_port = 7100\n[logging]\nformat = "json"\nlevel = "debug"\n',
    )
    yaml = write(
        tmp_path / "a.yaml",
        "job: {world_size: 4, token_budget: 2048, policy: odb}\n"
        "rank: {base_port: 7100}\nlogging: {format: json, level: debug}\n",
    )
    assert load_config(toml) == load_config(yaml).__class__(
        **{**load_config(yaml).__dict__, "source": str(toml)}
    )
    assert load_config(toml).logging.level == "DEBUG"


@pytest.mark.parametrize(
    "section, key, value, message",
    [
        ("job", "token_budget", '"8k"', "token_budget must be an int"),
        ("job", "policy", '"greedy"', "job.policy must be one of"),
        ("job", "world_size", "0", "world_size"),
        ("job", "epochs", "0", "job.epochs must be >= 1, got epochs=0"),
        ("job", "windw", "512", "unknown key job.windw"),
        ("coordinator", "port", "70000", "coordinator.port must be <= 65535"),
        ("coordinator", "address", '"nohost"', "coordinator.address must be HOST:PORT"),
        ("coordinator", "lease_s", "0", "coordinator.lease_s must be a number > 0"),
        ("rank", "base_port", "-1", "rank.base_port must be >= 0"),
        ("rank", "trainer_timeout_s", "0", "rank.trainer_timeout_s must be a number > 0"),
        ("data", "num_actors", "0", "data.num_actors must be >= 1"),
        ("pipeline", "vision", '"clip"', "pipeline.vision must be one of"),
        ("security", "client_auth", '"yes"', "security.client_auth must be true or false"),
        ("logging", "format", '"xml"', "logging.format must be one of"),
    ],
)
def test_bad_values_name_the_field_and_the_value(tmp_path, section, key, value, message):
    body = {"job": {"world_size": "2", "token_budget": "1024"}}
    body.setdefault(section, {})[key] = value
    text = "".join(f"[{s}]\n" + "".join(f"{k} = {v}\n" for k, v in kv.items()) for s, kv in body.items())
    path = write(tmp_path / "bad.toml", text)
    with pytest.raises(ConfigError, match=message) as err:
        load_config(path, check_files=False)
    assert str(path) in str(err.value)


def test_structural_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown section \[jobs\]"):
        load_config(write(tmp_path / "a.toml", "[jobs]\nworld_size = 2\n"))
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path / "b.toml", "[job\n"))
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="job.token_budget is required.*--token-budget"):
        load_config(write(tmp_path / "c.toml", "[job]\nworld_size = 2\n"))
    with pytest.raises(ConfigError, match="security.tls_cert and security.tls_key go together"):
        build_config(
            {"job": {"world_size": 1, "token_budget": 8}, "security": {"tls_cert": "x.pem"}},
            check_files=False,
        )
    with pytest.raises(ConfigError, match="data.dataset and data.lengths are exclusive"):
        build_config(
            {"job": {"world_size": 1, "token_budget": 8}, "data": {"dataset": "a", "lengths": "b"}},
            check_files=False,
        )


def test_overrides_beat_the_file_and_none_means_not_given(example):
    cfg = load_config(
        example,
        {
            "job.token_budget": 4096,
            "job.policy": None,
            "coordinator.port": 0,
            "coordinator.address": "10.0.0.5:7000",
        },
        check_files=False,
    )
    assert cfg.job.token_budget == 4096 and cfg.job.policy.name == "balanced"
    assert cfg.coordinator.dial_address() == "10.0.0.5:7000"
    with pytest.raises(ConfigError, match="override keys are 'section.key'"):
        load_config(example, {"token_budget": 1}, check_files=False)


def test_a_dropped_key_gives_way_to_an_exclusive_flag():
    raw = {"job": {"world_size": 1, "token_budget": 8}, "data": {"dataset": "train.parquet"}}
    with pytest.raises(ConfigError, match="data.dataset and data.lengths are exclusive"):
        build_config(raw, {"data.lengths": "l.txt"}, check_files=False)
    cfg = build_config(raw, {"data.lengths": "l.txt", "data.dataset": DROP}, check_files=False)
    assert (cfg.data.dataset, cfg.data.lengths) == (None, "l.txt")


def test_every_command_has_a_full_help(capsys):
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert {"simulate", "config", "coordinator", "rank", "demo", "bench"} <= set(commands)
    for name in commands:
        with pytest.raises(SystemExit) as exc:
            parser.parse_args([name, "--help"])
        assert exc.value.code == 0
        text = capsys.readouterr().out
        assert f"usage: batchd {name}" in text
    for name in ("coordinator", "rank"):
        text = commands[name].format_help()
        for flag in (
            "--config",
            "--metrics-port",
            "--tls-cert",
            "--tls-ca",
            "--tls-client-auth",
            "--token-file",
            "--log-format",
        ):
            assert flag in text, (name, flag)


def test_config_command_checks_a_file(example, capsys):
    assert main(["config", "--no-file-check", "--json", str(example)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["job"]["token_budget"] == 8192 and out["rank"]["base_port"] == 7100
    assert main(["config", str(example)]) == 2
    assert "data.dataset names a file that does not exist" in capsys.readouterr().err


def test_simulate_config_plus_flags_equals_flags_alone(tmp_path, capsys):
    cfg = write(
        tmp_path / "sim.toml",
        "[job]\nworld_size = 4\ntoken_budget = 4096\nshuffle = false\n"
        '[job.policy]\nname = "balanced"\nwindow = 128\n',
    )
    assert (
        main(["simulate", "--lengths", str(WORKLOAD), "--config", str(cfg), "--policy", "local", "--json"])
        == 0
    )
    via_config = json.loads(capsys.readouterr().out)
    assert (
        main(
            [
                "simulate",
                "--lengths",
                str(WORKLOAD),
                "--world-size",
                "4",
                "--token-budget",
                "4096",
                "--policy",
                "local",
                "--window",
                "128",
                "--no-shuffle",
                "--json",
            ]
        )
        == 0
    )
    via_flags = json.loads(capsys.readouterr().out)
    for k in [k for k in via_flags if "time" in k or k.endswith("_s") or "per_s" in k]:
        via_flags.pop(k), via_config.pop(k)
    assert via_config == via_flags and via_config["policy"] == "local"
    assert main(["simulate", "--lengths", str(WORKLOAD), "--world-size", "2"]) == 2
    assert "--token-budget is required" in capsys.readouterr().err


def test_json_log_lines_keep_extra_fields():
    record = logging.LogRecord("batchd.rank", logging.WARNING, __file__, 1, "round %d late", (7,), None)
    record.rank = 3
    out = json.loads(JsonFormatter().format(record))
    assert out["msg"] == "round 7 late" and out["rank"] == 3 and out["level"] == "WARNING"
    assert out["logger"] == "batchd.rank" and out["ts"].endswith("+00:00")


def _free_port() -> int:
    return free_block(1)  # below the ephemeral range: no port-0 server elsewhere takes it meanwhile


@pytest.mark.slow
def test_services_run_from_one_config_file(tmp_path):
    """`batchd coordinator --config` and `batchd rank --config --rank r` with nothing else: the rank
    finds the coordinator, its port and its data through the file; a client drains the epoch."""
    from batchd.client import BatchClient, ClientOptions

    lengths = write(tmp_path / "lengths.txt", "\n".join(str(1 + (7 * i) % 90) for i in range(120)) + "\n")
    cport, rport = _free_port(), _free_port()
    cfg = write(
        tmp_path / "job.toml",
        f'[job]\nworld_size = 1\ntoken_budget = 256\n[job.policy]\nname = "local"\nwindow = 32\n'
        f'[data]\nlengths = "{lengths.name}"\n[coordinator]\nport = {cport}\n'
        f'[rank]\nbase_port = {rport}\n[logging]\nformat = "json"\n',
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "batchd"]
    logs = [open(tmp_path / n, "w+") for n in ("coord.log", "rank.log")]
    procs = [
        subprocess.Popen(cmd + ["coordinator", "--config", str(cfg)], stderr=logs[0], env=env, cwd=tmp_path),
        subprocess.Popen(
            cmd + ["rank", "--config", str(cfg), "--rank", "0"], stderr=logs[1], env=env, cwd=tmp_path
        ),
    ]
    try:
        ids = []
        with BatchClient(f"127.0.0.1:{rport}", 0, 1, options=ClientOptions(reconnect_timeout_s=60)) as client:
            for batch, _info in client:
                ids += batch["sample_ids"].tolist()
        assert sorted(ids) == list(range(120))
        codes = [p.wait(timeout=30) for p in procs]
        assert codes == [0, 0], [Path(f.name).read_text() for f in logs]
    finally:
        for p in procs:
            p.kill() if p.poll() is None else None
        for f in logs:
            f.close()
    lines = [
        json.loads(line) for line in (tmp_path / "coord.log").read_text().splitlines() if line.startswith("{")
    ]
    assert any("listening" in rec["msg"] for rec in lines) and all("level" in rec for rec in lines)


def test_readme_commands_parse():
    """Every `batchd ...` line in the README's bash blocks is a valid command line for this CLI."""
    import re
    import shlex

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    parser = build_parser()
    checked = 0
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"[;&|]+|\bdo\b", line.split("#")[0]):
                words = shlex.split(part.replace("$r", "0").replace(">", " > ").split(" > ")[0])
                if words[:1] != ["batchd"]:
                    continue
                if words[1:2] == ["torchrun"]:  # torchrun's arguments, by torch's own parser
                    from torch.distributed.run import get_args_parser

                    parser_of, words = get_args_parser(), words[1:]
                else:
                    parser_of = parser
                try:
                    parser_of.parse_args(words[1:])
                except SystemExit as exc:
                    pytest.fail(f"README command does not parse ({exc.code}): {' '.join(words)}")
                checked += 1
    assert checked >= 5
