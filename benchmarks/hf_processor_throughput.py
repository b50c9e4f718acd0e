"""Preprocessing samples/s of one actor: a model's own HF processor (`HFProcessor`) vs the built-in chain.

Both chains run in this process, one thread (`torch.set_num_threads(1)`, `OMP_NUM_THREADS=1`,
`RAYON_NUM_THREADS=1`: what one Ray actor with one CPU gets), on the same demo records
(`demo_records`), through `Preprocessor` (image decoding included), cutoff 4096:

- `built-in`: `default_stages(tok)`: ChatTemplate("qwen2") + Tokenize + Qwen2VLVision + Truncate.
- `HF processor`: `default_stages(processor=DIR)`: HFProcessor + Truncate, DIR a Qwen2-VL processor
  built here and saved with `save_pretrained`: the demo tokenizer, Qwen2-VL's own chat template (no
  `{% generation %}` blocks: labels derived from rendered prefixes) and `Qwen2VLImageProcessor` with the
  built-in's min/max pixels (56 x 56, 14 x 14 x 4 x 1280).
- `HF, generation template`: the same processor with a template whose assistant turns are in
  `{% generation %}` blocks (labels from transformers' `return_assistant_tokens_mask`).

Workloads: `text` (no images), `image` (every record 1-2 images, 32-224 px a side), `image-large`
(32-672 px). Rates are the median of `--rounds` rounds, the chains interleaved within each round.
It also checks that the chains agree: input_ids and labels per record, and the built-in
Qwen2VLVision's pixel_values / image_grid_thw against the HF image processor's (max abs diff).

Result: benchmarks/results/hf-processor.json (template benchmarks/templates/hf-processor.md.j2).

Usage: python benchmarks/hf_processor_throughput.py [--samples N] [--rounds R] [--out PATH] [--print]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS"):
    os.environ[_var] = "1"  # before numpy, torch and tokenizers start their thread pools
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cli_runs import command, load_average, machine  # noqa: E402
from _report import add_common_args, finish  # noqa: E402

SECTION = "hf-processor"
MEASURES = ["service/preprocess"]
MIN_PIXELS, MAX_PIXELS = 56 * 56, 14 * 14 * 4 * 1280
WORKLOADS = {  # name -> (image_fraction, max_image_side, share of --samples)
    "text": (0.0, 224, 1.0),
    "image": (1.0, 224, 0.5),
    "image-large": (1.0, 672, 0.15),
}
# The tests' copies of Qwen2-VL's own chat template and of it with {% generation %} blocks (tests/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _hf_templates import QWEN2VL_GENERATION_TEMPLATE as GENERATION_TEMPLATE  # noqa: E402
from _hf_templates import QWEN2VL_TEMPLATE  # noqa: E402


def save_qwen2vl_processor(path: Path, tokenizer_json: Path, template: str) -> Path:
    """A Qwen2-VL processor (demo tokenizer + Qwen2VLImageProcessor) saved to `path`; without torchvision
    transformers cannot build its video processor, so it is saved without one."""
    from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessor, Qwen2VLProcessor

    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_json), pad_token="<|endoftext|>", eos_token="<|im_end|>"
    )
    ip = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    try:
        from transformers import Qwen2VLVideoProcessor

        proc = Qwen2VLProcessor(
            image_processor=ip, tokenizer=tok, video_processor=Qwen2VLVideoProcessor(), chat_template=template
        )
    except (ImportError, AttributeError, TypeError, ValueError):
        no_video = type(
            "Qwen2VLProcessor",
            (Qwen2VLProcessor,),
            {"get_attributes": classmethod(lambda c: ["image_processor", "tokenizer"])},
        )
        proc = no_video(image_processor=ip, tokenizer=tok, chat_template=template)
    proc.save_pretrained(path)
    return path


def records_of(name: str, n: int) -> list[Any]:
    from batchd.service.preprocess import demo_records
    from batchd.testing import parse_record

    frac, side, _ = WORKLOADS[name]
    raw, _ = demo_records(n, seed=11, image_fraction=frac, bad_fraction=0.0, max_image_side=side)
    return [parse_record(r) for r in raw]


def run_chain(pre, records) -> tuple[float, list[tuple[Any, dict[str, np.ndarray]]]]:
    """(CPU seconds, outputs) of the chain over the records: CPU time, as one actor with a core of its own
    would spend it (wall time on a shared machine also counts the other work's share of the cores)."""
    out = []
    t0 = time.process_time()
    for i, rec in enumerate(records):
        out.append(pre(rec, i, 0))
    return time.process_time() - t0, out


def agreement(base: list, other: list) -> dict[str, Any]:
    """How the built-in chain's outputs compare with an HF chain's on the same records."""
    pairs = [(a[1], b[1]) for a, b in zip(base, other, strict=False)]
    grids = [(a["image_grid_thw"], b["image_grid_thw"]) for a, b in pairs if "image_grid_thw" in a]
    diffs = [
        float(np.max(np.abs(a["pixel_values"] - b["pixel_values"])))
        for a, b in pairs
        if "pixel_values" in a and a["pixel_values"].shape == b.get("pixel_values", np.empty(0)).shape
    ]
    return {
        "records": len(pairs),
        "same_ids": sum(np.array_equal(a["input_ids"], b["input_ids"]) for a, b in pairs),
        "same_labels": sum(np.array_equal(a["labels"], b["labels"]) for a, b in pairs),
        "with_images": len(grids),
        "same_grid": sum(np.array_equal(g, h) for g, h in grids),
        "max_abs_diff": max(diffs) if diffs else None,
        "mean_max_abs_diff": statistics.mean(diffs) if diffs else None,
    }


def build_chains(tmp: Path) -> tuple[dict[str, Any], str]:
    """The three chains (built-in, HF processor, HF with the generation template), set up, and the
    name of the HF image processor's class."""
    from batchd.service.preprocess import (
        HFProcessor,
        Preprocessor,
        Qwen2VLImageConfig,
        TokenizerRef,
        default_stages,
        demo_tokenizer,
    )

    tok_json = demo_tokenizer(tmp / "tokenizer.json")
    plain = save_qwen2vl_processor(tmp / "qwen2vl", tok_json, QWEN2VL_TEMPLATE)
    gen = save_qwen2vl_processor(tmp / "qwen2vl-generation", tok_json, GENERATION_TEMPLATE)
    chains = {
        "built-in": Preprocessor(
            default_stages(
                TokenizerRef(plain), vision=Qwen2VLImageConfig(MIN_PIXELS, MAX_PIXELS), cutoff=4096
            )
        ),
        "HF processor": Preprocessor(default_stages(processor=plain, cutoff=4096)),
        "HF, generation template": Preprocessor(default_stages(processor=gen, cutoff=4096)),
    }
    for pre in chains.values():
        pre.setup()
    hf = next(s for s in chains["HF processor"].stages if isinstance(s, HFProcessor))
    return chains, type(hf.processor.image_processor).__name__


def measure(name: str, chains: dict[str, Any], samples: int, rounds: int) -> dict[str, Any]:
    """One workload: each chain's samples/s (median of the rounds), the ratio HF / built-in (median
    of the rounds' interleaved ratios: robust to the machine's drift) and the chains' agreement."""
    records = records_of(name, max(int(samples * WORKLOADS[name][2]), 20))
    for pre in chains.values():  # warm-up (first-call imports, caches)
        for i, rec in enumerate(records[:5]):
            pre(rec, i, 0)
    times: dict[str, list[float]] = {c: [] for c in chains}
    outs: dict[str, list[Any]] = {}
    for _ in range(rounds):
        for c, pre in chains.items():
            cpu, outs[c] = run_chain(pre, records)
            times[c].append(cpu)
    metas = [m for m, _ in outs["built-in"]]
    result = {
        "records": len(records),
        "mean_length": statistics.mean(m.length for m in metas),
        "mean_vision_tokens": statistics.mean(m.vision_tokens for m in metas),
        "rates": {c: len(records) / statistics.median(t) for c, t in times.items()},
        "ratios": {
            c: statistics.median(b / h for b, h in zip(times["built-in"], times[c], strict=True))
            for c in chains
        },
        "seconds": times,
        "agreement": {c: agreement(outs["built-in"], outs[c]) for c in chains if c != "built-in"},
    }
    print(name, json.dumps({k: result[k] for k in ("rates", "ratios")}), flush=True)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=400, help="records of the text workload (images: fewer)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per chain (median reported)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    add_common_args(ap)
    args = ap.parse_args(argv)

    import torch
    import transformers

    torch.set_num_threads(1)
    t_all = time.perf_counter()
    load_start = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        chains, backend = build_chains(Path(tmp))
        workloads = {n: measure(n, chains, args.samples, args.rounds) for n in args.workloads.split(",")}
    agree = all(
        a["same_ids"] == a["records"]
        and a["same_labels"] == a["records"]
        and a["same_grid"] == a["with_images"]
        and (a["max_abs_diff"] or 0.0) < 1e-5
        for w in workloads.values()
        for a in w["agreement"].values()
    )
    data = {
        "workloads": workloads,
        "order": list(workloads),  # the run's order (the JSON's keys are sorted)
        "all_agree": agree,
        "image_processor": backend,
        "transformers": transformers.__version__,
        "load_start": load_start,
        "load_end": load_average(),
        "wall_s": time.perf_counter() - t_all,
        "machine": machine(),
    }
    config = {
        "command": command("hf_processor_throughput.py", list(argv if argv is not None else sys.argv[1:])),
        "samples": args.samples,
        "rounds": args.rounds,
        "workloads": args.workloads,
    }
    finish(args, SECTION, data, measures=MEASURES, config=config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
