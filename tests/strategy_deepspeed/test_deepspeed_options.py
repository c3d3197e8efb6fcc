"""DeepSpeed options, DeepSpeed JSON configs with "auto" values, and accelerate's DeepSpeed YAML."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from acc_train import Machine, UserError, resolve_strategy
from acc_train.config import load_job
from acc_train_deepspeed import DeepSpeedStrategy
from acc_train_deepspeed.config import load_ds_config
from tests.conftest import cli_in_process


def test_presets() -> None:
    for name, stage in (("zero1", 1), ("zero2", 2), ("zero3", 3), ("deepspeed", 3)):
        assert load_job(flags={"strategy.name": (name, "--strategy")}).strategy.options.zero_stage == stage
    off = load_job(flags={"strategy.name": ("zero3-offload", "--strategy")}).strategy.options
    assert (off.offload_optimizer, off.offload_param) == ("cpu", "cpu")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"stage": 2, "offload_param": "cpu"}, "offload_param needs stage 3"),
        ({"stage": 3, "offload_optimizer": "nvme"}, "needs nvme_path"),
        ({"stage": 1, "zero3_init_flag": True}, "applies to stage 3 only"),
        ({"config_file": "ds.json", "stage": 3}, "the DeepSpeed JSON's zero_optimization decides"),
        ({"stag": 3}, "Extra inputs"),
    ],
)
def test_inconsistent_options_are_errors(options: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        DeepSpeedStrategy().parse_options(options)


def test_cpu_offload_on_a_cpu_only_run_is_refused() -> None:
    with pytest.raises(UserError, match="would do nothing"):
        resolve_strategy("deepspeed", {"stage": 3, "offload_optimizer": "cpu"}).bind(Machine("cpu", 2)).check_environment()


def test_json_auto_values_are_filled_from_the_job(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "train_batch_size": "auto", "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 3, "overlap_comm": True},
    }))  # fmt: skip
    config = load_ds_config(str(path), micro_batch_size=4, accumulation=2, clipping=1.0, mixed_precision="no")
    assert config["train_micro_batch_size_per_gpu"] == 4 and config["gradient_accumulation_steps"] == 2
    assert config["gradient_clipping"] == 1.0 and config["bf16"] == {"enabled": False}
    assert config["zero_optimization"] == {"stage": 3, "overlap_comm": True}  # used as given


def test_json_that_contradicts_the_job_shows_both_values(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"gradient_accumulation_steps": 8}))
    with pytest.raises(UserError, match=r"gradient_accumulation_steps is 8 in the DeepSpeed config but the job's training.gradient_accumulation_steps is 1"):
        load_ds_config(str(path), micro_batch_size=4, accumulation=1, clipping=1.0, mixed_precision="no")
    path.write_text(json.dumps({"optimizer": {"type": "AdamW"}}))
    with pytest.raises(UserError, match="acc-train's own optimizer and scheduler"):
        load_ds_config(str(path), micro_batch_size=4, accumulation=1, clipping=1.0, mixed_precision="no")


def test_accelerate_deepspeed_yaml_is_read_as_it_is(tmp_path: Path) -> None:
    cfg = tmp_path / "ds.yaml"
    cfg.write_text(
        "compute_environment: LOCAL_MACHINE\ndebug: false\n"
        "deepspeed_config:\n  gradient_accumulation_steps: 2\n  gradient_clipping: 0.5\n"
        "  offload_optimizer_device: none\n  offload_param_device: none\n  zero3_init_flag: true\n"
        "  zero3_save_16bit_model: true\n  zero_stage: 3\n  deepspeed_multinode_launcher: standard\n"
        "distributed_type: DEEPSPEED\ndowncast_bf16: 'no'\nmachine_rank: 0\nmain_training_function: main\n"
        "mixed_precision: 'no'\nnum_machines: 1\nnum_processes: 2\nrdzv_backend: static\nsame_network: true\n"
        "tpu_env: []\ntpu_use_cluster: false\ntpu_use_sudo: false\nuse_cpu: false\n"
    )
    proc = cli_in_process("--config", str(cfg), "--print-config")
    assert proc.returncode == 0, proc.stderr
    resolved = yaml.safe_load(proc.stdout)
    assert resolved["strategy"]["name"] == "deepspeed" and resolved["strategy"]["stage"] == 3
    assert resolved["strategy"]["zero3_save_16bit_model"] is True
    assert resolved["training"]["gradient_accumulation_steps"] == 2 and resolved["training"]["max_grad_norm"] == 0.5
    assert resolved["launch"]["num_processes"] == 2


def test_parameter_shards_and_the_reported_stage_come_from_what_runs() -> None:
    """Only ZeRO-3 partitions parameters; run.json's zero_stage is the engine's, not the option."""
    for name, shards in (("zero1", 1), ("zero2", 1), ("zero3", 4)):
        assert resolve_strategy(name).planner().parameter_shards(Machine("cpu", 4)) == shards

    class Engine:
        def zero_optimization_stage(self) -> int:
            return 2

    class Wrapped:
        engine = Engine()

    class Prepared:
        deepspeed_engine_wrapped = Wrapped()

    class Unprepared:
        deepspeed_engine_wrapped = None

    assert resolve_strategy("zero3").summary(Prepared()) == {"zero_stage": 2}
    assert resolve_strategy("zero3").summary(Unprepared()) == {"zero_stage": None}


def test_zero_stage_0_is_refused_before_launch_with_what_to_use(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = cli_in_process("--strategy", "deepspeed", "--set", "strategy.stage=0", "--num-processes", "2", "--output-dir", str(out))
    assert proc.returncode == 2 and "strategy.stage: ZeRO stage 0" in proc.stderr and "--strategy ddp" in proc.stderr
    silent = tmp_path / "ds.json"  # DeepSpeed's own default is stage 0
    silent.write_text('{"train_micro_batch_size_per_gpu": "auto"}')
    proc = cli_in_process("--strategy", "deepspeed", "--set", f"strategy.config_file={silent}", "--num-processes", "2", "--output-dir", str(out))
    assert proc.returncode == 2 and f"{silent}: zero_optimization.stage" in proc.stderr and "without zero_optimization.stage means stage 0" in proc.stderr
    assert not out.exists()
