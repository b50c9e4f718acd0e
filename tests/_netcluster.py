"""A cluster in a box: hosts with their own network namespaces, addresses and host names, on one machine.

    python tests/_netcluster.py job [--hosts 2] [--keep DIR]   # the real job across hosts (as the test)
    python tests/_netcluster.py clean                          # delete namespaces a killed run left

(`deploy/smoke/cluster.sh` runs the first.) Needs root and iproute2's `ip` and util-linux's `unshare`;
`NetCluster.unavailable()` says why not, and the tests skip with that reason.

Topology. Every "host" is a network namespace with one interface, `eth0`, its own address
10.77.I.2/24 (host I; the head is host 0) and a default route through a router namespace at
10.77.I.1, which forwards between the hosts (one veth pair per host). Nothing is added to the
machine's own network stack: the veth pairs are created inside the namespaces, and the 10.77.0.0/16
addresses exist only there. Each party runs in its host's namespace and, through a UTS namespace of
its own, under its host's name (`hostname` prints it; node agents name themselves by it), and every
host resolves every host's name (an /etc/hosts of its own, /etc/netns/NS/hosts, which `ip netns exec`
mounts over /etc/hosts: torchrun's rendezvous resolves its own host name). Ports are the host's own:
two hosts may listen on the same port.

Faults, each at the router (so a host sees silence, not an error):
- `cut(host)` / `heal(host)`: the host's link down / up (every packet to or from it is dropped);
- `partition(a, b)` / `join(a, b)`: packets between two hosts dropped (`ip rule ... blackhole`),
  each still reaching every other host;
- `kill_host(host)`: SIGKILL to every process of the host (its namespace's pids): the host is lost.

Names: every namespace is `bdc<owner pid>-<name>`; `close()` kills every process in them and deletes
them, and a new cluster first deletes those whose owner is gone (a test killed before its cleanup).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

PREFIX = "bdc"
SUBNET = "10.77"
ETC_NETNS = Path("/etc/netns")  # `ip netns exec NS` mounts /etc/netns/NS/hosts over /etc/hosts


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace(ns: str) -> None:
    """SIGKILLs every process in `ns` (repeatedly: a dying parent may still fork) and deletes it, and its
    /etc/netns files."""
    for _ in range(20):
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.1)
    _ip("netns", "del", ns, check=False)
    shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)


def clean_stale() -> list[str]:
    """Deletes the namespaces of clusters whose owner process is gone; returns their names."""
    gone = []
    for ns in _namespaces():
        owner = ns[len(PREFIX) :].split("-", 1)[0]
        if ns.startswith(PREFIX) and owner.isdigit() and not _alive(int(owner)):
            _kill_namespace(ns)
            gone.append(ns)
    return gone


class NetCluster:
    """`hosts` (names; the first is the head) as namespaces behind one router; `work` holds the logs.

    Use as a context manager, or call `up()` and `close()`."""

    def __init__(self, hosts: list[str], work: Path) -> None:
        if len(set(hosts)) != len(hosts) or not hosts:
            raise ValueError(f"hosts must be distinct names, got {hosts=}")
        self.hosts = list(hosts)
        self.work = Path(work)
        self.logs = self.work / "logs"
        self.tag = f"{PREFIX}{os.getpid()}"
        self.procs: dict[str, tuple[str, subprocess.Popen]] = {}
        self._made: list[str] = []
        self._rules: set[tuple[str, str]] = set()

    # -- what a test asks ---------------------------------------------------------------------------
    @staticmethod
    def unavailable() -> str | None:
        """Why namespaces cannot be made here (None: they can)."""
        if os.geteuid() != 0:
            return "network namespaces need root (ip netns add)"
        for tool in ("ip", "unshare", "hostname"):
            if shutil.which(tool) is None:
                return f"{tool} is not installed"
        probe = f"{PREFIX}{os.getpid()}-probe"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"ip netns add failed: {made.stderr.strip()}"
        _ip("netns", "del", probe, check=False)
        return None

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def addr(self, host: str) -> str:
        """The host's own address."""
        return f"{SUBNET}.{self.hosts.index(host)}.2"

    # -- life -----------------------------------------------------------------------------------------
    def __enter__(self) -> NetCluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def up(self) -> NetCluster:
        clean_stale()
        self.logs.mkdir(parents=True, exist_ok=True)
        router = self.ns("router")
        try:
            self._add(router)
            _ip("-n", router, "link", "set", "lo", "up")
            subprocess.run(
                ["ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1"],
                check=True,
                capture_output=True,
            )
            for i, host in enumerate(self.hosts):
                ns = self.ns(host)
                self._add(ns)
                _ip(
                    "link",
                    "add",
                    "eth0",
                    "netns",
                    ns,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    f"r{i}",
                    "netns",
                    router,
                )
                _ip("-n", router, "addr", "add", f"{SUBNET}.{i}.1/24", "dev", f"r{i}")
                _ip("-n", router, "link", "set", f"r{i}", "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "route", "add", "default", "via", f"{SUBNET}.{i}.1")
        except BaseException:
            self.close()
            raise
        return self

    def _add(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)
        etc = ETC_NETNS / ns  # `ip netns exec` bind-mounts these over /etc: each host resolves every name
        etc.mkdir(parents=True, exist_ok=True)
        names = "".join(f"{self.addr(h)} {h}\n" for h in self.hosts)
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n::1 localhost\n{names}")

    def close(self) -> None:
        """Ends every process of every host (SIGKILL) and deletes the namespaces."""
        for ns in reversed(self._made):
            _kill_namespace(ns)
        for _, p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self._made.clear()

    # -- parties ----------------------------------------------------------------------------------------
    def start(
        self,
        host: str,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen:
        """Runs `argv` on `host` (its network, its host name) in `cwd`, output to logs/NAME.log; NAME is
        unique."""
        if name in self.procs:
            raise ValueError(f"a party named {name=} was started already")
        wrapped = [
            "ip", "netns", "exec", self.ns(host),
            "unshare", "--uts", "--",
            "sh", "-c", 'hostname "$0" && exec "$@"', host, *argv,
        ]  # fmt: skip
        log = open(self.logs / f"{name}.log", "w")  # noqa: SIM115 - the child holds it
        try:
            p = subprocess.Popen(
                wrapped,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                cwd=cwd,
                start_new_session=True,
            )
        finally:
            log.close()
        self.procs[name] = (host, p)
        return p

    def get(self, name: str) -> subprocess.Popen:
        return self.procs[name][1]

    def log(self, name: str, n: int = 4000) -> str:
        try:
            return (self.logs / f"{name}.log").read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def all_logs(self, n: int = 3000) -> str:
        return "\n".join(
            f"===== {name} ({host}) =====\n{self.log(name, n)}" for name, (host, _) in self.procs.items()
        )

    def exec(self, host: str, argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        """Runs a short command on `host` and returns it (output captured)."""
        return subprocess.run(
            ["ip", "netns", "exec", self.ns(host), *argv], capture_output=True, text=True, timeout=timeout
        )

    # -- faults -------------------------------------------------------------------------------------------
    def cut(self, host: str) -> None:
        """The host's link goes down: every packet to or from it is dropped at the router."""
        _ip("-n", self.ns("router"), "link", "set", f"r{self.hosts.index(host)}", "down")

    def heal(self, host: str) -> None:
        _ip("-n", self.ns("router"), "link", "set", f"r{self.hosts.index(host)}", "up")

    def partition(self, a: str, b: str) -> None:
        """Packets between hosts a and b are dropped at the router; each still reaches the others."""
        for x, y in ((a, b), (b, a)):
            _ip(
                "-n",
                self.ns("router"),
                "rule",
                "add",
                "from",
                f"{self.addr(x)}/32",
                "to",
                f"{self.addr(y)}/32",
                "blackhole",
            )
            self._rules.add((x, y))
        _ip("-n", self.ns("router"), "route", "flush", "cache", check=False)

    def join(self, a: str, b: str) -> None:
        for x, y in ((a, b), (b, a)):
            if (x, y) in self._rules:
                _ip(
                    "-n",
                    self.ns("router"),
                    "rule",
                    "del",
                    "from",
                    f"{self.addr(x)}/32",
                    "to",
                    f"{self.addr(y)}/32",
                    "blackhole",
                )
                self._rules.discard((x, y))

    def kill_host(self, host: str) -> list[int]:
        """SIGKILL to every process on the host (the host is lost); returns their pids."""
        pids = [int(p) for p in _ip("netns", "pids", self.ns(host), check=False).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return pids


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tests/_netcluster.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    job = sub.add_parser("job", help="run the real job across hosts (the test's), print its figures")
    job.add_argument("--keep", metavar="DIR", help="work here (kept); default: a temporary directory")
    sub.add_parser("clean", help="delete the namespaces of runs that were killed")
    args = ap.parse_args(argv)
    if args.cmd == "clean":
        print("\n".join(clean_stale()) or "nothing to clean")
        return 0
    why = NetCluster.unavailable()
    if why:
        print(f"cannot build the cluster here: {why}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _netjobs import run_cli_job

    return run_cli_job(args.keep)


if __name__ == "__main__":
    sys.exit(main())
