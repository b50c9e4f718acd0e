"""The demo dataset: deterministic generated conversations and images, shipped as code (no downloads).

`demo_records(n, seed)` generates n conversation records: 1-3 user/assistant rounds whose lengths follow
a long-tailed (log-normal) word count, an optional system prompt, and for a fraction of the records 1-2
small generated PNG images (gradients and boxes, 32-224 px a side) with `<image>` markers; with
`audio_fraction` > 0, for that share of the records also 1-2 generated WAV clips (tones, noise) with
`<audio>` markers (`DemoDataset.clips` counts them). The assistant
answers are a learnable function of the question (its words in reverse order after a fixed preamble),
so a tiny model's loss falls during the demo. A few records are deliberately bad (empty conversation,
missing content, undecodable image, no assistant turn, more `<image>` markers than images, and in JSONL
an invalid JSON line); `DemoDataset.bad` lists them with the quarantine code each must produce.

`make_demo_dataset(out_dir, ...)` writes the records to Parquet, JSONL (images as files beside it,
referenced by relative path) or Arrow IPC, and returns the path with the expectations. Everything is a
pure function of (num_samples, seed, ...): the same call writes the same bytes.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

_WORDS = """
time person year way day thing man world life hand part child eye woman place work week case point
government company number group problem fact water river mountain cloud garden window table paper
music color light sound answer question market city road train station engine signal model vector
token batch rank length budget image pixel patch window layer weight loss gradient step epoch sample
red green blue yellow orange purple black white small large quick slow bright dark warm cold early
late simple complex happy quiet loud soft hard round square north south east west river forest
stone glass metal wood fire wind rain snow summer winter spring autumn morning evening night noon
apple bread cheese coffee tea sugar salt honey lemon pepper rice fish bird horse dog cat mouse
read write think know see look find give tell ask work seem feel try leave call move play run
build carry count draw drive eat fall grow hold keep learn meet pay send sing sit speak stand
teach turn walk watch win open close begin end show help start stop change follow create
""".split()
DEMO_WORDS: tuple[str, ...] = tuple(_WORDS)  # the demo text's vocabulary (the demo tokenizer's corpus)
_SYSTEMS = [
    "You are a helpful assistant.",
    "You answer briefly and precisely.",
    "You are a careful assistant that repeats the key words of every question.",
]
_PREAMBLE = "Here are your words in reverse order:"
BAD_KINDS_COLUMNAR = ("empty_conversation", "missing_field", "bad_image", "no_assistant", "image_mismatch")
BAD_KINDS_JSONL = BAD_KINDS_COLUMNAR + ("invalid_json",)


def _words(rng: np.random.Generator, median: float, sigma: float, cap: int) -> list[str]:
    n = int(min(max(round(rng.lognormal(np.log(median), sigma)), 1), cap))
    ranks = np.minimum(rng.zipf(1.3, n) - 1, len(_WORDS) - 1)  # Zipf-like word frequencies
    return [_WORDS[int(r)] for r in ranks]


def _png(rng: np.random.Generator, max_side: int) -> bytes:
    from PIL import Image

    h, w = (int(v) for v in rng.integers(32, max_side + 1, size=2))
    y = np.linspace(0, 1, h, dtype=np.float32)[:, None, None]
    x = np.linspace(0, 1, w, dtype=np.float32)[None, :, None]
    c0, c1 = rng.random(3, dtype=np.float32), rng.random(3, dtype=np.float32)
    img = c0 * (1 - x) * (1 - y) + c1 * x * y + 0.5 * (c0 + c1) * (x * (1 - y))
    y0, x0 = int(rng.integers(0, h // 2)), int(rng.integers(0, w // 2))
    img[y0 : y0 + h // 3, x0 : x0 + w // 3] = rng.random(3, dtype=np.float32)
    buf = io.BytesIO()
    Image.fromarray((img * 255).astype(np.uint8), "RGB").save(buf, format="PNG")
    return buf.getvalue()


def _conversation(rng: np.random.Generator) -> list[dict[str, str]]:
    messages = []
    for _ in range(int(rng.integers(1, 4))):
        words = _words(rng, 14, 1.0, 220)
        messages.append({"role": "user", "content": "Please reverse: " + " ".join(words) + "."})
        messages.append({"role": "assistant", "content": f"{_PREAMBLE} {' '.join(reversed(words))}."})
    return messages


def _clip(rng: np.random.Generator) -> bytes:
    """A short generated audio clip as 16-bit WAV bytes: a gliding tone or a burst of noise, 0.3-2 s, at
    16 kHz (or 22.05 kHz, which the chain resamples)."""
    import wave

    rate = 16000 if rng.random() < 0.8 else 22050
    t = np.arange(int(rng.uniform(0.3, 2.0) * rate)) / rate
    if rng.random() < 0.6:
        f0, f1 = rng.uniform(200.0, 2000.0, size=2)
        x = 0.4 * np.sin(2 * np.pi * (f0 + (f1 - f0) * t / (2 * t[-1])) * t)
    else:
        x = 0.2 * rng.standard_normal(len(t)) * np.hanning(len(t))
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def demo_record(
    i: int, seed: int = 0, image_fraction: float = 0.3, max_image_side: int = 224, audio_fraction: float = 0.0
) -> dict[str, Any]:
    """Record `i` of the demo dataset (a good one): messages, images (PNG bytes), audios (WAV bytes; drawn
    from their own generator, so a record's other fields do not depend on `audio_fraction`), system."""
    rng = np.random.default_rng([seed, i, 17])
    messages = _conversation(rng)
    system = _SYSTEMS[int(rng.integers(len(_SYSTEMS)))] if rng.random() < 0.3 else None
    images: list[bytes] = []
    if rng.random() < image_fraction:
        images = [_png(rng, max_image_side) for _ in range(1 if rng.random() < 0.8 else 2)]
        if rng.random() < 0.5:  # explicit markers; otherwise the reader puts them in front of the first turn
            messages[0]["content"] = "<image>" * len(images) + "Look at this. " + messages[0]["content"]
    heard = np.random.default_rng([seed, i, 23])
    audios = []
    if heard.random() < audio_fraction:
        audios = [_clip(heard) for _ in range(1 if heard.random() < 0.8 else 2)]
        messages[0]["content"] = "<audio>" * len(audios) + "Listen. " + messages[0]["content"]
    return {"messages": messages, "images": images, "audios": audios, "system": system}


def _bad_record(kind: str, i: int, seed: int) -> dict[str, Any]:
    rec = demo_record(i, seed, image_fraction=0.0)
    if kind == "empty_conversation":
        rec["messages"] = []
    elif kind == "missing_field":
        rec["messages"][-1]["content"] = None
    elif kind == "bad_image":
        rec["images"] = [b"\x89PNG this is not an image " + str(i).encode()]
    elif kind == "no_assistant":
        rec["messages"] = [m for m in rec["messages"] if m["role"] == "user"]
    elif kind == "image_mismatch":
        rec["messages"][0]["content"] = "<image><image>" + rec["messages"][0]["content"]
        rec["images"] = [_png(np.random.default_rng([seed, i, 99]), 64)]
    return rec


def demo_bad_ids(
    num_samples: int, seed: int = 0, bad_fraction: float = 0.02, kinds: tuple[str, ...] = BAD_KINDS_COLUMNAR
) -> dict[int, str]:
    """{id: quarantine code} of the deliberately bad records."""
    if bad_fraction <= 0 or num_samples == 0:
        return {}
    n = min(max(int(round(num_samples * bad_fraction)), len(kinds)), num_samples)
    ids = sorted(np.random.default_rng([seed, 4242]).choice(num_samples, size=n, replace=False).tolist())
    return {int(i): kinds[j % len(kinds)] for j, i in enumerate(ids)}


def demo_records(
    num_samples: int,
    seed: int = 0,
    image_fraction: float = 0.3,
    bad_fraction: float = 0.02,
    max_image_side: int = 224,
    kinds: tuple[str, ...] = BAD_KINDS_COLUMNAR,
    audio_fraction: float = 0.0,
) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """(records, {bad id: code}): the demo dataset in memory ('invalid_json' records are None here)."""
    bad = demo_bad_ids(num_samples, seed, bad_fraction, kinds)
    records: list[Any] = []
    for i in range(num_samples):
        if i in bad:
            records.append(None if bad[i] == "invalid_json" else _bad_record(bad[i], i, seed))
        else:
            records.append(demo_record(i, seed, image_fraction, max_image_side, audio_fraction))
    return records, bad


def demo_corpus(num_records: int = 1500, seed: int = 12345) -> Iterator[str]:
    """Text to train the demo tokenizer on: generated conversations plus the chat templates' words."""
    yield "system user assistant\n\n Look at this. Please reverse: " + _PREAMBLE + " ".join(_SYSTEMS)
    for i in range(num_records):
        rng = np.random.default_rng([seed, i])
        yield "\n".join(m["content"] for m in _conversation(rng))


@dataclasses.dataclass(frozen=True)
class DemoDataset:
    """A written demo dataset: its file, how many records, the bad ones with their quarantine codes, and how
    many audio clips its records hold (`clips`, all in good records)."""

    path: Path
    num_records: int
    bad: dict[int, str]
    format: str
    clips: int = 0

    @property
    def num_good(self) -> int:
        return self.num_records - len(self.bad)


def _write_jsonl(out: Path, stem: str, records: list[Any]) -> Path:
    """The records as JSONL, their images and clips as files in `<stem>-images/` beside it."""
    path = out / f"{stem}.jsonl"
    img_dir = out / f"{stem}-images"
    img_dir.mkdir(exist_ok=True)
    lines = []
    for i, rec in enumerate(records):
        if rec is None:
            lines.append('{"messages": [{"role": "user", "content": "truncated')
            continue
        paths = []
        for k, data in enumerate(rec["images"]):
            name = f"{img_dir.name}/{i:06d}-{k}.png"
            (out / name).write_bytes(data)
            paths.append(name)
        clips = []
        for k, data in enumerate(rec.get("audios", ())):
            name = f"{img_dir.name}/{i:06d}-{k}.wav"
            (out / name).write_bytes(data)
            clips.append(name)
        obj: dict[str, Any] = {"messages": rec["messages"]}
        if paths:
            obj["images"] = paths
        if clips:
            obj["audios"] = clips
        if rec["system"] is not None:
            obj["system"] = rec["system"]
        lines.append(json.dumps(obj))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def make_demo_dataset(
    out_dir: str | os.PathLike[str],
    num_samples: int = 512,
    seed: int = 0,
    image_fraction: float = 0.3,
    bad_fraction: float = 0.02,
    format: str = "parquet",
    max_image_side: int = 224,
    audio_fraction: float = 0.0,
) -> DemoDataset:
    """Writes the demo dataset to `out_dir` as `demo-<n>-<seed>.<ext>` and returns where and what.

    Args:
        out_dir: Directory (created). JSONL also writes `<stem>-images/` with the PNG files it references.
        num_samples: Records to write (bad ones included).
        seed: Selects the conversations, images and which records are bad.
        image_fraction: Share of good records with 1-2 images.
        bad_fraction: Share of deliberately bad records (at least one of each kind when > 0).
        format: "parquet", "jsonl" or "arrow" (Arrow IPC file).
        max_image_side: Largest generated image side in pixels.
        audio_fraction: Share of good records with 1-2 generated audio clips (tones, noise; `<audio>`
            markers in front of the first turn). JSONL writes them as WAV files beside the images.
    """
    import pyarrow as pa

    if format not in ("parquet", "jsonl", "arrow"):
        raise ValueError(f"format must be parquet, jsonl or arrow, got {format=}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kinds = BAD_KINDS_JSONL if format == "jsonl" else BAD_KINDS_COLUMNAR
    records, bad = demo_records(
        num_samples, seed, image_fraction, bad_fraction, max_image_side, kinds, audio_fraction
    )
    stem = f"demo-{num_samples}-{seed}"
    clips = sum(len(r.get("audios", ())) for r in records if r is not None)
    if format == "jsonl":
        path = _write_jsonl(out, stem, records)
        return DemoDataset(path, num_samples, bad, format, clips)
    msg_type = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    table = pa.table(
        {
            "messages": pa.array([r["messages"] for r in records], msg_type),
            "images": pa.array([r["images"] for r in records], pa.list_(pa.binary())),
            **(
                {"audios": pa.array([r.get("audios", []) for r in records], pa.list_(pa.binary()))}
                if audio_fraction > 0
                else {}
            ),
            "system": pa.array([r["system"] for r in records], pa.string()),
        }
    )
    if format == "parquet":
        import pyarrow.parquet as pq

        path = out / f"{stem}.parquet"
        pq.write_table(table, path, row_group_size=256)
    else:
        import pyarrow.ipc as paipc

        path = out / f"{stem}.arrow"
        with paipc.new_file(path, table.schema) as writer:
            writer.write_table(table, max_chunksize=256)
    return DemoDataset(path, num_samples, bad, format, clips)
