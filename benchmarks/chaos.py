"""Chaos suite: seeded batchd jobs as real processes, with parties killed (SIGKILL) and restarted mid-job.

Each job runs the real command lines on loopback: one `batchd coordinator`, N `batchd rank` services
(each with `--state-dir`; `--lengths FILE` synthetic samples, or `--dataset` on a small generated demo
dataset preprocessed by Ray actors, one per rank, on a Ray this process starts) and N trainers
(`python -m batchd.train`, gloo DDP on CPU, `--checkpoint DIR --checkpoint-every K` (default 5: a
killed trainer's group resumes up to K steps back, and the rank services send those steps again), a per-job
`--step-time` drawn log-uniformly from [--min-step-time, --max-step-time], and `--ids-log`: one fsynced
JSON line per step, written as the batch arrives, before it is trained).

At seeded points of a job's progress (steps every rank has logged) it kills one party of a kind:

- `actor`: a Ray preprocessing actor (`ray::PreprocessWorker` processes under this process's Ray;
  the actor's pid). Nothing is restarted by hand: the pool's actors have `max_restarts=-1` and RaySource
  resubmits the tasks that died with them (service/preprocess/_pool.py, _ray_source.py).
- `rank`: a rank service, restarted with the same command (same `--port`, same `--state-dir`).
- `coordinator`: the coordinator, restarted with the same command, which includes `--state-dir`.
  Skipped, with a note, while `batchd coordinator --help` has no `--state-dir` (no journal: a killed
  coordinator is unrecoverable by design).
- `trainer`: one trainer. A gloo process group cannot take a new member, so the harness does what
  torchrun's agent does on a worker failure (`--max-restarts`): it stops the other trainers (SIGTERM)
  and restarts all N with the same commands (a fresh rendezvous port); each resumes from its own
  checkpoint (`BatchClient.state_dict`), the group from the furthest saved step (batchd/train.py).
- `trainer-gone` (not in the defaults): one trainer killed and never restarted. Unrecoverable by
  design: the job must fail, every party exiting non-zero with a message naming that rank (its rank
  services get `--client-grace 3`, as in tests/test_multiprocess.py, so the failure comes in seconds).

After each job it checks, per epoch: every sample id exactly once across ranks (join mode; records the
pipeline quarantined, listed in each rank's `--quarantine` file with their epoch, are expected absent and
counted separately), the same contiguous steps 0..n-1 on every rank, a replayed step (a trainer restarted
before its checkpoint) carrying the same ids as the first time, and every party's final incarnation
exiting 0, or, for an unrecoverable fault, non-zero with a message naming the killed party.

Where the chaos harness lives: here (processes through benchmarks/_harness.py; the result goes to
benchmarks/results/chaos.json, its prose to templates/chaos.md.j2); `tests/test_chaos.py` imports it
from this directory (`run_jobs`, `plan_jobs`, `JobPlan`, `Fault`).

Usage:
    python benchmarks/chaos.py [--jobs 6] [--seed 0] [--kinds actor,rank,coordinator,trainer]
        [--max-step-time 5] [--json FILE] [--out PATH] [--print]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import Harness, free_port  # noqa: E402
from _report import add_common_args, command_line, finish, table  # noqa: E402

SECTION = "chaos"
MEASURES = ("benchmarks/chaos.py", "batchd", "client", "core", "proto", "service")
KINDS = ("actor", "rank", "coordinator", "trainer", "trainer-gone")
DEFAULT_KINDS = ("actor", "rank", "coordinator", "trainer")
UNRECOVERABLE = {"trainer-gone"}  # a job with such a fault must fail, naming the killed party
PY = sys.executable
BUDGET, WINDOW, DEPTH = 1024, 32, 4
MODEL = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2"]  # a few ms per step: the sleep dominates
TRAIN_S = 40.0  # training time a job aims at (steps x step time), before faults and startup
SYNTH_TOKENS_PER_SAMPLE = 66  # demo_lengths(longest=512)'s mean, for the step estimate
DATASET_TOKENS_PER_RECORD = 160  # the demo dataset with 64-pixel images (measured), for the step estimate
START_S = 120.0  # a rank service with --dataset starts its actors before it listens


# -- plan ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Fault:
    kind: str
    at_step: int  # when every rank has logged this many steps (summed over epochs)
    target: int | None = None  # rank (rank, trainer, trainer-gone); None: drawn at injection
    # filled in by the run:
    injected: bool = False
    t_s: float | None = None  # seconds after the trainers first started
    victim: str = ""
    note: str = ""
    recovered_s: float | None = None  # until the restarted party listens again (or the actor is back)


@dataclasses.dataclass
class JobPlan:
    index: int
    seed: int
    source: str  # "synthetic" | "dataset"
    num_samples: int  # samples (synthetic) or records (dataset)
    step_time: float
    faults: list[Fault]
    world_size: int = 2
    epochs: int = 2
    policy: str = "balanced"
    budget: int = BUDGET
    window: int = WINDOW
    depth: int = DEPTH
    client_grace: float | None = None  # rank services' --client-grace (None: theirs, 600 s)
    checkpoint_every: int = 5  # the trainers' --checkpoint-every

    def est_steps(self) -> int:
        """A rough number of steps of the whole job (for placing the faults)."""
        per = SYNTH_TOKENS_PER_SAMPLE if self.source == "synthetic" else DATASET_TOKENS_PER_RECORD
        return self.epochs * max(
            1, math.ceil(self.num_samples * per / (self.world_size * self.budget * 0.85))
        )


def coordinator_has_state_dir() -> bool:
    out = subprocess.run(
        [PY, "-m", "batchd", "coordinator", "--help"], capture_output=True, text=True, timeout=120
    ).stdout
    return "--state-dir" in out


def plan_jobs(
    n: int,
    seed: int,
    kinds: list[str],
    min_step_time: float = 0.01,
    max_step_time: float = 5.0,
    faults_per_job: int = 1,
    world_size: int = 2,
    epochs: int = 2,
    train_s: float = TRAIN_S,
    dataset: str = "auto",
) -> list[JobPlan]:
    """`n` seeded jobs. Fault kinds go round a seeded order of `kinds`, so each kind is drawn about
    equally often; a job with an `actor` fault reads the dataset (it has actors), the others alternate
    (`dataset`: "auto", "always" or "never"). Step times are log-uniform in [min, max]; a job's size is
    set so that its steps take about `train_s` seconds (64..400 synthetic samples, 48..160 records)."""
    rng = random.Random(seed)
    order = list(kinds)
    rng.shuffle(order)
    plans = []
    for i in range(n):
        jk = [order[(i * faults_per_job + k) % len(order)] for k in range(faults_per_job)]
        step_time = math.exp(rng.uniform(math.log(min_step_time), math.log(max_step_time)))
        if dataset == "always" or "actor" in jk:
            source = "dataset"
        elif dataset == "never":
            source = "synthetic"
        else:
            source = "dataset" if i % 2 == 1 else "synthetic"
        steps_per_epoch = min(max(round(train_s / (epochs * max(step_time, 0.05))), 3), 24)
        tokens = steps_per_epoch * world_size * BUDGET * 0.85
        if source == "synthetic":
            num = min(max(int(tokens / SYNTH_TOKENS_PER_SAMPLE), 64), 400)
        else:
            num = min(max(int(tokens / DATASET_TOKENS_PER_RECORD), 48), 160)
        plan = JobPlan(i, rng.randrange(1 << 16), source, num, round(step_time, 3), [], world_size, epochs)
        est = plan.est_steps()
        # distinct trigger points in 10%..70% of the estimated job, in order; at least one step done
        points = sorted(
            rng.sample(range(max(1, int(0.1 * est)), max(2, int(0.7 * est)) + faults_per_job), faults_per_job)
        )
        plan.faults = [Fault(kind, at) for kind, at in zip(jk, points, strict=False)]
        if "trainer-gone" in jk and "trainer" not in jk:  # fail within seconds, as tests/test_multiprocess.py
            plan.client_grace = 3.0
        plans.append(plan)
    return plans


# -- processes -------------------------------------------------------------------------------------
class Party:
    """One party of a job (a command line) and its incarnations (Popen objects, in order), started
    through the job's `Harness` (own session, log appended per incarnation, stopped at the job's end)."""

    def __init__(
        self,
        harness: Harness,
        name: str,
        argv: list[str],
        log: Path,
        env: dict[str, str] | None = None,
        port_file: Path | None = None,
    ) -> None:
        self.harness, self.name, self.argv, self.log = harness, name, argv, log
        self.env, self.port_file = env or {}, port_file
        self.procs: list[subprocess.Popen] = []
        self.expected_end: dict[int, str] = {}  # incarnation index -> why it did not exit on its own

    def start(self, env: dict[str, str] | None = None) -> subprocess.Popen:
        if env:
            self.env = {**self.env, **env}
        if self.port_file is not None:
            self.port_file.unlink(missing_ok=True)
        self.procs.append(self.harness.start(self.name, self.argv, env=self.env, log=self.log, append=True))
        return self.procs[-1]

    @property
    def proc(self) -> subprocess.Popen:
        return self.procs[-1]

    def alive(self) -> bool:
        return bool(self.procs) and self.proc.poll() is None

    def kill(self, why: str, sig: int = signal.SIGKILL) -> None:
        self.expected_end[len(self.procs) - 1] = why
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait_listening(self, timeout: float) -> float:
        """Seconds until the current incarnation wrote its port file; raises with the log's last error."""
        assert self.port_file is not None, self.name
        try:
            return self.harness.wait_file(self.port_file, self.name, timeout)
        except RuntimeError:
            raise RuntimeError(
                f"{self.name} exited with status {self.proc.returncode} before listening: "
                f"{last_error(self.log)}"
            ) from None
        except TimeoutError:
            raise TimeoutError(
                f"{self.name} did not listen within {timeout:g}s: {last_error(self.log)}"
            ) from None


_ERR_PATTERNS = [
    r"job failed: (.*)",
    r"JobFailed: (.*)",
    r"batchd\.train: error: (.*)",
    r"BatchdError: (.*)",
    r"CoordinatorError: (.*)",
    r"^(?:\[rank\d+\]:\s*)?(\w*(?:Error|Exception)\b.*)",
    r"(Traceback.*)",
]


def last_error(log: Path, incarnation_only: bool = True) -> str:
    """The most telling error line of a log (its last incarnation's part), or its last line."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "(no log)"
    if incarnation_only:
        text = text.rsplit("\n=== ", 1)[-1]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for pat in _ERR_PATTERNS:
        for k in range(len(lines) - 1, -1, -1):
            m = re.search(pat, lines[k])
            if m:
                msg = m.group(1)
                if msg.endswith("terminated with:"):  # a gRPC error: its status and details follow
                    msg += " " + " ".join(
                        ln for ln in lines[k + 1 : k + 4] if ln.startswith(("status =", "details ="))
                    )
                return msg[:400]
    return lines[-1][:400] if lines else "(empty log)"


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = collections.defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children[ppid].append(int(stat.parent.name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def actor_pids() -> list[int]:
    """The pids of the live preprocessing actors of the Ray this process started (its descendants)."""
    pids = []
    for pid in descendants(os.getpid()):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if cmd.startswith("ray::PreprocessWorker") and state != "Z":
            pids.append(pid)
    return sorted(pids)


# -- one job ---------------------------------------------------------------------------------------
class Job:
    """Runs one JobPlan in `work` and checks it (see module docstring)."""

    def __init__(
        self,
        plan: JobPlan,
        work: Path,
        ray_address: str | None,
        coordinator_journal: bool,
        timeout_s: float,
        log=print,
    ) -> None:
        self.plan, self.work, self.ray_address = plan, work, ray_address
        self.coordinator_journal, self.timeout_s, self.say = coordinator_journal, timeout_s, log
        self.rng = random.Random(plan.seed)
        self.bad: dict[int, str] = {}
        self.parties: dict[str, Party] = {}
        self.trainers: list[Party] = []
        self.notes: list[str] = []
        self.t_train: float | None = None
        self.harness = Harness(work)

    # setup
    def _spec(self) -> list[str]:
        p = self.plan
        return [
            "--world-size",
            str(p.world_size),
            "--token-budget",
            str(p.budget),
            "--policy",
            p.policy,
            "--window",
            str(p.window),
            "--depth",
            str(p.depth),
            "--seed",
            str(p.seed),
            "--epochs",
            str(p.epochs),
        ]

    def _data(self) -> tuple[list[str], list[str]]:
        """(rank service data flags, trainer model flags)."""
        p = self.plan
        if p.source == "synthetic":
            from batchd.demo import demo_lengths

            lengths = demo_lengths(p.num_samples, seed=p.seed, longest=512)
            f = self.work / "lengths.txt"
            f.write_text("\n".join(map(str, lengths)) + "\n")
            return ["--lengths", str(f)], ["--vocab-size", "512"]
        from batchd.demo import generated_bad_fraction
        from batchd.service.preprocess import demo_tokenizer, make_demo_dataset

        demo = make_demo_dataset(
            self.work / "data", num_samples=p.num_samples, seed=p.seed, max_image_side=64
        )
        self.bad = dict(demo.bad)
        tok = demo_tokenizer()
        # the demo's deliberate bad records, one of each kind at least, are a large share of a small job's
        # records: the demo's own allowance for them (a job of 48 records failed at the default 0.1)
        bad_fraction = generated_bad_fraction(len(demo.bad), p.num_samples, p.world_size)
        return (
            [
                "--max-bad-fraction",
                f"{bad_fraction:g}",
                "--dataset",
                str(demo.path),
                "--tokenizer",
                str(tok),
                "--num-actors",
                "1",
                "--ray-address",
                self.ray_address or "",
                "--quarantine",
                str(self.work / "quarantine.jsonl"),
            ],
            ["--tokenizer", str(tok)],
        )

    def _setup(self) -> None:
        p, w = self.plan, self.work
        spec = self._spec()
        data, model = self._data()
        cport = free_port()
        cargs = [
            PY,
            "-m",
            "batchd",
            "coordinator",
            *spec,
            "--port",
            str(cport),
            "--port-file",
            str(w / "coord.port"),
        ]
        if self.coordinator_journal:
            cargs += ["--state-dir", str(w / "coord-state")]
        self.parties["coordinator"] = Party(
            self.harness, "coordinator", cargs, w / "coordinator.log", port_file=w / "coord.port"
        )
        ports = [free_port() for _ in range(p.world_size)]
        for r in range(p.world_size):
            argv = [
                PY,
                "-m",
                "batchd",
                "rank",
                *spec,
                "--rank",
                str(r),
                "--coordinator",
                f"127.0.0.1:{cport}",
                *data,
                "--port",
                str(ports[r]),
                "--port-file",
                str(w / f"rank-{r}.port"),
                "--state-dir",
                str(w / "state"),
            ]
            if p.client_grace is not None:
                argv += ["--client-grace", f"{p.client_grace:g}"]
            self.parties[f"rank-{r}"] = Party(
                self.harness, f"rank-{r}", argv, w / f"rank-{r}.log", port_file=w / f"rank-{r}.port"
            )
        self._trainer_parties(",".join(f"127.0.0.1:{port}" for port in ports), model)

    def _trainer_parties(self, services: str, model: list[str]) -> None:
        """The N trainers of the job (gloo DDP over `services`), as parties not yet started."""
        p, w = self.plan, self.work
        for r in range(p.world_size):
            argv = [PY, "-m", "batchd.train", "--rank-services", services, *model, *MODEL]
            argv += ["--checkpoint", str(w / "ckpt"), "--checkpoint-every", str(p.checkpoint_every)]
            argv += ["--step-time", str(p.step_time), "--ids-log", str(w / "ids-{rank}.jsonl")]
            argv += ["--summary", str(w / "summary-{rank}.json"), "--log-every", "0", "--timeout", "120"]
            env = {
                "RANK": str(r),
                "WORLD_SIZE": str(p.world_size),
                "LOCAL_RANK": str(r),
                "LOCAL_WORLD_SIZE": str(p.world_size),
                "MASTER_ADDR": "127.0.0.1",
            }
            party = Party(self.harness, f"trainer-{r}", argv, w / f"trainer-{r}.log", env=env)
            self.parties[party.name] = party
            self.trainers.append(party)

    def _start_trainers(self) -> None:
        port = str(free_port())  # a fresh rendezvous, as torchrun's agent makes for a restarted group
        for t in self.trainers:
            t.start({"MASTER_PORT": port})

    # progress
    def read_logs(self) -> dict[int, list[dict[str, Any]]]:
        out = {}
        for r in range(self.plan.world_size):
            f = self.work / f"ids-{r}.jsonl"
            lines = f.read_text().splitlines() if f.exists() else []
            out[r] = [json.loads(ln) for ln in lines if ln.endswith("}")]
        return out

    def progress(self) -> int:
        """Steps every rank has logged, summed over epochs (distinct steps)."""
        logs = self.read_logs()
        return min(len({(e["epoch"], e["step"]) for e in entries}) for entries in logs.values())

    # faults
    def _elapsed(self) -> float:
        return time.monotonic() - (self.t_train or time.monotonic())

    def inject(self, fault: Fault) -> None:
        fault.t_s = round(self._elapsed(), 2)
        kind = fault.kind
        if kind == "coordinator" and not self.coordinator_journal:
            fault.note = "skipped: `batchd coordinator --help` has no --state-dir (no journal)"
            return
        if kind == "actor":
            pids = actor_pids()
            if not pids:
                fault.note = "skipped: no live preprocessing actor"
                return
            pid = self.rng.choice(pids)
            os.kill(pid, signal.SIGKILL)
            fault.injected, fault.victim = True, f"actor pid {pid}"
            t0 = time.monotonic()
            while time.monotonic() - t0 < 60:  # Ray restarts it: as many actors as before
                live = actor_pids()
                if len(live) >= len(pids) and pid not in live:
                    fault.recovered_s = round(time.monotonic() - t0, 2)
                    break
                time.sleep(0.2)
            else:
                fault.note = (
                    f"Ray had not restarted the actor 60 s later ({len(actor_pids())} of {len(pids)} live)"
                )
            return
        r = fault.target if fault.target is not None else self.rng.randrange(self.plan.world_size)
        fault.target = r
        if kind in ("rank", "coordinator"):
            party = self.parties["coordinator" if kind == "coordinator" else f"rank-{r}"]
            if not party.alive():
                fault.note = f"skipped: {party.name} had already exited ({party.proc.returncode})"
                return
            party.kill("chaos: SIGKILL")
            party.proc.wait(30)
            fault.injected, fault.victim = True, party.name
            party.start()
            try:
                fault.recovered_s = round(party.wait_listening(START_S), 2)
            except (RuntimeError, TimeoutError) as exc:
                fault.note = f"restart failed: {exc}"
            return
        victim = self.trainers[r]
        if not victim.alive():
            fault.note = f"skipped: trainer-{r} had already exited ({victim.proc.returncode})"
            return
        victim.kill("chaos: SIGKILL")
        fault.injected, fault.victim = True, victim.name
        if kind == "trainer-gone":
            return
        victim.proc.wait(30)
        t0 = time.monotonic()
        for t in self.trainers:  # what torchrun's agent does when a worker dies: stop the group ...
            if t is not victim and t.alive():
                t.kill("stopped with its group (SIGTERM, as torchrun does)", signal.SIGTERM)
        for t in self.trainers:
            try:
                t.proc.wait(20)
            except subprocess.TimeoutExpired:
                t.kill("stopped with its group (SIGKILL after 20 s)")
                t.proc.wait(10)
        self._start_trainers()  # ... and restart it
        fault.recovered_s = round(time.monotonic() - t0, 2)

    # run
    def run(self) -> dict[str, Any]:
        p = self.plan
        t_start = time.monotonic()
        result: dict[str, Any] = {"job": p.index, "plan": dataclasses.asdict(p)}
        try:
            self._setup()
            coord = self.parties["coordinator"]
            coord.start()
            coord.wait_listening(60)
            ranks = [self.parties[f"rank-{r}"] for r in range(p.world_size)]
            for party in ranks:
                party.start()
            for party in ranks:
                party.wait_listening(START_S)
            self.t_train = time.monotonic()
            self._start_trainers()
            result["startup_s"] = round(self.t_train - t_start, 2)
            self._monitor()
            done = self.progress()
            for f in p.faults:
                if not f.injected and not f.note:
                    f.note = f"not reached: the job ended at step {done}"
        except Exception as exc:  # noqa: BLE001 - a harness error fails this job, not the run
            self.notes.append(f"harness: {type(exc).__name__}: {exc}")
        finally:
            for party in self.parties.values():
                if party.alive():
                    party.kill("killed by the harness at the job's end (still running)")
                    party.proc.wait(10)
            self.harness.stop()  # whatever is left of the parties' process groups
        result["wall_s"] = round(time.monotonic() - t_start, 2)
        result["faults"] = [dataclasses.asdict(f) for f in p.faults]
        result.update(self.check())
        return result

    def _monitor(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        pending = list(self.plan.faults)
        failed_at = None
        while True:
            parties = list(self.parties.values())
            if all(not party.alive() for party in parties):
                return
            if pending and self.progress() >= pending[0].at_step:
                fault = pending.pop(0)
                self.say(f"  job {self.plan.index}: step {fault.at_step}: {fault.kind} fault")
                self.inject(fault)
                self.say(
                    f"  job {self.plan.index}: {fault.kind}: {fault.victim or '-'} {fault.note}".rstrip()
                )
                continue
            crashed = [party for party in parties if not party.alive() and party.proc.returncode != 0]
            if crashed and failed_at is None:
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > 60:
                self.notes.append(
                    f"harness: {', '.join(x.name for x in parties if x.alive())} still running 60 s "
                    f"after {crashed[0].name} failed; killed"
                )
                return
            if time.monotonic() > deadline:
                self.notes.append(
                    f"harness: job deadline {self.timeout_s:g}s passed with "
                    f"{', '.join(x.name for x in parties if x.alive())} still running "
                    f"(progress: {self.progress()} steps on every rank); killed"
                )
                return
            time.sleep(0.2)

    # check
    def check(self) -> dict[str, Any]:
        p = self.plan
        exits = {}
        for name, party in self.parties.items():
            if not party.procs:
                continue
            exits[name] = [
                {
                    "code": proc.returncode,
                    "why": party.expected_end.get(k),
                    "error": (last_error(party.log, False) if proc.returncode else None),
                }
                for k, proc in enumerate(party.procs)
            ]
        final_bad = {
            name: party.proc.returncode
            for name, party in self.parties.items()  # the victim of a
            if party.procs
            and party.proc.returncode != 0  # fault not restarted by design aside
            and not (party.expected_end.get(len(party.procs) - 1) or "").startswith("chaos")
        }
        messages = [
            f"{name} exit {code}: {last_error(self.parties[name].log)}" for name, code in final_bad.items()
        ]
        messages = self.notes + messages
        completed = bool(self.trainers) and all(t.procs and t.proc.returncode == 0 for t in self.trainers)
        # the data, from the trainers' ids logs
        logs = self.read_logs() if self.trainers else {}
        steps: dict[int, dict[int, dict[int, list[int]]]] = {}  # epoch -> rank -> step -> ids
        conflicts = replays = 0
        for r, entries in logs.items():
            for e in entries:
                cell = steps.setdefault(e["epoch"], {}).setdefault(r, {})
                if e["step"] in cell:
                    replays += 1
                    conflicts += cell[e["step"]] != e["ids"]
                else:
                    cell[e["step"]] = e["ids"]
        quarantined: dict[int, dict[int, str]] = collections.defaultdict(dict)
        qfile = self.work / "quarantine.jsonl"
        if qfile.exists():
            for ln in qfile.read_text().splitlines():
                if ln.strip():
                    q = json.loads(ln)
                    quarantined[q.get("epoch", 0)][int(q["id"])] = q["reason"]
        per_epoch, lost, dup, unexpected, unequal = [], 0, 0, 0, []
        for epoch in range(p.epochs):
            by_rank = steps.get(epoch, {})
            counts = [len(by_rank.get(r, {})) for r in range(p.world_size)]
            contiguous = all(
                sorted(by_rank.get(r, {})) == list(range(counts[r])) for r in range(p.world_size)
            )
            if len(set(counts)) != 1 or not contiguous:
                unequal.append(f"epoch {epoch}: steps per rank {counts}" + ("" if contiguous else " (gaps)"))
            ids = [i for r in by_rank.values() for s in r.values() for i in s]
            q = quarantined.get(epoch, {})
            expected = set(range(p.num_samples)) - set(q)
            seen = collections.Counter(ids)
            e_lost = len(expected - set(seen))
            e_dup = sum(c - 1 for c in seen.values() if c > 1)
            e_unexp = len(set(seen) - expected)
            lost += e_lost
            dup += e_dup
            unexpected += e_unexp
            per_epoch.append(
                {
                    "epoch": epoch,
                    "steps": counts,
                    "samples": len(ids),
                    "lost": e_lost,
                    "dup": e_dup,
                    "unexpected": e_unexp,
                    "quarantined": len(q),
                    "quarantined_by_fault": {i: why for i, why in q.items() if i not in self.bad},
                }
            )
        unrecoverable = [f for f in p.faults if f.injected and f.kind in UNRECOVERABLE]
        if unrecoverable:  # must fail, every party, naming the killed trainer's rank
            f = unrecoverable[0]
            rank_re = re.compile(rf"\brank {f.target}\b")
            survivors = [n for n in self.parties if n != f.victim]  # each must fail and name the rank
            named = all(
                final_bad.get(n) and rank_re.search(last_error(self.parties[n].log)) for n in survivors
            )
            ok = named and not self.notes
            verdict = "failed as designed" if ok else "did not fail as designed"
            data_ok = True
        else:
            data_ok = (
                completed and lost == 0 and dup == 0 and unexpected == 0 and conflicts == 0 and not unequal
            )
            ok = data_ok and not final_bad and not self.notes
            verdict = "ok" if ok else ("FAILED" if not completed or final_bad or self.notes else "WRONG DATA")
        return {
            "ok": ok,
            "verdict": verdict,
            "completed": completed,
            "lost": lost if completed else None,
            "lost_incomplete": None if completed else lost,
            "duplicated": dup,
            "unexpected": unexpected,
            "conflicting_replays": conflicts,
            "replayed_steps": replays,
            "unequal_steps": unequal,
            "epochs": per_epoch,
            "exits": exits,
            "messages": messages,
            "quarantined_expected": len(self.bad),
        }


# -- a run -----------------------------------------------------------------------------------------
class RayCluster:
    """One local Ray for the run's dataset jobs, started on first use (this process is its driver)."""

    def __init__(self, num_cpus: int) -> None:
        self.num_cpus, self.address = num_cpus, None

    def get(self) -> str:
        if self.address is None:
            import ray

            from batchd.service.preprocess import start_local_ray

            start_local_ray(num_cpus=self.num_cpus, include_dashboard=False, log_to_driver=False)
            self.address = ray.get_runtime_context().gcs_address
        return self.address

    def close(self) -> None:
        if self.address is not None:
            import ray

            ray.shutdown()


COORDINATOR_NOTE = (
    "coordinator faults skipped: `batchd coordinator --help` has no --state-dir, so a killed "
    "coordinator cannot be restarted from a journal (unrecoverable by design today)"
)


def run_jobs(
    plans: list[JobPlan],
    work: Path,
    coordinator_journal: bool | None = None,
    job_timeout_s: float = 240.0,
    log=print,
    notes: list[str] | None = None,
) -> dict[str, Any]:
    """Runs the jobs one after another in `work`; returns the report (see `summarize`)."""
    if coordinator_journal is None:
        coordinator_journal = coordinator_has_state_dir()
    notes = list(notes or [])
    if not coordinator_journal and any(f.kind == "coordinator" for p in plans for f in p.faults):
        notes.append(COORDINATOR_NOTE)
        log(notes[-1])
    ray = RayCluster(
        num_cpus=2 * max(p.world_size for p in plans)
    )  # actors of a restarted rank start meanwhile
    results = []
    t0 = time.monotonic()
    try:
        for plan in plans:
            d = work / f"job-{plan.index}"
            d.mkdir(parents=True, exist_ok=True)
            log(
                f"job {plan.index}: {plan.source} {plan.num_samples} samples, {plan.world_size} ranks, "
                f"{plan.epochs} epochs, step {plan.step_time:g}s, faults "
                f"{', '.join(f'{f.kind}@{f.at_step}' for f in plan.faults) or '-'}"
            )
            address = ray.get() if plan.source == "dataset" else None
            res = Job(plan, d, address, coordinator_journal, job_timeout_s, log).run()
            res["dir"] = str(d)
            results.append(res)
            log(
                f"job {plan.index}: {res['verdict']} in {res['wall_s']:.0f}s; lost {res['lost']}, "
                f"duplicated {res['duplicated']}" + "".join(f"\n    {m}" for m in res["messages"])
            )
    finally:
        ray.close()
    return summarize(results, notes, time.monotonic() - t0)


def summarize(results: list[dict[str, Any]], notes: list[str], wall_s: float) -> dict[str, Any]:
    planned, injected, skipped = collections.Counter(), collections.Counter(), collections.Counter()
    for r in results:
        for f in r["faults"]:
            planned[f["kind"]] += 1
            injected[f["kind"]] += f["injected"]
            skipped[f["kind"]] += not f["injected"]
    failed = [
        {"job": r["job"], "verdict": r["verdict"], "messages": r["messages"]} for r in results if not r["ok"]
    ]
    return {
        "jobs": len(results),
        "wall_s": round(wall_s, 1),
        "faults": {
            k: {"planned": planned[k], "injected": injected[k], "skipped": skipped[k]} for k in planned
        },
        "lost": sum(r["lost"] or 0 for r in results),
        "lost_in_failed_jobs": sum(r["lost_incomplete"] or 0 for r in results),
        "duplicated": sum(r["duplicated"] for r in results),
        "unexpected": sum(r["unexpected"] for r in results),
        "conflicting_replays": sum(r["conflicting_replays"] for r in results),
        "jobs_unequal_steps": sum(bool(r["unequal_steps"]) for r in results if r["completed"]),
        "jobs_failed": len(failed),
        "failures": failed,
        "notes": notes,
        "results": results,
    }


def fault_text(f: dict[str, Any]) -> str:
    s = f"{f['kind']}@{f['at_step']}"
    if f["injected"]:
        s += f" {f['victim']} t={f['t_s']:g}s"
        if f["recovered_s"] is not None:
            s += f" back {f['recovered_s']:g}s"
    if f["note"]:
        s += f" ({f['note']})"
    return s


def job_rows(report: dict[str, Any]) -> list[list[object]]:
    rows = []
    for r in report["results"]:
        p = r["plan"]
        steps = "/".join(
            str(e["steps"][0]) if len(set(e["steps"])) == 1 else str(e["steps"]) for e in r["epochs"]
        )
        rows.append(
            [
                r["job"],
                p["source"],
                p["num_samples"],
                f"{p['step_time']:g}",
                "; ".join(fault_text(f) for f in r["faults"]) or "-",
                steps,
                "-" if r["lost"] is None else r["lost"],
                r["duplicated"],
                f"{sum(e['quarantined'] for e in r['epochs'])} "
                f"({sum(len(e['quarantined_by_fault']) for e in r['epochs'])})",
                r["verdict"],
                f"{r['wall_s']:.0f}",
            ]
        )
    return rows


JOB_HEADERS = [
    "job",
    "source",
    "samples",
    "step s",
    "faults (kind@step victim time)",
    "steps/epoch",
    "lost",
    "dup",
    "quarantined (by fault)",
    "result",
    "wall s",
]


def section_data(report: dict[str, Any]) -> dict[str, Any]:
    """What the section shows of a run's report (the per-job tables' cells, totals, failures)."""
    fk = report["faults"]
    totals = [report["jobs"], sum(v["planned"] for v in fk.values()), sum(v["injected"] for v in fk.values())]
    totals += [report["lost"], report["duplicated"], report["jobs_unequal_steps"], report["jobs_failed"]]
    return {
        "totals_headers": ["jobs", "faults planned", "injected", "lost", "duplicated", "unequal steps"]
        + ["jobs failed"],
        "totals": [totals],
        "kinds_headers": ["fault kind", "planned", "injected", "skipped"],
        "kinds": [[k, v["planned"], v["injected"], v["skipped"]] for k, v in sorted(fk.items())],
        "job_headers": JOB_HEADERS,
        "jobs": job_rows(report),
        "notes": report["notes"],
        "failures": report["failures"],
        "wall_s": report["wall_s"],
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }


def print_report(report: dict[str, Any]) -> None:
    print()
    print(table(JOB_HEADERS, job_rows(report)))
    print()
    fk = report["faults"]
    print(
        "faults by kind: "
        + ", ".join(f"{k} {v['injected']}/{v['planned']} injected" for k, v in sorted(fk.items()))
    )
    print(
        f"jobs {report['jobs']}, failed {report['jobs_failed']}; samples lost {report['lost']} "
        "(completed jobs; "
        f"{report['lost_in_failed_jobs']} more in failed jobs), duplicated {report['duplicated']}, "
        f"unexpected {report['unexpected']}, conflicting replays {report['conflicting_replays']}, "
        f"jobs with unequal steps {report['jobs_unequal_steps']}"
    )
    for n in report["notes"]:
        print(f"note: {n}")
    for f in report["failures"]:
        print(f"job {f['job']} {f['verdict']}:")
        for m in f["messages"]:
            print(f"    {m}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default=",".join(DEFAULT_KINDS), help=f"comma list of {', '.join(KINDS)}")
    ap.add_argument("--faults-per-job", type=int, default=1)
    ap.add_argument("--min-step-time", type=float, default=0.01, help="seconds (log-uniform per job)")
    ap.add_argument("--max-step-time", type=float, default=5.0, help="seconds (log-uniform per job)")
    ap.add_argument(
        "--dataset",
        choices=("auto", "always", "never"),
        default="auto",
        help="which jobs read the Ray-preprocessed dataset (auto: those with actor faults, and every other)",
    )
    ap.add_argument("--job-timeout", type=float, default=240.0, help="seconds before a job is killed")
    ap.add_argument("--checkpoint-every", type=int, default=5, help="the trainers' steps between checkpoints")
    ap.add_argument(
        "--work", type=Path, default=None, help="keep the jobs' logs here (default: a temporary dir)"
    )
    ap.add_argument("--json", type=Path, default=None, help="write the full report here")
    add_common_args(ap)
    args = ap.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        ap.error(f"--kinds must be a comma list of {', '.join(KINDS)}, got {args.kinds!r}")
    if not 0 < args.min_step_time <= args.max_step_time:
        ap.error(
            f"need 0 < --min-step-time <= --max-step-time, got {args.min_step_time} {args.max_step_time}"
        )
    cmd = command_line(__file__, argv)
    journal = coordinator_has_state_dir()
    notes = []
    if not journal and "coordinator" in kinds and len(kinds) > 1:
        kinds.remove("coordinator")  # plan the jobs with the kinds that can run today
        notes.append(COORDINATOR_NOTE)
        print(f"note: {COORDINATOR_NOTE}", file=sys.stderr)
    plans = plan_jobs(
        args.jobs,
        args.seed,
        kinds,
        args.min_step_time,
        args.max_step_time,
        args.faults_per_job,
        dataset=args.dataset,
    )
    for plan in plans:
        plan.checkpoint_every = args.checkpoint_every
    with tempfile.TemporaryDirectory(prefix="batchd-chaos-") as tmp:
        work = args.work or Path(tmp)
        report = run_jobs(plans, work, journal, job_timeout_s=args.job_timeout, notes=notes)
        report["command"] = cmd
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    config = {k: v for k, v in vars(args).items() if k not in ("out", "print", "work", "json")}
    config.update(command=cmd, kinds=kinds, budget=BUDGET, window=WINDOW, depth=DEPTH, journal=journal)
    finish(args, SECTION, section_data(report), measures=MEASURES, config=config)
    return 0 if report["jobs_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
