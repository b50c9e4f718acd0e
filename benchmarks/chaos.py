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

Where the chaos harness lives: here (the jobs and the run), the plan in _chaos_plan.py, the parties'
processes in _chaos_procs.py (through benchmarks/_harness.py), a job's check in _chaos_check.py and the
report in _chaos_report.py; the result goes to benchmarks/results/chaos.json, its prose to
templates/chaos.md.j2. `tests/test_chaos.py` imports it from this directory (`run_jobs`, `plan_jobs`,
`JobPlan`, `Fault`: re-exported here).

Usage:
    python benchmarks/chaos.py [--jobs 6] [--seed 0] [--kinds actor,rank,coordinator,trainer]
        [--max-step-time 5] [--json FILE] [--out PATH] [--print]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _chaos_check import JobEnd, check  # noqa: E402
from _chaos_plan import (  # noqa: E402, F401  (Fault, JobPlan, plan_jobs: re-exported for tests/test_chaos.py)
    BUDGET,
    DEFAULT_KINDS,
    DEPTH,
    KINDS,
    WINDOW,
    Fault,
    JobPlan,
    PlanOptions,
    plan_jobs,
)
from _chaos_procs import Party, actor_pids  # noqa: E402
from _chaos_report import print_report, section_data, summarize  # noqa: E402
from _harness import Harness, free_port  # noqa: E402
from _report import add_common_args, command_line, finish  # noqa: E402

SECTION = "chaos"
MEASURES = (
    "benchmarks/chaos.py",
    "benchmarks/_chaos_check.py",
    "benchmarks/_chaos_plan.py",
    "benchmarks/_chaos_procs.py",
    "benchmarks/_chaos_report.py",
    "batchd",
    "client",
    "core",
    "proto",
    "service",
)
PY = sys.executable
MODEL = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2"]  # a few ms per step: the sleep dominates
START_S = 120.0  # a rank service with --dataset starts its actors before it listens


def coordinator_has_state_dir() -> bool:
    out = subprocess.run(
        [PY, "-m", "batchd", "coordinator", "--help"], capture_output=True, text=True, timeout=120
    ).stdout
    return "--state-dir" in out


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
        """Kills the fault's party (a drawn one where it names none) and restarts it as its kind says;
        what happened goes into `fault` (injected, victim, when, recovery, or why it was skipped)."""
        fault.t_s = round(self._elapsed(), 2)
        kind = fault.kind
        if kind == "coordinator" and not self.coordinator_journal:
            fault.note = "skipped: `batchd coordinator --help` has no --state-dir (no journal)"
            return
        if kind == "actor":
            self._kill_actor(fault)
            return
        if fault.target is None:
            fault.target = self.rng.randrange(self.plan.world_size)
        if kind in ("rank", "coordinator"):
            self._restart_service(
                fault, self.parties["coordinator" if kind == "coordinator" else f"rank-{fault.target}"]
            )
        else:
            self._kill_trainer(fault, self.trainers[fault.target])

    def _kill_actor(self, fault: Fault) -> None:
        """A preprocessing actor, SIGKILLed; Ray restarts it (waits up to 60 s for as many as before)."""
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

    def _restart_service(self, fault: Fault, party: Party) -> None:
        """A rank service or the coordinator, SIGKILLed and restarted with the same command."""
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

    def _kill_trainer(self, fault: Fault, victim: Party) -> None:
        """A trainer, SIGKILLed; for `trainer`, the group stopped and restarted as torchrun's agent does."""
        if not victim.alive():
            fault.note = f"skipped: {victim.name} had already exited ({victim.proc.returncode})"
            return
        victim.kill("chaos: SIGKILL")
        fault.injected, fault.victim = True, victim.name
        if fault.kind == "trainer-gone":
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
            stuck = [x for x in self.parties.values() if x.alive() and not x.name.startswith("trainer")]
            for party in stuck:  # a service prints every thread's stack on SIGUSR1 (batchd.cli): its log
                party.proc.send_signal(signal.SIGUSR1)  # says where it was stuck
            if stuck:
                time.sleep(1.0)  # the stacks' write before the kill
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
    # check
    def check(self) -> dict[str, Any]:
        """The job's verdict and counts, from its parties' exits and the trainers' ids logs (_chaos_check)."""
        logs = self.read_logs() if self.trainers else {}
        return check(JobEnd(self.plan, self.parties, self.trainers, self.notes, self.bad, self.work, logs))


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
    options = PlanOptions(args.min_step_time, args.max_step_time, args.faults_per_job, dataset=args.dataset)
    plans = plan_jobs(args.jobs, args.seed, kinds, options)
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
