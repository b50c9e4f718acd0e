"""`batchd bench`'s report: one system's metrics from its ranks' step records (`summarize`), the median of
repeated runs, and the PNG plots."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from batchd.core import cost_check, mean_imbalance


def _epoch_evals(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Held-out loss after each epoch (rank 0 evaluates), with the time the epoch ended (all ranks done)."""
    evals = next((r["epoch_evals"] for r in results if r.get("eval")), [])
    return [
        {"epoch": e["epoch"], "t": max(r["epoch_evals"][k]["t"] for r in results), "loss": e["eval"]["loss"]}
        for k, e in enumerate(evals)
    ]


def summarize(
    system: str, results: list[dict[str, Any]], num_samples: int, epochs: int = 1
) -> dict[str, Any]:
    """One system's metrics from its ranks' step records (steps combined across ranks by index); every
    id is expected `epochs` times."""
    n_steps = max(len(r["steps"]) for r in results)
    curve, times, mats = [], [], []
    for k in range(n_steps):
        recs = [r["steps"][k] for r in results if k < len(r["steps"])]
        ls, lt = sum(x["loss_sum"] for x in recs), sum(x["loss_tokens"] for x in recs)
        curve.append(ls / lt if lt else float("nan"))
        times.append(max(x["t"] for x in recs))
        mats.append(max(x["materialized"] for x in recs))
    counts: dict[int, int] = {}
    for r in results:
        for s in r["steps"]:
            for i in s["ids"]:
                counts[i] = counts.get(i, 0) + 1
    real = sum(s["real"] for r in results for s in r["steps"])
    mat = sum(s["materialized"] for r in results for s in r["steps"])
    tail = max(1, math.ceil(0.1 * n_steps))
    tail_recs = [
        r["steps"][k] for r in results for k in range(n_steps - tail, n_steps) if k < len(r["steps"])
    ]
    t_ls, t_lt = sum(x["loss_sum"] for x in tail_recs), sum(x["loss_tokens"] for x in tail_recs)
    wall = max(r["wall_s"] for r in results)
    wait = max(sum(s["wait_s"] for s in r["steps"]) for r in results)
    mean_mat = [
        sum(r["steps"][k]["materialized"] for r in results if k < len(r["steps"])) / len(results)
        for k in range(n_steps)
    ]
    ev = next((r["eval"] for r in results if r.get("eval")), None)
    per_update = max((r.get("updates") or [] for r in results), key=len)
    update_len_cv = _update_length_spread(results)
    seen, tokens_curve = 0, []
    for k in range(n_steps):  # real tokens trained so far, all ranks, after each step
        seen += sum(r["steps"][k]["real"] for r in results if k < len(r["steps"]))
        tokens_curve.append(seen)
    return {
        "wall_s": wall,
        "samples": sum(counts.values()),
        "steps": n_steps,
        "steps_per_rank": [len(r["steps"]) for r in results],
        "idle": sum(1 for r in results for s in r["steps"] if not s["ids"]),
        "missing": sum(epochs - counts.get(i, 0) for i in range(num_samples) if counts.get(i, 0) < epochs),
        "duplicates": sum(c - epochs for c in counts.values() if c > epochs),
        "unexpected": sum(1 for i in counts if not 0 <= i < num_samples),
        "real_tokens": real,
        "materialized_tokens": mat,
        "padding_efficiency": real / mat if mat else 1.0,
        "tokens_per_rank_step": mat / max(sum(len(r["steps"]) for r in results), 1),
        "final_loss": t_ls / t_lt if t_lt else float("nan"),
        "final_loss_steps": tail,
        "heldout_loss": ev["loss"] if ev else None,
        "heldout_by_epoch": _epoch_evals(results),
        "heldout_samples": ev["samples"] if ev else 0,
        "first_loss": next((x for x in curve if x == x), float("nan")),
        "samples_per_s": sum(counts.values()) / wall if wall > 0 else float("nan"),
        "stall_fraction": wait / wall if wall > 0 else 0.0,
        "startup_s": max(r["startup_s"] for r in results),
        "trainer_cpu_s": max(r.get("cpu_s", 0.0) for r in results),
        "rank_imbalance": sum(mats) / sum(mean_mat) if sum(mean_mat) else 1.0,
        "vision_imbalance": _vision_imbalance(results, n_steps),
        "cost_check": _cost_check(results),
        "encoder_patches": sum(s.get("patches", 0) for r in results for s in r["steps"]),
        **_vision_share(results[0]),
        **_vision_share(results[0], "audio", "frames"),
        "params": results[0].get("params"),
        "loss_curve": curve,
        "step_times": times,
        "tokens_curve": tokens_curve,
        "updates": len(per_update),
        "update_tokens_min": min(per_update, default=0),
        "update_tokens_mean": sum(per_update) / len(per_update) if per_update else 0.0,
        "update_tokens_max": max(per_update, default=0),
        "update_length_cv": update_len_cv,
    }


def _update_length_spread(results: list[dict[str, Any]]) -> float:
    """How much the updates' composition varies: the coefficient of variation, over the epoch's optimizer
    updates (cut where rank 0's updates end), of each update's mean sample length (real tokens / samples,
    all ranks). Random fixed-size micro-batches give a low value; updates of a few length-homogeneous
    token-budget steps a high one."""
    ends = [k for k, s in enumerate(results[0]["steps"]) if s.get("update_end")]
    means, start = [], 0
    for end in ends:
        recs = [r["steps"][k] for r in results for k in range(start, end + 1) if k < len(r["steps"])]
        samples = sum(len(x["ids"]) for x in recs)
        if samples:
            means.append(sum(x["real"] for x in recs) / samples)
        start = end + 1
    if len(means) < 2:
        return 0.0
    return statistics.pstdev(means) / statistics.fmean(means)


def _vision_share(result: dict[str, Any], tower: str = "vision", load: str = "patches") -> dict[str, Any]:
    """Rank 0's vision tower share of its steps (`VisionTimer`, multimodal workloads): `vision_share`, the
    tower's forward + backward seconds over the rank's wall time (every step's whole span: data wait,
    forward, backward and all-reduce, optimizer); `vision_share_mean`, the mean over its steps with images
    of each step's share; `vision_s`, the seconds in all. Empty for a text workload. With `tower="audio"`
    (and `load="frames"`) the same of the audio encoder (`audio_share`, ...; a workload with clips)."""
    steps = result["steps"]
    if not steps or f"{tower}_s" not in steps[0]:
        return {}
    spans, prev = [], 0.0
    for s in steps:
        spans.append(max(s["t"] - prev, 1e-9))
        prev = s["t"]
    vis = [s.get(f"{tower}_s", 0.0) for s in steps]
    with_items = [v / span for v, span, s in zip(vis, spans, steps, strict=False) if s.get(load)]
    return {
        f"{tower}_s": sum(vis),
        f"{tower}_share": sum(vis) / result["wall_s"] if result["wall_s"] > 0 else None,
        f"{tower}_share_mean": sum(with_items) / len(with_items) if with_items else 0.0,
    }


def _cost_check(results: list[dict[str, Any]]) -> dict[str, Any]:
    """How well the planned cost (batchd's plan; fixed's and ODB's padded rows x longest) predicted each
    rank's measured forward + backward, over the steps every rank ran (`batchd.core.cost_check`)."""
    n = min(len(r["steps"]) for r in results)
    steps = [[r["steps"][k] for r in results] for k in range(n)]
    return cost_check(
        [[float(x.get("cost", 0.0)) for x in row] for row in steps],
        [[float(x.get("compute_s", 0.0)) for x in row] for row in steps],
    )


def _vision_imbalance(results: list[dict[str, Any]], n_steps: int) -> float | None:
    """Mean over steps with images of max / mean of the encoder patches the ranks ran (1.0: balanced)."""
    return mean_imbalance(
        [r["steps"][k].get("patches", 0) if k < len(r["steps"]) else 0 for r in results]
        for k in range(n_steps)
    )


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], []
    for v in values:
        if v == v:
            acc.append(v)
        acc = acc[-window:]
        out.append(sum(acc) / len(acc) if acc else float("nan"))
    return out


def write_plots(
    systems: dict[str, dict[str, Any]], out: Path, title: str, prefix: str = "bench_"
) -> list[Path]:
    """loss vs step, vs wall time and vs tokens seen, and a wall-time bar chart, as PNGs under `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = {k: v for k, v in systems.items() if "wall_s" in v}
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    kinds = [("step", "step"), ("time", "wall time (s)"), ("tokens", "tokens seen (all ranks)")]
    for kind, xlabel in kinds:
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        for name, s in ran.items():
            xs = {
                "step": list(range(1, len(s["loss_curve"]) + 1)),
                "time": s["step_times"],
                "tokens": s.get("tokens_curve") or list(range(1, len(s["loss_curve"]) + 1)),
            }[kind]
            w = max(1, len(s["loss_curve"]) // 20)
            (line,) = ax.plot(xs, s["loss_curve"], alpha=0.25, linewidth=0.8)
            ax.plot(
                xs,
                _smooth(s["loss_curve"], w),
                color=line.get_color(),
                linewidth=1.8,
                label=f"{name} ({len(xs)} steps, {s.get('updates') or len(xs)} updates, {s['wall_s']:.1f} s)",
            )
        ax.set_xlabel(xlabel)
        ax.set_ylabel("global per-token loss (train)")
        ax.set_title(f"loss vs {xlabel.split(' (')[0]}: {title}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{prefix}loss_vs_{kind}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
    names = list(ran)
    walls = [ran[n]["wall_s"] for n in names]
    bars = ax.bar(
        names,
        walls,
        color=["#888888" if n == "fixed" else "#d98c3a" if n.startswith("odb") else "#3a7bd5" for n in names],
    )
    base = ran.get("fixed", {}).get("wall_s")
    for b, n in zip(bars, names, strict=False):
        label = f"{ran[n]['wall_s']:.1f} s" + (f"\n{base / ran[n]['wall_s']:.2f}x vs fixed" if base else "")
        ax.annotate(
            label, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8
        )
    ax.set_ylabel("epoch wall time (s)")
    ax.set_ylim(0, max(walls) * 1.3 if walls else 1)
    ax.set_title(f"wall time: {title}", fontsize=9)
    fig.tight_layout()
    path = out / f"{prefix}wall_time.png"
    fig.savefig(path)
    plt.close(fig)
    paths.append(path)
    return paths


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose wall time is the median (lower median for an even count) + every run's wall time."""
    ordered = sorted(runs, key=lambda r: r["wall_s"])
    pick = dict(ordered[(len(ordered) - 1) // 2])
    pick["wall_s_runs"] = [r["wall_s"] for r in runs]
    pick["runs"] = len(runs)
    return pick
