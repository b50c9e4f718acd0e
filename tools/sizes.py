"""Module and function sizes of batchd's layers, checked against the limits a maintainer can carry.

    python tools/sizes.py            # the largest modules and functions of core, proto, service, client
    python tools/sizes.py --check    # exit 1, listing every module over 600 lines or function over 80

Counts physical lines (docstrings and comments included), as an editor shows them; generated stubs
(`*_pb2*.py`) are left out. A function's size runs from its `def` (decorators excluded) to its last line;
a nested function counts inside its parent and on its own. Reads the source with `ast` only.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("core", "proto", "service", "client")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def sources(root: Path = ROOT, layers: tuple[str, ...] = LAYERS) -> list[Path]:
    """Every hand-written .py file of the layers, sorted."""
    return sorted(p for d in layers for p in (root / d).rglob("*.py") if "_pb2" not in p.name)


def module_lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def function_lines(path: Path) -> list[tuple[int, str, int]]:
    """(lines, qualified name, first line) of every function and method in `path`."""
    out: list[tuple[int, str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                out.append((child.end_lineno - child.lineno + 1, name, child.lineno))  # type: ignore[operator]
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), "")
    return out


def violations(root: Path = ROOT, layers: tuple[str, ...] = LAYERS) -> list[str]:
    """One line per module over MAX_MODULE_LINES and per function over MAX_FUNCTION_LINES."""
    found = []
    for path in sources(root, layers):
        rel = path.relative_to(root)
        n = module_lines(path)
        if n > MAX_MODULE_LINES:
            found.append(f"{rel}: {n} lines (limit {MAX_MODULE_LINES})")
        for lines, name, line in function_lines(path):
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{rel}:{line}: {name} is {lines} lines (limit {MAX_FUNCTION_LINES})")
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 on a module or function over its limit")
    ap.add_argument("--top", type=int, default=10, help="how many of the largest to list (default 10)")
    args = ap.parse_args(argv)
    if args.check:
        found = violations()
        for v in found:
            print(v)
        if not found:
            print(f"no module over {MAX_MODULE_LINES} lines, no function over {MAX_FUNCTION_LINES}")
        return 1 if found else 0
    paths = sources()
    mods = sorted(((module_lines(p), str(p.relative_to(ROOT))) for p in paths), reverse=True)
    funcs = sorted(
        ((n, f"{p.relative_to(ROOT)}:{line} {name}") for p in paths for n, name, line in function_lines(p)),
        reverse=True,
    )
    print(f"{len(paths)} modules, {sum(n for n, _ in mods)} lines; largest modules:")
    for n, name in mods[: args.top]:
        print(f"  {n:5d}  {name}")
    print("largest functions:")
    for n, name in funcs[: args.top]:
        print(f"  {n:5d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
