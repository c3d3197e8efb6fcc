"""Context parallelism on the fsdp strategy's mesh (``strategy.cp``): what CPU can check.

torch's context parallelism cannot run on CPU (torch 2.13: no ring attention for SDPA's CPU
kernel; ``acc_train_fsdp.context_parallel.CPU_REASON``), so a run with cp is refused before
launch here and trained only by the GPU benchmark script (bench/gpu_fsdp_vs_ddp.py, 2+ GPUs).
These tests hold the checks before launch, the mesh sizes and ``ParallelismConfig``, the plan,
and the loop's arithmetic for a cp group: labels shifted before the rows are cut, each rank's
part of the loss, and the ranks gradients are averaged over.

The launch tests run the whole context-parallel path on CPU but torch's ring-attention kernel:
a ``sitecustomize`` in the workers (:data:`STAND_IN`) lets ``strategy.cp`` past the CPU refusal
and registers, as transformers' ``sdpa`` attention, an exact causal attention over the cp group
(keys and values all-gathered, positions undone from torch's head-tail balancing). Everything
else is the product's: the mesh and FSDP over dp_shard x cp, Accelerate's hooks and
``maybe_context_parallel``, torch's cutting of the buffers, the loop's pre-shifted labels and
its loss and gradient scaling. On one long document (no example starts, so dropping the mask
changes nothing) cp = 2 on 2 processes and dp_shard 2 x cp 2 on 4 give DDP's losses.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.conftest import WORDS, cli_in_process, read_metrics, shared_runs, tiny_job_args


def _fsdp(**options: Any) -> Any:
    from acc_train.api import resolve_strategy

    return resolve_strategy("fsdp", options)


# -- before launch -------------------------------------------------------------------------


def test_cp_is_refused_on_cpu_before_launch_with_the_measured_reason(tiny_model_dir: Path, tiny_data: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = cli_in_process(*tiny_job_args(tiny_model_dir, tiny_data, out, "--strategy", "fsdp", "--num-processes", "2", "--set", "strategy.cp=2"))
    assert proc.returncode == 2, proc.stderr
    assert "strategy.cp" in proc.stderr and "cannot run on CPU" in proc.stderr
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def test_cp_job_settings_are_checked_before_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU the refusal of cp comes first (above); past it, as on GPUs, the job's settings.
    The command runs in this process past the refusal as :data:`STAND_IN` takes a worker past it
    (its ``check_environment``; nothing here reaches attention)."""
    from acc_train.api import Machine
    from acc_train_fsdp.strategy import FSDPStrategy

    checked = FSDPStrategy.check_environment

    def check_environment(self: Any) -> Any:
        machine = self.machine
        if machine.device_type == "cpu":  # past the refusal of cp on CPU, every other check kept
            return checked(self.bind(Machine("cuda", machine.world_size, machine.num_machines)))
        return checked(self)

    monkeypatch.setattr(FSDPStrategy, "check_environment", check_environment)
    out = tmp_path / "run"
    base = ("--strategy", "fsdp", "--num-processes", "2", "--set", "strategy.cp=2", "--output-dir", str(out), "--max-steps", "1")

    proc = cli_in_process(*base, "--set", "data.seq_len=30")
    assert proc.returncode == 2 and "strategy.cp" in proc.stderr
    assert "data.seq_len divisible by 2 x cp = 4" in proc.stderr and "data.seq_len is 30" in proc.stderr
    proc = cli_in_process(*base, "--set", "model.attn_implementation=eager")
    assert proc.returncode == 2 and "model.attn_implementation" in proc.stderr and "'eager'" in proc.stderr
    proc = cli_in_process(*base, "--set", "data.packing=false")
    assert proc.returncode == 2 and "data.packing" in proc.stderr and "takes no attention mask" in proc.stderr
    proc = cli_in_process(*base, "--set", "training.compile.enabled=true")
    assert proc.returncode == 2 and "training.compile" in proc.stderr and "context-parallel model (strategy.cp" in proc.stderr
    proc = cli_in_process("--strategy", "fsdp", "--num-processes", "4", "--set", "strategy.cp=3", "--set", "data.seq_len=96", "--output-dir", str(out))
    assert proc.returncode == 2 and "strategy.cp" in proc.stderr and "cp: 3 does not divide the world size (4 processes)" in proc.stderr
    proc = cli_in_process("--strategy", "fsdp", "--set", "strategy.cp_comm_strategy=alltoall", "--output-dir", str(out))
    assert proc.returncode == 2 and "cp_comm_strategy is used by context parallelism only" in proc.stderr
    proc = cli_in_process("--strategy", "fsdp1", "--set", "strategy.cp=2", "--output-dir", str(out))
    assert proc.returncode == 2 and "FSDP2 option" in proc.stderr
    assert not out.exists()


def test_cp_job_checks() -> None:
    from acc_train.api import UserError
    from acc_train.config import load_job

    strategy = _fsdp(cp=2)

    def job(*sets: str) -> Any:
        return load_job(None, {}, ["strategy.name=fsdp", "strategy.cp=2", *sets]).config

    strategy.check_job(job("data.seq_len=64"))  # text: documents cut into rows
    for sets, where, text in [
        (("data.seq_len=66",), "strategy.cp", "divisible by 2 x cp = 4"),
        # whole examples packed side by side: the ring's causal mask would let each attend to the ones before it
        (("data.kind=chat", "data.packing=true", "data.seq_len=64"), "strategy.cp", "cannot keep the examples packed into a row apart"),
        (("data.kind=prompt_completion", "data.packing=best_fit", "data.seq_len=64"), "strategy.cp", "data.kind 'prompt_completion' would attend"),
        (("data.kind=prompt_completion", "data.seq_len=64"), "data.packing", "data.kind 'prompt_completion' pads its examples"),
        (("model.attn_implementation=flash_attention_2", "data.seq_len=64"), "model.attn_implementation", "'flash_attention_2'"),
    ]:
        with pytest.raises(UserError) as caught:
            strategy.check_job(job(*sets))
        assert caught.value.where == where and text in str(caught.value), str(caught.value)
    _fsdp(tp=2).check_job(job("data.seq_len=66"))  # no cp: nothing to cut
    streamed = ("data.streaming=true", "data.train_files=[corpus.jsonl]", "training.max_steps=10", "data.seq_len=64")
    for options, name in (({"cp": 2}, "cp"), ({"tp": 2}, "tp")):  # a group reading one stream share was not tried
        with pytest.raises(UserError) as caught:
            _fsdp(**options).check_job(job(*streamed))
        assert caught.value.where == f"strategy.{name}" and f"data.streaming with strategy.{name} was not tried" in str(caught.value)


def test_cp_needs_an_sdpa_model() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from acc_train.api import UserError

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64))
    strategy = _fsdp(cp=2)
    strategy.check_model(model)  # sdpa, transformers' default
    model.set_attn_implementation("eager")
    with pytest.raises(UserError) as caught:
        strategy.check_model(model)
    assert caught.value.where == "model.attn_implementation" and "'eager'" in str(caught.value)
    model.set_attn_implementation("sdpa")
    model._supports_context_parallel = False  # (a model transformers marks so: sliding-window or recurrent layers)
    with pytest.raises(UserError) as caught:
        strategy.check_model(model)
    assert caught.value.where == "strategy.cp" and "does not support context parallelism" in str(caught.value)


# -- mesh ------------------------------------------------------------------------------------


def test_mesh_sizes_with_cp() -> None:
    from acc_train.api import Machine, UserError

    assert _fsdp(cp=2).mesh_sizes(2) == {"dp_replicate": 1, "dp_shard": 1, "cp": 2}
    assert _fsdp(cp=2).mesh_sizes(4) == {"dp_replicate": 1, "dp_shard": 2, "cp": 2}
    assert _fsdp(dp_shard=2, cp=2).mesh_sizes(4) == {"dp_replicate": 1, "dp_shard": 2, "cp": 2}
    assert _fsdp(dp_replicate=2, cp=2).mesh_sizes(8) == {"dp_replicate": 2, "dp_shard": 2, "cp": 2}
    assert _fsdp(cp=2, tp=2).mesh_sizes(8) == {"dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 2}
    assert _fsdp(cp=1).mesh_sizes(4) is None  # cp 1 is no mesh
    for options, world, where, text in [
        ({"cp": 3}, 4, "strategy.cp", "cp: 3 does not divide the world size (4 processes)"),
        ({"cp": 2, "tp": 2}, 6, "strategy.cp", "cp x tp = 2 x 2 = 4 does not divide the world size (6 processes)"),
        ({"cp": 2, "dp_shard": 3}, 4, "strategy.dp_shard", "dp_shard: 3 does not divide the world size / cp (4 / 2 = 2)"),
        ({"cp": 2, "tp": 2, "dp_shard": 3}, 8, "strategy.dp_shard", "dp_shard: 3 does not divide the world size / cp x tp (8 / 4 = 2)"),
        ({"cp": 2, "dp_replicate": 2, "dp_shard": 2}, 4, "strategy.dp_replicate", "dp_replicate x dp_shard x cp = 2 x 2 x 2 = 8"),
        ({"cp": 2, "dp_replicate": 2}, 4, "strategy.dp_replicate", "Accelerate refuses context parallelism with pure data parallelism"),
    ]:
        with pytest.raises(UserError) as caught:
            _fsdp(**options).mesh_sizes(world)
        assert caught.value.where == where and text in str(caught.value), str(caught.value)
    # FSDP shards over dp_shard x cp (Accelerate's dp_shard_cp dimension)
    assert _fsdp(dp_shard=2, cp=2).planner().parameter_shards(Machine("cuda", 4)) == 4
    assert _fsdp(cp=2, tp=2).planner().parameter_shards(Machine("cuda", 8)) == 8
    _fsdp(cp=2).bind(Machine("cuda", 2)).check_environment()  # a GPU run passes
    with pytest.raises(UserError, match="cannot run on CPU"):
        _fsdp(cp=2).bind(Machine("cpu", 2)).check_environment()
    assert not _fsdp(cp=2).planner().equivalent_to_ddp()  # the packed rows' masks are dropped
    assert not _fsdp(cp=2).bind(Machine("cpu", 2)).mesh.pure_tp


def test_parallelism_config_carries_cp() -> None:
    from acc_train.api import Machine

    config = _fsdp(dp_shard=2, cp=2).bind(Machine("cuda", 4))._parallelism_config()
    assert (config.dp_replicate_size, config.dp_shard_size, config.cp_size, config.tp_size) == (1, 2, 2, 1)
    assert config.cp_enabled and config.cp_backend == "torch" and config.cp_handler.cp_comm_strategy == "allgather"
    assert config.fsdp_dim_names == ["dp_shard_cp"] and config.non_data_parallel_size == 2
    config = _fsdp(cp=4, cp_comm_strategy="alltoall").bind(Machine("cuda", 4))._parallelism_config()
    assert config.cp_size == 4 and config.dp_shard_size == 1 and config.cp_handler.cp_comm_strategy == "alltoall"


def test_plan_shows_a_cp_mesh_row() -> None:
    proc = cli_in_process("plan", "--num-processes", "4", "--mesh", "shard=2,cp=2", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["label"]: r for r in json.loads(proc.stdout)["rows"]}
    row, plain = rows["fsdp2 mesh replicate=1,shard=2,cp=2"], rows["fsdp2"]
    assert (row["params"], row["grads"], row["optimizer"]) == (plain["params"], plain["grads"], plain["optimizer"])  # sharded over 4 as FSDP on 4
    assert "N = dp_shard x cp" in row["note"]
    assert row["activations"] < plain["activations"]  # each rank runs half of every row
    proc = cli_in_process("plan", "--num-processes", "4", "--mesh", "cp=3")
    assert proc.returncode == 2 and "cp: 3 does not divide the world size (4 processes)" in proc.stderr


# -- the loop's arithmetic for a cp group ----------------------------------------------------


class _FakeCP:
    """An accelerator whose cp context cuts the buffers as torch does for causal attention
    (2 x cp chunks; rank r keeps chunks r and 2cp-1-r), for one rank of the group."""

    def __init__(self, cp: int, rank: int) -> None:
        from accelerate.parallelism_config import ParallelismConfig

        self.parallelism_config = ParallelismConfig(cp_size=cp)
        self.cp, self.rank = cp, rank

    def maybe_context_parallel(self, buffers: list[Any], buffer_seq_dims: list[int], no_restore_buffers: set[Any]) -> Any:
        import contextlib

        import torch

        for b in buffers:
            chunks = b.chunk(2 * self.cp, dim=1)
            part = torch.cat([chunks[self.rank], chunks[2 * self.cp - 1 - self.rank]], dim=1).clone()
            b.resize_(part.shape)
            b.copy_(part)
        return contextlib.nullcontext()


class _PerToken:
    """A causal LM whose logits at a position depend on its token and position only, so they
    are the same whether the row is whole or cut (attention is what the ring exchanges)."""

    def __init__(self, vocab: int) -> None:
        import torch

        g = torch.Generator().manual_seed(0)
        self.table = torch.randn(vocab, vocab, generator=g)
        self.pos = torch.randn(64, vocab, generator=g)

    def __call__(self, input_ids: Any, position_ids: Any, use_cache: bool) -> Any:
        return SimpleNamespace(logits=self.table[input_ids] + self.pos[position_ids])


def test_a_cp_groups_parts_add_up_to_the_rows_loss() -> None:
    import torch

    from acc_train.data.rows import IGNORE_INDEX
    from acc_train.loop.loss import _counted, _token_losses, sequence_shards

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 16, (3, 16), generator=g)
    labels = ids.clone()
    labels[0, :5] = IGNORE_INDEX  # a prompt
    labels[1, 7] = IGNORE_INDEX  # an example start inside the row
    positions = torch.arange(16).repeat(3, 1)
    model = _PerToken(16)
    whole = {"input_ids": ids, "labels": labels, "position_ids": positions}
    reference, count = _token_losses(model, whole)
    assert count == _counted(whole)
    for cp in (2, 4):
        total, n = torch.zeros(()), 0
        for rank in range(cp):
            batch = {k: v.clone() for k, v in whole.items()}
            with sequence_shards(_FakeCP(cp, rank), batch) as part:
                assert part["input_ids"].shape == (3, 16 // cp) and "labels" not in part
                summed, k = _token_losses(model, part)
            total, n = total + summed, n + int(k)
        assert n == int(count) and torch.allclose(total, reference, rtol=0, atol=1e-4)


def test_sequence_shards_without_cp_is_the_batch_and_refuses_masks_with_it() -> None:
    import torch

    from acc_train.api import UserError
    from acc_train.loop.loss import sequence_shards

    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "labels": torch.zeros(1, 8, dtype=torch.long)}
    with sequence_shards(SimpleNamespace(parallelism_config=None), batch) as part:
        assert part is batch
    padded = {**batch, "attention_mask": torch.ones(1, 8, dtype=torch.long)}
    with pytest.raises(UserError) as caught, sequence_shards(_FakeCP(2, 0), padded):
        pass
    assert caught.value.where == "data.packing"


def test_gradients_average_over_data_and_cp_ranks_and_losses_over_tp_replicas() -> None:
    from accelerate.parallelism_config import ParallelismConfig

    from acc_train.accelerator import Accelerator

    def facts(num_processes: int, config: Any) -> tuple[int, int, int]:
        acc = SimpleNamespace(num_processes=num_processes, parallelism_config=config)
        replicas = Accelerator.batch_replicas.fget(acc)  # type: ignore[attr-defined]
        acc.batch_replicas = replicas
        return replicas, Accelerator.loss_replicas.fget(acc), Accelerator.data_parallel_size.fget(acc)  # type: ignore[attr-defined]

    assert facts(4, None) == (1, 1, 4)
    # dp_shard 2 x cp 2: 2 batches, each read by a cp pair; 4 different losses (the loop scales by 4 // 1)
    assert facts(4, ParallelismConfig(dp_shard_size=2, cp_size=2)) == (2, 1, 2)
    # dp_shard 2 x cp 2 x tp 2: each batch read by 4 ranks, each loss computed by a tp pair
    assert facts(8, ParallelismConfig(dp_shard_size=2, cp_size=2, tp_size=2)) == (4, 2, 2)
    assert facts(4, ParallelismConfig(dp_shard_size=2, tp_size=2)) == (2, 2, 2)


# -- the whole path on CPU, torch's ring kernel stood in for ------------------------------------

#: loaded by every process of a stand-in run (``CP_STAND_IN=1``): see the module docstring
STAND_IN = """
import os

if os.environ.get("CP_STAND_IN") == "1":
    import torch
    import torch.distributed as dist
    from transformers import AttentionInterface

    import acc_train_fsdp.strategy as fsdp_strategy
    from acc_train.api import Machine

    checked = fsdp_strategy.FSDPStrategy.check_environment

    def check_environment(self):
        machine = self.machine
        if machine.device_type == "cpu":  # past the refusal of cp on CPU, every other check kept
            return checked(self.bind(Machine("cuda", machine.world_size, machine.num_machines)))
        return checked(self)

    fsdp_strategy.FSDPStrategy.check_environment = check_environment

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group, ctx.rank, ctx.n = group, dist.get_rank(group), dist.get_world_size(group)
            parts = [torch.empty_like(x) for _ in range(ctx.n)]
            dist.all_gather(parts, x.contiguous(), group=group)
            return torch.cat(parts, dim=2)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=ctx.group)
            return grad.chunk(ctx.n, dim=2)[ctx.rank], None

    def positions(n, rank, chunk):  # torch's head-tail balancing: rank r holds chunks r and 2n-1-r
        return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk), torch.arange((2 * n - 1 - rank) * chunk, (2 * n - rank) * chunk)])

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        from accelerate.state import AcceleratorState
        from transformers.integrations.sdpa_attention import repeat_kv

        mesh = AcceleratorState().device_mesh
        if mesh is None or "cp" not in (mesh.mesh_dim_names or ()):
            return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
        group = mesh["cp"].get_group()
        n, rank, chunk = dist.get_world_size(group), dist.get_rank(group), query.shape[2] // 2
        keys = Gather.apply(repeat_kv(key, module.num_key_value_groups), group)
        values = Gather.apply(repeat_kv(value, module.num_key_value_groups), group)
        mine, every = positions(n, rank, chunk), torch.cat([positions(n, r, chunk) for r in range(n)])
        scores = (query @ keys.transpose(-1, -2)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
        scores = scores.masked_fill(every[None, :] > mine[:, None], float("-inf"))
        return (torch.softmax(scores, dim=-1) @ values).transpose(1, 2).contiguous(), None

    from transformers.integrations.sdpa_attention import sdpa_attention_forward as sdpa

    AttentionInterface.register("sdpa", attention)
"""

#: global batch 8 rows in every setting (the micro-batch times the data-parallel ranks)
CP_SETTINGS = {
    "ddp-2": ("--strategy", "ddp", "--num-processes", "2", "--micro-batch-size", "4"),
    "cp-2": ("--strategy", "fsdp", "--num-processes", "2", "--micro-batch-size", "8", "--set", "strategy.cp=2"),
    "shard-cp-2x2": ("--strategy", "fsdp", "--num-processes", "4", "--micro-batch-size", "4", "--set", "strategy.cp=2"),
}


@pytest.fixture(scope="module")
def cp_runs(no_dropout_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The three runs, made at once with the stand-in loaded (its attention is transformers'
    own SDPA where the mesh has no cp dimension: the DDP reference is unchanged)."""
    import random

    root = tmp_path_factory.mktemp("cp-stand-in")
    (root / "sitecustomize.py").write_text(STAND_IN)
    rng = random.Random(0)
    document = root / "one_document.jsonl"  # one long text: no row holds an example start
    document.write_text(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(4000))}) + "\n")
    data = {"train": document, "eval": document}

    def args(setting: str, out: Path) -> list[str]:
        steps = ("--max-steps", "6", "--set", "checkpoint.every=0", "--set", "data.shuffle=false", "--set", "data.eval_files=[]")
        return [*tiny_job_args(no_dropout_model, data, out, *steps), *CP_SETTINGS[setting]]

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CP_STAND_IN", "1")
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
        get = shared_runs(tmp_path_factory, args)
        return {setting: get(setting) for setting in CP_SETTINGS}


@pytest.mark.launch
@pytest.mark.xdist_group("cp")
@pytest.mark.parametrize("setting", ["cp-2", "shard-cp-2x2"])
def test_context_parallel_runs_give_ddps_losses(cp_runs: Any, setting: str) -> None:
    reference, got = read_metrics(cp_runs["ddp-2"]), read_metrics(cp_runs[setting])
    assert sorted(got) == sorted(reference) == list(range(1, 7))
    for step in reference:
        assert got[step]["loss"] == pytest.approx(reference[step]["loss"], abs=1e-4), step
        # (AdamW would hide gradients scaled by a constant from the losses; their norm does not)
        assert got[step]["grad_norm"] == pytest.approx(reference[step]["grad_norm"], rel=1e-4), step
    summary = json.loads((cp_runs[setting] / "run.json").read_text())
    shape = {"cp-2": {"cp": 2}, "shard-cp-2x2": {"dp_shard": 2, "cp": 2}}[setting]
    assert summary["mesh"]["shape"] == shape and summary["distributed_type"] == "DistributedType.FSDP"
    assert summary["mesh"]["coordinates"]["1"]["cp"] == 1
