"""LoRA for real (2 CPU processes, fp32): every strategy trains the adapters to DDP's losses,
checkpoints hold the adapters alone and resume across strategies, ``final/`` is an adapter
directory PEFT loads, and ``checkpoint export --merge`` writes a model transformers loads alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from acc_train.outputs.samples_file import read_samples
from tests.conftest import SAMPLE_ARGS, assert_model_card, read_metrics, run_cli, same_samples, shared_runs, stopped_copy, tiny_job_args

pytestmark = [pytest.mark.launch, pytest.mark.xdist_group("lora")]

STEPS = 8
LORA = ("--set", "model.lora.r=4", "--set", "model.lora.alpha=8")
#: the strategies LoRA is run under, each compared with ddp
STRATEGIES = {
    "ddp": ("--strategy", "ddp"),
    "fsdp2": ("--strategy", "fsdp"),
    "fsdp1": ("--strategy", "fsdp1"),
    "zero2": ("--strategy", "zero2"),
    "zero3": ("--strategy", "zero3"),
    # PEFT under transformers' gradient checkpointing (non-reentrant: no input grads needed)
    "ddp-checkpointed": ("--strategy", "ddp", "--set", "training.gradient_checkpointing=true"),
}


def _args(model: Path, data: dict[str, Path], out: Path, *extra: str, lora: tuple[str, ...] = LORA) -> list[str]:
    steps = ("--max-steps", str(STEPS), "--set", "checkpoint.every=4", "--set", "checkpoint.keep_last=null")
    return tiny_job_args(model, data, out, "--num-processes", "2", *steps, *lora, *SAMPLE_ARGS, *extra)


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tiny_data: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    return shared_runs(tmp_path_factory, lambda name, out: _args(tiny_model_dir, tiny_data, out, *STRATEGIES[name]))


@pytest.mark.parametrize("name", [n for n in STRATEGIES if n != "ddp"])
def test_lora_trains_to_ddps_losses(runs, name: str) -> None:
    ref, got = read_metrics(runs("ddp")), read_metrics(runs(name))
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    assert ref[STEPS]["loss"] != ref[1]["loss"]  # the adapters did train
    for step in ref:
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], abs=1e-4), (name, step)
    summary = json.loads((runs(name) / "run.json").read_text())
    for rank in summary["per_rank"]:
        assert rank["frozen_param_bytes"] > 0  # the base model, held without gradients or moments
        assert rank["param_dtype"] == "float32"
    # MFU's FLOPs per token: the frozen base at 4 per parameter, the adapters at 6, counted before
    # any strategy shards the model (ZeRO-3's partitioned parameters included)
    basis, ref_basis = summary["mfu_basis"], json.loads((runs("ddp") / "run.json").read_text())["mfu_basis"]
    assert (basis["parameters"], basis["trainable_parameters"], basis["flops_per_token"]) == (
        ref_basis["parameters"], ref_basis["trainable_parameters"], ref_basis["flops_per_token"],
    )  # fmt: skip
    adapters, frozen_matrix = basis["trainable_parameters"], basis["parameters"] - basis["trainable_parameters"] - 64 * 32
    assert 0 < adapters < frozen_matrix
    assert basis["flops_per_token"] == 6 * adapters + 4 * frozen_matrix + 12 * 1 * 32 * 16  # tiny model: 1 layer, hidden 32, vocab 64, seq 16
    assert 0 < summary["mfu"] < 1


@pytest.mark.parametrize("name", ["ddp", "zero3"])
def test_checkpoints_hold_the_adapters_and_their_optimizer_state_alone(runs, name: str) -> None:
    from acc_train.checkpoint import read_portable_full

    ckpt = runs(name) / "checkpoints" / "step-000004"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["adapters"]["type"] == "lora" and manifest["adapters"]["r"] == 4
    flat = read_portable_full(ckpt)
    weights = [k for k in flat if k.startswith("model.")]
    moments = [k for k in flat if k.startswith("optim.state.")]
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights)
    assert {k.rsplit(".", 1)[0] for k in moments if not k.endswith(".step")} >= {f"optim.state.{k.removeprefix('model.')}" for k in weights}
    assert all(".lora_" in k for k in moments)


@pytest.mark.parametrize(("writer", "reader"), [("ddp", "fsdp2"), ("zero3", "ddp")])
def test_lora_resumes_under_another_strategy(runs, writer: str, reader: str, tiny_model_dir: Path, tiny_data: dict[str, Path], tmp_path: Path) -> None:
    resumed = stopped_copy(runs(writer), tmp_path / "resumed", saved=4, lost=8)
    proc = run_cli(*_args(tiny_model_dir, tiny_data, resumed, *STRATEGIES[reader], "--resume", "latest"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    ref, got = read_metrics(runs("ddp")), read_metrics(resumed)
    for step in range(5, STEPS + 1):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], abs=1e-5), step


def test_a_lora_checkpoint_does_not_resume_as_full_fine_tuning(runs, tiny_model_dir: Path, tiny_data: dict[str, Path], tmp_path: Path) -> None:
    resumed = stopped_copy(runs("ddp"), tmp_path / "resumed", saved=4, lost=8)
    proc = run_cli(*_args(tiny_model_dir, tiny_data, resumed, "--resume", "latest", lora=()))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "holds LoRA adapters, and this run trains full fine-tuning" in proc.stderr
    assert not (resumed / "final").exists()


def test_final_loads_with_peft_and_export_merge_with_transformers(runs, tiny_model_dir: Path, tmp_path: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = runs("ddp")
    final = run / "final"
    assert (final / "adapter_config.json").is_file() and (final / "adapter_model.safetensors").is_file()
    assert not (final / "model.safetensors").exists()
    meta = assert_model_card(run, "ddp", adapter=True)
    assert meta.get("base_model") is None and str(tiny_model_dir) in (final / "README.md").read_text()  # a local base, named in the body
    ids = torch.tensor([[2, 5, 9, 11, 3, 7, 21, 4]])
    base_logits = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()(input_ids=ids).logits
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), final).eval()
    tuned_logits = tuned(input_ids=ids).logits
    assert (tuned_logits - base_logits).abs().max() > 1e-4  # the adapters changed the model

    last = run / "checkpoints" / f"step-{STEPS:06d}"
    merged_dir, adapter_dir = tmp_path / "merged", tmp_path / "adapter"
    proc = run_cli("checkpoint", "export", str(last), "--to", "hf", "--merge", str(merged_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(merged(input_ids=ids).logits, tuned_logits, atol=1e-5, rtol=1e-5)

    proc = run_cli("checkpoint", "export", str(last), "--to", "hf", str(adapter_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PeftModel.from_pretrained" in proc.stdout
    exported = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter_dir).eval()
    torch.testing.assert_close(exported(input_ids=ids).logits, tuned_logits)
    # each export's model card says what its directory holds: the merged model, or the adapters
    from huggingface_hub import ModelCard

    for directory, library, lora in ((merged_dir, "transformers", False), (adapter_dir, "peft", True)):
        meta = ModelCard.load(directory / "README.md").data.to_dict()
        assert meta["library_name"] == library and ("lora" in meta["tags"]) == lora, (directory, meta)

    proc = run_cli("checkpoint", "export", str(last), "--to", "hf", "--merge", str(merged_dir))  # OUT exists: refused, nothing touched
    assert proc.returncode == 2


@pytest.mark.parametrize(("name", "row"), [("ddp", "ddp"), ("fsdp2", "fsdp2"), ("zero3", "zero3")])
def test_plan_agrees_with_the_measured_adapters_and_frozen_base(runs, name: str, row: str, tiny_model_dir: Path) -> None:
    proc = run_cli("plan", "--json", "--model", str(tiny_model_dir), "--num-processes", "2", "--mixed-precision", "no", *LORA)
    assert proc.returncode == 0, proc.stderr[-3000:]
    planned = {r["label"]: r for r in json.loads(proc.stdout)["rows"]}[row]
    for rank in json.loads((runs(name) / "run.json").read_text())["per_rank"]:
        measured = rank["model_state_bytes"]
        assert planned["model_state"] == pytest.approx(measured["params"] + measured["grads"] + measured["optimizer"], rel=0.10), (name, measured)
        assert planned["frozen"] == pytest.approx(rank["frozen_param_bytes"], rel=0.10), (name, rank)


def test_generate_reads_a_lora_run_from_its_final_and_from_a_checkpoint(runs) -> None:
    """``acc-train generate`` on a LoRA run: final/ (the adapters on their base) and the last
    checkpoint (its portable state, the adapters merged into the base) complete a prompt alike."""
    run = runs("ddp")
    completions = []
    for source in (run, run / "checkpoints" / f"step-{STEPS:06d}"):
        proc = run_cli("generate", str(source), "--prompt", "the quick brown", "--max-new-tokens", "8")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "(8 tokens" in proc.stderr or "tokens" in proc.stderr.splitlines()[-1]
        completions.append(proc.stdout)
    assert completions[0].strip() and completions[0] == completions[1]  # greedy: the same tokens
    # the run's own sample of that prompt after its last step came from the same adapters
    (last,) = [r for r in read_samples(run) if r["step"] == STEPS and r["prompt"] == "the quick brown"]
    assert completions[0].strip() == last["completion"].strip()
    assert "model: " + str(run / "final") in run_cli("generate", str(run), "--prompt", "x", "--max-new-tokens", "1").stderr


@pytest.mark.parametrize("name", [n for n in STRATEGIES if n != "ddp"])
def test_lora_samples_are_ddps(runs, name: str) -> None:
    """Generated through the adapter model under every strategy (ZeRO-3 and FSDP from shards):
    greedy, in fp32, the completions after the last step are DDP's."""
    assert same_samples(runs(name)) == same_samples(runs("ddp")) and [r[0] for r in same_samples(runs("ddp"))] == [STEPS, STEPS]


def test_eval_scores_a_lora_run_from_its_final_and_from_a_checkpoint(runs, harness_task: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``acc-train eval`` on a LoRA run: final/ (the adapters on their base) and the last
    checkpoint (the adapters merged into the base) score a local harness task alike."""
    from click.testing import CliRunner

    from acc_train_cli.main import cli

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = runs("ddp")
    outputs = []
    for source in (run, run / "checkpoints" / f"step-{STEPS:06d}"):
        result = CliRunner().invoke(cli, ["eval", str(source), "--tasks", str(harness_task)])
        assert result.exit_code == 0, result.output[-3000:]
        outputs.append(result.stdout)
    assert outputs[0].startswith("tiny_words acc ") and outputs[0] == outputs[1]
