"""Prints batchd's import graph between its layers, and checks it against the one-way arrows.

    python tools/import_graph.py            # the package-to-package graph, with counts
    python tools/import_graph.py --check    # exit 1 on any import against the rules below
    python tools/import_graph.py --cycles   # every import cycle between the modules of one package

Layers, each importing only from those before it:
    core -> proto -> service (service.preprocess inside it) -> client -> app (the `batchd/` package)

Also flagged: an import of another package's private module (`batchd.service._x` from outside
`batchd.service`), torch imported anywhere in core, proto or service, an import cycle between the
modules of one package (every import counts: top-level, deferred in a function, under
`if TYPE_CHECKING:`), and in `tests/*.py` and `benchmarks/*.py` any import of a private module or
private name of batchd (`batchd.x._y`, `from batchd.x import _y`): those use public names.
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
    """Every import against the layers, into another package's private module, or of torch below the
    client."""
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
    """Package -> package import counts (batchd's own packages only), and how many imports sit in
    functions."""
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


def _owning_module(target: str, known: set[str]) -> str:
    """The module an import target names: itself, or the module a name was imported from."""
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target


def module_edges(mods: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {module of the same package it imports: first line}, every import counted (top level,
    in a function, under `if TYPE_CHECKING:`). A package's `__init__` belongs to the package."""
    known = set(mods)
    out: dict[str, dict[str, int]] = {m: {} for m in mods}
    for mod, path in mods.items():
        pkg = package_of(mod, mods)
        for line, target, _ in imports(mod, path, known):
            dst = _owning_module(target, known)
            if dst and dst != mod and package_of(dst, mods) == pkg:
                out[mod].setdefault(dst, line)
    return out


def _path(edges: dict[str, dict[str, int]], src: str, dst: str, inside: set[str]) -> list[str] | None:
    """A shortest path src -> ... -> dst through `inside` (breadth first, neighbours in sorted order)."""
    prev = {src: src}
    frontier = [src]
    while frontier:
        nxt = []
        for u in frontier:
            for v in sorted(edges[u]):
                if v in inside and v not in prev:
                    prev[v] = u
                    if v == dst:
                        path = [v]
                        while path[-1] != src:
                            path.append(prev[path[-1]])
                        return path[::-1]
                    nxt.append(v)
        frontier = nxt
    return None


def _components(edges: dict[str, dict[str, int]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            u, it = work[-1]
            v = next(it, None)
            if v is not None:
                if v not in index:
                    index[v] = low[v] = len(index)
                    stack.append(v)
                    on.add(v)
                    work.append((v, iter(sorted(edges[v]))))
                elif v in on:
                    low[u] = min(low[u], index[v])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[u])
            if low[u] == index[u]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == u:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def cycles(mods: dict[str, Path]) -> list[list[str]]:
    """Import cycles between the modules of one package, each as [a, b, ..., a].

    For every import u -> v inside a strongly connected component, the cycle of u -> v and a shortest
    path back, deduplicated: every import that lies on some cycle shows in at least one. O(E x (V + E))."""
    edges = module_edges(mods)
    seen: set[tuple[str, ...]] = set()
    out = []
    for comp in _components(edges):
        for u in sorted(comp):
            for v in sorted(edges[u]):
                back = _path(edges, v, u, comp) if v in comp else None
                if back is None:
                    continue
                ring = [u, *back[:-1]]
                k = ring.index(min(ring))
                key = tuple(ring[k:] + ring[:k])
                if key not in seen:
                    seen.add(key)
                    out.append([*key, key[0]])
    return sorted(out, key=lambda c: (len(c), c))


def _short(module: str) -> str:
    return module.removeprefix("batchd.")


def cycle_violations(mods: dict[str, Path]) -> list[str]:
    """One line per import cycle inside a package: `core._a -> core._b -> core._a`."""
    return [f"import cycle: {' -> '.join(_short(m) for m in c)}" for c in cycles(mods)]


def script_files(root: Path | None = None) -> dict[str, Path]:
    """Module-like name -> file for `tests/*.py` and `benchmarks/*.py` (they use batchd's public names)."""
    root = ROOT if root is None else root
    out = {}
    for d in ("tests", "benchmarks"):
        for path in sorted((root / d).glob("*.py")):
            out[f"{d}.{path.stem}"] = path
    return out


def private_uses(scripts: dict[str, Path], mods: dict[str, Path]) -> list[str]:
    """Every import in `scripts` of a private module or private name of batchd, by file and line."""
    known = set(mods)
    out = []
    for name, path in scripts.items():
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        found: dict[int, list[str]] = {}
        for line, target, _ in imports(name, path, known):
            if not (target == "batchd" or target.startswith("batchd.")):
                continue
            if any(p.startswith("_") and not p.startswith("__") for p in target.split(".")):
                names = found.setdefault(line, [])
                if not any(target.startswith(n + ".") for n in names):
                    names.append(target)
        out += [f"{where}:{line}: imports {', '.join(t)} (use public names)" for line, t in found.items()]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 on any import against the rules")
    ap.add_argument("--cycles", action="store_true", help="print the import cycles inside each package")
    args = ap.parse_args(argv)
    mods = modules()
    if args.cycles:
        found = cycles(mods)
        print("\n".join(" -> ".join(_short(m) for m in c) for c in found) or "no import cycle")
        return 0
    bad = violations(mods)
    if args.check:
        bad += cycle_violations(mods) + private_uses(script_files(), mods)
        print("\n".join(bad) or "no import runs against the layers, no import cycle, no private use")
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
