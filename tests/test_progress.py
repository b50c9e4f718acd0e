"""`batchd.proto.Progress`, the progress every long command shows: a line every interval off a terminal
(with the total, the rate and the ETA), a tqdm bar on one; driven by a fake clock, nothing sleeps."""

from __future__ import annotations

import io

import pytest

from batchd.proto import Progress, ProgressOutput, format_duration, progress_interval


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _every_5s(clock: _Clock) -> ProgressOutput:
    return ProgressOutput(io.StringIO(), interval_s=5, clock=clock)


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_one_line_per_interval_with_the_total_the_rate_and_the_eta():
    clock, lines = _Clock(), []
    out = ProgressOutput(io.StringIO(), interval_s=30, clock=clock)
    bar = Progress("rank 0", 1004, "samples", emit=lines.append, output=out)
    for _ in range(47):  # 47 steps in 165 s, ~11 samples each
        clock.t += 165 / 47
        bar.update(512 // 47, steps=1)
    assert len(lines) == 5  # one per 30 s, not one per step
    bar.update(512 - bar.n)
    clock.t += 30
    bar.update(0)  # 502 samples since the first 10 (at 3.5 s), 191.5 s ago: 2.62/s, 492 / 2.62 = 188 s left
    assert lines[-1] == "rank 0: 512/1004 samples (51%), 47 steps, 2.6 samples/s, ETA 3m08s"
    clock.t += 1
    bar.update(1004 - 512)
    bar.close()
    assert (
        lines[-1].startswith("rank 0: 1004/1004 samples (100%), 47 steps, ") and "done in 3m16s" in lines[-1]
    )
    assert len(lines) == 7


def test_short_work_off_a_terminal_prints_nothing_and_an_unknown_total_drops_the_eta():
    clock, lines = _Clock(), []
    with Progress("demo", 10, emit=lines.append, output=_every_5s(clock)) as bar:
        clock.t += 1
        bar.update(10, steps=2)
    assert lines == []
    with Progress("node", None, emit=lines.append, output=_every_5s(clock)) as bar:
        clock.t += 5
        bar.update(20, steps=1)  # the first samples: no rate yet (start-up is not the pace)
        clock.t += 5
        bar.update(20, steps=2)
    assert lines[:2] == ["node: 20 samples, 1 steps", "node: 40 samples, 3 steps, 4.0 samples/s"]
    assert lines[2:] == ["node: 40 samples, 3 steps, done in 10s"]
    with Progress("demo", 128, emit=lines.append, output=_every_5s(clock)) as bar:
        clock.t += 6
        bar.update(120, steps=20)  # 8 bad records never came: the end says so, without an ETA
    assert lines[-1] == "demo: 120/128 samples (94%), 20 steps, done in 6s"


def test_on_a_terminal_a_tqdm_bar_with_the_total_and_steps_beside_it():
    tty = _Tty()
    with Progress("bench batchd", 100, "samples", emit=pytest.fail, output=ProgressOutput(tty)) as bar:
        for _ in range(10):
            bar.update(10, steps=1)
    out = tty.getvalue()
    assert "bench batchd" in out and "100/100" in out and "10 steps" in out, out
    off = _Tty()
    with Progress("x", 10, enabled=False, output=ProgressOutput(off)) as bar:
        bar.update(10)
    assert off.getvalue() == ""


def test_the_interval_comes_from_the_environment_and_a_bad_one_is_named(monkeypatch):
    monkeypatch.delenv("BATCHD_PROGRESS_S", raising=False)
    assert progress_interval() == 30.0
    monkeypatch.setenv("BATCHD_PROGRESS_S", "1.5")
    assert (
        progress_interval() == 1.5
        and Progress("x", 1, output=ProgressOutput(io.StringIO())).interval_s == 1.5
    )
    for bad in ("0", "soon"):
        monkeypatch.setenv("BATCHD_PROGRESS_S", bad)
        with pytest.raises(ValueError, match="BATCHD_PROGRESS_S"):
            progress_interval()
    assert [format_duration(s) for s in (7, 160, 3900)] == ["7s", "2m40s", "1h05m"]
    with pytest.raises(ValueError, match=r"interval_s=0"):
        ProgressOutput(interval_s=0)
