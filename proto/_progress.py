"""Progress of long work, shared by every party (trainer, node agent, demo, bench, simulate).

On a terminal (the stream's `isatty()`) a tqdm bar with the count, the total, the rate and the ETA,
redrawn at most twice a second; otherwise (a pipe, a log file, CI) one line every `interval_s`
(default $BATCHD_PROGRESS_S, else 30 s), to `emit` (default: the `batchd.progress` logger at INFO):

    rank 0: 512/1004 samples (51%), 47 steps, 3.1 samples/s, ETA 2m40s

The rate counts from the first unit done (start-up is not the work's pace); once the total is reached
only `close` emits, one `... done in T` line.
Steps are shown beside the samples, not as the measure: with dynamic batching the number of steps is
not known in advance, the number of samples is. `total=None` (not known) drops the percentage and the
ETA. `clock` is injectable (tests pass a fake one); nothing here sleeps or starts a thread: a line is
due only when `update` is called.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

PROGRESS_ENV = "BATCHD_PROGRESS_S"
DEFAULT_INTERVAL_S = 30.0

log = logging.getLogger("batchd.progress")


def progress_interval(default: float = DEFAULT_INTERVAL_S) -> float:
    """Seconds between two progress lines off a terminal: $BATCHD_PROGRESS_S, else `default`.

    Raises:
        ValueError: naming the variable when it is not a number > 0.
    """
    text = os.environ.get(PROGRESS_ENV, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"${PROGRESS_ENV} must be a number of seconds > 0, got {text!r}") from None
    if not value > 0:
        raise ValueError(f"${PROGRESS_ENV} must be a number of seconds > 0, got {text!r}")
    return value


def format_duration(seconds: float) -> str:
    """`2m40s`, `1h05m`, `7s`."""
    s = max(int(round(seconds)), 0)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


@dataclass(frozen=True)
class ProgressOutput:
    """Where and when `Progress` shows itself: `stream`, the terminal a bar is drawn on and whose
    `isatty()` picks the mode (None: stderr); `tty` False draws lines even on a terminal (a daemon in the
    background), None asks `stream.isatty()`; `interval_s`, seconds between two lines off a terminal
    (None: `progress_interval()`); `clock`, monotonic seconds (tests pass a fake clock).

    Raises:
        ValueError: naming `interval_s` when it is not > 0.
    """

    stream: TextIO | None = None
    tty: bool | None = None
    interval_s: float | None = None
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        interval_s = self.interval_s
        if interval_s is not None and not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s=}")


class Progress:
    """Counts `unit`s done out of `total` for `desc` (see the module docstring).

    Args:
        desc: What is counted, the line's prefix (e.g. "rank 0", "batchd run").
        total: Units of the whole work, or None when not known.
        unit: The counted unit's name (plural), e.g. "samples".
        emit: Where a line goes off a terminal (default: the `batchd.progress` logger, INFO).
        enabled: False: a no-op (e.g. under --json or --quiet).
        output: The stream, the mode, the interval between lines and the clock (`ProgressOutput`;
            default: stderr, a bar on a terminal, `progress_interval()`, `time.monotonic`).
    """

    def __init__(
        self,
        desc: str,
        total: int | None,
        unit: str = "samples",
        *,
        emit: Callable[[str], None] | None = None,
        enabled: bool = True,
        output: ProgressOutput | None = None,
    ) -> None:
        if total is not None and total < 0:
            raise ValueError(f"total must be >= 0 or None, got {total=}")
        output = ProgressOutput() if output is None else output
        if not isinstance(output, ProgressOutput):
            raise ValueError(f"output must be a ProgressOutput, got {output=!r}")
        stream, tty, clock = output.stream, output.tty, output.clock
        self.desc, self.total, self.unit = desc, total, unit
        self.interval_s = progress_interval() if output.interval_s is None else output.interval_s
        self.emit = emit or log.info
        self.clock = clock
        self.n = self.steps = 0
        self.t0 = self._last = clock()
        self._first: tuple[float, int] | None = (
            None  # (time, count) of the first work done: the rate's origin
        )
        self.enabled = enabled
        stream = stream or sys.stderr
        self._bar: Any = None
        if tty is None:
            tty = bool(getattr(stream, "isatty", lambda: False)())
        if enabled and tty:
            from tqdm import tqdm

            try:  # a terminal of unknown width (0 columns: some ptys) would get an empty bar
                sized = os.get_terminal_size(stream.fileno()).columns > 0
            except (AttributeError, OSError, ValueError):
                sized = False
            self._bar = tqdm(
                total=total,
                desc=desc,
                unit=f" {unit}",
                unit_scale=False,
                file=stream,
                mininterval=0.5,
                dynamic_ncols=sized,
                ncols=None if sized else 100,
                nrows=None if sized else 24,
                leave=True,
            )

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_total(self, total: int | None) -> None:
        """The total, once known (or corrected)."""
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def update(self, n: int = 1, steps: int = 0) -> None:
        """Adds `n` units (and `steps` steps) done; draws the bar, or emits a line when one is due."""
        self.n += n
        self.steps += steps
        if not self.enabled:
            return
        if self._first is None and self.n > 0:
            self._first = (self.clock(), self.n)  # start-up before the first unit is not the work's rate
        if self._bar is not None:
            if steps:
                self._bar.set_postfix_str(f"{self.steps} steps", refresh=False)
            self._bar.update(n)
            return
        now = self.clock()
        if now - self._last >= self.interval_s and (self.total is None or self.n < self.total):
            self._last = now  # (once the total is reached, only `close` says so)
            self.emit(self.line(now))

    def line(self, now: float | None = None, final: bool = False) -> str:
        """`desc: n/total unit (pct%), S steps, R unit/s, ETA T` (without what is not known); at the
        total, or `final`ly (work that ended short of its estimated total), `..., done in T`."""
        now = self.clock() if now is None else now
        elapsed = now - self.t0
        t1, n1 = self._first or (now, self.n)
        rate = (self.n - n1) / (now - t1) if now > t1 and self.n > n1 else None  # since the first unit
        parts = [
            f"{self.n}/{self.total} {self.unit}"
            + (f" ({100 * self.n / self.total:.0f}%)" if self.total else "")
            if self.total is not None
            else f"{self.n} {self.unit}"
        ]
        if self.steps:
            parts.append(f"{self.steps} steps")
        if final or (self.total is not None and self.n >= self.total):
            parts.append(f"done in {format_duration(elapsed)}")
            return f"{self.desc}: " + ", ".join(parts)
        if rate is not None:
            parts.append(f"{rate:.1f} {self.unit}/s")
        if self.total is not None:
            parts.append(f"ETA {format_duration((self.total - self.n) / rate)}" if rate else "ETA ?")
        return f"{self.desc}: " + ", ".join(parts)

    def close(self) -> None:
        """Ends the bar; off a terminal, emits a last line when the work took longer than one interval."""
        if not self.enabled:
            return
        self.enabled = False
        if self._bar is not None:
            self._bar.close()
        elif self.clock() - self.t0 >= self.interval_s:
            self.emit(self.line(final=True))
