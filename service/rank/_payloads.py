"""A rank's payloads: held, lent to the ranks a balanced plan moves them to, fetched from others, collated.

Payloads are dicts of numpy arrays, or references to one (a `RaySource` yields Ray ObjectRefs; the bytes
stay in the Ray object store). References are resolved at collate time, one `ray.get` per step
(`resolve_payloads`), when a peer `Fetch`es a lent sample, and when a restart re-materializes payloads
(`materialize_many`).

`Payloads` holds one rank's payloads by sample id (the window's, plus those fetched for this round) and
the lending side of a balanced plan:

    decision -> lend (set aside the payloads other ranks take) -> commit -> finalize
             -> fetch_moved (one Fetch per home rank, FETCH_CHUNK ids each) -> take / image_payload

A lent payload is handed to each rank that takes it (its LLM owner, every rank encoding one of its
images; `lend_out` serves a peer's `Fetch`) and dropped after the last; one this rank also uses stays
held (the same reference, no copy). A rank of the same node agent (`local_peers`) hands moved payloads
over in process; others are fetched over one long-lived gRPC channel per peer address, retried while
the peer restarts or a partition heals (up to two leases, `patience_s`; then the job fails naming it).
A payload not held (after a restart) is re-made from the source by id. Thread safety: `lend`, `take_lent`
and `untake_lent` take the lending lock (`lend_out` runs on the server's threads); everything else runs
on the rank's loop thread.

`collate` / `batch_of` turn one step's payloads into its arrays (padded, packed or two-phase; numpy, no
torch) and its `pb.Batch`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

import grpc

from batchd.core import (
    AUDIO_EXCHANGE_KEYS,
    CoordinatorError,
    Exchange,
    JobSpec,
    RoundDecision,
    Sample,
    Step,
    clip_of,
    collate_clips,
    collate_images,
    collate_packed,
    collate_padded,
    exchange_arrays,
    idle_batch,
    image_of,
    llm_grids,
    strip_audio,
    strip_vision,
)
from batchd.proto import CHANNEL_OPTIONS, Security, Unreachable, channel, retry_while_unreachable, wire
from batchd.proto import batchd_pb2 as pb
from batchd.proto import batchd_pb2_grpc as pb_grpc

from .._coord_client import CoordinatorLink
from ..preprocess import Payload, Source, loss_tokens_of, resolve_many

log = logging.getLogger("batchd.rank")
FETCH_CHUNK = 64  # sample ids per Fetch request


def resolve_payloads(payloads: list[Any]) -> list[Payload]:
    """Payload dicts for `payloads`, fetching Ray ObjectRefs (if any) with one `ray.get`."""
    if all(isinstance(p, dict) for p in payloads):
        return payloads
    return resolve_many(payloads)


def materialize_many(source: Source, ids: list[int]) -> list[Payload]:
    """The payload dicts of `ids`, re-made by `source` (in one batch: `Source.materialize_many`)."""
    if not ids:
        return []
    return resolve_payloads(list(source.materialize_many(ids)))


def truncated(payload: Payload, n: int) -> tuple[dict[str, Any], int]:
    """A sample's payload cut to its first `n` tokens (`over_budget = "truncate"`), and its loss tokens.

    Cuts the token sequences only. Other arrays (pixel_values, image_grid_thw) are kept whole: an image
    whose tokens are cut would need the pipeline's spans to drop consistently, which is why `batchd rank
    --dataset` preprocesses with cutoff <= truncate_length (the Truncate stage drops whole images) and
    never needs this."""
    out = dict(resolve_payloads([payload])[0])
    for k in ("input_ids", "labels"):
        if k in out:
            out[k] = out[k][:n]
    return out, loss_tokens_of(out["labels"]) if "labels" in out else n - 1


def collate(
    spec: JobSpec,
    payloads: list[Payload],
    pad_id: int = 0,
    step: Step | None = None,
    images: list[Payload] | None = None,
    clips: list[Payload] | None = None,
) -> dict[str, Any]:
    """Collates payloads into the step's arrays (padded or packed, per the job spec; numpy, no torch).

    A two-phase step (`step.exchange` set) carries its LLM samples without their pixels, the pixels of the
    images it encodes (`images`: their samples' payloads, one per `exchange.encode` entry, in order) and the
    exchange arrays (`batchd.core.exchange_arrays`). A step with an audio exchange (`step.audio_exchange`)
    alike: its LLM samples without their audio features, the features of the clips it encodes (`clips`:
    their samples' payloads, one per `audio_exchange.encode` entry) and the `AUDIO_EXCHANGE_KEYS` arrays."""
    if step is not None and step.audio_exchange is not None:
        encode = step.audio_exchange.encode
        if clips is None or len(clips) != len(encode):
            raise ValueError(
                f"step {step.info.step}: {len(encode)} audio clips to encode, got "
                f"{None if clips is None else len(clips)} payloads"
            )
        out = collate(spec, strip_audio(payloads), pad_id, replace(step, audio_exchange=None), images)
        out.update(collate_clips([clip_of(p, c.index) for p, c in zip(clips, encode, strict=True)]))
        out.update(exchange_arrays(step.audio_exchange, AUDIO_EXCHANGE_KEYS))
        return out
    if step is not None and step.exchange is not None:
        out = collate(spec, strip_vision(payloads), pad_id)
        out.update(llm_grids(payloads))
        encode = step.exchange.encode
        if images is None or len(images) != len(encode):
            raise ValueError(
                f"step {step.info.step}: {len(encode)} images to encode, got "
                f"{None if images is None else len(images)} payloads"
            )
        out.update(collate_images([image_of(p, im.index) for p, im in zip(images, encode, strict=False)]))
        out.update(exchange_arrays(step.exchange))
        return out
    if not payloads:
        return idle_batch(pad_id)
    if spec.policy.collate == "packed":
        return collate_packed(payloads)
    return collate_padded(payloads, pad_id=pad_id)


def batch_of(
    spec: JobSpec,
    epoch: int,
    step: Step,
    payloads: list[Any],
    images: list[Any] | None = None,
    clips: list[Any] | None = None,
) -> pb.Batch:
    """The `pb.Batch` the trainer gets for `step` of `epoch`: its info, collated tensors and sample ids."""
    tensors = collate(
        spec,
        resolve_payloads(payloads),
        step=step,
        images=resolve_payloads(images) if images else images,
        clips=resolve_payloads(clips) if clips else clips,
    )
    return pb.Batch(
        info=wire.info_to_pb(step.info, epoch),
        tensors=wire.tensors_to_pb(tensors),
        sample_ids=[s.id for s in step.samples],
    )


class FetchRefused(Exception):
    """A peer's `Fetch` this rank cannot serve, the message says why: samples of another epoch than this
    one or the one before (the handler sends FAILED_PRECONDITION), or a payload neither lent nor made by
    the source (`not_found`: NOT_FOUND)."""

    def __init__(self, message: str, not_found: bool = False) -> None:
        super().__init__(message)
        self.not_found = not_found


def _takers(me: int, decision: RoundDecision) -> tuple[dict[int, set[int]], set[int]]:
    """({sample id: the other ranks that take it}, the ids this rank uses itself) for `me`'s samples."""
    assert decision.plan is not None
    takers: dict[int, set[int]] = {}
    mine: set[int] = {s.id for group in decision.plan[me] for s in group}
    for rank, plan_steps in enumerate(decision.plan):
        if rank != me:
            for group in plan_steps:
                for s in group:
                    if s.home_rank == me:
                        takers.setdefault(s.id, set()).add(rank)
    for phase in (decision.vision, decision.audio):  # the samples whose images (clips) a rank encodes
        for rank, exchanges in enumerate(phase or ()):
            for ex in exchanges:
                for im in ex.encode:
                    if im.home_rank == me:
                        if rank == me:
                            mine.add(im.sample_id)
                        else:
                            takers.setdefault(im.sample_id, set()).add(rank)
    return takers, mine


class Payloads:
    """The payloads of one rank (see module docstring).

    Attributes:
        held: Payloads by sample id: the window's, and those fetched for the steps being collated.
        lent: Payloads of this rank's samples that other ranks take this round; `lent_takers` counts the
            ranks still to take each.
        address: This rank's own address (for asking the coordinator for its peers').
        peers: Every rank's address, by rank (as the coordinator last said).
        local_peers: The other ranks of this node agent, in process (their `Payloads`).
        fetched: Moved-in samples taken in process ("local") and fetched over gRPC ("remote"), and the
            bytes of the Fetch replies that carried the latter ("remote_bytes", as serialized).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        source: Source,
        coord: Callable[[], CoordinatorLink],
        security: Security | None,
        stop: threading.Event,
        epoch: Callable[[], int],
    ) -> None:
        """`coord` and `epoch` are read at each use: the rank's coordinator client (a node agent sets it
        after construction) and its current epoch."""
        self.rank, self.world_size, self.source, self._coord = rank, world_size, source, coord
        self.security, self._stop, self._epoch = security, stop, epoch
        self.held: dict[int, Payload] = {}
        self.lent: dict[int, Payload] = {}
        self.lent_takers: dict[int, int] = {}  # lent sample -> ranks still to take it (LLM owner, encoders)
        self._lend_lock = threading.Lock()
        self.address = ""
        self.peers: list[str] = []
        self.local_peers: Mapping[int, Payloads] = {}
        self.fetched = {"local": 0, "remote": 0, "remote_bytes": 0}
        self._peer_stubs: dict[str, pb_grpc.RankServiceStub] = {}  # one channel per peer address, for the job
        self._peer_channels: list[grpc.Channel] = []

    def close(self) -> None:
        """Closes the channels to the peers."""
        for ch in self._peer_channels:
            ch.close()
        self._peer_channels.clear()

    # -- this rank's own steps ---------------------------------------------------------------------
    def take(self, s: Sample) -> Payload:
        """The payload of `s`, a sample of one of this rank's steps, no longer held after: held, fetched
        now (a moved sample `fetch_moved` did not prefetch) or re-made by the source."""
        payload = self.held.pop(s.id, None)
        if payload is not None:
            return payload
        if s.home_rank != self.rank:
            return self.fetch_ids(s.home_rank, [s.id])[0]
        return self.source.materialize(s.id)

    def image_payload(self, sample_id: int, home: int) -> Payload:
        """The payload of a sample whose image this rank encodes: held here (its LLM sample, or a sample of
        this rank), fetched by `fetch_moved`, or fetched now. It stays held (the caller drops it)."""
        payload = self.held.get(sample_id)
        if payload is not None:
            return payload
        if home != self.rank:
            payload = self.fetch_ids(home, [sample_id])[0]
        else:
            payload = self.source.materialize(sample_id)
        self.held[sample_id] = payload
        return payload

    def encoded(self, exchange: Exchange | None) -> list[Payload] | None:
        """The payloads of the samples whose images (clips) `exchange` has this rank encode, in its order
        (`image_payload` each); None without an exchange."""
        if exchange is None:
            return None
        return [self.image_payload(im.sample_id, im.home_rank) for im in exchange.encode]

    # -- lending ------------------------------------------------------------------------------------
    def lend(self, decision: RoundDecision) -> None:
        """Sets aside the payloads of this rank's samples that other ranks will take this round: the LLM
        owner a balanced plan placed them on, and (two-phase) every rank encoding one of their images.
        A payload this rank also uses itself (its own LLM group, images it encodes) stays in `held`
        too: the same reference, no copy."""
        if decision.plan is None:
            return
        takers, mine = _takers(self.rank, decision)
        with self._lend_lock:
            for sample_id, ranks in takers.items():
                payload = self.held.get(sample_id) if sample_id in mine else self.held.pop(sample_id, None)
                if payload is not None:
                    self.lent[sample_id] = payload
                    self.lent_takers[sample_id] = len(ranks)

    def take_lent(self, sample_id: int) -> Payload | None:
        """The payload of a sample of this rank that the plan placed elsewhere, handed to each rank that
        takes it (None when it is not held, e.g. after a restart: the caller re-makes it from the source)."""
        with self._lend_lock:
            payload = self.lent.get(sample_id)
            if payload is not None:
                left = self.lent_takers.pop(sample_id, 1) - 1
                if left > 0:
                    self.lent_takers[sample_id] = left
                else:
                    del self.lent[sample_id]
            return payload

    def untake_lent(self, sample_id: int, payload: Payload) -> None:
        """Undoes one `take_lent` (a Fetch reply that had no room for it: the peer asks again)."""
        with self._lend_lock:
            if sample_id in self.lent:
                self.lent_takers[sample_id] = self.lent_takers.get(sample_id, 1) + 1
            else:
                self.lent[sample_id], self.lent_takers[sample_id] = payload, 1

    def lend_out(self, ids: list[int], epoch: int, limit_bytes: int) -> list[pb.IngestRequest]:
        """The payloads of `ids` (samples of `epoch`) for a peer's `Fetch`, in order, encoded in this rank's
        epoch: lent ones handed over (`take_lent`), others re-made by the source. A prefix of them when the
        encoded reply would pass `limit_bytes` (at least one): the peer asks again for the rest, which stays
        lent (`untake_lent`).

        Raises:
            FetchRefused: (`not_found`) naming a sample neither lent nor made by the source.
        """
        out: list[pb.IngestRequest] = []
        size = 0
        for i in ids:
            lent = self.take_lent(i)
            payload = lent
            if payload is None:
                try:
                    payload = self.source.materialize(i)
                except (KeyError, IndexError, ValueError) as exc:
                    log.warning("Fetch: sample %d: %s: %s", i, type(exc).__name__, exc)
                    raise FetchRefused(
                        f"rank {self.rank} has no payload for sample {i} of epoch {epoch}: it was not lent "
                        f"to a peer and its source cannot make it ({type(exc).__name__}: {exc})",
                        not_found=True,
                    ) from None
            msg = pb.IngestRequest(
                tensors=wire.tensors_to_pb(resolve_payloads([payload])[0]), epoch=self._epoch()
            )
            size += msg.ByteSize()
            if out and size > limit_bytes:
                if lent is not None:
                    self.untake_lent(i, lent)
                break
            out.append(msg)
        return out

    # -- fetching -----------------------------------------------------------------------------------
    def fetch_moved(self, steps: Iterable[Step]) -> None:
        """Fetches the payloads of the samples the balanced plan moved here: one Fetch per home rank
        and round over one long-lived channel per peer (FETCH_CHUNK ids per request; a reply stops at
        the server's `FETCH_REPLY_BYTES`, far below the message cap, and the rest is asked for again)."""
        wanted: dict[int, list[int]] = {}
        seen: set[int] = set()
        for step in steps:
            for sample_id, home in step.payload_refs():
                if home != self.rank and sample_id not in self.held and sample_id not in seen:
                    seen.add(sample_id)
                    wanted.setdefault(home, []).append(sample_id)
        for home, ids in wanted.items():
            for k in range(0, len(ids), FETCH_CHUNK):
                chunk = ids[k : k + FETCH_CHUNK]
                self.held.update(zip(chunk, self.fetch_ids(home, chunk), strict=True))

    def fetch_ids(self, home: int, ids: list[int]) -> list[Payload]:
        """The payloads of `ids` from rank `home`. A peer that is unreachable (restarting from its journal)
        is retried, with its address asked anew of the coordinator, for up to two of the coordinator's leases
        (its `patience_s`: a restart, or a partition between the two agents that heals);
        one that stays away fails the job, naming it. A rank of this node agent hands them over in process."""
        if home in self.local_peers:
            return self._take_local(self.local_peers[home], ids)
        out: list[Payload] = []
        while len(out) < len(ids):  # a reply may hold a prefix (size cap): ask for the rest
            request = pb.FetchRequest(ids=ids[len(out) :], epoch=self._epoch(), rank=home)

            def fetch(request: pb.FetchRequest = request) -> pb.FetchReply:
                got: pb.FetchReply = self._peer(home).Fetch(request, timeout=60)  # the peer as of now
                return got

            try:
                reply = retry_while_unreachable(
                    fetch,
                    self._coord().patience_s,
                    f"rank {home} (rank {self.rank} fetching moved samples)",
                    stop=self._stop,
                    on_retry=self._refresh_peers,
                    logger=log,
                )
            except Unreachable as gone:
                raise CoordinatorError(
                    f"rank {home} at {self.peers[home]} unreachable for {gone.elapsed_s:.0f}s "
                    f"(rank {self.rank} fetching moved samples): {gone.error.details()}"
                ) from None
            except grpc.RpcError as exc:
                raise CoordinatorError(
                    f"rank {self.rank} could not fetch moved samples from rank {home} at "
                    f"{self.peers[home]}: {exc.code().name}: {exc.details()}"
                ) from None
            if not reply.samples:
                raise RuntimeError(f"rank {home} returned no payload for samples {ids[len(out) :]}")
            out += [wire.tensors_from_pb(m.tensors) for m in reply.samples]
            self.fetched["remote_bytes"] += reply.ByteSize()
        self.fetched["remote"] += len(out)
        return out

    def _take_local(self, home: Payloads, ids: list[int]) -> list[Payload]:
        """Moved samples of a rank of this node agent: references handed over in process, no copy."""
        out = []
        for i in ids:
            payload = home.take_lent(i)
            out.append(payload if payload is not None else home.source.materialize(i))
        self.fetched["local"] += len(ids)
        return out

    def _peer(self, rank: int) -> pb_grpc.RankServiceStub:
        if len(self.peers) != self.world_size or not all(self.peers):
            # The coordinator sends the addresses only once every rank registered, so the first ranks
            # to register have none; a plan that moves samples comes after every rank reported.
            self.peers = list(self._coord().register(self.address).rank_addresses)
            if len(self.peers) != self.world_size or not all(self.peers):
                raise CoordinatorError(
                    f"rank {self.rank}: the coordinator does not know every rank's address"
                )
        address = self.peers[rank]
        stub = self._peer_stubs.get(address)
        if stub is None:
            ch = channel(address, self.security, CHANNEL_OPTIONS)
            self._peer_channels.append(ch)
            stub = self._peer_stubs[address] = pb_grpc.RankServiceStub(ch)
        return stub

    def _refresh_peers(self) -> None:
        """Asks the coordinator for the ranks' addresses again (a restarted peer may listen elsewhere)."""
        peers = list(self._coord().register(self.address).rank_addresses)
        if peers and peers != self.peers:
            for old, new in zip(self.peers, peers, strict=False):
                if old != new:
                    self._peer_stubs.pop(old, None)
            self.peers = peers
