"""What a trainer does when a step raised: ask its rank service whether the job failed (and who made it).

A trainer blocked in a collective learns that a peer died only when a peer it exchanges with drops the
connection, by which time its rank service may have failed and exited too: `FailureWatch` polls for the
job's failure in the background and keeps the message, `raise_job_failure` turns the step's exception
into `JobFailed` naming the rank that caused it.

A peer whose host is cut off or lost never drops its connections: a collective with it blocks until the
process group's own timeout (`--timeout`, 30 min by default). So once the job has failed, a trainer still
in its step `STUCK_EXIT_S` later is blocked on such a peer, and the watch ends it (`on_stuck`): exit 1
with the job's failure, within about `STUCK_EXIT_S` of the failure (docs/deployment.md#network-faults).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

import grpc

from batchd.client import JobFailed
from batchd.proto import batchd_pb2 as pb

STUCK_EXIT_S = 20.0  # after the job failed, a trainer still in its step this long is ended (docstring)
JOIN_S = 5.0  # `FailureWatch.stop` waits this long for a poll in flight (its own timeout is 2 s)


class FailureWatch:
    """Polls this rank's service for the job's failure in the background and keeps the message.

    A trainer blocked in a collective learns that a peer died only when a peer it exchanges with
    drops the connection (in a ring, after its neighbours have exited), by which time its rank service
    may have failed and exited too; the message kept here still names the rank that caused it.
    """

    def __init__(
        self,
        client,
        period_s: float = 0.5,
        on_stuck: Callable[[str], None] | None = None,
        stuck_s: float = STUCK_EXIT_S,
    ) -> None:
        self.client, self.period_s = client, period_s
        self.on_stuck, self.stuck_s = on_stuck, stuck_s
        self.failure: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batchd-failure-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                failure = self.client.stub.RankStatus(
                    pb.RankStatusRequest(rank=self.client.rank), timeout=2
                ).failure
            except (grpc.RpcError, ValueError):  # ValueError: the channel was closed under us
                continue
            if failure:
                self.failure = failure
                if self.on_stuck is not None and not self._stop.wait(self.stuck_s):
                    self.on_stuck(failure)  # the trainer did not stop the watch: still in its step
                return

    def stop(self, join_s: float = JOIN_S) -> None:
        """Stops the polling and waits up to `join_s` for its thread to end (it may be in a poll, which
        times out after 2 s): a process that exits with the thread still inside gRPC tears gRPC down
        under it."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(join_s)


def exit_stuck(rank: int, stuck_s: float = STUCK_EXIT_S) -> Callable[[str], None]:
    """`FailureWatch.on_stuck` of `batchd.train`: print the job's failure as its one line and exit 1."""

    def stuck(failure: str) -> None:
        print(
            f"[rank {rank}] batchd job failed: {failure} (this trainer was still in its step {stuck_s:g}s "
            "later, blocked in a collective with a party that is gone: exiting)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    return stuck


def raise_job_failure(client, watch: FailureWatch, exc: BaseException) -> None:
    """A step raised (typically a collective broke because a peer died): when the rank service knows the
    job failed, raise `JobFailed` with its message (it names the rank); otherwise return."""
    failure = _job_failure(client, watch)
    if failure:
        raise JobFailed(f"{failure} (this trainer saw: {type(exc).__name__}: {exc})") from exc


def _job_failure(client, watch: FailureWatch) -> str | None:
    """After a collective failed, ask this rank's service why (its message names the failed rank)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            status = client.stub.RankStatus(pb.RankStatusRequest(rank=client.rank), timeout=2)
            if status.failure:
                return status.failure
        except grpc.RpcError:
            return watch.failure or f"rank service of rank {client.rank} at {client.address} is gone"
        time.sleep(0.2)
    return watch.failure
