"""A timed stand-in model for `batchd calibrate`'s tests: its step costs known seconds.

Its forward sleeps OVERHEAD + LINEAR x T + QUADRATIC x Q (T tokens materialized, Q attention pairs, as
`batchd.core.batch_terms` counts them: padded rows x longest and rows x longest^2; packed the sum of the
documents' lengths and of their squares, the documents read from ``cu_seqlens``), then returns the logits
of a tiny embedding and head, so the backward and the optimizer step are real and cheap.
"""

from __future__ import annotations

import time

import torch

OVERHEAD = 0.02  # seconds
LINEAR = 20e-6  # seconds per token
Q = 512  # the length at which a sample's quadratic term equals its linear one
QUADRATIC = LINEAR / Q  # seconds per attention pair
VOCAB = 64
SLEEP = True  # False: the same model without its sleeps (what the framework's own step costs)


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
        if SLEEP:
            time.sleep(OVERHEAD + LINEAR * t + QUADRATIC * q)
        return self.head(self.embed(input_ids))


def make(device: torch.device) -> torch.nn.Module:
    return StandIn().to(device)
