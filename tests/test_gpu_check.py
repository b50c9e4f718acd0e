"""benchmarks/gpu/check.sh, the GPU run prepared in advance, in its CPU mode (`--cpu`), as CI runs it.

It must work where a device machine stands: no Ray and none of the other libraries such a machine lacks
(a `sitecustomize` on PYTHONPATH makes importing them fail here), batchd run from the checkout through
the script's own site directory, not the installed package. It calibrates, then benches fixed, ODB
0.1.2 (when installed) and batchd padded and packed on the same samples, and writes every result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.beside]  # CI: the second lane (.ci/run)

REPO = Path(__file__).resolve().parents[1]
ABSENT = ("ray", "jinja2", "yaml", "tqdm", "PIL", "soundfile", "matplotlib", "scipy")


def test_the_gpu_script_runs_end_to_end_on_cpu_without_what_a_device_lacks(tmp_path):
    block = tmp_path / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(
        f"import sys\nfor name in {ABSENT!r}:\n    sys.modules[name] = None\n"
    )
    out = tmp_path / "out"
    run = subprocess.run(
        [str(REPO / "benchmarks" / "gpu" / "check.sh"), "--cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(block)},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    env = (out / "environment.txt").read_text()
    assert "ray absent" in env, env
    source = Path(env.split("batchd from ")[1].split()[0])
    assert not source.is_relative_to(REPO) and source.parts[-2:] == ("batchd", "__init__.py"), source
    cal = json.loads((out / "calibration" / "calibration.json").read_text())
    assert cal["token_budget"] is not None and set(cal["fits"]) == {"padded", "packed"}, cal["fits"]
    assert (out / "calibration" / "calibration.svg").exists()
    bench = json.loads((out / "bench" / "bench.json").read_text())
    assert {"fixed", "batchd-balanced", "batchd-packed"} <= set(bench["systems"]), bench["systems"]
    for line in run.stderr.splitlines():  # "[bench] SYSTEM: ... (missing 0, dup 0) ..."
        if "(missing " in line:
            assert "(missing 0, dup 0)" in line, line
    assert "no plots: matplotlib is not installed" in run.stderr
