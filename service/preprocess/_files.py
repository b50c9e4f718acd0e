"""Dataset files: local paths, directories and filesystem URIs, read through pyarrow's filesystems.

Files are given as local paths, directories (every supported file inside, sorted; hidden files and
Hugging Face metadata such as `dataset_info.json` skipped) or filesystem URIs that
pyarrow understands (`file://`, `s3://`, `gs://`, `hdfs://`...); the format comes from the extension
(`FORMATS`) unless forced. Relative image paths in a record are relative to its file's directory
(`_base_dir`). Nothing here knows what a record is.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import pyarrow.fs as pafs

FORMATS = ("parquet", "jsonl", "arrow")
_EXTENSIONS = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
    ".arrows": "arrow",
}


def _is_uri(path: str) -> bool:
    return "://" in path


def filesystem_of(path: str | os.PathLike[str]) -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path inside it) for a local path or a filesystem URI."""
    s = os.fspath(path)
    if _is_uri(s):
        fs, inner = pafs.FileSystem.from_uri(s)
        return fs, str(inner)
    return pafs.LocalFileSystem(), os.path.abspath(s)


def _format_of(path: str, fmt: str | None) -> str:
    if fmt is not None:
        if fmt not in FORMATS:
            raise ValueError(f"format must be one of {list(FORMATS)}, got format={fmt!r}")
        return fmt
    ext = os.path.splitext(path)[1].lower()
    if ext not in _EXTENSIONS:
        raise ValueError(
            f"{path}: cannot tell the format from the extension {ext!r}; "
            f"pass format= one of {list(FORMATS)} (known extensions: {sorted(_EXTENSIONS)})"
        )
    return _EXTENSIONS[ext]


def expand_paths(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[str]:
    """Files behind `paths`: each a file, a directory (its supported files, sorted) or a URI."""
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not items:
        raise ValueError("no dataset files given")
    out: list[str] = []
    for item in items:
        s = os.fspath(item)
        fs, inner = filesystem_of(s)
        info = fs.get_file_info(inner)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"dataset file not found: {s}")
        if info.type == pafs.FileType.Directory:
            found = sorted(
                i.path
                for i in fs.get_file_info(pafs.FileSelector(inner, recursive=False))
                if i.type == pafs.FileType.File
                and os.path.splitext(i.path)[1].lower() in _EXTENSIONS
                and not _metadata_file(i.path)
            )
            if not found:
                raise FileNotFoundError(f"no {sorted(_EXTENSIONS)} files in directory {s}")
            prefix = s[: s.index("://") + 3] if _is_uri(s) else ""
            out.extend(prefix + f if prefix and not f.startswith(prefix) else f for f in found)
        else:
            out.append(s if _is_uri(s) else os.path.abspath(s))
    return out


# Files a dataset directory may hold beside its records (Hugging Face `save_to_disk` / hub metadata).
_METADATA_NAMES = ("dataset_info.json", "dataset_dict.json", "state.json", "dataset_infos.json")


def _metadata_file(path: str) -> bool:
    """A hidden file (our JSONL index among them) or a known metadata file: not records, in a directory."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return name.startswith(".") or name in _METADATA_NAMES


def _base_dir(path: str) -> str:
    """The directory that relative image paths in `path`'s records are relative to."""
    if _is_uri(path):
        return path.rsplit("/", 1)[0]
    return os.path.dirname(os.path.abspath(path))


def _read_bytes(path: str) -> bytes:
    fs, inner = filesystem_of(path)
    with fs.open_input_stream(inner) as f:
        return bytes(f.read())
