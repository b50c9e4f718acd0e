"""`batchd demo`'s plain-text report (`batchd.cli.print_demo`): what a run's summary shows a user."""

from __future__ import annotations

from batchd.cli import print_demo

SUMMARY = {
    "steps_per_rank": [12, 12],
    "idle": 0,
    "emitted": 113,
    "missing": 0,
    "duplicates": 0,
    "padding_efficiency": 0.91,
    "phases": 2,
    "vision_imbalance": 1.031,
    "clips": 14,
    "audio_imbalance": 1.12,
    "loss_first": 6.2,
    "loss_last": 5.1,
    "wall_s": 12.5,
}


def test_the_report_counts_the_clips_and_their_balance(capsys):
    print_demo(SUMMARY)
    out = capsys.readouterr().out
    assert "audio encoder       14 clips, each encoded once; slowest rank / mean, in frames: 1.120" in out
    assert "vision encoder      2-phase: slowest rank / mean, in encoder patches: 1.031" in out
    assert "samples             113 emitted, 0 missing, 0 duplicated" in out


def test_a_run_without_clips_has_no_audio_line(capsys):
    print_demo({**SUMMARY, "clips": 0, "audio_imbalance": None})
    assert "audio encoder" not in capsys.readouterr().out
