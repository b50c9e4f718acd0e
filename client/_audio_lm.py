"""Stock Hugging Face Qwen2-Audio on batchd batches: the audio phase of `batchd.client.two_phase`.

``two_phase(model)`` adapts a ``Qwen2AudioForConditionalGeneration`` (``config.model_type`` in
`AUDIO_FAMILIES`) in place through `AudioAdapter` (its ``forward`` only; parameters, state dict,
``save_pretrained`` and ``generate`` stay the model's own), so that it trains on every batchd step:

* **Two-phase audio** (the batch carries ``audio_send_splits``, `batchd.core.AUDIO_EXCHANGE_KEYS`): the
  model's own audio tower (``audio_tower``, then ``multi_modal_projector``) encodes the clips the audio plan
  gave this rank (the batch's ``audio_features`` [sum of frames, mel bins] / ``audio_frames`` [clips],
  `batchd.core.AUDIO_KEYS`, are those clips, in ``Exchange.encode`` order, possibly other ranks' clips),
  `batchd.client.exchange_audio_embeddings` sends every clip-token row to the rank whose LLM sample holds
  the clip and returns this rank's own clips in LLM order, and they are written at the audio-token positions
  (``config.audio_token_id``) of the input embeddings, as the stock forward's ``masked_scatter`` does; the
  LLM then runs on ``inputs_embeds``.
* **One-phase** (no audio exchange arrays): the same path without the exchange; the rank encodes its own
  clips, already in LLM order. The result equals the stock forward on the same clips (padded as below).
* **Padded or packed rows**: a packed row (``position_ids`` restarting at 0 per sample, no
  ``attention_mask``) keeps its samples apart only on an attention implementation of
  `batchd.client.PACKED_ATTENTION` (the Qwen2 LM derives one causal block per sample from the positions);
  any other is refused with a ValueError before the forward.
* **Every audio parameter in every step's graph**: one element of each trainable tower / projector parameter
  enters the logits times 0.0, so a step without clips (or a rank that encodes none, and does not run the
  tower) still gives each a (zero) gradient: DDP needs no ``find_unused_parameters``. The logits are
  unchanged bit for bit. What is trainable is read at every step: a tower and projector frozen (before or
  after ``two_phase``) get no gradient, and then no rank runs the exchange's backward.

The batch's audio tokens must be expanded already (one ``<|AUDIO|>`` token per clip token, clip tokens =
``((frames - 1) // 2 + 1 - 2) // 2 + 1``, as batchd's ``Qwen2Audio`` preprocessing stage and the stock
processor write them); a row count that does not match raises ValueError (before any communication on a
two-phase step).

**The fixed 30 s window.** The stock ``Qwen2AudioEncoder`` takes only input features of exactly
`audio_window` frames (``max_source_positions`` x its two convolution strides: 3,000 frames = 30 s for the
released config) and adds all of its position embeddings. batchd's clips are not padded (``frames`` log-mel
frames each), so the adapter pads every clip to the window with Whisper's silence (`whisper_silence`: the
value the stock ``WhisperFeatureExtractor`` gives the zero samples it pads a clip with), masks the padded
positions out of the encoder's attention (``feature_attention_mask`` as the stock forward builds it) and
keeps each clip's first ``clip tokens`` output rows. A clip's embedding depends on that clip alone, never on
which rank encodes it or beside which clips, so the exchanged step equals the stock model's on the same
padded features. (The padding is not masked everywhere: the convolutions read up to 3 frames past a clip's
end. The stock processor's padded features hold Whisper's silence from about 2 frames past the end on; the
frame or two straddling the end carry the clip's last samples there, and are not in batchd's trimmed
features, so a clip's last token can differ slightly from the processor-and-model pipeline's.) The price:
**every clip costs the tower a full window**, a 1 s clip as much as a 30 s one, so the tower's real cost
is per clip, not per frame as ``AudioCost`` models it; the plan still spreads clips over the ranks, but its
frame-based balance is not the tower's. A clip longer than the window raises ValueError.

Calling it: as the vision families (`batchd.client.forward_logits`, ``model(batch)``, ``model(**kwargs)``).
A call with a cache, ``use_cache=True``, ``inputs_embeds`` or the model's own padded ``input_features``
(the HF way) goes to the model's own forward unchanged. The exchange is a collective over `group`: every
rank calls the forward, and the backward, of every step.

Imports torch and `batchd.core` only; transformers only through the model it is given (and its mask
helper, imported when a clip is encoded).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from batchd.core import AUDIO_EXCHANGE_KEYS, AUDIO_KEYS

from ._exchange import exchange_audio_embeddings
from ._stock import as_tensor, batchd_kwargs

__all__ = ["AUDIO_FAMILIES", "AudioAdapter", "audio_window", "whisper_silence"]

AUDIO_FAMILIES = ("qwen2_audio",)
"""config.model_type of the audio models `two_phase` adapts (``Qwen2AudioForConditionalGeneration``)."""

_BATCHD_KEYS = (*AUDIO_EXCHANGE_KEYS, *AUDIO_KEYS)
_GENERATION = ("cache", "past_key_values", "inputs_embeds", "input_features")


def whisper_silence(clip: torch.Tensor) -> torch.Tensor:
    """The feature value of silence appended to `clip` [frames, mel bins] (Whisper-normalized log-mel), a
    0-d tensor: ``max(clip.max() - 2, -1.5)``. Whisper's extractor floors log10 mel power at max - 8 (or
    -10, log10 of its 1e-10 floor, when higher) and scales by (x + 4) / 4, so a zero sample's frame is
    (max_log - 4) / 4 = clip.max() - 2. Depends on the clip alone; no gradient."""
    if clip.numel() == 0:
        raise ValueError("a clip has >= 1 frame")
    return torch.clamp(clip.detach().max() - 2.0, min=-1.5)


def audio_window(tower: Any) -> int:
    """The frames the stock encoder `tower` takes per clip: ``max_source_positions`` x both conv strides."""
    return int(tower.config.max_source_positions * tower.conv1.stride[0] * tower.conv2.stride[0])


def _counts(frames: Any) -> list[int]:
    counts = [int(f) for f in as_tensor(frames, "audio_frames", torch.device("cpu")).reshape(-1).tolist()]
    if any(f < 1 for f in counts):
        raise ValueError(f"every clip has >= 1 frame, got audio_frames={counts}")
    return counts


class AudioAdapter:
    """The state `two_phase` keeps on a Qwen2-Audio model: its own forward, its tower and the exchange group.

    Args:
        model: A ``Qwen2AudioForConditionalGeneration`` (``.model.audio_tower``, ``.multi_modal_projector``).
        group: The process group of the audio exchange (None = the default group).
        check_packed: Raises ValueError for a model whose attention would cross a packed row's samples
            (`batchd.client.check_packed_attention`).

    Raises:
        ValueError: for another model type, or a model without its LM head and audio tower.
    """

    foreign_keys = ("pixel_values", "pixel_values_videos", "vision_send_splits")
    """Batch keys this adapter does not consume (`check_model_batch` refuses a batch carrying them)."""

    def __init__(self, model: torch.nn.Module, group: Any, check_packed: Callable[[Any], None]) -> None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in AUDIO_FAMILIES:
            raise ValueError(f"AudioAdapter adapts {list(AUDIO_FAMILIES)}, got {model_type=}")
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "audio_tower") or not hasattr(inner, "multi_modal_projector"):
            raise ValueError(
                f"two_phase needs the model with its LM head (Qwen2AudioForConditionalGeneration), got "
                f"{type(model).__name__} without .model.audio_tower / .model.multi_modal_projector"
            )
        self.inner = inner
        self.token_id = int(inner.config.audio_token_id)
        towers = (inner.audio_tower, inner.multi_modal_projector)
        self.audio_params = [p for m in towers for p in m.parameters()]
        self.forward = model.forward  # the model's own (bound) forward
        self.group = group
        self.check_packed = check_packed

    # -- the audio phase ----------------------------------------------------------------------------
    def pad(self, feats: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Clips [sum of frames, mel bins] -> (input_features [clips, mel bins, window], feature lengths
        [clips]): each clip padded to `audio_window` frames with its `whisper_silence`."""
        tower = self.inner.audio_tower
        window, mels = audio_window(tower), int(tower.config.num_mel_bins)
        if feats.ndim != 2 or feats.shape[1] != mels or feats.shape[0] != sum(counts):
            raise ValueError(
                f"audio_features must be [sum of audio_frames = {sum(counts)}, num_mel_bins = {mels}], "
                f"got {tuple(feats.shape)}"
            )
        if max(counts) > window:
            raise ValueError(
                f"the stock Qwen2-Audio encoder takes clips of at most {window} frames (its fixed window), "
                f"got audio_frames={counts}: split longer clips"
            )
        out = feats.new_empty((len(counts), mels, window))
        for k, clip in enumerate(torch.split(feats, counts)):
            out[k].fill_(whisper_silence(clip))
            out[k, :, : clip.shape[0]] = clip.T
        return out, torch.as_tensor(counts, dtype=torch.long, device=feats.device)

    def encode(self, feats: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The clips' embeddings [sum of clip tokens, hidden], clip by clip: the stock forward's tower call
        (its encoder attention mask from the feature lengths), projector and per-clip row selection."""
        from transformers.masking_utils import create_bidirectional_mask

        tower, embed = self.inner.audio_tower, self.inner.get_input_embeddings().weight
        features, lengths = self.pad(feats, counts)
        feat_lengths, out_lengths = tower._get_feat_extract_output_lengths(lengths)
        positions = (features.shape[-1] - 2) // 2 + 1
        mask = (torch.arange(positions, device=lengths.device)[None, :] < feat_lengths[:, None]).long()
        dummy = embed.new_zeros((len(counts), positions, 1))
        attention = create_bidirectional_mask(config=tower.config, inputs_embeds=dummy, attention_mask=mask)
        hidden = tower(features, attention_mask=attention).last_hidden_state
        projected = self.inner.multi_modal_projector(hidden)  # [clips, window tokens, hidden]
        keep = torch.arange(projected.shape[1], device=projected.device)[None, :] < out_lengths[:, None]
        rows: torch.Tensor = projected[keep.to(projected.device)]
        return rows

    def audio(
        self, feats: Any, frames: Any, exchange: Mapping[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(this rank's LLM clip rows in LLM order, a zero scalar that puts every trainable audio parameter
        in the graph, None where none is trainable)."""
        if (feats is None) != (frames is None):
            raise ValueError(
                f"audio_features and audio_frames come together, got {feats is None=} {frames is None=}"
            )
        embed = self.inner.get_input_embeddings().weight
        params = [p for p in self.audio_params if p.requires_grad]  # as frozen now, not at adaptation
        trains = bool(params)  # False: a frozen tower and projector
        anchor = torch.stack([p.reshape(-1)[0] for p in params]).sum() * 0.0 if trains else None
        counts = [] if frames is None else _counts(frames)
        if not counts:  # nothing to encode: zero rows, the tower is not run
            # rows that require grad where the other ranks' encoder output does, so the exchange's backward
            # (a collective) runs on every rank or on none
            encoded = embed.new_zeros((0, embed.shape[1])).requires_grad_(torch.is_grad_enabled() and trains)
        else:
            tower = self.inner.audio_tower.conv1.weight.device  # the stock forward encodes there too
            encoded = self.encode(as_tensor(feats, "audio_features", tower).to(embed.dtype), counts)
        return exchange_audio_embeddings(encoded, exchange, self.group), anchor

    # -- the forward --------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        step, stock = batchd_kwargs(self.forward, args, kwargs, _GENERATION, _BATCHD_KEYS)
        if step is None:
            return stock
        kwargs = step
        device = self.inner.get_input_embeddings().weight.device
        input_ids = as_tensor(kwargs.pop("input_ids"), "input_ids", device)
        exchange = {k: kwargs.pop(k) for k in AUDIO_EXCHANGE_KEYS if k in kwargs}
        at = input_ids == self.token_id
        tokens = exchange.get(AUDIO_EXCHANGE_KEYS[3])  # checked before the collective
        if exchange.get(AUDIO_EXCHANGE_KEYS[0]) is not None and tokens is not None:
            rows = int(as_tensor(tokens, AUDIO_EXCHANGE_KEYS[3], torch.device("cpu")).sum())
            if rows != int(at.sum()):
                raise ValueError(
                    f"the batch has {int(at.sum())} audio-token positions (audio_token_id={self.token_id}) "
                    f"but its clips have sum({AUDIO_EXCHANGE_KEYS[3]}) = {rows} tokens"
                )
        if kwargs.get("attention_mask") is None and kwargs.get("position_ids") is not None:
            self.check_packed(self.inner)  # a packed row
        own, anchor = self.audio(
            kwargs.pop("audio_features", None), kwargs.pop("audio_frames", None), exchange
        )
        if own.shape[0] != int(at.sum()):
            raise ValueError(
                f"the batch has {int(at.sum())} audio-token positions (audio_token_id={self.token_id}) but "
                f"{own.shape[0]} audio embedding rows: expand each clip's audio token to its clip tokens"
            )
        embeds = self.inner.get_input_embeddings()(input_ids)
        embeds = embeds.masked_scatter(at.unsqueeze(-1), own.to(embeds.device, embeds.dtype))
        out = self.forward(inputs_embeds=embeds, **kwargs)
        if anchor is not None:
            out["logits"] = out["logits"] + anchor.to(out["logits"].dtype)
        return out
