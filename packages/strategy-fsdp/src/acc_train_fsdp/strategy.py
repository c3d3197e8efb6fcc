"""The ``fsdp`` strategy: parameters, gradients and optimizer state sharded across ranks.

On GPUs this is Accelerate's own FSDP path. On CPU, Accelerate would silently run DDP; the
strategy switches its state to FSDP through :mod:`acc_train.accelerate_compat`, so FSDP
really shards over gloo. The device mesh is :mod:`acc_train_fsdp.mesh`, planning
:mod:`acc_train_fsdp.planning`, ``acc-train launch`` :mod:`acc_train_fsdp.launch`.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from acc_train.api import Strategy, UserError, warn_once_per_machine
from acc_train_fsdp.launch import FSDPLaunch
from acc_train_fsdp.mesh import Mesh, live_mesh_summary
from acc_train_fsdp.options import FSDPOptions
from acc_train_fsdp.planning import FSDPPlanner

__all__ = ["FSDPStrategy"]

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

    def planner(self) -> FSDPPlanner:
        return FSDPPlanner(self)

    def launch_protocol(self) -> FSDPLaunch:
        return FSDPLaunch(self)

    @functools.cached_property
    def mesh(self) -> Mesh | None:
        """The device mesh on the bound machine (None for plain FSDP), computed and validated once:
        sizes that do not fit the world are refused here, naming the option."""
        return Mesh.of(self.options, self.machine.world_size)

    def mesh_sizes(self, world_size: int) -> dict[str, int] | None:
        """The mesh's sizes for a run of ``world_size`` processes (``acc-train plan`` and
        ``plan --simulate`` plan other worlds than the bound one); None for plain FSDP."""
        mesh = Mesh.of(self.options, world_size)
        return None if mesh is None else mesh.sizes

    @property
    def _pure_tp(self) -> bool:
        """Tensor parallelism alone on the bound machine (:attr:`Mesh.pure_tp`)."""
        return self.mesh is not None and self.mesh.pure_tp

    def _parallelism_config(self) -> Any:
        """Accelerate's ``ParallelismConfig`` for the mesh (None without one)."""
        return None if self.mesh is None else self.mesh.parallelism_config(self.options.cp_comm_strategy)

    def checkpoint_format_name(self) -> str:
        """Sharded: core's ``dcp`` (each rank writes its shards; portable across strategies and
        world sizes). Full: gathered to rank 0."""
        options = self.options
        return "dcp" if options.state_dict_type == "sharded" else "fsdp-full"

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

    def check_environment(self) -> None:
        options, machine = self.options, self.machine
        if options.cpu_offload and machine.device_type == "cpu":
            raise UserError(
                "cpu_offload moves parameters from accelerator memory to CPU memory; this run has no accelerator, so it would do nothing",
                where="strategy.cpu_offload",
                hint="drop cpu_offload (or the fsdp-offload preset) on a CPU-only run",
            )
        if self.mesh is not None:  # sizes that do not fit the world are refused as it is computed
            self.mesh.refuse_fsdp_options(options, machine.world_size)
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

    def accelerator_kwargs(self, job: Any) -> dict[str, Any]:
        import torch
        from accelerate.utils import FullyShardedDataParallelPlugin

        options = self.options
        on_cpu = self.machine.device_type == "cpu"
        if options.cp not in (None, 1):
            warn_once_per_machine(
                "strategy.cp: attention is causal over each whole row (Accelerate drops the attention mask for "
                "context parallelism), so the documents cut into a row attend to the documents before them in the "
                "row, which they do not without cp (rows of whole examples are refused under cp)"
            )
        if self._pure_tp:  # no FSDP: the mesh alone (on CPU: after_accelerator)
            return {} if on_cpu else {"parallelism_config": self._parallelism_config()}
        if not on_cpu:
            # Accelerate picks its cuda:nccl,cpu:gloo backend (needed when state lives on CPU) from
            # these variables, which `accelerate launch` sets from the same options
            os.environ["FSDP_OFFLOAD_PARAMS"] = str(options.cpu_offload).lower()
            os.environ["FSDP_STATE_DICT_TYPE"] = "SHARDED_STATE_DICT" if options.state_dict_type == "sharded" else "FULL_STATE_DICT"
        kwargs = self.plugin_kwargs(on_cpu, job)
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

    def plugin_kwargs(self, on_cpu: bool, job: Any) -> dict[str, Any]:
        """``FullyShardedDataParallelPlugin`` arguments for the options, less the wrap policy and
        the mixed-precision policy: what :meth:`accelerator_kwargs` builds the plugin from, and
        what :meth:`FSDPLaunch.launch_env` exports as Accelerate's variables."""
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
            kwargs["sync_module_states"] = self._sync_module_states()
            kwargs["use_orig_params"] = True if options.use_orig_params is None else options.use_orig_params
        else:
            kwargs["reshard_after_forward"] = True if options.reshard_after_forward is None else options.reshard_after_forward
        return kwargs

    def _sync_module_states(self) -> bool:
        """FSDP1's rank-0 broadcast at wrap time needs an accelerator to initialise on."""
        options = self.options
        if self.machine.device_type != "cpu":
            return True if options.sync_module_states is None else options.sync_module_states
        if options.sync_module_states:
            warn_once_per_machine(
                "strategy.sync_module_states is not used on CPU (FSDP1 cannot initialise parameters there); "
                "every rank already starts from the same weights (same seed, or the same pretrained files)"
            )
        return False

    def after_accelerator(self, accelerator: Any) -> None:
        """On CPU, switch Accelerate to FSDP with the strategy's plugin (or, in a program
        launched unchanged, the one Accelerate built from the launch variables or the program
        passed), unless an earlier Accelerator of the process already did."""
        if self.machine.device_type != "cpu":
            return
        from acc_train.api import already_running, run_sharded_on_cpu

        if already_running(accelerator, "FSDP", "fsdp_plugin"):
            return
        if self._pure_tp:
            # stays MULTI_CPU, with the mesh Accelerate builds on GPUs (its validation names GPU types
            # only; the mesh checked its sizes): Accelerate wraps no DDP around a tensor-parallel model
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

    def expected_distributed_types(self) -> set[str]:
        if self._pure_tp:  # tensor parallelism alone is Accelerate's plain multi-process type
            return super().expected_distributed_types()
        return {"FSDP"}

    def before_prepare(self, accelerator: Any, model: Any) -> None:
        """Resolve the registered wrap policy against the model, in Accelerate's terms
        (:func:`acc_train_fsdp.policies.apply_wrap_policy`), and activation checkpointing
        (:meth:`_checkpoint_activations`)."""
        from acc_train_fsdp.policies import apply_wrap_policy

        if getattr(accelerator, "acc_launched", False):  # the launch variables' (or the program's) plugin decides
            return
        if self.options.tp not in (None, 1):
            self._tensor_parallel(accelerator, model)
            if self._pure_tp:  # tensor parallelism alone
                return
        plugin = accelerator.state.fsdp_plugin
        self._checkpoint_activations(plugin, model)
        apply_wrap_policy(plugin, model, self.options)

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

        if self.machine.device_type != "cpu":
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
        return {"fsdp_version": version, "mesh": live_mesh_summary(accelerator)}
