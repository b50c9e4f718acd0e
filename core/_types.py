"""Sample metadata and the validation shared by every core module (steps: `_step`).

Only metadata travels through the protocol: a sample is an id, its realized length (tokens after
augmentation, chat template, tokenization and visual-token expansion), how many of those tokens carry
loss, the rank whose view produced it, and optional per-modality token counts. Payloads never enter
the core; the daemon maps ids to payload references.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, TypeVar, cast

# JSON keys of a serialized sample (compact: samples appear by the hundred thousand in states).
_ID, _LEN, _LOSS, _HOME, _MOD, _BYTES, _IMG, _AUD = "i", "n", "l", "h", "m", "b", "v", "a"


def check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    """Returns `value` if it is an int within [lo, hi]; raises ValueError naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {name}={value!r} ({type(value).__name__})")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {name}={value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {name}={value}")
    return value


_Choice = TypeVar("_Choice", str, int)


def check_choice(name: str, value: Any, choices: Sequence[_Choice]) -> _Choice:
    """Returns `value` if it is one of `choices`; raises ValueError listing them otherwise."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {name}={value!r}")
    return cast(_Choice, value)


def check_number(name: str, value: Any, gt: float = 0.0) -> float:
    """Returns `value` as a float if it is a number > `gt`; raises ValueError naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > gt:
        raise ValueError(f"{name} must be a number > {gt:g}, got {name}={value!r}")
    return float(value)


def parse_bytes(value: int | str) -> int:
    """Bytes from an int or a size such as "512MiB", "1GiB", "2GB", "300k" (powers of 1024 for both
    spellings)."""
    if isinstance(value, bool):
        raise ValueError(f"a size must be bytes or a string like '1GiB', got {value=}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"a size must be >= 1 byte, got {value=}")
        return value
    text = str(value).strip().lower().replace(" ", "")
    units = {
        "": 1,
        "b": 1,
        "k": 1 << 10,
        "kb": 1 << 10,
        "kib": 1 << 10,
        "m": 1 << 20,
        "mb": 1 << 20,
        "mib": 1 << 20,
        "g": 1 << 30,
        "gb": 1 << 30,
        "gib": 1 << 30,
        "t": 1 << 40,
        "tb": 1 << 40,
        "tib": 1 << 40,
    }
    num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(num) :]
    try:
        n = float(num)
    except ValueError:
        n = -1.0
    if unit not in units or n <= 0:
        raise ValueError(f"a size must be bytes or a number with a unit (k, MiB, GiB, ...), got {value=}")
    return max(int(n * units[unit]), 1)


def check_bool(name: str, value: Any) -> bool:
    """Returns `value` if it is a bool; raises ValueError naming it otherwise (1 and "yes" are not bools)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {name}={value!r}")
    return value


def check_str(name: str, value: Any, optional: bool = False) -> str | None:
    """Returns `value` if it is a non-empty string (or None when `optional`); raises ValueError otherwise."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {name}={value!r}")
    return value


def _encoder_items(field: str, size: str, items: Any) -> tuple[tuple[int, int], ...]:
    """`items` as a tuple of (encoder size, tokens) pairs, validated; errors name the field and entry."""
    out = cast(tuple[tuple[int, int], ...], tuple(tuple(it) for it in items))
    for k, it in enumerate(out):
        if len(it) != 2:
            raise ValueError(f"{field} entries must be ({size}, tokens), got {field}[{k}]={it!r}")
        check_int(f"{field}[{k}] {size}", it[0], lo=0)
        check_int(f"{field}[{k}] tokens", it[1], lo=1)
    return out


class _SampleFields(NamedTuple):
    id: int
    length: int
    loss_tokens: int
    home_rank: int
    modality_tokens: tuple[tuple[str, int], ...]
    nbytes: int
    images: tuple[tuple[int, int], ...]
    audio: tuple[tuple[int, int], ...]


class Sample(_SampleFields):
    """Metadata of one preprocessed sample: an immutable named tuple, validated on construction.

    A named tuple rather than a frozen dataclass because every sample a rank handles is built once on
    the per-rank hot path; construction cost, measured: docs/benchmarks.md (Throughput).

    Attributes:
        id: Dataset-wide sample id (>= 0), unique within an epoch.
        length: Realized length in tokens (>= 1).
        loss_tokens: Tokens that carry loss (labels != -100); -1 on construction means "all of them".
        home_rank: The rank whose sampler view produced the sample.
        modality_tokens: Optional per-modality counts, e.g. (("text", 300), ("vision", 1024)).
        nbytes: Bytes of its payload (token ids, labels, pixel values) as it would cross the network;
            0 = unknown. A node-aware balanced plan moves the groups that carry the fewest bytes.
        images: Per image, (encoder patches, image tokens in the sequence): the vision encoder's cost and
            the rows of the image's embedding (two-phase balancing, `batchd.core.plan_vision`).
        audio: Per audio clip, (encoder frames, clip tokens in the sequence): the audio encoder's cost
            (log-mel frames, 100 per second) and the rows of the clip's embedding (`batchd.core.plan_phases`).
    """

    __slots__ = ()

    def __new__(
        cls,
        id: int,
        length: int,
        loss_tokens: int = -1,
        home_rank: int = 0,
        modality_tokens: tuple[tuple[str, int], ...] = (),
        nbytes: int = 0,
        images: tuple[tuple[int, int], ...] = (),
        audio: tuple[tuple[int, int], ...] = (),
    ) -> Sample:
        if loss_tokens == -1 and type(length) is int:
            loss_tokens = length
        # Fast path: exact ints in range need no further checks.
        if not (
            type(id) is int
            and type(length) is int
            and type(loss_tokens) is int
            and type(home_rank) is int
            and type(nbytes) is int
            and id >= 0
            and length >= 1
            and 0 <= loss_tokens <= length
            and home_rank >= 0
            and nbytes >= 0
        ):
            check_int("id", id, lo=0)
            check_int("nbytes", nbytes, lo=0)
            check_int("length", length, lo=1)
            check_int("home_rank", home_rank, lo=0)
            check_int("loss_tokens", loss_tokens, lo=0, hi=length)
        if modality_tokens:
            modality_tokens = tuple(modality_tokens)
            for entry in modality_tokens:
                if len(entry) != 2 or not isinstance(entry[0], str):
                    raise ValueError(f"modality_tokens entries must be (name, count), got {entry!r}")
                check_int(f"modality_tokens[{entry[0]!r}]", entry[1], lo=0)
        if images:
            images = _encoder_items("images", "patches", images)
        if audio:
            audio = _encoder_items("audio", "frames", audio)
        fields = (id, length, loss_tokens, home_rank, modality_tokens, nbytes, images, audio)
        return tuple.__new__(cls, fields)

    def replace(self, **changes: Any) -> Sample:
        """A copy with some fields changed (validated again)."""
        return Sample(**{**self._asdict(), **changes})

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {_ID: self.id, _LEN: self.length, _HOME: self.home_rank}
        if self.loss_tokens != self.length:
            out[_LOSS] = self.loss_tokens
        if self.modality_tokens:
            out[_MOD] = [list(m) for m in self.modality_tokens]
        if self.nbytes:
            out[_BYTES] = self.nbytes
        if self.images:
            out[_IMG] = [list(im) for im in self.images]
        if self.audio:
            out[_AUD] = [list(a) for a in self.audio]
        return out

    @staticmethod
    def from_json(obj: Mapping[str, Any]) -> Sample:
        return Sample(
            id=obj[_ID],
            length=obj[_LEN],
            loss_tokens=obj.get(_LOSS, -1),
            home_rank=obj.get(_HOME, 0),
            modality_tokens=tuple((str(k), int(v)) for k, v in obj.get(_MOD, ())),
            nbytes=obj.get(_BYTES, 0),
            images=tuple((int(p), int(t)) for p, t in obj.get(_IMG, ())),
            audio=tuple((int(f), int(t)) for f, t in obj.get(_AUD, ())),
        )
