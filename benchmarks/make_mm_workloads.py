"""Writes the six synthetic multimodal workloads of `benchmarks/workloads/` (docs/workloads.md).

Each file is a CSV with the header `text_tokens,image_patches,image_tokens` (image lists space-separated,
empty for a text-only sample), and `,audio_frames,audio_tokens` for the one with audio. Every draw comes
from a numpy generator with a fixed seed per workload, so rerunning the script rewrites byte-identical
files:

- `llava-like` (4,096 samples): LLaVA-1.5 geometry, one 336 px image per sample = 24 x 24 = 576 patches
  and 576 tokens (no merge); short instructions (text lognormal, mean 140, CV 0.6, clipped to 50..300);
  10% text-only samples with longer text (mean 600, CV 0.8, clipped to 20..3,000).
- `sharegpt4o-like` (4,096 samples): Qwen2-VL geometry, images of varied resolution rounded to
  multiples of 28 px (patch 14, 2 x 2 merge) and scaled into 56^2..1024 x 28^2 pixels, so
  patches = (h / 14)(w / 14) <= 4,096 and tokens = patches / 4; 0..4 images per sample (probabilities
  0.20, 0.45, 0.18, 0.10, 0.07); long-tailed text (lognormal, mean 900, CV 1.0, clipped to 16..12,000),
  the shape of `batchd/workloads/sharegpt4o-like.txt`.
- `bimodal` (4,096 samples): 88% small one-image samples (Qwen2-VL geometry, 224..448 px sides, text
  30..200) and 12% long documents with 4..16 pages at 448..896 px sides (capped at 1,024 tokens per
  page) and 500..3,000 text tokens.
- `document-like` (4,096 samples): scanned multi-page documents (DocVQA / slide decks): 1..8 pages
  (geometric, mean ~2.5) at 900..2,400 px sides (over 90% at 900..1,024 tokens, the cap), and 60..1,500
  text tokens.
- `mixed` (4,096 samples): one mixture of everything: 25% text-only (lognormal mean 900, CV 1.0), 30%
  one image and 15% 2..6 images (Qwen2-VL geometry, 200..2,000 px), 15% video-like clips of 8..32 frames
  at 224..448 px, 15% documents of 2..8 pages at 900..1,800 px; text as in `sharegpt4o-like` for the
  image samples, 50..400 for the video and 200..2,000 for the documents.
- `audio-visual` (4,096 samples): speech and sound beside images, Qwen2-Audio geometry (log-mel frames at
  100 per second, tokens by Qwen2-Audio's rule, about one per 4 frames, clips of at most 30 s = 3,000
  frames, not padded): 35% one
  spoken instruction (lognormal mean 8 s, CV 0.8, 1..30 s; text mean 120, CV 0.6, 10..1,000), 20%
  multi-turn audio with 2..5 clips of 2..20 s (text mean 300, CV 0.8, 20..3,000), 20% one image
  (Qwen2-VL geometry, 224..1,024 px) and one clip of 2..15 s (text 20..400), 15% one or two images
  only (200..2,000 px, text as in `sharegpt4o-like`), 10% text only (mean 900, CV 1.0).

Usage: python benchmarks/make_mm_workloads.py [--out DIR]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from batchd.core import Sample, format_workload
from batchd.service.preprocess import qwen2_audio_tokens

OUT = Path(__file__).resolve().parent / "workloads"
N = 4096
MIN_PIXELS, MAX_PIXELS = 56 * 56, 1024 * 28 * 28  # Qwen2-VL's resize bounds (max lowered to 1,024 tokens)

Row = tuple[int, list[int], list[int]] | tuple[int, list[int], list[int], list[int], list[int]]
FRAMES_PER_S = 100


def lognormal(rng: np.random.Generator, mean: float, cv: float, lo: int, hi: int) -> int:
    sigma2 = np.log(1 + cv * cv)
    return int(np.clip(rng.lognormal(np.log(mean) - sigma2 / 2, np.sqrt(sigma2)), lo, hi))


def qwen2_vl(h: float, w: float) -> tuple[int, int]:
    """(patches, tokens) of an h x w image under Qwen2-VL's smart resize (sides multiples of 28)."""
    hr, wr = max(28, round(h / 28) * 28), max(28, round(w / 28) * 28)
    if hr * wr > MAX_PIXELS:
        beta = (h * w / MAX_PIXELS) ** 0.5
        hr, wr = max(28, int(h / beta / 28) * 28), max(28, int(w / beta / 28) * 28)
    elif hr * wr < MIN_PIXELS:
        beta = (MIN_PIXELS / (h * w)) ** 0.5
        hr, wr = -(-int(h * beta) // 28) * 28, -(-int(w * beta) // 28) * 28
    patches = (hr // 14) * (wr // 14)
    return patches, patches // 4


def image(rng: np.random.Generator, lo: int, hi: int) -> tuple[int, int]:
    """An image whose longer side is uniform in [lo, hi] px, aspect ratio lognormal around 4:3."""
    side = rng.uniform(lo, hi)
    aspect = float(np.clip(rng.lognormal(np.log(4 / 3), 0.3), 0.4, 2.5))
    h, w = (side, side / aspect) if rng.random() < 0.3 else (side / aspect, side)
    return qwen2_vl(h, w)


def llava_like(seed: int = 11) -> list[Row]:
    rng = np.random.default_rng(seed)
    rows: list[Row] = []
    for _ in range(N):
        if rng.random() < 0.10:
            rows.append((lognormal(rng, 600, 0.8, 20, 3000), [], []))
        else:
            rows.append((lognormal(rng, 140, 0.6, 50, 300), [576], [576]))
    return rows


def sharegpt4o_like(seed: int = 12) -> list[Row]:
    rng = np.random.default_rng(seed)
    rows: list[Row] = []
    for _ in range(N):
        k = int(rng.choice(5, p=[0.20, 0.45, 0.18, 0.10, 0.07]))
        ims = [image(rng, 200, 2000) for _ in range(k)]
        rows.append((lognormal(rng, 900, 1.0, 16, 12000), [p for p, _ in ims], [t for _, t in ims]))
    return rows


def bimodal(seed: int = 13) -> list[Row]:
    rng = np.random.default_rng(seed)
    rows: list[Row] = []
    for _ in range(N):
        if rng.random() < 0.88:
            p, t = image(rng, 224, 448)
            rows.append((int(rng.integers(30, 201)), [p], [t]))
        else:
            ims = [image(rng, 448, 896) for _ in range(int(rng.integers(4, 17)))]
            rows.append((int(rng.integers(500, 3001)), [p for p, _ in ims], [t for _, t in ims]))
    return rows


def document_like(seed: int = 14) -> list[Row]:
    rng = np.random.default_rng(seed)
    rows: list[Row] = []
    for _ in range(N):
        ims = [image(rng, 900, 2400) for _ in range(min(8, int(rng.geometric(0.38))))]
        rows.append((lognormal(rng, 400, 0.8, 60, 1500), [p for p, _ in ims], [t for _, t in ims]))
    return rows


def mixed(seed: int = 15) -> list[Row]:
    rng = np.random.default_rng(seed)
    rows: list[Row] = []
    for _ in range(N):
        kind = int(rng.choice(5, p=[0.25, 0.30, 0.15, 0.15, 0.15]))
        if kind == 0:
            rows.append((lognormal(rng, 900, 1.0, 16, 12000), [], []))
            continue
        if kind in (1, 2):
            ims = [image(rng, 200, 2000) for _ in range(1 if kind == 1 else int(rng.integers(2, 7)))]
            text = lognormal(rng, 900, 1.0, 16, 12000)
        elif kind == 3:
            frame = image(rng, 224, 448)  # a clip's frames share one geometry
            ims = [frame] * int(rng.integers(8, 33))
            text = int(rng.integers(50, 401))
        else:
            ims = [image(rng, 900, 1800) for _ in range(int(rng.integers(2, 9)))]
            text = int(rng.integers(200, 2001))
        rows.append((text, [p for p, _ in ims], [t for _, t in ims]))
    return rows


def clip(rng: np.random.Generator, lo_s: float, hi_s: float, mean_s: float | None = None) -> tuple[int, int]:
    """(frames, tokens) of an audio clip: lognormal around `mean_s` (CV 0.8) or uniform, within [lo, hi] s."""
    if mean_s is None:
        secs = rng.uniform(lo_s, hi_s)
    else:
        sigma2 = np.log(1 + 0.8 * 0.8)
        secs = float(np.clip(rng.lognormal(np.log(mean_s) - sigma2 / 2, np.sqrt(sigma2)), lo_s, hi_s))
    frames = max(4, int(secs * FRAMES_PER_S))
    return frames, qwen2_audio_tokens(frames)


def audio_visual(seed: int = 16) -> list[Row]:
    rng = np.random.default_rng(seed)
    rows: list[Row] = []
    for _ in range(N):
        kind = int(rng.choice(5, p=[0.35, 0.20, 0.20, 0.15, 0.10]))
        ims: list[tuple[int, int]] = []
        clips: list[tuple[int, int]] = []
        if kind == 0:
            clips, text = [clip(rng, 1, 30, 8)], lognormal(rng, 120, 0.6, 10, 1000)
        elif kind == 1:
            clips = [clip(rng, 2, 20) for _ in range(int(rng.integers(2, 6)))]
            text = lognormal(rng, 300, 0.8, 20, 3000)
        elif kind == 2:
            ims, clips, text = [image(rng, 224, 1024)], [clip(rng, 2, 15)], int(rng.integers(20, 401))
        elif kind == 3:
            ims = [image(rng, 200, 2000) for _ in range(int(rng.integers(1, 3)))]
            text = lognormal(rng, 900, 1.0, 16, 12000)
        else:
            text = lognormal(rng, 900, 1.0, 16, 12000)
        rows.append(
            (text, [p for p, _ in ims], [t for _, t in ims], [f for f, _ in clips], [t for _, t in clips])
        )
    return rows


WORKLOADS = {
    "llava-like": llava_like,
    "sharegpt4o-like": sharegpt4o_like,
    "bimodal": bimodal,
    "document-like": document_like,
    "mixed": mixed,
    "audio-visual": audio_visual,
}


def render(rows: Sequence[Row]) -> str:
    samples = []
    for i, (t, p, k, *audio) in enumerate(rows):
        frames, tokens = audio if audio else ([], [])
        clips = tuple(zip(frames, tokens, strict=True))
        samples.append(Sample(i, t + sum(k) + sum(tokens), images=tuple(zip(p, k, strict=True)), audio=clips))
    return format_workload(samples)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT, help=f"output folder (default {OUT})")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, make in WORKLOADS.items():
        path = args.out / f"{name}.csv"
        path.write_text(render(make()), encoding="utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
