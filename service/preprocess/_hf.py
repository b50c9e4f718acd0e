"""`HFProcessor`: a stage that runs a model's own Hugging Face processor (template, tokenizer, images, audio).

    HFProcessor   messages, system, images, audios -> text, input_ids, labels, image_spans, image_tokens,
                                                      image_tensors, audio_spans, audio_tokens,
                                                      audio_tensors, extra

It replaces `ChatTemplate`, `Tokenize` and the vision stage of the default chain with what the model's
own processor directory (`save_pretrained` output, read offline) does: its chat template renders the
conversation with the images where the record's `<image>` markers are, and the processor turns text
and images into exactly the tensors it gives the model (`input_ids`, `pixel_values`, `image_grid_thw`,
and whatever else it returns). `Truncate` and `finalize` work after it unchanged.

Labels (what carries loss: the assistant turns' content and their end-of-turn token, nothing else):
    "generation"  the template wraps assistant output in `{% generation %}` blocks: transformers'
                  own `apply_chat_template(return_assistant_tokens_mask=True)` gives the mask.
    "prefix"      any other template: the characters of assistant turn k are those that rendering
                  messages[:k + 1] adds to rendering messages[:k] with the generation prompt, trailing
                  whitespace excluded; the tokens overlapping them carry loss (the same overlap rule,
                  shifted past expanded image placeholders). A template whose rendering of a prefix of the
                  conversation is not a prefix of the whole (one that rewrites earlier turns) is rejected
                  per record as `template_error`.
    "auto"        (default) "generation" when the template has such blocks, else "prefix".
Image and audio tokens never carry loss.

Each image must become one run of the processor's image token (Qwen2-VL, Qwen2.5-VL, LLaVA...): that
run, widened by the tokens the template writes around each image, is the image's span for `Truncate`.
A processor that splits an image into several runs (tiled images) rejects such records (`image_mismatch`).

Audio clips alike, with a processor that has an audio feature extractor (Qwen2-Audio: Whisper's, and
`<|AUDIO|>` runs between `<|audio_bos|>` / `<|audio_eos|>`): the record's `<audio>` markers become
`{"type": "audio"}` parts, its decoded clips go to the processor, each clip must become one run of its
audio token (else `audio_mismatch`, or `bad_audio` naming a clip too short for one token), and the clip's
features are kept without the processor's padding to its window (`_hf_audio`). A processor without an
audio feature extractor rejects records with clips (`unsupported_audio`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from ._hf_audio import (
    AudioSide,
    _first_line,
    audio_runs,
    audio_side,
    audio_tensors,
    clip_reject,
    prepare_clips,
    with_clips,
)
from ._parse import AUDIO_MARKER, IMAGE_MARKER
from ._quarantine import Reject
from ._stage import IGNORE_INDEX, Example, Stage, StageContext

log = logging.getLogger(__name__)

LABEL_MODES = ("auto", "generation", "prefix")
_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")
_DROP = ("attention_mask", "offset_mapping", "text_replacement_offsets", "assistant_masks")
_MARKERS_RE = re.compile(f"({re.escape(IMAGE_MARKER)}|{re.escape(AUDIO_MARKER)})")


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------
def _processor_class_name(path: Path) -> str | None:
    """The `processor_class` a processor directory names (processor, preprocessor or tokenizer config)."""
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        f = path / name
        if f.is_file():
            try:
                cls = json.loads(f.read_text(encoding="utf-8")).get("processor_class")
            except (OSError, ValueError):
                continue
            if cls:
                return str(cls)
    return None


def _has_image_processor(path: Path) -> bool:
    if (path / "preprocessor_config.json").is_file():
        return True
    try:
        return "image_processor" in json.loads((path / "processor_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False


def _without_video(path: Path, cause: Exception) -> Any:
    """The directory's processor class loaded without its video processor, or None when it has none.

    Image-and-video processors (Qwen2-VL, Qwen2.5-VL...) fail to load where transformers cannot build
    their video processor: without torchvision, or from a directory saved without one. Records carry no
    videos, so the image and text parts are all this stage needs.
    """
    import transformers

    name = _processor_class_name(path)
    cls = getattr(transformers, name, None) if name else None
    if cls is None or not any("video" in a for a in cls.get_attributes()):
        return None
    keep = [a for a in cls.get_attributes() if "video" not in a]
    image_text: Any = type(cls.__name__, (cls,), {"get_attributes": classmethod(lambda c: list(keep))})
    proc = image_text.from_pretrained(str(path), local_files_only=True)
    log.warning(
        "processor %s at %s loaded without its video processor (%s); images and text work",
        name,
        path,
        _first_line(cause),
    )
    return proc


def load_processor(path: str | os.PathLike[str]) -> Any:
    """The processor of a local Hugging Face directory, offline: `AutoProcessor` (an image-and-video one
    without its video processor when that cannot load), else `AutoTokenizer` for a directory without an
    image processor (a text-only processor: the tokenizer itself).

    Raises:
        ValueError: naming `path` and the loaders' errors when nothing loads.
    """
    from transformers import AutoProcessor, AutoTokenizer

    path = Path(path)
    try:
        # transformers declares AutoProcessor.from_pretrained untyped; the processor is any ProcessorMixin.
        return AutoProcessor.from_pretrained(str(path), local_files_only=True)  # type: ignore[no-untyped-call]
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, ImportError... by case
        first = exc
    try:
        proc = _without_video(path, first)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(
            f"processor directory {path} cannot be loaded: {_first_line(first)}; without its "
            f"video processor: {_first_line(exc)}"
        ) from None
    if proc is not None:
        return proc
    if _has_image_processor(path):
        raise ValueError(f"processor directory {path} cannot be loaded: {_first_line(first)}")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(
            f"processor directory {path} loads neither as a Hugging Face processor "
            f"({_first_line(first)}) nor as a tokenizer ({_first_line(exc)})"
        ) from None


# ---------------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------------
class _Loaded:
    """What `HFProcessor` derives from the loaded processor once per process (never pickled)."""

    def __init__(self, proc: Any, path: str, labels: str, template_kwargs: dict[str, Any]) -> None:
        from transformers import PreTrainedTokenizerBase

        self.proc = proc
        is_tok = isinstance(proc, PreTrainedTokenizerBase)
        self.tok = proc if is_tok else proc.tokenizer
        self.has_images = not is_tok and hasattr(proc, "image_processor")
        self.audio: AudioSide | None = None if is_tok else audio_side(proc, self.tok, path)
        self.text_only = not self.has_images and self.audio is None  # the tokenizer does all the work
        template = getattr(proc, "chat_template", None) or getattr(self.tok, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("default")
        if not template:
            raise ValueError(f"the processor at {path} has no chat template")
        self.template = template
        has_generation = bool(_GENERATION_RE.search(template))
        if labels == "generation" and not has_generation:
            raise ValueError(
                f"labels='generation' needs {{% generation %}} blocks in the chat template of {path}"
            )
        self.generation = labels == "generation" or (labels == "auto" and has_generation)
        self.template_kwargs = template_kwargs
        self.image_token: str | None = None
        self.image_token_id: int | None = None
        self.wrap: tuple[list[int], list[int]] = ([], [])
        if self.has_images:
            self.image_token = getattr(proc, "image_token", None)
            tid = getattr(proc, "image_token_id", None)
            if tid is None and self.image_token is not None:
                tid = self.tok.convert_tokens_to_ids(self.image_token)
            if self.image_token is None or tid is None or tid == self.tok.unk_token_id:
                raise ValueError(
                    f"the processor at {path} names no image token (image_token / image_token_id)"
                )
            self.image_token_id = int(tid)
            self.wrap = self._probe_wrap()

    def render(self, conv: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The template's text for one conversation (`apply_chat_template(..., tokenize=False)`)."""
        rendered: str = self.proc.apply_chat_template(
            conv,
            chat_template=self.template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )
        return rendered

    def render_many(
        self, convs: list[list[dict[str, Any]]], add_generation_prompt: bool = False
    ) -> list[str]:
        """`render` of several conversations in one call."""
        if not convs:
            return []
        return list(
            self.proc.apply_chat_template(
                convs,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **self.template_kwargs,
            )
        )

    def _probe_wrap(self) -> tuple[list[int], list[int]]:
        """The tokens the template writes around each image token (Qwen2-VL: `<|vision_start|>`,
        `<|vision_end|>`), found by rendering one message with and without an image; ([], []) if unclear."""
        try:
            a, b = {"type": "text", "text": "A"}, {"type": "text", "text": "B"}
            with_img = self.render([{"role": "user", "content": [a, {"type": "image"}, b]}])
            without = self.render([{"role": "user", "content": [a, b]}])
        except Exception:  # noqa: BLE001 - a template that needs more than one user turn: no wrap
            return [], []
        lo = 0
        while lo < min(len(with_img), len(without)) and with_img[lo] == without[lo]:
            lo += 1
        hi = 0
        while hi < min(len(with_img), len(without)) - lo and with_img[-1 - hi] == without[-1 - hi]:
            hi += 1
        inserted = with_img[lo : len(with_img) - hi]
        if self.image_token is None or inserted.count(self.image_token) != 1:
            return [], []
        before, after = inserted.split(self.image_token)
        enc = self.tok.backend_tokenizer if hasattr(self.tok, "backend_tokenizer") else None
        if enc is None:
            return [], []
        return (
            enc.encode(before, add_special_tokens=False).ids if before else [],
            enc.encode(after, add_special_tokens=False).ids if after else [],
        )


class HFProcessor(Stage):
    """Runs a model's own Hugging Face processor on a conversation, its images and its audio clips (see the
    module docstring).

    The processor is loaded offline from `path` once per process (`setup`, or the first call) and never
    pickled: the stage ships to Ray actors as its arguments only. A directory with an image processor
    and/or an audio feature extractor gives a multimodal processor; one with only a tokenizer a text-only
    one. A record with images (clips) the processor has no image processor (audio feature extractor) for
    is rejected as `unsupported_image` (`unsupported_audio`).

    Per record: the messages (system first when the record has one) become HF chat messages whose
    content is a list of `{"type": "text", "text": ...}` / `{"type": "image"}` / `{"type": "audio"}` parts
    (plain strings for a text-only processor), where the `<image>` / `<audio>` markers were, in order; the
    processor renders and processes them with `ex.images` and `ex.audios` (consumed: left empty, the clips'
    tensors take their place). Results:
        input_ids       the processor's, unchanged; labels per the module docstring.
        image_spans     per image, the run of its image tokens, widened by the tokens the template writes
                        around each image (Qwen2-VL: `<|vision_start|>` ... `<|vision_end|>`); each image
                        must give one run. image_tokens: the image tokens in each run.
        image_tensors   per image, the processor's per-image outputs: with `image_grid_thw`, the rows of
                        tensors with sum(prod(grid)) rows split by prod(grid) (Qwen2-VL `pixel_values`)
                        and the grid's own rows; else tensors with one leading row per image.
        audio_spans     per clip, the run of its audio tokens widened by the processor's audio bos / eos
                        tokens; audio_tokens: the run's length (what the processor expanded it to).
        audio_tensors   per clip, its features without the padding to the window: `audio_features`
                        [frames, n_mels], `audio_frames` [1] (`_hf_audio`).
        extra           everything else but `attention_mask`: per-token tensors ([1, n]) as [n] arrays
                        (`Truncate` cuts them with input_ids), others as the processor returns them.
    A processor error on a record becomes `Reject`: `bad_image` / `bad_audio` naming the image / clip the
    processor fails on (or a clip too long for its window, too short for a token), `template_error` when
    the template cannot render the conversation, else `processor_error`.

    Args:
        path: The processor directory (`save_pretrained` output, e.g. the model's checkout).
        labels: "auto", "generation" or "prefix" (module docstring).
        template_kwargs: Extra variables for the chat template (e.g. {"add_vision_id": True}).
        processor_kwargs: Extra arguments of the processor call (e.g. {"images_kwargs": {...}}).

    Raises:
        FileNotFoundError: naming `path` when it is not a directory.
        ValueError: for a bad `labels`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        labels: str = "auto",
        template_kwargs: dict[str, Any] | None = None,
        processor_kwargs: dict[str, Any] | None = None,
    ) -> None:
        p = Path(os.fspath(path)).expanduser()
        if not p.is_dir():
            raise FileNotFoundError(
                f"processor directory not found: {path} (expected a Hugging Face "
                f"processor or tokenizer directory, what save_pretrained writes)"
            )
        if labels not in LABEL_MODES:
            raise ValueError(f"labels must be one of {list(LABEL_MODES)}, got {labels=}")
        self.path = str(p.resolve())
        self.labels = labels
        self.template_kwargs = dict(template_kwargs or {})
        self.processor_kwargs = dict(processor_kwargs or {})
        self._loaded: _Loaded | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        self._loaded = None

    def setup(self) -> None:
        self._load()

    def _load(self) -> _Loaded:
        if self._loaded is None:
            self._loaded = _Loaded(load_processor(self.path), self.path, self.labels, self.template_kwargs)
        return self._loaded

    @property
    def processor(self) -> Any:
        """The loaded processor (a `ProcessorMixin`, or a tokenizer for a text-only directory)."""
        return self._load().proc

    @property
    def label_mode(self) -> str:
        """ "generation" or "prefix": how this processor's labels are derived."""
        return "generation" if self._load().generation else "prefix"

    def conversation(self, ex: Example) -> list[dict[str, Any]]:
        """The record as HF chat messages (content parts for a multimodal processor, strings otherwise):
        `{"type": "image"}` / `{"type": "audio"}` parts where the `<image>` / `<audio>` markers were."""
        msgs = [{"role": "system", "content": ex.system}] if ex.system is not None else []
        msgs += ex.messages
        if self._load().text_only:
            return [{"role": m["role"], "content": m["content"]} for m in msgs]
        out = []
        kinds = {IMAGE_MARKER: "image", AUDIO_MARKER: "audio"}
        for m in msgs:
            parts: list[dict[str, Any]] = []
            for piece in _MARKERS_RE.split(m["content"]):
                if piece in kinds:
                    parts.append({"type": kinds[piece]})
                elif piece:
                    parts.append({"type": "text", "text": piece})
            out.append({"role": m["role"], "content": parts or [{"type": "text", "text": ""}]})
        return out

    # -- per record ---------------------------------------------------------------------------------
    def __call__(self, ex: Example, ctx: StageContext) -> Example:
        lp = self._load()
        self._check_items(lp, ex)
        clips = prepare_clips(lp.audio, ex.audios) if lp.audio is not None and ex.audios else []
        conv = self.conversation(ex)
        try:
            text = lp.render(conv)
            spans = None if lp.generation else self._prefix_spans(lp, conv, text)
        except Reject:
            raise
        except Exception as exc:  # noqa: BLE001 - the template's own errors (raise_exception, bad roles)
            raise Reject("template_error", _first_line(exc)) from None
        out = self._process(lp, conv, ex.images, clips, text)
        ids = np.asarray(out.pop("input_ids"))[0].astype(np.int64)
        n = len(ids)
        runs = self._image_runs(lp, ids, len(ex.images))
        heard = audio_runs(lp.audio, lp.proc, ids, clips) if lp.audio is not None and clips else []
        if lp.generation:
            mask = np.asarray(out["assistant_masks"])[0].astype(bool)
        else:
            replacements = out.get("text_replacement_offsets")
            if heard and not (replacements and replacements[0]):
                raise Reject(
                    "processor_error",
                    "the processor gives no text_replacement_offsets: cannot place the labels past "
                    "its expanded audio placeholders (give the template {% generation %} blocks)",
                )
            assert spans is not None  # found above for "prefix" labels (not lp.generation)
            mask = self._span_mask(lp, np.asarray(out["offset_mapping"])[0], spans, text, runs, replacements)
        for k in _DROP:
            out.pop(k, None)
        labels = np.where(mask, ids, IGNORE_INDEX)
        image_spans = [self._widen(lp.wrap, ids, s, e) for s, e in runs]
        audio_spans = [self._widen(lp.audio.wrap, ids, s, e) for s, e in heard] if lp.audio else []
        for s, e in image_spans + audio_spans:
            labels[s:e] = IGNORE_INDEX
        ex.text, ex.input_ids, ex.labels = text, ids.astype(np.int32), labels.astype(np.int32)
        ex.image_spans = image_spans
        ex.image_tokens = [int(np.count_nonzero(ids[s:e] == lp.image_token_id)) for s, e in runs]
        if clips:  # the clips are consumed: their tensors replace them (a later `_NoAudio` passes)
            ex.audio_tokens, ex.audio_tensors = audio_tensors(out, heard)
            ex.audio_spans, ex.audios = audio_spans, []
        ex.image_tensors, extra = self._split(out, n, len(ex.images))
        ex.extra.update(extra)
        return ex

    def _check_items(self, lp: _Loaded, ex: Example) -> None:
        """Reject a record whose markers do not match its images / clips, or that has images (clips) this
        processor has no image processor (audio feature extractor) for."""
        for marker, items, what in ((IMAGE_MARKER, ex.images, "image"), (AUDIO_MARKER, ex.audios, "audio")):
            found = sum(m["content"].count(marker) for m in ex.messages)
            found += ex.system.count(marker) if ex.system else 0
            if found != len(items):
                raise Reject(f"{what}_mismatch", f"{found} {marker} markers but {len(items)} {what}s")
        if ex.images and not lp.has_images:
            raise Reject("unsupported_image", f"the processor at {self.path} has no image processor")
        if ex.audios and lp.audio is None:
            raise Reject("unsupported_audio", f"the processor at {self.path} has no audio feature extractor")

    def _process(
        self, lp: _Loaded, conv: list[dict[str, Any]], images: list[Any], clips: list[np.ndarray], text: str
    ) -> dict[str, Any]:
        """The processor's outputs (numpy, batch of one) for the conversation, its images and its clips.

        "generation" labels: `apply_chat_template(..., tokenize=True, return_assistant_tokens_mask=True)`,
        the clips in the conversation's audio parts. "prefix" labels: the processor called on the rendered
        `text`, the images and the clips (`audio=`), as that method calls it (no special tokens added when
        the text starts with the tokenizer's BOS; a tokenizer never adds them), with the token offsets the
        labels need.
        """
        extra: dict[str, Any] = dict(self.processor_kwargs)
        if clips and lp.audio is not None:
            extra["sampling_rate"] = lp.audio.rate
        try:
            if lp.generation:
                kwargs: dict[str, Any] = dict(
                    chat_template=lp.template,
                    tokenize=True,
                    return_dict=True,
                    return_tensors="np",
                    return_assistant_tokens_mask=True,
                    **lp.template_kwargs,
                )
                if lp.text_only:
                    return dict(lp.tok.apply_chat_template(conv, tokenizer_kwargs=extra, **kwargs))
                kwargs["processor_kwargs"] = {**extra, **({"images": list(images)} if images else {})}
                return dict(lp.proc.apply_chat_template(with_clips(conv, clips) if clips else conv, **kwargs))
            extra["return_offsets_mapping"] = True
            if lp.text_only:
                return dict(lp.tok([text], add_special_tokens=False, return_tensors="np", **extra))
            bos = lp.tok.bos_token
            if bos is not None and text.startswith(bos):
                extra["add_special_tokens"] = False
            return dict(
                lp.proc(
                    text=[text],
                    images=list(images) if images else None,
                    return_tensors="np",
                    return_text_replacement_offsets=True,
                    **({"audio": list(clips)} if clips else {}),
                    **extra,
                )
            )
        except Exception as exc:  # noqa: BLE001 - whatever the processor raises on this record
            raise self._reject(lp, images, clips, exc) from None

    def _reject(self, lp: _Loaded, images: list[Any], clips: list[np.ndarray], exc: Exception) -> Reject:
        for k, img in enumerate(images):  # which image or clip? (only on the error path)
            try:
                lp.proc.image_processor(images=[img], return_tensors="np")
            except Exception as img_exc:  # noqa: BLE001
                return Reject("bad_image", f"images[{k}]: {_first_line(img_exc)}")
        bad = clip_reject(lp.audio, clips) if lp.audio is not None and clips else None
        return bad or Reject("processor_error", _first_line(exc))

    def _prefix_spans(self, lp: _Loaded, conv: list[dict[str, Any]], text: str) -> list[tuple[int, int]]:
        """Character spans of the assistant turns in `text` (module docstring, labels "prefix")."""
        turns = [k for k, m in enumerate(conv) if m["role"] == "assistant"]
        ups = iter(lp.render_many([conv[: k + 1] for k in turns if k + 1 < len(conv)]))
        heads = iter(lp.render_many([conv[:k] for k in turns if k], add_generation_prompt=True))
        spans = []
        for k in turns:
            upto = next(ups) if k + 1 < len(conv) else text
            if k:
                head = next(heads)
            else:  # nothing before: where the turn's content starts, from the same turn with no content
                m = conv[0]
                empty = lp.render([{**m, "content": "" if isinstance(m["content"], str) else []}])
                head = upto[: len(os.path.commonprefix([upto, empty]))]
            if not (text.startswith(upto) and upto.startswith(head)):
                raise Reject(
                    "template_error",
                    f"the chat template is not prefix-stable at message {k} "
                    f"(rendering messages[:{k + 1}] is not a prefix of the whole conversation): "
                    f"give it {{% generation %}} blocks",
                )
            end = len(upto.rstrip())
            if end > len(head):
                spans.append((len(head), end))
        return spans

    def _image_runs(self, lp: _Loaded, ids: np.ndarray, n_images: int) -> list[tuple[int, int]]:
        """Token spans of the runs of the image token: one per image, in order."""
        if lp.image_token_id is None or n_images == 0:
            return []
        is_img = np.concatenate([[False], ids == lp.image_token_id, [False]]).astype(np.int8)
        edges = np.flatnonzero(np.diff(is_img))
        runs = [(int(s), int(e)) for s, e in zip(edges[0::2], edges[1::2], strict=False)]
        if len(runs) != n_images:
            raise Reject(
                "image_mismatch",
                f"{len(runs)} runs of {lp.image_token} tokens for {n_images} "
                f"images (HFProcessor needs one run per image)",
            )
        return runs

    @staticmethod
    def _widen(wrap: tuple[list[int], list[int]], ids: np.ndarray, s: int, e: int) -> tuple[int, int]:
        """The run s:e widened by the tokens `wrap` says the template writes around each item."""
        before, after = wrap
        if before and s >= len(before) and ids[s - len(before) : s].tolist() == before:
            s -= len(before)
        if after and ids[e : e + len(after)].tolist() == after:
            e += len(after)
        return s, e

    @staticmethod
    def _span_mask(
        lp: _Loaded,
        offsets: np.ndarray,
        spans: list[tuple[int, int]],
        text: str,
        runs: list[tuple[int, int]],
        replacements: Any,
    ) -> np.ndarray:
        """Tokens overlapping the character spans of `text`, after the processor expanded each image
        placeholder (from its `text_replacement_offsets`, else from the image-token runs' offsets)."""
        ends: list[int] = []  # placeholder ends in `text`
        gained: list[int] = [0]  # characters the expansions up to and including each one added
        reps = list(replacements[0]) if replacements else []
        if reps:
            for r in reps:
                ends.append(int(r["span"][1]))
                gained.append(int(r["new_span"][1]) - int(r["span"][1]))
        elif runs:
            assert lp.image_token is not None  # image runs are found by the image token
            pos, width = 0, len(lp.image_token)
            for s, e in runs:
                at = text.index(lp.image_token, pos)
                pos = at + width
                if int(offsets[s][0]) != at + gained[-1]:
                    raise Reject(
                        "processor_error",
                        "cannot locate the expanded image placeholders in the "
                        "processor's offsets (give the template {% generation %} blocks)",
                    )
                ends.append(pos)
                gained.append(gained[-1] + int(offsets[e - 1][1]) - int(offsets[s][0]) - width)
        mask = np.zeros(len(offsets), dtype=bool)
        starts, stops = offsets[:, 0], offsets[:, 1]
        for a, b in spans:
            a += gained[int(np.searchsorted(ends, a, side="right"))]
            b += gained[int(np.searchsorted(ends, b, side="right"))]
            mask |= (starts < b) & (stops > a)
        return mask

    @staticmethod
    def _split(
        out: dict[str, Any], n: int, n_images: int
    ) -> tuple[list[dict[str, np.ndarray]], dict[str, np.ndarray]]:
        """(per-image tensors, the rest) of the processor's outputs (see the class docstring)."""
        arrays = {k: np.asarray(v) for k, v in out.items() if v is not None}
        per_image: list[dict[str, np.ndarray]] = [{} for _ in range(n_images)]
        extra: dict[str, np.ndarray] = {}
        grid = arrays.get("image_grid_thw")
        sizes = None
        if grid is not None and len(grid) == n_images:
            sizes = np.prod(grid, axis=-1).astype(np.int64)
        for key, arr in arrays.items():
            if arr.shape == (1, n):  # per token
                extra[key] = arr[0]
            elif n_images and sizes is not None and arr.ndim >= 1 and arr.shape[0] == int(sizes.sum()):
                bounds = np.concatenate([[0], np.cumsum(sizes)])
                for k in range(n_images):
                    per_image[k][key] = arr[bounds[k] : bounds[k + 1]]
            elif n_images and arr.ndim >= 1 and arr.shape[0] == n_images:
                for k in range(n_images):
                    per_image[k][key] = arr[k : k + 1]
            else:
                extra[key] = arr
        return (per_image if n_images else []), extra
