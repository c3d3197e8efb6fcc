"""The ``local-sgd`` strategy: each rank steps alone; parameters are averaged every K steps.

How it gets through acc-train's strategy-agnostic loop, using only the public contract:

- :class:`LocalSGDStrategy` asks Accelerate for plain DDP (so data is sharded, buffers are
  broadcast and the model is wrapped as usual);
- ``acc_train_train_start`` registers a DDP communication hook that returns each rank's own
  gradients instead of all-reducing them, and sets up ``accelerate.local_sgd.LocalSGD``;
- ``acc_train_step_end`` calls ``LocalSGD.step()``, which averages the parameters on every
  K-th step of its own count;
- that count is state the strategy owns: :meth:`LocalSGDStrategy.state_dict` saves it with every
  checkpoint and :meth:`LocalSGDStrategy.load_state_dict` takes it back before the run starts
  again, so a resumed run averages at the same steps;
- run.json's ``local_sgd_averages`` counts the averages this launch made: the effect that tells
  local SGD from plain DDP, which the conformance kit requires to be there and to change;
- between averages the ranks hold different models and optimizer moments, so the checkpoint
  format :class:`PerRankFormat` writes each rank's own state;
- it keeps the default planner (a replica on every rank; not DDP's updates) and the default
  launch protocol, whose ``accelerator_kwargs(None)`` call refuses a user's script with what to
  use instead.

No torch or accelerate import at module level: listing strategies stays fast.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import Field

from acc_train.api import CheckpointFormat, RunContext, Strategy, StrategyOptions, UserError, hookimpl

__all__ = ["LocalSGDOptions", "LocalSGDStrategy", "PerRankFormat"]

#: where the plugin keeps its ``LocalSGD`` helper in ``RunContext.extras``
EXTRAS_KEY = "local_sgd"
#: where a resumed run's restored step count waits for ``acc_train_train_start``
RESTORED_KEY = "local_sgd_restored"


class LocalSGDOptions(StrategyOptions):
    sync_every: int = Field(4, ge=1, description="Optimizer steps between parameter averages (K). Larger: less communication.")


class LocalSGDStrategy(Strategy[LocalSGDOptions]):
    name = "local-sgd"
    aliases = ("localsgd",)
    description = "local SGD: ranks step alone, parameters averaged every sync_every steps"
    options_schema = LocalSGDOptions
    checkpoint_format = "local-sgd-per-rank"

    def accelerator_kwargs(self, job: Any) -> dict[str, Any]:
        if job is None:  # `acc-train launch`: the script's own loop never fires our hooks
            raise UserError(
                "local-sgd works inside acc-train's own training loop, not under `acc-train launch`",
                where="--strategy",
                hint="launch your script with --strategy ddp and use accelerate.local_sgd.LocalSGD in it",
            )
        return {}  # plain DDP: the comm hook registered at train start turns off its all-reduce

    def full_state_dict(self, accelerator: Any, model: Any) -> dict[str, Any]:
        """The average of the ranks' models (they differ unless the last step was an average)."""
        state = accelerator.get_state_dict(model)
        if accelerator.num_processes == 1:
            return state
        out = {}
        for key, tensor in state.items():
            if tensor.is_floating_point():
                local = tensor.detach().clone().to(accelerator.device)
                tensor = accelerator.reduce(local, reduction="mean").cpu()
            out[key] = tensor
        return out

    #: parameter averages this process made in this launch (``summary`` is handed the accelerator alone)
    averages = 0

    def summary(self, accelerator: Any) -> dict[str, Any]:
        return {"sync_every": self.options.sync_every, "local_sgd_averages": self.averages}

    def state_dict(self, run: RunContext) -> dict[str, Any]:
        """The helper's step count, which decides when it averages next."""
        helper = run.extras.get(EXTRAS_KEY)
        return {"num_steps": helper.num_steps} if helper is not None else {}

    def load_state_dict(self, run: RunContext, state: dict[str, Any]) -> None:
        run.extras[RESTORED_KEY] = int(state["num_steps"])  # the helper is built at train start


class PerRankFormat(CheckpointFormat):
    """Every rank's own model and optimizer state: safetensors plus JSON, no pickle."""

    name = "local-sgd-per-rank"
    description = "each rank's own model + optimizer state (ranks differ between averages)"

    def save(self, accelerator: Any, model: Any, optimizer: Any, directory: Path) -> None:
        from safetensors.torch import save_file, save_model

        from acc_train.api import flatten_optimizer_state

        rank = accelerator.process_index
        save_model(accelerator.unwrap_model(model, keep_torch_compile=False), str(directory / f"model-rank{rank:05d}.safetensors"))
        tensors, meta = flatten_optimizer_state(optimizer.state_dict())
        save_file(tensors, str(directory / f"optimizer-rank{rank:05d}.safetensors"))
        (directory / f"optimizer-rank{rank:05d}.json").write_text(json.dumps(meta))

    def load(self, accelerator: Any, model: Any, optimizer: Any, directory: Path) -> None:
        from safetensors.torch import load_file, load_model

        from acc_train.api import unflatten_optimizer_state

        rank = accelerator.process_index
        model_file = directory / f"model-rank{rank:05d}.safetensors"
        if not model_file.is_file():
            raise UserError(
                f"the checkpoint holds no state for rank {rank}",
                where=str(directory),
                hint="resume local-sgd with the number of processes that wrote the checkpoint",
            )
        load_model(accelerator.unwrap_model(model, keep_torch_compile=False), str(model_file))
        meta = json.loads((directory / f"optimizer-rank{rank:05d}.json").read_text())
        tensors = load_file(str(directory / f"optimizer-rank{rank:05d}.safetensors"))
        optimizer.load_state_dict(unflatten_optimizer_state(tensors, meta))


@hookimpl
def acc_train_register_strategies(register: Callable[[Strategy], None]) -> None:
    register(LocalSGDStrategy())


@hookimpl
def acc_train_register_checkpoint_formats(register: Callable[[CheckpointFormat], None]) -> None:
    register(PerRankFormat())


@hookimpl
def acc_train_train_start(run: Any) -> None:
    strategy = run.job.strategy
    if not isinstance(strategy, LocalSGDStrategy):
        return
    from accelerate.local_sgd import LocalSGD
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

    if hasattr(run.model, "register_comm_hook"):  # wrapped in DDP: more than one process
        # hands each rank's own gradients back instead of all-reducing them
        run.model.register_comm_hook(state=None, hook=noop_hook)
    helper = LocalSGD(accelerator=run.accelerator, model=run.model, local_sgd_steps=strategy.options.sync_every, enabled=True)
    # a resumed run continues the count it saved (a checkpoint written before acc-train kept a
    # strategy's own state has none: the count was the run's step then)
    helper.num_steps = run.extras.pop(RESTORED_KEY, run.step)
    run.extras[EXTRAS_KEY] = helper


@hookimpl(tryfirst=True)  # the key it adds goes into the step's row of metrics.jsonl
def acc_train_step_end(run: Any, step: int, metrics: dict[str, Any]) -> None:
    helper = run.extras.get(EXTRAS_KEY) if run is not None else None
    if helper is None:
        return
    helper.step()  # averages the parameters when its count is a multiple of sync_every
    strategy = run.job.strategy
    if helper.enabled and helper.num_steps % strategy.options.sync_every == 0:
        strategy.averages += 1
        metrics["local_sgd_averaged"] = True
