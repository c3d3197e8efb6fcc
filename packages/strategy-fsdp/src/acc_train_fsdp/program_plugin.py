"""A launched program's own ``FullyShardedDataParallelPlugin``, held to the FSDP version
``acc-train launch`` was given (:meth:`acc_train_fsdp.launch.FSDPLaunch.before_program`).

Accelerate reads ``FSDP_VERSION`` (which the launch sets) when a plugin is built, then refuses
the other version's options with a ValueError from inside the plugin
(``reshard_after_forward set to None. This is not supported with FSDP2``), or, given
``fsdp_version`` itself, runs that version. Both are named here instead, with the option and
the launch that runs it.
"""

from __future__ import annotations

from typing import Any

from acc_train.api import UserError

__all__ = ["refuse_other_version", "version_options"]


def version_options(plugin: Any, launched: int) -> list[str]:
    """The options the program gave ``plugin`` that belong to the other FSDP version: as
    ``name=value``, or empty when it fits ``launched`` (1 or 2)."""
    found = []
    version = getattr(plugin, "fsdp_version", None)
    if version is not None and int(version) != launched:
        found.append(f"fsdp_version={version}")
    if launched == 2:
        if getattr(plugin, "sharding_strategy", None) is not None:
            found.append(f"sharding_strategy={_named(plugin.sharding_strategy)}")
        reshard = getattr(plugin, "reshard_after_forward", None)
        if reshard is not None and not isinstance(reshard, bool) and str(reshard).lower() not in ("true", "false"):
            found.append(f"reshard_after_forward={_named(reshard)}")
    elif isinstance(getattr(plugin, "reshard_after_forward", None), bool):
        found.append(f"reshard_after_forward={plugin.reshard_after_forward}")
    return found


def _named(value: Any) -> str:
    return getattr(value, "name", None) or repr(value)


def refuse_other_version(plugin: Any, launched: int, strategy_name: str) -> None:
    """Raise the error a person can act on when the program's plugin asks for the other version."""
    found = version_options(plugin, launched)
    if not found:
        return
    other = "fsdp1" if launched == 2 else "fsdp"
    raise UserError(
        f"the program builds FullyShardedDataParallelPlugin({', '.join(found)}), "
        f"{'an FSDP1' if launched == 2 else 'an FSDP2'} setting, but acc-train launch was asked for strategy "
        f'"{strategy_name}" (FSDP{launched})',
        where=f"FullyShardedDataParallelPlugin({found[0].split('=')[0]}=...)",
        hint=f"launch it with --strategy {other}, or drop {', '.join(f.split('=')[0] for f in found)} from the program"
        + (" (reshard_after_forward=True/False is FSDP2's sharding_strategy)" if launched == 2 else ""),
    )
