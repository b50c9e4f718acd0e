"""Text stages: the chat template (`ChatTemplate`, `TEMPLATES`), `Tokenize` and `Truncate`.

    ChatTemplate      messages, system             -> text, assistant_spans (char spans that carry loss)
    Tokenize          text, assistant_spans        -> input_ids, labels (-100 outside assistant spans)
    Truncate          the token sequence           -> cut to the cutoff (never inside an image) or Reject

Loss comes from the template alone: the characters inside its `{% generation %}` blocks carry loss, and
`Tokenize` marks the tokens overlapping them. `Truncate` comes last in the default chain, after the
vision stage has expanded the image tokens, so the cutoff counts every token the model will see.
"""

from __future__ import annotations

import os
from typing import Any, cast

import numpy as np

from ._parse import AUDIO_MARKER, IMAGE_MARKER
from ._quarantine import Reject
from ._stage import IGNORE_INDEX, Example, Stage, StageContext, _as_ref
from ._tokenizer import TokenizerRef

# ---------------------------------------------------------------------------------------------------
# Chat template
# ---------------------------------------------------------------------------------------------------
QWEN2VL_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# Both templates wrap what carries loss in {% generation %} blocks (the assistant's content and its
# end-of-turn token), the mechanism behind HF `apply_chat_template(return_assistant_tokens_mask=True)`.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' and default_system -%}"
    "{{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}{{- '\\n' -}}"
    "{%- else -%}"
    "{{- message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
LLAMA3_TEMPLATE = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] | trim + '<|eot_id|>' -}}{%- endgeneration -%}"
    "{%- else -%}"
    "{{- message['content'] | trim + '<|eot_id|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}"
)
# name -> (Jinja template, default system prompt, image placeholder text)
TEMPLATES: dict[str, tuple[str, str | None, str]] = {
    "chatml": (CHATML_TEMPLATE, None, QWEN2VL_IMAGE),
    "qwen2": (CHATML_TEMPLATE, "You are a helpful assistant.", QWEN2VL_IMAGE),
    "llama3": (LLAMA3_TEMPLATE, None, IMAGE_MARKER),
}
_UNSET = object()


class ChatTemplate(Stage):
    """Renders the conversation with a Jinja chat template (HF `apply_chat_template` semantics).

    Rendering goes through transformers' own renderer (`render_jinja_template`, what
    `apply_chat_template` calls), which also reports the character spans inside `{% generation %}`
    blocks: those spans, and only those, carry loss after `Tokenize`. A custom template without
    generation blocks would give a sample no loss tokens (quarantined as `no_loss_tokens`).

    Args:
        template: "chatml", "qwen2" (ChatML with Qwen2's default system prompt), "llama3", or Jinja text.
        default_system: System prompt when the record has none (default: the template's).
        image_placeholder: What each `<image>` marker becomes in the text (default: the template's;
            set it to match the vision stage: `QWEN2VL_IMAGE` for Qwen2-VL, "<image>" for LLaVA).
        audio_placeholder: What each `<audio>` marker becomes (default: kept; `QWEN2_AUDIO` for the
            Qwen2-Audio stage).
        template_kwargs: Extra variables for the template.
    """

    def __init__(
        self,
        template: str = "qwen2",
        default_system: Any = _UNSET,
        image_placeholder: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        audio_placeholder: str = AUDIO_MARKER,
    ) -> None:
        if template in TEMPLATES:
            jinja, sys_default, placeholder = TEMPLATES[template]
        elif "{%" in template or "{{" in template:
            jinja, sys_default, placeholder = template, None, IMAGE_MARKER
        else:
            raise ValueError(f"template must be one of {sorted(TEMPLATES)} or Jinja text, got {template!r}")
        self.template = template
        self.jinja = jinja
        self.default_system = sys_default if default_system is _UNSET else default_system
        self.image_placeholder = placeholder if image_placeholder is None else image_placeholder
        self.audio_placeholder = audio_placeholder
        self.template_kwargs = dict(template_kwargs or {})

    def messages_of(self, ex: Example) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": ex.system}] if ex.system is not None else []
        msgs += [dict(m) for m in ex.messages]
        for marker, placeholder in (
            (IMAGE_MARKER, self.image_placeholder),
            (AUDIO_MARKER, self.audio_placeholder),
        ):
            if placeholder != marker:
                for m in msgs:
                    m["content"] = m["content"].replace(marker, placeholder)
        return msgs

    def setup(self) -> None:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        _compile_jinja_template(self.jinja)

    def __call__(self, ex: Example, ctx: StageContext) -> Example:
        from transformers.utils.chat_template_utils import render_jinja_template

        # transformers declares the plain form's return (str); with the mask it returns (texts, spans).
        rendered, spans = cast(Any, render_jinja_template)(
            conversations=[self.messages_of(ex)],
            chat_template=self.jinja,
            return_assistant_tokens_mask=True,
            add_generation_prompt=False,
            default_system=self.default_system,
            **self.template_kwargs,
        )
        ex.text, ex.assistant_spans = rendered[0], [(int(s), int(e)) for s, e in spans[0]]
        return ex


# ---------------------------------------------------------------------------------------------------
# Tokenization
# ---------------------------------------------------------------------------------------------------
class Tokenize(Stage):
    """Tokenizes `text` with an HF fast tokenizer; labels = ids on tokens overlapping an assistant span.

    The masking rule is `apply_chat_template(return_assistant_tokens_mask=True)`'s: a token carries loss
    when its character offsets overlap a `{% generation %}` span. Special tokens written by the template
    are matched as whole tokens; no BOS/EOS is added beyond what the template writes.

    Args:
        tokenizer: Path to a local tokenizer.json, or a TokenizerRef (default: the demo tokenizer).
    """

    def __init__(self, tokenizer: str | os.PathLike[str] | TokenizerRef | None = None) -> None:
        self.tokenizer = _as_ref(tokenizer)

    def setup(self) -> None:
        _ = self.tokenizer.hf  # loads the tokenizer once per actor, before the first sample

    def __call__(self, ex: Example, ctx: StageContext) -> Example:
        if ex.text is None:
            raise ValueError("Tokenize needs example.text: put a ChatTemplate stage before it")
        enc = self.tokenizer.hf.backend_tokenizer.encode(ex.text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int32)
        mask = np.zeros(len(ids), dtype=bool)
        spans, s = ex.assistant_spans, 0
        for t, (start, end) in enumerate(enc.offsets):
            while s < len(spans) and start >= spans[s][1]:
                s += 1
            if s == len(spans):
                break
            if end > spans[s][0]:
                mask[t] = True
        ex.input_ids = ids
        ex.labels = np.where(mask, ids, IGNORE_INDEX).astype(np.int32)
        return ex


# ---------------------------------------------------------------------------------------------------
# Truncation
# ---------------------------------------------------------------------------------------------------
TRUNCATE_POLICIES = ("truncate", "reject")


class Truncate(Stage):
    """Keeps samples within `cutoff` tokens.

    policy "truncate": cut to `cutoff` tokens; an image or audio clip whose tokens would be cut is dropped
    whole (the cut moves to just before it, and its pixels or features leave the payload), so the payload
    stays consistent.
    `example.extra` arrays with one row per token (leading dimension = the sequence's length: a plug-in's
    loss weights, a processor's token type ids) are cut with the tokens.
    policy "reject": a sample over the cutoff is quarantined (`over_cutoff`).
    """

    def __init__(self, cutoff: int, policy: str = "truncate") -> None:
        if cutoff < 1:
            raise ValueError(f"cutoff must be >= 1, got {cutoff=}")
        if policy not in TRUNCATE_POLICIES:
            raise ValueError(f"policy must be one of {list(TRUNCATE_POLICIES)}, got {policy=}")
        self.cutoff, self.policy = int(cutoff), policy

    def __call__(self, ex: Example, ctx: StageContext) -> Example:
        if ex.input_ids is None or ex.labels is None:
            raise ValueError(f"{self.name} needs input_ids: put it after Tokenize")
        n = len(ex.input_ids)
        if n <= self.cutoff:
            return ex
        if self.policy == "reject":
            raise Reject("over_cutoff", f"{n} tokens > cutoff {self.cutoff}")
        cut = self.cutoff
        for s, e in sorted(ex.image_spans + ex.audio_spans):  # never inside an image or a clip
            if e > cut:
                cut = min(cut, s)
                break
        keep = sum(e <= cut for _, e in ex.image_spans)
        heard = sum(e <= cut for _, e in ex.audio_spans)
        ex.input_ids, ex.labels = ex.input_ids[:cut], ex.labels[:cut]
        for key, value in ex.extra.items():
            if getattr(value, "ndim", 0) >= 1 and len(value) == n:
                ex.extra[key] = value[:cut]
        ex.image_spans, ex.image_tokens = ex.image_spans[:keep], ex.image_tokens[:keep]
        ex.image_tensors, ex.images = ex.image_tensors[:keep], ex.images[:keep]
        ex.audio_spans, ex.audio_tokens = ex.audio_spans[:heard], ex.audio_tokens[:heard]
        ex.audio_tensors, ex.audios = ex.audio_tensors[:heard], ex.audios[:heard]
        return ex
