"""One worker of ``acc-train launch``: ``python -m acc_train.script_worker [-m] PROGRAM [ARGS]``.

Runs the user's program unchanged (a script, or a module as ``python -m`` does) as ``__main__``
under the elastic error recorder, so a failing rank's exception and traceback reach the
launching command. Before it starts, every ``accelerate.Accelerator`` it will build (its own, or
the one inside HF Trainer or TRL) is made to run the launched strategy
(:func:`acc_train.launch.launched.adopt_accelerate`); when it ends, a strategy that had no
effect on it is an error, never silence.
"""

from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    argv = sys.argv[1:]
    as_module = argv[:1] == ["-m"]
    if as_module:
        argv = argv[1:]
    program, *args = argv
    sys.argv = [program, *args]  # (run_module puts the module's file in argv[0], as python -m does)
    # the directory python itself would put first: the working one for -m, the script's own otherwise
    sys.path.insert(0, os.getcwd() if as_module else os.path.dirname(os.path.abspath(program)))

    from acc_train.errors import UserError
    from acc_train.machine import is_local_main_process
    from acc_train.worker import exit_finished_run, exit_with_user_error, record_errors

    @record_errors
    def run() -> None:
        import torch.distributed as dist

        from acc_train.launch.launched import adopt_accelerate, is_plain
        from acc_train.accelerator import strategy_from_env

        try:
            strategy = strategy_from_env()
            machine = strategy.machine
            program_state = adopt_accelerate(strategy)
            if as_module:
                runpy.run_module(program, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(program, run_name="__main__")
            expected = strategy.expected_distributed_types()
            joined = program_state.process_group or dist.is_initialized()
            if program_state.accelerators == 0 and not is_plain(expected):
                how = (
                    "it joined the process group (PartialState or init_process_group), but no model was prepared by one"
                    if joined
                    else f"each of the {machine.world_size} processes ran it on its own"
                )
                raise UserError(
                    f'the program never built an accelerate.Accelerator, so strategy "{strategy.name}" had no effect on it ({how})',
                    where=program,
                    hint="build the model and optimizer through accelerate.Accelerator (or HF Trainer / TRL, which do), "
                    "or launch a program that does not need one with --strategy ddp",
                )
            if program_state.accelerators == 0 and machine.world_size > 1 and not joined and is_local_main_process():
                sys.stderr.write(
                    f"warning: the program built no accelerate.Accelerator and no process group: each of the "
                    f"{machine.world_size} processes ran it on its own\n"
                )
        except UserError as exc:  # e.g. a strategy that cannot run here: one message, exit 2
            exit_with_user_error(exc)

        if dist.is_available() and dist.is_initialized():  # a clean exit, not an abort in gloo's teardown
            dist.destroy_process_group()
        exit_finished_run()  # the program has returned: its process group's teardown must not abort it

    run()


if __name__ == "__main__":
    main()
