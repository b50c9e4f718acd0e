"""`batchd demo`: the main job on an embedded default, end to end, against fixed batching.

One command starts one local Ray (or joins `--ray-address`), the coordinator, this host's node agent
(`batchd node`: the rank services of all N ranks in one process, one stream to the coordinator) and N
trainer processes (torch.distributed gloo on CPU) that train a tiny multimodal LM (`TinyMLLM`; the tiny
causal LM with `--synthetic`) for one epoch through the batchd client, two-phase by default on image data
(`run_demo`'s `phases`). Each rank's service preprocesses its sampler view of the dataset with its own
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
L makes the rule, and B=1 would flatter batchd) and reports both. `synthetic=True` (`--synthetic`) serves
synthetic tokenized samples with long-tail lengths instead, without Ray (`batchd node --lengths`).

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
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import ray

from batchd.core import JobFailed, JobSpec, mean_imbalance
from batchd.launch import (
    MARKER_ENV,
    Processes,
    Reaper,
    spec_argv,
    start_node_agents,
    start_trainers,
    wait_trainers,
)
from batchd.proto import Progress
from batchd.service.preprocess import (
    HFProcessor,
    Quarantine,
    RecordDataset,
    TokenizerRef,
    demo_tokenizer,
    make_demo_dataset,
    quiet_token_auth,
    start_local_ray,
)

DEMO_BUDGET = 1024
# The fixed-batching baseline's batch size: the bench's B on its default workload (floor(8192 / 4064)), what
# a user would pick; on the tiny CPU model a step of two samples up to L each cannot run out of memory.
BASELINE_BATCH_SIZE = 2


IMAGE_TOKEN = "<|image_pad|>"  # the Qwen2-VL visual token of the demo chain: where TinyMLLM writes images
AUDIO_TOKEN = "<|AUDIO|>"  # the Qwen2-Audio clip token of the demo chain: where TinyMLLM writes clips
DEMO_AUDIO_FRACTION = 0.1  # share of the generated records with 1-2 clips (where the chain hears them)


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


def _trainers(
    procs: Processes,
    work: Path,
    tag: str,
    world_size: int,
    common: dict[str, Any],
    per_rank: list[dict[str, Any]],
    timeout: float,
    say=None,
    total: int | None = None,
    desc: str = "",
) -> list[dict[str, Any]]:
    """Runs one phase's trainers; with `say` (the demo's progress printer) shows the phase's progress in
    samples of every rank together out of `total` (a bar on a terminal, else a `say` line every
    $BATCHD_PROGRESS_S seconds)."""
    _, outs = start_trainers(procs, work, tag, world_size, common, per_rank)
    bar = Progress(desc, total, "samples", emit=say) if say is not None else None
    return wait_trainers(procs, tag, outs, timeout, bar)


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
    world_size: int = 2,
    num_samples: int = 1024,
    token_budget: int = DEMO_BUDGET,
    policy: str | None = None,
    window: int | None = None,
    depth: int | None = None,
    seed: int | None = None,
    baseline: bool = True,
    progress=None,
    timeout: float = 900.0,
    keep_dir: bool = False,
    synthetic: bool = False,
    dataset: str | None = None,
    num_actors: int = 2,
    ray_address: str | None = None,
    tokenizer: str | None = None,
    step_time: float = 0.0,
    phases: int | None = None,
    memory_budget: str | None = None,
    max_bad_fraction: float | None = None,
    processor: str | None = None,
    deterministic: bool | None = None,
) -> dict[str, Any]:
    """Runs the demo; returns the summary dict `batchd demo --json` prints. `step_time`: seconds each batchd
    trainer sleeps per step (a real model's step time; the job must not mind). `memory_budget`,
    `max_bad_fraction`: the node agent's [data] keys (None: their defaults). `deterministic`: the job's
    `JobSpec.deterministic`: the same data, seed and config give the same batches, steps and losses
    (`step_digests`, `losses` in the summary) whatever the actors' and trainers' speed. `policy`,
    `window`, `depth`, `seed`, `deterministic`: the job's keys (None: `JobSpec`'s defaults).

    Ray path (default): `dataset` (None: generate `num_samples` demo records, `DEMO_AUDIO_FRACTION` of
    them with clips where the chain turns clips into audio tokens, `audio_model_cfg`), `num_actors`
    preprocessing actors in all (the same number per rank, at least one each), `ray_address` (None: start
    a local Ray here, which the node agent joins), `tokenizer` (None: the demo tokenizer), `processor` (a
    Hugging Face processor directory whose `HFProcessor` replaces the built-in template/tokenizer/vision/
    audio stages; its tokenizer sizes the model unless `tokenizer` is given; clips only when it has an
    audio feature extractor). `synthetic=True`: synthetic samples, no Ray.

    `phases` (None: 2 for the image data of the Ray path under policy balanced, else 1): with 2 the
    coordinator also balances the vision encoder every step (`batchd.core.plan_vision`) and the trainers'
    `TinyMLLM` exchanges the image embeddings with one all-to-all per step (and in rounds with clips the
    audio encoder's likewise, `audio_imbalance`). Two-phase is the default for image data because its
    cost is one collective of a few embedding rows while an unbalanced encoder phase makes every rank
    wait for the one that holds most images (`vision_imbalance` in the summary).
    """
    given = dict(policy=policy, window=window, depth=depth, seed=seed, deterministic=deterministic)
    job = JobSpec.from_keys(
        world_size=world_size, token_budget=token_budget, **{k: v for k, v in given.items() if v is not None}
    )
    policy, seed = job.policy.name, job.seed
    if phases is None:
        phases = 2 if not synthetic and policy == "balanced" else 1
    say = progress or (lambda msg: None)
    show = progress  # the trainers' progress lines too (None: no bar, no lines)
    main_thread = threading.current_thread() is threading.main_thread()
    signals = _Signals()
    if main_thread:  # SIGINT and SIGTERM unwind through the finally below: children stop, Ray is shut down
        signals.install()
    work = Path(tempfile.mkdtemp(prefix="batchd-demo-"))
    marker = uuid.uuid4().hex
    reaper = None if keep_dir or not sys.platform.startswith("linux") else Reaper(work, marker)
    procs = Processes(work, {MARKER_ENV: marker})
    ray_started = False
    t_start = time.perf_counter()
    try:
        say(f"logs and temporary files in {work}")
        spec = spec_argv(job.replace(phases=phases))
        if synthetic:
            summary = _run_synthetic(
                procs,
                work,
                spec,
                world_size,
                num_samples,
                token_budget,
                policy,
                seed,
                baseline,
                say,
                timeout,
                t_start,
                step_time,
                show,
            )
        else:
            ray_started = ray_address is None
            summary = _run_ray(
                procs,
                work,
                spec,
                world_size,
                num_samples,
                token_budget,
                policy,
                seed,
                baseline,
                say,
                timeout,
                t_start,
                dataset,
                num_actors,
                ray_address,
                tokenizer,
                marker,
                step_time,
                memory_budget,
                max_bad_fraction,
                processor,
                show,
            )
        summary["phases"] = phases
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
            if not keep_dir:
                shutil.rmtree(work, ignore_errors=True)
        finally:
            if reaper is not None:
                reaper.close()
            signals.restore()


def generated_bad_fraction(bad: int, records: int, world_size: int, default: float = 0.1) -> float:
    """The demo's max_bad_fraction for its own generated dataset: the default, or, where the deliberate bad
    records (at least one of each kind, however small the dataset) are a larger share, twice their share
    of a rank's view (views differ in size, and the bad records are not dealt evenly), at most 1."""
    return max(default, min(1.0, 2 * bad * world_size / records))


def kept_quarantine(work: Path) -> Path:
    """Where the demo leaves its quarantine file (beside its temporary directory, which it removes)."""
    return work.with_name(work.name + "-quarantine.jsonl")


def _run_synthetic(
    procs,
    work,
    spec,
    world_size,
    num_samples,
    token_budget,
    policy,
    seed,
    baseline,
    say,
    timeout,
    t_start,
    step_time=0.0,
    show=None,
) -> dict[str, Any]:
    lengths = demo_lengths(num_samples)
    lengths_file = work / "lengths.txt"
    lengths_file.write_text("\n".join(map(str, lengths)) + "\n")
    say(
        f"starting coordinator and a node agent for {world_size} ranks ({num_samples} synthetic samples, "
        f"L={token_budget}, policy {policy})"
    )
    _, ports = start_node_agents(procs, work, spec, world_size, world_size, lengths_file)
    say(f"training one epoch on {world_size} gloo DDP trainers through batchd")
    results = _trainers(
        procs,
        work,
        "batchd",
        world_size,
        {"mode": "batchd", "seed": seed, "step_time": step_time},
        [{"service": f"127.0.0.1:{ports[r]}"} for r in range(world_size)],
        timeout,
        show,
        num_samples,
        "batchd run",
    )
    summary = summarize(lengths, results)
    summary["startup_and_teardown_s"] = time.perf_counter() - t_start - summary["wall_s"]
    if baseline:
        bs = BASELINE_BATCH_SIZE
        say(f"baseline: the same epoch with fixed batching at batch size B={bs} (as batchd bench)")
        base = _trainers(
            procs,
            work,
            "fixed",
            world_size,
            {"mode": "fixed", "seed": seed, "lengths": lengths, "batch_size": bs},
            [{} for _ in range(world_size)],
            timeout,
            show,
            -(-num_samples // world_size) * world_size,
            "fixed run",
        )  # DistributedSampler pads
        _add_baseline(summary, summarize(lengths, base, check_coverage=False), bs)
    return summary


def _add_baseline(summary: dict[str, Any], b: dict[str, Any], bs: int) -> None:
    summary["baseline"] = {
        "wall_s": b["wall_s"],
        "steps": b["steps_per_rank"][0],
        "batch_size": bs,
        "padding_efficiency": b["padding_efficiency"],
        "loss_last": b["loss_last"],
        "stall_fraction": b["stall_fraction"],
        "vision_imbalance": b["vision_imbalance"],
        "clips": b["clips"],
        "audio_imbalance": b["audio_imbalance"],
    }
    summary["speedup"] = b["wall_s"] / summary["wall_s"]


def actors_per_rank(num_actors: int, world_size: int) -> list[int]:
    """`num_actors` spread over the ranks as evenly as possible, at least one per rank."""
    return [
        max(1, num_actors // world_size + (1 if r < num_actors % world_size else 0))
        for r in range(world_size)
    ]


def _vocab_size(tokenizer: str | os.PathLike) -> int:
    """1 + the largest token id of a tokenizer.json or HF tokenizer directory (vocabulary and added tokens).

    Raises:
        FileNotFoundError, ValueError: naming `tokenizer` when it is missing or not a tokenizer.
    """
    return TokenizerRef(tokenizer).id_space


def audio_model_cfg(tok: str | os.PathLike, processor: str | os.PathLike | None = None) -> dict[str, int]:
    """TinyMLLM's audio keys where the node agent's chain turns clips into audio tokens: the built-in chain's
    `Qwen2Audio` (every job's chain runs it; a tokenizer holding `<|AUDIO|>`), or with `processor` the
    model's own processor when it has an audio feature extractor and an audio token (its mel bins too).
    {} where the chain quarantines clips (`unsupported_audio`): the model then has no audio encoder."""
    token, n_mels = AUDIO_TOKEN, None
    if processor:
        from transformers import SequenceFeatureExtractor

        notes = logging.getLogger("batchd.service.preprocess")  # its load notes: the node agent logs them
        level = notes.level
        notes.setLevel(logging.ERROR)
        try:
            proc = HFProcessor(processor).processor
        finally:
            notes.setLevel(level)
        fe = getattr(proc, "audio_processor", None) or getattr(proc, "feature_extractor", None)
        token = getattr(proc, "audio_token", None)
        if not isinstance(fe, SequenceFeatureExtractor) or not token:
            return {}
        token, n_mels = str(token), int(fe.feature_size)
    try:
        cfg = {"audio_token_id": TokenizerRef(tok).token_id(token)}
    except (KeyError, ValueError):
        return {}
    return cfg | ({"n_mels": n_mels} if n_mels else {})


def _run_ray(
    procs,
    work,
    spec,
    world_size,
    num_samples,
    token_budget,
    policy,
    seed,
    baseline,
    say,
    timeout,
    t_start,
    dataset,
    num_actors,
    ray_address,
    tokenizer,
    marker,
    step_time=0.0,
    memory_budget=None,
    max_bad_fraction=None,
    processor=None,
    show=None,
) -> dict[str, Any]:
    expected_bad: dict[int, str] | None = None
    expected_clips = None
    if dataset is not None:
        records = len(RecordDataset(dataset))  # validates the schema here, before any process starts
    tok = Path(tokenizer) if tokenizer else Path(processor) if processor else demo_tokenizer()
    # A missing or bad tokenizer fails here, before any process. The model reads the images (TinyMLLM),
    # and the clips where the node agent's chain turns them into audio tokens.
    model_cfg = {"vocab_size": _vocab_size(tok), "image_token_id": TokenizerRef(tok).token_id(IMAGE_TOKEN)}
    model_cfg |= audio_model_cfg(tok, processor)
    if dataset is None:  # clips only where the chain hears them: else they would be quarantined
        heard = DEMO_AUDIO_FRACTION if "audio_token_id" in model_cfg else 0.0
        demo = make_demo_dataset(work / "data", num_samples=num_samples, seed=seed, audio_fraction=heard)
        dataset, expected_bad, expected_clips = str(demo.path), demo.bad, demo.clips
        records = demo.num_records
    per_rank = actors_per_rank(num_actors, world_size)
    if ray_address is None:  # one Ray for the whole demo: the node agent joins it (--ray-address)
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        previous = os.environ.get(MARKER_ENV)
        os.environ[MARKER_ENV] = marker  # Ray's processes inherit it: the reaper finds them by it
        try:
            quiet_token_auth()  # token auth on, without Ray's warning (its children inherit the mode)
            start_local_ray(num_cpus=sum(per_rank), include_dashboard=False, log_to_driver=False)
        finally:
            if previous is None:
                os.environ.pop(MARKER_ENV, None)
            else:
                os.environ[MARKER_ENV] = previous
            for sig, handler in handlers.items():  # ray.init installs its own SIGTERM handler; ours stays
                if handler is not None:
                    signal.signal(sig, handler)
        ray_address = ray.get_runtime_context().gcs_address
    say(
        f"Ray at {ray_address}; {sum(per_rank)} preprocessing actors ({per_rank} per rank) "
        f"on {records} records of {dataset}"
    )

    node_args = [
        "--dataset",
        str(dataset),
        "--tokenizer",
        str(tok),
        "--num-actors",
        str(max(per_rank)),
        "--ray-address",
        ray_address,
        "--quarantine",
        str(work / "quarantine.jsonl"),
        "--stats-file",
        str(work / "stats-{rank}.json"),
    ]
    if memory_budget is not None:
        node_args += ["--memory-budget", str(memory_budget)]
    if max_bad_fraction is None and expected_bad:
        max_bad_fraction = generated_bad_fraction(len(expected_bad), num_samples, world_size)
    if max_bad_fraction is not None:
        node_args += ["--max-bad-fraction", str(max_bad_fraction)]
    if processor:
        node_args += ["--processor", str(processor)]
    say(f"starting coordinator and a node agent for {world_size} ranks (L={token_budget}, policy {policy})")
    _, ports = start_node_agents(procs, work, spec, world_size, world_size, None, node_args=node_args)
    say(f"training one epoch on {world_size} gloo DDP trainers through batchd")
    results = _trainers(
        procs,
        work,
        "batchd",
        world_size,
        {"mode": "batchd", "seed": seed, "model_cfg": model_cfg, "step_time": step_time},
        [{"service": f"127.0.0.1:{ports[r]}"} for r in range(world_size)],
        timeout,
        show,
        records,
        "batchd run",
    )  # of the records; the bad ones drop out
    try:  # it exits on its own once every trainer took the last batch
        procs.get("node-0").wait(60)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"the node agent did not exit after the epoch:\n{procs.log('node-0')}") from None
    stats = []
    for r in range(world_size):
        path = work / f"stats-{r}.json"
        if not path.exists():
            raise RuntimeError(
                f"the node agent wrote no stats for rank {r} (exit {procs.get('node-0').returncode}):"
                f"\n{procs.log('node-0')}"
            )
        stats.append(json.loads(path.read_text()))
    quarantined_ids = set()
    q = work / "quarantine.jsonl"
    if q.exists():
        quarantined_ids = {int(line["id"]) for line in Quarantine.read(q)}
    good = [i for i in range(records) if i not in quarantined_ids]
    summary = summarize(good, results, expected_ids=good)
    summary["startup_and_teardown_s"] = time.perf_counter() - t_start - summary["wall_s"]
    pre = {
        "actors": sum(s["actors"] for s in stats),
        "samples": sum(s["samples"] for s in stats),
        "quarantined": sum(s["quarantined"] for s in stats),
        "records_read": sum(s["records_read"] for s in stats),
        "records": records,
        "samples_per_s": sum(s["samples"] for s in stats) / summary["wall_s"]
        if summary["wall_s"] > 0
        else 0.0,
        "capacity_samples_per_s": _capacity(stats),
        "actor_busy_fraction": (
            sum(s.get("actor_busy_s", 0.0) for s in stats)
            / max(sum(s["actors"] * s["wall_s"] for s in stats), 1e-9)
        ),
        "stall_fraction": summary["stall_fraction"],
        "stall_fraction_per_rank": summary["stall_fraction_per_rank"],
        "reasons": _sum_counts(s["reasons"] for s in stats),
        "quarantine_file": str(kept_quarantine(work)),
        "retries": sum(s["retries"] for s in stats),
        "peak_held_bytes": max(s.get("peak_held_bytes", 0) for s in stats),
    }
    pre["accounting_ok"] = (
        pre["samples"] + pre["quarantined"] == pre["records_read"] == records
        and pre["samples"] == summary["emitted"]
        and len(quarantined_ids) == pre["quarantined"]
    )
    if expected_bad is not None:
        pre["expected_quarantined"] = len(expected_bad)
        pre["expected_clips"] = expected_clips
        pre["accounting_ok"] = pre["accounting_ok"] and quarantined_ids == set(expected_bad)
    summary["preprocess"] = pre
    if baseline:
        bs = BASELINE_BATCH_SIZE
        say(
            f"baseline: the same epoch with fixed batching on the same preprocessed samples at batch size "
            f"B={bs} (as batchd bench)"
        )
        common = {
            "mode": "fixed",
            "seed": seed,
            "batch_size": bs,
            "model_cfg": model_cfg,
            "dataset": str(dataset),
            "tokenizer": str(tok),
            "cutoff": token_budget,
            "ray_address": ray_address,
            "processor": str(processor) if processor else None,
        }
        base = _trainers(
            procs,
            work,
            "fixed",
            world_size,
            common,
            [{"num_actors": n} for n in per_rank],
            timeout,
            show,
            len(good),
            "fixed run",
        )
        _add_baseline(summary, summarize(good, base, check_coverage=False), bs)
    return summary


def _capacity(stats: list[dict[str, Any]]) -> float | None:
    """Records the actors preprocess per second of their busy time, all actors together."""
    busy = sum(s.get("actor_busy_s", 0.0) for s in stats)
    if busy <= 0:
        return None
    return sum(s["records_read"] for s in stats) * sum(s["actors"] for s in stats) / busy


def _sum_counts(dicts: Iterable[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + int(v)
    return out


def summarize(
    lengths: list[int],
    results: list[dict[str, Any]],
    check_coverage: bool = True,
    expected_ids: Iterable[int] | None = None,
) -> dict[str, Any]:
    """The demo's metrics over the trainers' results; `missing` counts ids of `expected_ids` (default:
    0 .. len(lengths) - 1) that no trainer trained on."""
    ids = [i for r in results for step in r["sample_ids"] for i in step]
    counts: dict[int, int] = {}
    for i in ids:
        counts[i] = counts.get(i, 0) + 1
    real = sum(r["real_tokens"] for r in results)
    padded = sum(r["padded_tokens"] for r in results)
    losses = [x for x in results[0]["losses"] if x == x]
    stalls = [r.get("wait_s", 0.0) / r["wall_s"] if r["wall_s"] > 0 else 0.0 for r in results]
    return {
        "steps_per_rank": [r["steps"] for r in results],
        "step_digests": step_digests(results),
        "losses": losses,
        "emitted": len(ids),
        "missing": sum(
            1 for i in (range(len(lengths)) if expected_ids is None else expected_ids) if i not in counts
        ),
        "duplicates": sum(c - 1 for c in counts.values() if c > 1),
        "idle": sum(r["idle"] for r in results),
        "real_tokens": real,
        "padded_tokens": padded,
        "padding_efficiency": real / padded if padded else 1.0,
        "wall_s": max(r["wall_s"] for r in results),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "stall_fraction": max(stalls),
        "stall_fraction_per_rank": stalls,
        "vision_imbalance": vision_imbalance(results),
        "clips": sum(sum(r.get("encoded_clips", ())) for r in results),
        "audio_imbalance": vision_imbalance(results, "encoded_frames"),
    }


def step_digests(results: list[dict[str, Any]]) -> list[str]:
    """One short digest per global step: of every rank's sample ids at that step, in rank order (two runs
    made the same batches iff their digests are equal)."""
    per_rank = [r["sample_ids"] for r in results]
    steps = max((len(p) for p in per_rank), default=0)
    return [
        hashlib.sha256(json.dumps([p[k] if k < len(p) else None for p in per_rank]).encode()).hexdigest()[:16]
        for k in range(steps)
    ]


def vision_imbalance(results: list[dict[str, Any]], load: str = "encoded_patches") -> float | None:
    """The mean over steps with images of (max / mean) of the encoder patches the ranks ran (1.0: every
    rank encoded alike); None when no step had an image or a trainer did not record them. `load`
    "encoded_frames": the same of the audio encoder's frames, over steps with clips."""
    per_rank = [r.get(load) for r in results]
    if not all(per_rank) or len({len(p) for p in per_rank}) != 1:
        return None
    return mean_imbalance(zip(*per_rank, strict=False))
