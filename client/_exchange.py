"""The vision exchange of a two-phase step: image embeddings back from their encoders to their owners.

Under two-phase balancing (`batchd.core.plan_vision`) rank r encodes the images of its step's
`Exchange.encode` (ordered by owner rank, then by the owner's LLM image order), which need not be the
images of its own LLM samples. After the encoder every embedding row goes to its owner with one
`torch.distributed.all_to_all_single`; the owner then puts the received images back in its LLM order
(samples in batch order, images in sample order: the row-major order of the image-token positions of
its padded or packed batch). The batch carries what each rank needs for that, as int64 arrays
(`batchd.core.exchange_arrays`):

- ``vision_send_splits`` [N]: rows of this rank's encoder output for each destination rank;
- ``vision_recv_splits`` [N]: rows it receives from each source rank;
- ``vision_placement`` [I]: the LLM-order index of the j-th received image (received source by source);
- ``vision_image_tokens`` [I]: the rows (image tokens) of each of its LLM images, in LLM order.

`exchange_image_embeddings` is a `torch.autograd.Function`: forward = the all-to-all, then a gather of
rows into LLM order; backward = the inverse gather, then the all-to-all with the split sizes swapped,
so every encoder receives exactly the gradient of the rows it produced. Both directions are
collectives: every rank of the group must call it once per step (and run its backward), including a
rank with nothing to send or receive (zero-row tensors; gloo and NCCL accept them). Under DDP on the
same group the backward's all-to-all and DDP's bucket all-reduces interleave in the same order on every
rank (every rank runs the same graph; tests/test_exchange.py runs exactly that on gloo); a separate
`group` for the exchange avoids relying on it. It is a pure
permutation of rows across ranks, so values and gradients are moved bit for bit.

Imports torch and `batchd.core` only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from batchd.core import AUDIO_EXCHANGE_KEYS, EXCHANGE_KEYS

__all__ = ["exchange_audio_embeddings", "exchange_embeddings", "exchange_image_embeddings"]


def _ints(batch: Mapping[str, Any], key: str) -> list[int]:
    """batch[key] as a list of Python ints; ValueError unless it is a 1-D integer array of values >= 0."""
    value = batch[key]
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{key} must be an integer array, got {value.dtype=}")
        arr = value.detach().cpu().numpy()
    else:
        arr = np.asarray(value)
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{key} must be an integer array, got {arr.dtype=}")
    if arr.ndim != 1:
        raise ValueError(f"{key} must be 1-D, got {arr.shape=}")
    out = [int(v) for v in arr.tolist()]
    if any(v < 0 for v in out):
        raise ValueError(f"{key} must hold values >= 0, got {key}={out}")
    return out


def _world_size(group: Any, n: int) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    if n != 1:
        raise ValueError(
            f"an exchange over {n} ranks needs an initialized torch.distributed process group "
            f"(got none); world_size={n}"
        )
    return 1


def _plan(
    rows: int,
    send: list[int],
    recv: list[int],
    placement: list[int],
    image_tokens: list[int],
    keys: tuple[str, ...] = EXCHANGE_KEYS,
) -> tuple[np.ndarray, np.ndarray]:
    """Validates one rank's exchange arrays; returns int64 (gather, inverse): out = received[gather] puts
    the received rows in LLM order, received = out[inverse] undoes it. `keys` name the arrays in errors
    (an image of the vision phase or a clip of the audio phase: an "item")."""
    ks, kr, kp, kt = keys
    if rows != sum(send):
        raise ValueError(f"encoded must have sum({ks}) rows, got encoded rows={rows} {ks}={send}")
    n_images = len(image_tokens)
    if len(placement) != n_images or sorted(placement) != list(range(n_images)):
        raise ValueError(
            f"{kp} must be a permutation of range({n_images}) (one entry per LLM item), got {kp}={placement}"
        )
    if any(t < 1 for t in image_tokens):
        raise ValueError(f"every item has >= 1 token, got {kt}={image_tokens}")
    if sum(recv) != sum(image_tokens):
        raise ValueError(f"sum({kr}) must equal sum({kt}), got {kr}={recv} {kt}={image_tokens}")
    llm_start = np.concatenate(([0], np.cumsum(image_tokens, dtype=np.int64)))
    # the received images, source by source, must fill each source's rows exactly
    bounds = set(np.cumsum(recv, dtype=np.int64).tolist())
    received_end = np.cumsum([image_tokens[i] for i in placement], dtype=np.int64).tolist()
    stray = sorted(b for b in bounds if b and b not in set(received_end))
    if stray:
        raise ValueError(
            f"{kr}={recv} cut a received item in two (row boundaries {stray} fall inside an item; "
            f"received item tokens in order: {[image_tokens[i] for i in placement]})"
        )
    # received row r_j + k (image j from the sources, LLM image placement[j]) is
    # LLM row start[placement[j]] + k
    sizes = np.asarray([image_tokens[i] for i in placement], dtype=np.int64)
    received_start = np.concatenate(([0], np.cumsum(sizes)))[:-1]
    shift = (
        llm_start[np.asarray(placement, dtype=np.int64)] - received_start
        if placement
        else np.zeros(0, np.int64)
    )
    inverse = np.repeat(shift, sizes) + np.arange(int(sizes.sum()), dtype=np.int64)
    gather = np.empty_like(inverse)
    gather[inverse] = np.arange(inverse.shape[0], dtype=np.int64)
    return gather, inverse


def _all_to_all(
    x: torch.Tensor, out_rows: int, out_splits: list[int], in_splits: list[int], group: Any, world: int
) -> torch.Tensor:
    x = x.contiguous()
    if world == 1:
        return x.clone()
    out = x.new_empty((out_rows, *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)
    return out


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        encoded: torch.Tensor,
        send: list[int],
        recv: list[int],
        gather: torch.Tensor,
        inverse: torch.Tensor,
        group: Any,
        world: int,
    ) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.world = send, recv, group, world
        ctx.save_for_backward(inverse)
        received = _all_to_all(encoded, sum(recv), recv, send, group, world)
        return received.index_select(0, gather)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None, None]:
        (inverse,) = ctx.saved_tensors
        back = grad.index_select(0, inverse)  # rows in received order again
        grad_encoded = _all_to_all(back, sum(ctx.send), ctx.send, ctx.recv, ctx.group, ctx.world)
        return grad_encoded, None, None, None, None, None, None


def exchange_embeddings(
    encoded: torch.Tensor, batch: Mapping[str, Any], group: Any = None, keys: tuple[str, ...] = EXCHANGE_KEYS
) -> torch.Tensor:
    """Sends this rank's encoder output to the images' owners; returns its own images' embeddings.

    A collective over `group`: every rank calls it once per step with its own batch, and its backward
    (the inverse exchange) runs as part of every rank's backward, even where a rank sends and receives
    nothing.

    Args:
        encoded: [rows, H], the embeddings of the images this rank encoded, in its ``Exchange.encode``
            order (rows = image tokens, after the encoder's merger/projector). Any device the group's
            backend supports (gloo: CPU; NCCL: CUDA); the result is on the same device and dtype.
        batch: The step's batch, carrying `batchd.core.EXCHANGE_KEYS` (numpy arrays or torch tensors).
            Without ``vision_send_splits`` (a single-phase job: every rank encodes its own images, in
            LLM order) `encoded` is returned unchanged and nothing is communicated.
        group: The process group (None = the default group); its size must be len(vision_send_splits).

    Returns:
        [sum(vision_image_tokens), H]: this rank's LLM images' embedding rows, in LLM order (the row-major
        order of its batch's image-token positions).

    Raises:
        ValueError: on a non-2-D `encoded`, missing or malformed exchange arrays, split sizes that do not
            match the group size, the encoded rows or each other, or an uninitialized process group with
            more than one rank. The arrays are checked before any communication, so a malformed batch
            raises on its own rank only (the others then wait in the collective until the group's timeout).

    Any encoder phase: `keys` names the phase's four arrays (`batchd.core.EXCHANGE_KEYS` for the vision
    phase, the default; `batchd.core.AUDIO_EXCHANGE_KEYS` for the audio clips), `exchange_image_embeddings`
    and `exchange_audio_embeddings` are this function with either.
    """
    ks, kr = keys[0], keys[1]
    if ks not in batch:
        return encoded
    missing = [k for k in keys if k not in batch]
    if missing:
        raise ValueError(f"the batch has {ks} but lacks {missing=}")
    if not isinstance(encoded, torch.Tensor) or encoded.ndim != 2:
        raise ValueError(
            f"encoded must be a [rows, H] tensor, got "
            f"shape={tuple(getattr(encoded, 'shape', ()))} type={type(encoded).__name__}"
        )
    send, recv, placement, image_tokens = (_ints(batch, k) for k in keys)
    if len(send) != len(recv):
        raise ValueError(f"{ks} and {kr} need one entry per rank, got {ks}={send} {kr}={recv}")
    world = _world_size(group, len(send))
    if len(send) != world:
        raise ValueError(
            f"the exchange arrays are for {len(send)} ranks but the group has world_size={world}"
        )
    gather, inverse = _plan(encoded.shape[0], send, recv, placement, image_tokens, keys)
    gather_t, inverse_t = (torch.from_numpy(ix).to(encoded.device) for ix in (gather, inverse))
    # torch's autograd.Function.apply is declared without types.
    out: torch.Tensor = _Exchange.apply(  # type: ignore[no-untyped-call]
        encoded, send, recv, gather_t, inverse_t, group, world
    )
    return out


def exchange_image_embeddings(
    encoded: torch.Tensor, batch: Mapping[str, Any], group: Any = None
) -> torch.Tensor:
    """`exchange_embeddings` of the vision phase: image embeddings back to their owners (`EXCHANGE_KEYS`)."""
    return exchange_embeddings(encoded, batch, group, EXCHANGE_KEYS)


def exchange_audio_embeddings(
    encoded: torch.Tensor, batch: Mapping[str, Any], group: Any = None
) -> torch.Tensor:
    """`exchange_embeddings` of the audio phase: audio-clip embeddings back to the ranks whose LLM samples
    hold them (`AUDIO_EXCHANGE_KEYS`); without ``audio_send_splits`` in the batch `encoded` unchanged."""
    return exchange_embeddings(encoded, batch, group, AUDIO_EXCHANGE_KEYS)
