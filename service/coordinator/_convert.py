"""The coordinator's protobuf conversions: its state's answers (`_answers`) into replies, and the
decisions and totals its journal keeps as serialized replies (`_recovery`'s `decision` and `totals`
records: the on-disk format). The state modules speak core types only; this module and the servicer
are where the coordinator touches protobuf (`batchd.proto.wire` converts the core's own types)."""

from __future__ import annotations

import base64

from batchd.core import RoundDecision, RoundTotals
from batchd.proto import batchd_pb2 as pb
from batchd.proto import wire

from ._answers import JobStatus, Registration, Resumed


def register_reply(reg: Registration) -> pb.RegisterReply:
    """The `RegisterReply` of a registration (lease in whole milliseconds)."""
    return pb.RegisterReply(
        epoch=reg.epoch,
        round=reg.round,
        lease_ms=int(reg.lease_s * 1000),
        rank_addresses=list(reg.addresses),
        generation=reg.generation,
        resume_needed=reg.resume_needed,
        token_budget=reg.token_budget,
    )


def resume_reply(resumed: Resumed) -> pb.ResumeReply:
    return pb.ResumeReply(
        epoch=resumed.epoch,
        round=resumed.round,
        step=resumed.step,
        generation=resumed.generation,
        remainder=resumed.remainder,
        job_end=resumed.job_end,
    )


def status_reply(status: JobStatus) -> pb.StatusReply:
    return pb.StatusReply(
        state=status.state,
        failure=status.failure,
        epoch=status.epoch,
        round=status.round,
        registered=list(status.registered),
        round_latency_ms=list(status.round_latency_ms),
        finished=list(status.finished),
    )


def encode_decision(decision: RoundDecision, epoch: int) -> str:
    """A decision as the journal keeps it: its `AlignReply`, serialized, in base64."""
    return base64.b64encode(wire.decision_to_pb(decision, epoch).SerializeToString()).decode()


def decode_decision(text: str) -> RoundDecision:
    """`encode_decision` undone."""
    return wire.decision_from_pb(pb.AlignReply.FromString(base64.b64decode(text)))


def encode_totals(totals: RoundTotals, epoch: int) -> str:
    """Totals as the journal keeps them: their `CommitReply`, serialized, in base64."""
    return base64.b64encode(wire.totals_to_pb(totals, epoch).SerializeToString()).decode()


def decode_totals(text: str) -> RoundTotals:
    """`encode_totals` undone."""
    return wire.totals_from_pb(pb.CommitReply.FromString(base64.b64decode(text)))
