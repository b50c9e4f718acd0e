"""A timed stand-in model for `batchd calibrate`'s tests: its step costs known seconds.

Its forward waits (awake) OVERHEAD + LINEAR x T + QUADRATIC x Q (T tokens materialized, Q attention pairs, as
`batchd.core.batch_terms` counts them: padded rows x longest and rows x longest^2; packed the sum of the
documents' lengths and of their squares, the documents read from ``cu_seqlens``), then returns the logits
of a tiny embedding and head, so the backward and the optimizer step are real and cheap.
"""

from __future__ import annotations

import time

import torch

OVERHEAD = 0.04  # seconds
LINEAR = 40e-6  # seconds per token
Q = 512  # the length at which a sample's quadratic term equals its linear one
QUADRATIC = LINEAR / Q  # seconds per attention pair
VOCAB = 64
SLEEP = True  # False: the baseline, whose forward waits FLOOR only: what the step costs beside the terms
FLOOR = 0.001


def _spin(seconds: float) -> None:
    """Waits `seconds` on the wall clock, awake: a sleep's wake-up comes late by a varying few ms on a busy
    machine, a spin's end by at most a time slice, and only when it is preempted right then."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class StandIn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.embed

    def forward(self, input_ids, attention_mask=None, position_ids=None, cu_seqlens=None):
        if cu_seqlens is not None:
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
            t, q = sum(lengths), sum(n * n for n in lengths)
        else:
            rows, longest = input_ids.shape
            t, q = rows * longest, rows * longest * longest
        _spin(OVERHEAD + LINEAR * t + QUADRATIC * q if SLEEP else FLOOR)
        return self.head(self.embed(input_ids))


def make(device: torch.device) -> torch.nn.Module:
    return StandIn().to(device)
