"""The contract of an optimizer selected by name (``optimizer.name``), and core's own: adamw,
sgd, adafactor and adamw_8bit.

An :class:`OptimizerKind` states the keys of the ``optimizer:`` section it takes, its own
``optimizer.options`` schema, what it needs to run (packages, a device type), how much state it
keeps per parameter, and whether that state can go into the portable checkpoint; it builds the
torch optimizer over the model's parameter groups. A plugin adds its own through
``acc_train_register_optimizers`` (``docs/hooks.md``). Importing this module imports no torch.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from acc_train.errors import UserError

if TYPE_CHECKING:
    from acc_train.contracts.protocols import MachineView, Section

__all__ = [
    "parameter_groups",
    "OptimizerKind", "OptimizerOptions", "COMMON_KEYS", "AdamW", "SGD", "Adafactor", "AdamW8bit", "BUILTIN_OPTIMIZERS",
]  # fmt: skip

#: keys of the ``optimizer:`` section an optimizer may take (its :attr:`OptimizerKind.defaults`);
#: ``name``, ``lr``, ``weight_decay`` and ``options`` belong to every optimizer
COMMON_KEYS = ("betas", "eps", "momentum", "nesterov")


class OptimizerOptions(BaseModel):
    """``optimizer.options``: an optimizer's own keys. Subclass it to add fields; unknown keys are
    refused, naming the key and the closest valid one."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True)


class OptimizerKind(ABC):
    """An optimizer, registered by name. The registered instance is shared: keep it stateless."""

    #: the value of ``optimizer.name`` that selects it
    name: ClassVar[str]
    description: ClassVar[str] = ""
    #: the :data:`COMMON_KEYS` it takes, with their defaults (a key it does not take is refused
    #: when set, and null in the resolved config)
    defaults: ClassVar[dict[str, Any]] = {}
    #: the schema of ``optimizer.options``
    options_schema: ClassVar[type[OptimizerOptions]] = OptimizerOptions
    #: distributions it imports, checked before launch: {import name: pip name}
    requires: ClassVar[dict[str, str]] = {}
    #: device types it runs on (``"cuda"``...); empty: any
    device_types: ClassVar[tuple[str, ...]] = ()
    #: the names of the per-parameter state tensors its ``state_dict`` holds (``step`` included
    #: when it is a tensor). A checkpoint format that carries only some names refuses it.
    state_keys: ClassVar[tuple[str, ...]] = ()
    #: True when every state tensor but a scalar ``step`` has its parameter's shape, so it can be
    #: sharded with the parameter (FSDP) and resharded on resume. False (factored state): the
    #: optimizer runs only where every rank holds its parameters whole.
    elementwise_state: ClassVar[bool] = True

    def all_names(self) -> list[str]:
        return [self.name]

    def parse_options(self, cfg: Section) -> Any:
        """``optimizer.options`` validated by :attr:`options_schema`."""
        return self.options_schema.model_validate(cfg.options)

    def problem(self, cfg: Section) -> str | None:
        """What is wrong with a combination of its keys (naming them), or None; called when
        the config is validated."""
        return None

    def state_bytes(self, cfg: Section, param_bytes: int) -> float:
        """Bytes of optimizer state per trainable parameter element (``acc-train plan``);
        ``param_bytes`` is a parameter element's size (4 in fp32)."""
        return 2.0 * param_bytes

    def check(self, cfg: Section, machine: MachineView) -> None:
        """Raise :class:`acc_train.UserError` when it cannot run on ``machine``: called before
        launch and in each worker. The default checks :attr:`requires` and :attr:`device_types`."""
        for module, dist in self.requires.items():
            if importlib.util.find_spec(module) is None:
                raise UserError(
                    f"optimizer {self.name!r} needs the {dist!r} package, which is not installed",
                    where="optimizer.name",
                    hint=f"`pip install {dist}`, or choose another optimizer",
                )
        if self.device_types and machine.device_type not in self.device_types:
            raise UserError(
                f"optimizer {self.name!r} runs on {' or '.join(self.device_types)} devices; this machine trains on {machine.device_type}",
                where="optimizer.name",
                hint="run it on a machine with such a device, or choose another optimizer (adamw)",
            )

    @abstractmethod
    def build(self, param_groups: list[dict[str, Any]], cfg: Section, device: Any) -> Any:
        """The ``torch.optim.Optimizer`` over ``param_groups`` (each a dict with ``params`` and
        ``weight_decay``: biases and norms get 0), stepping parameters on ``device``."""

    def describe(self, optimizer: Any) -> dict[str, Any]:
        """What ``run.json`` records of the built optimizer, besides its name."""
        return {}


class AdamW(OptimizerKind):
    name = "adamw"
    description = "torch.optim.AdamW: fused on CUDA, foreach elsewhere"
    defaults: ClassVar[dict[str, Any]] = {"betas": [0.9, 0.95], "eps": 1e-8}
    state_keys = ("step", "exp_avg", "exp_avg_sq")

    def build(self, param_groups: list[dict[str, Any]], cfg: Section, device: Any) -> Any:
        import torch

        impl = {"fused": True} if getattr(device, "type", str(device)) == "cuda" else {"foreach": True}
        return torch.optim.AdamW(param_groups, lr=cfg.lr, betas=tuple(cfg.betas or ()), eps=cfg.eps, **impl)

    def describe(self, optimizer: Any) -> dict[str, Any]:
        group = optimizer.param_groups[0] if optimizer.param_groups else {}
        return {"implementation": "fused" if group.get("fused") else "foreach" if group.get("foreach") else "for-loop"}


class SGD(OptimizerKind):
    name = "sgd"
    description = "torch.optim.SGD, with momentum (0.9) and optional Nesterov"
    defaults: ClassVar[dict[str, Any]] = {"momentum": 0.9, "nesterov": False}
    state_keys = ("momentum_buffer",)

    def state_bytes(self, cfg: Section, param_bytes: int) -> float:
        return float(param_bytes) if cfg.momentum else 0.0

    def problem(self, cfg: Section) -> str | None:
        if cfg.nesterov and not cfg.momentum:
            return "optimizer.nesterov needs optimizer.momentum above 0"
        return None

    def build(self, param_groups: list[dict[str, Any]], cfg: Section, device: Any) -> Any:
        import torch

        return torch.optim.SGD(param_groups, lr=cfg.lr, momentum=cfg.momentum or 0.0, nesterov=bool(cfg.nesterov), foreach=True)


class AdafactorOptions(OptimizerOptions):
    #: the update's RMS is clipped to this
    clip_threshold: float = Field(1.0, gt=0, allow_inf_nan=False)
    #: the second moment's decay: 1 - step^decay_rate
    decay_rate: float = Field(-0.8, lt=0, allow_inf_nan=False)
    #: a first moment (an extra state of the parameter's size) when set
    beta1: float | None = Field(None, ge=0, lt=1, allow_inf_nan=False)
    #: scale the lr by the parameter's RMS
    scale_parameter: bool = False


class Adafactor(OptimizerKind):
    name = "adafactor"
    description = "transformers' Adafactor at optimizer.lr (relative_step off): factored second moments"
    options_schema = AdafactorOptions
    requires: ClassVar[dict[str, str]] = {"transformers": "transformers"}
    state_keys = ("step", "exp_avg", "exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col", "RMS")
    #: row and column vectors; under FSDP2 its step fails on the first DTensor parameter
    #: ("mixed torch.Tensor and DTensor", transformers 5.24), so it runs only unsharded
    elementwise_state = False

    def state_bytes(self, cfg: Section, param_bytes: int) -> float:
        # row and column vectors of a matrix: about 0 per element; beta1 adds a first moment
        return float(param_bytes) if cfg.options.get("beta1") is not None else 0.0

    def build(self, param_groups: list[dict[str, Any]], cfg: Section, device: Any) -> Any:
        from transformers.optimization import Adafactor as HFAdafactor

        opts = self.parse_options(cfg)
        return HFAdafactor(
            param_groups, lr=cfg.lr, relative_step=False, warmup_init=False, scale_parameter=opts.scale_parameter,
            clip_threshold=opts.clip_threshold, decay_rate=opts.decay_rate, beta1=opts.beta1,
        )  # fmt: skip


class AdamW8bit(OptimizerKind):
    name = "adamw_8bit"
    description = "bitsandbytes' 8-bit AdamW (CUDA GPUs with bitsandbytes installed)"
    defaults: ClassVar[dict[str, Any]] = {"betas": [0.9, 0.95], "eps": 1e-8}
    requires: ClassVar[dict[str, str]] = {"bitsandbytes": "bitsandbytes"}
    device_types = ("cuda",)
    state_keys = ("step", "state1", "state2", "qmap1", "qmap2", "absmax1", "absmax2")
    #: quantization maps and per-block absmax do not have the parameter's shape
    elementwise_state = False

    def state_bytes(self, cfg: Section, param_bytes: int) -> float:
        return 2.0

    def build(self, param_groups: list[dict[str, Any]], cfg: Section, device: Any) -> Any:
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(param_groups, lr=cfg.lr, betas=tuple(cfg.betas or ()), eps=cfg.eps)


#: core's optimizers, registered by the builtin plugin
BUILTIN_OPTIMIZERS: tuple[OptimizerKind, ...] = (AdamW(), SGD(), Adafactor(), AdamW8bit())


def parameter_groups(model: Any, weight_decay: float) -> list[dict[str, Any]]:
    """The trainable parameters in two groups: with ``weight_decay``, and without it for biases
    and norm weights (what the loop and ``plan --simulate`` build the optimizer over)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
