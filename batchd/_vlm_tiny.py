"""Tiny stock Hugging Face multimodal models and their processors, built locally (nothing is downloaded).

`save_tiny_vlm(path, family)` writes what a real checkout holds (``save_pretrained`` of the processor: the
tokenizer, the image processor and the family's chat template; and of the model: its config and random
weights), so `HFProcessor(path)` and ``AutoModelForImageTextToText.from_pretrained(path)`` load it exactly as
they load ``Qwen/Qwen2-VL-2B-Instruct`` or ``llava-hf/llava-1.5-7b-hf``. The tests, `batchd bench --model
tiny-qwen2vl` and docs/multimodal.md's recipe use it; a real job points at its model's own directory instead.

Families (`TINY_VLM_FAMILIES`):
    qwen2_vl   ``Qwen2VLForConditionalGeneration``: a 2-block ViT (patch 14, temporal patch 2, 2x2 merger,
               1,176-value patches, so `batchd.service.preprocess.Qwen2VLVision` patches fit it too) and a
               2-layer Qwen2 LM with M-RoPE; images of 56x56 to 224x224 pixels (4 to 64 image tokens).
    llava      ``LlavaForConditionalGeneration``: a 2-layer CLIP ViT on 28x28 images (2x2 patches of 14,
               4 image tokens, ``vision_feature_select_strategy="default"``) and a 2-layer Llama LM.

The tokenizer is a byte-level BPE trained on the demo records (`train_tokenizer`, deterministic), with the
family's special tokens. Weights are seeded (`seed`), so every rank and a reference build the same model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

TINY_VLM_FAMILIES = ("qwen2_vl", "llava")
QWEN2VL_MIN_PIXELS, QWEN2VL_MAX_PIXELS = 56 * 56, 224 * 224

# Qwen2-VL's own chat template (as its processor ships it): no {% generation %} blocks.
QWEN2VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant."
    "<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A LLaVA-1.5 style template: "USER: <image>\n... ASSISTANT: ...</s>".
LLAVA_TEMPLATE = (
    "{%- for message in messages -%}{{- message['role'].upper() + ': ' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}{%- else -%}"
    "{%- for part in message['content'] -%}{%- if part['type'] == 'image' -%}{{- '<image>\\n' -}}"
    "{%- else -%}{{- part['text'] -}}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{- '</s>' -}}{%- endif -%}{{- '\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'ASSISTANT: ' -}}{%- endif -%}"
)


def _check_family(family: str) -> str:
    if family not in TINY_VLM_FAMILIES:
        raise ValueError(f"family must be one of {list(TINY_VLM_FAMILIES)}, got {family=}")
    return family


def tiny_tokenizer(extra_special: tuple[str, ...] = (), vocab_size: int = 1024, **kwargs: Any):
    """A `PreTrainedTokenizerFast` trained on the demo records' texts, with batchd's special tokens."""
    from transformers import PreTrainedTokenizerFast

    from batchd.service.preprocess import SPECIAL_TOKENS, demo_records, train_tokenizer

    records, _ = demo_records(300, seed=3, image_fraction=0.0, bad_fraction=0.0)
    texts = [m["content"] for r in records for m in r["messages"]]
    tok = train_tokenizer(
        texts, vocab_size=vocab_size, special_tokens=tuple(SPECIAL_TOKENS) + tuple(extra_special)
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", **kwargs)


def tiny_processor(family: str = "qwen2_vl"):
    """The family's processor (tokenizer, image processor, chat template), in memory."""
    if _check_family(family) == "qwen2_vl":
        from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor

        tok = tiny_tokenizer(("<|video_pad|>",), eos_token="<|im_end|>")
        ip = Qwen2VLImageProcessor(min_pixels=QWEN2VL_MIN_PIXELS, max_pixels=QWEN2VL_MAX_PIXELS)
        # without torchvision transformers cannot build the video processor: the same class without one
        no_video = type(
            "Qwen2VLProcessor",
            (Qwen2VLProcessor,),
            {"get_attributes": classmethod(lambda c: ["image_processor", "tokenizer"])},
        )
        return no_video(image_processor=ip, tokenizer=tok, chat_template=QWEN2VL_TEMPLATE)
    from transformers import CLIPImageProcessor, LlavaProcessor

    tok = tiny_tokenizer(eos_token="</s>")
    ip = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    return LlavaProcessor(
        image_processor=ip,
        tokenizer=tok,
        patch_size=14,
        num_additional_image_tokens=1,
        vision_feature_select_strategy="default",
        chat_template=LLAVA_TEMPLATE,
    )


@dataclass(frozen=True)
class Qwen2VLTokens:
    """The token ids of a tiny Qwen2-VL's vocabulary (no tokenizer needed): its size, the image, video and
    vision start / end placeholders, and the pad and end-of-sequence ids (None: none).

    Raises:
        ValueError: naming an id outside [0, vocab_size), or a vocabulary smaller than 1.
    """

    vocab_size: int
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    pad_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {self.vocab_size=}")
        for f in fields(self)[1:]:
            token = getattr(self, f.name)
            if token is None and f.name in ("pad_token_id", "eos_token_id"):
                continue
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
                raise ValueError(
                    f"{f.name} must be an int in [0, {self.vocab_size=}), got {f.name}={token!r}"
                )


def tiny_qwen2vl_config(
    tokens: Qwen2VLTokens, attn_implementation: str = "sdpa", max_position_embeddings: int = 8192
):
    """The tiny Qwen2-VL's config for a vocabulary given by its ids (`tokens`): `tiny_vlm_config`'s model,
    or `batchd bench --model tiny-qwen2vl`'s on the synthetic samples (their own image token id)."""
    from transformers import Qwen2VLConfig

    cfg = Qwen2VLConfig(
        text_config=dict(
            vocab_size=tokens.vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=max_position_embeddings,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
            pad_token_id=tokens.pad_token_id,
            bos_token_id=None,
            eos_token_id=tokens.eos_token_id,
        ),
        vision_config=dict(
            depth=2,
            embed_dim=32,
            hidden_size=64,
            num_heads=2,
            mlp_ratio=2,
            in_channels=3,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=tokens.image_token_id,
        video_token_id=tokens.video_token_id,
        vision_start_token_id=tokens.vision_start_token_id,
        vision_end_token_id=tokens.vision_end_token_id,
    )
    cfg._attn_implementation = attn_implementation
    return cfg


def tiny_vlm_config(family: str, tokenizer: Any, attn_implementation: str = "sdpa"):
    """The tiny model's config for a tokenizer of `tiny_processor(family)` (its vocabulary and image
    tokens)."""
    ids = tokenizer.convert_tokens_to_ids
    vocab = len(tokenizer)
    if _check_family(family) == "qwen2_vl":
        tokens = Qwen2VLTokens(
            vocab,
            image_token_id=ids("<|image_pad|>"),
            video_token_id=ids("<|video_pad|>"),
            vision_start_token_id=ids("<|vision_start|>"),
            vision_end_token_id=ids("<|vision_end|>"),
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=ids("<|im_end|>"),
        )
        return tiny_qwen2vl_config(tokens, attn_implementation=attn_implementation)
    else:
        from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

        cfg = LlavaConfig(
            vision_config=CLIPVisionConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
                projection_dim=32,
            ),
            text_config=LlamaConfig(
                vocab_size=vocab,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=8192,
                pad_token_id=tokenizer.pad_token_id,
                bos_token_id=None,
                eos_token_id=ids("</s>") if "</s>" in tokenizer.get_vocab() else None,
            ),
            image_token_id=ids("<image>"),
            vision_feature_layer=-1,
            vision_feature_select_strategy="default",
            projector_hidden_act="gelu",
        )
    cfg._attn_implementation = attn_implementation
    return cfg


def tiny_vlm(family: str, tokenizer: Any, seed: int = 0, attn_implementation: str = "sdpa"):
    """A randomly initialised tiny model of `family` (seeded: same seed, same weights), fp32, train mode."""
    import torch
    from transformers import LlavaForConditionalGeneration, Qwen2VLForConditionalGeneration

    cfg = tiny_vlm_config(family, tokenizer, attn_implementation)
    cls = Qwen2VLForConditionalGeneration if family == "qwen2_vl" else LlavaForConditionalGeneration
    torch.manual_seed(seed)
    model = cls._from_config(cfg, attn_implementation=attn_implementation)
    return model.train()


def save_tiny_vlm(path: str | os.PathLike, family: str = "qwen2_vl", seed: int = 0) -> Path:
    """Writes the family's processor and a tiny random model into `path` (created); returns the path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    proc = tiny_processor(family)
    proc.save_pretrained(path)
    tiny_vlm(family, proc.tokenizer, seed).save_pretrained(path)
    return path


def load_vlm(path: str | os.PathLike, attn_implementation: str = "sdpa"):
    """The model saved at `path` (a tiny one from `save_tiny_vlm`, or a real checkout), offline, fp32."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(
        str(path), local_files_only=True, attn_implementation=attn_implementation
    )
