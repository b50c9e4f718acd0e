"""A dependency-free progress bar for long CLI work (`batchd simulate`, `batchd bench`).

On a terminal it redraws one line (`\\r`) at most 5 times a second with the count, the percentage, the
rate and the remaining time; on a pipe or file (CI logs) it prints a full line at most every 10% or 10 s,
and only once the work has run 2 s, so logs stay short. Disabled (a no-op) with `enabled=False`, e.g.
under `--json` or `--quiet`.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Counts work done out of `total` units named `unit`."""

    def __init__(self, total: int, desc: str, unit: str = "it", enabled: bool = True,
                 stream: TextIO | None = None) -> None:
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total=}")
        self.total, self.desc, self.unit = total, desc, unit
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.n = 0
        self.t0 = self._last = time.monotonic()
        self._last_frac = 0.0

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _line(self) -> str:
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        rate = self.n / elapsed
        frac = self.n / self.total if self.total else 1.0
        eta = (self.total - self.n) / rate if rate > 0 and self.total else 0.0
        return (f"{self.desc}: {100 * frac:5.1f}% {self.n}/{self.total} {self.unit} "
                f"[{elapsed:.1f}s, {rate:,.0f} {self.unit}/s, eta {eta:.0f}s]")

    def update(self, n: int = 1) -> None:
        self.n += n
        if not self.enabled:
            return
        now = time.monotonic()
        frac = self.n / self.total if self.total else 1.0
        if self.tty:
            if now - self._last >= 0.2:
                self.stream.write("\r" + self._line())
                self.stream.flush()
                self._last = now
        elif now - self.t0 >= 2.0 and (frac - self._last_frac >= 0.1 or now - self._last >= 10.0):
            self.stream.write(self._line() + "\n")
            self.stream.flush()
            self._last, self._last_frac = now, frac

    def close(self) -> None:
        if self.enabled and (self.tty or self._last_frac > 0 or time.monotonic() - self.t0 >= 2.0):
            self.stream.write(("\r" if self.tty else "") + self._line() + "\n")
            self.stream.flush()
        self.enabled = False
