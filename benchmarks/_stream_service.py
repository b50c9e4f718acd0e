"""The process side of stream_scale.py: a RaySource's time to first sample, and one epoch through
real processes (coordinator, rank service or node agent, model-free trainers), optionally with the
service SIGKILLed and restarted mid-epoch (parts 2, 3 and 5 of that script).

`service_run` starts every process through the shared `_harness.Harness` (own process groups, logs
under the run's directory, all stopped on any exit), watches the trainers' step logs, memory in /proc
and the kill point, then checks the epoch: every good id once, exactly the bad ids quarantined, each
step's `StepInfo` totals equal to the sum of the ranks' local counts. `trainer_main` is the trainer
process (`stream_scale.py _trainer ...`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from _harness import Harness, free_port
from _stream_data import JOB, MIN_PIXELS, RUN_LIMIT_S, SEED, Generated, evict

SCRIPT = Path(__file__).resolve().parent / "stream_scale.py"


# -- 5. RaySource time to first sample (in process) -------------------------------------------------
def raysource_first(
    gen: Generated, budget: int, stages: list, num_actors: int, samples: int = 64
) -> dict[str, Any]:
    """From opening the dataset to a RaySource's first sample (and to its `samples`-th)."""
    from batchd.service.preprocess import PoolOptions, RaySource, RecordDataset, StreamOptions

    evict(gen.files)
    t0 = time.perf_counter()
    ds = RecordDataset(gen.path)
    t_open = time.perf_counter() - t0
    src = RaySource(
        ds,
        0,
        1,
        SEED,
        0,
        True,
        pool=PoolOptions(stages=stages, num_actors=num_actors),
        options=StreamOptions(memory_budget=budget),
    )
    try:
        t_made = time.perf_counter() - t0
        got, t_first, at_first = 0, None, None
        while got < samples:
            item = src.poll(1.0)
            if item is None:
                continue
            if not isinstance(item, tuple):
                break
            got += 1
            if t_first is None:
                t_first = time.perf_counter() - t0
                at_first = src.stats()
        t_n = time.perf_counter() - t0
        end = src.stats()
    finally:
        src.close()
    return {
        "open_s": t_open,
        "construct_s": t_made,
        "first_s": t_first,
        "n": got,
        "n_s": t_n,
        "blocks_at_first": at_first["blocks_read"],
        "bytes_at_first": at_first["bytes_read"],
        "blocks_at_n": end["blocks_read"],
        "bytes_at_n": end["bytes_read"],
        "blocks": len(ds.blocks),
        "windows": end["windows"],
    }


# -- 2, 3, 5. the service run ------------------------------------------------------------------------
def trainer_main(argv: Sequence[str]) -> int:
    """A trainer without a model: iterates its rank's batches and logs each step's sample ids (JSON lines)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from batchd.client import BatchClient, ClientOptions

    with (
        BatchClient(a.address, a.rank, a.world, options=ClientOptions(reconnect_timeout_s=600)) as client,
        open(a.out, "a", encoding="utf-8") as f,
    ):
        for batch, info in client:
            ids = batch["sample_ids"].tolist()
            f.write(
                json.dumps(
                    {
                        "step": info.step,
                        "ids": ids,
                        "idle": bool(info.is_idle),
                        "t": time.time(),
                        "loss": [info.local_loss_tokens, info.global_loss_tokens],
                        "samples": [info.local_samples, info.global_samples],
                    }
                )
                + "\n"
            )
            f.flush()
        f.write(
            json.dumps(
                {
                    "done": True,
                    "t": time.time(),
                    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                }
            )
            + "\n"
        )
    return 0


def _read_steps(path: Path) -> tuple[list[dict], dict | None]:
    steps, done = [], None
    if path.exists():
        for line in path.read_text().splitlines():
            if not line.endswith("}"):
                continue  # a line cut by a kill
            obj = json.loads(line)
            if obj.get("done"):
                done = obj
            else:
                steps.append(obj)
    return steps, done


@dataclasses.dataclass
class _Watch:
    """The live state of one service run: the service's current name, the kill and the restart, and
    the memory peaks sampled so far."""

    argv: list[str]
    outs: list[Path]
    t_start: float
    service: str = "service"
    kill: dict[str, Any] | None = None
    restart: dict[str, float] | None = None
    rss_peaks: dict[str, int] = dataclasses.field(default_factory=dict)
    actor_peaks: dict[int, dict[str, int]] = dataclasses.field(default_factory=dict)


def _start_coordinator(h: Harness, work: Path, spec: list[str]) -> int:
    """Starts the coordinator; returns its port once it listens."""
    port_file = work / "coord.port"
    h.start(
        "coordinator",
        [sys.executable, "-m", "batchd", "coordinator", *spec, "--port", "0"]
        + ["--port-file", str(port_file), "--lease", "180"],
    )
    return h.wait_port(port_file, "coordinator", 60)


def _service_argv(
    work: Path,
    gen: Generated,
    budget: int,
    ranks: int,
    ray_address: str,
    spec: list[str],
    cport: int,
    port: int,
) -> list[str]:
    """The rank service's command (`batchd rank` for one rank, else one `batchd node`), without its
    `--port-file`."""
    common = [
        *("--config", str(work / "pipeline.toml"), "--coordinator", f"127.0.0.1:{cport}"),
        *("--dataset", str(gen.path), "--memory-budget", str(budget), "--num-actors", "1"),
        *("--ray-address", ray_address, "--quarantine", str(work / "quarantine.jsonl")),
        *("--state-dir", str(work / "state"), "--stats-file", str(work / "stats-{rank}.json")),
        *("--port", str(port)),
    ]
    py = [sys.executable, "-m", "batchd"]
    if ranks == 1:
        return [*py, "rank", *spec, "--rank", "0", *common]
    return [*py, "node", *spec, "--local-ranks", str(ranks), "--node-rank", "0", "--name", "bench", *common]


def _sample_memory(h: Harness, w: _Watch) -> None:
    """Folds the service's and the actors' current /proc memory into the run's peaks."""
    for key, v in _proc_memory(h.get(w.service).pid).items():
        w.rss_peaks[key] = max(w.rss_peaks.get(key, 0), v)
    for pid in _actor_pids():
        peaks = w.actor_peaks.setdefault(pid, {})
        for key, v in _proc_memory(pid).items():
            peaks[key] = max(peaks.get(key, 0), v)


def _kill_and_restart(h: Harness, work: Path, w: _Watch, got: int, say: Callable[[str], None]) -> None:
    """SIGKILLs the service (its process only, as kill -9 would) and starts it again, same command."""
    proc = h.get(w.service)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    w.kill = {
        "t": time.time(),
        "samples": got,
        "steps": {r: len(_read_steps(o)[0]) for r, o in enumerate(w.outs)},
    }
    say(f"service: SIGKILLed at {got} samples; restarting it")
    port_file = work / "service-restarted.port"
    port_file.unlink(missing_ok=True)
    w.service = "service-restarted"
    h.start(w.service, w.argv + ["--port-file", str(port_file)])
    w.restart = {"t": time.time()}
    h.wait_port(port_file, w.service, 300)
    w.restart["listen"] = time.time()


def _watch(
    h: Harness, work: Path, w: _Watch, good: int, kill_at: float | None, say: Callable[[str], None]
) -> None:
    """Polls every 0.5 s until every trainer exited: fails fast on a child's error, samples memory,
    and kills / restarts the service once the trainers got `kill_at` of the good samples."""
    deadline, last_say = time.monotonic() + RUN_LIMIT_S, time.monotonic()
    trainers = [n for n in h.logs if n.startswith("trainer-")]
    while any(h.get(t).poll() is None for t in trainers):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the run did not end within {RUN_LIMIT_S:g} s\n{_logs(h)}")
        bad = [(n, c) for n, c in h.codes().items() if c not in (None, 0) and n != "service"]
        if bad:
            raise RuntimeError(f"{bad} failed\n{_logs(h)}")
        _sample_memory(h, w)
        got = sum(len(s["ids"]) for o in w.outs for s in _read_steps(o)[0])
        if kill_at is not None and w.kill is None and got >= kill_at * good:
            _kill_and_restart(h, work, w, got, say)
        elif w.kill is None and h.get("service").poll() not in (None, 0):
            raise RuntimeError(f"the service exited with {h.get('service').returncode}\n{_logs(h)}")
        if time.monotonic() - last_say > 30:
            say(f"service: {got}/{good} samples after {time.time() - w.t_start:.0f} s")
            last_say = time.monotonic()
        time.sleep(0.5)


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """One service run's settings: the rank services' memory budget (bytes), the ranks, `[pipeline]
    max_pixels`, the batching policy and, for a resume run, `kill_at`: the share of the good samples the
    trainers got when the service is SIGKILLed and restarted (None: no kill)."""

    budget: int
    ranks: int
    max_pixels: int
    policy: str = "balanced"
    kill_at: float | None = None

    def __post_init__(self) -> None:
        if self.budget <= 0 or self.ranks < 1 or self.max_pixels <= 0:
            raise ValueError(f"need positive settings: {self.budget=} {self.ranks=} {self.max_pixels=}")
        if self.kill_at is not None and not 0 < self.kill_at < 1:
            raise ValueError(f"kill_at is a share in (0, 1): {self.kill_at=}")


def service_run(
    work: Path, gen: Generated, settings: RunSettings, ray_address: str, say: Callable[[str], None] = print
) -> dict[str, Any]:
    """One epoch through a coordinator, the rank service(s) and model-free trainers; with
    `settings.kill_at`, the service is SIGKILLed once the trainers got that share of the good samples and
    restarted."""
    from batchd.core import JobSpec
    from batchd.launch import spec_argv

    budget, ranks, max_pixels = settings.budget, settings.ranks, settings.max_pixels
    policy, kill_at = settings.policy, settings.kill_at
    work.mkdir(parents=True, exist_ok=True)
    spec = spec_argv(JobSpec(world_size=ranks, **{**JOB, "policy": policy}))
    (work / "pipeline.toml").write_text(f"[pipeline]\nmin_pixels = {MIN_PIXELS}\nmax_pixels = {max_pixels}\n")
    with Harness(work) as h:
        cport, port = _start_coordinator(h, work, spec), free_port()
        argv = _service_argv(work, gen, budget, ranks, ray_address, spec, cport, port)
        w = _Watch(argv, [work / f"trainer-{r}.jsonl" for r in range(ranks)], time.time())
        h.start("service", argv + ["--port-file", str(work / "service.port")])
        for r in range(ranks):
            h.start(
                f"trainer-{r}",
                [sys.executable, str(SCRIPT), "_trainer", "--address", f"127.0.0.1:{port}"]
                + ["--rank", str(r), "--world", str(ranks), "--out", str(w.outs[r])],
            )
        h.wait_port(work / "service.port", "service", 300)
        t_listen, at_listen = time.time(), _proc_memory(h.get("service").pid)
        say(
            f"service: listening after {t_listen - w.t_start:.1f} s "
            f"({at_listen.get('VmRSS', 0) / 2**30:.2f} GiB RSS)"
        )
        _watch(h, work, w, len(gen.good), kill_at, say)
        t_trainers = time.time()
        for name in (w.service, "coordinator"):
            h.wait(name, 120)
        codes, restored = h.codes(), _restore_line(h.log("service-restarted", 1 << 22) if w.kill else "")
    return {
        **_check(work, gen, w, ranks),
        "ranks": ranks,
        "budget": budget,
        "max_pixels": max_pixels,
        "killed": w.kill is not None,
        "policy": policy,
        "service_memory_peaks": w.rss_peaks,
        "service_memory_at_listen": at_listen,
        "actor_memory_peaks": list(w.actor_peaks.values()),
        "t_listen_s": t_listen - w.t_start,
        "trainers_done_s": t_trainers - w.t_start,
        "codes": codes,
        "kill": w.kill,
        "restart_listen_s": (w.restart["listen"] - w.kill["t"]) if w.restart and w.kill else None,
        "restored": restored,
    }


def _restore_line(log: str) -> str | None:
    return next((ln for ln in log.splitlines() if "restored from" in ln), None)


def _quarantined(path: Path) -> dict[int, str]:
    """id -> reason code of the quarantine file's records."""
    out: dict[int, str] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                obj = json.loads(line)
                out[int(obj["id"])] = obj["reason"].split(":", 1)[0]
    return out


def _check(work: Path, gen: Generated, w: _Watch, ranks: int) -> dict[str, Any]:
    """What the trainers got against the dataset's good and bad ids, the rates and the stats files."""
    steps, dones = zip(*[_read_steps(o) for o in w.outs], strict=True)
    ids = [i for per_rank in steps for s in per_rank for i in s["ids"]]
    times = sorted(s["t"] for per_rank in steps for s in per_rank)
    stats = [
        json.loads((work / f"stats-{r}.json").read_text()) if (work / f"stats-{r}.json").exists() else {}
        for r in range(ranks)
    ]
    quarantined = _quarantined(work / "quarantine.jsonl")
    counts = (
        np.bincount(np.asarray(ids, dtype=np.int64), minlength=gen.records) if ids else np.zeros(gen.records)
    )
    good_mask = np.ones(gen.records, dtype=bool)
    good_mask[list(gen.bad)] = False
    first_after = None
    if (
        w.restart is not None and w.kill is not None
    ):  # batches held at the kill come at once, before it listens
        after = [t for t in times if t > w.restart["listen"]]
        first_after = (after[0] - w.kill["t"]) if after else None
    totals_ok, totals_checked = totals_consistent(steps)
    return {
        "totals_ok": totals_ok,
        "totals_checked": totals_checked,
        "first_batch_s": times[0] - w.t_start if times else None,
        "wall_s": times[-1] - w.t_start if times else None,
        "samples": len(ids),
        "good": len(gen.good),
        "missing": int(np.sum((counts == 0) & good_mask)),
        "duplicates": int(np.sum(np.maximum(counts - 1, 0))),
        "bad_delivered": int(np.sum(counts[~good_mask])),
        "steps": [len(s) for s in steps],
        "idle_steps": sum(1 for per in steps for s in per if s["idle"]),
        "quarantined": len(quarantined),
        "quarantine_exact": set(quarantined) == set(gen.bad),
        "quarantine_codes_ok": all(quarantined.get(i) == kind for i, kind in gen.bad.items()),
        "samples_per_s": len(ids) / (times[-1] - times[0]) if len(times) > 1 else None,
        "samples_per_s_from_start": len(ids) / (times[-1] - w.t_start) if times else None,
        "stats": stats,
        "trainer_peak_rss": [d["peak_rss_bytes"] if d else None for d in dones],
        "first_batch_after_kill_s": first_after,
    }


def _actor_pids() -> list[int]:
    """This process's descendants that are preprocessing actors (Ray names them `ray::PreprocessWorker`)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(proc.name))
    out, stack, seen = [], list(children.get(os.getpid(), [])), set()
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        stack.extend(children.get(pid, []))
        try:
            if (Path("/proc") / str(pid) / "cmdline").read_bytes().startswith(b"ray::PreprocessWorker"):
                out.append(pid)
        except OSError:
            continue
    return out


def _proc_memory(pid: int) -> dict[str, int]:
    """VmRSS and its parts (RssAnon: private, RssFile, RssShmem: e.g. Ray object store pages) of `pid`,
    in bytes."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def totals_consistent(steps: Sequence[Sequence[dict]]) -> tuple[int, int]:
    """(steps whose StepInfo totals match the sum over ranks of their local counts, steps checked)."""
    by_step: dict[int, list[dict]] = {}
    for per_rank in steps:
        for s in per_rank:
            by_step.setdefault(s["step"], []).append(s)
    ok = checked = 0
    for row in by_step.values():
        if len(row) != len(steps):
            continue
        checked += 1
        ok += all(
            sum(s["loss"][0] for s in row) == s["loss"][1]
            and sum(s["samples"][0] for s in row) == s["samples"][1]
            for s in row
        )
    return ok, checked


def _logs(h: Harness) -> str:
    return "\n".join(f"--- {n} (exit {c}) ---\n{h.log(n, 2500)}" for n, c in h.codes().items())


def exact(run: dict[str, Any]) -> bool:
    """Every good id delivered exactly once, no bad one, and exactly the bad ids quarantined with
    their expected reason codes."""
    return (
        run["missing"] == 0
        and run["duplicates"] == 0
        and run["bad_delivered"] == 0
        and run["quarantine_exact"]
        and run["quarantine_codes_ok"]
    )
