"""Node agents whose stream broke: a process that died is noticed at once, not at its lease.

A node agent holds one `Node` stream to the coordinator. When its process dies (kill -9, a reboot, an
OOM kill) the stream breaks at once; a silent hang keeps it open and only the lease (`lease_s`) notices.
On a break (`broke`), the coordinator logs it at once, naming the agent and its ranks. What follows
depends on whether the agent can come back:
- it journals (`state_dir`): started again with the same command it resumes the job, so the job waits
  for it as long as its lease (the lease watchdog fails the job after that);
- it keeps no journal: a restart cannot resume its ranks, so unless the same agent reconnects within
  `RECONNECT_S` (a network blip that broke the stream of a live agent) the job fails, naming it.
`back` forgets the break once the agent said hello again; `check` is called by the watchdog's tick.
"""

from __future__ import annotations

import logging

log = logging.getLogger("batchd.coordinator")

RECONNECT_S = 10.0  # a live agent whose stream broke reconnects within this


class BrokenStreams:
    """The node agents whose stream broke and that have not said hello again (see module docstring)."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._broken: dict[str, tuple[float, list[int], bool]] = {}  # name -> (since, ranks, journaled)

    def broke(self, name: str, ranks: list[int], journaled: bool, now: float) -> None:
        self._broken[name] = (now, ranks, journaled)
        what = (
            f"the job waits up to its lease ({self.lease_s:g}s) for it to come back: started again with "
            "the same command, it resumes from its journal"
            if journaled
            else f"it keeps no journal (no state_dir), so unless it reconnects within {RECONNECT_S:g}s "
            "the job fails"
        )
        log.warning("node agent %r (rank(s) %s): its stream broke (process gone?); %s", name, ranks, what)

    def back(self, name: str) -> None:
        self._broken.pop(name, None)

    def check(self, now: float) -> str | None:
        """The failure at `now`: an agent without a journal that did not come back; else None."""
        for name, (since, ranks, journaled) in self._broken.items():
            if not journaled and now - since > min(RECONNECT_S, self.lease_s):
                return (
                    f"node agent {name!r} (rank(s) {ranks}) went away: its stream broke and it did not "
                    f"reconnect within {min(RECONNECT_S, self.lease_s):g}s; it keeps no journal (no "
                    "state_dir), so a restart cannot resume its ranks"
                )
        return None
