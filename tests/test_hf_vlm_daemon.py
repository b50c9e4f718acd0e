"""A stock Hugging Face multimodal model trained two-phase through the daemon: the "Stock Hugging Face
multimodal models" recipe of docs/multimodal.md, run as written by bash in an empty directory.

The block is taken from the page and run line by line: `batchd tiny-vlm vlm` writes the tiny Qwen2-VL and
its processor, the records (the demo generator's, with images) go to train.parquet, job.toml is the
page's (`[pipeline] processor = "vlm"`, `phases = 2`), then a coordinator, a node agent whose Ray actors
run the model's own processor, and `torchrun ... -m batchd.train --hf-model vlm`: two gloo ranks training
the stock `Qwen2VLForConditionalGeneration` through `batchd.two_phase` (its own vision tower, the exchange,
its own LLM). The test changes only what a shared test machine needs: free ports, 40 records
instead of 256, a smaller token budget (more steps), torchrun's rendezvous port, and `--ids-log` /
`--summary` on the trainer line. Checked: the script succeeds; every sample id is trained exactly once;
both ranks ran the same number of steps with a finite loss, each step two-phase (its batch carried the
vision exchange); the encoders ran images; rank 0 reported the encoder's imbalance (the log line, and
`vision_imbalance` in both summaries, equal); no process of the job is left.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import uuid

import pytest
from _procs import free_block
from _readme_job import REPO, end_job, job_env, trained_ids

RECORDS = 40


def readme_block() -> str:
    text = (REPO / "docs" / "multimodal.md").read_text()
    start = text.index("## Stock Hugging Face multimodal models")
    return re.search(r"```bash\n(.*?)```", text[start:], re.S).group(1)


def script(cport: int, rport: int) -> list[str]:
    """The page's block with free ports, fewer records and the trainer's logs."""
    block = readme_block()
    assert 'make_demo_dataset(".", 256,' in block and "port = 7000" in block and "base_port = 7100" in block
    block = (
        block.replace('make_demo_dataset(".", 256,', f'make_demo_dataset(".", {RECORDS},')
        .replace("token_budget = 2048", "token_budget = 1024")  # more, smaller steps of 40 records
        .replace("port = 7000", f"port = {cport}")
        .replace("base_port = 7100", f"base_port = {rport}")
        .replace("--node-agent 127.0.0.1:7100", f"--node-agent 127.0.0.1:{rport}")
    )
    lines = [
        "set -euo pipefail",
        "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT",
    ]  # a failed line: end the rest
    for line in block.splitlines():
        if line.startswith("torchrun "):
            assert "--hf-model vlm" in line, line
            # torchrun is `python -m torch.distributed.run`: this interpreter's, whatever the script's shebang
            line = (
                line.split("#")[0]
                .rstrip()
                .replace(
                    "torchrun ",
                    f"{sys.executable} -m torch.distributed.run --master-port {free_block(1)} ",
                    1,
                )
                + " --log-every 0 --ids-log ids-{rank}.jsonl --summary summary-{rank}.json"
            )
        lines.append(line)
    lines.append('for p in $(jobs -p); do wait "$p"; done')  # the services exit on their own, status 0
    return lines


@pytest.mark.slow
def test_stock_qwen2_vl_trains_two_phase_through_the_daemon(tmp_path):
    cport, rport = free_block(1), free_block(2)
    ray_tmp = tempfile.mkdtemp(prefix="bdv-", dir="/tmp")  # short socket paths for Ray
    marker = f"BATCHD_TEST_VLM={uuid.uuid4().hex}"
    try:
        run = subprocess.run(
            ["bash", "-c", "\n".join(script(cport, rport))],
            cwd=tmp_path,
            env=job_env(ray_tmp, marker),
            capture_output=True,
            text=True,
            timeout=900,
        )  # a backstop against a hang: every party has its own liveness limits
        out = run.stdout[-4000:] + "\n--- stderr\n" + run.stderr[-8000:]
        assert run.returncode == 0, out
        assert "Traceback" not in run.stderr, out
        ids = trained_ids(tmp_path)
        assert sorted(ids) == list(range(RECORDS)), (sorted(ids), out)  # every id once: none lost, none twice
        results = [json.loads((tmp_path / f"summary-{r}.json").read_text()) for r in range(2)]
        assert results[0]["steps"] == results[1]["steps"] > 0, results
        assert all(r["last_loss"] == r["last_loss"] for r in results), results  # a finite loss, not NaN
        assert [r["exchange_steps"] for r in results] == [r["steps"] for r in results], results  # two-phase
        logs = [
            [json.loads(line) for line in (tmp_path / f"ids-{r}.jsonl").read_text().splitlines()]
            for r in range(2)
        ]
        assert sum(e["patches"] for lg in logs for e in lg) > 0, logs  # images reached the encoders
        # every merged embedding row (4 patches, a 2x2 merge) went to one rank in the exchanges
        sent = [r["exchange_rows_to"] for r in results]
        assert all(len(s) == 2 for s in sent), sent
        assert sum(map(sum, sent)) * 4 == sum(e["patches"] for lg in logs for e in lg), (sent, logs)
        # the cost model checked itself on each rank's own steps (its compute on its planned cost)
        for r in results:
            assert r["cost_check"]["steps"] > 0 and set(r["cost_check"]) >= {"r2", "slope_s"}, r
        vision = results[0]["vision_imbalance"]
        assert vision is not None and vision == results[1]["vision_imbalance"] and 1.0 <= vision, results
        m = re.search(
            r"\[rank 0\] vision encoder: slowest rank / mean, in encoder patches: (\d+\.\d+)", run.stderr
        )
        assert m and abs(float(m.group(1)) - vision) < 1e-3, out
    finally:
        left = end_job(marker)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not left, "processes outlived the job:\n" + "\n".join(left)


def test_tiny_vlm_command_writes_what_a_checkout_holds(tmp_path, capsys, monkeypatch):
    """`batchd tiny-vlm DIR --family llava` writes a model `load_vlm` loads and a processor `HFProcessor`
    runs (the Qwen2-VL one: the job above); a file as DIR, or a directory `--hf-model` cannot load, is
    exit 2 with one line naming it (README, "Exit statuses")."""
    from batchd.cli import main
    from batchd.preprocess import HFProcessor
    from batchd.testing import load_vlm
    from batchd.train import main as train_main

    out = tmp_path / "llava"
    assert main(["tiny-vlm", str(out), "--family", "llava", "--seed", "1"]) == 0
    assert str(out) in capsys.readouterr().out
    model = load_vlm(out)
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    from PIL import Image

    from batchd.preprocess import Example, StageContext

    messages = [
        {"role": "user", "content": "<image>What is it?"},
        {"role": "assistant", "content": "A red square."},
    ]
    ex = HFProcessor(str(out))(
        Example(0, 0, "", messages, None, [Image.new("RGB", (40, 40), (200, 10, 10))]),
        StageContext(0, 0, 0, 0),
    )
    assert ex.image_tokens == [4] and int(ex.input_ids.max()) < model.get_input_embeddings().num_embeddings

    assert main(["tiny-vlm", str(out / "config.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("batchd tiny-vlm: error: ") and "config.json" in err[0], err

    for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(var, value)
    assert train_main(["--node-agent", "127.0.0.1:1", "--hf-model", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("[rank 0] batchd.train: error: --hf-model") and "nowhere" in err[-1], err
