"""`python -m batchd.train --elastic DIR --config job.toml`: the job's services started by its own
torchrun workers, so that torchrun elastic (`--nnodes MIN:MAX --max-restarts R`) resizes the job by itself.

torchrun restarts every worker of the job whenever its membership changes (a host lost, one added) or a
worker fails, with the new WORLD_SIZE, RANK and GROUP_RANK. Each start of a worker group therefore starts
the services that fit it:

- global rank 0 starts the coordinator: `batchd coordinator --config FILE --world-size $WORLD_SIZE
  --state-dir DIR/coordinator --resize --host 0.0.0.0`, on the config's `[coordinator] port`; with the
  journal of the same world size it restarts the job where it stood, with another it resizes it
  (`batchd.core._resize`), so `--resize` is what `--elastic` opts into;
- local rank 0 of each host starts its node agent: `batchd node --config FILE --world-size $WORLD_SIZE
  --local-ranks $LOCAL_WORLD_SIZE --node-rank $GROUP_RANK --coordinator $MASTER_ADDR:PORT --state-dir
  DIR/ranks` on the config's `[rank] base_port` + $GROUP_RANK (one journal per global rank, so a rank's
  journal follows it to whichever host serves it after a re-rendezvous);
- every worker trains on its host's agent (`--node-agent 127.0.0.1:PORT`) and resumes from the furthest
  checkpoint of `--checkpoint` (batchd/train.py).

DIR and the checkpoint directory must be shared by every host (NFS, Lustre, a bucket mount): the new
rank 0 may run on another host than the old one. The services die with the worker that started them
(`die_with_parent`: SIGTERM when it exits, however), so a restart of the worker group restarts them from
their journals; a new one first waits until the old one left its port. MASTER_ADDR, which torchrun sets
to rank 0's host, is where the coordinator listens. `BATCHD_ADVERTISE` (default the host name) is the
address other hosts reach this host's agent at.

torchrun must run with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`: by default its agents share one TCPStore
across restarts of the worker group, and a restarted group's gloo (or NCCL) bootstrap can read the last
group's keys (a dead peer's address: "Connection refused", or a reused port: a hang; pytorch issue
#135712). With the variable set, each group's rank 0 hosts a fresh store. `--elastic` refuses to start
without it (`check_torchrun_env`).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from batchd.launch import die_with_parent

PORT_FREE_S = 60.0  # how long a new service waits for its predecessor to leave its port


def _port_taken(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


SHARED_STORE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def check_torchrun_env(env: dict[str, str]) -> None:
    """Raises ValueError when torchrun shares its rendezvous store with the workers (module docstring)."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise ValueError(
            f"--elastic needs torchrun started with {SHARED_STORE_VAR}=1: with the store torchrun shares "
            f"across restarts, a restarted worker group reads the last group's addresses and its process "
            f"group fails or hangs (pytorch issue #135712); run `{SHARED_STORE_VAR}=1 torchrun ...`"
        )


class ElasticServices:
    """The services this worker started (module docstring); `agent` is its host's node agent address."""

    def __init__(self, config: str, directory: str, env: dict[str, str] | None = None) -> None:
        from batchd._config import load_config

        env = dict(os.environ if env is None else env)
        check_torchrun_env(env)
        cfg = load_config(config, check_files=False)
        self.coordinator_port, self.agent_port = int(cfg.coordinator.port), int(cfg.rank.base_port)
        if not self.coordinator_port or not self.agent_port:
            raise ValueError(
                f"--elastic needs fixed ports in {config}: [coordinator] port and [rank] base_port, got "
                f"{self.coordinator_port} and {self.agent_port}"
            )
        self.rank, self.world = int(env["RANK"]), int(env["WORLD_SIZE"])
        self.local_rank, self.local_world = int(env["LOCAL_RANK"]), int(env.get("LOCAL_WORLD_SIZE", "1"))
        self.node_rank = int(env.get("GROUP_RANK", env.get("NODE_RANK", "0")))
        self.agent_port += self.node_rank  # hosts sharing one machine (a test) do not collide
        self.master = env.get("MASTER_ADDR", "127.0.0.1")
        self.config, self.dir = config, Path(directory)
        self.agent = f"127.0.0.1:{self.agent_port}"
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self._ending = threading.Event()  # `wait` began: the services' exits are the job's end
        self.advertise = env.get("BATCHD_ADVERTISE") or socket.gethostname()

    def start(self) -> None:
        """Starts this worker's services (the coordinator on rank 0, the agent on local rank 0)."""
        batchd = [sys.executable, "-m", "batchd"]
        common = ["--config", self.config, "--world-size", str(self.world)]
        if self.rank == 0:
            self._free(self.coordinator_port)
            argv = [*batchd, "coordinator", *common, "--state-dir", str(self.dir / "coordinator"), "--resize"]
            self._spawn("coordinator", [*argv, "--host", "0.0.0.0", "--port", str(self.coordinator_port)])
        if self.local_rank == 0:
            self._free(self.agent_port)
            argv = [*batchd, "node", *common, "--local-ranks", str(self.local_world)]
            argv += ["--node-rank", str(self.node_rank), "--state-dir", str(self.dir / "ranks")]
            argv += ["--coordinator", f"{self.master}:{self.coordinator_port}", "--host", "0.0.0.0"]
            argv += ["--name", f"{socket.gethostname()}/{self.node_rank}", "--advertise", self.advertise]
            self._spawn("node", [*argv, "--port", str(self.agent_port)])
        threading.Thread(target=self._watch, name="elastic-services", daemon=True).start()

    def _watch(self) -> None:
        """A service of this worker that exits with an error before the worker ends (e.g. a coordinator
        that refuses its journal) ends the worker at once, naming it and its log's last line: its torchrun
        then restarts or ends the group, instead of the trainers waiting out their start-up timeouts."""
        while not self._ending.wait(0.5):
            for name, proc in self.procs:
                code = proc.poll()
                if code not in (None, 0) and not self._ending.is_set():
                    log = self.dir / "logs" / f"{name}-rank{self.rank}.log"
                    lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
                    print(
                        f"[rank {self.rank}] --elastic: the {name} this worker started exited {code}: "
                        f"{lines[-1] if lines else '(no log)'} (log {log})",
                        file=sys.stderr,
                        flush=True,
                    )
                    os._exit(1)

    def _free(self, port: int) -> None:
        deadline = time.monotonic() + PORT_FREE_S
        while _port_taken("127.0.0.1", port):
            if time.monotonic() > deadline:
                raise OSError(
                    f"port {port} is still taken after {PORT_FREE_S:g}s (a service of the last "
                    f"worker group that did not stop?)"
                )
            time.sleep(0.2)

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = self.dir / "logs" / f"{name}-rank{self.rank}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                die_with_parent(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        self.procs.append((name, proc))
        print(
            f"[rank {self.rank}] --elastic: started the {name} (pid {proc.pid}, log {log})",
            file=sys.stderr,
            flush=True,
        )

    def wait(self, timeout: float) -> dict[str, int | None]:
        """Waits up to `timeout` seconds for the services to exit on their own (a finished job's do), then
        stops the rest; their exit statuses."""
        self._ending.set()
        deadline = time.monotonic() + timeout
        out: dict[str, int | None] = {}
        for name, proc in self.procs:
            try:
                out[name] = proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.terminate()
                out[name] = None
        return out
