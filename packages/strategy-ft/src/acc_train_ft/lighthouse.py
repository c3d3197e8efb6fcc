"""``acc-train lighthouse``: torchft's lighthouse in the foreground, the address the groups need printed.

The lighthouse keeps the quorum of live replica groups by heartbeat. It must outlive every group:
run it on a host that stays up (a Slurm job's head node, its own Kubernetes Deployment).
"""

from __future__ import annotations

import signal
import socket
import threading

import click

__all__ = ["lighthouse"]

#: the lighthouse's port unless told otherwise (torchft's default)
DEFAULT_PORT = 29510


@click.command("lighthouse")
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True, help="Port to listen on (0: any free one).")
@click.option("--min-groups", type=click.IntRange(1), default=1, show_default=True, help="Groups a quorum needs; the groups' strategy.min_groups decides whether a step commits.")
@click.option("--heartbeat-timeout", type=click.FloatRange(0.1), default=5.0, show_default=True, help="Seconds without a heartbeat after which a group is lost: the survivors' stall.")
@click.option("--join-timeout", type=click.FloatRange(0.0), default=1.0, show_default=True, help="Seconds a quorum waits for a heartbeating group that has not asked to join yet.")
@click.option("--quorum-tick", type=click.FloatRange(0.001), default=0.01, show_default=True, help="Seconds between the lighthouse's quorum checks.")
def lighthouse(port: int, min_groups: int, heartbeat_timeout: float, join_timeout: float, quorum_tick: float) -> None:
    """Run the lighthouse of a fault-tolerant job (ft-ddp) in the foreground, until interrupted.

    Each replica group then names it: --set strategy.lighthouse=HOST:PORT.
    """
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind=f"[::]:{port}",
        min_replicas=min_groups,
        join_timeout_ms=int(join_timeout * 1000),
        quorum_tick_ms=max(1, int(quorum_tick * 1000)),
        heartbeat_timeout_ms=int(heartbeat_timeout * 1000),
    )
    bound = int(server.address().rsplit(":", 1)[1])
    click.echo(f"lighthouse listening on {socket.gethostname()}:{bound}", err=False)
    click.echo(f"  each group: --set strategy.lighthouse={socket.gethostname()}:{bound}", err=False)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        stop.wait()
    finally:
        server.shutdown()
