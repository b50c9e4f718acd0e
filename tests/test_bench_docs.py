"""docs/benchmarks.md is rendered from benchmarks/results/*.json and benchmarks/templates/ (render.py).

On the committed tree the page must be exactly the rendering. Controls: a changed result makes the check
fail, a result whose measured code changed after its commit is reported stale (in a tmp git repo).
Also the shared process harness (benchmarks/_harness.py): waits, fast failure, process-group stop.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import _report  # noqa: E402
import render  # noqa: E402


def test_committed_page_is_the_rendering() -> None:
    assert render.check() == []


def test_every_section_has_a_template_and_a_full_command() -> None:
    for name in render.sections():
        assert (_report.TEMPLATES / f"{name}.md.j2").exists(), name
        assert render.FULL_RUNS[name].startswith(("python benchmarks/", "batchd ")), name
    for name in render.ORDER:
        if name.startswith("_"):
            assert (_report.TEMPLATES / f"{name}.md.j2").exists(), name
    assert set(render.FULL_RUNS) == set(render.sections())


def _git(cwd: Path, *args: str) -> str:
    env_args = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    return subprocess.run(
        ["git", *env_args, *args], cwd=cwd, check=True, capture_output=True, text=True, timeout=60
    ).stdout.strip()


def _tree(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A tmp page of one section `demo-x`: its template and a result recorded by write_result."""
    templates, results = tmp_path / "templates", tmp_path / "results"
    templates.mkdir()
    (templates / "_header.md.j2").write_text("# header\n")
    (templates / "demo-x.md.j2").write_text(
        "## Demo\n\n{{ measured(r) }}\n\n{{ table(['n', 'rate'], r.data.rows) }}\n"
        "Best: {{ r.data.rows[0][1] | fmt(1) }} with n={{ r.config.n }}.\n"
    )
    _report.write_result(
        "demo-x",
        {"rows": [[1, 2.5], [2, float("nan")]]},
        measures=["core"],
        config={"n": 2},
        out=results / "demo-x.json",
    )
    return templates, results, tmp_path / "page.md"


def test_check_fails_on_a_modified_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    templates, results, page = _tree(tmp_path)
    monkeypatch.setattr(render, "ORDER", ("demo-x",))
    page.write_text(render.render_page(results, templates))
    assert "Measured at commit " in page.read_text() and "| 2 |     - |" in page.read_text()
    assert render.check(page, results, templates) == []
    path = results / "demo-x.json"
    path.write_text(path.read_text().replace("2.5", "3.5"))
    assert any("differs from the rendering" in p for p in render.check(page, results, templates))
    (results / "orphan.json").write_text(path.read_text())
    assert "result without a template: orphan" in render.check(page, results, templates)


def test_stale_names_the_commits_after_the_measured_one(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "core").mkdir(parents=True)
    (repo / "docs").mkdir()
    (repo / "core" / "x.py").write_text("x = 1\n")
    (repo / "docs" / "y.md").write_text("y\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "first")
    measured = _git(repo, "rev-parse", "HEAD")
    results = tmp_path / "results"
    results.mkdir()
    rec = {"section": "s", "commit": measured, "measures": ["core"], "config": {}, "data": {}}
    (results / "s.json").write_text(__import__("json").dumps(rec))
    assert render.stale(results, repo, expected=["s"]) == {}
    (repo / "docs" / "y.md").write_text("z\n")  # not measured code: still fresh
    _git(repo, "commit", "-q", "-am", "docs only")
    assert render.stale(results, repo, expected=["s"]) == {}
    (repo / "core" / "x.py").write_text("x = 2\n")
    _git(repo, "commit", "-q", "-am", "change the code")
    found = render.stale(results, repo, expected=["s"])
    assert list(found) == ["s"] and found["s"][0].endswith("change the code")
    assert render.stale(results, repo, expected=["never-run"])["never-run"] == ["no result"]


def test_render_main_commands_and_check_exit_codes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert render.main(["--commands"]) == 0
    assert "python benchmarks/simulate_workloads.py" in capsys.readouterr().out
    empty = tmp_path / "results"
    empty.mkdir()
    page = tmp_path / "p.md"
    assert render.main(["--check", "--results", str(empty), "--docs", str(page)]) == 1  # no page
    assert render.main(["--results", str(empty), "--docs", str(page)]) == 0
    assert "not measured at this code yet" in page.read_text()  # every section pending
    assert render.main(["--check", "--results", str(empty), "--docs", str(page)]) == 0
    assert render.main(["--stale", "--results", str(empty)]) == 1


def test_harness_waits_fails_fast_and_stops_the_process_group(tmp_path: Path) -> None:
    import os
    import time

    import _harness

    ready = tmp_path / "ready"
    parent = (  # a child that starts a grandchild in its group, then says it is ready
        "import pathlib, subprocess, sys, time\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"print('grandchild', g.pid, flush=True)\n"
        f"pathlib.Path({str(ready)!r}).write_text('{{\"port\": 1234}}')\n"
        "time.sleep(60)\n"
    )
    with _harness.Harness(tmp_path) as h:
        h.start("p", [sys.executable, "-c", parent])
        assert h.wait_port(ready, "p", 60) == 1234
        grandchild = int(h.wait_line("p", r"grandchild (\d+)", 10).group(1))
        h.start("dies", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"])
        with pytest.raises(RuntimeError, match="status 3"):
            h.wait_file(tmp_path / "never", "dies", 30)
        with pytest.raises(TimeoutError):
            h.wait_line("p", "never logged", 0.2)
        assert h.codes()["dies"] == 3 and h.codes()["p"] is None
    assert h.get("p").poll() is not None  # stopped on leaving the block ...
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # ... with its whole group, the grandchild included
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        if Path(f"/proc/{grandchild}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break  # a zombie waiting for its (gone) parent's reaper: it is dead
        time.sleep(0.05)
    else:
        pytest.fail(f"grandchild {grandchild} outlived the harness")
    assert isinstance(_harness.free_port(), int)
