"""One node agent's `Node` stream: its hello (version and spec checks, registration), which ranks it may
speak for, and the part of a balanced plan it is sent.

A node agent (`batchd node`) holds one persistent stream: a hello first (it registers the node's
ranks), then its ranks' reports and commits of a round as one message each, one reply per message, in
order. A node agent of another node protocol version is refused naming both versions; a message before
the hello, or for a rank the agent did not register, is refused (FAILED_PRECONDITION).
"""

from __future__ import annotations

from collections.abc import Iterable

from batchd.core import ProtocolError, RoundDecision, decision_for_node
from batchd.proto import batchd_pb2 as pb
from batchd.proto import wire

from ._convert import register_reply
from ._state import CoordinatorState


class NodeSession:
    """The state of one `Node` stream: the agent's name and ranks once it said hello, and the newest
    round's decision as this node needs it (`batchd.core.decision_for_node`), serialized once."""

    def __init__(self, state: CoordinatorState) -> None:
        self.state = state
        self.name: str | None = None
        self.ranks: frozenset[int] = frozenset()
        self.journaled = False  # the agent journals: a restart of it resumes its ranks
        self._decision: tuple[int, int, RoundDecision, bytes] | None = None  # epoch, round, original, reply

    def hello(self, hello: pb.NodeHello) -> pb.NodeReply:
        """Checks the agent's protocol version and job spec, registers its ranks (`register_node`) and
        returns the `registered` reply. Raises ProtocolError (another version, or as `register_node`),
        ValueError (an invalid spec), JobFailed, ShuttingDown."""
        if hello.protocol != pb.NODE_PROTOCOL_V1:
            raise ProtocolError(
                f"node agent {hello.node!r} speaks node protocol {hello.protocol}; "
                f"this coordinator speaks {pb.NODE_PROTOCOL_V1} (batchd.v1): run the "
                f"same batchd version on every party"
            )
        try:
            spec = wire.spec_from_pb(hello.spec)
        except ValueError as exc:
            raise ValueError(f"node agent {hello.node!r} sent an invalid job spec: {exc}") from None
        ranks = [int(r) for r in hello.ranks]
        registration = self.state.register_node(hello.node, ranks, spec, hello.address)
        self.name, self.ranks, self.journaled = hello.node, frozenset(ranks), bool(hello.journaled)
        return pb.NodeReply(registered=register_reply(registration))

    def own(self, kind: str, ranks: Iterable[int]) -> list[int]:
        """The ranks of an `align` / `commit` message (`kind`), once checked to be this agent's own.
        Raises ProtocolError before the hello, or naming the ranks it did not register."""
        if self.name is None:
            raise ProtocolError(f"a node stream sent {kind} before its hello")
        ranks = [int(r) for r in ranks]
        if not self.ranks.issuperset(ranks):
            foreign = sorted(set(ranks) - self.ranks)
            raise ProtocolError(
                f"node agent {self.name!r} sent {kind} for rank(s) {foreign}, which it "
                f"did not register (it serves {sorted(self.ranks)})"
            )
        return ranks

    def decision_reply(self, decision: RoundDecision, epoch: int) -> bytes:
        """The serialized `NodeReply` of `decision` as this node needs it: built once per round (the
        same decision object, epoch and round give the same bytes)."""
        cached = self._decision
        if (
            cached is not None
            and cached[0] == epoch
            and cached[1] == decision.round
            and cached[2] is decision
        ):
            return cached[3]
        mine = decision_for_node(decision, self.ranks)
        data: bytes = wire.node_decision_to_pb(mine, epoch).SerializeToString()
        self._decision = (epoch, decision.round, decision, data)
        return data
