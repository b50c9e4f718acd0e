"""Module, function and signature sizes of batchd's packages, checked against limits a maintainer can carry.

    python tools/sizes.py                    # the largest modules and functions of the checked packages
    python tools/sizes.py --check            # exit 1, listing every violation in the checked packages
    python tools/sizes.py --check --layers batchd,service    # the same, for the packages named
    python tools/sizes.py --report           # per package: violations counted, largest module and function

The limits: no module over 600 lines, no function over 80 lines, no function over 8 parameters.

Lines are physical lines (docstrings and comments included), as an editor shows them; generated stubs
(`*_pb2*.py`) are left out. A function's size runs from its `def` (decorators excluded) to its last line;
a nested function counts inside its parent and on its own.

Parameters are every name a caller can bind by position or keyword: positional-only, ordinary and
keyword-only parameters. Not counted: a method's leading `self` or `cls`, and the catch-alls `*args` and
`**kwargs`. A dataclass's fields are not parameters: its generated `__init__` is not in the source, so a
record of many fields is the way to pass many values (an options object).

`--check --layers a,b` holds the packages named to all three limits. `--check` alone (what CI and
pre-commit run) holds every package of DEFAULT_CHECK, which is all of PACKAGES, to all three. `--report` and
the listing cover every package unless `--layers` names some. Reads the source with `ast` only.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("core", "proto", "service", "client", "batchd", "benchmarks")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_PARAMETERS = 8
LIMITS = ("module", "function", "parameters")
# What `--check` with no `--layers` holds each package to today: the four layers and benchmarks/ to every
# limit; batchd/ joins once its splits land (`--report` counts what is left).
DEFAULT_CHECK: dict[str, tuple[str, ...]] = {package: LIMITS for package in PACKAGES}
DEFAULT_LAYERS = tuple(DEFAULT_CHECK)


@dataclass(frozen=True)
class Function:
    """A function or method: qualified name (`Class.method`, `outer.inner`), first line, size, parameters."""

    name: str
    line: int
    lines: int
    parameters: int


def sources(root: Path = ROOT, layers: tuple[str, ...] = DEFAULT_LAYERS) -> list[Path]:
    """Every hand-written .py file of the layers, sorted."""
    return sorted(p for d in layers for p in (root / d).rglob("*.py") if "_pb2" not in p.name)


def module_lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The parameters a caller binds by name or position; leading `self`/`cls`, `*args`, `**kwargs` aside."""
    a = node.args
    named = [*a.posonlyargs, *a.args]
    if named and named[0].arg in ("self", "cls"):
        named = named[1:]
    return len(named) + len(a.kwonlyargs)


def functions(path: Path) -> list[Function]:
    """Every function and method in `path`, in source order (a nested one after its parent)."""
    out: list[Function] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                size = child.end_lineno - child.lineno + 1  # type: ignore[operator]
                out.append(Function(name, child.lineno, size, parameter_count(child)))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), "")
    return out


def function_lines(path: Path) -> list[tuple[int, str, int]]:
    """(lines, qualified name, first line) of every function and method in `path`."""
    return [(f.lines, f.name, f.line) for f in functions(path)]


def _module_violations(root: Path, path: Path, limits: tuple[str, ...]) -> list[str]:
    rel = path.relative_to(root)
    found = []
    n = module_lines(path)
    if "module" in limits and n > MAX_MODULE_LINES:
        found.append(f"{rel}: {n} lines (limit {MAX_MODULE_LINES})")
    for f in functions(path):
        if "function" in limits and f.lines > MAX_FUNCTION_LINES:
            found.append(f"{rel}:{f.line}: {f.name} is {f.lines} lines (limit {MAX_FUNCTION_LINES})")
        if "parameters" in limits and f.parameters > MAX_PARAMETERS:
            found.append(f"{rel}:{f.line}: {f.name} has {f.parameters} parameters (limit {MAX_PARAMETERS})")
    return found


def violations(root: Path = ROOT, layers: tuple[str, ...] | None = None) -> list[str]:
    """One line per module over MAX_MODULE_LINES, per function over MAX_FUNCTION_LINES and per function
    over MAX_PARAMETERS parameters (sorted by path, then source order). `layers` named: those packages,
    every limit; None: each package of DEFAULT_CHECK, the limits it lists."""
    checks = DEFAULT_CHECK if layers is None else dict.fromkeys(layers, LIMITS)
    return [
        v
        for layer, limits in checks.items()
        for p in sources(root, (layer,))
        for v in _module_violations(root, p, limits)
    ]


def report(root: Path = ROOT, layers: tuple[str, ...] = PACKAGES) -> list[str]:
    """Per package, one line: modules over the line limit, functions over the line and parameter limits,
    and its largest module and function (the counts a change's closing note quotes)."""
    head = f"{'package':<11} {'modules':>7} {'>600':>5} {'fn>80':>5} {'args>8':>6}"
    out = [f"{head}  largest module; largest function"]
    for layer in layers:
        paths = sources(root, (layer,))
        if not paths:
            out.append(f"{layer:<11} {0:>7}  (no modules)")
            continue
        mods = [(module_lines(p), p) for p in paths]
        funcs = [(f, p) for p in paths for f in functions(p)]
        big_mod = max(mods, key=lambda m: m[0])
        big_fn = max(funcs, key=lambda fp: fp[0].lines, default=None)
        fn_text = f"{big_fn[1].relative_to(root)}:{big_fn[0].name} {big_fn[0].lines}" if big_fn else "-"
        out.append(
            f"{layer:<11} {len(paths):>7} {sum(n > MAX_MODULE_LINES for n, _ in mods):>5} "
            f"{sum(f.lines > MAX_FUNCTION_LINES for f, _ in funcs):>5} "
            f"{sum(f.parameters > MAX_PARAMETERS for f, _ in funcs):>6}  "
            f"{big_mod[1].relative_to(root)} {big_mod[0]}; {fn_text}"
        )
    return out


def _layers(text: str) -> tuple[str, ...]:
    names = tuple(n.strip().strip("/") for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in PACKAGES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"packages are a comma list of {', '.join(PACKAGES)}: {text=}")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument(
        "--check", action="store_true", help="exit 1 on a module, function or signature over its limit"
    )
    mode.add_argument(
        "--report", action="store_true", help="per package: violations counted, largest module/function"
    )
    ap.add_argument(
        "--layers",
        type=_layers,
        default=None,
        help=f"comma-separated packages of {','.join(PACKAGES)} (default: --check: DEFAULT_CHECK; else all)",
    )
    ap.add_argument("--top", type=int, default=10, help="how many of the largest to list (default 10)")
    args = ap.parse_args(argv)
    if args.check:
        found = violations(ROOT, args.layers)
        for v in found:
            print(v)
        if not found:
            print(
                f"no module over {MAX_MODULE_LINES} lines, no function over {MAX_FUNCTION_LINES}, "
                f"none over {MAX_PARAMETERS} parameters"
            )
        return 1 if found else 0
    layers = args.layers or PACKAGES
    if args.report:
        print("\n".join(report(ROOT, layers)))
        return 0
    paths = sources(ROOT, layers)
    mods = sorted(((module_lines(p), str(p.relative_to(ROOT))) for p in paths), reverse=True)
    funcs = sorted(
        ((f.lines, f"{p.relative_to(ROOT)}:{f.line} {f.name}") for p in paths for f in functions(p)),
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
