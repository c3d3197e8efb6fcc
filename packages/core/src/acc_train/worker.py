"""One worker process of a training run: ``python -m acc_train.worker CONFIG.yaml``.

The launcher starts one per rank. CONFIG.yaml is the resolved config the command wrote outside
the output directory; rank 0 copies it there as ``config.yaml`` once every rank's checks have
passed. A mistake in the user's input exits with code 2 and its
message in the elastic error file, so the launching command can show it once, without a
traceback; any other failure is recorded with its traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from acc_train.errors import EXIT_USER_ERROR, UserError


def main(argv: list[str] | None = None) -> None:
    from acc_train.machine import quiet_other_local_ranks

    quiet_other_local_ranks()  # before the libraries load: their warnings print once per machine
    from acc_train.checkpoint.faults import check_fault_env
    from acc_train.config import load_resolved
    from acc_train.trainer import restart_resumes, runs_again, train

    args = sys.argv[1:] if argv is None else argv
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own bar is the only one on screen

    @record_errors
    def run() -> None:
        from acc_train.machine import is_local_main_process
        from acc_train.launch.stop_signals import install, write_stop_marker

        output_dir = None
        try:
            check_fault_env()
            job = load_resolved(args[0])
            output_dir = job.config.output_dir
            stop = install(job.config.launch.save_signals)  # a signal from here on saves at the next step, then stops
            # a later attempt of this launch (restarted after a failure, or started again after a
            # machine left and rejoined): continue from the latest checkpoint, or start if none
            if runs_again(args[0]) and restart_resumes(job, args[0]):
                job.config.resume = "auto"
            summary = train(job, config_file=args[0], stop=stop)
            if "stopped_by" in summary and is_local_main_process():  # tell this machine's command
                write_stop_marker(args[0], summary["stopped_by"], summary["step"], summary["checkpoint"])
        except UserError as exc:
            exit_with_user_error(exc)
        except Exception as exc:
            from acc_train.files.disk_full import disk_full_error

            full = disk_full_error(exc, output_dir)  # any write (metrics, final/, run.json): one message, not a traceback
            if full is None:
                raise
            exit_with_user_error(full)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():  # a clean exit, not an abort in gloo's teardown
            dist.destroy_process_group()
        exit_finished_run()

    run()


def exit_finished_run() -> None:
    """Exit 0 once the run has finished and written its outputs.

    Python's exit handlers run (trackers, logging, coverage) and open files are flushed; the
    interpreter's own teardown, where C++ destructors of objects still holding the gloo process
    group run after Python has stopped, does not: there finished ranks (training runs and
    ``acc-train launch`` scripts) were seen to abort with "terminate called without an active
    exception", failing runs whose outputs were complete.
    """
    import atexit

    atexit._run_exitfuncs()
    flush_open_files()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def flush_open_files() -> None:
    """Flush what the interpreter's teardown would: files still open (a script's own, too)."""
    import gc
    import io

    for obj in gc.get_objects():
        try:
            # type(), not isinstance(): isinstance asks the object for its __class__, which
            # torch.distributed.reduce_op answers with a FutureWarning at every run's end
            if not issubclass(type(obj), io.IOBase) or obj.closed:
                continue
        except ReferenceError:  # a weakref.proxy whose object is gone (torch.compile leaves some)
            continue
        try:
            obj.flush()
        except Exception:  # noqa: BLE001 - a file that cannot flush is not ours to fix at exit
            pass


def _atomic_error_handler() -> Any:
    """torch's elastic ``ErrorHandler``, writing the error file whole or not at all.

    Its own opens the file and then writes it. When one rank dies, the agent stops the others
    with SIGTERM, and a rank stopped between those two steps leaves an empty file, on which the
    agent itself fails with a ``JSONDecodeError`` (the run ends in the agent's traceback instead
    of a restart: seen once in a fresh-clone CI run of the restart test).
    """
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    class AtomicErrorHandler(ErrorHandler):
        def record_exception(self, e: BaseException) -> None:
            import json
            import tempfile
            import time
            import traceback

            file = self._get_error_file_path()
            if not file:
                return super().record_exception(e)
            data = {
                "message": {
                    "message": f"{type(e).__name__}: {e}",
                    "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))},
                }
            }
            fd, tmp = tempfile.mkstemp(prefix=".error-", suffix=".json", dir=os.path.dirname(file) or ".")
            with os.fdopen(fd, "w") as fp:
                json.dump(data, fp)
            os.replace(tmp, file)

    return AtomicErrorHandler()


def record_errors(fn: Callable[[], None]) -> Callable[[], None]:
    """torch's ``@record`` (a failing rank's error and traceback reach the launching command),
    with the error file written atomically. On several machines, a connection to another rank
    that closed (another machine's rank died) is recorded and exits 1 without printing its
    traceback: the command reports it once."""
    import functools

    from torch.distributed.elastic.multiprocessing.errors import record

    from acc_train.errors import is_connection_lost

    recorded = record(fn, error_handler=_atomic_error_handler())
    several_machines = os.environ.get("GROUP_WORLD_SIZE", "1") not in ("", "1")  # torch elastic: the machines' agents

    @functools.wraps(fn)
    def run() -> None:
        try:
            recorded()
        except Exception as exc:
            if several_machines and is_connection_lost(str(exc)):  # recorded; the command says it once, without the traceback
                sys.exit(1)
            raise

    return run


def exit_with_user_error(exc: UserError) -> None:
    """Put the message where the launching command reads it (the elastic error file), exit 2."""
    handler = _atomic_error_handler()
    handler.initialize()
    handler.record_exception(exc)
    sys.exit(EXIT_USER_ERROR)


if __name__ == "__main__":
    main()
