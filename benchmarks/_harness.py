"""The one harness the benchmark scripts spawn and collect processes with.

`Harness` starts each child in its own session (so its whole process group can be signalled), with
stdout and stderr going to a log file, `PYTHONUNBUFFERED=1` and `OMP_NUM_THREADS=1`, and wrapped by
`batchd.launch.die_with_parent` (Linux: the kernel SIGTERMs it if the benchmark dies, even by
SIGKILL). It waits for a child's readiness with a deadline (`wait_file`, `wait_port`, `wait_line`),
failing fast with the log's tail when the child exits first; `codes()` collects exit statuses;
leaving the `with` block (or `stop()`) terminates every process group still running, then kills it
after a grace. `free_port()` is the one way to pick a TCP port.

Contract: a name is started at most once per harness unless `start(..., append=True)` (a restarted
party: its incarnations share one log, each headed by a `=== name incarnation k` line). All waits
poll every 50 ms; none blocks past its deadline.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path
from types import TracebackType

from batchd.launch import die_with_parent, free_port

__all__ = ["Harness", "free_port", "log_tail"]

POLL_S = 0.05


def join_or_terminate(procs: list, coord, timeout: float = 10.0) -> None:
    """Joins the `multiprocessing` client processes `procs` and then the coordinator process `coord`,
    each for up to `timeout` s, terminating any still alive (the latency benchmarks' end)."""
    for p in [*procs, coord]:
        p.join(timeout)
        if p.is_alive():
            p.terminate()


def log_tail(log: Path, chars: int = 3000) -> str:
    """The last `chars` characters of a log ("" if it does not exist)."""
    try:
        return Path(log).read_text(errors="replace")[-chars:]
    except OSError:
        return ""


class Harness:
    """Children of one benchmark run, stopped whatever happens (see the module docstring).

    `log_dir` holds `<name>.log` per child unless `start` is given a `log`; `env` is added to every
    child's environment (a child's own `env` on top).
    """

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.env = dict(env or {})
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.logs: dict[str, Path] = {}

    def __enter__(self) -> Harness:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- starting ------------------------------------------------------------------------------------
    def start(
        self,
        name: str,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        log: Path | None = None,
        append: bool = False,
        cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Starts `argv` as child `name` and returns its Popen. With `append`, `name` may be started
        again (a restart) and its log is appended to, each incarnation headed by a line."""
        if name in self.logs and not append:
            raise ValueError(f"child started twice without append: {name=}")
        path = Path(log) if log is not None else self.log_dir / f"{name}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.logs[name] = path
        full = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **self.env, **(env or {})}
        with open(path, "a" if append else "w") as f:  # the child keeps its own descriptor
            if append:
                k = sum(1 for n, _ in self.procs if n == name)
                f.write(f"\n=== {name} incarnation {k}: {' '.join(argv)}\n")
                f.flush()
            proc = subprocess.Popen(
                die_with_parent(argv),
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full,
                cwd=cwd,
                start_new_session=True,
            )
        self.procs.append((name, proc))
        return proc

    def get(self, name: str) -> subprocess.Popen[bytes]:
        """The latest incarnation of child `name`."""
        return [p for n, p in self.procs if n == name][-1]

    def log(self, name: str, chars: int = 3000) -> str:
        return log_tail(self.logs[name], chars)

    # -- waiting -------------------------------------------------------------------------------------
    def _check_alive(self, name: str, proc: subprocess.Popen[bytes], what: str) -> None:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{name} exited with status {proc.returncode} before {what}:\n{self.log(name, 1500)}"
            )

    def wait_file(self, path: Path, name: str, timeout: float) -> float:
        """Seconds until `path` exists; raises RuntimeError if child `name` exits first and
        TimeoutError after `timeout` seconds (both with its log's tail)."""
        proc, t0 = self.get(name), time.monotonic()
        while time.monotonic() - t0 < timeout:
            if Path(path).exists():
                return time.monotonic() - t0
            self._check_alive(name, proc, f"writing {path}")
            time.sleep(POLL_S)
        raise TimeoutError(f"{name} did not write {path} within {timeout:g}s:\n{self.log(name, 1500)}")

    def wait_port(self, port_file: Path, name: str, timeout: float) -> int:
        """The port child `name` wrote to `port_file` (batchd's `--port-file`: JSON with "port")."""
        import json

        self.wait_file(port_file, name, timeout)
        deadline = time.monotonic() + 5.0
        while True:  # the writer may not have finished the file yet
            try:
                return int(json.loads(Path(port_file).read_text())["port"])
            except (ValueError, KeyError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(POLL_S)

    def wait_line(self, name: str, pattern: str, timeout: float) -> re.Match[str]:
        """The first match of regex `pattern` in child `name`'s log (searched line by line)."""
        proc, t0, rx = self.get(name), time.monotonic(), re.compile(pattern)
        while time.monotonic() - t0 < timeout:
            for line in self.log(name, 1 << 20).splitlines():
                m = rx.search(line)
                if m:
                    return m
            self._check_alive(name, proc, f"logging {pattern!r}")
            time.sleep(POLL_S)
        raise TimeoutError(f"{name} did not log {pattern!r} within {timeout:g}s:\n{self.log(name, 1500)}")

    def wait(self, name: str, timeout: float) -> int:
        """Child `name`'s exit status; raises TimeoutError (with its log's tail) after `timeout`."""
        try:
            return self.get(name).wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{name} did not exit within {timeout:g}s:\n{self.log(name, 1500)}") from None

    def codes(self) -> dict[str, int | None]:
        """Each child's latest incarnation's exit status (None while it runs)."""
        return {n: p.poll() for n, p in self.procs}

    # -- stopping ------------------------------------------------------------------------------------
    def signal(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Sends `sig` to child `name`'s process group (its latest incarnation), if it still runs."""
        _killpg(self.get(name), sig)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERMs every running child's process group, then SIGKILLs those left after `grace`."""
        for _, p in self.procs:
            _killpg(p, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for _, p in self.procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                _killpg(p, signal.SIGKILL)
                p.wait()


def _killpg(proc: subprocess.Popen[bytes], sig: int) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)  # start_new_session: the child leads its group
    except ProcessLookupError:
        pass
    except PermissionError:
        proc.send_signal(sig)
