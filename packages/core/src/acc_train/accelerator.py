"""``acc_train.Accelerator``: ``accelerate.Accelerator`` built for the chosen strategy.

It is a drop-in: a user's script that does ``from acc_train import Accelerator`` runs under
whatever ``acc-train --strategy ...`` chose (the launcher passes the strategy to the workers
through ``ACC_TRAIN_STRATEGY``). After construction it checks that Accelerate really runs the
requested strategy; it never trains silently under another one.
"""

from __future__ import annotations

import json
import os
import warnings
from datetime import timedelta
from typing import Any

import accelerate

from acc_train.config.strategy import resolve_strategy
from acc_train.errors import UserError
from acc_train.machine import bound_here, is_local_main_process, resolve_mixed_precision
from acc_train.strategy import DEFAULT_STRATEGY, Strategy

__all__ = ["Accelerator", "strategy_from_env", "ENV_STRATEGY", "ENV_TIMEOUT", "collective_timeout_handler"]

#: JSON ``{"name": ..., **options}`` set by the launcher for the workers.
ENV_STRATEGY = "ACC_TRAIN_STRATEGY"
#: ``launch.timeout`` in seconds, set by ``acc-train launch`` for a user's script.
ENV_TIMEOUT = "ACC_TRAIN_TIMEOUT"


def strategy_from_env() -> Strategy[Any]:
    """The configured strategy the launcher chose, or the default strategy when run without
    acc-train, bound to this process's machine."""
    raw = json.loads(os.environ.get(ENV_STRATEGY) or "{}")
    name = raw.pop("name", DEFAULT_STRATEGY)
    return bound_here(resolve_strategy(name, raw))


def collective_timeout_handler(job: Any) -> accelerate.utils.InitProcessGroupKwargs | None:
    """The process group's timeout: the job's ``launch.timeout``, or the one ``acc-train
    launch`` passed a user's script; None (Accelerate's default) outside acc-train."""
    seconds = job.config.launch.timeout if job is not None else os.environ.get(ENV_TIMEOUT)
    if seconds is None:
        return None
    seconds = float(seconds)
    if seconds == 600:  # Accelerate drops a value equal to its class default, leaving torch's (30 min on gloo)
        seconds += 0.001
    return accelerate.utils.InitProcessGroupKwargs(timeout=timedelta(seconds=seconds))


def _merge_kwargs(base: dict[str, Any], user: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in user.items():
        if value is None and key.endswith(("_plugin", "_plugins")):
            continue  # an explicit None (HF Trainer passes fsdp_plugin=None) means "not given"
        if key == "kwargs_handlers":
            user_types = {type(h) for h in value or []}
            for handler in out.get(key, []):
                if type(handler) in user_types and is_local_main_process():  # once per machine
                    warnings.warn(
                        f"the script's own {type(handler).__name__} replaces the one the strategy built from its options",
                        stacklevel=3,
                    )
            out[key] = [h for h in out.get(key, []) if type(h) not in user_types] + list(value or [])
        elif key in out and out[key] is not None and value is not None and key.endswith("_plugin"):
            raise UserError(
                f"the script passes {key}, but the strategy already configures it",
                where=key,
                hint="configure it through the strategy's options instead",
            )
        else:
            out[key] = value
    return out


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` for the strategy acc-train was asked to run."""

    def __init__(
        self,
        *args: Any,
        strategy: Strategy[Any] | None = None,
        job: Any = None,
        **kwargs: Any,
    ) -> None:
        strategy = strategy_from_env() if strategy is None else bound_here(strategy)
        machine = strategy.machine
        strategy.check_environment()
        if job is not None:
            strategy.check_job(job.config)
        merged = _merge_kwargs(strategy.accelerator_kwargs(job), kwargs)
        timeout = collective_timeout_handler(job)
        handlers = merged.get("kwargs_handlers") or []
        if timeout is not None and not any(isinstance(h, accelerate.utils.InitProcessGroupKwargs) for h in handlers):
            merged["kwargs_handlers"] = [*handlers, timeout]  # a script's own handler wins
        if machine.device_type == "cpu":
            merged["cpu"] = True
        from acc_train.accelerate_compat import for_a_later_accelerator, undo_switch_after_reset

        undo_switch_after_reset()
        if for_a_later_accelerator(merged):
            pass  # the process's state already runs: its mixed precision was resolved when it started
        elif merged.get("mixed_precision") in (None, "auto"):
            requested = merged.get("mixed_precision") or os.environ.get("ACC_TRAIN_MIXED_PRECISION", "auto")
            merged["mixed_precision"] = resolve_mixed_precision(requested, machine)
        self.acc_kwargs = merged
        super().__init__(*args, **merged)
        self.acc_strategy = strategy
        self.acc_machine = machine
        strategy.after_accelerator(self)
        self._acc_prepared: set[int] = set()
        expected = strategy.expected_distributed_types()
        actual = self.distributed_type.name
        if actual not in expected:
            raise RuntimeError(
                f'strategy "{strategy.name}" expected Accelerate to run as {sorted(expected)} '
                f"on {machine.world_size} {machine.device_type} process(es), but it chose {actual}; "
                "refusing to train under a strategy that was not asked for"
            )

    @property
    def batch_replicas(self) -> int:
        """Processes that read the same batches: a tensor- or context-parallel group of the
        strategy's mesh (1 without one). Counts summed over all ranks count its batches this often."""
        config = self.parallelism_config
        return config.non_data_parallel_size if config is not None else 1

    @property
    def loss_replicas(self) -> int:
        """Processes that compute the same loss: a tensor-parallel group (1 without one). The
        ranks of a context-parallel group read one batch but each holds a different part of its
        rows, so their losses are parts of the batch's, and gradients are averaged over them."""
        config = self.parallelism_config
        return config.tp_size if config is not None else 1

    @property
    def data_parallel_size(self) -> int:
        """Processes that read different batches: the world size over :attr:`batch_replicas`."""
        return self.num_processes // self.batch_replicas

    def _before_prepare(self, objects: tuple[Any, ...]) -> None:
        import torch

        for obj in objects:
            if isinstance(obj, torch.nn.Module) and id(obj) not in self._acc_prepared:
                self._acc_prepared.add(id(obj))
                before = dict(obj.named_parameters())
                self.acc_strategy.before_prepare(self, obj)
                _follow_new_parameters(objects, before, dict(obj.named_parameters()))

    def prepare(self, *args: Any, **kwargs: Any) -> Any:
        self._before_prepare(args)
        return super().prepare(*args, **kwargs)

    def get_state_dict(self, model: Any, unwrap: bool = True) -> Any:
        """Accelerate's, with a compiled model's state under the model's own names: its
        replicated path unwraps keeping torch.compile's wrapper, whose keys all start with
        ``_orig_mod.`` (a ``final/`` transformers could not load)."""
        from accelerate.utils import is_compiled_module

        if is_compiled_module(model):
            model = model._orig_mod
        return super().get_state_dict(model, unwrap=unwrap)

    def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> Any:
        """Accelerate's, except that a model compiled by regions (``training.compile.regional``)
        unwraps to the model itself: Accelerate would hand back its regionally compiled copy of
        the wrapper (a ``DistributedDataParallel``), which is not the model."""
        from accelerate.utils import has_compiled_regions, is_compiled_module

        if keep_torch_compile and not is_compiled_module(model) and has_compiled_regions(model):
            keep_torch_compile = False
        return super().unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile)

    def prepare_model(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        self._before_prepare((model,))
        return super().prepare_model(model, *args, **kwargs)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        """Accelerate's, unless the strategy clips its own way (:meth:`Strategy.clip_grad_norm`,
        e.g. a norm its engine already measured, kept on the device instead of read back)."""
        if not getattr(self, "acc_launched", False):
            norm = self.acc_strategy.clip_grad_norm(self, max_norm)
            if norm is not None:
                return norm
        return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)


def _follow_new_parameters(objects: tuple[Any, ...], before: dict[str, Any], after: dict[str, Any]) -> None:
    """Point the optimizers among ``objects`` at the parameters a strategy's ``before_prepare``
    put in the old ones' places (tensor parallelism makes new DTensor parameters)."""
    import torch

    moved = {id(old): after[name] for name, old in before.items() if name in after and after[name] is not old}
    if not moved:
        return
    for obj in objects:
        if isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                group["params"] = [moved.get(id(p), p) for p in group["params"]]
