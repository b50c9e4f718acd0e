"""The suite fails on a lint or type regression, not only CI: ruff check, ruff format --check and mypy
over the tree, with the project's own configuration (pyproject.toml).

Each check runs the tool of this interpreter's environment (the dev extra pins them) and is skipped,
saying so, when the tool is not installed. Together they take a few seconds (mypy reuses its cache).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120


def _ruff() -> list[str]:
    """The ruff of this environment (beside the interpreter), else the one on PATH; skips without."""
    local = Path(sys.executable).parent / "ruff"
    found = str(local) if local.is_file() else shutil.which("ruff")
    if found is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]'): lint not checked")
    return [found]


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)


def test_ruff_check_passes():
    run = _run([*_ruff(), "check", "--no-cache", "--output-format", "concise", "."])
    assert run.returncode == 0, f"ruff check . found:\n{run.stdout[-6000:]}{run.stderr[-2000:]}"


def test_ruff_format_check_passes():
    run = _run([*_ruff(), "format", "--check", "--no-cache", "."])
    assert run.returncode == 0, (
        f"ruff format --check . (fix: ruff format FILES):\n{run.stdout[-6000:]}{run.stderr[-2000:]}"
    )


def test_mypy_passes():
    """`python -m mypy` with no arguments: strict on core/ and proto/wire.py ([tool.mypy])."""
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install -e '.[dev]'): types not checked")
    run = _run([sys.executable, "-m", "mypy"])
    assert run.returncode == 0, f"python -m mypy found:\n{run.stdout[-6000:]}{run.stderr[-2000:]}"


def _sizes():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import sizes
    finally:
        sys.path.pop(0)
    return sizes


def test_no_module_over_600_lines_and_no_function_over_80():
    found = _sizes().violations()
    assert not found, "over the size limits (python tools/sizes.py --check):\n" + "\n".join(found)


def test_the_size_check_sees_a_long_module_and_a_long_function(tmp_path):
    sizes = _sizes()
    (tmp_path / "core").mkdir()
    body = "\n".join(f"        x{i} = {i}" for i in range(85))
    (tmp_path / "core" / "_long.py").write_text(f"class C:\n    def f(self):\n{body}\n")
    (tmp_path / "core" / "_big.py").write_text("x = 1\n" * 601)
    (tmp_path / "core" / "_ok.py").write_text("def g():\n    return 1\n")
    found = sizes.violations(tmp_path, ("core",))
    assert found == ["core/_big.py: 601 lines (limit 600)", "core/_long.py:2: C.f is 86 lines (limit 80)"]
