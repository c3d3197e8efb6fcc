"""One worker of ``acc-train launch``: ``python -m acc_train.script_worker SCRIPT [ARGS]``.

Runs the user's script as ``__main__`` under the elastic error recorder, so a failing rank's
exception and traceback reach the launching command.
"""

from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` does

    from acc_train.errors import UserError
    from acc_train.worker import exit_finished_run, exit_with_user_error, record_errors

    @record_errors
    def run() -> None:
        try:
            runpy.run_path(script, run_name="__main__")
        except UserError as exc:  # e.g. a strategy that cannot run here: one message, exit 2
            exit_with_user_error(exc)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():  # a clean exit, not an abort in gloo's teardown
            dist.destroy_process_group()
        exit_finished_run()  # the script has returned: its process group's teardown must not abort it

    run()


if __name__ == "__main__":
    main()
