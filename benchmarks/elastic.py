"""Elastic jobs: a real multi-process job resized mid-epoch, every sample of the epoch trained exactly once.

A job runs in phases, each a whole set of real processes on loopback: one `batchd coordinator`
(`--state-dir`, the same every phase; `--resize` from the second phase on, with the phase's
`--world-size`), one `batchd node` agent per host (`--local-ranks K --node-rank G`, each with its own
`--state-dir`, the same every phase) and one trainer per rank (`python -m batchd.train --node-agent`,
gloo DDP on CPU, `--checkpoint DIR --checkpoint-every 1`, `--ids-log`, a `--step-time`). A phase ends
one of three ways:

- `agent`: a node agent is SIGKILLed once every trainer logged the phase's step; every other party
  then fails fast (the coordinator's lease, the trainers' reconnect timeout) and exits non-zero;
- `preempt`: every process of the phase is SIGKILLed at once (an allocation lost);
- `end`: the phase runs the job to its end; every party must exit 0.

The next phase restarts the coordinator with `--resize` and the next world size on the same state dir,
its agents (those that exist now: a killed host may be gone for good) and its trainers, which resume
from the furthest checkpoint in the directory (batchd/train.py: a checkpoint of another world size is
loaded by every rank, `BatchClient.load_state_dict(..., resize=True)`).

Checked per job (join mode, one epoch): the resume step of each phase is the same on every rank; the
ids of the steps each phase trained before the next phase's resume step, plus every step of the last
phase, hold every sample id of the epoch exactly once (records the pipeline quarantined, listed in
each agent's `--quarantine` file, are expected absent); each phase's ranks make equal steps; the last
phase's parties exit 0. Measured: the seconds from a phase's first restart command to the first batch
every one of its trainers holds (its first `--ids-log` line).

Usage:
    python benchmarks/elastic.py [--jobs 5] [--seed 0] [--json FILE] [--out PATH] [--print]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import Harness, free_port  # noqa: E402

PY = sys.executable
MODEL = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2"]  # a few ms per step: the sleep dominates
LEASE_S, RECONNECT_S = 5, 5  # liveness judged in seconds, not a minute: a killed agent fails the job fast


@dataclasses.dataclass
class Phase:
    """One set of processes: `agents` as (node rank G, local ranks K), ranks G*K .. G*K+K-1 each; the
    phase ends with `end` ("agent": SIGKILL agent `victim`; "preempt": SIGKILL all; "end": run to the
    job's end) once every trainer logged `at_step` steps of this phase."""

    agents: list[tuple[int, int]]
    end: str = "end"
    at_step: int = 0
    victim: int = 0

    @property
    def ranks(self) -> list[int]:
        return sorted(g * k + i for g, k in self.agents for i in range(k))

    @property
    def world(self) -> int:
        return len(self.ranks)


@dataclasses.dataclass
class ElasticPlan:
    seed: int
    phases: list[Phase]
    source: str = "synthetic"  # "synthetic" (--lengths), "dataset" (demo records, Ray) or a Parquet path
    num_samples: int = 240
    step_time: float = 0.05
    budget: int = 1024
    window: int = 32
    depth: int = 4
    tokens_per_update: int | None = None
    memory_budget: str | None = None  # agents' --memory-budget (a streamed dataset)


class ElasticJob:
    """One job of `plan` in `work` (module docstring)."""

    def __init__(self, plan: ElasticPlan, work: Path, ray_address: str | None = None, log=print) -> None:
        self.plan, self.work, self.ray_address, self.say = plan, Path(work), ray_address, log
        self.harness = Harness(self.work)
        self.data_flags, self.model_flags = self._data()
        self.phase_results: list[dict[str, Any]] = []

    def _data(self) -> tuple[list[str], list[str]]:
        p = self.plan
        if p.source == "synthetic":
            from batchd.demo import demo_lengths

            f = self.work / "lengths.txt"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text("\n".join(map(str, demo_lengths(p.num_samples, seed=p.seed, longest=512))) + "\n")
            return ["--lengths", str(f)], ["--vocab-size", "512"]
        from batchd.service.preprocess import demo_tokenizer, make_demo_dataset

        path = p.source
        if p.source == "dataset":
            path = str(make_demo_dataset(self.work / "data", num_samples=p.num_samples, seed=p.seed).path)
        tok = str(demo_tokenizer())
        flags = ["--dataset", path, "--tokenizer", tok, "--num-actors", "1"]
        flags += ["--ray-address", self.ray_address or ""]
        if p.memory_budget:
            flags += ["--memory-budget", p.memory_budget]
        return flags, ["--tokenizer", tok]

    def _spec(self, world: int) -> list[str]:
        p = self.plan
        out = ["--world-size", str(world), "--token-budget", str(p.budget), "--policy", "balanced"]
        out += ["--window", str(p.window), "--depth", str(p.depth), "--seed", str(p.seed)]
        if p.tokens_per_update:
            out += ["--tokens-per-update", str(p.tokens_per_update)]
        return out

    # -- one phase ---------------------------------------------------------------------------------------
    def _start(self, k: int, phase: Phase) -> float:
        """Starts the phase's processes; returns the monotonic time of its first command."""
        w, h = self.work, self.harness
        t0 = time.monotonic()
        cport = free_port()
        cargs = [PY, "-m", "batchd", "coordinator", *self._spec(phase.world), "--port", str(cport)]
        cargs += ["--state-dir", str(w / "coord-state"), "--lease", str(LEASE_S)]
        h.start("coordinator", cargs + (["--resize"] if k else []), log=w / "coordinator.log", append=k > 0)
        ports = {}
        for g, kk in phase.agents:
            ports[g] = free_port()
            argv = [PY, "-m", "batchd", "node", *self._spec(phase.world), "--local-ranks", str(kk)]
            argv += ["--node-rank", str(g), "--name", f"host{g}", "--coordinator", f"127.0.0.1:{cport}"]
            argv += [*self.data_flags, "--port", str(ports[g]), "--state-dir", str(w / f"node-{g}")]
            argv += (
                ["--quarantine", str(w / f"quarantine-{g}.jsonl")] if self.plan.source != "synthetic" else []
            )
            h.start(f"agent-{g}", argv, log=w / f"agent-{g}.log", append=f"agent-{g}" in h.logs)
        master = str(free_port())  # a fresh rendezvous per phase, as torchrun makes for a restarted group
        for g, kk in phase.agents:
            for i in range(kk):
                r = g * kk + i
                argv = [PY, "-m", "batchd.train", "--node-agent", f"127.0.0.1:{ports[g]}", *self.model_flags]
                argv += [*MODEL, "--checkpoint", str(w / "ckpt"), "--checkpoint-every", "1"]
                argv += [
                    "--step-time",
                    str(self.plan.step_time),
                    "--ids-log",
                    str(w / f"ids-{k}-{{rank}}.jsonl"),
                ]
                argv += ["--log-every", "0", "--timeout", "120", "--reconnect-timeout", str(RECONNECT_S)]
                env = {"RANK": str(r), "WORLD_SIZE": str(phase.world), "LOCAL_RANK": str(i)}
                env |= {"LOCAL_WORLD_SIZE": str(kk), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master}
                h.start(
                    f"trainer-{r}", argv, env=env, log=w / f"trainer-{r}.log", append=f"trainer-{r}" in h.logs
                )
        return t0

    def logs(self, k: int, ranks: list[int]) -> dict[int, list[dict[str, Any]]]:
        out = {}
        for r in ranks:
            f = self.work / f"ids-{k}-{r}.jsonl"
            lines = f.read_text().splitlines() if f.exists() else []
            out[r] = [json.loads(ln) for ln in lines if ln.endswith("}")]
        return out

    def _names(self, phase: Phase) -> list[str]:
        return [
            "coordinator",
            *(f"agent-{g}" for g, _ in phase.agents),
            *(f"trainer-{r}" for r in phase.ranks),
        ]

    def run_phase(self, k: int, phase: Phase, timeout_s: float) -> dict[str, Any]:
        t0 = self._start(k, phase)
        deadline = t0 + timeout_s
        first: dict[int, float] = {}
        names = self._names(phase)
        result: dict[str, Any] = {"world": phase.world, "end": phase.end, "agents": phase.agents}
        while time.monotonic() < deadline:
            logs = self.logs(k, phase.ranks)
            now = time.monotonic()
            for r, entries in logs.items():
                if entries and r not in first:
                    first[r] = now - t0
            codes = {n: self.harness.get(n).poll() for n in names}
            if phase.end != "end" and min(len(e) for e in logs.values()) >= phase.at_step:
                if phase.end == "agent":
                    self.harness.signal(f"agent-{phase.victim}", signal.SIGKILL)
                else:
                    for n in names:
                        self.harness.signal(n, signal.SIGKILL)
                result["killed_at"] = {r: len(e) for r, e in logs.items()}
                break
            if all(c is not None for c in codes.values()):
                break
            time.sleep(0.1)
        result["first_batch_s"] = max(first.values()) if len(first) == phase.world else None
        for n in names:  # every party of the phase exits (fails fast after a kill)
            try:
                self.harness.wait(n, max(deadline - time.monotonic(), 1.0) + 3 * (LEASE_S + RECONNECT_S))
            except TimeoutError:
                self.harness.signal(n, signal.SIGKILL)
                result.setdefault("hung", []).append(n)
        result["codes"] = {n: self.harness.get(n).returncode for n in names}
        result["logs"] = self.logs(k, phase.ranks)
        return result

    # -- the job -----------------------------------------------------------------------------------------
    def run(self, timeout_s: float = 300.0) -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            for k, phase in enumerate(self.plan.phases):
                self.say(
                    f"[elastic] job {self.plan.seed} phase {k}: {phase.world} rank(s) on {phase.agents}, "
                    f"ends by {phase.end}"
                )
                res = self.run_phase(k, phase, timeout_s)
                self.phase_results.append(res)
                if phase.end != "end" and all(c == 0 for c in res["codes"].values()):
                    res["end"] = "done"  # the job ended before the planned kill: no phase is left to run
                    break
        finally:
            self.harness.stop()
        out = self.check()
        out["wall_s"] = time.monotonic() - t0
        return out

    def quarantined(self) -> set[int]:
        out: set[int] = set()
        for f in self.work.glob("quarantine-*.jsonl"):
            out |= {int(json.loads(ln)["id"]) for ln in f.read_text().splitlines() if ln.strip()}
        return out

    def check(self) -> dict[str, Any]:
        """Every id of the epoch once across the phases (module docstring), equal steps, resume steps."""
        seen: dict[int, int] = {}
        phases = []
        for k, res in enumerate(self.phase_results):
            logs = res["logs"]
            starts = {e[0]["step"] for e in logs.values() if e}
            nxt = self.phase_results[k + 1]["logs"] if k + 1 < len(self.phase_results) else None
            resume = min((e[0]["step"] for e in nxt.values() if e), default=None) if nxt else None
            kept_steps = {}
            for r, entries in logs.items():
                last = {}
                for e in entries:  # a replayed step logs again: the last one counts (same ids)
                    if resume is None or e["step"] < resume:
                        last[e["step"]] = e["ids"]
                kept_steps[r] = last
                for ids in last.values():
                    for i in ids:
                        seen[i] = seen.get(i, 0) + 1
            counts = {r: len(v) for r, v in kept_steps.items()}
            phases.append(
                {
                    "world": res["world"],
                    "end": res["end"],
                    "first_step": sorted(starts),
                    "steps_kept": counts,
                    "equal_steps": len(set(counts.values())) <= 1,
                    "first_batch_s": res["first_batch_s"],
                    "codes": res["codes"],
                    "hung": res.get("hung", []),
                }
            )
        expected = (
            set(range(self.plan.num_samples)) - self.quarantined()
            if self.plan.source == "synthetic"
            else None
        )
        if expected is None:
            expected = set(range(self._dataset_rows())) - self.quarantined()
        lost = len(expected - set(seen))
        duplicated = sum(c - 1 for c in seen.values() if c > 1)
        last = phases[-1]
        ok = (
            lost == 0
            and duplicated == 0
            and all(p["equal_steps"] and len(p["first_step"]) == 1 for p in phases)
            and all(c == 0 for c in last["codes"].values())
        )
        return {"ok": ok, "lost": lost, "duplicated": duplicated, "samples": len(expected), "phases": phases}

    def _dataset_rows(self) -> int:
        from batchd.service.preprocess import RecordDataset

        return len(RecordDataset(self.data_flags[1]))


def scenario(seed: int, source: str = "synthetic", **kw: Any) -> ElasticPlan:
    """The issue's job: 4 ranks on 2 agents, agent 1 SIGKILLed mid-epoch; 2 ranks on agent 0; later
    every process preempted and the job grows to 3 ranks (agent 0 and a new one-rank agent)."""
    phases = [
        Phase([(0, 2), (1, 2)], "agent", at_step=4, victim=1),
        Phase([(0, 2)], "preempt", at_step=4),
        Phase([(0, 2), (2, 1)], "end"),
    ]
    return ElasticPlan(seed, phases, source, **kw)


def chaos_plan(seed: int, **kw: Any) -> ElasticPlan:
    """A seeded job of 2-4 phases: world sizes 1-4 on agents of 1-2 ranks, each phase ended by an agent
    kill or a preemption at a seeded step, the last run to the end (a job that ends before a planned
    kill ends there)."""
    rng = random.Random(seed)
    phases = []
    for _ in range(rng.randint(2, 4)):
        kk = rng.choice([1, 2])
        agents = [(g, kk) for g in range(rng.randint(1, 2))]
        end = rng.choice(["agent", "preempt"])
        phases.append(Phase(agents, end, at_step=rng.randint(1, 6), victim=agents[-1][0]))
    phases[-1].end = "end"
    return ElasticPlan(seed, phases, num_samples=800, tokens_per_update=rng.choice([None, 3000]), **kw)


def restart_plans(seed: int, root: Path, budget_mib: int, say=print) -> dict[str, ElasticPlan]:
    """The jobs whose restart is timed: 4 ranks on 2 agents, agent 1 killed, 2 ranks to the end; on
    synthetic samples, the demo dataset (Ray actors) and a Parquet dataset of images 4x the agents'
    memory budget (streamed by blocks)."""
    from _stream_data import make_image_dataset

    def plan(source: str, n: int, **kw: Any) -> ElasticPlan:
        phases = [Phase([(0, 2), (1, 2)], "agent", at_step=3, victim=1), Phase([(0, 2)], "end")]
        return ElasticPlan(seed, phases, source, num_samples=n, **kw)

    budget = budget_mib << 20
    images = make_image_dataset(root / "data", 4 * budget, budget // 8, seed, say=say)
    return {
        "synthetic": plan("synthetic", 1200),
        "demo": plan("dataset", 400),
        "parquet": plan(str(images.path), images.records, budget=4096, memory_budget=f"{budget_mib}MiB"),
    }


def quality(lengths: list[int]) -> list[dict[str, Any]]:
    """Batching around a resize (`batchd simulate --resize`): 8 ranks losing a 2-rank agent at step 10,
    and 6 growing back to 8 at step 25, against the same steps of the job without a change."""
    from batchd.core import CostModel, JobSpec, PolicySpec, simulate

    out = []
    for policy, cost in (("balanced", "padded"), ("balanced", "packed")):
        spec = JobSpec(
            world_size=8,
            token_budget=8192,
            seed=0,
            policy=PolicySpec(name=policy, window=128, depth=8),
            cost=CostModel(name=cost),
        )
        res = simulate(lengths, spec, resize=[(10, 6), (25, 8)])
        for m in res["resizes"]:
            out.append({"cost": cost, **{k: m[k] for k in ("step", "from", "to", "after", "without")}})
    return out


def main(argv: list[str] | None = None) -> int:
    from _report import DEFAULT_WORKLOADS, add_common_args, command_line, finish

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=5, help="seeded chaos jobs (resized at random steps)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-mib", type=int, default=48, help="the Parquet job's agents' memory budget")
    ap.add_argument("--sources", default="synthetic,demo,parquet", help="restart timings to measure")
    ap.add_argument("--work", type=Path, default=None)
    add_common_args(ap)
    args = ap.parse_args(argv)
    import tempfile

    from chaos import RayCluster

    work = args.work or Path(tempfile.mkdtemp(prefix="batchd-elastic-"))
    t0 = time.monotonic()
    chaos_runs = []
    for j in range(args.jobs):
        res = ElasticJob(chaos_plan(args.seed + j), work / f"chaos-{j}").run()
        chaos_runs.append(
            {
                **{k: res[k] for k in ("ok", "lost", "duplicated", "samples", "wall_s")},
                "phases": res["phases"],
            }
        )
        print(
            f"[elastic] chaos job {j}: ok {res['ok']}, lost {res['lost']}, duplicated {res['duplicated']}",
            flush=True,
        )
    restarts = {}
    ray = RayCluster(num_cpus=4)
    try:
        for name, plan in restart_plans(args.seed, work, args.budget_mib).items():
            if name not in args.sources.split(","):
                continue
            address = ray.get() if plan.source != "synthetic" else None
            res = ElasticJob(plan, work / f"restart-{name}", address).run(timeout_s=600)
            restarts[name] = {
                **{k: res[k] for k in ("ok", "lost", "duplicated", "samples", "wall_s")},
                "fresh_first_batch_s": res["phases"][0]["first_batch_s"],
                "resized_first_batch_s": res["phases"][1]["first_batch_s"],
                "resume_step": res["phases"][1]["first_step"],
            }
            print(f"[elastic] restart {name}: {restarts[name]}", flush=True)
    finally:
        ray.close()
    lengths = [int(x) for x in (DEFAULT_WORKLOADS / "odb-synthetic.txt").read_text().split()]
    data = {
        "chaos": chaos_runs,
        "restarts": restarts,
        "quality": quality(lengths),
        "wall_s": time.monotonic() - t0,
    }
    config = {"jobs": args.jobs, "seed": args.seed, "budget_mib": args.budget_mib, "sources": args.sources}
    config["command"] = command_line(__file__, argv)
    config |= {"lease_s": LEASE_S, "reconnect_s": RECONNECT_S}
    finish(
        args,
        "elastic",
        data,
        measures=("benchmarks/elastic.py", "batchd", "client", "core", "proto", "service"),
        config=config,
    )
    ok = all(r["ok"] for r in chaos_runs) and all(r["ok"] for r in restarts.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
