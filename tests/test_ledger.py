"""`Ledger`: a RaySource's account of its pulled samples, without Ray."""

from __future__ import annotations

from batchd.core import Sample
from batchd.testing import Ledger

FLIGHT, READY, DONE = Ledger.FLIGHT, Ledger.READY, Ledger.DONE


def _sample(i: int) -> Sample:
    return Sample(i, 4, 4, 0, (("text", 4), ("vision", 0)), 0, ())


def test_ordered_mode_emits_in_pull_order_and_drops_resolved_entries():
    led = Ledger(0, set(), ordered=True)
    seqs = [led.add(i) for i in (10, 11, 12)]
    assert seqs == [0, 1, 2] and led.open == 3
    assert led.next_ready() is None  # nothing back yet
    led.mark_ready(1, _sample(11), "p11")
    assert led.next_ready() is None and led.peek_id() == 10  # seq 0 holds the head of the line
    led.mark_ready(0, _sample(10), "p10")
    assert led.next_ready() == 0 and led.ready_count() == 2
    led.resolve(0)
    led.advance()
    assert led.low == 1 and 0 not in led.entries and led.open == 2
    assert led.entries[1].status == READY and led.entries[2].status == FLIGHT


def test_completion_order_emits_the_smallest_ready_seq():
    led = Ledger(0, set(), ordered=False)
    for i in (10, 11, 12):
        led.add(i)
    led.mark_ready(2, _sample(12), None)
    led.mark_ready(1, _sample(11), None)
    assert led.peek_id() == 11
    assert led.next_ready() == 1
    led.resolve(1)
    assert led.next_ready() == 2
    led.resolve(2)
    assert led.next_ready() is None and led.peek_id() == 10


def test_a_resumed_ledger_skips_what_was_resolved_and_reports_it_again():
    led = Ledger(5, {6, 8}, ordered=True)
    assert led.add(50) == 5
    assert led.add(60) is None and led.entries[6].status == DONE  # resolved before the resume
    assert led.add(70) == 7 and led.open == 2
    assert led.resolved_ahead() == [1, 3]  # seq 6 (pulled again) and seq 8 (not pulled yet)
    led.resolve(5)
    assert led.resolved_ahead() == [1]  # low moved to 7 past the DONE seq 6; seq 8 is still ahead
    assert led.low == 7
