"""Start workers through PyTorch's elastic launcher (the engine behind ``torchrun``).

acc-train never manages processes itself: local multi-process runs, multi-node rendezvous and
restarts on failure are the elastic agent's job. This module only translates the ``launch:``
section into its ``LaunchConfig`` and reports a failed worker readably.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import uuid
from dataclasses import dataclass
from typing import Any

from acc_train.config import LaunchConfig as LaunchSection
from acc_train.errors import EXIT_USER_ERROR

__all__ = ["launch", "LaunchFailed", "LaunchStopped", "default_num_processes", "worker_command"]


@dataclass
class LaunchStopped(Exception):
    """The launcher got a signal (``signum``); it passed it on to the workers and stopped them."""

    signum: int


@dataclass
class LaunchFailed(Exception):
    """A worker failed; ``report`` shows the failing rank's error first."""

    exit_code: int
    report: str

    def __str__(self) -> str:
        return self.report


def default_num_processes() -> int:
    import torch

    return torch.cuda.device_count() or 1


def _launch_config(section: LaunchSection, nproc: int) -> Any:
    from torch.distributed.launcher.api import LaunchConfig

    common: dict[str, Any] = {
        "min_nodes": section.num_machines,
        "max_nodes": section.num_machines,
        "nproc_per_node": nproc,
        "max_restarts": section.max_restarts,
        "start_method": "spawn",
        "monitor_interval": 0.1,
        # the agent passes these on to the workers (which save on launch.save_signals), then
        # waits shutdown_timeout seconds before killing them
        "signals_to_handle": ",".join(dict.fromkeys(["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", *section.save_signals])),
        "shutdown_timeout": section.shutdown_timeout,
    }
    if section.num_machines == 1:  # torchrun --standalone: a private rendezvous on a free port
        return LaunchConfig(
            run_id=str(uuid.uuid4()), rdzv_backend="c10d", rdzv_endpoint="localhost:0", rdzv_configs={"is_host": True}, **common
        )
    endpoint = f"{section.main_process_ip}:{section.main_process_port}"
    if section.rdzv_backend == "static":
        return LaunchConfig(
            run_id="acc-train", rdzv_backend="static", rdzv_endpoint=endpoint, rdzv_configs={"rank": section.machine_rank, "timeout": 900}, **common
        )
    return LaunchConfig(
        run_id=os.environ.get("ACC_TRAIN_RUN_ID", "acc-train"),
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs={"is_host": section.machine_rank == 0},
        **common,
    )


def worker_command(module: str, *args: str) -> list[str]:
    """Interpreter arguments that run ``module`` as ``__main__`` (as ``python -m`` does) without
    the working directory on ``sys.path``: ``python -m`` would put it first, so a user's
    ``queue.py`` or ``datasets.py`` there would replace the library every worker imports
    (Python 3.11's ``-P`` does this, and acc-train supports 3.10). The worker dies with the
    command that started it (:func:`acc_train.launch_files.die_with_parent`)."""
    bootstrap = (
        "import sys; del sys.path[0]; from acc_train.launch_files import die_with_parent; die_with_parent(); "
        f"import runpy; runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    )
    return ["-c", bootstrap, *args]


def launch(section: LaunchSection, args: list[str], env: dict[str, str]) -> None:
    """Run ``python ARGS`` on every worker; raises :class:`LaunchFailed` if one fails."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    nproc = section.num_processes or default_num_processes()
    os.environ.update(env)
    if section.max_restarts:
        # Workers restarted by the agent would rendezvous through the agent's TCPStore, where
        # the failed attempt's keys are still present: gloo then connects to dead peers and
        # hangs (explicit rank/world_size, as Accelerate passes them; pytorch/pytorch#135712).
        # Unshared, rank 0 hosts a fresh store on a new port every attempt.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if "OMP_NUM_THREADS" not in os.environ:  # as torchrun does, but sized to the machine
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    # failures are reported below, failing rank first; the agent's own log lines only repeat them
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.launcher").setLevel(logging.CRITICAL)
    # set its own level (torch's LOGLEVEL); a stop on a signal is reported by the command in one line
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.CRITICAL)
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        elastic_launch(_launch_config(section, nproc), sys.executable)(*args)
    except ChildFailedError as exc:
        raise _failure_report(exc) from None
    except SignalException as exc:  # the workers got it too, and had shutdown_timeout seconds to stop
        raise LaunchStopped(int(exc.sigval)) from None


def _failure_report(exc: Any) -> LaunchFailed:
    rank, first = exc.get_first_failure()
    message = first.message
    if isinstance(message, dict):
        message = message.get("message", json.dumps(message))
    text = str(message or "")
    # the worker recorded a UserError and exits 2; a process that crashes in native teardown
    # after recording it (seen under heavy load: SIGBUS/abort at interpreter exit) still failed
    # on the user's input, and says so with the same exit code
    if first.exitcode == EXIT_USER_ERROR or text.startswith(("UserError: ", "PluginError: ")):
        return LaunchFailed(EXIT_USER_ERROR, text.removeprefix("UserError: ").removeprefix("PluginError: "))
    trace = ""
    if first.error_file_data:
        extra = first.error_file_data.get("message", {})
        if isinstance(extra, dict):
            trace = extra.get("extraInfo", {}).get("py_callstack", "")
    others = sorted(r for r in exc.failures if r != rank)
    lines = [f"rank {rank} failed first (exit code {first.exitcode}): {text or 'see its output above'}"]
    if trace:
        lines.append(trace.rstrip())
    if others:
        lines.append(f"ranks {others} stopped after it")
    return LaunchFailed(first.exitcode if first.exitcode > 0 else 1, "\n".join(lines))
