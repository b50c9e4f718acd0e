"""The lease watchdog: a daemon thread that fails the job when a party stops being alive.

Timeouts judge liveness, never speed (`batchd.core.Liveness`):
- every rank must register within `startup_timeout_s` (parties start in any order; the coordinator
  logs every `WAIT_LOG_S` seconds whom it waits for);
- a registered, unfinished rank silent for longer than `lease_s` (no heartbeat, no call) fails the job
  naming it; a barrier waits as long as every missing rank is alive;
- any party may call `Fail(rank, reason)`;
after which every pending and later call returns ABORTED with the failure message. Until the job is
done the coordinator stays, whatever the trainers' step times: a job never fails because a trainer is
slow.

The watchdog holds no state of its own: each tick (every min(lease / 4, 1) s) it calls the state's
`check_leases`, which fails the job under the state's lock when a lease lapsed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("batchd.coordinator")

WAIT_LOG_S = 5.0  # how often a waiting coordinator says whom it waits for


class LeaseWatchdog:
    """Calls `check(log_after)` every `period_s` until `stop` is set, on a daemon thread.

    `check(log_after)` fails the job if a lease lapsed and returns (now, whom the job waits for), the
    latter only when now >= log_after (else None); the watchdog logs it and waits `WAIT_LOG_S` before
    asking again.
    """

    def __init__(
        self, check: Callable[[float], tuple[float, str | None]], period_s: float, stop: threading.Event
    ) -> None:
        if period_s <= 0:
            raise ValueError(f"the watchdog's period must be positive, got {period_s=}")
        self._check, self.period_s, self._stop = check, period_s, stop
        self._thread = threading.Thread(target=self._run, name="batchd-lease-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        last_log = time.monotonic()
        while not self._stop.wait(self.period_s):
            now, waiting = self._check(last_log + WAIT_LOG_S)
            if waiting:
                log.info("%s", waiting)
                last_log = now
