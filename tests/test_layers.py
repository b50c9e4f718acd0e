"""The package imports one way: core -> proto -> service (preprocess below the rest) -> client -> app.

`tools/import_graph.py` reads every module with `ast`; these tests fail on any import against the
arrows, into another package's private module, of torch below the client, on an import cycle between
the modules of one package, and on a test importing a private module or name of batchd. The controls
feed the checker small synthetic trees, so a checker that stopped seeing violations would fail here too.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("import_graph", REPO / "tools" / "import_graph.py")
graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(graph)


def test_no_import_runs_against_the_layers():
    bad = graph.violations(graph.modules())
    assert not bad, "imports against batchd's layers:\n" + "\n".join(bad)


def test_no_import_cycle_inside_a_package():
    found = graph.cycle_violations(graph.modules())
    assert not found, "import cycles:\n" + "\n".join(found)


def test_tests_and_benchmarks_import_only_public_names():
    bad = graph.private_uses(graph.script_files(), graph.modules())
    assert not bad, "tests or benchmarks importing batchd's private modules or names:\n" + "\n".join(bad)


def test_the_daemon_never_imports_torch():
    code = (
        "import sys, batchd.core, batchd.proto, batchd.service, batchd.service.preprocess; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    mods = {}
    for name, text in files.items():
        path = tmp_path / (name.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        mods[name.removesuffix(".__init__")] = path
    return mods


@pytest.mark.parametrize(
    "module, source, needle",
    [
        ("batchd.core._x", "from batchd.service import run_rank\n", "batchd.core -> batchd.service"),
        ("batchd.proto._x", "from batchd import client\n", "batchd.proto -> batchd.client"),
        (
            "batchd.service._x",
            "def f():\n    from batchd.client import BatchClient\n",
            "batchd.service -> batchd.client",
        ),
        ("batchd.service._x", "import torch\n", "imports torch"),
        ("batchd.client._x", "from batchd.demo import run_demo\n", "batchd.client -> batchd"),
        (
            "batchd.client._x",
            "from batchd.service._coordinator import X\n",
            "private module of batchd.service",
        ),
        ("batchd._x", "from batchd.client._train import _scaled\n", "private module of batchd.client"),
        (
            "batchd.service.preprocess._x",
            "from batchd.service._main import run_rank\n",
            "below the rest of service",
        ),
        ("batchd.service.preprocess._x", "from .. import _coordinator\n", "below the rest of service"),
    ],
)
def test_the_checker_sees_each_kind_of_violation(tmp_path, monkeypatch, module, source, needle):
    mods = _tree(
        tmp_path,
        {
            module: source,
            "batchd.service._coordinator": "X = 1\n",
            "batchd.service._main": "",
            "batchd.service.__init__": "",
            "batchd.client.__init__": "",
        },
    )
    monkeypatch.setattr(graph, "ROOT", tmp_path)
    bad = graph.violations(mods)
    assert any(needle in b for b in bad), bad


def test_the_checker_accepts_imports_along_the_arrows(tmp_path, monkeypatch):
    mods = _tree(
        tmp_path,
        {
            "batchd.client._x": (
                "from batchd.core import JobSpec\nfrom batchd.proto import channel\nfrom . import _y\n"
            ),
            "batchd.client._y": "import numpy\n",
            "batchd._app": "from batchd.service.preprocess import RaySource\nimport torch\n",
        },
    )
    monkeypatch.setattr(graph, "ROOT", tmp_path)
    assert graph.violations(mods) == []


def test_import_batchd_gives_the_public_api_without_torch():
    code = (
        "import sys, batchd; assert 'torch' not in sys.modules; "
        "missing = [n for n in batchd.__all__ if not hasattr(batchd, n)]; "
        "assert not missing, missing; assert batchd.__all__ == sorted(batchd.__all__); "
        "assert batchd.JobFailed is batchd.client.JobFailed is batchd.core.JobFailed; "
        "assert issubclass(batchd.JobFailed, batchd.BatchdError); print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_every_modules_all_names_what_it_defines():
    # `from m import *` fails on a name in `__all__` that `m` does not define (a stale export).
    code = (
        "import importlib, pkgutil, batchd\n"
        "bad = []\n"
        "for info in pkgutil.walk_packages(batchd.__path__, 'batchd.'):\n"
        "    if info.name.endswith('__main__'):\n"
        "        continue\n"
        "    mod = importlib.import_module(info.name)\n"
        "    bad += [f'{info.name}.{n}' for n in getattr(mod, '__all__', []) if not hasattr(mod, n)]\n"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize(
    "a_source",
    [
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from ._b import B\n",
        "def f():\n    from . import _b\n",
        "import batchd.core._b\n",
    ],
    ids=["type-checking", "deferred", "absolute"],
)
def test_the_checker_sees_a_cycle_through_any_import(tmp_path, monkeypatch, a_source):
    mods = _tree(
        tmp_path,
        {
            "batchd.core.__init__": "from ._b import B\n",
            "batchd.core._a": a_source + "A = 1\n",
            "batchd.core._b": "from ._a import A\nB = A\n",
            "batchd.core._c": "from ._b import B\n",
        },
    )
    monkeypatch.setattr(graph, "ROOT", tmp_path)
    assert graph.cycle_violations(mods) == ["import cycle: core._a -> core._b -> core._a"]


def test_the_checker_accepts_a_package_without_cycles(tmp_path, monkeypatch):
    mods = _tree(
        tmp_path,
        {
            "batchd.core.__init__": "from ._a import A\nfrom ._b import B\n",
            "batchd.core._a": "A = 1\n",
            "batchd.core._b": "from typing import TYPE_CHECKING\nfrom ._a import A\n"
            "if TYPE_CHECKING:\n    from batchd.proto import X\n",
            "batchd.proto.__init__": "from batchd.core import A as X\n",
        },
    )
    monkeypatch.setattr(graph, "ROOT", tmp_path)
    assert graph.cycles(mods) == []


def test_the_checker_sees_a_test_importing_a_private_name(tmp_path, monkeypatch):
    mods = _tree(tmp_path, {"batchd.core.__init__": "", "batchd.core._phases": "ACCEPT = 1\n"})
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "from batchd.core import JobSpec\n"
        "from batchd.core._phases import ACCEPT\n"
        "from batchd.core import _phases\n"
        "from batchd.demo import _vocab_size\n"
        "import batchd._model\n"
    )
    monkeypatch.setattr(graph, "ROOT", tmp_path)
    bad = graph.private_uses(graph.script_files(tmp_path), mods)
    assert [b.split(":")[1] for b in bad] == ["2", "3", "4", "5"], bad
    assert "batchd.demo._vocab_size" in bad[2] and "batchd._model" in bad[3], bad
