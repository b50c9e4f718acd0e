"""One barrier of a round (its align or its commit) and how its waiters learn the outcome.

A barrier completes once, under the coordinator state's lock, with the round's decision / totals or
with an error: the job failed (`JobFailed`) or the coordinator closes (`ShuttingDown`). Sync waiters
block on it (`wait`); async ones await a future of their event loop (`future`: one per waiter),
resolved directly when the completing thread runs their loop (the usual case: the last message's
handler completes the barrier), else by one `call_soon_threadsafe` per loop. Nothing else is woken, and
a waiter whose call ended cancels only its own future.
"""

from __future__ import annotations

import asyncio
import threading

from batchd.core import RoundDecision, RoundTotals


class ShuttingDown(RuntimeError):
    """This coordinator is stopping (a restart may follow): callers retry (UNAVAILABLE)."""


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _settle(futures: list[asyncio.Future[Barrier]], barrier: Barrier) -> None:
    for fut in futures:
        if not fut.done():  # a waiter cancelled (its stream ended) cancelled its own future
            fut.set_result(barrier)


class Barrier:
    """The outcome of one barrier, keyed ("align" | "commit", epoch, round), for whoever waits on it.

    `done`, then exactly one of `result` (the decision / totals) and `error` (the exception class and
    message, raised anew for every waiter) is set. `complete` and `future` run under the owner's lock.
    """

    __slots__ = ("key", "done", "result", "error", "_event", "_futures")

    def __init__(self, key: tuple[str, int, int]) -> None:
        self.key = key
        self.done = False
        self.result: RoundDecision | RoundTotals | None = None
        self.error: tuple[type[Exception], str] | None = None
        self._event = threading.Event()
        self._futures: dict[asyncio.AbstractEventLoop, list[asyncio.Future[Barrier]]] = {}

    def complete(
        self,
        result: RoundDecision | RoundTotals | None = None,
        error: tuple[type[Exception], str] | None = None,
    ) -> None:
        """Completes the barrier (once; later calls do nothing) and wakes every waiter."""
        if self.done:
            return
        self.done, self.result, self.error = True, result, error
        self._event.set()
        running = _running_loop()
        for loop, futures in self._futures.items():
            if loop is running:
                _settle(futures, self)
            else:
                try:
                    loop.call_soon_threadsafe(_settle, futures, self)
                except RuntimeError:  # that loop is closed: nobody awaits there any more
                    pass
        self._futures = {}

    def future(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[Barrier]:
        """A future of `loop` resolved (to this barrier) once it completes (at once if it has)."""
        fut: asyncio.Future[Barrier] = loop.create_future()
        if self.done:
            fut.set_result(self)
        else:
            self._futures.setdefault(loop, []).append(fut)
        return fut

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the barrier completed (True) or `timeout` (s) passed (False)."""
        return self._event.wait(timeout)
