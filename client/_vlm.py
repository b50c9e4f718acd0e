"""Stock Hugging Face multimodal models on batchd batches: `two_phase(model)`, without forking the model.

``batchd.two_phase(model)`` adapts a ``Qwen2VLForConditionalGeneration``,
``Qwen2_5_VLForConditionalGeneration`` or ``LlavaForConditionalGeneration`` in place (its ``forward``
only; parameters, state dict, ``save_pretrained`` and ``generate`` stay the model's own) so that it
trains on every kind of batchd step:

* **Two-phase** (the batch carries ``vision_send_splits``): the model's own vision tower
  (``get_image_features``: the ViT and its merger / projector) encodes the images the vision plan gave this
  rank (``pixel_values`` / ``image_grid_thw`` of the batch are those images, in ``Exchange.encode`` order),
  `batchd.client.exchange_image_embeddings` sends every embedding row to the rank whose LLM sample holds the
  image and returns this rank's own images in LLM order, and the model consumes them through its stock
  ``mm_encoder_outputs`` argument (its own placeholder check and scatter). Qwen2-VL's M-RoPE positions come
  from the LLM samples' own grids, ``llm_image_grid_thw`` (the rank service adds it to two-phase batches),
  never from the grids of the images this rank happened to encode.
* **One-phase** (no exchange arrays): the same path with the exchange left out: the rank encodes its own
  images, already in LLM order. The result equals the stock forward on the same inputs.
* **Packed rows** (``position_ids`` restarting at 0 per sample, no ``attention_mask``: the padding-free layout
  of `batchd.core.collate_packed`): the model derives one causal block per sample from the restarting
  positions. For Qwen2-VL the adapter computes each sample's own M-RoPE positions (``get_rope_index`` on the
  samples as a padded batch, then packed back) and prepends the restarting text positions, the
  ``[4, 1, S]`` layout the model accepts for packed input. Attention stays inside each sample only on
  `PACKED_ATTENTION` (eager, sdpa, flex and flash attention); any other implementation (``paged|eager``,
  a kernel from the Hub) is refused with a ValueError before the forward, never run silently across samples.
* **Every parameter in every step's graph**: one element of each vision parameter (the tower, its merger or
  projector) enters the logits times 0.0, so a step without images (an image-free step, an IDLE step's
  1-token dummy, a rank that encodes nothing) and LLaVA's layers past its feature layer, which the stock
  forward never uses, still get a (zero) gradient: DDP's all-reduce needs no ``find_unused_parameters`` and
  the graph is the same on every step. The logits are unchanged bit for bit (x + 0.0 = x); the cost is one
  indexing op per vision parameter. A rank with nothing to encode does not run the tower.

**Audio** (``Qwen2AudioForConditionalGeneration``, `AUDIO_FAMILIES`): the same adaptation of its audio phase
(its audio tower encodes the clips the audio plan gave this rank, `exchange_audio_embeddings` returns them to
their owners, written at the audio tokens; each clip padded to the stock encoder's fixed 30 s window, so
every clip costs the tower the same), `batchd.client._audio_lm.AudioAdapter`.

Calling it. `batchd.client.forward_logits(model, batch)`, `train_step`, `BatchdTrainer` and `batchd_backward`
pass the whole batch (the adapted model has ``takes_batch = True``); ``model(batch)`` takes a batchd batch
(labels, sample ids and packing boundaries are dropped), ``model(**hf_kwargs)`` the model's own keyword
arguments plus the batchd keys above. A call with a cache, ``use_cache=True`` or ``inputs_embeds``
(generation) goes to the model's own forward unchanged. The exchange is a collective over `group`:
every rank calls the forward, and the backward, of every step.

Imports torch and `batchd.core` only; transformers only through the model it is given.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ._audio_lm import AUDIO_FAMILIES, AudioAdapter
from ._exchange import exchange_image_embeddings
from ._stock import as_tensor, batchd_kwargs

__all__ = [
    "AUDIO_FAMILIES",
    "PACKED_ATTENTION",
    "VLM_FAMILIES",
    "check_model_batch",
    "check_packed_attention",
    "is_two_phase",
    "two_phase",
]

PACKED_ATTENTION = (
    "eager",
    "sdpa",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
)
"""Attention implementations that keep packed samples apart (tested: eager and sdpa on CPU, packed loss = the
sum of the samples' unpacked losses; transformers gives flex and flash the same per-sample blocks from the
positions, untested here: flex has no CPU backward, flash needs a GPU)."""

_BATCHD_KEYS = (
    "vision_send_splits",
    "vision_recv_splits",
    "vision_placement",
    "vision_image_tokens",
    "llm_image_grid_thw",
)
_GENERATION = ("cache", "past_key_values", "inputs_embeds")
_ADAPTED = "_batchd_two_phase"


# ---------------------------------------------------------------------------------------------------
# Families: how a model's vision tower is called, and whether it uses M-RoPE
# ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Family:
    mrope: bool  # Qwen2-VL style 3-D positions from the image grids
    grids: bool  # pixel_values are patch rows split by image_grid_thw (else one [3, S, S] image per row)


def _qwen_encode(inner: Any, pixels: torch.Tensor, grid: torch.Tensor | None) -> torch.Tensor:
    if grid is None:
        raise ValueError(f"a Qwen2-VL family model needs image_grid_thw with its pixels, got {grid=}")
    out = inner.get_image_features(pixels, grid, return_dict=True)
    return torch.cat(tuple(out.pooler_output), dim=0)


def _llava_encode(inner: Any, pixels: torch.Tensor, grid: torch.Tensor | None) -> torch.Tensor:
    cfg = inner.config
    out = inner.get_image_features(
        pixel_values=pixels,
        vision_feature_layer=cfg.vision_feature_layer,
        vision_feature_select_strategy=cfg.vision_feature_select_strategy,
        return_dict=True,
    )
    feats = out.pooler_output
    if isinstance(feats, torch.Tensor):
        return feats.reshape(-1, feats.shape[-1])
    return torch.cat([f.reshape(-1, f.shape[-1]) for f in feats], dim=0)


_QWEN = _Family(mrope=True, grids=True)
_LLAVA = _Family(mrope=False, grids=False)
VLM_FAMILIES: dict[str, tuple[_Family, Callable[[Any, torch.Tensor, torch.Tensor | None], torch.Tensor]]] = {
    "qwen2_vl": (_QWEN, _qwen_encode),
    "qwen2_5_vl": (_QWEN, _qwen_encode),
    "llava": (_LLAVA, _llava_encode),
}
"""config.model_type -> (family, encode) of the models `two_phase` adapts."""


def _attn_implementation(model: Any) -> str | None:
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "_attn_implementation", None) or getattr(config, "_attn_implementation", None)


def check_packed_attention(model: Any) -> None:
    """Raises ValueError unless `model`'s (text) attention keeps packed samples apart (`PACKED_ATTENTION`).

    Models without an HF config (batchd's own `TinyCausalLM` / `TinyMLLM`, which take ``cu_seqlens``) pass."""
    model = getattr(model, "module", model)
    impl = _attn_implementation(model)
    if getattr(model, "config", None) is None or impl is None:
        return
    if impl not in PACKED_ATTENTION:
        raise ValueError(
            f"packed rows need an attention implementation that keeps samples apart, one of "
            f"{list(PACKED_ATTENTION)}; this model uses attn_implementation={impl!r}: load it "
            f"with attn_implementation='sdpa' (or flash_attention_2) or use collate = \"padded\""
        )


def is_two_phase(model: Any) -> bool:
    """Whether `model` (or the module a DDP / FSDP wrapper holds) was adapted by `two_phase`."""
    return getattr(getattr(model, "module", model), _ADAPTED, None) is not None


def _is_packed(batch: Mapping[str, Any]) -> bool:
    return batch.get("attention_mask") is None and batch.get("position_ids") is not None


def check_model_batch(model: Any, batch: Mapping[str, Any]) -> None:
    """Raises ValueError where `model` would train on `batch` silently wrong: a stock HF multimodal model of
    `VLM_FAMILIES` or `AUDIO_FAMILIES` not adapted by `two_phase` (Qwen2-VL would get 1-D positions for its
    M-RoPE, a two-phase batch's pixels or clips are other ranks'), another HF model given a two-phase batch
    (vision or audio exchange), a model adapted for one modality given the other's inputs, or a packed row on
    an attention implementation that lets samples attend to each other (`check_packed_attention`)."""
    module = getattr(model, "module", model)
    config = getattr(module, "config", None)
    if config is not None and not is_two_phase(module) and not getattr(module, "takes_batch", False):
        model_type = getattr(config, "model_type", None)
        if model_type in VLM_FAMILIES or model_type in AUDIO_FAMILIES:
            raise ValueError(
                f"a {type(module).__name__} (model_type={model_type!r}) trains on batchd batches "
                f"through batchd.two_phase(model): call it once before DDP / Trainer"
            )
        for key in ("vision_send_splits", "audio_send_splits"):
            if batch.get(key) is not None:
                raise ValueError(
                    f"a two-phase batch ({key}) needs a model that runs the exchange: "
                    f"{type(module).__name__} is not one of {sorted(VLM_FAMILIES) + list(AUDIO_FAMILIES)} "
                    f"adapted by batchd.two_phase; use phases = 1 for it"
                )
    stray = [
        k for k in getattr(getattr(module, _ADAPTED, None), "foreign_keys", ()) if batch.get(k) is not None
    ]
    if stray:
        raise ValueError(f"{type(module).__name__} adapted by batchd.two_phase does not take {stray}")
    if _is_packed(batch):
        check_packed_attention(module)


class _Adapter:
    """The state `two_phase` keeps on the model: its own forward, its family and the exchange group."""

    foreign_keys = ("audio_features", "audio_send_splits")  # batch keys it does not consume

    def __init__(self, model: torch.nn.Module, group: Any) -> None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in VLM_FAMILIES:
            raise ValueError(
                f"two_phase adapts {sorted(VLM_FAMILIES) + list(AUDIO_FAMILIES)} (config.model_type), got "
                f"{type(model).__name__} with model_type={model_type!r}"
            )
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "get_image_features"):
            raise ValueError(
                f"two_phase needs the model with its LM head (e.g. Qwen2VLForConditionalGeneration), "
                f"got {type(model).__name__} without a .model.get_image_features"
            )
        self.family, self.encode = VLM_FAMILIES[model_type]
        self.inner = inner
        language = {id(p) for p in inner.get_input_embeddings().parameters()}
        language |= {id(p) for n, p in inner.named_parameters() if n.startswith("language_model.")}
        self.vision_params = [p for p in inner.parameters() if id(p) not in language]
        self.forward = model.forward  # the model's own (bound) forward
        self.group = group

    # -- the vision phase ---------------------------------------------------------------------------
    def vision(
        self, pixels: Any, grid: Any, exchange: Mapping[str, Any], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(this rank's LLM image rows in LLM order, a zero scalar that puts every vision parameter in
        the graph)."""
        if self.family.grids and (pixels is None) != (grid is None):
            raise ValueError(
                f"pixel_values and image_grid_thw come together, got {pixels is None=} {grid is None=}"
            )
        # every vision parameter enters the graph times 0.0 (LLaVA's tower has layers past the feature layer
        # that the stock forward never uses): DDP sees a gradient for each on every step
        params = [p for p in self.vision_params if p.requires_grad]  # as frozen now, not at adaptation
        trains = bool(params)  # False: a frozen vision tower and projector
        anchor = torch.stack([p.reshape(-1)[0] for p in params]).sum() * 0.0 if trains else None
        if pixels is not None:
            pixels = as_tensor(pixels, "pixel_values", device)
        if pixels is None or pixels.shape[0] == 0:  # nothing to encode: zero rows, the tower is not run
            embed = self.inner.get_input_embeddings().weight
            # the rows require grad so the exchange's backward (a collective: the other ranks' all-to-all
            # waits for this rank's) runs here too; rows that need no grad would skip it and hang the step
            # (or on none: no rank's rows require grad where the tower is frozen)
            encoded = embed.new_zeros((0, embed.shape[1])).requires_grad_(torch.is_grad_enabled() and trains)
        else:
            encoded = self.encode(
                self.inner, pixels, as_tensor(grid, "image_grid_thw", device) if grid is not None else None
            )
        return exchange_image_embeddings(encoded, exchange, self.group), anchor

    # -- positions ----------------------------------------------------------------------------------
    def token_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Qwen2-VL's mm_token_type_ids (0 text, 1 image, 2 video) when the batch does not carry them."""
        cfg = self.inner.config
        types_ = torch.zeros_like(input_ids, dtype=torch.int32)
        types_[input_ids == cfg.image_token_id] = 1
        if getattr(cfg, "video_token_id", None) is not None:
            types_[input_ids == cfg.video_token_id] = 2
        return types_

    def packed_positions(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        types_: torch.Tensor,
        grids: torch.Tensor | None,
    ) -> torch.Tensor:
        """Qwen2-VL packed row: [4, 1, S], the restarting text positions, then each sample's own M-RoPE
        positions (`get_rope_index` over the row's samples as a padded batch, packed back)."""
        if input_ids.ndim != 2 or input_ids.shape[0] != 1 or position_ids.shape != input_ids.shape:
            raise ValueError(
                f"a packed batch is one row: input_ids and position_ids [1, S], got "
                f"{tuple(input_ids.shape)=} {tuple(position_ids.shape)=}"
            )
        flat = position_ids.reshape(-1)
        starts = (flat == 0).nonzero().reshape(-1).tolist()
        if not starts or starts[0] != 0:
            raise ValueError("a packed row's position_ids must start at 0 and restart at 0 per sample")
        lengths = [e - s for s, e in zip(starts, [*starts[1:], flat.shape[0]], strict=False)]
        ids = input_ids.new_zeros((len(lengths), max(lengths)))
        tt = types_.new_zeros(ids.shape)
        mask = torch.zeros(ids.shape, dtype=torch.long, device=ids.device)
        for row, (s, n) in enumerate(zip(starts, lengths, strict=False)):
            ids[row, :n], tt[row, :n], mask[row, :n] = input_ids[0, s : s + n], types_[0, s : s + n], 1
        rope, _ = self.inner.get_rope_index(
            ids, mm_token_type_ids=tt, image_grid_thw=grids, attention_mask=mask
        )
        mrope = rope[:, mask.bool()].reshape(3, 1, -1)
        return torch.cat([flat.view(1, 1, -1).to(mrope.dtype), mrope], dim=0)

    # -- the forward --------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        step, stock = batchd_kwargs(self.forward, args, kwargs, _GENERATION, _BATCHD_KEYS)
        if step is None:
            return stock
        kwargs = step
        device = self.inner.get_input_embeddings().weight.device
        input_ids = as_tensor(kwargs.pop("input_ids"), "input_ids", device)
        exchange = {k: kwargs.pop(k) for k in _BATCHD_KEYS if k in kwargs}
        two = exchange.get("vision_send_splits") is not None
        grid = kwargs.pop("image_grid_thw", None)
        own, anchor = self.vision(kwargs.pop("pixel_values", None), grid, exchange, device)
        llm_grids = exchange.get("llm_image_grid_thw") if two else grid
        if llm_grids is not None:
            llm_grids = as_tensor(llm_grids, "llm_image_grid_thw", device).reshape(-1, 3)
            llm_grids = llm_grids if llm_grids.shape[0] else None
        position_ids = kwargs.get("position_ids")
        packed = _is_packed(kwargs)
        if packed:
            check_packed_attention(self.inner)
        if self.family.mrope:
            types_ = kwargs.get("mm_token_type_ids")
            types_ = (
                self.token_types(input_ids)
                if types_ is None
                else as_tensor(types_, "mm_token_type_ids", device)
            )
            kwargs["mm_token_type_ids"] = types_
            if llm_grids is not None:
                kwargs["image_grid_thw"] = llm_grids
            if packed:
                kwargs["position_ids"] = self.packed_positions(
                    input_ids, as_tensor(position_ids, "position_ids", device), types_, llm_grids
                )
            elif position_ids is not None and as_tensor(position_ids, "position_ids", device).ndim == 2:
                kwargs.pop("position_ids")  # 1-D positions: the model computes M-RoPE from the grids
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        # The model reads pooler_output as a tuple of per-image rows (what its own encoder returns).
        own_outputs = BaseModelOutputWithPooling(pooler_output=(own,))  # type: ignore[arg-type]
        kwargs["mm_encoder_outputs"] = {"image": own_outputs}
        out = self.forward(input_ids=input_ids, **kwargs)
        if anchor is not None:
            out["logits"] = out["logits"] + anchor.to(out["logits"].dtype)
        return out


def _adapted_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    return getattr(self, _ADAPTED)(*args, **kwargs)


def two_phase(model: torch.nn.Module, group: Any = None) -> torch.nn.Module:
    """Adapts a stock HF multimodal model in place to batchd steps (module docstring); returns it.

    Idempotent (a second call only changes `group`). Call it before wrapping the model in DDP / FSDP.
    ``copy.deepcopy`` keeps the adaptation; save weights with ``save_pretrained`` / ``state_dict`` (a pickle
    of the whole module cannot carry the patched forward).

    Args:
        model: A ``Qwen2VLForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration`` or
            ``LlavaForConditionalGeneration`` (`VLM_FAMILIES`, by ``config.model_type``), or a
            ``Qwen2AudioForConditionalGeneration`` (`AUDIO_FAMILIES`: the audio phase, `AudioAdapter`).
        group: The process group of the two-phase exchange (None = the default group).

    Raises:
        ValueError: for a model of another family, or one without its LM head.
    """
    adapter = getattr(model, _ADAPTED, None)
    if adapter is not None:
        adapter.group = group
        return model
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in AUDIO_FAMILIES:
        adapter = AudioAdapter(model, group, check_packed_attention)
    else:
        adapter = _Adapter(model, group)
    object.__setattr__(model, _ADAPTED, adapter)
    model.forward = types.MethodType(_adapted_forward, model)
    model.takes_batch = True  # type: ignore[assignment]  # a plain flag on the module, not a submodule
    return model
