"""Process and port helpers shared by the multi-process tests."""

from __future__ import annotations

import socket
from pathlib import Path


def free_block(n: int) -> int:
    """A port p with p .. p + n - 1 all free on loopback right now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + n >= 65536:
            continue
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {n} free ports")


def processes_with_marker(marker: str) -> list[str]:
    """Live (non-zombie) processes whose environment holds `marker` ("NAME=value"), as "pid: cmdline"."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if marker.encode() not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        found.append(f"{proc.name}: {cmd[:200]}")
    return found
