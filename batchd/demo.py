"""`batchd demo`: the main job on an embedded default, end to end, against fixed batching.

One command starts one local Ray (or joins `--ray-address`), the coordinator, this host's node agent
(`batchd node`: the rank services of all N ranks in one process, one stream to the coordinator) and N
trainer processes (torch.distributed gloo on CPU) that train a tiny multimodal LM (`TinyMLLM`; the tiny
causal LM with `--synthetic`) for one epoch through the batchd client, two-phase by default on image data
(`DemoOptions.phases`). Each rank's service preprocesses its sampler view of the dataset with its own
Ray actors (`batchd node --dataset`: chat template, the demo BPE tokenizer, Qwen2-VL visual tokens with pixel
values, Qwen2-Audio clip tokens with log-mel features, cutoff L) and batches the realized lengths;
samples the balanced plan moves between ranks are handed over inside the agent; the default dataset is
generated (`make_demo_dataset`: conversations, images, audio clips in `DEMO_AUDIO_FRACTION` of the records
and a few deliberately bad records, no downloads); `TinyMLLM` has its audio encoder, and clips are
generated, where the chain turns clips into audio tokens (`audio_model_cfg`). Then it runs the same model
with fixed batching on the same preprocessed samples (each baseline trainer runs the same RaySource view
and encodes its own images and clips, one phase; DistributedSampler semantics, batch size
`BASELINE_BATCH_SIZE` = 2: what `batchd bench` runs on its default workload and what a user would pick; the
OOM-safe floor(L / longest realized length) is 1 wherever a realized length passes L / 2, which the cutoff at
L makes the rule, and B=1 would flatter batchd) and reports both. `DemoOptions(synthetic=True)`
(`--synthetic`) serves synthetic tokenized samples with long-tail lengths instead, without Ray (`batchd
node --lengths`).

Every process is a child of this one and is terminated on any exit path; the Ray this demo started is
shut down on every exit path too, and its raylet and workers with it. Ctrl-C (SIGINT) and SIGTERM stop
the children and Ray in order and `batchd demo` exits 130 with one line; the children run in their own
session, so a terminal's Ctrl-C reaches only the demo, which stops them. If the demo itself is killed
(SIGKILL), its children get SIGTERM from the kernel (PR_SET_PDEATHSIG, Linux) and a small reaper
process, which notices the demo's death through a pipe, ends every process that inherited the demo's
run marker (the node agent, trainers, the Ray it started and Ray's workers and agents) and removes
the demo's temp dir. A Ray the demo only joined (`--ray-address`) is never stopped.

The JSON's `preprocess` (Ray path only): `actors` (in all), `samples` (emitted by the ranks'
sources), `quarantined`, `records_read` (= samples + quarantined, must equal `records`, the dataset's
size: `accounting_ok`), `samples_per_s` (samples / the batchd epoch's wall time: the rate the pipeline
delivered to training, which backpressure holds to the trainers' pace), `capacity_samples_per_s` (records
per second of actor busy time, all actors: what the pool could sustain), `actor_busy_fraction` (actor
time inside preprocessing / (actors x the sources' active time)), and `stall_fraction`: the largest over
ranks of (trainer time blocked in the batch iterator's `next()`) / (trainer epoch wall time), with
the per-rank values in `stall_fraction_per_rank`; for the generated dataset `expected_quarantined` and
`expected_clips` (the clips its good records hold). The summary's (and the baseline's) `clips`: clips the
audio encoders encoded, each once (= `expected_clips` unless truncation dropped one), and `audio_imbalance`:
`vision_imbalance` of the audio encoder's frames (None without clips).

Why the tiny model is compute-bound: each step costs ~6 x 0.5M params x padded tokens FLOPs (about
3 GFLOP for a full 1024-token step), while the per-step overhead (2 MB gloo all-reduce, AdamW over 0.5M
params, Python) does not grow with the tokens: a full batchd step is mostly per-token work, so wall
time follows padded tokens and step count, which is what batching changes, and the baseline's small
batches (B=2) pay the per-step cost once per two samples. docs/benchmarks.md (`batchd demo`)
measures both parts.

Here: `run_demo` (the processes, Ray and signals of one run) and the synthetic path; `batchd._demo_run` holds
`DemoOptions`, a run's parts (`DemoRun`) and the summary, `batchd._demo_ray` the Ray path.
"""

from __future__ import annotations

import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import ray

from batchd._demo_ray import (
    AUDIO_TOKEN,
    DEMO_AUDIO_FRACTION,
    IMAGE_TOKEN,
    actors_per_rank,
    audio_model_cfg,
    generated_bad_fraction,
    run_ray,
)
from batchd._demo_run import (
    BASELINE_BATCH_SIZE,
    DEMO_BUDGET,
    DemoOptions,
    DemoRun,
    add_baseline,
    kept_quarantine,
    step_digests,
    summarize,
    vision_imbalance,
)
from batchd.core import JobFailed
from batchd.launch import MARKER_ENV, Processes, Reaper, spec_argv

__all__ = [
    "AUDIO_TOKEN",
    "BASELINE_BATCH_SIZE",
    "DEMO_AUDIO_FRACTION",
    "DEMO_BUDGET",
    "IMAGE_TOKEN",
    "DemoOptions",
    "actors_per_rank",
    "audio_model_cfg",
    "demo_lengths",
    "generated_bad_fraction",
    "kept_quarantine",
    "run_demo",
    "step_digests",
    "summarize",
    "vision_imbalance",
]


def demo_lengths(num_samples: int, seed: int = 7, longest: int = 512) -> list[int]:
    """A long-tail length mix like ODB's synthetic benchmark (72% short, 22% medium, 6% long), scaled
    so the longest sample is `longest` tokens."""
    rng = np.random.default_rng(seed)
    scale = longest / 4096
    n_short, n_med = int(num_samples * 0.72), int(num_samples * 0.22)
    parts = [
        rng.integers(64, 384, n_short),
        rng.integers(384, 1400, n_med),
        rng.integers(1400, 4096, num_samples - n_short - n_med),
    ]
    lengths = np.maximum((np.concatenate(parts) * scale).astype(int), 2)
    rng.shuffle(lengths)
    return lengths.tolist()


class _Signals:
    """SIGINT and SIGTERM -> KeyboardInterrupt, once: later signals are ignored while the demo cleans up.

    Installed only on the main thread (`install`), and restored by `restore`.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._old: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
            raise KeyboardInterrupt(f"by {signal.Signals(signum).name}")

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old.setdefault(sig, signal.getsignal(sig))
            signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def interrupt(self) -> KeyboardInterrupt:
        name = signal.Signals(self.received).name if self.received is not None else "signal"
        return KeyboardInterrupt(f"by {name}")


def run_demo(
    options: DemoOptions | None = None, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Runs the demo that `options` describe (None: `DemoOptions()`, `batchd demo`'s defaults); returns the
    summary dict `batchd demo --json` prints. `progress`: the printer of the demo's progress lines and
    the trainers' progress (None: no lines, no bar).

    Every child process is stopped and the Ray it started shut down on every exit path; SIGINT and
    SIGTERM (on the main thread) become KeyboardInterrupt, once. Raises ValueError naming a bad
    option, JobFailed when the job failed (its quarantine file named where it outlives the temp dir).
    """
    o = DemoOptions() if options is None else options
    say = progress or (lambda msg: None)
    signals = _Signals()
    if threading.current_thread() is threading.main_thread():  # SIGINT and SIGTERM unwind through the
        signals.install()  # finally below: children stop, Ray is shut down
    work = Path(tempfile.mkdtemp(prefix="batchd-demo-"))
    marker = uuid.uuid4().hex
    reaper = None if o.keep_dir or not sys.platform.startswith("linux") else Reaper(work, marker)
    procs = Processes(work, {MARKER_ENV: marker})
    ray_started = False
    t_start = time.perf_counter()
    try:
        say(f"logs and temporary files in {work}")
        job = o.job()
        run = DemoRun(o, procs, work, marker, spec_argv(job), say, progress, t_start)
        ray_started = not o.synthetic and o.ray_address is None
        summary = _run_synthetic(run) if o.synthetic else run_ray(run)
        summary["phases"] = job.phases.count
        summary["deterministic"] = job.deterministic
        return summary
    except BaseException as exc:
        if signals.received is not None:  # whatever the signal broke on its way (a child's exit, a wait)
            raise signals.interrupt() from None
        inside = str(work / "quarantine.jsonl")
        if isinstance(exc, JobFailed) and inside in str(exc):  # name the copy that outlives the directory
            raise JobFailed(str(exc).replace(inside, str(kept_quarantine(work)))) from None
        raise
    finally:
        try:
            procs.stop()
            if ray_started:
                ray.shutdown()
            if (work / "quarantine.jsonl").exists():  # the bad records outlive the demo's directory
                shutil.copyfile(work / "quarantine.jsonl", kept_quarantine(work))
                say(f"bad records (quarantine): {kept_quarantine(work)}")
            if not o.keep_dir:
                shutil.rmtree(work, ignore_errors=True)
        finally:
            if reaper is not None:
                reaper.close()
            signals.restore()


def _run_synthetic(run: DemoRun) -> dict[str, Any]:
    """The synthetic path: `demo_lengths` samples served by the node agent (`--lengths`), no Ray."""
    o = run.options
    lengths = demo_lengths(o.num_samples)
    lengths_file = run.work / "lengths.txt"
    lengths_file.write_text("\n".join(map(str, lengths)) + "\n")
    run.say(
        f"starting coordinator and a node agent for {o.world_size} ranks ({o.num_samples} synthetic samples, "
        f"L={o.token_budget}, policy {o.policy})"
    )
    ports = run.start_services(lengths_file)
    run.say(f"training one epoch on {o.world_size} gloo DDP trainers through batchd")
    common = {"mode": "batchd", "seed": o.seed, "step_time": o.step_time}
    results = run.trainers("batchd", common, run.service_addresses(ports), o.num_samples, "batchd run")
    summary = summarize(lengths, results)
    summary["startup_and_teardown_s"] = time.perf_counter() - run.t_start - summary["wall_s"]
    if o.baseline:
        bs = BASELINE_BATCH_SIZE
        run.say(f"baseline: the same epoch with fixed batching at batch size B={bs} (as batchd bench)")
        fixed = {"mode": "fixed", "seed": o.seed, "lengths": lengths, "batch_size": bs}
        padded = -(-o.num_samples // o.world_size) * o.world_size  # DistributedSampler pads
        base = run.trainers("fixed", fixed, [{} for _ in range(o.world_size)], padded, "fixed run")
        add_baseline(summary, summarize(lengths, base, check_coverage=False), bs)
    return summary
