"""A tiny byte-level BPE tokenizer trained locally (no downloads), and a picklable tokenizer reference.

`train_tokenizer` trains a byte-level BPE with the `tokenizers` library on the given texts (by default
the demo dataset's generated text) and adds the special tokens the built-in chat templates, vision and
audio stages use: ChatML/Qwen2 (`<|im_start|>`, `<|im_end|>`), Qwen2-VL (`<|vision_start|>`,
`<|vision_end|>`, `<|image_pad|>`), Llama-3 (`<|begin_of_text|>`, `<|start_header_id|>`,
`<|end_header_id|>`, `<|eot_id|>`), LLaVA (`<image>`) and Qwen2-Audio (`<|audio_bos|>`, `<|AUDIO|>`,
`<|audio_eos|>`). Id 0 is `<|endoftext|>`, which doubles as the pad token.

`TokenizerRef` is how stages hold a tokenizer: it carries the tokenizer.json *text* (so it pickles to
any Ray worker, on any node) and builds the `transformers.PreTrainedTokenizerFast` lazily, once per
process. It reads a `tokenizer.json` file or a Hugging Face tokenizer directory (what
`save_pretrained` writes: its `tokenizer.json`, or a slow tokenizer that `AutoTokenizer` converts),
offline, from local files only.

The default tokenizer (`demo_tokenizer()`) is trained on first use and cached in
`$BATCHD_CACHE` (default `~/.cache/batchd`) as `demo-tokenizer-<hash>.json`; `batchd tokenizer FILE`
writes it to FILE, for trainers that need its vocabulary size.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<image>",
    "<|audio_bos|>",
    "<|AUDIO|>",
    "<|audio_eos|>",
)
PAD_TOKEN = "<|endoftext|>"


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 2048, special_tokens: Iterable[str] = SPECIAL_TOKENS
) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` trained on `texts` (deterministic for the same input)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _cache_dir() -> Path:
    root = os.environ.get("BATCHD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "batchd")
    return Path(root)


def demo_tokenizer(path: str | os.PathLike[str] | None = None, vocab_size: int = 1024) -> Path:
    """The demo tokenizer.json (trained on the demo generator's text), written to `path` or a cache file.

    Training takes about a second; the cached file is reused (its name carries a hash of the recipe).
    """
    from ._demo_data import demo_corpus

    if path is None:
        recipe = f"v1-{vocab_size}-{','.join(SPECIAL_TOKENS)}".encode()
        path = _cache_dir() / f"demo-tokenizer-{hashlib.sha1(recipe).hexdigest()[:12]}.json"
    path = Path(path)
    if path.exists():
        return path
    tok = train_tokenizer(demo_corpus(), vocab_size=vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tok.save(str(tmp))
    os.replace(tmp, path)
    return path


@functools.lru_cache(maxsize=8)
def _build(json_text: str, pad_token: str | None) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    kwargs: dict[str, Any] = {}
    if pad_token is not None:
        kwargs["pad_token"] = pad_token
    # transformers declares this constructor without types.
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=Tokenizer.from_str(json_text), **kwargs
    )


def _read_tokenizer_dir(path: Path) -> tuple[str, str | None]:
    """(tokenizer.json text, pad token or None) of a Hugging Face tokenizer directory, offline."""
    try:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True, use_fast=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError... by case
        raise ValueError(
            f"tokenizer directory {path} cannot be loaded as a Hugging Face tokenizer: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None
    if not getattr(hf, "is_fast", False):
        raise ValueError(
            f"tokenizer directory {path} holds a slow tokenizer that cannot be converted to a fast "
            f"one (batchd needs tokenizer.json)"
        )
    return hf.backend_tokenizer.to_str(), hf.pad_token


class TokenizerRef:
    """A picklable handle on an HF fast tokenizer built from local files (never downloads).

    Args:
        source: A tokenizer.json file, a Hugging Face tokenizer directory (`save_pretrained` output),
            tokenizer.json text, another TokenizerRef, or None (the demo tokenizer, `demo_tokenizer()`).
        pad_token: The pad token (default: the directory's pad token, else `<|endoftext|>` when the
            vocabulary has it).

    Raises:
        FileNotFoundError: naming `source` when it does not exist.
        ValueError: naming `source` when it is not a tokenizer.
    """

    def __init__(
        self, source: str | os.PathLike[str] | TokenizerRef | None = None, pad_token: str | None = None
    ) -> None:
        self.json_text: str
        self.pad_token: str | None
        self.name: str
        if isinstance(source, TokenizerRef):
            self.json_text, self.pad_token, self.name = source.json_text, source.pad_token, source.name
            return
        if source is None:
            source = demo_tokenizer()
        text = os.fspath(source)
        dir_pad = None
        if text.lstrip().startswith("{"):
            self.json_text, self.name = text, "<inline tokenizer.json>"
        else:
            path = Path(text).expanduser()
            if path.is_dir():
                self.json_text, dir_pad = _read_tokenizer_dir(path)
            elif path.is_file():
                self.json_text = path.read_text(encoding="utf-8")
                try:
                    json.loads(self.json_text)
                except ValueError:
                    raise ValueError(f"tokenizer file {text} is not a tokenizer.json (not JSON)") from None
            else:
                raise FileNotFoundError(
                    f"tokenizer not found: {text} (expected a tokenizer.json file or a "
                    f"Hugging Face tokenizer directory; `batchd tokenizer FILE` writes the "
                    f"demo one)"
                )
            self.name = text
        self.pad_token = pad_token or dir_pad
        if self.pad_token is None and f'"{PAD_TOKEN}"' in self.json_text:
            self.pad_token = PAD_TOKEN

    @property
    def hf(self) -> PreTrainedTokenizerFast:
        """The `transformers.PreTrainedTokenizerFast` (built once per process)."""
        return _build(self.json_text, self.pad_token)

    def token_id(self, token: str) -> int:
        """The id of a token that must be in the vocabulary (a special token, usually)."""
        i = self.hf.convert_tokens_to_ids(token)
        if not isinstance(i, int) or i == self.hf.unk_token_id or self.hf.convert_ids_to_tokens(i) != token:
            raise ValueError(f"token {token!r} is not in the tokenizer {self.name}")
        return int(i)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def id_space(self) -> int:
        """1 + the largest token id (model vocabulary and added tokens): the embedding rows a model needs."""
        data = json.loads(self.json_text)
        vocab = data.get("model", {}).get("vocab", {})
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
        ids += [t["id"] for t in data.get("added_tokens", [])]
        return max(ids) + 1 if ids else len(self.hf)

    @property
    def pad_id(self) -> int:
        return int(self.hf.pad_token_id) if self.hf.pad_token_id is not None else 0

    def __repr__(self) -> str:
        return f"TokenizerRef({self.name})"
