"""The deployment files (deploy/, docker/, docs/deployment.md) against the code they drive.

Every command line they run is extracted and parsed by the parser that will run it:

- `batchd ...` (compose `command:`/`entrypoint:`, `bash -c` strings, shell scripts, `ray up` commands,
  Dockerfile ENTRYPOINT + CMD, the shell blocks of docs/deployment.md) by `batchd.cli.build_parser()`;
- `torchrun ...` by torch's own `torch.distributed.run.get_args_parser()`, and the trainer module's
  arguments after it by `batchd.train.build_parser()` (also the Kubernetes trainer Job's args,
  which deploy/torchrun/launch.sh forwards).

`batchd node ...` lines (one node agent per GPU host) and the trainer's `--node-agent` parse with the
real parsers. launch.sh and start-node-agent.sh also run for real, from their environment, up to their
final `exec` (`exec_argv`: the program variable set to `true`, the command line read from bash's trace
of that exec), and what they would exec parses with the same real parsers; the Kubernetes pods that run
launch.sh are checked through that run too, not through a model of the script.
docker/compose.yaml is checked alone and merged with its CPU override docker/compose.cpu.yaml (host
networking everywhere, no published ports); deploy/smoke/compose.sh, which runs that merge for real
under docker, is only syntax-checked here (CI has no docker daemon).

argparse exits on an unknown flag or a bad value: the test catches it and fails naming the file, the
command and argparse's message. Shell variables are expanded with the example values each script
documents in `# example: NAME=value` lines (compose `${VAR:-default}` with its default); a variable
without one fails the test, so a command can never be skipped silently. The job configs (deploy/,
docker/, the ConfigMaps) are loaded with `tomllib` and validated by `batchd.config.load_config`
(`check_files=False`: they name paths on other machines), and cross-checked against the files that
start the job: world size = rank services = trainer processes = GPUs, ports = base_port + r, healthchecks
on the metrics ports. The KubeRay manifests are checked for the fields the CRDs require.

One slow test runs deploy/torchrun/launch.sh for real: torchrun starts 2 gloo trainers
(`python -m batchd.train`) against a real coordinator and 2 rank services on loopback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import io
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from _procs import free_block

from batchd import train
from batchd.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
SHELL_SCRIPTS = [
    "deploy/ray/start-batchd.sh",
    "deploy/ray/start-node-agent.sh",
    "deploy/torchrun/launch.sh",
    "deploy/smoke/compose.sh",
]
TOML_CONFIGS = ["deploy/ray/job.toml", "docker/job.toml"]
K8S = ["deploy/kubernetes/raycluster.yaml", "deploy/kubernetes/rayjob.yaml"]
DOCKERFILES = ["docker/Dockerfile", "docker/Dockerfile.cpu"]
# Variables the platform sets (not documented in the files): Ray sets RAY_HEAD_IP on `ray up` workers.
PLATFORM_VALUES = {"RAY_HEAD_IP": "10.0.0.1", "USER": "ubuntu", "HOME": "/home/ubuntu"}
# Placeholders used in the shell blocks of docs/deployment.md.
DOC_VALUES = {
    "HEAD_IP": "10.0.0.1",
    "BATCHD_TOKEN": "t0ken",
    "i": "0",
    "r": "0",
    "POD": "pod-0",
    "POD0_IP": "10.0.0.2",
    "NODE0_IP": "10.0.0.2",
    "NODE_IP": "10.0.0.3",
    "IP": "10.0.0.3",
    **PLATFORM_VALUES,
}
# Variables Kubernetes sets in a pod (the Indexed Job's completion index, downward-API env).
K8S_VALUES = {
    "JOB_COMPLETION_INDEX": "0",
    "NODE_RANK": "0",
    "POD_IP": "10.0.0.5",
    "ADVERTISE": "10.0.0.5",
    "POD_NAME": "pod-0",
    "HOSTNAME": "pod-0",
}
OPERATORS = {"&&", "||", ";", "|", "&", "(", ")", ";;", "|&"}
KEYWORDS = {"then", "do", "else", "elif", "if", "while", "until", "!", "{"}
PREFIXES = {"exec", "nohup", "time", "command"}


def read(rel: str) -> str:
    return (REPO / rel).read_text()


# -- shell parsing ----------------------------------------------------------------------------------
class Undocumented(KeyError):
    """A shell variable with neither a documented example value nor a default."""


def example_values(text: str) -> dict[str, str]:
    """`# example: NAME=value` lines of a script."""
    return dict(m.groups() for m in re.finditer(r"^#\s*example:\s*(\w+)=(.*?)\s*$", text, re.MULTILINE))


def _var(name: str, values: dict[str, str], default: str | None) -> str:
    if name in values:
        return values[name]
    if default is not None:
        return default
    raise Undocumented(f"shell variable ${name} has no example value and no default")


def expand_word(word: str, values: dict[str, str]) -> list[str]:
    """One (unquoted) shell word -> its words after parameter and arithmetic expansion."""
    if word in ("$@", "${@}", "$*"):
        return []
    if m := re.fullmatch(r"\$\{(\w+)\[@\]\}", word):
        return _var(m.group(1), values, None).split()

    def arith(m: re.Match) -> str:
        expr = re.sub(r"\$?\b([A-Za-z_]\w*)\b", lambda v: _var(v.group(1), values, None), m.group(1))
        if not re.fullmatch(r"[\d\s+\-*/%()]+", expr):
            raise ValueError(f"cannot evaluate $(({m.group(1)})) -> {expr!r}")
        return str(eval(expr, {"__builtins__": {}}))  # digits and + - * / % only (checked above)

    word = re.sub(r"\$\(\((.+?)\)\)", arith, word)
    word = re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: _var(m.group(1), values, m.group(2)), word)
    word = re.sub(r"\$([A-Za-z_]\w*)", lambda m: _var(m.group(1), values, None), word)
    return [word]


def logical_lines(text: str) -> list[str]:
    """Shell lines with backslash continuations joined; comments and here-document bodies dropped."""
    out: list[str] = []
    lines = iter(text.splitlines())
    buf = ""
    for line in lines:
        if not buf and line.lstrip().startswith("#"):
            continue
        if heredoc := re.search(r"<<-?\s*['\"]?(\w+)['\"]?", line):
            for body in lines:
                if body.strip() == heredoc.group(1):
                    break
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        out.append(buf + line)
        buf = ""
    if buf:
        out.append(buf)
    return out


@dataclasses.dataclass
class Invocation:
    source: str
    program: str  # "batchd" | "torchrun"
    argv: list[str]

    def __str__(self) -> str:
        return f"{self.source}: `{shlex.join([self.program, *self.argv])}`"


def shell_invocations(
    text: str, values: dict[str, str], source: str, programs: tuple[str, ...] = ("batchd", "torchrun")
) -> list[Invocation]:
    """Every `batchd`/`torchrun` command (in command position) of a shell text, expanded."""
    found: list[Invocation] = []
    for line in logical_lines(text):
        try:
            # `2>&1`, `1>log`: the fd number touching the redirection is not an argument
            lex = shlex.shlex(re.sub(r"(?<=\s)\d+(?=[<>])", "", line), posix=True, punctuation_chars=True)
            lex.whitespace_split = True
            tokens = list(lex)
        except ValueError:
            if re.search(r"(^|[\s;&|])(exec\s+)?(\"?\$\{?(BATCHD|TORCHRUN)\}?\"?|batchd|torchrun)\s", line):
                raise ValueError(f"{source}: cannot tokenize command line {line!r}") from None
            continue
        cmd_pos = True
        i = 0
        while i < len(tokens):
            tok = tokens[i]
            if tok in OPERATORS or set(tok) <= set("();<>|&"):
                cmd_pos = tok in OPERATORS
                i += 1
                continue
            if not cmd_pos:
                i += 1
                continue
            if tok in KEYWORDS or tok in PREFIXES or re.fullmatch(r"\w+=.*", tok):
                i += 1  # still in command position
                continue
            name = Path(expand_word(tok, values)[0]).name if tok.startswith("$") or "/" in tok else tok
            cmd_pos = False
            if name not in programs:
                i += 1
                continue
            args: list[str] = []
            i += 1
            while i < len(tokens) and not (tokens[i] in OPERATORS or set(tokens[i]) <= set("();<>|&")):
                args.append(tokens[i])
                i += 1
            argv = [w for a in args for w in expand_word(a, values)]
            found.append(Invocation(source, name, argv))
    return found


# -- checking ---------------------------------------------------------------------------------------
def parse_error(parser, argv: list[str]) -> str | None:
    """argparse's message when `argv` does not parse (None when it does; `--help` counts as parsing)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as exc:
        if exc.code == 0 and ("--help" in argv or "-h" in argv):
            return None
        return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {exc.code}"
    return None


def check(inv: Invocation) -> str | None:
    """Why `inv` would not start (None when every parser accepts it): `batchd ...` by the CLI's
    parser; `torchrun ...` by torch's, then its `-m batchd.train` arguments by the trainer's."""
    if inv.program == "batchd" and inv.argv[:1] == ["torchrun"]:  # `batchd torchrun`: torchrun's arguments
        inv = dataclasses.replace(inv, program="torchrun", argv=inv.argv[1:])
    if inv.program == "batchd":
        error = parse_error(build_parser(), inv.argv)
        return f"{inv}: {error}" if error else None
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    error = parse_error(parser, inv.argv)
    if error:
        return f"{inv}: torchrun: {error}"
    args = parser.parse_args(inv.argv)
    if not (args.module and args.training_script == "batchd.train"):
        return f"{inv}: torchrun must run `-m batchd.train`, got {args.training_script!r}"
    error = parse_error(train.build_parser(), list(args.training_script_args))
    return f"{inv}: trainer: {error}" if error else None


# -- running a deploy script up to its exec ---------------------------------------------------------
def exec_argv(script: str, args: list[str], env: dict[str, str], program_var: str) -> list[str]:
    """Runs `script` (bash, with `args`) for real in `env`, with `$program_var` (TORCHRUN, BATCHD) set
    to coreutils' `true` so that its final `exec` starts nothing; returns what the script would exec
    after the program: bash's xtrace of that line (`+ exec true ...`, shell-quoted; nested commands
    trace as `++ ...`), split back. Fails with the script's stderr when it exits non-zero."""
    run = subprocess.run(
        ["bash", "-x", str(REPO / script), *args],
        env={**env, program_var: "true"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, f"{script} exited {run.returncode}:\n{run.stderr[-3000:]}"
    execs = [line for line in run.stderr.splitlines() if line.startswith("+ exec true")]
    assert execs, f"{script} ran no exec:\n{run.stderr[-3000:]}"
    words = shlex.split(execs[-1][2:])
    assert words[:2] == ["exec", "true"], words
    return words[2:]


def launch_argv(env: dict[str, str], args: list[str]) -> list[str]:
    """torchrun's arguments as deploy/torchrun/launch.sh builds them from `env` (plus PATH)."""
    return exec_argv("deploy/torchrun/launch.sh", args, {"PATH": os.environ["PATH"], **env}, "TORCHRUN")


def failures(invocations: list[Invocation]) -> list[str]:
    return [msg for inv in invocations if (msg := check(inv))]


# -- file-specific extraction -----------------------------------------------------------------------
class ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's merge tags: `!reset` (drop the inherited value) and `!override` (replace it)."""


class Reset:
    def __repr__(self) -> str:
        return "!reset"


RESET = Reset()
ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)
ComposeLoader.add_constructor(
    "!override",
    lambda loader, node: (
        loader.construct_mapping(node, deep=True)
        if isinstance(node, yaml.MappingNode)
        else loader.construct_sequence(node, deep=True)
        if isinstance(node, yaml.SequenceNode)
        else loader.construct_scalar(node)
    ),
)


def compose(rel: str = "docker/compose.yaml") -> dict[str, Any]:
    return yaml.load(read(rel), Loader=ComposeLoader)


def compose_merge(base: Any, override: Any) -> Any:
    """`docker compose -f A -f B`'s merge, as far as these files use it: mappings merge key by key,
    `command`/`entrypoint` and other sequences are replaced, `!reset` removes the key."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            if value is RESET:
                out.pop(key, None)
            else:
                out[key] = compose_merge(base.get(key), value) if key in base else value
        return out
    return override


def compose_cpu() -> dict[str, Any]:
    """docker/compose.yaml merged with its CPU override (deploy/smoke/compose.sh runs this)."""
    return compose_merge(compose(), compose("docker/compose.cpu.yaml"))


def compose_interpolate(value: Any) -> Any:
    """Compose's `${VAR:-default}` with the default and `$$` -> `$`, recursively."""
    if isinstance(value, str):
        value = re.sub(r"(?<!\$)\$\{(\w+):?-([^}]*)\}", lambda m: m.group(2), value)
        if re.search(r"(?<!\$)\$\{?\w", value):
            raise Undocumented(f"compose variable without a default in {value!r}")
        return value.replace("$$", "$")
    if isinstance(value, list):
        return [compose_interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: compose_interpolate(v) for k, v in value.items()}
    return value


def dockerfile_instructions(rel: str) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", read(rel))
    return [
        (m.group(1).upper(), m.group(2).strip())
        for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", text, re.MULTILINE)
        if not m.group(0).lstrip().startswith("#")
    ]


def dockerfile_entry(rel: str) -> tuple[list[str], list[str]]:
    """ENTRYPOINT and CMD (exec form) of the final stage."""
    entry: list[str] = []
    cmd: list[str] = []
    for op, arg in dockerfile_instructions(rel):
        if op == "FROM":
            entry, cmd = [], []
        elif op == "ENTRYPOINT":
            entry = json.loads(arg)
        elif op == "CMD":
            cmd = json.loads(arg)
    return entry, cmd


def compose_invocations(cpu: bool = False) -> list[Invocation]:
    services = compose_interpolate((compose_cpu() if cpu else compose())["services"])
    image_entry = {
        "batchd:0.1.0-cpu": dockerfile_entry("docker/Dockerfile.cpu")[0],
        "batchd:0.1.0-cuda": dockerfile_entry("docker/Dockerfile")[0],
    }
    found = []
    for name, svc in services.items():
        source = f"docker/compose{'.cpu' if cpu else ''}.yaml services.{name}"
        entry = svc.get("entrypoint", image_entry[svc["image"]])
        entry = shlex.split(entry) if isinstance(entry, str) else entry
        command = svc.get("command", [])
        command = shlex.split(command) if isinstance(command, str) else command
        argv = [*entry, *command]
        if argv[:2] == ["bash", "-c"]:
            found += shell_invocations(argv[2], {}, source)
        elif Path(argv[0]).name == "batchd" and argv[1:2] == ["torchrun"]:  # torchrun's own arguments
            found.append(Invocation(source, "torchrun", argv[2:]))
        elif Path(argv[0]).name in ("batchd", "torchrun"):
            found.append(Invocation(source, Path(argv[0]).name, argv[1:]))
    return found


def cluster_yaml() -> dict[str, Any]:
    return yaml.safe_load(read("deploy/ray/cluster.yaml"))


def cluster_invocations() -> list[Invocation]:
    cfg = cluster_yaml()
    found = []
    for key in (
        "initialization_commands",
        "setup_commands",
        "head_setup_commands",
        "worker_setup_commands",
        "head_start_ray_commands",
        "worker_start_ray_commands",
    ):
        for command in cfg.get(key) or []:
            found += shell_invocations(command, PLATFORM_VALUES, f"deploy/ray/cluster.yaml {key}")
    return found


def k8s_docs(rel: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(read(rel)) if d]


def pod_specs(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any], dict[str, str]]]:
    """(where, pod spec, pod labels) of every pod template in a manifest."""
    kind, spec = doc["kind"], doc.get("spec", {})
    if kind in ("RayCluster", "RayJob"):
        cluster = spec["rayClusterSpec"] if kind == "RayJob" else spec
        # KubeRay labels the pods it creates with the cluster name (known only for a RayCluster).
        name = {"ray.io/cluster": doc["metadata"]["name"]} if kind == "RayCluster" else {}
        head = cluster["headGroupSpec"]["template"]
        out = [
            (
                "headGroupSpec",
                head["spec"],
                {**head.get("metadata", {}).get("labels", {}), **name, "ray.io/node-type": "head"},
            )
        ]
        for g in cluster["workerGroupSpecs"]:
            t = g["template"]
            out.append(
                (
                    f"workerGroupSpecs[{g['groupName']}]",
                    t["spec"],
                    {**t.get("metadata", {}).get("labels", {}), **name, "ray.io/node-type": "worker"},
                )
            )
        return out
    if kind == "Job":
        t = spec["template"]
        return [("Job", t["spec"], t.get("metadata", {}).get("labels", {}))]
    return []


def configmap_toml(rel: str) -> str:
    (cm,) = [d for d in k8s_docs(rel) if d["kind"] == "ConfigMap"]
    return cm["data"]["job.toml"]


def repo_path_of_image_path(path: str) -> Path:
    """/opt/batchd/deploy/... (COPY deploy /opt/batchd/deploy in the Dockerfiles) -> the repo file."""
    assert path.startswith("/opt/batchd/deploy/"), path
    return REPO / path.removeprefix("/opt/batchd/")


def container_env(c: dict[str, Any]) -> dict[str, str]:
    """A container's literal env values (downward-API ones get the K8S_VALUES example)."""
    return {e["name"]: e["value"] if "value" in e else K8S_VALUES[e["name"]] for e in c.get("env", [])}


def k8s_invocations(rel: str) -> list[Invocation]:
    found: list[Invocation] = []
    for doc in k8s_docs(rel):
        if doc["kind"] == "RayJob":
            found += shell_invocations(doc["spec"]["entrypoint"], {}, f"{rel} RayJob.entrypoint")
        for where, pod, _ in pod_specs(doc):
            for c in [*pod.get("initContainers", []), *pod.get("containers", [])]:
                argv = [*c.get("command", []), *c.get("args", [])]
                source = f"{rel} {where} {c['name']}"
                if argv[:1] == ["bash"] and argv[1].endswith("/torchrun/launch.sh"):
                    torchrun = launch_argv(container_env(c), argv[2:])
                    found.append(Invocation(f"{source} (via launch.sh)", "torchrun", torchrun))
                elif argv[:2] == ["bash", "-c"]:
                    found += shell_invocations(argv[2], {**K8S_VALUES, **container_env(c)}, source)
                elif argv and Path(argv[0]).name in ("batchd", "torchrun"):
                    found.append(Invocation(source, Path(argv[0]).name, argv[1:]))
    return found


def docs_invocations() -> list[Invocation]:
    text = read("docs/deployment.md")
    found = []
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, re.DOTALL):
        found += shell_invocations(block, DOC_VALUES, "docs/deployment.md")
    return found


SOURCES = {
    "deploy/ray/start-batchd.sh": lambda: shell_invocations(
        read("deploy/ray/start-batchd.sh"),
        example_values(read("deploy/ray/start-batchd.sh")),
        "deploy/ray/start-batchd.sh",
    ),
    "deploy/ray/start-node-agent.sh": lambda: shell_invocations(
        read("deploy/ray/start-node-agent.sh"),
        example_values(read("deploy/ray/start-node-agent.sh")),
        "deploy/ray/start-node-agent.sh",
    ),
    "deploy/torchrun/launch.sh": lambda: shell_invocations(
        read("deploy/torchrun/launch.sh"),
        example_values(read("deploy/torchrun/launch.sh")),
        "deploy/torchrun/launch.sh",
    ),
    "deploy/ray/cluster.yaml": cluster_invocations,
    "docker/compose.yaml": compose_invocations,
    "docker/compose.cpu.yaml": lambda: compose_invocations(cpu=True),
    "deploy/kubernetes/rayjob.yaml": lambda: k8s_invocations("deploy/kubernetes/rayjob.yaml"),
    "deploy/kubernetes/raycluster.yaml": lambda: k8s_invocations("deploy/kubernetes/raycluster.yaml"),
    "docker/Dockerfile": lambda: [
        Invocation("docker/Dockerfile ENTRYPOINT+CMD", "batchd", dockerfile_entry("docker/Dockerfile")[1])
    ],
    "docker/Dockerfile.cpu": lambda: [
        Invocation(
            "docker/Dockerfile.cpu ENTRYPOINT+CMD", "batchd", dockerfile_entry("docker/Dockerfile.cpu")[1]
        )
    ],
    "docs/deployment.md": docs_invocations,
}
# The least each file must yield: a refactor that hides commands from the extractor fails here.
MIN_INVOCATIONS = {
    "deploy/ray/start-batchd.sh": {"batchd": 2},
    "deploy/ray/start-node-agent.sh": {"batchd": 1},
    "deploy/torchrun/launch.sh": {"torchrun": 1},
    "deploy/ray/cluster.yaml": {"batchd": 1},
    "docker/compose.yaml": {"batchd": 2, "torchrun": 1},
    "docker/compose.cpu.yaml": {"batchd": 2, "torchrun": 1},
    "deploy/kubernetes/rayjob.yaml": {"batchd": 1, "torchrun": 1},
    "deploy/kubernetes/raycluster.yaml": {"batchd": 1},
    "docker/Dockerfile": {"batchd": 1},
    "docker/Dockerfile.cpu": {"batchd": 1},
    "docs/deployment.md": {"batchd": 4, "torchrun": 2},
}
# The files that deploy node agents: each must start at least one `batchd node` (and its trainers use
# --node-agent, where the file starts trainers).
NODE_AGENT_SOURCES = {
    "deploy/ray/start-node-agent.sh",
    "docker/compose.yaml",
    "docker/compose.cpu.yaml",
    "deploy/kubernetes/rayjob.yaml",
    "deploy/kubernetes/raycluster.yaml",
    "docs/deployment.md",
}
NODE_AGENT_TRAINERS = {
    "docker/compose.yaml",
    "docker/compose.cpu.yaml",
    "deploy/kubernetes/rayjob.yaml",
    "docs/deployment.md",
}


# -- the command lines ------------------------------------------------------------------------------
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_every_command_parses(source: str) -> None:
    invocations = SOURCES[source]()
    counts = {p: sum(inv.program == p for inv in invocations) for p in ("batchd", "torchrun")}
    for program, least in MIN_INVOCATIONS[source].items():
        assert counts[program] >= least, f"{source}: expected >= {least} `{program}` commands, found {counts}"
    bad = failures(invocations)
    assert not bad, "commands the CLI rejects:\n" + "\n".join(bad)
    if source in NODE_AGENT_SOURCES:
        assert any(inv.program == "batchd" and inv.argv[:1] == ["node"] for inv in invocations), (
            f"{source}: no `batchd node` command"
        )
    if source in NODE_AGENT_TRAINERS:
        assert any("--node-agent" in inv.argv for inv in invocations if inv.program == "torchrun"), (
            f"{source}: no trainer uses --node-agent"
        )


def test_checker_rejects_unknown_flags_and_bad_values() -> None:
    good = "batchd rank --rank 0 --coordinator 127.0.0.1:7000 --world-size 2 --token-budget 64 --port 7100"
    script = f"#!/bin/bash\n# example: P=7101\n{good} \\\n    --no-such-flag 1 >log 2>&1 &\n"
    (inv,) = shell_invocations(script, example_values(script), "synthetic.sh")
    assert inv.argv[-2:] == ["--no-such-flag", "1"]  # joined continuation, redirections dropped
    assert "unrecognized arguments: --no-such-flag 1" in check(inv)
    assert check(Invocation("x", "batchd", shlex.split(good)[1:])) is None
    assert "invalid choice" in check(
        Invocation(
            "x", "batchd", ["coordinator", "--world-size", "2", "--token-budget", "8", "--policy", "fastest"]
        )
    )
    bad_torchrun = Invocation(
        "x", "torchrun", ["--nproc-per-node", "2", "-m", "batchd.train", "--base-port", "7100", "--bogus"]
    )
    assert "trainer: " in check(bad_torchrun) and "--bogus" in check(bad_torchrun)
    assert "torchrun: " in check(Invocation("x", "torchrun", ["--nprocs-per-nod", "2", "train.py"]))


def test_expansion_is_strict() -> None:
    values = {"BASE": "7100", "r": "1", "target": "--rank-host h --base-port 1"}
    assert expand_word("$((BASE + r))", values) == ["7101"]
    assert expand_word("${target[@]}", values) == ["--rank-host", "h", "--base-port", "1"]
    assert expand_word("${MISSING:-x}/$BASE", values) == ["x/7100"]
    with pytest.raises(Undocumented, match="MISSING"):
        expand_word("--port=$MISSING", values)
    with pytest.raises(Undocumented, match="MISSING"):
        shell_invocations('batchd rank --port "$MISSING"\n', {}, "synthetic.sh")
    # not in command position: a path that ends in batchd, and an echo of a batchd command line
    assert shell_invocations("pip install -e ~/batchd && echo batchd rank --bogus\n", {}, "s") == []


# -- job configs ------------------------------------------------------------------------------------
def all_configs() -> dict[str, str]:
    out = {rel: read(rel) for rel in TOML_CONFIGS}
    out.update({f"{rel} ConfigMap": configmap_toml(rel) for rel in K8S})
    return out


@pytest.mark.parametrize("name", sorted(all_configs()))
def test_job_configs_load_and_validate(name: str, tmp_path: Path) -> None:
    text = all_configs()[name]
    raw = tomllib.loads(text)
    assert raw["job"]["world_size"] >= 1 and raw["job"]["token_budget"] >= 1
    try:
        from batchd.config import load_config
    except ImportError:
        pytest.skip("batchd.config.load_config does not exist yet (tomllib parse checked only)")
    path = tmp_path / "job.toml"
    path.write_text(text)
    try:
        cfg = load_config(path, check_files=False)
    except ValueError as exc:
        pytest.fail(f"{name}: the config loader rejects it: {exc}")
    assert cfg.job.world_size == raw["job"]["world_size"]
    assert cfg.rank.base_port == 7100 and cfg.coordinator.port == 7000, "the files below assume these ports"


def test_config_validation_rejects_a_bad_config(tmp_path: Path) -> None:
    load_config = pytest.importorskip("batchd.config", reason="batchd.config not there yet").load_config
    path = tmp_path / "job.toml"
    path.write_text(read("docker/job.toml").replace('name = "balanced"', 'name = "fastest"'))
    with pytest.raises(ValueError, match="policy"):
        load_config(path, check_files=False)


# -- consistency between a job's config and the files that start it ---------------------------------
def test_compose_matches_its_config() -> None:
    """One GPU host: the coordinator, one node agent serving every rank, the trainers connecting to it."""
    cfg = tomllib.loads(read("docker/job.toml"))
    world, base, mbase = cfg["job"]["world_size"], cfg["rank"]["base_port"], cfg["rank"]["metrics_base_port"]
    services = compose_interpolate(compose()["services"])
    by_service = {inv.source.split("services.")[1]: inv for inv in compose_invocations()}
    assert not [n for n in services if n.startswith(("rank-", "ray-"))], "no per-rank services or Ray head"
    assert "ray_address" not in cfg["data"], "one host: the node agent's embedded Ray"
    agent = by_service["node-agent"].argv
    assert agent[0] == "node"
    opt = dict(itertools.pairwise(agent[1:]))
    assert opt["--local-ranks"] == str(world) and opt["--node-rank"] == "0", (
        "one agent serves ranks 0..world-1"
    )
    assert opt["--port"] == str(base) and opt["--metrics-port"] == str(mbase)
    assert opt["--coordinator"] == cfg["coordinator"]["address"]
    assert opt["--state-dir"].startswith(cfg["rank"]["state_dir"])  # the batchd-state volume: restartable
    assert "--ray-address" not in opt and "--rank" not in opt
    assert f":{mbase}/metrics" in " ".join(services["node-agent"]["healthcheck"]["test"])
    coord = by_service["coordinator"].argv
    assert f":{dict(itertools.pairwise(coord))['--metrics-port']}/metrics" in " ".join(
        services["coordinator"]["healthcheck"]["test"]
    )
    assert cfg["coordinator"]["address"] == f"127.0.0.1:{cfg['coordinator']['port']}", "host networking"
    trainer = by_service["trainer"].argv
    from torch.distributed.run import get_args_parser

    targs = get_args_parser().parse_args(trainer)
    assert int(targs.nnodes) * int(targs.nproc_per_node) == world
    assert int(targs.nproc_per_node) == int(opt["--local-ranks"])
    assert targs.rdzv_backend == "static" and int(targs.node_rank) == int(opt["--node-rank"])
    targ = dict(itertools.pairwise(targs.training_script_args))
    assert targ["--node-agent"] == f"127.0.0.1:{base}"
    assert "--rank-services" not in targ and "--base-port" not in targ
    assert services["trainer"]["depends_on"] == {"node-agent": {"condition": "service_healthy"}}
    (gpus,) = services["trainer"]["deploy"]["resources"]["reservations"]["devices"]
    assert "gpu" in gpus["capabilities"] and gpus["count"] == int(targs.nproc_per_node)
    for name, svc in services.items():
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown service {dep}"
        secrets = [s if isinstance(s, str) else s["source"] for s in svc.get("secrets", [])]
        assert set(secrets) <= set(compose()["secrets"]), f"{name}: unknown secret"
        assert secrets == ["batchd_token"], f"{name} does not get the token"
        if name != "trainer":
            assert "healthcheck" in svc, f"service {name} has no healthcheck"
        # host networking: service names do not resolve, published ports are invalid
        assert svc.get("network_mode") == "host", f"service {name} is not on host networking"
        assert "ports" not in svc and "networks" not in svc, (
            f"service {name}: ports/networks with host networking"
        )
        argv = by_service[name].argv
        assert not [a for a in argv if re.match(rf"({'|'.join(services)}):\d+$", a)], (
            f"{name} names a service as a host: {argv}"
        )


def test_compose_cpu_override() -> None:
    """docker/compose.cpu.yaml: the same job with the trainer on the CPU image (gloo, no GPU reservation),
    logging the sample ids and summaries deploy/smoke/compose.sh checks."""
    base, override = compose(), compose("docker/compose.cpu.yaml")
    assert set(override["services"]) <= set(base["services"]), "the override adds no service"
    merged = compose_interpolate(compose_cpu()["services"])
    trainer = merged["trainer"]
    assert (
        trainer["image"] == "batchd:0.1.0-cpu" and trainer["build"]["dockerfile"] == "docker/Dockerfile.cpu"
    )
    assert "deploy" not in trainer, "no GPU reservation on a CPU host"
    assert compose_interpolate(base["services"])["trainer"]["deploy"]["resources"]["reservations"]["devices"]
    assert all(svc["network_mode"] == "host" and "ports" not in svc for svc in merged.values())
    assert all(merged[n]["healthcheck"]["test"] for n in ("coordinator", "node-agent"))
    (inv,) = [i for i in compose_invocations(cpu=True) if i.source.endswith("services.trainer")]
    from torch.distributed.run import get_args_parser

    targs = get_args_parser().parse_args(inv.argv)
    args = train.build_parser().parse_args(targs.training_script_args)
    assert args.backend == "gloo" and args.node_agent == "127.0.0.1:7100"
    assert int(targs.nproc_per_node) == tomllib.loads(read("docker/job.toml"))["job"]["world_size"]
    mounts = {v.split(":")[1] for v in trainer["volumes"]}
    for path in (args.ids_log, args.summary, args.checkpoint):
        assert any(path == m or path.startswith(m + "/") for m in mounts), f"{path} is not on a host mount"
    assert "{rank}" in args.ids_log and "{rank}" in args.summary
    smoke = read("deploy/smoke/compose.sh")
    assert "docker/compose.cpu.yaml" in smoke and "network_mode" not in smoke


def test_compose_variables_are_in_env_example() -> None:
    used = set(re.findall(r"(?<!\$)\$\{(\w+)", read("docker/compose.yaml") + read("docker/compose.cpu.yaml")))
    used |= {s["environment"] for s in compose()["secrets"].values() if "environment" in s}
    example = {m.group(1) for m in re.finditer(r"^(\w+)=", read("docker/env.example"), re.MULTILINE)}
    assert used == example, f"compose uses {sorted(used)}, env.example sets {sorted(example)}"


def test_ray_cluster_config() -> None:
    cfg = cluster_yaml()
    job = tomllib.loads(read("deploy/ray/job.toml"))
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types and cfg["provider"]["type"]
    gpu = [t for t in types.values() if t.get("resources", {}).get("GPU")]
    assert gpu, "no GPU worker node type"
    trainers = sum(t["min_workers"] * t["resources"]["GPU"] for t in gpu)
    assert trainers == job["job"]["world_size"], f"{trainers=} GPUs but world_size={job['job']['world_size']}"
    assert types[cfg["head_node_type"]]["resources"] == {"CPU": 0}, "no actors on the coordinator's head"
    for t in gpu:  # each GPU node's agent runs its ranks' actors there (soft affinity): Ray needs its CPUs
        assert t["resources"].get("CPU", 0) >= job["data"]["num_actors"] * t["resources"]["GPU"], t
    assert cfg["max_workers"] >= sum(t["min_workers"] for t in types.values() if "min_workers" in t)
    setup = " ".join(cfg["setup_commands"])
    assert "pip install" in setup and "~/batchd" in setup and cfg["file_mounts"]["~/batchd"] == "."
    assert any("ray start --head" in c for c in cfg["head_start_ray_commands"])
    assert any("--address=$RAY_HEAD_IP:6379" in c for c in cfg["worker_start_ray_commands"])


# -- KubeRay manifests ------------------------------------------------------------------------------
@pytest.mark.parametrize("rel", K8S)
def test_kuberay_manifest(rel: str) -> None:
    docs = k8s_docs(rel)
    ray = [d for d in docs if d["kind"] in ("RayCluster", "RayJob")]
    assert len(ray) == 1 and ray[0]["apiVersion"] == "ray.io/v1"
    spec = ray[0]["spec"]
    cluster = spec["rayClusterSpec"] if ray[0]["kind"] == "RayJob" else spec
    assert cluster["headGroupSpec"]["template"]["spec"]["containers"]
    assert cluster["workerGroupSpecs"], "no worker groups"
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        params = group.get("rayStartParams", {})
        assert all(isinstance(v, str) for v in params.values()), f"rayStartParams must be strings: {params}"
    for g in cluster["workerGroupSpecs"]:
        assert g["groupName"] and g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
    world = tomllib.loads(configmap_toml(rel))["job"]["world_size"]
    gpus = 0
    pods = [p for d in docs for p in pod_specs(d)]
    for where, pod, _ in pods:
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            assert c.get("image") and "batchd" in c["image"], f"{rel} {where} {c['name']}: image"
            names = [p["name"] for p in c.get("ports", [])]
            assert len(names) == len(set(names)) and all(len(n) <= 15 for n in names), names
            res = c.get("resources", {})
            if "nvidia.com/gpu" in res.get("limits", {}):
                assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"]
                env = container_env(c)
                replicas = next(
                    (g["replicas"] for g in cluster["workerGroupSpecs"] if g["template"]["spec"] is pod), None
                )
                gpus += res["limits"]["nvidia.com/gpu"] * (replicas or int(env.get("NNODES", 1)))
                if "NPROC_PER_NODE" in env:
                    assert int(env["NPROC_PER_NODE"]) == res["limits"]["nvidia.com/gpu"]
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in pod.get("volumes", [])}, f"{where}: unknown volume"
    assert gpus == world, f"{rel}: {gpus} GPUs requested for trainers but world_size={world}"
    for svc in (d for d in docs if d["kind"] == "Service"):
        sel = svc["spec"]["selector"]
        assert any(sel.items() <= labels.items() for _, _, labels in pods), (
            f"Service {svc['metadata']['name']}"
        )
        ports = {p["port"] for p in svc["spec"]["ports"]}
        if "coordinator" in {p["name"] for p in svc["spec"]["ports"]}:
            assert {7000, 9100} <= ports and not ports & set(range(7100, 7100 + world)), (
                "the head serves the coordinator only; ranks are served by the node agents"
            )
    check_node_agents(rel, docs, world)


def check_node_agents(rel: str, docs: list[dict[str, Any]], world: int) -> None:
    """Each GPU pod: a node-agent sidecar serving the pod's GPUs' ranks, next to the trainer container
    that reaches it over localhost; the agent joins the RayCluster's Ray and advertises the pod IP."""
    cm = tomllib.loads(configmap_toml(rel))
    base = cm["rank"]["base_port"]
    gpu_pods = [
        (w, pod)
        for d in docs
        for w, pod, _ in pod_specs(d)
        if any("nvidia.com/gpu" in c.get("resources", {}).get("limits", {}) for c in pod["containers"])
    ]
    assert gpu_pods, f"{rel}: no GPU pod"
    for where, pod in gpu_pods:
        sidecars = [*pod.get("initContainers", []), *pod["containers"]]
        assert "node-agent" in [c["name"] for c in sidecars], f"{rel} {where}: no node-agent sidecar"
        agent = next(c for c in sidecars if c["name"] == "node-agent")
        if agent in pod.get("initContainers", []):  # a native sidecar, or the pod would wait for it forever
            assert agent.get("restartPolicy") == "Always", f"{rel} {where}: node-agent init container"
        assert agent is not pod["containers"][0] or not where.startswith("workerGroupSpecs"), (
            "KubeRay replaces the first container's command with ray start"
        )
        gpus = sum(
            c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0) for c in pod["containers"]
        )
        assert "nvidia.com/gpu" not in agent.get("resources", {}).get("limits", {}), (
            "the GPUs are the trainers'"
        )
        assert {p["containerPort"] for p in agent.get("ports", [])} >= {base}
        env = container_env(agent)
        assert env.get("LOCAL_RANKS") == str(gpus), (
            f"{rel} {where}: LOCAL_RANKS must be the pod's {gpus} GPUs"
        )
        assert any(
            e["name"] == "ADVERTISE"
            and e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP"
            for e in agent["env"]
        ), f"{rel} {where}: ADVERTISE = the pod IP"
        (inv,) = [
            i
            for i in k8s_invocations(rel)
            if i.source.startswith(f"{rel} {where} node-agent") and i.program == "batchd"
        ]
        assert inv.argv[0] == "node", inv
        opt = dict(itertools.pairwise(inv.argv[1:]))
        assert opt["--port"] == str(base) and opt["--local-ranks"] == str(gpus)
        assert opt["--coordinator"] == cm["coordinator"]["address"]
        assert "--node-rank" in opt and "--advertise" in opt
        trainer = next((c for c in pod["containers"] if c["name"] == "trainer"), None)
        if trainer is not None:  # the Job's pods; raycluster.yaml's trainers are exec'd (docs/deployment.md)
            tenv = container_env(trainer)
            from torch.distributed.run import get_args_parser

            targs = get_args_parser().parse_args(launch_argv(tenv, []))
            assert targs.training_script_args == ["--node-agent", f"127.0.0.1:{base}"], tenv
            assert targs.rdzv_backend == "static" and str(targs.node_rank) == env["NODE_RANK"], targs
            assert tenv["NPROC_PER_NODE"] == str(gpus) and tenv["RDZV_BACKEND"] == "static"
            assert tenv["NODE_RANK"] == env["NODE_RANK"], "torchrun's node rank = the agent's"


def test_rayjob_entrypoint_runs_the_start_script_on_the_mounted_config() -> None:
    docs = k8s_docs("deploy/kubernetes/rayjob.yaml")
    (job,) = [d for d in docs if d["kind"] == "RayJob"]
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[0] == "bash" and repo_path_of_image_path(argv[1]) == REPO / "deploy/ray/start-batchd.sh"
    assert argv[2] == "--coordinator-only", "the head runs the coordinator; the node agents the ranks"
    del argv[2]
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    mounts = {m["mountPath"]: m for m in head["containers"][0]["volumeMounts"]}
    assert argv[2] in mounts and mounts[argv[2]]["subPath"] == "job.toml"
    volume = {v["name"]: v for v in head["volumes"]}[mounts[argv[2]]["name"]]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert volume["configMap"]["name"] == cm["metadata"]["name"]
    token = tomllib.loads(cm["data"]["job.toml"])["security"]["token_file"]
    assert any(token.startswith(path + "/") for path in mounts), f"{token=} is not mounted on the head"
    for _, pod, _ in pod_specs(next(d for d in docs if d["kind"] == "Job")):
        for c in pod["containers"]:
            if c["command"][:2] != ["bash", "-c"]:
                assert repo_path_of_image_path(c["command"][1]).is_file()


# -- Dockerfiles, scripts ---------------------------------------------------------------------------
def dockerignored(rel: str) -> bool:
    patterns = [p.strip() for p in read(".dockerignore").splitlines() if p.strip() and not p.startswith("#")]
    parts = Path(rel).parts
    return any(fnmatch.fnmatch("/".join(parts[: i + 1]), p) for p in patterns for i in range(len(parts)))


@pytest.mark.parametrize("rel", DOCKERFILES)
def test_dockerfile(rel: str) -> None:
    ins = dockerfile_instructions(rel)
    args = {m.group(1): m.group(2) for op, a in ins if op == "ARG" and (m := re.match(r"(\w+)=(\S+)", a))}
    bases = [a.split()[0] for op, a in ins if op == "FROM"]
    bases = [re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], b) for b in bases]
    final_from = [a.split()[0] for op, a in ins if op == "FROM"][-1]
    assert final_from == "${BASE}" and "BASE" in args, f"{rel}: the runtime's base is the build arg BASE"
    assert [op for op, a in ins].index("ARG") < [op for op, a in ins].index("FROM")
    if rel.endswith(".cpu"):
        assert bases[-1] == "python:3.11-slim"
        assert any("whl/cpu" in v for v in args.values())
    else:
        assert bases[-1].startswith("nvidia/cuda:")
        assert any(re.search(r"whl/cu\d+", v) for v in args.values())
    assert dockerfile_entry(rel)[0] == ["batchd"]
    for op, a in ins:
        if op == "COPY" and not a.startswith("--from"):
            *srcs, _ = a.split()
            for src in srcs:
                assert (REPO / src).exists(), f"{rel}: COPY {src} does not exist"
                assert not dockerignored(src), f"{rel}: COPY {src} is excluded by .dockerignore"
    pyproject = tomllib.loads(read("pyproject.toml"))
    copied = [a.split()[0].rstrip("/") for op, a in ins if op == "COPY"]
    for pkg_dir in pyproject["tool"]["setuptools"][
        "package-dir"
    ].values():  # a subpackage ships with its parent
        assert any(pkg_dir == c or pkg_dir.startswith(c + "/") for c in copied), (
            f"{rel} misses COPY {pkg_dir}"
        )


@pytest.mark.parametrize("rel", SHELL_SCRIPTS)
def test_shell_script_syntax(rel: str) -> None:
    path = REPO / rel
    assert os.access(path, os.X_OK), f"{rel} is not executable"
    assert read(rel).startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in read(rel)
    subprocess.run(["bash", "-n", str(path)], check=True)


@pytest.mark.parametrize("script", ["deploy/ray/start-batchd.sh", "deploy/ray/start-node-agent.sh"])
def test_start_script_reads_the_layout_from_the_config(tmp_path: Path, script: str) -> None:
    """Runs the script's config-reading part (its here-document) on each config; checks the layout."""
    text = read(script)
    program = re.search(r"<<'PY'\n(.*?)\nPY\n", text, re.DOTALL).group(1)
    for name, toml in all_configs().items():
        path = tmp_path / "job.toml"
        path.write_text(toml)
        out = subprocess.run(
            [sys.executable, "-c", program, str(path)], capture_output=True, text=True, check=True
        )
        layout = dict(line.split("=", 1) for line in out.stdout.split())
        cfg = tomllib.loads(toml)
        if script.endswith("start-batchd.sh"):
            assert layout["WORLD_SIZE"] == str(cfg["job"]["world_size"]), name
        assert layout["RANK_BASE_PORT"] == str(cfg["rank"]["base_port"])
        assert layout["RANK_METRICS_BASE_PORT"] == str(cfg["rank"]["metrics_base_port"])
        assert layout["CONFIG_COORD_ADDRESS"] == cfg["coordinator"]["address"]
        assert layout["COORD_PORT"] == str(cfg["coordinator"]["port"])


LAUNCH_ENV_KEYS = (
    "LAUNCH_MODE",
    "NODE_AGENT",
    "BATCHD_NODE_AGENT",
    "NODE_RANK",
    "RANK_SERVICES",
    "RANK_HOST",
    "BASE_PORT",
    "RDZV_BACKEND",
    "NNODES",
    "NPROC_PER_NODE",
    "RDZV_ENDPOINT",
    "RDZV_ID",
)


@pytest.mark.parametrize(
    "env, target, rdzv, node_rank",
    [
        (
            {"NODE_AGENT": "127.0.0.1:7300", "NODE_RANK": "1"},
            ["--node-agent", "127.0.0.1:7300"],
            "static",
            "1",
        ),
        ({"LAUNCH_MODE": "node-agent"}, ["--node-agent", "127.0.0.1:7100"], "static", "0"),
        ({"BATCHD_NODE_AGENT": "127.0.0.1:7200"}, ["--node-agent", "127.0.0.1:7200"], "static", "0"),
        ({"RANK_SERVICES": "a:1,b:2"}, ["--rank-services", "a:1,b:2"], "c10d", None),
        ({"RANK_HOST": "h", "BASE_PORT": "7400"}, ["--rank-host", "h", "--base-port", "7400"], "c10d", None),
        ({}, ["--rank-host", "127.0.0.1", "--base-port", "7100"], "c10d", None),
    ],
)
def test_launch_modes(env: dict[str, str], target: list[str], rdzv: str, node_rank: str | None) -> None:
    """deploy/torchrun/launch.sh run up to its exec: the data target and rendezvous of each mode, and
    the command parses (torchrun's parser, then the trainer's)."""
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV_KEYS}
    argv = launch_argv({**base, "NPROC_PER_NODE": "2", **env}, ["--checkpoint", "/ckpt"])
    assert check(Invocation("launch.sh", "torchrun", argv)) is None
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(argv)
    assert args.rdzv_backend == rdzv and args.training_script_args == [*target, "--checkpoint", "/ckpt"]
    assert ("--node-rank" in argv) == (node_rank is not None)
    if node_rank is not None:
        assert str(args.node_rank) == node_rank


def test_launch_rejects_an_unknown_mode() -> None:
    run = subprocess.run(
        ["bash", str(REPO / "deploy/torchrun/launch.sh")],
        env={**os.environ, "TORCHRUN": "true", "LAUNCH_MODE": "nodes"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 2 and "LAUNCH_MODE" in run.stderr


def test_start_node_agent_command() -> None:
    """deploy/ray/start-node-agent.sh run up to its exec: the agent's command line from config + env,
    parsed by the real `batchd node` parser."""
    base = {
        k: v
        for k, v in os.environ.items()
        if k
        not in ("COORD_ADDRESS", "LOCAL_RANKS", "LOCAL_WORLD_SIZE", "NODE_RANK", "ADVERTISE", "RAY_ADDRESS")
    }
    env = {
        **base,
        "PYTHON": sys.executable,
        "NODE_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "NODE_NAME": "gpu-1",
        "ADVERTISE": "10.0.0.3",
    }
    script = "deploy/ray/start-node-agent.sh"
    argv = exec_argv(script, [str(REPO / "docker/job.toml"), "--state-dir", "/s"], env, "BATCHD")
    assert check(Invocation("start-node-agent.sh", "batchd", argv)) is None
    cfg = tomllib.loads(read("docker/job.toml"))
    assert argv[0] == "node"
    opt = dict(itertools.pairwise(argv[1:]))
    assert opt["--coordinator"] == cfg["coordinator"]["address"] and opt["--local-ranks"] == "4"
    assert opt["--node-rank"] == "1" and opt["--advertise"] == "10.0.0.3" and opt["--name"] == "gpu-1"
    assert opt["--port"] == str(cfg["rank"]["base_port"]) and opt["--state-dir"] == "/s"
    assert "--ray-address" not in opt
    argv = exec_argv(
        script,
        [str(REPO / "deploy/ray/job.toml")],
        {**env, "COORD_ADDRESS": "10.0.0.1:7000", "RAY_ADDRESS": "auto"},
        "BATCHD",
    )
    assert check(Invocation("start-node-agent.sh", "batchd", argv)) is None
    opt = dict(itertools.pairwise(argv[1:]))
    assert opt["--coordinator"] == "10.0.0.1:7000" and opt["--ray-address"] == "auto"
    run = subprocess.run(
        ["bash", str(REPO / script), str(REPO / "docker/job.toml")],
        env={**env, "BATCHD": "true", "NODE_RANK": ""},
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 2 and "NODE_RANK" in run.stderr


def test_node_agent_interface() -> None:
    """What the deploy files need of `batchd node` and `batchd.train --node-agent`."""
    parser = build_parser()
    full = [
        "node",
        "--coordinator",
        "10.0.0.1:7000",
        "--local-ranks",
        "4",
        "--node-rank",
        "1",
        "--name",
        "gpu-1",
        "--host",
        "0.0.0.0",
        "--port",
        "7100",
        "--advertise",
        "10.0.0.3",
        "--port-file",
        "/tmp/p.json",
        "--state-dir",
        "/var/lib/batchd",
        "--dataset",
        "/data/train.parquet",
        "--tokenizer",
        "/models/t.json",
        "--num-actors",
        "2",
        "--ray-address",
        "auto",
        "--config",
        "job.toml",
        "--metrics-port",
        "9200",
        "--metrics-host",
        "0.0.0.0",
        "--token-file",
        "/t",
        "--tls-cert",
        "c",
        "--tls-key",
        "k",
        "--tls-ca",
        "a",
        "--log-format",
        "json",
    ]
    assert parse_error(parser, full) is None
    args = parser.parse_args(full)
    assert (args.local_ranks, args.node_rank, args.port, args.advertise) == (4, 1, 7100, "10.0.0.3")
    assert parse_error(parser, ["node", "--coordinator", "h:7000", "--lengths", "lengths.txt"]) is None
    assert parse_error(parser, ["node", "--local-ranks", "2"]) is None, (
        "K, G and the coordinator have defaults"
    )
    assert "--rank" in (parse_error(parser, ["node", "--rank", "0"]) or ""), "a node agent has no --rank"
    assert parse_error(parser, ["node", "--local-ranks", "four"])
    trainer = train.build_parser()
    assert parse_error(trainer, ["--node-agent", "127.0.0.1:7100"]) is None
    assert trainer.parse_args(["--node-agent", "127.0.0.1:7100"]).node_agent == "127.0.0.1:7100"
    assert parse_error(trainer, ["--rank-services", "a:1,b:2"]) is None, "per-rank services stay supported"
    assert parse_error(trainer, ["--base-port", "7100"]) is None


# -- the trainer entry point ------------------------------------------------------------------------
def test_trainer_module_imports_and_resolves_addresses() -> None:
    assert callable(train.main) and callable(train.build_parser)
    assert train.rank_service_address(1, 2, rank_services="a:1,b:2") == "b:2"
    assert train.rank_service_address(3, 4, rank_services="rank-{rank}:7100") == "rank-3:7100"
    assert train.rank_service_address(1, 2, rank_host="h", base_port=7100) == "h:7101"
    with pytest.raises(ValueError, match="world_size=2"):
        train.rank_service_address(0, 2, rank_services="a:1")
    with pytest.raises(ValueError, match="either"):
        train.rank_service_address(0, 2)
    with pytest.raises(ValueError, match="rank must be"):
        train.rank_service_address(2, 2, base_port=7100)


def test_trainer_refuses_to_start_outside_torchrun(monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="RANK"):
        train.main(["--base-port", "7100"])


def test_elastic_trainer_refuses_torchruns_shared_store(monkeypatch, capsys, tmp_path) -> None:
    """--elastic under a torchrun that shares its rendezvous store with the workers (torch's default) would
    let a restarted group read the last group's addresses: exit 2 in one line naming the variable, before
    any service starts."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    (tmp_path / "job.toml").write_text("[coordinator]\nport = 1\n[rank]\nbase_port = 2\n")
    argv = ["--elastic", str(tmp_path / "state"), "--config", str(tmp_path / "job.toml")]
    assert train.main([*argv, "--checkpoint", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert "--elastic needs torchrun started with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in err, err
    assert not (tmp_path / "state").exists()  # no service started


def test_a_process_group_init_that_outlives_its_timeout_ends_the_trainer(tmp_path) -> None:
    """The watchdog on init_process_group: a rank whose peer never comes exits 1 naming the stall (here the
    watchdog's grace is set below gloo's own timeout, so that it, not gloo, ends the wait)."""
    script = (
        "import sys; from batchd import train; train.INIT_GRACE_S = -29.0; "
        "train._init_process_group('gloo', 30.0, 0); sys.exit(0)"
    )
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(free_block(1))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "[rank 0] batchd.train: error: the gloo process group did not form within 1s" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("step_time", [0.0, 5.0])
def test_start_and_launch_scripts_run_a_job(tmp_path: Path, step_time: float) -> None:
    """deploy/ray/start-batchd.sh (coordinator + 2 rank services from a config, with a bearer token) and
    deploy/torchrun/launch.sh (torchrun -> 2 x batchd.train on gloo) run a 2-epoch job for real.

    With 5 s trainer steps and a 5 s lease the job still ends cleanly: a slow trainer never fails a job
    (the coordinator stays until every trainer took its last step; leases judge liveness only)."""
    from batchd.demo import demo_lengths

    world = 2
    samples = 160 if step_time == 0 else 40
    (tmp_path / "lengths.txt").write_text("\n".join(map(str, demo_lengths(samples))) + "\n")
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    token.chmod(0o600)
    cport, base, mbase = free_block(1), free_block(world), free_block(world + 1)
    config = tmp_path / "job.toml"
    config.write_text(f"""
[job]
world_size = {world}
token_budget = 1024
policy = "balanced"
window = 64
depth = 4
epochs = 2
[data]
lengths = "lengths.txt"
[coordinator]
host = "127.0.0.1"
port = {cport}
metrics_port = {mbase + world}
lease_s = 5.0
[rank]
host = "127.0.0.1"
base_port = {base}
metrics_base_port = {mbase}
state_dir = "state"
[security]
token_file = "token"
""")
    bindir = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": f"{bindir}:{os.environ.get('PATH', '')}",
        "PYTHON": sys.executable,
        "BATCHD_LOG_DIR": str(tmp_path / "logs"),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "COORD_ADDRESS", "RANK_SERVICES"):
        env.pop(var, None)
    services = subprocess.Popen(
        ["bash", str(REPO / "deploy/ray/start-batchd.sh"), str(config)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        trainer_env = {
            **env,
            "NPROC_PER_NODE": str(world),
            "RDZV_ENDPOINT": f"127.0.0.1:{free_block(1)}",
            "RANK_HOST": "127.0.0.1",
            "BASE_PORT": str(base),
            "TORCHRUN": f"{sys.executable} -m torch.distributed.run",
        }
        run = subprocess.run(
            [
                "bash",
                str(REPO / "deploy/torchrun/launch.sh"),
                "--d-model",
                "32",
                "--n-layers",
                "1",
                "--n-heads",
                "2",
                "--token-file",
                str(token),
                "--checkpoint",
                str(tmp_path / "ckpt"),
                "--summary",
                str(tmp_path / "summary-{rank}.json"),
                "--step-time",
                str(step_time),
            ],
            env=trainer_env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        out, _ = services.communicate(timeout=60)  # the services exit on their own when the epoch ends
    finally:
        if services.poll() is None:
            services.terminate()
            services.wait(10)
    logs = "\n".join(
        f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted((tmp_path / "logs").glob("*.log"))
    )
    assert run.returncode == 0, f"{run.stderr[-3000:]}\n--- start-batchd.sh\n{out}\n{logs}"
    assert services.returncode == 0, f"{out}\n{logs}"
    results = [json.loads((tmp_path / f"summary-{r}.json").read_text()) for r in range(world)]
    assert [r["rank"] for r in results] == [0, 1]
    assert results[0]["steps"] == results[1]["steps"] > 0, results  # aligned: same step count per rank
    if step_time:  # the slow trainers' last steps outlast the lease many times over
        assert results[0]["steps"] * step_time > 4 * 5.0, results
    # the trainers ran the job's 2 epochs (no --epochs: they asked their rank service)
    assert results[0]["epoch_steps"] == results[1]["epoch_steps"] and len(results[0]["epoch_steps"]) == 2
    assert all(r["epoch"] == 1 and r["steps"] == sum(r["epoch_steps"]) for r in results)
    assert all(r["backend"] == "gloo" and r["world_size"] == world for r in results)
    assert [r["rank_service"] for r in results] == [f"127.0.0.1:{base + r}" for r in range(world)]
    assert all((tmp_path / "ckpt" / f"rank-{r}.pt").is_file() for r in range(world))
    assert len(list((tmp_path / "state").iterdir())) == world, (
        "one journal per rank (state_dir of the config)"
    )


def test_compose_config_with_docker_compose(tmp_path: Path) -> None:
    """`docker compose config` as an extra check, where the compose plugin is installed."""
    docker = shutil.which("docker")
    if (
        docker is None
        or subprocess.run([docker, "compose", "version"], capture_output=True, check=False).returncode != 0
    ):
        pytest.skip("docker compose is not installed here (the YAML checks above still ran)")
    for extra in ([], ["-f", str(REPO / "docker/compose.cpu.yaml")]):
        run = subprocess.run(
            [docker, "compose", "-f", str(REPO / "docker/compose.yaml"), *extra, "config", "-q"],
            capture_output=True,
            text=True,
            env={**os.environ, "BATCHD_TOKEN": "t"},
            check=False,
        )
        assert run.returncode == 0, run.stderr
