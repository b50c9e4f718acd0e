"""The daemon as real processes: `batchd coordinator`, 4 x `batchd rank` and 4 gloo DDP trainers
(`python -m batchd._train.demo`) on loopback, every server on port 0, CPU only.

1. A full epoch: equal step counts, every sample id exactly once, and the all-reduced float64 gradients
   of the first two steps equal a single-process reference on the union of each step's samples
   (global per-token mean loss; the same AdamW update between the two steps).
2. A trainer SIGKILLed mid-epoch: every other party fails within a deadline with an error naming it.
3. A rank service SIGKILLed mid-epoch and restarted on its port from its journal: the epoch completes
   with every id exactly once and equal step counts.

Every test also checks that each process it started has exited on its own and that the ports are free.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import grpc
import pytest
import torch

from batchd.client import collate_padded, token_loss_sum
from batchd.core import JobSpec, PolicySpec, epoch_permutation
from batchd.demo import demo_lengths
from batchd.launch import Processes, rank_argv, spec_argv, start_services, start_trainers, wait_port
from batchd.proto import batchd_pb2 as pb
from batchd.proto import batchd_pb2_grpc as pb_grpc
from batchd.service.preprocess import synthetic_payload
from batchd.testing import build_model

pytestmark = pytest.mark.slow

WORLD = 4
SEED = 0
VOCAB = 512  # `batchd rank --lengths` serves synthetic_payload(..., vocab_size=512)
LR = 1e-3
GRAD_STEPS = 2
ATOL = 1e-5
TRAINERS = [f"trainer-{r}" for r in range(WORLD)]
SMALL_MODEL = {"d_model": 32, "n_layers": 1, "n_heads": 2}  # keeps the float64 reference cheap


class Job:
    """One job's processes (coordinator "coordinator", services "rank-R", trainers "trainer-R")."""

    def __init__(
        self,
        work: Path,
        lengths: list[int],
        policy: str,
        budget: int,
        window: int = 64,
        depth: int = 4,
        coordinator_args: tuple[str, ...] = (),
        rank_args: tuple[str, ...] = (),
    ) -> None:
        self.work, self.lengths, self.depth = work, lengths, depth
        self.procs = Processes(work)
        self.spec = spec_argv(
            JobSpec(
                world_size=WORLD,
                token_budget=budget,
                seed=SEED,
                policy=PolicySpec(name=policy, window=window, depth=depth),
            )
        )
        self.lengths_file = work / "lengths.txt"
        self.lengths_file.write_text("\n".join(map(str, lengths)) + "\n")
        self.rank_args = rank_args
        self.cport, self.ports = start_services(
            self.procs, work, self.spec, WORLD, self.lengths_file, coordinator_args, rank_args
        )
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.cport}")
        self.master_port = 0
        self.outs: list[Path] = []

    def start_trainers(self, **common) -> None:
        common = {"mode": "batchd", "seed": SEED, "lr": LR, **common}
        self.master_port, self.outs = start_trainers(
            self.procs,
            self.work,
            "trainer",
            WORLD,
            common,
            [{"service": f"127.0.0.1:{p}"} for p in self.ports],
        )

    def proc(self, name: str) -> subprocess.Popen:
        return self.procs.get(name)

    def log(self, name: str) -> str:
        return (self.work / f"{name}.log").read_text()

    def logs(self) -> str:
        return "\n".join(
            f"--- {n} (exit {p.poll()}) ---\n{self.procs.log(n)[-1500:]}" for n, p in self.procs.procs
        )

    def status(self) -> pb.StatusReply:
        return pb_grpc.CoordinatorStub(self.channel).Status(pb.StatusRequest(), timeout=5)

    def rank_status(self, rank: int) -> pb.RankStatusReply:
        with grpc.insecure_channel(f"127.0.0.1:{self.ports[rank]}") as ch:
            return pb_grpc.RankServiceStub(ch).RankStatus(pb.RankStatusRequest(), timeout=5)

    def wait_training(self, min_round: int = 2, timeout: float = 60.0) -> None:
        """Until the coordinator is at round >= `min_round` and every trainer has finished a step (a rank
        service that made more than `depth` steps has had some acknowledged), mid-epoch."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.procs if p.poll() is not None]
            assert not dead, f"{dead} exited before the kill\n{self.logs()}"
            try:
                st = self.status()
            except grpc.RpcError:  # the coordinator just exited: the check above reports it
                continue
            if st.round >= min_round and all(
                self.rank_status(r).next_step > self.depth for r in range(WORLD)
            ):
                assert st.state == "running", f"the epoch ended before the kill\n{self.logs()}"
                return
            time.sleep(0.05)
        raise AssertionError(f"training did not reach round {min_round} within {timeout:g}s\n{self.logs()}")

    def wait_exit(self, names: list[str], timeout: float) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        for name in names:
            try:
                self.proc(name).wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                stuck = self.proc(name)
                stuck.send_signal(signal.SIGUSR1)  # services print every thread's stack (batchd.cli)
                time.sleep(1.0)  # the stacks' write, not an assertion's wait
                stacks = self.procs.log(name)[-6000:]
                raise AssertionError(
                    f"{name} still running {timeout:g}s later\n{self.logs()}\n--- {name}'s stacks ---\n"
                    f"{stacks}"
                ) from None
        return {name: self.proc(name).returncode for name in names}

    def results(self) -> list[dict]:
        return [json.loads(o.read_text()) for o in self.outs]

    def close(self) -> None:
        self.channel.close()
        self.procs.stop()


@pytest.fixture
def jobs(tmp_path):
    """Makes Jobs; afterwards stops what is left and checks no process or port outlived the test."""
    made: list[Job] = []

    def make(*args, **kwargs) -> Job:
        work = tmp_path / f"job{len(made)}"
        work.mkdir()
        made.append(Job(work, *args, **kwargs))
        return made[-1]

    yield make
    for job in made:
        job.close()
        assert all(p.poll() is not None for _, p in job.procs.procs)


def all_names(job: Job) -> list[str]:
    return [n for n, _ in job.procs.procs]


def assert_clean_exit(job: Job, timeout: float = 30.0, expected: dict[str, int] | None = None) -> None:
    """Every process exits on its own (status 0 unless `expected` says otherwise); ports are free."""
    codes = job.wait_exit(all_names(job), timeout)
    want = {n: 0 for n in codes} | (expected or {})
    assert codes == want, job.logs()
    assert not live_processes_mentioning(job.work)  # nor any process they may have started
    for port in (job.cport, *job.ports, job.master_port):
        with socket.socket() as s:  # SO_REUSEADDR: TIME_WAIT is fine, a listener is not
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))


def live_processes_mentioning(path: Path) -> list[str]:
    """Command lines of live (non-zombie) processes that name `path` (every config and port file of a
    job lives there)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            zombie = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if str(path) in cmdline and not zombie:
            found.append(f"{proc.name}: {cmdline}")
    return found


def assert_epoch(results: list[dict], num_samples: int) -> None:
    steps = [r["steps"] for r in results]
    assert len(set(steps)) == 1 and steps[0] > 0, steps
    assert all(len(r["sample_ids"]) == r["steps"] for r in results)
    ids = sorted(i for r in results for step in r["sample_ids"] for i in step)
    assert ids == list(range(num_samples)), "some sample id is missing or duplicated"


def home_ranks(num_samples: int) -> dict[int, int]:
    """Where each id starts (the shuffled view of `batchd rank`: position p belongs to rank p % N)."""
    return {int(i): p % WORLD for p, i in enumerate(epoch_permutation(num_samples, SEED, 0))}


# -- 1. a full epoch: coverage and gradient equality ------------------------------------------------
@pytest.mark.parametrize("policy", ["local", "balanced"])
def test_epoch_gradients_equal_single_process_reference(jobs, policy):
    lengths = demo_lengths(96, longest=256)
    job = jobs(lengths, policy, budget=512, window=16, depth=2)
    job.start_trainers(dtype="float64", grad_steps=GRAD_STEPS, model_cfg=SMALL_MODEL)
    codes = job.wait_exit(TRAINERS, 90)
    assert set(codes.values()) == {0}, job.logs()
    results = job.results()
    assert_clean_exit(job)
    assert_epoch(results, len(lengths))
    home = home_ranks(len(lengths))
    moved = sum(home[i] != r["rank"] for r in results for step in r["sample_ids"] for i in step)
    if policy == "local":
        assert moved == 0
    else:
        assert moved > 0, "the balanced plan moved no sample: the workload does not exercise it"
    assert all(len(r["grads"]) == GRAD_STEPS for r in results)

    model = build_model("tiny", SEED, dtype=torch.float64, **SMALL_MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(GRAD_STEPS):
        ids = [i for r in results for i in r["sample_ids"][step]]
        batch = collate_padded([synthetic_payload(i, lengths[i], SEED, VOCAB) for i in ids])
        opt.zero_grad(set_to_none=True)
        logits = model(
            batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        )
        loss_sum, n_tokens = token_loss_sum(logits, batch["labels"])
        (loss_sum / n_tokens).backward()
        want = torch.cat([p.grad.flatten() for p in model.parameters()])
        assert want.abs().max() > 1e-3  # a real gradient, far above the tolerance
        for r in results:
            got = torch.tensor(r["grads"][step], dtype=torch.float64)
            assert got.shape == want.shape
            err = (got - want).abs().max().item()
            assert err <= ATOL, f"step {step} rank {r['rank']}: max |grad - reference| = {err:.3g}"
        opt.step()


# -- 2. a trainer dies: everyone fails fast, naming it ----------------------------------------------
def test_killed_trainer_fails_every_party_naming_its_rank(jobs):
    victim = 1
    job = jobs(
        demo_lengths(512),
        "balanced",
        budget=1024,
        coordinator_args=("--lease", "5"),
        rank_args=("--client-grace", "2"),
    )
    job.start_trainers(gloo_timeout_s=30)
    job.wait_training()
    job.proc(f"trainer-{victim}").send_signal(signal.SIGKILL)
    others = [n for n in all_names(job) if n != f"trainer-{victim}"]
    codes = job.wait_exit(others, 45)
    assert job.proc(f"trainer-{victim}").wait(5) == -signal.SIGKILL
    # The coordinator names the dead trainer's rank, and every other party reports that same failure.
    failures = re.findall(r"^batchd coordinator: the job failed: (.*)$", job.log("coordinator"), re.M)
    assert len(failures) == 1 and re.search(rf"\brank {victim}\b", failures[0]), job.logs()
    for name in others:
        if name.startswith("trainer-"):
            assert codes[name] != 0, f"{name} exited 0\n{job.logs()}"
            last = job.log(name).strip().splitlines()[-1]  # the trainer's one line for JobFailed
            assert f"{name.replace('trainer-', 'rank ')}: the job failed: " in last and failures[0] in last, (
                f"{name}: {last}\n{job.logs()}"
            )
            assert "Traceback" not in job.log(name), job.log(name)
        else:
            assert codes[name] == 1 and failures[0] in job.log(name), f"{name}: {codes[name]}\n{job.logs()}"
    assert_clean_exit(job, expected={f"trainer-{victim}": -signal.SIGKILL} | {n: codes[n] for n in others})


# -- 3. a rank service dies and is restarted from its journal: the epoch completes ------------------
def test_restarted_rank_service_completes_the_epoch(jobs, tmp_path):
    victim = 2
    lengths = demo_lengths(512)
    job = jobs(
        lengths,
        "balanced",
        budget=1024,
        coordinator_args=("--lease", "15"),
        rank_args=("--state-dir", str(tmp_path / "state")),
    )
    job.start_trainers(gloo_timeout_s=60)
    job.wait_training()
    old = job.proc(f"rank-{victim}")
    old.send_signal(signal.SIGKILL)
    old.wait(10)
    port_file = job.work / f"rank-{victim}-restarted.port"
    new = job.procs.start(
        f"rank-{victim}-restarted",
        rank_argv(job.spec, victim, job.cport, job.lengths_file, job.ports[victim], port_file, job.rank_args),
    )
    assert wait_port(port_file, new, "the restarted rank service") == job.ports[victim]
    codes = job.wait_exit(TRAINERS, 90)
    assert set(codes.values()) == {0}, job.logs()
    results = job.results()
    assert_epoch(results, len(lengths))
    restored = re.search(
        r"restored from \S+ at epoch \d+ round \d+ \(step (\d+)\)", job.log(f"rank-{victim}-restarted")
    )
    assert restored and 0 < int(restored[1]) < results[0]["steps"], job.logs()  # it resumed mid-epoch
    assert_clean_exit(job, expected={f"rank-{victim}": -signal.SIGKILL})
