"""The Ray path of `batchd demo` (`batchd.demo` says what it runs): its data and model, the local Ray, the
node agent that preprocesses every rank's view with Ray actors, the trainers of both systems and the
`preprocess` report of the summary.

`run_ray` runs it in steps: the data and the model's keys (`_prepare`), the Ray (`_start_ray`), the
services (`_node_args`), batchd's epoch, the node agent's stats and quarantine (`_collect`), the report
(`_preprocess_report`) and the fixed-batching baseline (`_baseline`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import ray

from batchd._demo_run import BASELINE_BATCH_SIZE, DemoRun, add_baseline, kept_quarantine, summarize
from batchd.launch import MARKER_ENV
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

IMAGE_TOKEN = "<|image_pad|>"  # the Qwen2-VL visual token of the demo chain: where TinyMLLM writes images
AUDIO_TOKEN = "<|AUDIO|>"  # the Qwen2-Audio clip token of the demo chain: where TinyMLLM writes clips
DEMO_AUDIO_FRACTION = 0.1  # share of the generated records with 1-2 clips (where the chain hears them)


def generated_bad_fraction(bad: int, records: int, world_size: int, default: float = 0.1) -> float:
    """The demo's max_bad_fraction for its own generated dataset: the default, or, where the deliberate bad
    records (at least one of each kind, however small the dataset) are a larger share, twice their share
    of a rank's view (views differ in size, and the bad records are not dealt evenly), at most 1."""
    return max(default, min(1.0, 2 * bad * world_size / records))


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


@dataclasses.dataclass(frozen=True)
class _Data:
    """The Ray path's data and model: the `dataset` of `records` records, the tokenizer `tok`, the trainers'
    `model_cfg`; for the generated dataset its bad records (`expected_bad`, id -> kind) and clips."""

    dataset: str
    records: int
    tok: Path
    model_cfg: dict[str, int]
    expected_bad: dict[int, str] | None = None
    expected_clips: int | None = None


def _prepare(run: DemoRun) -> _Data:
    """The data and the model's keys; a bad dataset or tokenizer fails here, before any process starts."""
    o = run.options
    if o.dataset is not None:
        records = len(RecordDataset(o.dataset))  # validates the schema here, before any process starts
    tok = Path(o.tokenizer) if o.tokenizer else Path(o.processor) if o.processor else demo_tokenizer()
    # A missing or bad tokenizer fails here, before any process. The model reads the images (TinyMLLM),
    # and the clips where the node agent's chain turns them into audio tokens.
    model_cfg = {"vocab_size": _vocab_size(tok), "image_token_id": TokenizerRef(tok).token_id(IMAGE_TOKEN)}
    model_cfg |= audio_model_cfg(tok, o.processor)
    if o.dataset is not None:
        return _Data(str(o.dataset), records, tok, model_cfg)
    # clips only where the chain hears them: else they would be quarantined
    heard = DEMO_AUDIO_FRACTION if "audio_token_id" in model_cfg else 0.0
    demo = make_demo_dataset(run.work / "data", num_samples=o.num_samples, seed=o.seed, audio_fraction=heard)
    return _Data(str(demo.path), demo.num_records, tok, model_cfg, demo.bad, demo.clips)


def _start_ray(marker: str, num_cpus: int) -> str:
    """Starts one local Ray for the whole demo (the node agent joins it) and returns its address; its
    processes inherit the run `marker` (the reaper finds them by it), and our signal handlers stay."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    previous = os.environ.get(MARKER_ENV)
    os.environ[MARKER_ENV] = marker  # Ray's processes inherit it: the reaper finds them by it
    try:
        quiet_token_auth()  # token auth on, without Ray's warning (its children inherit the mode)
        start_local_ray(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    finally:
        if previous is None:
            os.environ.pop(MARKER_ENV, None)
        else:
            os.environ[MARKER_ENV] = previous
        for sig, handler in handlers.items():  # ray.init installs its own SIGTERM handler; ours stays
            if handler is not None:
                signal.signal(sig, handler)
    return str(ray.get_runtime_context().gcs_address)


def _node_args(run: DemoRun, data: _Data, ray_address: str, per_rank: list[int]) -> tuple[str, ...]:
    """The node agent's flags: the dataset, its preprocessing on `per_rank` actors and its limits."""
    o, work = run.options, run.work
    args = ["--dataset", data.dataset, "--tokenizer", str(data.tok), "--num-actors", str(max(per_rank))]
    args += ["--ray-address", ray_address, "--quarantine", str(work / "quarantine.jsonl")]
    args += ["--stats-file", str(work / "stats-{rank}.json")]
    if o.memory_budget is not None:
        args += ["--memory-budget", str(o.memory_budget)]
    max_bad_fraction = _bad_limit(run, data)
    if max_bad_fraction is not None:
        args += ["--max-bad-fraction", str(max_bad_fraction)]
    if o.processor:
        args += ["--processor", str(o.processor)]
    return tuple(args)


def run_ray(run: DemoRun) -> dict[str, Any]:
    """The Ray path: preprocessing on Ray actors, batchd's epoch, then the baseline's; the summary with its
    `preprocess` report (`batchd.demo`'s docstring lists its keys)."""
    o = run.options
    data = _prepare(run)
    per_rank = actors_per_rank(o.num_actors, o.world_size)
    ray_address = _start_ray(run.marker, sum(per_rank)) if o.ray_address is None else o.ray_address
    run.say(
        f"Ray at {ray_address}; {sum(per_rank)} preprocessing actors ({per_rank} per rank) "
        f"on {data.records} records of {data.dataset}"
    )
    run.say(
        f"starting coordinator and a node agent for {o.world_size} ranks "
        f"(L={o.token_budget}, policy {o.policy})"
    )
    ports = run.start_services(None, _node_args(run, data, ray_address, per_rank))
    run.say(f"training one epoch on {o.world_size} gloo DDP trainers through batchd")
    common = {"mode": "batchd", "seed": o.seed, "model_cfg": data.model_cfg, "step_time": o.step_time}
    # the progress is of the records; the bad ones drop out
    results = run.trainers("batchd", common, run.service_addresses(ports), data.records, "batchd run")
    stats, quarantined_ids = _collect(run)
    good = [i for i in range(data.records) if i not in quarantined_ids]
    summary = summarize(good, results, expected_ids=good)
    summary["startup_and_teardown_s"] = time.perf_counter() - run.t_start - summary["wall_s"]
    summary["preprocess"] = _preprocess_report(run.work, data, stats, summary, quarantined_ids)
    if o.baseline:
        base = _baseline(run, data, ray_address, per_rank, len(good))
        add_baseline(summary, summarize(good, base, check_coverage=False), BASELINE_BATCH_SIZE)
    return summary


def _collect(run: DemoRun) -> tuple[list[dict[str, Any]], set[int]]:
    """Waits for the node agent to exit (it does once every trainer took the last batch); returns every
    rank's stats and the ids of the records it quarantined."""
    agent = run.procs.get("node-0")
    try:
        agent.wait(60)
    except subprocess.TimeoutExpired:
        raise TimeoutError(
            f"the node agent did not exit after the epoch:\n{run.procs.log('node-0')}"
        ) from None
    stats = []
    for r in range(run.options.world_size):
        path = run.work / f"stats-{r}.json"
        if not path.exists():
            raise RuntimeError(
                f"the node agent wrote no stats for rank {r} (exit {agent.returncode}):"
                f"\n{run.procs.log('node-0')}"
            )
        stats.append(json.loads(path.read_text()))
    q = run.work / "quarantine.jsonl"
    quarantined_ids = {int(line["id"]) for line in Quarantine.read(q)} if q.exists() else set()
    return stats, quarantined_ids


def _preprocess_report(
    work: Path, data: _Data, stats: list[dict[str, Any]], summary: dict[str, Any], quarantined_ids: set[int]
) -> dict[str, Any]:
    """The summary's `preprocess` (`batchd.demo`'s docstring): the sources' `stats` over the epoch."""
    records, wall_s = data.records, summary["wall_s"]
    samples = sum(s["samples"] for s in stats)
    pre = {
        "actors": sum(s["actors"] for s in stats),
        "samples": samples,
        "quarantined": sum(s["quarantined"] for s in stats),
        "records_read": sum(s["records_read"] for s in stats),
        "records": records,
        "samples_per_s": samples / wall_s if wall_s > 0 else 0.0,
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
    if data.expected_bad is not None:
        pre["expected_quarantined"] = len(data.expected_bad)
        pre["expected_clips"] = data.expected_clips
        pre["accounting_ok"] = pre["accounting_ok"] and quarantined_ids == set(data.expected_bad)
    return pre


def _baseline(
    run: DemoRun, data: _Data, ray_address: str, per_rank: list[int], good: int
) -> list[dict[str, Any]]:
    """The fixed-batching epoch on the same preprocessed samples (each trainer runs its rank's RaySource
    view on `per_rank` actors, `good` samples in all); its trainers' results."""
    o, bs = run.options, BASELINE_BATCH_SIZE
    run.say(
        f"baseline: the same epoch with fixed batching on the same preprocessed samples at batch size "
        f"B={bs} (as batchd bench)"
    )
    common = {
        "mode": "fixed",
        "seed": o.seed,
        "batch_size": bs,
        "model_cfg": data.model_cfg,
        "dataset": data.dataset,
        "tokenizer": str(data.tok),
        "cutoff": o.token_budget,
        "ray_address": ray_address,
        "processor": str(o.processor) if o.processor else None,
        "max_bad_fraction": _bad_limit(run, data),  # the node agent's: the same records, judged alike
    }
    return run.trainers("fixed", common, [{"num_actors": n} for n in per_rank], good, "fixed run")


def _bad_limit(run: DemoRun, data: _Data) -> float | None:
    """The bad-record limit of the demo's services and baseline: the user's, else for the generated
    dataset `generated_bad_fraction`, else None (the default)."""
    o = run.options
    if o.max_bad_fraction is None and data.expected_bad:
        return generated_bad_fraction(len(data.expected_bad), o.num_samples, o.world_size)
    return o.max_bad_fraction


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
