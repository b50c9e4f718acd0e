"""Token-level loss scaling across ranks that hold different numbers of tokens.

Each rank r computes its mean loss over its own loss-bearing tokens, m_r = S_r / t_r. Plain DDP
averages gradients, i.e. optimizes (1/N) sum_r m_r, which over-weights tokens on ranks with few tokens
(a rank with one short sample counts as much as a rank with 60). The per-token reference loss over the
whole step is S / T_tok with S = sum_r S_r and T_tok = sum_r t_r. Weighting each rank's mean by
w_r = t_r / T_tok recovers it; DDP then divides the summed gradients by N, so the factor a rank applies
is N * t_r / T_tok:

    (1/N) * sum_r (N * t_r / T_tok) * (S_r / t_r) = S / T_tok.

An IDLE rank has t_r = 0 and scale 0: its zero-weight backward contributes nothing but still joins the
all-reduce. Under FSDP/DeepSpeed (which also average over ranks) the same factor applies; under a SUM
reduction drop the N.
"""

from __future__ import annotations

from ._types import check_int


def loss_scale(local_tokens: int, global_tokens: int, world_size: int) -> float:
    """The factor for a rank's per-token mean loss: world_size * local_tokens / global_tokens.

    Args:
        local_tokens: Loss-bearing tokens on this rank this step (0 for IDLE).
        global_tokens: Loss-bearing tokens over all ranks this step.
        world_size: Ranks whose gradients DDP averages.
    """
    check_int("local_tokens", local_tokens, lo=0)
    check_int("global_tokens", global_tokens, lo=local_tokens)
    check_int("world_size", world_size, lo=1)
    if global_tokens == 0:
        return 0.0
    return world_size * local_tokens / global_tokens
