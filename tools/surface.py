"""Who uses each name that batchd.core, batchd.client and batchd.service.preprocess export.

    python tools/surface.py            # per package: every exported name and who uses it
    python tools/surface.py --check    # exit 1 on an export no other layer or user doc uses

A package's `__all__` holds what another layer or a user imports. A name stays when
  - a module of another layer uses it: `from batchd.core import X`, `core.X` through an imported
    `batchd.core`, or a string table naming the package (`batchd`'s `_EXPORTS`); the `testing`
    modules, tests/ and benchmarks/ do not count; or
  - a user doc shows it (README.md and docs/, the maintainer's map docs/codebase.md excepted): a
    Python code block uses it, the text names it whole (`batchd.core.plan_vision`), or it is
    backticked in a section whose heading, or a table row whose first cell, names the package; or
  - the package's own docstring (`help(batchd.client)`) names it in backticks or its example uses it,
    or a docstring or comment of batchd's source names it whole (`help(train_step)` points at
    `batchd.client.check_model_batch`); or
  - it is in `EXTENSION_API`, the few names a user builds on that no doc shows yet, each with its reason.
What only tests and benchmarks need lives in the package's own `testing` module (no stability
promise), and `batchd.testing` gathers those. Also flagged: an `__all__` that is not sorted or holds
a private name. Reads the source with `ast`; imports nothing.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The packages whose exports are checked -> their directories.
PACKAGES = {
    "batchd.core": "core",
    "batchd.client": "client",
    "batchd.service.preprocess": "service/preprocess",
}
SOURCES = {
    "core": "batchd.core",
    "proto": "batchd.proto",
    "service": "batchd.service",
    "client": "batchd.client",
    "batchd": "batchd",
}
ALIASES = {"batchd.preprocess": "batchd.service.preprocess"}  # `batchd.preprocess` re-exports it whole
# Names kept without another layer's import or a user doc: what a user builds on, each group with why.
EXTENSION_API = {
    "batchd.service.preprocess": {
        # The parts of a custom chain (`RaySource(stages=...)`, `Preprocessor`): the stage contract
        # (`_stage`'s docstring) and the built-in stages `default_stages` composes.
        "ChatTemplate",
        "Example",
        "LlavaVision",
        "Qwen2Audio",
        "Qwen2VLVision",
        "RandomResizedCrop",
        "Stage",
        "StageContext",
        "SystemPrompt",
        "Tokenize",
        "Truncate",
        "TurnSubsample",
    },
}
USER_DOCS_EXCEPT = {"docs/codebase.md"}


def _norm(module: str) -> str:
    return ALIASES.get(module, module)


def _module_of(path: Path, root: Path) -> tuple[str, bool] | None:
    """(dotted module, is a package __init__) for a file of batchd's source dirs, else None."""
    rel = path.relative_to(root)
    if rel.parts[0] not in SOURCES:
        return None
    parts = [p for p in rel.with_suffix("").parts[1:] if p != "__init__"]
    return ".".join([SOURCES[rel.parts[0]], *parts]), path.name == "__init__.py"


def uses_in(source: str, module: tuple[str, bool] | None = None) -> set[tuple[str, str]]:
    """(package, name) for every use in `source` of a name of batchd.core, batchd.client or
    batchd.service.preprocess: from-imports, attributes of an imported package, string tables."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    targets = set(PACKAGES)
    alias: dict[str, str] = {}
    out: set[tuple[str, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                alias[a.asname or a.name.split(".")[0]] = _norm(a.name) if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level and module:
                parts = module[0].split(".") if module[1] else module[0].split(".")[:-1]
                anchor = ".".join(parts[: len(parts) - node.level + 1])
                target = f"{anchor}.{node.module}" if node.module else anchor
            target = _norm(target)
            for a in node.names:
                sub = _norm(f"{target}.{a.name}")
                if sub in targets:
                    alias[a.asname or a.name] = sub
                elif target in targets:
                    out.add((target, a.name))

    def dotted(n: ast.AST) -> str | None:
        if isinstance(n, ast.Name):
            return alias.get(n.id)
        if isinstance(n, ast.Attribute):
            base = dotted(n.value)
            return None if base is None else _norm(f"{base}.{n.attr}")
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = dotted(node.value)
            if base in targets:
                out.add((base, node.attr))
        elif isinstance(node, ast.Dict):  # name -> "package" or ("package", "name") tables
            for k, v in zip(node.keys, node.values, strict=True):
                if not (isinstance(k, ast.Constant) and isinstance(k.value, str)):
                    continue
                if isinstance(v, ast.Constant) and isinstance(v.value, str) and _norm(v.value) in targets:
                    out.add((_norm(v.value), k.value))
                elif isinstance(v, ast.Tuple) and len(v.elts) == 2 and isinstance(v.elts[0], ast.Constant):
                    pkg, name = v.elts[0].value, v.elts[1]
                    if isinstance(pkg, str) and _norm(pkg) in targets and isinstance(name, ast.Constant):
                        out.add((_norm(pkg), name.value))
    return out


def code_blocks(text: str) -> list[str]:
    """The Python (or unlabelled) fenced code blocks of a markdown text."""
    out, block, lang = [], None, ""
    for line in text.splitlines():
        fence = line.strip()
        if fence.startswith("```"):
            if block is None:
                block, lang = [], fence[3:].strip()
            else:
                if lang in ("python", "py", ""):
                    out.append("\n".join(block))
                block = None
        elif block is not None:
            block.append(line)
    return out


_QUALIFIED = re.compile(r"(?<![\w.])(batchd\.(?:core|client|service\.preprocess|preprocess))\.(\w+)(?![\w*])")
_TICKED = re.compile(r"`([^`\n]+)`")


def doc_uses(text: str) -> set[tuple[str, str]]:
    """(package, name) a markdown text shows: in code blocks, named whole, or backticked in a section
    (heading) or table row (first cell) that names the package in backticks."""
    out = set()
    for block in code_blocks(text):
        out |= uses_in(block)
    out |= {(_norm(m.group(1)), m.group(2)) for m in _QUALIFIED.finditer(text)}
    section: str | None = None
    for line in text.splitlines():
        if line.startswith("#"):
            named = [_norm(t) for t in _TICKED.findall(line) if _norm(t) in PACKAGES]
            section = named[0] if named else None
        row = None
        if line.startswith("|"):
            first = _TICKED.findall(line.split("|")[1]) if line.count("|") > 2 else []
            row = next((_norm(t) for t in first if _norm(t) in PACKAGES), None)
        for pkg in {p for p in (section, row) if p}:
            for ticked in _TICKED.findall(line):
                out |= {(pkg, w) for w in re.findall(r"\w+", ticked)}
    return out


def docstring_uses(pkg: str, source: str) -> set[tuple[str, str]]:
    """(pkg, name) a package's docstring shows: backticked, or used by its indented example."""
    doc = ast.get_docstring(ast.parse(source), clean=True) or ""
    out = {(pkg, w) for ticked in _TICKED.findall(doc) for w in re.findall(r"\w+", ticked)}
    example = [line[4:] for line in doc.splitlines() if line.startswith("    ")]
    for line in example:  # line by line: an example's lines need not parse together
        out |= uses_in(line.strip())
    return out


def exports(root: Path = ROOT) -> dict[str, list[str]]:
    """Package -> its `__all__`, read from its `__init__.py`."""
    out = {}
    for pkg, d in PACKAGES.items():
        tree = ast.parse((root / d / "__init__.py").read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                out[pkg] = [ast.literal_eval(e) for e in node.value.elts]  # type: ignore[attr-defined]
    return out


def users(root: Path = ROOT) -> dict[tuple[str, str], set[str]]:
    """(package, name) -> who uses it: a file (`service/_x.py`), a doc or a package's docstring
    (`docs/a.md (doc)`), a source file whose docstring or comment names it whole (`client/_y.py (text)`).
    The package's own files, `testing` modules, tests/ and benchmarks/ are left out (module docstring)."""
    out: dict[tuple[str, str], set[str]] = defaultdict(set)
    for d in SOURCES:
        for path in sorted((root / d).rglob("*.py")):
            if path.stem == "testing":
                continue
            rel = path.relative_to(root).as_posix()
            text = path.read_text()
            for pkg, name in uses_in(text, _module_of(path, root)):
                if not rel.startswith(PACKAGES[pkg] + "/"):
                    out[(pkg, name)].add(rel)
            for m in _QUALIFIED.finditer(text):  # a docstring's or comment's pointer to the public name
                out[(_norm(m.group(1)), m.group(2))].add(rel + " (text)")
    for pkg, d in PACKAGES.items():
        for key in docstring_uses(pkg, (root / d / "__init__.py").read_text()):
            out[key].add(f"{d}/__init__.py (doc)")
    docs = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    for path in docs:
        rel = path.relative_to(root).as_posix()
        if rel not in USER_DOCS_EXCEPT:
            for key in doc_uses(path.read_text()):
                out[key].add(rel + " (doc)")
    return out


def pointers(root: Path = ROOT) -> set[tuple[str, str, str]]:
    """(package, name, file) for every whole name (`batchd.core.plan_vision`) in batchd's source,
    benchmarks, README.md and docs/: a name a reader is sent to."""
    files = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    for d in [*SOURCES, "benchmarks"]:
        files += sorted((root / d).rglob("*.py"))
    return {
        (_norm(m.group(1)), m.group(2), path.relative_to(root).as_posix())
        for path in files
        for m in _QUALIFIED.finditer(path.read_text())
    }


def problems(root: Path = ROOT) -> list[str]:
    """One line per export against the rules: unsorted, private, or used by no other layer or doc."""
    used = users(root)
    bad = []
    for pkg, names in exports(root).items():
        if names != sorted(names):
            bad.append(f"{pkg}.__all__ is not sorted")
        bad += [f"{pkg}.{n}: a private name in __all__" for n in names if n.startswith("_")]
        allowed = EXTENSION_API.get(pkg, set())
        bad += [
            f"{pkg}.{n}: no other layer or user doc uses it (tests' and benchmarks' helpers belong in "
            f"{pkg}.testing, gathered by batchd.testing)"
            for n in names
            if not used.get((pkg, n)) and n not in allowed
        ]
        bad += [f"{pkg}: EXTENSION_API names {n}, not exported" for n in sorted(allowed - set(names))]
    every = exports(root)
    for pkg, name, where in sorted(pointers(root)):
        module = root / PACKAGES[pkg] / name
        if name not in every[pkg] and not name.startswith("_") and not module.with_suffix(".py").exists():
            bad.append(f"{where}: names {pkg}.{name}, which {pkg} does not export")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 on an export against the rules")
    args = ap.parse_args(argv)
    if args.check:
        bad = problems()
        print("\n".join(bad) or "every export is used by another layer or a user doc")
        return 1 if bad else 0
    used = users()
    for pkg, names in exports().items():
        print(f"{pkg} ({len(names)} names)")
        for n in names:
            where = sorted(used.get((pkg, n), ()))
            if not where and n in EXTENSION_API.get(pkg, set()):
                where = ["EXTENSION_API"]
            print(f"  {n:28s} {', '.join(where) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
