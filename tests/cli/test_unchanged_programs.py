"""``acc-train launch`` runs the code users bring, unchanged, under the strategy it is given: the
seed's own Accelerate script, HF Trainer, TRL's SFTTrainer and DPOTrainer, and Accelerate's own
test scripts, on 2 CPU processes in fp32; and a strategy that cannot apply to what a program
builds is an error, never silence. The programs live in ``tests/launch_programs``."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.launch

PROGRAMS = Path(__file__).resolve().parent.parent / "launch_programs"


def launch(strategy: str, *program: str, nproc: int = 2, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return run_cli("--strategy", strategy, "--num-processes", str(nproc), "--mixed-precision", "no", "launch", *program, cwd=cwd)


def results(proc: subprocess.CompletedProcess[str]) -> list[dict]:
    assert proc.returncode == 0, proc.stderr[-5000:]
    return [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines() if "RESULT " in line]


# --- the seed's script -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def seed_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """The seed's script under each strategy, one launch each, rank by rank. The ddp run starts
    it as a module (``launch -m``), from a copy in a directory of its own."""
    out: dict[str, list[dict]] = {}
    home = tmp_path_factory.mktemp("seed")
    shutil.copy(PROGRAMS / "seed_train.py", home / "seed_train.py")
    out["ddp"] = results(launch("ddp", "-m", "seed_train", cwd=home))
    for strategy in ("fsdp", "zero3"):
        out[strategy] = results(launch(strategy, str(PROGRAMS / "seed_train.py")))
    return {name: sorted(ranks, key=lambda r: r["rank"]) for name, ranks in out.items()}


@pytest.mark.xdist_group("unchanged-scripts")
@pytest.mark.parametrize(("strategy", "distributed_type"), [("ddp", "MULTI_CPU"), ("fsdp", "FSDP"), ("zero3", "DEEPSPEED")])
def test_the_seeds_script_runs_the_strategy_it_was_given(seed_runs: dict, strategy: str, distributed_type: str) -> None:
    ranks = seed_runs[strategy]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert {r["type"] for r in ranks} == {distributed_type}
    assert {r["world"] for r in ranks} == {2}
    total = ranks[0]["total"]
    if strategy == "ddp":
        assert [r["held"] for r in ranks] == [total, total]
    else:  # sharded: each rank holds about half of the parameters, together all of them
        assert all(r["held"] < 0.6 * total for r in ranks)
        assert sum(r["held"] for r in ranks) >= total


@pytest.mark.xdist_group("unchanged-scripts")
@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_the_seeds_script_gives_ddps_losses(seed_runs: dict, strategy: str) -> None:
    """Including ZeRO's: built from the variables, DeepSpeed would clip gradients at 1.0 where
    DDP does not; nothing in the script asks for clipping, so neither clips."""
    reference = seed_runs["ddp"][0]["losses"]
    assert len(reference) == 8 and reference[-1] < reference[0]
    for rank in seed_runs[strategy]:
        assert rank["losses"] == pytest.approx(reference, abs=1e-4)


# --- Accelerate's own test scripts ---------------------------------------------------------------


@pytest.mark.xdist_group("unchanged-scripts")
@pytest.mark.parametrize(
    ("script", "shows"),
    [
        ("test_script.py", "Distributed environment: DistributedType.MULTI_CPU  Backend: gloo\nNum processes: 2"),
        ("test_sync.py", "**Test Distributed `no_sync` context manager**"),  # printed only on a distributed run
        ("test_ops.py", "testing reduce_sum"),  # PartialState alone, no Accelerator: still one 2-process job
    ],
)
def test_accelerates_own_test_scripts_pass_under_ddp(script: str, shows: str) -> None:
    """One real 2-process run: each script checks its own results against the world size."""
    proc = launch("ddp", accelerate_script(script))
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert shows in proc.stdout
    assert "ran it on its own" not in proc.stderr  # a process group built through PartialState counts


def accelerate_script(name: str) -> str:
    import accelerate.test_utils.scripts as scripts

    return str(Path(scripts.__file__).parent / name)


# --- acc_train.Accelerator under other people's patterns ---------------------------------------


@pytest.mark.xdist_group("unchanged-scripts")
@pytest.mark.parametrize(("strategy", "distributed_type"), [("fsdp", "FSDP"), ("zero3", "DEEPSPEED")])
def test_later_acc_train_accelerators_in_one_process_run_the_strategy(strategy: str, distributed_type: str) -> None:
    """The user's, a second one, one with Trainer's explicit ``fsdp_plugin=None,
    deepspeed_plugin=None``, and one after ``AcceleratorState._reset_state()``."""
    extra = ("--set", "strategy.auto_wrap_policy=none") if strategy == "fsdp" else ()  # a plain Sequential has no layer classes
    # fp32 pinned: the program feeds fp32 batches, which DeepSpeed's bf16 engine does not cast (as under
    # `accelerate launch`), and `auto` is bf16 on a CPU with AVX512-BF16 or AMX (this suite's machines vary)
    proc = run_cli(
        "--strategy", strategy, *extra, "--num-processes", "2", "--mixed-precision", "no", "launch", str(PROGRAMS / "acc_train_accelerators.py")
    )
    (seen,) = results(proc)
    assert [s["type"] for s in seen] == [distributed_type] * 4
    assert len({s["mixed_precision"] for s in seen}) == 1  # resolved once per process


@pytest.mark.xdist_group("unchanged-scripts")
def test_accelerates_test_script_passes_with_acc_train_accelerator_forced_in() -> None:
    script = accelerate_script("test_script.py")
    proc = run_cli("--strategy", "ddp", "--num-processes", "2", "--mixed-precision", "bf16", "launch", str(PROGRAMS / "acc_train_accelerators.py"), script)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "Num processes: 2\nProcess index: 0" in proc.stdout and "Mixed precision type: bf16" in proc.stdout


# --- a strategy that cannot apply is an error ------------------------------------------------------


@pytest.mark.xdist_group("unchanged-scripts")
@pytest.mark.parametrize(
    ("strategy", "program", "says"),
    [
        ("fsdp", "no_accelerator.py", 'the program never built an accelerate.Accelerator, so strategy "fsdp" had no effect on it'),
        ("zero3", "own_ddp.py", 'wraps its model in torch.nn.parallel.DistributedDataParallel itself, so strategy "deepspeed" would not apply'),
        ("zero2", "fsdp_plugin.py", 'builds Accelerator(fsdp_plugin=...), which asks Accelerate for strategy "fsdp", but acc-train launch was asked for strategy "deepspeed"'),
        # Accelerate's own: PartialState and no Accelerator; a plugin written for FSDP1
        ("zero3", "accelerate:test_ops.py", "it joined the process group (PartialState or init_process_group), but no model was prepared by one"),
        ("fsdp", "accelerate:test_merge_weights.py", 'FullyShardedDataParallelPlugin(sharding_strategy=FULL_SHARD), an FSDP1 setting, but acc-train launch was asked for strategy "fsdp" (FSDP2)'),
    ],
    ids=["no-accelerator", "own-ddp", "contradicting-plugin", "partial-state-only", "fsdp1-plugin-under-fsdp2"],
)
def test_a_strategy_that_cannot_apply_is_an_error_naming_it(strategy: str, program: str, says: str) -> None:
    proc = launch(strategy, accelerate_script(program.split(":", 1)[1]) if program.startswith("accelerate:") else str(PROGRAMS / program))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert says in proc.stderr
    assert "Traceback" not in proc.stderr.split("error: ", 1)[-1]


# --- HF Trainer and TRL ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory: pytest.TempPathFactory, no_dropout_model: Path) -> dict[str, dict]:
    out = {}
    for strategy in ("ddp", "fsdp", "zero3"):
        (result,) = results(launch(strategy, str(PROGRAMS / "trainer_train.py"), str(no_dropout_model), str(tmp_path_factory.mktemp(strategy) / "out")))
        out[strategy] = result
    return out


@pytest.mark.xdist_group("unchanged-trainers")
@pytest.mark.parametrize(("strategy", "flags"), [("ddp", (False, False)), ("fsdp", (True, False)), ("zero3", (False, True))])
def test_hf_trainer_runs_the_strategy_it_was_given(trainer_runs: dict, strategy: str, flags: tuple[bool, bool]) -> None:
    for run in (trainer_runs[strategy]["first"], trainer_runs[strategy]["resumed"]):
        assert (run["fsdp"], run["deepspeed"]) == flags  # the trainer's own is_fsdp_enabled / is_deepspeed_enabled
        assert run["world"] == 2
        assert run["held"] == run["total"] if strategy == "ddp" else run["held"] < 0.6 * run["total"]
    assert trainer_runs[strategy]["checkpoints"] == ["checkpoint-3", "checkpoint-6"]


@pytest.mark.xdist_group("unchanged-trainers")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero3"])
def test_hf_trainer_resumes_from_its_checkpoint(trainer_runs: dict, strategy: str) -> None:
    first, resumed = trainer_runs[strategy]["first"], trainer_runs[strategy]["resumed"]
    assert first["steps_run"] == 6 and resumed["steps_run"] == 3  # steps 4-6, from checkpoint-3
    for step in ("4", "5", "6"):
        assert resumed["losses"][step] == pytest.approx(first["losses"][step], abs=1e-5)
    for step in map(str, range(1, 7)):  # and the sharded runs train as DDP does
        assert first["losses"][step] == pytest.approx(trainer_runs["ddp"]["first"]["losses"][step], abs=1e-4)


@pytest.fixture(scope="module")
def trl_runs(tmp_path_factory: pytest.TempPathFactory, no_dropout_model: Path) -> dict[str, dict]:
    """SFT, SFT with LoRA and DPO one after another in one launch per strategy (each trainer's
    Accelerator a later one of its process)."""
    out = {}
    for strategy in ("fsdp", "zero3"):
        dest = tmp_path_factory.mktemp(strategy) / "out"
        (by_trainer,) = results(launch(strategy, str(PROGRAMS / "trl_train.py"), "sft,sft-lora,dpo", str(no_dropout_model), str(dest)))
        out.update({f"{strategy} {which}": result for which, result in by_trainer.items()})
    return out


@pytest.mark.xdist_group("unchanged-trainers")
@pytest.mark.parametrize("run", ["fsdp sft", "zero3 sft", "fsdp sft-lora", "zero3 sft-lora"])
def test_trl_sft_runs_the_strategy_saves_and_resumes(trl_runs: dict, run: str) -> None:
    strategy = run.split()[0]
    result = trl_runs[run]
    for trainer in (result["first"], result["resumed"]):
        assert (trainer["fsdp"], trainer["deepspeed"]) == (strategy == "fsdp", strategy == "zero3")
        assert trainer["type"] == ("FSDP" if strategy == "fsdp" else "DEEPSPEED") and trainer["world"] == 2
        assert trainer["held"] < 0.6 * trainer["total"]
    assert {"checkpoint-2", "checkpoint-4"} <= set(result["checkpoints"])
    assert result["first"]["steps_run"] == 4 and result["resumed"]["steps_run"] == 2
    for step in ("3", "4"):
        assert result["resumed"]["losses"][step] == pytest.approx(result["first"]["losses"][step], abs=1e-5)


@pytest.mark.xdist_group("unchanged-trainers")
def test_trl_sft_trains_alike_under_fsdp_and_zero3(trl_runs: dict) -> None:
    for which in ("sft", "sft-lora"):
        fsdp, zero3 = trl_runs[f"fsdp {which}"]["first"]["losses"], trl_runs[f"zero3 {which}"]["first"]["losses"]
        assert fsdp == pytest.approx(zero3, abs=1e-4)


@pytest.mark.xdist_group("unchanged-trainers")
@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_trl_dpo_trains_under_the_strategy(trl_runs: dict, strategy: str) -> None:
    """DPO's reference model (a second copy of the model) is where users report breakage."""
    run = trl_runs[f"{strategy} dpo"]["first"]
    assert (run["fsdp"], run["deepspeed"]) == (strategy == "fsdp", strategy == "zero3")
    assert run["held"] < 0.6 * run["total"]
    losses = [run["losses"][s] for s in ("1", "2", "3")]
    assert losses[0] == pytest.approx(0.6931, abs=1e-3)  # log 2: the policy starts as its reference
    assert losses[-1] < losses[0]


# --- on a GPU ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(("strategy", "flags"), [("fsdp", (True, False)), ("zero3", (False, True))])
def test_hf_trainer_on_one_gpu(strategy: str, flags: tuple[bool, bool], no_dropout_model: Path, tmp_path: Path) -> None:
    """Accelerate's own GPU path (no CPU switch), at world size 1: the device check's."""
    (result,) = results(launch(strategy, str(PROGRAMS / "trainer_train.py"), str(no_dropout_model), str(tmp_path / "out"), nproc=1))
    assert (result["first"]["fsdp"], result["first"]["deepspeed"]) == flags
    assert result["resumed"]["steps_run"] == 3
