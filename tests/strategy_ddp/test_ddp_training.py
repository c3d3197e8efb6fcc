"""DDP on 2 CPU processes over gloo, through the real command and the elastic launcher.

One 20-step run (the session fixture ``ddp_run`` in conftest) is shared by most tests here and by
the FSDP tests that compare against DDP; a second launch resumes it from step 10.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import SAMPLE_ARGS, SAMPLE_PROMPTS, WORDS, assert_model_card, read_metrics, resume_from_step_10, run_cli, same_samples, tiny_job_args

pytestmark = [pytest.mark.launch, pytest.mark.xdist_group("reference-runs")]


def test_run_is_real_ddp_on_two_cpu_ranks(ddp_run: Path) -> None:
    summary = json.loads((ddp_run / "run.json").read_text())
    assert summary["distributed_type"] == "DistributedType.MULTI_CPU"
    assert summary["world_size"] == 2
    assert summary["strategy"] == "ddp"
    assert summary["steps"] == 20
    ranks = summary["per_rank"]
    assert [r["rank"] for r in ranks] == [0, 1]
    # every rank holds the whole model, and the replicas stayed identical
    assert ranks[0]["param_elements"] == ranks[1]["param_elements"] == summary["model_parameters"]
    assert ranks[0]["param_checksum"] == ranks[1]["param_checksum"]
    assert all(r["peak_memory_bytes"] > 0 for r in ranks)


def test_metrics_and_outputs(ddp_run: Path) -> None:
    metrics = read_metrics(ddp_run)
    assert sorted(metrics) == list(range(1, 21))
    first, last = metrics[1], metrics[20]
    assert {"step", "loss", "lr", "grad_norm", "tokens", "elapsed_s", "tokens_per_s", "mfu"} <= set(first)
    # real tokens: the packed rows' padding (each epoch's last row) is left out of the 20 * 2 * 4 * 16 positions
    summary = json.loads((ddp_run / "run.json").read_text())
    assert 0.9 * 20 * 2 * 4 * 16 < last["tokens"] <= 20 * 2 * 4 * 16 and summary["tokens"] == last["tokens"]
    basis = summary["mfu_basis"]
    assert basis["devices"] == 1 and basis["peak_flops"] == basis["peak_flops_per_device"]  # 2 ranks share one CPU
    for row in metrics.values():
        assert 0 < row["mfu"] < 1 and row["mfu"] == pytest.approx(row["tokens_per_s"] * basis["flops_per_token"] / basis["peak_flops"])
    assert 0 < summary["mfu"] < 1
    assert last["loss"] < first["loss"]
    evals = [json.loads(line) for line in (ddp_run / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line]
    assert [e["step"] for e in evals] == [10, 20]
    config = (ddp_run / "config.yaml").read_text()
    assert "name: ddp" in config and "max_steps: 20" in config
    assert list((ddp_run / "logs").rglob("events.out.tfevents.*")), "tensorboard wrote no events"


def test_checkpoints_are_complete_and_pointed_to(ddp_run: Path) -> None:
    ckpts = ddp_run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-000020"
    for step in (10, 20):
        manifest = json.loads((ckpts / f"step-{step:06d}" / "manifest.json").read_text())
        assert manifest["step"] == step
        assert manifest["world_size"] == 2
        assert manifest["format"] == "dcp"
        assert {"trainer_state.json", "rng-rank00001.safetensors"} <= set(manifest["files"])
        assert [f for f in manifest["files"] if f.startswith("state/") and f.endswith(".safetensors")]
    assert not list(ckpts.glob(".staging-*"))
    assert not [p for p in ckpts.rglob("*") if p.suffix in {".bin", ".pt", ".pkl"}], "nothing we write needs pickle"


def test_every_output_is_as_readable_as_the_umask_says(ddp_run: Path) -> None:
    """Issue 41: final/model.safetensors, the checkpoints' rng-*.safetensors and report.png were
    written 0600 (safetensors and tempfile ignore the umask): a colleague could not read them."""
    import os
    import stat

    umask = os.umask(0)
    os.umask(umask)  # the launch inherited this process's
    wrong = {}
    for path in [ddp_run, *ddp_run.rglob("*")]:
        if path.is_symlink() or path.name.startswith("."):  # (the run's lock)
            continue
        want = (0o777 if path.is_dir() else 0o666) & ~umask
        if stat.S_IMODE(path.stat().st_mode) != want:
            wrong[str(path.relative_to(ddp_run))] = oct(stat.S_IMODE(path.stat().st_mode))
    assert (ddp_run / "report.png").is_file() and list(ddp_run.glob("checkpoints/*/rng-rank*.safetensors"))
    assert wrong == {}, f"not {oct(0o666 & ~umask)} as umask {oct(umask)} gives: {wrong}"


def test_final_model_loads_in_transformers(ddp_run: Path, tiny_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from acc_train.checkpoint import read_portable_full

    final = ddp_run / "final"
    assert (final / "model.safetensors").is_file()
    assert_model_card(ddp_run, "ddp")
    model = AutoModelForCausalLM.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    ids = torch.tensor([tok("the quick brown fox")["input_ids"]])
    assert torch.isfinite(model(ids).logits).all()
    # the exported weights are the trained ones: equal to the last checkpoint's
    ckpt = read_portable_full(ddp_run / "checkpoints" / "step-000020")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, ckpt[f"model.{name}"]), name
    untrained = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.equal(untrained.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_stop_at_10_and_resume_gives_the_same_losses(ddp_run: Path, tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    """The run as if it had been killed after step 10's checkpoint, resumed with --resume latest."""
    resumed = resume_from_step_10(ddp_run, tmp_path, tiny_model_dir, tiny_data, "--strategy", "ddp", *SAMPLE_ARGS)
    full, again = read_metrics(ddp_run), read_metrics(resumed)
    assert full[10]["epoch"] >= 1 and full[20]["epoch"] > full[10]["epoch"], "the resume must cross epochs"
    assert sorted(again) == list(range(1, 21))  # steps 1-10 kept, 11-20 redone
    for step in range(11, 21):
        assert again[step]["loss"] == pytest.approx(full[step]["loss"], abs=1e-6), step
        assert again[step]["lr"] == pytest.approx(full[step]["lr"], rel=1e-9)
    summary = json.loads((resumed / "run.json").read_text())
    assert summary["start_step"] == 10 and summary["resumed_from"].endswith("step-000010")
    # step 10's samples kept, step 20's written again (once): the uninterrupted run's
    assert same_samples(resumed) == same_samples(ddp_run) and len(same_samples(ddp_run)) == 4


def test_samples_at_each_evaluation_reach_the_file_tensorboard_card_and_report(ddp_run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = same_samples(ddp_run)
    assert [(step, index, prompt) for step, index, prompt, _, _ in rows] == [(s, i, p) for s in (10, 20) for i, p in enumerate(SAMPLE_PROMPTS)]
    for _, _, _, completion, new_tokens in rows:
        assert 1 <= new_tokens <= 8 and set(completion.split()) <= set(WORDS), completion  # the tiny tokenizer's words
    assert len({completion for *_, completion, _ in rows}) > 1, "the prompts and steps give different completions"
    summary = json.loads((ddp_run / "run.json").read_text())
    last = [{"prompt": prompt, "completion": completion} for step, _, prompt, completion, _ in rows if step == 20]
    assert summary["samples"] == {"file": "samples.jsonl", "step": 20, "last": last}
    card = (ddp_run / "final" / "README.md").read_text()
    assert "## Samples" in card and all(f"| {r['prompt']} | {r['completion']} |" in card for r in last)
    folder = next((ddp_run / "logs").rglob("events.out.tfevents.*")).parent
    events = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    events.Reload()
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("samples/text_summary")}
    assert sorted(texts) == [10, 20] and all(r["completion"] in texts[20] for r in last if r["completion"])
    proc = run_cli("report", str(ddp_run), "--no-png", "--prompt", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = proc.stdout.split("samples at step 20 (samples.jsonl):\n", 1)[1]
    latest, across = shown.split(f"prompt [1] across steps: {SAMPLE_PROMPTS[1]}\n")
    assert latest.splitlines() == [line for i, r in enumerate(last) for line in (f"  [{i}] {r['prompt']}", f"      -> {r['completion']}")]
    assert across.splitlines() == [f"  step {step}  {completion}" for step, index, _, completion, _ in rows if index == 1]


@pytest.mark.xdist_group("one-process")
def test_one_launched_process_trains_and_a_worker_side_input_error_exits_2(tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    out = tmp_path / "one"
    proc = run_cli(*tiny_job_args(tiny_model_dir, tiny_data, out, "--num-processes", "1", "--max-steps", "3"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "run.json").read_text())
    assert summary["world_size"] == 1 and summary["steps"] == 3
    # a mistake only the worker can see (the data's fields): exit 2, one message, no traceback
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"content": "the quick brown fox jumps over a lazy dog"}\n' * 50)
    args = tiny_job_args(tiny_model_dir, {"train": bad, "eval": tiny_data["eval"]}, tmp_path / "bad-run", "--num-processes", "1")
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "data.text_field" in proc.stderr and "'content'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_gradient_checkpointing_gives_the_losses_of_the_run_without_it(ddp_run: Path, tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    """fp32, recompute only: the same losses as the reference run, attention dropout included
    (the recompute replays each rank's RNG)."""
    from tests.conftest import assert_same_losses, checkpointed_run

    got = checkpointed_run(tmp_path, tiny_model_dir, tiny_data, "--strategy", "ddp")
    assert got["run"]["activation_checkpointing"] == {"transformers_layers": 1, "checkpoint_wrappers": 0}
    assert got["run"]["attn_implementation"] == "sdpa"
    assert_same_losses(got["losses"], read_metrics(ddp_run))
