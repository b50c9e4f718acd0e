"""Chat templates of the Hugging Face processors the tests and `benchmarks/hf_processor_throughput.py` build
locally (nothing is downloaded)."""

# Qwen2-VL's own chat template (as its processor ships it): no {% generation %} blocks -> "prefix" labels.
from batchd.testing import QWEN2VL_TEMPLATE  # noqa: F401 - re-exported for the tests

# The same rendering with the assistant's content and <|im_end|> in {% generation %} blocks -> HF's mask.
QWEN2VL_GENERATION_TEMPLATE = (
    "{%- macro render(content) -%}{%- if content is string -%}{{- content -}}{%- else -%}"
    "{%- for part in content -%}{%- if part['type'] == 'image' -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- render(message['content']) + '<|im_end|>' -}}{%- endgeneration -%}{{- '\\n' -}}"
    "{%- else -%}{{- render(message['content']) + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
