"""Start workers through PyTorch's elastic launcher (the engine behind ``torchrun``).

acc-train never manages processes itself: local multi-process runs, multi-node rendezvous and
restarts on failure are the elastic agent's job. This module only translates the ``launch:``
section into its ``LaunchConfig`` and reports a failed worker readably.
"""

from __future__ import annotations

import json
import logging
import re
import os
import sys
import uuid
from dataclasses import dataclass
from typing import Any

from acc_train.config import LaunchConfig as LaunchSection
from acc_train.errors import EXIT_USER_ERROR, is_connection_lost, is_lost_peer
from acc_train.strategy import Machine

__all__ = ["launch", "LaunchFailed", "LaunchStopped", "default_num_processes", "launch_machine", "worker_command"]


@dataclass
class LaunchStopped(Exception):
    """The launcher got a signal (``signum``); it passed it on to the workers and stopped them."""

    signum: int


@dataclass
class LaunchFailed(Exception):
    """A worker failed; ``report`` shows the failing rank's error first."""

    exit_code: int
    report: str
    #: every recorded failure on this machine is a lost peer's symptom (a rank of another
    #: machine died, or its machine was lost): the command adds the checkpoint and the restart
    lost_peer: bool = False

    def __str__(self) -> str:
        return self.report


def default_num_processes() -> int:
    import torch

    return torch.cuda.device_count() or 1


def launch_machine(section: LaunchSection) -> Machine:
    """The machines the resolved launch section describes: this machine's device type,
    ``num_processes`` (or one per GPU) on each of ``num_machines``. Built once before launch and
    bound to the strategy (:meth:`acc_train.Strategy.bind`) for its checks."""
    from acc_train.machine import current_machine

    nproc = section.num_processes or default_num_processes()
    return Machine(current_machine().device_type, nproc * section.num_machines, section.num_machines)


#: torch elastic's wait between passing a signal on and killing the workers, where its
#: ``LaunchConfig`` has no ``shutdown_timeout`` to set it (torch 2.11 waits this, fixed)
FIXED_SHUTDOWN_TIMEOUT = 30


def _has_shutdown_timeout() -> bool:
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    return "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}


def check_launch_support(section: LaunchSection) -> None:
    """Refuse, before launch, a ``launch:`` setting this torch's elastic launcher cannot honour
    (exit 2): ``shutdown_timeout`` other than the fixed 30 s where torch has no such setting."""
    if section.shutdown_timeout != FIXED_SHUTDOWN_TIMEOUT and not _has_shutdown_timeout():
        import torch

        from acc_train.errors import UserError

        raise UserError(
            f"shutdown_timeout: {section.shutdown_timeout} cannot be set with torch {torch.__version__}: its elastic "
            f"launcher has no shutdown_timeout and always waits {FIXED_SHUTDOWN_TIMEOUT} s between passing a signal on and killing the workers",
            where="launch",
            hint=f"remove launch.shutdown_timeout (or set it to {FIXED_SHUTDOWN_TIMEOUT}), or install a torch whose "
            "torch.distributed.launcher.api.LaunchConfig has shutdown_timeout (2.13 has it)",
        )


def _launch_config(section: LaunchSection, nproc: int) -> Any:
    from torch.distributed.launcher.api import LaunchConfig

    check_launch_support(section)

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
    }
    if _has_shutdown_timeout():  # else torch waits FIXED_SHUTDOWN_TIMEOUT (check_launch_support)
        common["shutdown_timeout"] = section.shutdown_timeout
    if section.num_machines == 1:  # torchrun --standalone: a private rendezvous on a free port
        return LaunchConfig(
            run_id=str(uuid.uuid4()), rdzv_backend="c10d", rdzv_endpoint="localhost:0", rdzv_configs={"is_host": True}, **common
        )
    endpoint = f"{section.main_process_ip}:{section.main_process_port}"
    if section.rdzv_backend == "static":
        return LaunchConfig(
            run_id="acc-train", rdzv_backend="static", rdzv_endpoint=endpoint, rdzv_configs={"rank": section.machine_rank, "timeout": section.rendezvous_timeout}, **common
        )
    return LaunchConfig(
        run_id=os.environ.get("ACC_TRAIN_RUN_ID", "acc-train"),
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs={"is_host": section.machine_rank == 0, "join_timeout": section.rendezvous_timeout},
        **common,
    )


def worker_command(module: str, *args: str) -> list[str]:
    """Interpreter arguments that run ``module`` as ``__main__`` (as ``python -m`` does) without
    the working directory on ``sys.path``: ``python -m`` would put it first, so a user's
    ``queue.py`` or ``datasets.py`` there would replace the library every worker imports
    (Python 3.11's ``-P`` does this, and acc-train supports 3.10). The worker dies with the
    command that started it (:func:`acc_train.launch.scratch.die_with_parent`)."""
    bootstrap = (
        "import sys; del sys.path[0]; from acc_train.launch.scratch import die_with_parent; die_with_parent(); "
        f"import runpy; runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    )
    return ["-c", bootstrap, *args]


def launch(section: LaunchSection, args: list[str], env: dict[str, str]) -> None:
    """Run ``python ARGS`` on every worker; raises :class:`LaunchFailed` if one fails."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    machine = launch_machine(section)
    nproc = machine.world_size // machine.num_machines
    os.environ.update(env)
    if section.max_restarts:
        # Workers restarted by the agent would rendezvous through the agent's TCPStore, where
        # the failed attempt's keys are still present: gloo then connects to dead peers and
        # hangs (explicit rank/world_size, as Accelerate passes them; pytorch/pytorch#135712).
        # Unshared, rank 0 hosts a fresh store on a new port every attempt.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # as torchrun does, but sized to the machine; one process keeps torch's own default (the same
    # thread count, and 5-20% faster steps on a small model than with the variable set: BENCHMARKS.md)
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    # failures are reported below, failing rank first; the agent's own log lines only repeat them
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.launcher").setLevel(logging.CRITICAL)
    # set its own level (torch's LOGLEVEL); a stop on a signal is reported by the command in one line
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.CRITICAL)
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    try:
        elastic_launch(_launch_config(section, nproc), sys.executable)(*args)
    except ChildFailedError as exc:
        raise _failure_report(exc, machines=section.num_machines) from None
    except (DistNetworkError, RendezvousError) as exc:  # before any worker started: the launch settings
        raise _rendezvous_report(section, exc) from None
    except SignalException as exc:  # the workers got it too, and had shutdown_timeout seconds to stop
        raise LaunchStopped(int(exc.sigval)) from None


def _rendezvous_report(section: LaunchSection, exc: Exception) -> LaunchFailed:
    """A rendezvous that could not start (a busy port, an address that cannot be reached or
    bound, machines that did not all join in time): exit 2, naming the setting to change."""
    endpoint = f"{section.main_process_ip or 'localhost'}:{section.main_process_port}"
    text = " ".join(str(exc).split())
    if "EADDRINUSE" in text or "address already in use" in text:
        what, hint = f"port {section.main_process_port} on this machine is already in use", "set --main-process-port (launch.main_process_port) to a free port, the same on every machine"
    elif "timed out" in text.lower() or "timeout" in text.lower():
        what = f"not every machine joined the rendezvous at {endpoint} within {section.rendezvous_timeout:g} s"
        hint = "start acc-train on every machine (--num-machines), check --main-process-ip / --main-process-port, or raise launch.rendezvous_timeout"
    else:
        what, hint = f"the rendezvous at {endpoint} could not start", "check --main-process-ip (machine 0's address, reachable from every machine) and --main-process-port"
    return LaunchFailed(EXIT_USER_ERROR, f"launch.main_process_port: {what} ({text[:300]})\n  hint: {hint}")




#: how the worker's error file begins for errors in the user's hands (``type(e).__name__: ``)
USER_ERROR_NAMES = ("UserError: ", "PluginError: ", "DiskFullError: ")


def _recorded(failure: Any) -> bool:
    """Whether the rank recorded its error (torch's error file; without one, torch fills
    ``error_file_data`` with traits only)."""
    return failure.error_file != "<N/A>" and isinstance(failure.error_file_data, dict) and failure.error_file_data.get("message") not in (None, "<NONE>")


def _message(failure: Any) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", json.dumps(message))
    return str(message or "")


def _root_cause(exc: Any) -> tuple[int, Any]:
    """The failure to show first: the earliest recorded error that is not a lost peer's
    symptom; else a rank that ended without recording one and was not stopped by the agent
    (killed by the kernel, crashed in native code, exited on its own); else the earliest."""
    failures = exc.failures
    recorded = {r: f for r, f in failures.items() if _recorded(f)}
    causes = {r: f for r, f in recorded.items() if not is_lost_peer(_message(f))}
    if causes:
        rank = min(causes, key=lambda r: causes[r].timestamp)
        return rank, causes[rank]
    silent = {r: f for r, f in failures.items() if not _recorded(f) and f.exitcode not in (-15, -2)}  # not SIGTERM/SIGINT from the agent
    if silent:
        rank = min(silent)
        return rank, silent[rank]
    return exc.get_first_failure()


def _lost_peer_report(exc: Any, rank: int, first: Any) -> LaunchFailed:
    """Every rank here stopped because a peer's connection went: one message, the symptom as
    the first rank to notice recorded it (gloo names the peer's address), no traceback."""
    text = _message(first).splitlines()[0] if _message(first) else ""
    seen = re.search(r"(Connection closed by peer|Connection reset by peer)( \[[^\]]+\]:\d+)?", text)
    symptom = seen.group(0).strip() if seen else text[:200]
    others = sorted(r for r in exc.failures if r != rank)
    also = f"; rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} stopped with it" if others else ""
    report = (
        f"lost a peer: rank {rank} lost its connection to another rank ({symptom}){also}. A process on another machine "
        "died, or that machine was lost; its own log says which"
    )
    return LaunchFailed(first.exitcode if first.exitcode > 0 else 1, report, lost_peer=True)


def _failure_report(exc: Any, machines: int = 1) -> LaunchFailed:
    rank, first = _root_cause(exc)
    text = _message(first)
    # every rank here lost its connection, and nothing here died first: another machine's rank
    if machines > 1 and _recorded(first) and is_connection_lost(text) and first.exitcode != EXIT_USER_ERROR:
        return _lost_peer_report(exc, rank, first)
    # the worker recorded a UserError and exits 2; a process that crashes in native teardown
    # after recording it (seen under heavy load: SIGBUS/abort at interpreter exit) still failed
    # on the user's input, and says so with the same exit code
    if first.exitcode == EXIT_USER_ERROR or text.startswith(USER_ERROR_NAMES):
        for name in USER_ERROR_NAMES:
            text = text.removeprefix(name)
        return LaunchFailed(EXIT_USER_ERROR, text)
    if not _recorded(first):  # torch's placeholder ("To enable traceback see: ...") says nothing
        if first.exitcode < 0:
            import signal

            name = signal.Signals(-first.exitcode).name if -first.exitcode in signal.Signals._value2member_map_ else str(-first.exitcode)
            text = f"killed by {name} without recording an error" + (
                " (SIGKILL: often the kernel's out-of-memory killer; `dmesg` or the job's memory limit says)" if name == "SIGKILL" else ""
            )
        else:
            text = f"exited with code {first.exitcode} without recording an error; its own output above shows why"
    trace = ""
    if _recorded(first):
        extra = first.error_file_data.get("message", {})
        if isinstance(extra, dict):
            trace = extra.get("extraInfo", {}).get("py_callstack", "")
    others = sorted(r for r in exc.failures if r != rank)
    lines = [f"rank {rank} failed first (exit code {first.exitcode}): {text}"]
    if trace:
        lines.append(trace.rstrip())
    if others:
        lines.append(f"ranks {others} stopped after it")
    return LaunchFailed(first.exitcode if first.exitcode > 0 else 1, "\n".join(lines))
