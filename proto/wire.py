"""Conversions between the core's dataclasses and the batchd.v1 protobuf messages.

Kept in one place so the coordinator, the rank service and the client agree field by field; every
`*_from_pb` validates through the core's own constructors, so a malformed message raises ValueError
(which the servicers turn into INVALID_ARGUMENT).

The coordinator's hot path has its own reader of a commit, `commit_with_sums_from_pb`: its steps are
`WireStep`s (pairs built only when read) and it sums each step in C, so a round's totals cost no
per-sample Python work. `node_decision_to_pb` / `node_totals_to_pb` wrap a round's answer as the reply of
a node agent's stream.
"""

from __future__ import annotations

import collections.abc
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast, overload

import numpy as np

from batchd.core import (
    GROUPS,
    Exchange,
    ImageRef,
    JobSpec,
    RankCommit,
    RankReport,
    RoundDecision,
    RoundTotals,
    Sample,
    StepInfo,
)

from . import batchd_pb2 as pb

_DTYPES = {"int32", "int64", "float32", "float16", "uint8", "bool", "float64", "int16", "int8"}
MAX_TENSOR_BYTES = 256 << 20


def spec_to_pb(spec: JobSpec) -> pb.JobSpec:
    """Every `JobSpec` field by name, its parts as nested messages (quota None travels as -1, an update
    size None as 0)."""
    top = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name not in GROUPS}
    top["quota"] = -1 if spec.quota is None else spec.quota
    u = spec.updates
    return pb.JobSpec(
        **top,
        policy=pb.PolicySpec(**dataclasses.asdict(spec.policy)),
        cost=pb.CostModel(name=spec.cost.name, quadratic=spec.cost.quadratic),
        phases=pb.Phases(**dataclasses.asdict(spec.phases)),
        updates=pb.Updates(
            tokens_per_update=u.tokens_per_update or 0,
            samples_per_update=u.samples_per_update or 0,
            update_rule=u.update_rule,
        ),
    )


def spec_from_pb(m: pb.JobSpec) -> JobSpec:
    """The `JobSpec` of a message, validated by the constructors (ValueError names a bad field)."""
    parts: dict[str, Any] = {}
    for name, cls in GROUPS.items():
        msg = getattr(m, name)
        parts[name] = {f.name: getattr(msg, f.name) for f in dataclasses.fields(cls)}
    for name in ("tokens_per_update", "samples_per_update"):  # 0 on the wire: off
        parts["updates"][name] = int(parts["updates"][name]) or None
    parts = {name: GROUPS[name](**kw) for name, kw in parts.items()}
    top = {f.name: getattr(m, f.name) for f in dataclasses.fields(JobSpec) if f.name not in GROUPS}
    top["quota"] = None if m.quota < 0 else int(m.quota)
    return JobSpec(**top, **parts)


def sample_to_pb(s: Sample) -> pb.SampleMeta:
    return pb.SampleMeta(
        id=s.id,
        length=s.length,
        loss_tokens=s.loss_tokens,
        home_rank=s.home_rank,
        modality_tokens=[pb.ModalityTokens(name=n, tokens=t) for n, t in s.modality_tokens],
        nbytes=s.nbytes,
        image_patches=[p for p, _ in s.images],
        image_tokens=[t for _, t in s.images],
        audio_frames=[f for f, _ in s.audio],
        audio_tokens=[t for _, t in s.audio],
    )


def sample_from_pb(m: pb.SampleMeta) -> Sample:
    if len(m.image_patches) != len(m.image_tokens):
        raise ValueError(
            f"sample {m.id}: {len(m.image_patches)} image patch counts but {len(m.image_tokens)} "
            f"image token counts"
        )
    if len(m.audio_frames) != len(m.audio_tokens):
        raise ValueError(
            f"sample {m.id}: {len(m.audio_frames)} audio frame counts but {len(m.audio_tokens)} "
            f"audio token counts"
        )
    return Sample(
        int(m.id),
        int(m.length),
        int(m.loss_tokens),
        int(m.home_rank),
        tuple((t.name, int(t.tokens)) for t in m.modality_tokens),
        int(m.nbytes),
        tuple(zip(m.image_patches, m.image_tokens, strict=False)),
        tuple(zip(m.audio_frames, m.audio_tokens, strict=False)),
    )


def exchange_to_pb(x: Exchange) -> pb.StepExchange:
    return pb.StepExchange(
        encode=[
            pb.ImageRef(
                sample_id=i.sample_id,
                index=i.index,
                home_rank=i.home_rank,
                owner=i.owner,
                patches=i.patches,
                tokens=i.tokens,
            )
            for i in x.encode
        ],
        sources=x.sources,
        tokens=x.tokens,
    )


def exchange_from_pb(m: pb.StepExchange, rank: int, world_size: int) -> Exchange:
    return Exchange(
        rank,
        world_size,
        tuple(
            ImageRef(
                int(i.sample_id), int(i.index), int(i.home_rank), int(i.owner), int(i.patches), int(i.tokens)
            )
            for i in m.encode
        ),
        tuple(int(s) for s in m.sources),
        tuple(int(t) for t in m.tokens),
    )


def report_to_pb(r: RankReport, epoch: int) -> pb.AlignRequest:
    return pb.AlignRequest(
        rank=r.rank,
        epoch=epoch,
        round=r.round,
        capacity=r.capacity,
        buffered=r.buffered,
        groups=r.groups,
        exhausted=r.exhausted,
        pool=[pb.PoolEntry(sample=sample_to_pb(s), arrival=a) for s, a in r.pool],
        unread=r.unread,
    )


def report_from_pb(m: pb.AlignRequest) -> RankReport:
    pool = tuple((sample_from_pb(e.sample), int(e.arrival)) for e in m.pool)
    unread = int(m.unread) if m.HasField("unread") else None
    return RankReport(
        int(m.rank),
        int(m.round),
        int(m.capacity),
        int(m.buffered),
        int(m.groups),
        bool(m.exhausted),
        pool,
        unread,
    )


def decision_to_pb(d: RoundDecision, epoch: int) -> pb.AlignReply:
    plan = []
    if d.plan is not None:
        plan = [
            pb.RankPlan(steps=[pb.Group(samples=[sample_to_pb(s) for s in g]) for g in steps])
            for steps in d.plan
        ]
    vision, audio = (
        [pb.RankVision(steps=[exchange_to_pb(x) for x in steps]) for steps in phase]
        if phase is not None
        else []
        for phase in (d.vision, d.audio)
    )
    return pb.AlignReply(epoch=epoch, round=d.round, target=d.target, plan=plan, vision=vision, audio=audio)


def decision_from_pb(m: pb.AlignReply) -> RoundDecision:
    plan = None
    if len(m.plan):
        plan = tuple(tuple(tuple(sample_from_pb(s) for s in g.samples) for g in p.steps) for p in m.plan)
    vision, audio = (
        tuple(tuple(exchange_from_pb(x, r, len(phase)) for x in rv.steps) for r, rv in enumerate(phase))
        if len(phase)
        else None
        for phase in (m.vision, m.audio)
    )
    return RoundDecision(int(m.round), int(m.target), plan, vision, audio)


def commit_to_pb(c: RankCommit, epoch: int) -> pb.CommitRequest:
    ids = c.ids if len(c.ids) == len(c.steps) else [()] * len(c.steps)
    steps = [
        pb.StepSamples(lengths=[n for n, _ in st], loss_tokens=[k for _, k in st], ids=step_ids)
        for st, step_ids in zip(c.steps, ids, strict=True)
    ]
    return pb.CommitRequest(
        rank=c.rank, epoch=epoch, round=c.round, steps=steps, remaining=c.remaining, exhausted=c.exhausted
    )


def commit_from_pb(m: pb.CommitRequest) -> RankCommit:
    # Hot path of the coordinator (one commit per rank per round): the repeated uint fields already
    # iterate as Python ints, so zip pairs them in C (about 2x faster than a per-sample generator).
    steps = []
    for st in m.steps:
        lengths, loss = st.lengths, st.loss_tokens
        if len(lengths) != len(loss):
            raise ValueError(f"commit of rank {m.rank}: {len(lengths)} lengths but {len(loss)} loss counts")
        steps.append(tuple(zip(lengths, loss, strict=False)))
    return RankCommit(
        int(m.rank), int(m.round), tuple(steps), int(m.remaining), bool(m.exhausted), _commit_ids(m)
    )


def _commit_ids(m: pb.CommitRequest) -> tuple[tuple[int, ...], ...]:
    """The commit's ids per step; () from a peer that sends none (its steps not all empty). Raises
    ValueError naming the rank on a step whose ids and samples differ in number."""
    if not any(len(st.ids) for st in m.steps):
        return () if any(len(st.lengths) for st in m.steps) else tuple(() for _ in m.steps)
    for st in m.steps:
        if len(st.ids) != len(st.lengths):
            raise ValueError(
                f"commit of rank {m.rank}: a step of {len(st.lengths)} samples with {len(st.ids)} ids"
            )
    return tuple(tuple(st.ids) for st in m.steps)


_Steps = tuple[tuple[tuple[int, int], ...], ...]  # RankCommit.steps


class WireStep(collections.abc.Sequence[tuple[int, int]]):
    """One committed step as it came off the wire: a sequence of the (length, loss_tokens) pairs of its
    samples (as `commit_from_pb` builds them), made only when someone reads them (the metrics, a quota
    cut); its length is known at once. Equal to the tuple of those pairs (and to another WireStep of
    them); unhashable. Raises ValueError on unequal lengths and loss counts."""

    __slots__ = ("_lengths", "_loss", "_pairs")

    def __init__(self, lengths: list[int], loss_tokens: list[int]) -> None:
        if len(lengths) != len(loss_tokens):
            raise ValueError(f"{len(lengths)} lengths but {len(loss_tokens)} loss counts")
        self._lengths, self._loss = lengths, loss_tokens
        self._pairs: tuple[tuple[int, int], ...] | None = None

    @property
    def pairs(self) -> tuple[tuple[int, int], ...]:
        """The (length, loss_tokens) pairs, built on first read."""
        if self._pairs is None:
            self._pairs = tuple(zip(self._lengths, self._loss, strict=False))
        return self._pairs

    def __len__(self) -> int:
        return len(self._lengths)

    @overload
    def __getitem__(self, i: int) -> tuple[int, int]: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[tuple[int, int], ...]: ...

    def __getitem__(self, i: int | slice) -> tuple[int, int] | tuple[tuple[int, int], ...]:
        return self.pairs[i]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self.pairs)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, WireStep | tuple):
            return self.pairs == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"WireStep({self.pairs!r})"


def commit_with_sums_from_pb(m: pb.CommitRequest) -> tuple[RankCommit, tuple[tuple[int, int, int], ...]]:
    """`commit_from_pb` for the coordinator's hot path, plus per step its (samples, tokens, loss tokens):
    the repeated fields are copied to lists and summed in C, with no per-sample pair (the steps are
    `WireStep`s, which stand in for the core's step tuples). O(samples) in C, O(steps) in Python.
    Raises ValueError naming the rank on unequal lengths and loss counts."""
    steps: list[WireStep] = []
    sums: list[tuple[int, int, int]] = []
    for st in m.steps:
        lengths, loss = st.lengths[:], st.loss_tokens[:]
        if len(lengths) != len(loss):
            raise ValueError(f"commit of rank {m.rank}: {len(lengths)} lengths but {len(loss)} loss counts")
        steps.append(WireStep(lengths, loss))
        sums.append((len(lengths), sum(lengths), sum(loss)))
    # A WireStep is a Sequence equal to the tuple it stands for; the core only iterates and measures it.
    pairs = cast(_Steps, tuple(steps))
    commit = RankCommit(int(m.rank), int(m.round), pairs, int(m.remaining), bool(m.exhausted), _commit_ids(m))
    return commit, tuple(sums)


def totals_to_pb(t: RoundTotals, epoch: int) -> pb.CommitReply:
    return pb.CommitReply(
        epoch=epoch,
        round=t.round,
        steps=t.steps,
        step_samples=t.step_samples,
        step_tokens=t.step_tokens,
        step_loss_tokens=t.step_loss_tokens,
        done=t.done,
        keep_last=t.keep_last or (),
        has_keep_last=t.keep_last is not None,
        update_first=t.update_first,
        update_open_steps=t.update_open_steps,
        update_end=t.update_end,
        update_loss_tokens=t.update_loss_tokens,
    )


def totals_from_pb(m: pb.CommitReply) -> RoundTotals:
    """The `RoundTotals` of a message; raises ValueError when its update fields do not give one entry
    per step (empty ones, from a peer that predates them, mean every step ends an update)."""
    for name in ("update_end", "update_loss_tokens"):
        n = len(getattr(m, name))
        if n not in (0, m.steps):
            raise ValueError(f"commit reply of round {m.round}: {n} {name} entries for {m.steps} steps")
    return RoundTotals(
        int(m.round),
        int(m.steps),
        tuple(int(x) for x in m.step_samples),
        tuple(int(x) for x in m.step_tokens),
        tuple(int(x) for x in m.step_loss_tokens),
        bool(m.done),
        tuple(int(x) for x in m.keep_last) if m.has_keep_last else None,
        int(m.update_first),
        int(m.update_open_steps),
        tuple(bool(x) for x in m.update_end),
        tuple(int(x) for x in m.update_loss_tokens),
    )


def node_decision_to_pb(d: RoundDecision, epoch: int) -> pb.NodeReply:
    """A round's decision as the reply of a node agent's stream (`d` already cut for that node, if at
    all: `batchd.core.decision_for_node`)."""
    return pb.NodeReply(decision=decision_to_pb(d, epoch))


def node_totals_to_pb(t: RoundTotals, epoch: int) -> pb.NodeReply:
    """A round's totals as the reply of a node agent's stream."""
    return pb.NodeReply(totals=totals_to_pb(t, epoch))


def info_to_pb(i: StepInfo, epoch: int) -> pb.StepInfo:
    return pb.StepInfo(
        rank=i.rank,
        step=i.step,
        round=i.round,
        is_idle=i.is_idle,
        local_samples=i.local_samples,
        local_tokens=i.local_tokens,
        local_loss_tokens=i.local_loss_tokens,
        global_samples=i.global_samples,
        global_tokens=i.global_tokens,
        global_loss_tokens=i.global_loss_tokens,
        loss_scale=i.loss_scale,
        cost=i.cost,
        epoch=epoch,
        update=i.update,
        update_step=i.update_step,
        not_update_end=not i.update_end,
        update_scale=i.update_scale,
        update_loss_tokens=i.update_loss_tokens,
        token_budget=i.token_budget,
    )


def info_from_pb(m: pb.StepInfo) -> StepInfo:
    return StepInfo(
        rank=int(m.rank),
        step=int(m.step),
        round=int(m.round),
        is_idle=bool(m.is_idle),
        local_samples=int(m.local_samples),
        local_tokens=int(m.local_tokens),
        local_loss_tokens=int(m.local_loss_tokens),
        global_samples=int(m.global_samples),
        global_tokens=int(m.global_tokens),
        global_loss_tokens=int(m.global_loss_tokens),
        loss_scale=float(m.loss_scale),
        cost=float(m.cost),
        update=int(m.update),
        update_step=int(m.update_step),
        update_end=not m.not_update_end,
        update_scale=float(m.update_scale) or 1.0,
        update_loss_tokens=int(m.update_loss_tokens),
        token_budget=int(m.token_budget),
    )


def tensor_to_pb(name: str, array: Any) -> pb.Tensor:
    """Encodes a numpy array or CPU torch tensor as raw little-endian bytes."""
    if hasattr(array, "numpy") and not isinstance(array, np.ndarray):
        array = array.detach().cpu().numpy()
    a = np.ascontiguousarray(array)
    if a.dtype.name not in _DTYPES:
        raise ValueError(f"tensor {name!r} has unsupported dtype {a.dtype.name!r}")
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return pb.Tensor(name=name, dtype=a.dtype.name, shape=list(a.shape), data=a.tobytes())


def tensor_from_pb(t: pb.Tensor) -> np.ndarray:
    """Decodes a `Tensor`; raises ValueError when dtype, shape and byte count disagree."""
    if t.dtype not in _DTYPES:
        raise ValueError(f"tensor {t.name!r}: unsupported dtype {t.dtype!r}")
    shape = tuple(int(x) for x in t.shape)
    if any(x < 0 for x in shape):
        raise ValueError(f"tensor {t.name!r}: negative dimension in shape={shape}")
    dtype = np.dtype(t.dtype).newbyteorder("<")
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if expected != len(t.data):
        raise ValueError(
            f"tensor {t.name!r}: {len(t.data)} bytes for shape={shape} dtype={t.dtype}, expected {expected}"
        )
    return np.frombuffer(t.data, dtype=dtype).reshape(shape)


def tensors_to_pb(tensors: Mapping[str, object]) -> list[pb.Tensor]:
    return [tensor_to_pb(k, v) for k, v in tensors.items() if not isinstance(v, (int, float))]


def tensors_from_pb(ts: Sequence[pb.Tensor]) -> dict[str, np.ndarray]:
    out = {}
    for t in ts:
        if t.name in out:
            raise ValueError(f"duplicate tensor name {t.name!r}")
        out[t.name] = tensor_from_pb(t)
    return out
