"""Accelerate's launch protocol: the variables ``accelerate launch`` gives each worker, exported
by ``acc-train launch`` for a program it runs unchanged.

Accelerate's launcher turns its flags and config file into environment variables, and every
``Accelerator`` (the program's own, or the one inside HF Trainer or TRL) builds its state and
plugins from them; ``TrainingArguments`` reads them too. ``acc-train launch`` exports the same
variables from the resolved job: those every launch sets (mixed precision, the CPU switch)
here, each strategy's own through :meth:`acc_train.api.LaunchProtocol.launch_env`, and the dynamo ones
from ``training.compile`` (:func:`acc_train.config.compile.dynamo_env`). The same variables
left in the user's shell give way, with one warning naming them.

Accelerate's own helpers (``accelerate.utils.launch.prepare_multi_gpu_env`` and
``prepare_deepspeed_cmd_env``) are not called: they take an argparse Namespace validated by a
private function, copy the whole shell environment, may move the port, prepend the working
directory to ``PYTHONPATH`` and fill parser defaults the user never chose (for one,
``FSDP_CPU_RAM_EFFICIENT_LOADING=true`` where acc-train's default is false). The variables are
read off their code instead, and a test holds each strategy's to the plugin Accelerate builds.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["CORE_VARIABLES", "launch_protocol_of", "protocol_env", "protocol_variables", "shell_leftovers", "leftovers_warning"]

#: The variables every launch speaks for; each strategy adds its own (``LaunchProtocol.launch_variables``).
#: The dynamo variables are ``training.compile``'s, handled with their own warning.
CORE_VARIABLES = ("ACCELERATE_USE_CPU", "ACCELERATE_MIXED_PRECISION")

_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def launch_protocol_of(strategy: Any) -> Any:
    """The strategy's launch protocol; a strategy that has none (``launch_protocol()`` is None)
    is refused by name: a program launched unchanged would not run it."""
    protocol = strategy.launch_protocol()
    if protocol is None:
        from acc_train.errors import UserError

        raise UserError(
            f'strategy "{strategy.name}" declares no `acc-train launch` mapping (Strategy.launch_protocol), so a program '
            "launched unchanged would not run it",
            where="--strategy",
            hint="train through a job config (acc-train --config ...), or ask the plugin's authors for a launch_protocol",
        )
    return protocol


def protocol_env(strategy: Any, mixed_precision: str, scratch: Path) -> dict[str, str]:
    """The variables for a launch of ``strategy`` on the machine it is bound to (its device type
    and world size), with ``mixed_precision`` already resolved (``no``, ``bf16``, ``fp16``)."""
    env = {"ACCELERATE_MIXED_PRECISION": mixed_precision}
    if strategy.machine.device_type == "cpu":  # what `accelerate launch --cpu` sets; Accelerate picks MULTI_CPU from it
        env["ACCELERATE_USE_CPU"] = "true"
    env.update(launch_protocol_of(strategy).launch_env(scratch))
    return env


def protocol_variables() -> tuple[str, ...]:
    """Every launch variable acc-train speaks for: core's and each installed strategy's."""
    from acc_train.plugins import strategies

    protocols = [strategy.launch_protocol() for strategy, _ in strategies().primary()]
    return CORE_VARIABLES + tuple(v for protocol in protocols if protocol is not None for v in protocol.launch_variables)


def _matches(name: str, variables: tuple[str, ...]) -> bool:
    return any(name == v or (v.endswith("_") and name.startswith(v)) for v in variables)


def _same(a: str, b: str) -> bool:
    a, b = a.strip().lower(), b.strip().lower()
    return a == b or (a in _TRUE and b in _TRUE) or (a in _FALSE and b in _FALSE)


def shell_leftovers(env: Mapping[str, str], environ: Mapping[str, str], variables: tuple[str, ...]) -> dict[str, str]:
    """Launch ``variables`` (:func:`protocol_variables`) in ``environ`` (the shell's) that the
    launch's ``env`` does not set to the same value: they would change what the program's
    Accelerator builds, so they give way."""
    return {name: value for name, value in environ.items() if _matches(name, variables) and not _same(env.get(name, ""), value)}


def leftovers_warning(leftovers: Mapping[str, str]) -> str:
    shown = ", ".join(f"{name}={value}" for name, value in sorted(leftovers.items()))
    return (
        f"ignoring {shown} from the environment: acc-train launch exports Accelerate's launch variables from "
        "--strategy, --mixed-precision and the config (set the strategy's options there instead)"
    )
