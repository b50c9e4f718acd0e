"""Bad inputs fail fast, in one line, naming the file: empty datasets, missing or wrong tokenizers.

Real files and the real CLI in subprocesses (`python -m batchd ...`); no Ray is started: every check
runs before Ray would be.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchd.preprocess import RecordDataset, TokenizerRef, demo_tokenizer
from batchd.testing import EmptyDatasetError


def batchd(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "batchd", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
    )


def one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Asserts exit 2 and a single stderr line holding every needle, with no traceback; returns it.
    (`batchd demo`'s progress lines, `[batchd demo] ...`, are not errors.)"""
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("[batchd demo] ")]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture
def empty_files(tmp_path) -> dict[str, Path]:
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n")
    parquet = tmp_path / "empty.parquet"
    msg = pa.struct([("role", pa.string()), ("content", pa.string())])
    pq.write_table(pa.table({"messages": pa.array([], pa.list_(msg))}), parquet)
    return {"jsonl": blank, "parquet": parquet}


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_an_empty_dataset_is_an_error_naming_the_file(empty_files, fmt):
    path = empty_files[fmt]
    with pytest.raises(EmptyDatasetError, match=f"no records: {path}"):
        RecordDataset(path)
    with pytest.raises(ValueError, match="no records"):  # a directory of empty files too
        RecordDataset(path.parent)


def test_rank_and_demo_refuse_an_empty_dataset(empty_files, tmp_path):
    path = str(empty_files["jsonl"])
    rank = batchd(
        "rank",
        "--world-size",
        "1",
        "--token-budget",
        "256",
        "--rank",
        "0",
        "--coordinator",
        "127.0.0.1:9",
        "--dataset",
        path,
        cwd=tmp_path,
    )
    one_line_error(rank, "batchd rank: error:", "no records", path)
    demo = batchd("demo", "--dataset", path, "--no-baseline", cwd=tmp_path)
    one_line_error(demo, "batchd demo: error:", "no records", path)


def test_missing_inputs_are_one_line_errors(tmp_path):
    missing = str(tmp_path / "nope.json")
    demo = batchd("demo", "--tokenizer", missing, "--num-samples", "8", "--no-baseline", cwd=tmp_path)
    one_line_error(demo, "batchd demo: error:", "tokenizer not found", missing)
    demo = batchd("demo", "--dataset", str(tmp_path / "nope.parquet"), cwd=tmp_path)
    one_line_error(demo, "batchd demo: error:", "nope.parquet")
    rank = batchd(
        "rank",
        "--world-size",
        "1",
        "--token-budget",
        "256",
        "--rank",
        "0",
        "--coordinator",
        "127.0.0.1:9",
        "--dataset",
        str(tmp_path / "nope.parquet"),
        cwd=tmp_path,
    )
    one_line_error(rank, "batchd rank: error:", "data.dataset", "nope.parquet")
    check = batchd("tokenizer", "--check", missing, cwd=tmp_path)
    one_line_error(check, "batchd tokenizer: error:", missing)
    not_json = tmp_path / "tok.txt"
    not_json.write_text("hello")
    one_line_error(
        batchd("tokenizer", "--check", str(not_json), cwd=tmp_path), "not a tokenizer.json", "tok.txt"
    )


def test_trainer_reports_a_missing_tokenizer_in_one_line(tmp_path):
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    missing = str(tmp_path / "tok.json")
    proc = subprocess.run(
        [sys.executable, "-m", "batchd.train", "--base-port", "7100", "--tokenizer", missing],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().count("\n") == 0 and missing in proc.stderr, proc.stderr


def test_tokenizer_command_writes_the_demo_tokenizer_and_a_directory_loads_the_same(tmp_path):
    out = batchd("tokenizer", "tok.json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "tok.json").read_text() == demo_tokenizer().read_text()
    check = batchd("tokenizer", "--check", "tok.json", cwd=tmp_path)
    assert check.returncode == 0 and "tok.json: ok" in check.stdout, check.stderr

    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tok.json"), pad_token="<|endoftext|>")
    hf.save_pretrained(tmp_path / "hf-tok")  # what a model repository's tokenizer directory holds
    by_dir, by_file = TokenizerRef(tmp_path / "hf-tok"), TokenizerRef(tmp_path / "tok.json")
    text = "<|im_start|>user\nhello <|image_pad|> world<|im_end|>"
    assert by_dir.hf(text)["input_ids"] == by_file.hf(text)["input_ids"]
    assert by_dir.id_space == by_file.id_space and by_dir.pad_id == by_file.pad_id
    assert batchd("tokenizer", "--check", "hf-tok", cwd=tmp_path).returncode == 0


def _users_jsonl(path: Path, n: int = 64) -> dict[int, str]:
    """Good conversations and a few bad lines of different kinds, as a new user's file might have them;
    returns {line: reason code} of the bad ones."""
    import json

    lines = [
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": f"What is {i} plus {i}?"},
                    {"role": "assistant", "content": f"It is {2 * i}. " * (1 + i % 5)},
                ]
            }
        )
        for i in range(n)
    ]
    bad = {5: "schema", 17: "invalid_json", 30: "missing_field", 44: "bad_role"}
    lines[5] = json.dumps({"messages": "hello there"})  # a field of the wrong type
    lines[17] = '{"messages": [{"role": "user", "content": "broken'  # cut off
    lines[30] = json.dumps({"conversation": []})  # no messages at all
    lines[44] = json.dumps(
        {"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]}
    )
    path.write_text("\n".join(lines) + "\n")
    return bad


@pytest.mark.slow
def test_demo_on_a_users_jsonl_with_bad_lines_quarantines_them_and_trains_on_the_rest(tmp_path):
    import json

    bad = _users_jsonl(tmp_path / "mine.jsonl")
    proc = batchd(
        "demo",
        "--dataset",
        str(tmp_path / "mine.jsonl"),
        "--no-baseline",
        "--json",
        cwd=tmp_path,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    pre = s["preprocess"]
    assert s["emitted"] == 60 and s["missing"] == 0 and s["duplicates"] == 0, s
    assert pre["quarantined"] == 4 and pre["reasons"] == {code: 1 for code in bad.values()}, pre
    kept = Path(pre["quarantine_file"])  # outlives the demo's temporary directory
    lines = [json.loads(x) for x in kept.read_text().splitlines()]
    # `mine.jsonl:LINE` names the line as an editor numbers it (1-based)
    assert {int(x["source"].rsplit(":", 1)[1]) - 1: x["reason"].split(":")[0] for x in lines} == bad
    assert any(x["reason"] == "schema: field 'messages': expected a list of messages, got str" for x in lines)
    kept.unlink()


@pytest.mark.slow
def test_too_many_bad_records_fail_a_small_dataset_naming_the_kept_quarantine(tmp_path):
    """60 records, a quarter bad: fewer than `MIN_JUDGED` per rank, so the share is judged at the end of
    each rank's view. The job fails (exit 1, one line) naming the quarantine file that outlives the demo."""
    import json

    lines = [
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": f"What is {i} plus {i}?"},
                    {"role": "assistant", "content": f"It is {2 * i}."},
                ]
            }
        )
        for i in range(60)
    ]
    for i in range(0, 60, 4):
        lines[i] = json.dumps({"messages": "hello there"})
    (tmp_path / "mine.jsonl").write_text("\n".join(lines) + "\n")
    proc = batchd(
        "demo", "--dataset", str(tmp_path / "mine.jsonl"), "--no-baseline", cwd=tmp_path, timeout=240
    )
    err = proc.stderr
    assert proc.returncode == 1, (proc.returncode, err[-3000:])  # a failed job (README, "Exit statuses")
    assert "Traceback" not in err, err[-3000:]
    failed = [ln for ln in err.splitlines() if ln.startswith("batchd demo: the job failed: ")]
    assert len(failed) == 1 and "max_bad_fraction = 0.1" in failed[0] and "by reason: schema " in failed[0], (
        err[-3000:]
    )
    named = Path(failed[0].split("; see ", 1)[1].split(". Fix the data", 1)[0])
    assert named.name.endswith("-quarantine.jsonl") and named.is_file(), failed[
        0
    ]  # the kept copy, not the temp dir's
    assert f"bad records (quarantine): {named}" in err, err[-3000:]
    named.unlink()
