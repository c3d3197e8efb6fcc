"""The ``fsdp`` strategy: parameters, gradients and optimizer state sharded across ranks.

On GPUs this is Accelerate's own FSDP path. On CPU, Accelerate would silently run DDP; the
strategy switches its state to FSDP through :mod:`acc_train.accelerate_compat`, so FSDP
really shards over gloo.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any

from acc_train.api import Machine, Strategy, UserError, warn_once_per_machine
from acc_train_fsdp.options import FSDPOptions

if TYPE_CHECKING:
    from acc_train.api import MemoryPlan, PlanInput

__all__ = ["FSDPStrategy"]

DEFAULT_MIN_NUM_PARAMS = 100_000_000

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class FSDPStrategy(Strategy[FSDPOptions]):
    name = "fsdp"
    aliases = ("fully-sharded",)
    presets = {
        "fsdp1": {"version": 1},
        "fsdp2": {"version": 2},
        "fsdp-offload": {"cpu_offload": True},
    }
    description = "PyTorch FSDP (v2 by default): parameters, gradients and optimizer state sharded across ranks"
    options_schema = FSDPOptions
    checkpoint_format = "dcp"
    accelerate_distributed_types = ("FSDP",)
    accelerate_config_sections = ("fsdp_config", "parallelism_config")
    launch_variables = ("ACCELERATE_USE_FSDP", "FSDP_", "ACCELERATE_USE_PARALLELISM_CONFIG", "PARALLELISM_CONFIG_")
    accelerator_arguments = ("fsdp_plugin",)

    def checkpoint_format_name(self) -> str:
        """Sharded: core's ``dcp`` (each rank writes its shards; portable across strategies and
        world sizes). Full: gathered to rank 0."""
        options = self.options
        return "dcp" if options.state_dict_type == "sharded" else "fsdp-full"

    def equivalent_to_ddp(self) -> bool:
        options = self.options
        # its own casts change the arithmetic; context parallelism drops the packed rows' masks
        return options.mixed_precision_policy is None and options.cp in (None, 1)

    def compile_problem(self, settings: Any) -> str | None:
        """Compiled as Accelerate does it (the model before ``fully_shard`` under FSDP2, the FSDP
        module under FSDP1); graph breaks at FSDP's hooks are expected, so not ``fullgraph``:
        under FSDP2 Accelerate's per-block compile then fails with "found no compiled frames"
        (torch 2.13). FSDP1 compiled trains, but its checkpoints do not resume: the root unit's
        parameters (the embeddings, the head) are saved as each rank's flat 1-D piece instead
        of sharded tensors of their shape (measured with torch 2.13 under aot_eager, in fp32
        and bf16), so loading fails "Size mismatch between saved torch.Size([2048]) and
        current: torch.Size([64, 32])"."""
        if self.options.version == 1:
            return (
                "compiled under FSDP1, its checkpoints cannot be resumed (torch 2.13 saves the root unit's parameters as "
                "flat pieces instead of sharded tensors); compile under FSDP2 (--strategy fsdp) or drop training.compile"
            )
        if settings.fullgraph:
            return "fullgraph: true does not run under FSDP (its hooks break the graph); set training.compile.fullgraph=false"
        if self.options.tp not in (None, 1):
            return "compiling a tensor-parallel model (strategy.tp) was not tried; drop training.compile or strategy.tp"
        if self.options.cp not in (None, 1):
            return "compiling a context-parallel model (strategy.cp, which patches SDPA while it runs) was not tried; drop training.compile or strategy.cp"
        return None

    def check_environment(self, machine: Machine) -> None:
        options = self.options
        if options.cpu_offload and machine.device_type == "cpu":
            raise UserError(
                "cpu_offload moves parameters from accelerator memory to CPU memory; this run has no accelerator, so it would do nothing",
                where="strategy.cpu_offload",
                hint="drop cpu_offload (or the fsdp-offload preset) on a CPU-only run",
            )
        self.mesh_sizes(machine.world_size)  # refuses sizes that do not fit the world
        self._refuse_fsdp_options_without_fsdp(machine.world_size)
        if options.cp not in (None, 1) and machine.device_type == "cpu":
            from acc_train_fsdp.context_parallel import refuse_cp_on_cpu

            refuse_cp_on_cpu(options.cp)
        if options.sharding_strategy in ("hybrid_shard", "hybrid_shard_zero2") and machine.num_machines < 2:
            raise UserError(
                f"{options.sharding_strategy} shards within a machine and replicates across machines; this run has one machine",
                where="strategy.sharding_strategy",
                hint="use full_shard on one machine",
            )

    def check_model(self, model: Any) -> None:
        """``tp`` must divide the model's attention heads (query and key/value), and cannot cut
        a model PEFT has wrapped (:meth:`_tensor_parallel`); ``cp`` needs SDPA attention; the
        wrap policy must not leave the model's layers in the root unit (:func:`check_units`)."""
        if self.options.tp not in (None, 1):
            from acc_train_fsdp.tensor_parallel import check_tp_fits

            self._refuse_adapters(model)
            check_tp_fits(model.config, self.options.tp)
        if self.options.cp not in (None, 1):
            from acc_train_fsdp.context_parallel import check_cp_model

            check_cp_model(model, self.options.cp)
        from acc_train.api import wrap_policies
        from acc_train_fsdp.policies import check_units

        check_units(model, wrap_policies().get(self.options.auto_wrap_policy), self.options.model_dump())

    def check_job(self, config: Any) -> None:
        """``cp`` needs rows it can cut: ``data.seq_len`` divisible by 2 x cp, packed, SDPA; a
        streamed job runs without tp and cp (its resume position is kept per data-parallel rank
        only for plain data parallelism: not tried with a group reading one share)."""
        for name in ("tp", "cp"):
            if getattr(self.options, name) not in (None, 1) and config.data.streaming:
                raise UserError(
                    f"data.streaming with strategy.{name} was not tried (each {name} group must read one stream share, and resume it)",
                    where=f"strategy.{name}",
                    hint=f"drop data.streaming (cached data works with {name}) or strategy.{name}",
                )
        if self.options.cp not in (None, 1):
            from acc_train_fsdp.context_parallel import check_cp_job

            check_cp_job(config, self.options.cp)

    @staticmethod
    def _refuse_adapters(model: Any) -> None:
        if hasattr(model, "peft_config"):
            raise UserError(
                "model.lora with strategy.tp: transformers' tp_plan cuts the base model's layers, which PEFT has wrapped",
                where="strategy.tp",
                hint="drop model.lora or strategy.tp",
            )

    def mesh_sizes(self, world_size: int) -> dict[str, int] | None:
        """``{"dp_replicate": R, "dp_shard": S}`` (and ``"cp": C``, ``"tp": T`` when above 1) for a
        run of ``world_size`` processes when the options ask for a mesh (an unset data-parallel
        size is the world size divided by cp x tp and the other); None for plain FSDP. Sizes whose
        product is not the world size, and combinations that cannot run, are a UserError naming
        the option."""
        options = self.options
        replicate, shard, tp, cp = options.dp_replicate, options.dp_shard, options.tp or 1, options.cp or 1
        if replicate is None and shard is None and tp == 1 and cp == 1:
            return None
        for name, size in (("tp", tp), ("cp", cp)):
            if world_size % size:
                raise UserError(
                    f"{name}: {size} does not divide the world size ({world_size} processes)",
                    where=f"strategy.{name}",
                    hint=f"choose a divisor of {world_size}, or change --num-processes / --num-machines",
                )
        if world_size % (tp * cp):
            raise UserError(
                f"cp x tp = {cp} x {tp} = {cp * tp} does not divide the world size ({world_size} processes)",
                where="strategy.cp",
                hint=f"make cp x tp a divisor of {world_size}",
            )
        data = world_size // (tp * cp)  # processes that read different batches
        inner = " x ".join(n for n, size in (("cp", cp), ("tp", tp)) if size > 1)
        per = f"the world size / {inner} ({world_size} / {tp * cp} = {data})" if tp * cp > 1 else f"the world size ({world_size} processes)"
        if replicate is None and shard is None:
            replicate, shard = 1, data
        elif replicate is None or shard is None:
            given, size = ("dp_replicate", replicate) if shard is None else ("dp_shard", shard)
            if data % size:  # type: ignore[operator]
                raise UserError(
                    f"{given}: {size} does not divide {per}",
                    where=f"strategy.{given}",
                    hint=f"choose a divisor of {data}, or change --num-processes / --num-machines",
                )
            other = data // size  # type: ignore[operator]
            replicate, shard = (size, other) if shard is None else (other, size)
        if replicate * shard * cp * tp != world_size:
            dims = [("dp_replicate", replicate), ("dp_shard", shard), ("cp", cp), ("tp", tp)]
            dims = [(n, size) for n, size in dims if n.startswith("dp") or size > 1]
            names, sizes = " x ".join(n for n, _ in dims), " x ".join(str(size) for _, size in dims)
            raise UserError(
                f"{names} = {sizes} = {replicate * shard * cp * tp}, and the run has {world_size} processes",
                where="strategy.dp_replicate",
                hint=f"make the product {world_size} (processes per machine x machines), or set only one of them",
            )
        if tp > 1 and replicate > 1 and shard == 1:
            raise UserError(
                "dp_replicate above 1 with tp and no dp_shard replicates tensor-parallel models without syncing their "
                "gradients (Accelerate wraps no DDP around a tensor-parallel model)",
                where="strategy.dp_replicate",
                hint=f"use dp_shard: {replicate} instead (FSDP x TP), or dp_replicate with dp_shard above 1 (HSDP x TP)",
            )
        if tp > 1 and options.version == 2 and options.cpu_offload:
            raise UserError("cpu_offload with tp (FSDP x TP offloading) was not tried", where="strategy.tp", hint="drop cpu_offload or tp")
        if cp > 1 and replicate > 1 and shard == 1:
            raise UserError(
                "dp_replicate above 1 with cp and no dp_shard: Accelerate refuses context parallelism with pure data parallelism",
                where="strategy.dp_replicate",
                hint=f"use dp_shard: {replicate} instead (FSDP x CP), or dp_replicate with dp_shard above 1 (HSDP x CP)",
            )
        sizes = {"dp_replicate": replicate, "dp_shard": shard}
        return {**sizes, **{n: size for n, size in (("cp", cp), ("tp", tp)) if size > 1}}

    def _pure_tp(self, world_size: int) -> bool:
        """Tensor parallelism alone (``tp`` is the world size): no FSDP, Accelerate's plain
        multi-process type with the mesh (Accelerate refuses FSDP with nothing to shard over)."""
        sizes = self.mesh_sizes(world_size)
        return sizes is not None and sizes.get("tp", 1) > 1 and sizes.get("cp", 1) == 1 and sizes["dp_replicate"] == sizes["dp_shard"] == 1

    #: FSDP's own options, which tensor parallelism alone (no FSDP) would not use
    FSDP_ONLY = ("activation_checkpointing", "mixed_precision_policy", "reshard_after_forward", "cpu_ram_efficient_loading", "cpu_offload")

    def _refuse_fsdp_options_without_fsdp(self, world_size: int) -> None:
        if not self._pure_tp(world_size):
            return
        for name in self.FSDP_ONLY:
            if getattr(self.options, name) != type(self.options).model_fields[name].default:  # set to anything but "unset"
                raise UserError(
                    f"{name} is an FSDP option, and tp: {self.options.tp} on {world_size} processes is tensor parallelism alone (no FSDP), which would not use it",
                    where=f"strategy.{name}",
                    hint="drop it, or add dp_shard (FSDP x TP) so FSDP runs",
                )

    def _parallelism_config(self) -> Any:
        """Accelerate's ``ParallelismConfig`` for the mesh options (None without them)."""
        from acc_train.api import current_machine

        sizes = self.mesh_sizes(current_machine().world_size)
        if sizes is None:
            return None
        from accelerate.parallelism_config import ParallelismConfig

        cp: dict[str, Any] = {}
        if sizes.get("cp", 1) > 1:  # torch's context_parallel; the exchange Accelerate's default (not the shell's PARALLELISM_CONFIG_*) unless set
            from accelerate.utils import TorchContextParallelConfig

            cp = {"cp_size": sizes["cp"], "cp_handler": TorchContextParallelConfig(cp_comm_strategy=self.options.cp_comm_strategy or "allgather")}
        return ParallelismConfig(dp_replicate_size=sizes["dp_replicate"], dp_shard_size=sizes["dp_shard"], tp_size=sizes.get("tp", 1), **cp)

    def accelerator_kwargs(self, job: Any) -> dict[str, Any]:
        import torch
        from accelerate.utils import FullyShardedDataParallelPlugin

        options = self.options
        from acc_train.api import current_machine

        on_cpu = current_machine().device_type == "cpu"
        if options.cp not in (None, 1):
            warn_once_per_machine(
                "strategy.cp: attention is causal over each whole row (Accelerate drops the attention mask for "
                "context parallelism), so the documents cut into a row attend to the documents before them in the "
                "row, which they do not without cp (rows of whole examples are refused under cp)"
            )
        if self._pure_tp(current_machine().world_size):  # no FSDP: the mesh alone (on CPU: after_accelerator)
            return {} if on_cpu else {"parallelism_config": self._parallelism_config()}
        if not on_cpu:
            # Accelerate picks its cuda:nccl,cpu:gloo backend (needed when state lives on CPU) from
            # these variables, which `accelerate launch` sets from the same options
            os.environ["FSDP_OFFLOAD_PARAMS"] = str(options.cpu_offload).lower()
            os.environ["FSDP_STATE_DICT_TYPE"] = "SHARDED_STATE_DICT" if options.state_dict_type == "sharded" else "FULL_STATE_DICT"
        kwargs = self._plugin_kwargs(on_cpu, job)
        # the wrap policy is resolved against the model in before_prepare
        kwargs["auto_wrap_policy"] = "no_wrap"
        if options.mixed_precision_policy is not None:
            mp = options.mixed_precision_policy.model_dump()
            if options.version == 2:
                mp.pop("buffer_dtype")
            # Accelerate's dict form needs every field: unset ones stay fp32
            kwargs["mixed_precision_policy"] = {k: getattr(torch, DTYPES[v or "fp32"]) for k, v in mp.items()}
        out: dict[str, Any] = {"fsdp_plugin": FullyShardedDataParallelPlugin(**kwargs)}
        mesh = self._parallelism_config()
        if mesh is not None and not on_cpu:  # on CPU: after_accelerator, once the run is FSDP (Accelerate refuses MULTI_CPU)
            out["parallelism_config"] = mesh
        return out

    def _plugin_kwargs(self, on_cpu: bool, job: Any) -> dict[str, Any]:
        """``FullyShardedDataParallelPlugin`` arguments for the options, less the wrap policy and
        the mixed-precision policy: what :meth:`accelerator_kwargs` builds the plugin from, and
        what :meth:`launch_env` exports as Accelerate's variables."""
        options = self.options
        ram_efficient = options.cpu_ram_efficient_loading
        if ram_efficient and job is not None and job.config.model.name_or_path is None:
            warn_once_per_machine("strategy.cpu_ram_efficient_loading has no effect on the demo model (nothing is loaded from disk)")
        if ram_efficient and on_cpu and options.version == 1:
            warn_once_per_machine(
                "strategy.cpu_ram_efficient_loading is not used under FSDP1 on CPU (it needs the rank-0 broadcast "
                "FSDP1 cannot do there); every rank loads the weights itself"
            )
            ram_efficient = False
        kwargs: dict[str, Any] = {
            "fsdp_version": options.version,
            "cpu_offload": options.cpu_offload,
            "activation_checkpointing": options.activation_checkpointing,
            "state_dict_type": "SHARDED_STATE_DICT" if options.state_dict_type == "sharded" else "FULL_STATE_DICT",
            "cpu_ram_efficient_loading": ram_efficient,
        }
        if options.version == 1:
            kwargs["sharding_strategy"] = (options.sharding_strategy or "full_shard").upper()
            kwargs["backward_prefetch"] = (options.backward_prefetch or "backward_pre").upper() if options.backward_prefetch != "none" else None
            kwargs["forward_prefetch"] = bool(options.forward_prefetch)
            kwargs["sync_module_states"] = self._sync_module_states(options)
            kwargs["use_orig_params"] = True if options.use_orig_params is None else options.use_orig_params
        else:
            kwargs["reshard_after_forward"] = True if options.reshard_after_forward is None else options.reshard_after_forward
        return kwargs

    def launch_env(self, machine: Machine, scratch: Any) -> dict[str, str]:
        """``accelerate launch``'s FSDP variables for the options (Accelerate's
        ``prepare_multi_gpu_env``). No variable carries ``mixed_precision_policy``, a wrap policy
        a plugin registered, or the mesh (``dp_replicate``, ``dp_shard``, ``tp``, ``cp``): each is
        refused by name, with what to do in the program instead."""
        options = self.options
        for name in ("dp_replicate", "dp_shard", "tp", "cp"):
            if getattr(options, name) is not None:
                raise UserError(
                    f"strategy.{name} (the device mesh) has no `accelerate launch` variable that acc-train exports, "
                    "and a program launched unchanged builds its own mesh",
                    where=f"strategy.{name}",
                    hint="pass accelerate's ParallelismConfig to Accelerator(parallelism_config=...) in your program, "
                    "or train through a job config (acc-train --config JOB.yaml), where the mesh options apply",
                )
        if options.mixed_precision_policy is not None:
            raise UserError(
                "strategy.mixed_precision_policy has no `accelerate launch` variable",
                where="strategy.mixed_precision_policy",
                hint="drop it (--mixed-precision sets FSDP's casts), or pass FullyShardedDataParallelPlugin("
                "mixed_precision_policy=...) to Accelerator(fsdp_plugin=...) in your program",
            )
        from acc_train.api import wrap_policies

        policy = wrap_policies().get(options.auto_wrap_policy).name
        if policy not in ("transformer", "size", "none"):
            raise UserError(
                f"wrap policy {policy!r} is a plugin's, which no `accelerate launch` variable can name",
                where="strategy.auto_wrap_policy",
                hint="use transformer, size or none with acc-train launch, or pass the policy to "
                "FullyShardedDataParallelPlugin(auto_wrap_policy=...) in your program",
            )
        kwargs = self._plugin_kwargs(machine.device_type == "cpu", None)

        def flag(value: Any) -> str:
            return str(bool(value)).lower()

        env = {
            "ACCELERATE_USE_FSDP": "true",
            "FSDP_VERSION": str(kwargs["fsdp_version"]),
            "FSDP_OFFLOAD_PARAMS": flag(kwargs["cpu_offload"]),
            "FSDP_ACTIVATION_CHECKPOINTING": flag(kwargs["activation_checkpointing"]),
            "FSDP_STATE_DICT_TYPE": kwargs["state_dict_type"],
            "FSDP_CPU_RAM_EFFICIENT_LOADING": flag(kwargs["cpu_ram_efficient_loading"]),
        }
        if options.version == 1:
            env["FSDP_SHARDING_STRATEGY"] = kwargs["sharding_strategy"]
            env["FSDP_BACKWARD_PREFETCH"] = kwargs["backward_prefetch"] or "NO_PREFETCH"
            env["FSDP_FORWARD_PREFETCH"] = flag(kwargs["forward_prefetch"])
            env["FSDP_SYNC_MODULE_STATES"] = flag(kwargs["sync_module_states"])
            env["FSDP_USE_ORIG_PARAMS"] = flag(kwargs["use_orig_params"])
        else:
            env["FSDP_RESHARD_AFTER_FORWARD"] = flag(kwargs["reshard_after_forward"])
        if policy == "transformer":
            env["FSDP_AUTO_WRAP_POLICY"] = "TRANSFORMER_BASED_WRAP"  # no classes: the model's _no_split_modules
            if options.transformer_layer_cls_to_wrap:
                env["FSDP_TRANSFORMER_CLS_TO_WRAP"] = ",".join(options.transformer_layer_cls_to_wrap)
        elif policy == "size":
            env["FSDP_AUTO_WRAP_POLICY"] = "SIZE_BASED_WRAP"
            env["FSDP_MIN_NUM_PARAMS"] = str(options.min_num_params or DEFAULT_MIN_NUM_PARAMS)
        else:
            env["FSDP_AUTO_WRAP_POLICY"] = "NO_WRAP"
        return env

    @staticmethod
    def _sync_module_states(options: FSDPOptions) -> bool:
        """FSDP1's rank-0 broadcast at wrap time needs an accelerator to initialise on."""
        from acc_train.api import current_machine

        if current_machine().device_type != "cpu":
            return True if options.sync_module_states is None else options.sync_module_states
        if options.sync_module_states:
            warn_once_per_machine(
                "strategy.sync_module_states is not used on CPU (FSDP1 cannot initialise parameters there); "
                "every rank already starts from the same weights (same seed, or the same pretrained files)"
            )
        return False

    def before_program(self, machine: Machine) -> None:
        """A program that builds its own ``FullyShardedDataParallelPlugin`` for the other FSDP
        version than the one launched is refused as the plugin is built (Accelerate would raise
        a ValueError from inside it, or, given ``fsdp_version`` itself, run the other version):
        the program's plugin is followed otherwise, so a silent switch of version is the only
        alternative, and the launch asked for this one."""
        from accelerate.utils import dataclasses as accelerate_dataclasses

        from acc_train_fsdp.program_plugin import refuse_other_version

        plugin_class = accelerate_dataclasses.FullyShardedDataParallelPlugin
        original = plugin_class.__post_init__
        launched = self.options.version
        name = self.name if launched == 2 else "fsdp1"

        @functools.wraps(original)
        def __post_init__(plugin: Any) -> None:
            refuse_other_version(plugin, launched, name)
            original(plugin)

        plugin_class.__post_init__ = __post_init__

    def after_accelerator(self, accelerator: Any) -> None:
        """On CPU, switch Accelerate to FSDP with the strategy's plugin (or, in a program
        launched unchanged, the one Accelerate built from the launch variables or the program
        passed), unless an earlier Accelerator of the process already did."""
        if accelerator.acc_machine.device_type != "cpu":
            return
        from acc_train.api import already_running, run_sharded_on_cpu

        if already_running(accelerator, "FSDP", "fsdp_plugin"):
            return
        if self._pure_tp(accelerator.num_processes):
            # stays MULTI_CPU, with the mesh Accelerate builds on GPUs (its validation names GPU types
            # only; mesh_sizes checked the sizes): Accelerate wraps no DDP around a tensor-parallel model
            mesh = self._parallelism_config()
            accelerator.state.parallelism_config = mesh
            accelerator.state.device_mesh = mesh.get_device_mesh("cpu")
            return
        plugin = accelerator.acc_kwargs.get("fsdp_plugin")
        if plugin is None and getattr(accelerator, "acc_launched", False):
            from accelerate.utils import FullyShardedDataParallelPlugin

            # the plugin Accelerate built from the launch variables, and AcceleratorState dropped on CPU
            plugin = FullyShardedDataParallelPlugin()
        if plugin is None:
            raise RuntimeError("strategy fsdp on CPU: the Accelerator was built without an FSDP plugin")
        if accelerator.mixed_precision != "no":
            plugin.set_mixed_precision(accelerator.mixed_precision)
        mesh = self._parallelism_config()
        if mesh is None:
            run_sharded_on_cpu(accelerator, "FSDP", fsdp_plugin=plugin)
            return
        # the mesh as Accelerate builds it on GPUs (gloo here), checked by its own validation
        run_sharded_on_cpu(accelerator, "FSDP", fsdp_plugin=plugin, parallelism_config=mesh, device_mesh=mesh.get_device_mesh("cpu"))
        mesh._validate_accelerator(accelerator)

    def expected_distributed_types(self, machine: Machine) -> set[str]:
        if self._pure_tp(machine.world_size):  # tensor parallelism alone is Accelerate's plain multi-process type
            return super().expected_distributed_types(machine)
        return {"FSDP"}

    def before_prepare(self, accelerator: Any, model: Any) -> None:
        """Resolve the registered wrap policy against the model, in Accelerate's terms, and
        activation checkpointing (:meth:`_checkpoint_activations`)."""
        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy, size_based_auto_wrap_policy, transformer_auto_wrap_policy

        from acc_train.api import wrap_policies
        from acc_train_fsdp.policies import layer_class_names

        if getattr(accelerator, "acc_launched", False):  # the launch variables' (or the program's) plugin decides
            return
        options = self.options
        if options.tp not in (None, 1):
            self._tensor_parallel(accelerator, model)
            if self._pure_tp(accelerator.num_processes):  # tensor parallelism alone
                return
        plugin = accelerator.state.fsdp_plugin
        self._checkpoint_activations(plugin, model)
        policy = wrap_policies().get(options.auto_wrap_policy)
        if policy.name == "transformer":
            plugin.transformer_cls_names_to_wrap = layer_class_names(model, options.transformer_layer_cls_to_wrap)
            plugin.auto_wrap_policy = transformer_auto_wrap_policy
        elif policy.name == "size":
            plugin.min_num_params = options.min_num_params or DEFAULT_MIN_NUM_PARAMS
            plugin.auto_wrap_policy = size_based_auto_wrap_policy
        elif policy.name == "none":
            plugin.auto_wrap_policy = None
        else:  # a plugin's policy: a predicate over modules
            predicate = policy.build(model, options.model_dump())
            if options.version == 1:
                plugin.auto_wrap_policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=predicate)
            else:  # Accelerate's FSDP2 path wraps by layer class: the predicate must select whole classes
                modules = [m for m in model.modules() if m is not model]
                chosen = {type(m) for m in modules if predicate(m)}
                if any(type(m) in chosen and not predicate(m) for m in modules):
                    raise UserError(
                        f"wrap policy {policy.name!r} selects some modules of a class but not others; FSDP2 here wraps by layer class",
                        where="strategy.auto_wrap_policy",
                        hint="use it with version: 1, or make it select whole classes",
                    )
                plugin.transformer_cls_names_to_wrap = sorted(c.__name__ for c in chosen)
                plugin.auto_wrap_policy = transformer_auto_wrap_policy if chosen else None

    @staticmethod
    def _tensor_parallel(accelerator: Any, model: Any) -> None:
        """The model cut by its ``tp_plan`` over the mesh's ``tp`` dimension; every other
        parameter replicated over it (a DTensor too, for clipping and for Accelerate's FSDP2)."""
        from acc_train_fsdp.tensor_parallel import apply_tp, let_accelerate_import_replicate_parallel, replicate_rest

        FSDPStrategy._refuse_adapters(model)
        tp_mesh = accelerator.torch_device_mesh["tp"]
        apply_tp(model, tp_mesh)
        replicate_rest(model, tp_mesh)
        let_accelerate_import_replicate_parallel()

    def _checkpoint_activations(self, plugin: Any, model: Any) -> None:
        """``activation_checkpointing`` is ``training.gradient_checkpointing``: transformers'
        checkpointing of each layer, which replays the forward's RNG in the recompute. Accelerate's
        own (torch's checkpoint wrapper on each wrapped unit) is kept for models transformers
        cannot checkpoint; under FSDP2 it does not preserve the RNG state, so layers with dropout
        would recompute with other masks. With both switches on, each layer is checkpointed once."""
        from acc_train.api import enable_gradient_checkpointing

        if not self.options.activation_checkpointing:
            return
        if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
            pass  # training.gradient_checkpointing: already on, the same thing
        elif getattr(model, "supports_gradient_checkpointing", False):
            enable_gradient_checkpointing(model)
        else:
            return  # Accelerate wraps the units the wrap policy selects
        plugin.activation_checkpointing = False

    def full_state_dict(self, accelerator: Any, model: Any) -> dict[str, Any]:
        """Gathered for rank 0, whichever checkpoint format the run uses. On CPU it is built from
        the sharded state dict: FSDP1's own full-state-dict path crashes (SIGSEGV) there in torch 2.13."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from acc_train_fsdp.checkpoint import gather_full

        if accelerator.acc_machine.device_type != "cpu":
            return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return gather_full(get_model_state_dict(model), keep=accelerator.is_main_process)

    def generation_model(self, accelerator: Any, model: Any) -> Any:
        """FSDP1's root unit gathers its own parameters for ``generate`` (:mod:`acc_train_fsdp.generation`)."""
        from acc_train_fsdp.generation import generation_model

        return generation_model(accelerator, model)

    def parameter_elements(self, accelerator: Any, model: Any) -> tuple[int, int]:
        """FSDP1 keeps each unit's parameters in one flat parameter, sharded with padding."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        units = FullyShardedDataParallel.fsdp_modules(model)
        if not units:  # FSDP2: DTensors, which the default understands
            # as a rank holds them between steps: FSDP2 leaves the root's parameters gathered after
            # a forward (for the backward), so after the last evaluation's forward they are whole
            # on every rank until they are sharded again (run.json measures right after this)
            from acc_train_fsdp.generation import reshard

            reshard(accelerator.unwrap_model(model, keep_torch_compile=False))
            return super().parameter_elements(accelerator, model)
        local = total = 0
        for unit in units:
            handle = unit._handle
            if handle is not None:
                local += handle.flat_param._sharded_size.numel()
                total += handle.flat_param._unpadded_unsharded_size.numel()
        return local, total

    def summary(self, accelerator: Any) -> dict[str, Any]:
        """``fsdp_version`` as the prepared model shows it: 1 where it holds ``FullyShardedDataParallel``
        units, 2 where ``fully_shard`` made its modules ``FSDPModule``s, None where neither."""
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        modules = [m for model in getattr(accelerator, "_models", []) for m in model.modules()]  # Accelerate keeps no public list
        version = 1 if any(isinstance(m, FullyShardedDataParallel) for m in modules) else 2 if any(isinstance(m, FSDPModule) for m in modules) else None
        return {"fsdp_version": version, "mesh": self._mesh_summary(accelerator)}

    @staticmethod
    def _mesh_summary(accelerator: Any) -> dict[str, Any] | None:
        """The device mesh the model was sharded over: its dimensions, and each rank's
        coordinates in it (rank -> {dimension: index}), from the live mesh."""
        mesh = getattr(accelerator, "torch_device_mesh", None)
        if mesh is None or not mesh.mesh_dim_names:
            return None
        names = [n for n in mesh.mesh_dim_names]
        grid = mesh.mesh.tolist()
        coordinates: dict[str, dict[str, int]] = {}

        def walk(node: Any, index: list[int]) -> None:
            if isinstance(node, list):
                for i, child in enumerate(node):
                    walk(child, [*index, i])
            else:
                coordinates[str(node)] = dict(zip(names, index))

        walk(grid, [])
        return {"shape": dict(zip(names, mesh.mesh.shape)), "coordinates": coordinates}

    def memory_tracker(self, model: Any, optimizer: Any) -> Any | None:
        """``FSDPMemTracker`` for a model ``fully_shard`` prepared (FSDP2); the default otherwise."""
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(model, FSDPModule):
            return None
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        return FSDPMemTracker(model, getattr(optimizer, "optimizer", optimizer))  # the torch optimizer inside Accelerate's wrapper

    def parameter_shards(self, machine: Machine) -> int:
        """The world size; the processes per machine under hybrid sharding; ``dp_shard`` x ``cp``
        x ``tp`` on a mesh (FSDP shards over dp_shard x cp); 1 under no_shard."""
        mesh = self.mesh_sizes(machine.world_size)
        if mesh is not None:
            return mesh["dp_shard"] * mesh.get("cp", 1) * mesh.get("tp", 1)
        how = self._sharding()
        if how == "no_shard":
            return 1
        if how.startswith("hybrid_shard"):
            return max(1, machine.world_size // max(1, machine.num_machines))
        return machine.world_size

    def _sharding(self) -> str:
        """FSDP1's sharding strategy, or what FSDP2's ``reshard_after_forward`` amounts to."""
        options = self.options
        if options.version == 1:
            return options.sharding_strategy or "full_shard"
        return "full_shard" if options.reshard_after_forward in (None, True) else "shard_grad_op"

    def plan_variants(self) -> dict[str, dict[str, Any]]:
        """The presets, and FSDP1's shard_grad_op (ZeRO-2-like), which has no preset."""
        return {**super().plan_variants(), "fsdp1-shard_grad_op": {"version": 1, "sharding_strategy": "shard_grad_op"}}

    def plan_memory(self, plan: PlanInput) -> MemoryPlan:
        """Parameters, gradients and Adam's moments, all fp32 (under bf16 FSDP casts the
        gathered copy only), sharded 1/N; shard_grad_op keeps the gathered parameters from
        forward to backward. Measured in fp32: 16psi/N (BENCHMARKS.md). Under ``model.dtype:
        bf16`` the shards, gradients and moments are 2 bytes (measured: 8psi/N)."""
        from acc_train.api import MemoryPlan, replicated

        options = self.options
        psi, n, b, o = plan.parameters, plan.world_size, plan.param_bytes, plan.optimizer_bytes
        how = self._sharding()
        if how == "no_shard":
            return replicated(plan, note="no_shard: a replica on every rank, as DDP")
        if how.startswith("hybrid_shard"):  # sharded within a machine, replicated across machines
            n = plan.local_world_size or n
            how = "shard_grad_op" if how == "hybrid_shard_zero2" else "full_shard"
        mesh = self.mesh_sizes(n) if (options.dp_replicate or options.dp_shard or options.tp or options.cp) else None
        if mesh is not None:  # HSDP: each replica shards over dp_shard (x cp) processes; tp cuts each shard again
            n = mesh["dp_shard"] * mesh.get("cp", 1) * mesh.get("tp", 1)
        offload = {"params": "cpu", "grads": "cpu", "optimizer": "cpu"} if options.cpu_offload else {}
        notes = ["N = processes per machine (hybrid sharding)"] if n != plan.world_size and mesh is None else []
        if mesh is not None:
            cp = f" x cp={mesh['cp']}" if "cp" in mesh else ""
            tp = f" x tp={mesh['tp']}" if "tp" in mesh else ""
            factors = "dp_shard" + (" x cp" if cp else "") + (" x tp" if tp else "")
            whole = " (norm weights whole on each tp rank)" if tp else ""
            notes.append(f"mesh dp_replicate={mesh['dp_replicate']} x dp_shard={mesh['dp_shard']}{cp}{tp}: N = {factors}{whole}")
            if cp:
                notes.append("activations: each rank runs 1/cp of every row (s = seq_len / cp)")
        gathered = 2 if plan.low_precision or plan.low_precision_weights else 4
        if how == "shard_grad_op":
            params = b * psi // n + gathered * psi
            formula = f"({b}psi/N + {gathered}psi) + {b}psi/N + {o:g}psi/N = {gathered}psi + {2 * b + o:g}psi/N"
            notes.append(f"parameters: the {b}psi/N shard plus the gathered {gathered}psi kept from forward to backward")
        else:
            params = b * psi // n
            formula = f"{b}psi/N + {b}psi/N + {o:g}psi/N = {2 * b + o:g}psi/N"
            if not plan.largest_layer:  # the buffers below say it in bytes where the block is known
                notes.append("+ one wrapped unit's parameters, gathered while it computes")
        if plan.low_precision_weights:
            notes.append(f"model.dtype {plan.dtype}: shards, gradients and moments are {plan.dtype}, no fp32 master copy")
        if options.cpu_offload:
            notes.append("offload: parameters, gradients and optimizer steps in CPU memory")
        split = {"sequence_split": mesh.get("cp", 1), "tensor_split": mesh.get("tp", 1)} if mesh is not None else {}
        # the block that computes, gathered in the compute dtype, its all-gather buffer and the
        # reduce-scatter buffer of its gradients: FSDPMemTracker's Unsharded Param, All Gather and
        # Reduce Scatter at the peak of a simulated 7B step (plan --simulate, BENCHMARKS.md);
        # shard_grad_op keeps the gathered parameters in `params` already
        tp = mesh.get("tp", 1) if mesh is not None else 1
        units = 2 if how == "shard_grad_op" else 3
        buffers = units * gathered * plan.largest_layer // tp
        if buffers:
            what = "its all-gather buffer and" if how == "shard_grad_op" else "the block gathered, its all-gather buffer and"
            notes.append(f"buffers: for the largest block ({plan.largest_layer:,} elements, {gathered} bytes each), {what} the reduce-scatter buffer of its gradients")
        return MemoryPlan(
            params, b * psi // n, int(o * psi) // n, formula, offload=offload, note="; ".join(notes), recompute=options.activation_checkpointing,
            buffers=buffers, **split,
        )
