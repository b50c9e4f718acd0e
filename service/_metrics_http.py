"""The HTTP endpoint of the services' Prometheus metrics (`_metrics`): `start_metrics_server` serves one
registry (a `RankMetrics`' or `CoordinatorMetrics`' `registry`, or a node agent's `MergedRegistry` of
its ranks' registries) in the Prometheus text format on a daemon thread; `stop_metrics_server` ends it.

Bound to 127.0.0.1 by default: metrics are not meant for the open network (HTTPS with a certificate
and key when given).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric


def start_metrics_server(
    registry: CollectorRegistry,
    host: str = "127.0.0.1",
    port: int = 0,
    certfile: str | None = None,
    keyfile: str | None = None,
) -> tuple[Any, int]:
    """Serves `registry` in the Prometheus text format at http://host:port/ (any path) on a daemon thread.

    Args:
        registry: The service's registry (`RankMetrics.registry`, `CoordinatorMetrics.registry`).
        host: Address to bind; 127.0.0.1 by default (metrics are not meant for the open network).
        port: Port to bind; 0 picks a free one.
        certfile: With `keyfile`, serve HTTPS with this certificate chain.
        keyfile: The certificate's private key.

    Returns:
        (server, bound_port); stop it with `stop_metrics_server(server)`.
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"metrics port must be in 0..65535, got {port=}")
    if (certfile is None) != (keyfile is None):
        raise ValueError(f"give both certfile and keyfile or neither, got {certfile=} {keyfile=}")
    # prometheus_client >= 0.20 (pyproject) returns (server, thread); the thread ends with `shutdown()`
    server, _thread = start_http_server(
        port, addr=host, registry=registry, certfile=certfile, keyfile=keyfile
    )
    return server, int(server.server_port)


def stop_metrics_server(server: Any) -> None:
    """Stops a `start_metrics_server` server: ends its serving loop and closes its socket."""
    server.shutdown()
    server.server_close()


class MergedRegistry:
    """The metrics of several registries (a node agent's ranks) as one: families of the same name are
    merged (their series differ by the `rank` label). Serve it with `start_metrics_server`."""

    def __init__(self, registries: list[CollectorRegistry]) -> None:
        self.registries = list(registries)

    def collect(self) -> list[Metric]:
        families: dict[str, Any] = {}
        for registry in self.registries:
            for family in registry.collect():
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        return list(families.values())
