"""Prints batchd's import graph between its layers, and checks it against the one-way arrows.

    python tools/import_graph.py            # the package-to-package graph, with counts
    python tools/import_graph.py --check    # exit 1, listing every import against the arrows

Layers, each importing only from those before it:
    core -> proto -> service (service.preprocess inside it) -> client -> app (the `batchd/` package)

Also flagged: an import of another package's private module (`batchd.service._x` from outside
`batchd.service`), and torch imported anywhere in core, proto or service.
Reads the source with `ast` only; nothing is imported.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Source directories of the one namespace `batchd` (see pyproject's package-dir).
PACKAGE_DIRS = {
    "batchd.core": "core",
    "batchd.proto": "proto",
    "batchd.service": "service",
    "batchd.client": "client",
    "batchd": "batchd",
}
LAYERS = ["batchd.core", "batchd.proto", "batchd.service", "batchd.client", "batchd"]
# Inside service, service.preprocess is the lower sub-layer: the rank service uses it, never the reverse.
NO_TORCH = {"batchd.core", "batchd.proto", "batchd.service"}


def modules() -> dict[str, Path]:
    """Module name -> file, for every .py file of the package."""
    out = {}
    for pkg, d in PACKAGE_DIRS.items():
        for path in sorted((ROOT / d).rglob("*.py")):
            rel = path.relative_to(ROOT / d).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


def layer_of(module: str) -> str:
    """The layer (a key of PACKAGE_DIRS) a module belongs to."""
    for pkg in LAYERS[:-1]:
        if module == pkg or module.startswith(pkg + "."):
            return pkg
    return "batchd"


def imports(module: str, path: Path, known: set[str]) -> list[tuple[int, str, bool]]:
    """(line, imported module, inside a function) for every import in a file, relative ones resolved.

    `from pkg import name` counts as an import of `pkg.name` when that is a module (`known`)."""
    tree = ast.parse(path.read_text(), str(path))
    base = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = []

    def visit(node, in_func):
        for child in ast.iter_child_nodes(node):
            f = in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                out.extend((child.lineno, a.name, in_func) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    parts = base.split(".")
                    anchor = ".".join(parts[: len(parts) - child.level + 1])
                    target = f"{anchor}.{child.module}" if child.module else anchor
                else:
                    target = child.module or ""
                subs = [f"{target}.{a.name}" for a in child.names if f"{target}.{a.name}" in known]
                names = [a.name for a in child.names if f"{target}.{a.name}" not in known]
                out.extend((child.lineno, m, in_func) for m in subs)
                if names:
                    out.append((child.lineno, target, in_func))
                # `from batchd.service._x import _y`: a private name, even if not a module
                out.extend(
                    (child.lineno, f"{target}.{n}", in_func)
                    for n in names
                    if n.startswith("_") and not n.startswith("__")
                )
            visit(child, f)

    visit(tree, False)
    return out


def violations(mods: dict[str, Path]) -> list[str]:
    """Every import against the layers, into another package's private module, or of torch below the client."""
    rank = {p: i for i, p in enumerate(LAYERS)}
    known = set(mods)
    out = []
    for mod, path in mods.items():
        src = layer_of(mod)
        for line, target, _ in imports(mod, path, known):
            where = f"{path.relative_to(ROOT)}:{line}"
            if target == "torch" or target.startswith("torch."):
                if src in NO_TORCH:
                    out.append(f"{where}: {mod} imports torch ({src} must not need it)")
                continue
            if not (target == "batchd" or target.startswith("batchd.")):
                continue
            dst = layer_of(target)
            if rank[dst] > rank[src]:
                out.append(f"{where}: {mod} imports {target} ({src} -> {dst} runs against the layers)")
            elif (
                dst == "batchd.service"
                and mod.startswith("batchd.service.preprocess")
                and not target.startswith("batchd.service.preprocess")
            ):
                out.append(
                    f"{where}: {mod} imports {target} (service.preprocess is below the rest of service)"
                )
            private = [p for p in target.split(".") if p.startswith("_") and not p.startswith("__")]
            if private:
                owner = target.split("." + private[0])[0]
                if not (mod == owner or mod.startswith(owner + ".")):
                    out.append(f"{where}: {mod} imports {target}, a private module of {owner}")
    return out


def package_of(module: str, mods: dict[str, Path]) -> str:
    """The package a module belongs to (itself for a package's __init__)."""
    if module in mods and mods[module].name == "__init__.py":
        return module
    return module.rsplit(".", 1)[0]


def graph(mods: dict[str, Path]) -> tuple[Counter, int]:
    """Package -> package import counts (batchd's own packages only), and how many imports sit in functions."""
    edges: Counter = Counter()
    known = set(mods)
    in_funcs = 0
    for mod, path in mods.items():
        for _, target, in_func in imports(mod, path, known):
            in_funcs += in_func
            while target and target not in known:  # a name imported from a module: its module
                target = target.rpartition(".")[0]
            if not target.startswith("batchd"):
                continue
            src, dst = package_of(mod, mods), package_of(target, mods)
            if src != dst:
                edges[(src, dst)] += 1
    return edges, in_funcs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 on any import against the layers")
    args = ap.parse_args(argv)
    mods = modules()
    bad = violations(mods)
    if args.check:
        print("\n".join(bad) or "no import runs against the layers")
        return 1 if bad else 0
    edges, in_funcs = graph(mods)
    print("package -> package   (imports)")
    for (a, b), n in sorted(edges.items()):
        mark = "" if LAYERS.index(layer_of(b)) <= LAYERS.index(layer_of(a)) else "   <-- against the layers"
        if "._" in b and not b.startswith(a.split("._")[0]):
            mark = "   <-- another package's private module"
        print(f"  {a:28s} -> {b:28s} {n:3d}{mark}")
    print(
        f"{len(bad)} imports against the layers or into another package's private module; "
        f"{in_funcs} imports inside functions"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
