"""tools/sizes.py: each limit (module lines, function lines, parameters) fires on a small source and names
the function; the parameter rule leaves out self/cls, *args/**kwargs and dataclass fields; the layers the
check holds by default, and benchmarks/ under every limit, pass in this repository."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sizes():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import sizes
    finally:
        sys.path.pop(0)
    return sizes


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "core" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_a_module_over_600_lines_is_named(sizes, tmp_path):
    root = _tree(tmp_path, {"_big.py": "x = 1\n" * 601, "_fits.py": "x = 1\n" * 600})
    assert sizes.violations(root, ("core",)) == ["core/_big.py: 601 lines (limit 600)"]


def test_a_function_over_80_lines_is_named_with_its_class_and_parent(sizes, tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(80))  # def + 80 lines: 81
    inner = "\n".join(f"            y{i} = {i}" for i in range(80))
    source = f"class C:\n    def long(self):\n{body}\n\n    def outer(self):\n        def inner():\n{inner}\n"
    found = sizes.violations(_tree(tmp_path, {"_long.py": source}), ("core",))
    assert found == [
        "core/_long.py:2: C.long is 81 lines (limit 80)",
        "core/_long.py:84: C.outer is 82 lines (limit 80)",
        "core/_long.py:85: C.outer.inner is 81 lines (limit 80)",
    ]


def test_a_function_over_8_parameters_is_named(sizes, tmp_path):
    source = (
        "def wide(a, b, c, d, e, f, g, h, i):\n    pass\n\n"
        "async def keywords(a, /, b, *, c, d, e, f, g, h, i):\n    pass\n\n"
        "class K:\n    def method(self, a, b, c, d, e, f, g, h, i):\n        pass\n"
    )
    found = sizes.violations(_tree(tmp_path, {"_wide.py": source}), ("core",))
    assert found == [
        "core/_wide.py:1: wide has 9 parameters (limit 8)",
        "core/_wide.py:4: keywords has 9 parameters (limit 8)",
        "core/_wide.py:8: K.method has 9 parameters (limit 8)",
    ]


def test_self_cls_star_args_and_dataclass_fields_are_not_parameters(sizes, tmp_path):
    fields = "\n".join(f"    f{i}: int = {i}" for i in range(20))
    source = (
        "import dataclasses\n\n"
        "def eight(a, b, c, d, e, f, g, h, *args, **kwargs):\n    pass\n\n"
        "class K:\n"
        "    def method(self, a, b, c, d, e, f, g, h):\n        pass\n\n"
        "    @classmethod\n    def make(cls, a, b, c, d, e, f, g, h):\n        pass\n\n"
        f"@dataclasses.dataclass(frozen=True)\nclass Options:\n{fields}\n"
    )
    assert sizes.violations(_tree(tmp_path, {"_ok.py": source}), ("core",)) == []


def test_the_default_check_holds_each_layer_to_the_limits_it_lists(sizes, tmp_path, monkeypatch):
    monkeypatch.setattr(sizes, "DEFAULT_CHECK", {"core": ("module", "function"), "benchmarks": sizes.LIMITS})
    wide = "def wide(a, b, c, d, e, f, g, h, i):\n    pass\n"
    _tree(tmp_path, {"_wide.py": wide})
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "wide.py").write_text(wide)
    (tmp_path / "batchd").mkdir()
    (tmp_path / "batchd" / "big.py").write_text("x = 1\n" * 700)  # not in the default check
    assert sizes.violations(tmp_path) == ["benchmarks/wide.py:1: wide has 9 parameters (limit 8)"]
    assert sizes.violations(tmp_path, ("core", "batchd")) == [
        "core/_wide.py:1: wide has 9 parameters (limit 8)",
        "batchd/big.py: 700 lines (limit 600)",
    ]


def test_report_counts_each_limit_per_package(sizes, tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(85))
    _tree(tmp_path, {"_a.py": f"def long():\n{body}\n\ndef wide(a, b, c, d, e, f, g, h, i):\n    pass\n"})
    (tmp_path / "proto").mkdir()
    head, core, proto = sizes.report(tmp_path, ("core", "proto"))
    assert head.split()[:5] == ["package", "modules", ">600", "fn>80", "args>8"]
    assert core.split()[:5] == ["core", "1", "0", "1", "1"] and core.endswith("core/_a.py:long 86")
    assert proto.split()[:2] == ["proto", "0"]


def test_cli_layers_check_and_bad_layer(sizes, capsys):
    assert sizes.main(["--check", "--layers", "benchmarks"]) == 0
    assert "none over 8 parameters" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        sizes.main(["--check", "--layers", "nope"])
    assert "text='nope'" in capsys.readouterr().err


def test_the_repository_passes_the_default_check_and_benchmarks_every_limit(sizes):
    assert set(sizes.DEFAULT_CHECK) >= {"core", "proto", "service", "client", "benchmarks"}
    assert sizes.DEFAULT_CHECK["benchmarks"] == sizes.LIMITS
    found = sizes.violations() + sizes.violations(layers=("benchmarks",))
    assert not found, "over the size limits (python tools/sizes.py --check):\n" + "\n".join(found)
