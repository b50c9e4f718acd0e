"""Each layer exports what another layer or a user imports; what only tests use is in `batchd.testing`.

`tools/surface.py` finds who uses every name that `batchd.core`, `batchd.client` and
`batchd.service.preprocess` export (another layer's import, a user doc, a docstring pointing at it);
these tests fail on an export that nobody outside its package uses, an unsorted `__all__` or one with a
private name, a doc or docstring naming `batchd.<layer>.X` that the layer does not export, and on
`batchd.testing` not gathering each layer's own `testing` module whole. The controls feed the checker a
small synthetic tree, so a checker that stopped seeing uses (or misuses) fails here too.
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import batchd.testing

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("surface", REPO / "tools" / "surface.py")
surface = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(surface)

LAYERS = ["batchd.core", "batchd.client", "batchd.service.preprocess"]
TESTING = [f"{layer}.testing" for layer in LAYERS]


def test_every_export_is_used_by_another_layer_or_a_user_doc():
    bad = surface.problems()
    assert not bad, "exports against the rules (see tools/surface.py):\n" + "\n".join(bad)


def test_the_checker_reads_the_real_exports_and_their_users():
    exports = surface.exports()
    assert set(exports) == set(LAYERS)
    for layer in LAYERS:
        assert exports[layer] == importlib.import_module(layer).__all__, layer
    used = surface.users()
    # one of each kind of use, so a scanner that stopped seeing one fails here
    assert "batchd/__init__.py" in used[("batchd.core", "JobSpec")]  # a string table
    assert "service/rank/_core.py" in used[("batchd.core", "Delivery")]  # an import from another layer
    assert "docs/integrations.md (doc)" in used[("batchd.client", "BatchdTrainer")]  # a doc's code block
    assert "docs/workloads.md (doc)" in used[("batchd.core", "parse_workload")]  # named whole in a doc
    assert "docs/internals.md (doc)" in used[("batchd.core", "Liveness")]  # the doc's batchd.core section
    assert "client/__init__.py (doc)" in used[("batchd.client", "optimizer_updates")]  # its own docstring
    assert "client/_train.py (text)" in used[("batchd.client", "check_model_batch")]  # a docstring's pointer


def _layer(root: Path, d: str, names: list[str], doc: str = "") -> None:
    (root / d).mkdir(parents=True, exist_ok=True)
    body = "".join(f"{n} = 1\n" for n in names if not n.startswith("__"))
    all_ = "".join(f'    "{n}",\n' for n in names)
    (root / d / "__init__.py").write_text(f'"""{doc}"""\n\n{body}\n__all__ = [\n{all_}]\n')


def test_the_checker_sees_each_kind_of_use_and_of_misuse(tmp_path):
    _layer(
        tmp_path,
        "core",
        [
            "_private",
            "by_code_block",
            "by_docstring",
            "by_layer",
            "by_row",
            "by_section",
            "by_table",
            "by_whole",
            "only_tests",
            "unused",
        ],
        doc="The core: `by_docstring`.",
    )
    _layer(tmp_path, "client", ["b", "a"])  # unsorted
    _layer(tmp_path, "service/preprocess", ["Stage"])  # an EXTENSION_API name: kept without a user
    (tmp_path / "service" / "_x.py").write_text("from batchd.core import by_layer\n")
    (tmp_path / "batchd").mkdir()
    (tmp_path / "batchd" / "__init__.py").write_text('_EXPORTS = {"by_table": "batchd.core"}\n')
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("from batchd.core import only_tests\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "```python\nimport batchd.core as core\ncore.by_code_block()\n```\n"
        "See `batchd.core.by_whole`, and `batchd.core.gone`, which core does not export.\n"
    )
    (tmp_path / "docs" / "a.md").write_text(
        "## The core (`batchd.core`)\n\n| piece | what |\n| --- | --- |\n| `by_section` | x |\n\n"
        "## Layers\n\n| `batchd.core` | `by_row` |\n| `batchd.client` | `a` |\n"
    )
    # the maintainer's map does not make a name public
    (tmp_path / "docs" / "codebase.md").write_text("## `batchd.core`\n\n`unused`, `batchd.core.unused`\n")
    bad = surface.problems(tmp_path)
    extension = surface.EXTENSION_API["batchd.service.preprocess"] - {"Stage"}
    assert sorted(bad) == sorted(
        [
            "README.md: names batchd.core.gone, which batchd.core does not export",
            "batchd.client.__all__ is not sorted",
            f"batchd.client.b: {_NOT_USED.format(pkg='batchd.client')}",
            "batchd.core._private: a private name in __all__",
            f"batchd.core._private: {_NOT_USED.format(pkg='batchd.core')}",
            f"batchd.core.only_tests: {_NOT_USED.format(pkg='batchd.core')}",
            f"batchd.core.unused: {_NOT_USED.format(pkg='batchd.core')}",
            *[f"batchd.service.preprocess: EXTENSION_API names {n}, not exported" for n in extension],
        ]
    ), bad


_NOT_USED = (
    "no other layer or user doc uses it (tests' and benchmarks' helpers belong in {pkg}.testing, "
    "gathered by batchd.testing)"
)


@pytest.mark.parametrize("module", TESTING)
def test_batchd_testing_gathers_each_layers_testing_module_whole(module):
    mod = importlib.import_module(module)
    names = mod.__all__
    assert names and names == sorted(names), module
    assert not [n for n in names if n.startswith("_")], module
    assert batchd.testing._GATHERED[module] == tuple(names)
    for name in names:
        assert name in batchd.testing.__all__, name
        assert getattr(batchd.testing, name) is getattr(mod, name), name
    # a helper lives in one place: not exported by its layer as well
    layer = importlib.import_module(module.removesuffix(".testing"))
    assert not set(names) & set(layer.__all__), module


def test_batchd_testing_all_is_sorted_and_resolves_without_torch():
    assert batchd.testing.__all__ == sorted(batchd.testing.__all__)
    assert set(batchd.testing.__all__) == {*batchd.testing._EXPORTS, "demo_vocab_size"}
    code = (
        "import sys, batchd.testing as t; "
        "from batchd.testing import vision_greedy, START_ATTEMPTS, form_groups; "
        "print('torch' in sys.modules, callable(vision_greedy), START_ATTEMPTS > 0, callable(form_groups))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.split() == ["False", "True", "True", "True"], out.stderr[-2000:]
