"""Sample sources a rank service pulls from: (metadata, payload) pairs for its view of the epoch.

- `SyntheticSource`: deterministic tokenized samples with realized lengths from a list (e.g. one of
  batchd/workloads): token ids and the prompt mask come from a generator seeded by (seed, id), so
  any payload can be re-materialized from its id alone. That is what makes a rank service restartable
  from a metadata-only journal, and what lets a balanced plan move a reference instead of a payload.
- `IngestSource`: samples pushed by external producers through `RankService.Ingest`, validated on the
  way in (`ingest`: malformed ones quarantined, duplicates refused); a bounded queue,
  so a full window blocks the producer's stream (gRPC flow control). Not replayable: a rank service fed
  this way cannot be restarted mid-epoch without the producer resending (documented limitation).

Every source implements `Source` (a `typing.Protocol`, checked at run time by `isinstance`): the rank
service depends on that interface only. `RaySource` (`_ray_source`) is the third implementation.
Every sample a source yields carries `nbytes`, its payload's bytes (`payload_nbytes`), so a node-aware
plan can prefer moving the groups that carry the fewest bytes.
"""

from __future__ import annotations

import dataclasses
import enum
import queue
import threading
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from batchd.core import Remainder, Sample, ViewSource

from ._audio import qwen2_audio_tokens


class _End(enum.Enum):
    EXHAUSTED = "exhausted"

    def __repr__(self) -> str:
        return "EXHAUSTED"


EXHAUSTED = _End.EXHAUSTED  # `Source.poll`: the epoch's view is done
Payload = dict[str, np.ndarray]
# What `Source.poll` returns: a sample and its payload, None (nothing ready yet) or EXHAUSTED.
Poll = tuple[Sample, Payload] | Literal[_End.EXHAUSTED] | None
NO_REASONS: Mapping[str, int] = types.MappingProxyType(
    {}
)  # `Source.reasons` of a source that quarantines nothing


@runtime_checkable
class Source(Protocol):
    """What a rank service pulls samples from: one rank's view of one epoch, resumable.

    Contract:
        poll(timeout): the next `(Sample, payload)`, `None` when nothing is ready within `timeout`
            seconds, or `EXHAUSTED` once the epoch's view is done (and forever after).
        peek_id(): the id `poll` will yield next if the source knows it (None otherwise); the rank
            service uses it to skip ids a restored journal already holds.
        materialize(id) / materialize_many(ids): the payloads of ids of this epoch (for a peer's
            `Fetch` of a moved sample and for a restored journal); KeyError names an id it cannot give.
        start_epoch(e): epoch e's view, from its start (called between epochs).
        state_dict() / load_state_dict(state): a JSON-safe resume point taken between polls; loading a
            state of another rank, world size, seed, epoch or dataset raises ValueError naming it.
        stats(): counters for logs and metrics (JSON-safe); close(): frees workers (idempotent).
        unread() (optional): samples of this epoch's view not yet returned by `poll` (None: unknown,
            e.g. an endless non-join view); reported each round, node-local rounds share out the nodes'
            remaining work by it. A source without it reports unknown.
        longest (optional): the most tokens one of its samples has (after its own cutoff), or None when
            unknown; told to trainers (`RankStatus.max_tokens`) so they size their models' positions.
        reasons: the records this source quarantined (all epochs so far), counted by reason code
            (`Quarantine.code_of`); read from the thread that polls; empty for a source that cannot
            quarantine (`NO_REASONS`).
    """

    reasons: Mapping[str, int]

    def poll(self, timeout: float = 0.0) -> Poll: ...

    def peek_id(self) -> int | None: ...

    def materialize(self, sample_id: int) -> Payload: ...

    def materialize_many(self, sample_ids: Sequence[int]) -> list[Payload]: ...

    def start_epoch(self, epoch: int, remainder: Remainder | None = None) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


SOURCE_MEMBERS = tuple(sorted({*Source.__annotations__, *(n for n in vars(Source) if not n.startswith("_"))}))


def missing_source_members(obj: object) -> list[str]:
    """The `Source` members `obj` lacks (what `isinstance(obj, Source)` checks); empty for a source."""
    return [name for name in SOURCE_MEMBERS if not hasattr(obj, name)]


def synthetic_payload(sample_id: int, length: int, seed: int, vocab_size: int) -> Payload:
    """A learnable token sequence and labels with a masked prompt (-100) of 1..length/2 tokens.

    Each sample walks the vocabulary [1, vocab) from a random start with a per-sample stride in 1..4,
    with 10% of the tokens replaced by noise: a model can learn to continue the walk, so the demo's
    loss falls well below ln(vocab) (uniform random tokens would keep it there).
    """
    rng = np.random.default_rng([seed, sample_id])
    span = vocab_size - 1
    start, stride = int(rng.integers(0, span)), int(rng.integers(1, 5))
    ids = (1 + (start + stride * np.arange(length, dtype=np.int64)) % span).astype(np.int32)
    noise = rng.random(length) < 0.1
    ids[noise] = rng.integers(1, vocab_size, size=int(noise.sum()), dtype=np.int64)
    prompt = int(rng.integers(1, max(length // 2, 1) + 1))
    labels = ids.copy()
    labels[:prompt] = -100
    return {"input_ids": ids, "labels": labels}


SYNTHETIC_PATCH_DIM = 48  # floats per synthetic patch (a 4 x 4 RGB patch; Qwen2-VL's real ones hold 1,176)


def synthetic_image_payload(
    sample_id: int,
    length: int,
    images: Sequence[tuple[int, int]],
    seed: int,
    vocab_size: int,
    patch_dim: int = SYNTHETIC_PATCH_DIM,
) -> Payload:
    """`synthetic_payload` with images: image k's `tokens` placeholder tokens (id vocab_size - 1, which the
    text never uses; labels -100) follow the first token, one text token between consecutive images (while
    the text lasts; where a real sample has its vision end / start markers), and its pixels are `patches`
    random float32 rows of `patch_dim` (Qwen2-VL's layout: grid (1, 2, patches / 2), 4 patches per token).
    The default patch is small (`SYNTHETIC_PATCH_DIM`): with a tiny encoder, real-size pixels would make
    the bench measure payload bytes instead of the encoder's share of compute that a real ViT has.

    Raises:
        ValueError: an image whose patches are not 4 x tokens, or images with more tokens than `length` - 1.
    """
    vision = sum(t for _, t in images)
    if vision > length - 1:
        raise ValueError(
            f"sample {sample_id}: {vision} image tokens do not fit {length=} (one text token at least)"
        )
    payload = (
        synthetic_payload(sample_id, length - vision, seed, vocab_size - 1)
        if vision
        else synthetic_payload(sample_id, length, seed, vocab_size - 1)
    )
    if not images:
        return payload
    rng = np.random.default_rng([seed, sample_id, 1])
    text_ids, text_labels = payload["input_ids"], payload["labels"]
    ids, labels = [text_ids[:1]], [text_labels[:1]]
    pixels, grids = [], []
    pos = 1
    for k, (patches, tokens) in enumerate(images):
        if patches != 4 * tokens:
            raise ValueError(
                f"sample {sample_id}: image {k} has {patches=} {tokens=}; synthetic images need "
                f"patches = 4 x tokens (a 2x2 merge)"
            )
        ids.append(np.full(tokens, vocab_size - 1, dtype=np.int32))
        labels.append(np.full(tokens, -100, dtype=np.int32))
        pixels.append(rng.standard_normal((patches, patch_dim), dtype=np.float32))
        grids.append((1, 2, patches // 2))
        if k + 1 < len(images) and pos < len(text_ids):  # one text token between images (a vision marker's
            ids.append(text_ids[pos : pos + 1])  # place): Qwen2-VL's M-RoPE tells images apart
            labels.append(text_labels[pos : pos + 1])  # by the text between them
            pos += 1
    ids.append(text_ids[pos:])
    labels.append(text_labels[pos:])
    return {
        "input_ids": np.concatenate(ids),
        "labels": np.concatenate(labels),
        "pixel_values": np.concatenate(pixels),
        "image_grid_thw": np.asarray(grids, dtype=np.int64),
    }


SYNTHETIC_MELS = 8  # synthetic clips' mel bins: the data path, not the features, is under test


def synthetic_audio_payload(
    payload: Payload,
    sample_id: int,
    audio: Sequence[tuple[int, int]],
    seed: int,
    vocab_size: int,
    n_mels: int = SYNTHETIC_MELS,
) -> Payload:
    """`payload` (a synthetic sample of length - audio tokens) with audio clips: clip k's `tokens`
    placeholder tokens (id vocab_size - 2; a text token of that id becomes vocab_size - 3, in every sample of
    a dataset with audio, clips or not: only clips hold the id; labels -100)
    after the first token, and `frames` random float32 feature rows of `n_mels` (tokens =
    `qwen2_audio_tokens(frames)`: Qwen2-Audio's stride-2 convolution and stride-2 pool, about frames / 4).

    Raises:
        ValueError: a clip whose tokens are not its frames' by that rule.
    """
    ids, labels = np.array(payload["input_ids"]), np.array(payload["labels"])
    ids[ids == vocab_size - 2] = vocab_size - 3
    labels[labels == vocab_size - 2] = vocab_size - 3
    if not audio:
        return {**payload, "input_ids": ids, "labels": labels}
    rng = np.random.default_rng([seed, sample_id, 2])
    feats = []
    for k, (frames, tokens) in enumerate(audio):
        if tokens != qwen2_audio_tokens(frames):
            raise ValueError(
                f"sample {sample_id}: clip {k} has {frames=} {tokens=}; synthetic clips need tokens = "
                f"qwen2_audio_tokens(frames) = {qwen2_audio_tokens(frames)}"
            )
        feats.append(rng.standard_normal((frames, n_mels), dtype=np.float32))
    heard = sum(t for _, t in audio)
    return {
        **payload,
        "input_ids": np.concatenate([ids[:1], np.full(heard, vocab_size - 2, dtype=ids.dtype), ids[1:]]),
        "labels": np.concatenate([labels[:1], np.full(heard, -100, dtype=labels.dtype), labels[1:]]),
        "audio_features": np.concatenate(feats),
        "audio_frames": np.asarray([f for f, _ in audio], dtype=np.int64),
    }


def synthetic_sample(
    sample_id: int,
    length: int,
    seed: int,
    vocab_size: int,
    images: Sequence[tuple[int, int]] | None = None,
    audio: Sequence[tuple[int, int]] | None = None,
    patch_dim: int = SYNTHETIC_PATCH_DIM,
) -> Payload:
    """The synthetic sample `SyntheticSource` serves: `length` tokens in all, with `images` (None: a text
    dataset, `synthetic_payload`) and `audio` clips (None: a dataset without audio; their tokens count in
    `length`, `synthetic_audio_payload`)."""
    base_length = length - sum(t for _, t in audio or ())
    if images is not None:
        base = synthetic_image_payload(sample_id, base_length, images, seed, vocab_size, patch_dim)
    else:
        base = synthetic_payload(sample_id, base_length, seed, vocab_size)
    return base if audio is None else synthetic_audio_payload(base, sample_id, audio, seed, vocab_size)


def payload_nbytes(payload: Mapping[str, Any]) -> int:
    """Bytes of a payload's arrays as they cross the network (`Sample.nbytes`): the sum of their `nbytes`.

    Plain ints and floats are skipped (the wire format does not send them as tensors); any other value
    counts as the array numpy makes of it.
    """
    total = 0
    for value in payload.values():
        if isinstance(value, (bool, int, float)):
            continue
        n = getattr(value, "nbytes", None)
        total += int(n) if isinstance(n, (int, np.integer)) else int(np.asarray(value).nbytes)
    return total


def loss_tokens_of(labels: np.ndarray) -> int:
    """Tokens that carry the shifted causal-LM loss: count(labels[1:] != -100)."""
    return int(np.count_nonzero(labels[1:] != -100))


@dataclasses.dataclass(frozen=True)
class SyntheticData:
    """A synthetic tokenized dataset: sample i has `lengths[i]` tokens drawn from `vocab_size` ids;
    `images[i]`: its images as (patches, tokens) (`synthetic_image_payload`, `patch_dim` floats a patch),
    None: text only; `audio[i]`: its audio clips as (frames, tokens) (`synthetic_audio_payload`; their
    tokens count in lengths[i]). Stored as tuples.

    Raises:
        ValueError: naming the value, on `vocab_size` < 2, `patch_dim` < 1, or `images` / `audio` without
            one entry per sample.
    """

    lengths: Sequence[int]
    vocab_size: int = 512
    images: Sequence[Sequence[tuple[int, int]]] | None = None
    audio: Sequence[Sequence[tuple[int, int]]] | None = None
    patch_dim: int = SYNTHETIC_PATCH_DIM

    def __post_init__(self) -> None:
        lengths, vocab_size, patch_dim = tuple(int(n) for n in self.lengths), self.vocab_size, self.patch_dim
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size=}")
        if patch_dim < 1:
            raise ValueError(f"patch_dim must be >= 1, got {patch_dim=}")
        object.__setattr__(self, "lengths", lengths)
        for name in ("images", "audio"):
            rows = getattr(self, name)
            if rows is None:
                continue
            if len(rows) != len(lengths):
                raise ValueError(
                    f"{name} must hold one entry per sample, got len({name})={len(rows)} for {len(lengths)=}"
                )
            object.__setattr__(self, name, tuple(tuple((int(a), int(b)) for a, b in row) for row in rows))


class SyntheticSource:
    """Rank `rank`'s view of a synthetic tokenized dataset (a `Source`): `data`, a `SyntheticData`, or its
    realized lengths alone (`SyntheticData(lengths)`: text, a vocabulary of 512).

    Every sample is valid: nothing is quarantined (`reasons` stays empty). `state_dict()` is the view's
    (rank, world size, seed, epoch, dataset size, position); loading another one raises ValueError
    naming the field.
    """

    reasons: Mapping[str, int] = NO_REASONS

    def __init__(
        self,
        data: SyntheticData | Sequence[int],
        rank: int,
        world_size: int,
        seed: int = 0,
        epoch: int = 0,
        shuffle: bool = True,
        wrap: bool = False,
    ) -> None:
        data = data if isinstance(data, SyntheticData) else SyntheticData(data)
        self.data = data
        rows = tuple[tuple[int, int], ...]
        self.images: list[rows] | None = [tuple(r) for r in data.images] if data.images is not None else None
        self.audio: list[rows] | None = [tuple(r) for r in data.audio] if data.audio is not None else None
        self.patch_dim = data.patch_dim
        self.lengths = list(data.lengths)
        self.longest = max(self.lengths, default=0)  # `Source.longest`
        self.rank, self.seed, self.vocab_size = rank, seed, data.vocab_size
        self.view = ViewSource(len(self.lengths), rank, world_size, seed, epoch, shuffle, wrap)

    def start_epoch(self, epoch: int, remainder: Remainder | None = None) -> None:
        """Moves to `epoch`'s view (a new seeded permutation when shuffled), from its start; with a resize's
        `remainder` (its epoch, at its world size), the ids it left, dealt to this rank."""
        self.view = self.view.for_epoch(epoch, remainder)

    def __len__(self) -> int:
        return len(self.view)

    def materialize(self, sample_id: int) -> Payload:
        if not 0 <= sample_id < len(self.lengths):
            raise KeyError(f"sample {sample_id} is not in this dataset of {len(self.lengths)} samples")
        return synthetic_sample(
            sample_id,
            self.lengths[sample_id],
            self.seed,
            self.vocab_size,
            self.images[sample_id] if self.images is not None else None,
            self.audio[sample_id] if self.audio is not None else None,
            self.patch_dim,
        )

    def materialize_many(self, sample_ids: Sequence[int]) -> list[Payload]:
        return [self.materialize(int(i)) for i in sample_ids]

    def meta(self, sample_id: int, payload: Payload, home_rank: int | None = None) -> Sample:
        n = self.lengths[sample_id]
        home = self.rank if home_rank is None else home_rank
        images = self.images[sample_id] if self.images is not None else ()
        audio = self.audio[sample_id] if self.audio is not None else ()
        return Sample(
            sample_id,
            n,
            loss_tokens_of(payload["labels"]),
            home,
            nbytes=payload_nbytes(payload),
            images=images,
            audio=audio,
        )

    def peek_id(self) -> int | None:
        return self.view.peek()

    def unread(self) -> int | None:
        return self.view.unread()

    def poll(self, timeout: float = 0.0) -> Poll:
        i = self.view.next()
        if i is None:
            return EXHAUSTED
        payload = self.materialize(i)
        return self.meta(i, payload), payload

    def state_dict(self) -> dict[str, Any]:
        return self.view.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.view.load_state_dict(state)

    def stats(self) -> dict[str, Any]:
        return {"samples": len(self.lengths), "view": len(self.view), "position": self.view.position}

    def close(self) -> None:
        pass


class IngestRefused(ValueError):
    """A pushed sample an `IngestSource` (or its rank) refuses: the stream's error, not the sample's (a
    duplicate id in the epoch, a sample after end_of_epoch, a sample for another epoch, a rank that reads
    its own source). The `Ingest` handler ends the stream with FAILED_PRECONDITION and this message."""


def check_pushed(sample: Sample, payload: Payload) -> None:
    """Checks a pushed payload against its metadata: a 1-D `input_ids` of `sample.length` tokens, and
    `labels` (when sent) of its shape carrying `sample.loss_tokens` loss tokens (`loss_tokens_of`).

    Raises:
        ValueError: naming the mismatch (the reason an `IngestSource` quarantines the sample with).
    """
    ids = payload.get("input_ids")
    if ids is None or ids.ndim != 1:
        raise ValueError("needs a 1-D input_ids tensor")
    if len(ids) != sample.length:
        raise ValueError(f"input_ids has {len(ids)} tokens, metadata says length={sample.length}")
    labels = payload.get("labels")
    if labels is not None:
        if labels.shape != ids.shape:
            raise ValueError(f"labels shape {labels.shape} != input_ids shape {ids.shape}")
        if loss_tokens_of(labels) != sample.loss_tokens:
            raise ValueError(
                f"labels carry {loss_tokens_of(labels)} loss tokens, "
                f"metadata says loss_tokens={sample.loss_tokens}"
            )


class IngestSource:
    """A bounded queue filled by `RankService.Ingest` (a `Source`; see module docstring).

    `ingest` validates each pushed record before it reaches the queue: a malformed one (bytes that do not
    decode, a payload that contradicts its metadata: `check_pushed`) is quarantined, i.e. not queued and
    its reason returned to the handler, which reports it to the producer and counts it (metric reason
    `invalid_ingest`). `reasons` stays empty: the rank loop never sees such a record.
    """

    reasons: Mapping[str, int] = NO_REASONS

    def __init__(self, capacity: int) -> None:
        self._q: queue.Queue[tuple[Sample, Payload]] = queue.Queue(maxsize=max(capacity, 1))
        self._ended = threading.Event()
        self._ids: set[int] = set()
        self._lock = threading.Lock()

    def ingest(self, decode: Callable[[], tuple[Sample, Payload]], home_rank: int) -> str | None:
        """Validates one pushed record and enqueues it as a sample of `home_rank` (blocking while the queue
        is full: backpressure on the producer's stream).

        Args:
            decode: Makes the record's (metadata, payload) from its wire form; a ValueError it raises (bytes
                that do not decode) quarantines the record like a failed `check_pushed`.
            home_rank: The rank the sample is queued for (the producer's `home_rank` is not trusted).

        Returns:
            None when queued; the reason when quarantined (nothing is queued then).

        Raises:
            IngestRefused: a duplicate id in this epoch or a sample after end_of_epoch (see `put`),
                prefixed with "rank {home_rank}: ".
        """
        try:
            sample, payload = decode()
            check_pushed(sample, payload)
        except ValueError as exc:
            return str(exc)
        pushed = Sample(
            sample.id,
            sample.length,
            sample.loss_tokens,
            home_rank,
            sample.modality_tokens,
            images=sample.images,
            audio=sample.audio,
        )
        try:
            self.put(pushed, payload)
        except IngestRefused as exc:
            raise IngestRefused(f"rank {home_rank}: {exc}") from None
        return None

    def put(self, sample: Sample, payload: Payload, timeout: float | None = None) -> None:
        """Blocks while the queue is full (backpressure); raises IngestRefused (a ValueError) on a
        duplicate id in this epoch or after end_of_epoch. Does not validate the payload (`ingest` does).

        The queued sample's `nbytes` is that of the ingested tensors (`payload_nbytes`), whatever the
        producer's metadata said.
        """
        nbytes = payload_nbytes(payload)
        if sample.nbytes != nbytes:
            sample = sample.replace(nbytes=nbytes)
        with self._lock:
            if self._ended.is_set():
                raise IngestRefused(f"sample {sample.id} arrived after end_of_epoch")
            if sample.id in self._ids:
                raise IngestRefused(f"duplicate sample id {sample.id} in this epoch")
            self._ids.add(sample.id)
        self._q.put((sample, payload), timeout=timeout)

    def end(self) -> None:
        self._ended.set()

    def start_epoch(self, epoch: int, remainder: Remainder | None = None) -> None:
        """Accepts the next epoch's samples (ids may repeat across epochs); anything left is dropped.
        Raises ValueError on a resize's `remainder`: the producers decide what is pushed."""
        if remainder is not None:
            raise ValueError(
                "a rank whose samples are pushed (Ingest) cannot be resized mid-epoch: its producers choose "
                "the samples; resume its trainers at an epoch's end instead"
            )
        with self._lock:
            while True:
                try:
                    self._q.get_nowait()
                except queue.Empty:
                    break
            self._ids.clear()
            self._ended.clear()

    def materialize(self, sample_id: int) -> Payload:
        raise KeyError(f"sample {sample_id}: an ingest source cannot re-materialize payloads")

    def materialize_many(self, sample_ids: Sequence[int]) -> list[Payload]:
        return [self.materialize(int(i)) for i in sample_ids]

    def stats(self) -> dict[str, Any]:
        return {"queued": self._q.qsize(), "ingested": len(self._ids), "ended": self._ended.is_set()}

    def close(self) -> None:
        self.end()

    def peek_id(self) -> int | None:
        return None

    def poll(self, timeout: float = 0.0) -> Poll:
        try:
            return self._q.get(timeout=timeout) if timeout > 0 else self._q.get_nowait()
        except queue.Empty:
            return EXHAUSTED if self._ended.is_set() and self._q.empty() else None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state:
            raise ValueError("an ingest source has no resumable state")
