"""The processes of a chaos job (benchmarks/chaos.py): a party's incarnations, its log's telling error,
and the live Ray preprocessing actors to kill."""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
from pathlib import Path

from _harness import Harness


class Party:
    """One party of a job (a command line) and its incarnations (Popen objects, in order), started
    through the job's `Harness` (own session, log appended per incarnation, stopped at the job's end)."""

    def __init__(
        self,
        harness: Harness,
        name: str,
        argv: list[str],
        log: Path,
        env: dict[str, str] | None = None,
        port_file: Path | None = None,
    ) -> None:
        self.harness, self.name, self.argv, self.log = harness, name, argv, log
        self.env, self.port_file = env or {}, port_file
        self.procs: list[subprocess.Popen] = []
        self.expected_end: dict[int, str] = {}  # incarnation index -> why it did not exit on its own

    def start(self, env: dict[str, str] | None = None) -> subprocess.Popen:
        if env:
            self.env = {**self.env, **env}
        if self.port_file is not None:
            self.port_file.unlink(missing_ok=True)
        self.procs.append(self.harness.start(self.name, self.argv, env=self.env, log=self.log, append=True))
        return self.procs[-1]

    @property
    def proc(self) -> subprocess.Popen:
        return self.procs[-1]

    def alive(self) -> bool:
        return bool(self.procs) and self.proc.poll() is None

    def kill(self, why: str, sig: int = signal.SIGKILL) -> None:
        self.expected_end[len(self.procs) - 1] = why
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait_listening(self, timeout: float) -> float:
        """Seconds until the current incarnation wrote its port file; raises with the log's last error."""
        assert self.port_file is not None, self.name
        try:
            return self.harness.wait_file(self.port_file, self.name, timeout)
        except RuntimeError:
            raise RuntimeError(
                f"{self.name} exited with status {self.proc.returncode} before listening: "
                f"{last_error(self.log)}"
            ) from None
        except TimeoutError:
            raise TimeoutError(
                f"{self.name} did not listen within {timeout:g}s: {last_error(self.log)}"
            ) from None


_ERR_PATTERNS = [
    r"job failed: (.*)",
    r"JobFailed: (.*)",
    r"batchd\.train: error: (.*)",
    r"BatchdError: (.*)",
    r"CoordinatorError: (.*)",
    r"^(?:\[rank\d+\]:\s*)?(\w*(?:Error|Exception)\b.*)",
    r"(Traceback.*)",
]


def last_error(log: Path, incarnation_only: bool = True) -> str:
    """The most telling error line of a log (its last incarnation's part), or its last line."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "(no log)"
    if incarnation_only:
        text = text.rsplit("\n=== ", 1)[-1]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for pat in _ERR_PATTERNS:
        for k in range(len(lines) - 1, -1, -1):
            m = re.search(pat, lines[k])
            if m:
                msg = m.group(1)
                if msg.endswith("terminated with:"):  # a gRPC error: its status and details follow
                    msg += " " + " ".join(
                        ln for ln in lines[k + 1 : k + 4] if ln.startswith(("status =", "details ="))
                    )
                return msg[:400]
    return lines[-1][:400] if lines else "(empty log)"


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = collections.defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children[ppid].append(int(stat.parent.name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def actor_pids() -> list[int]:
    """The pids of the live preprocessing actors of the Ray this process started (its descendants)."""
    pids = []
    for pid in descendants(os.getpid()):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if cmd.startswith("ray::PreprocessWorker") and state != "Z":
            pids.append(pid)
    return sorted(pids)
