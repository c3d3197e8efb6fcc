"""The support matrix: strategies x features, each cell computed by the checks a run makes
before launch (``acc-train``'s own), on a tiny job, for a machine described, not this one.

A cell is *refused* (with the refusal's own message), *tested* (accepted, and the test that
runs it is named), *device* (accepted; only the device check trains it, on a lent GPU) or
*accepted* (accepted before launch; nothing trains it).
``python docs/_gen/matrix.py`` rewrites ``docs/reference/support-matrix.md``;
``tests/core/test_docs_site.py`` fails when the committed page differs.
"""

from __future__ import annotations

import contextlib
import html
import importlib.util
import io
import re
import sys
import unittest.mock
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference" / "support-matrix.md"
if str(ROOT) not in sys.path:  # tests/matrix/combinations.py: plain data, no test dependencies
    sys.path.insert(0, str(ROOT))

from tests.matrix.combinations import COMBINATIONS  # noqa: E402

#: row label -> (strategy section, processes): a tiny job on 4 processes unless a mesh needs more
ROWS: dict[str, tuple[dict[str, Any], int]] = {
    "ddp": ({"name": "ddp"}, 4),
    "fsdp2": ({"name": "fsdp2"}, 4),
    "fsdp1": ({"name": "fsdp1"}, 4),
    "fsdp-offload": ({"name": "fsdp-offload"}, 4),
    "hsdp 2x2": ({"name": "fsdp", "dp_replicate": 2}, 4),
    "tp 2": ({"name": "fsdp", "tp": 2}, 2),
    "fsdp 2 x tp 2": ({"name": "fsdp", "dp_shard": 2, "tp": 2}, 4),
    "cp 2": ({"name": "fsdp", "cp": 2}, 2),
    "zero1": ({"name": "zero1"}, 4),
    "zero2": ({"name": "zero2"}, 4),
    "zero3": ({"name": "zero3"}, 4),
    "zero2-offload": ({"name": "zero2-offload"}, 4),
    "zero3-offload": ({"name": "zero3-offload"}, 4),
}

#: column label -> (config overrides, device type). Feature columns are asked of a GPU machine
#: (a CPU column says what a machine without one refuses); the tiny job is the demo model.
COLUMNS: dict[str, tuple[dict[str, Any], str]] = {
    "CPU": ({}, "cpu"),
    "GPU": ({}, "cuda"),
    "LoRA": ({"model": {"lora": {"r": 4}}}, "cuda"),
    "gradient checkpointing": ({"training": {"gradient_checkpointing": True}}, "cuda"),
    "compile": ({"training": {"compile": True}}, "cuda"),
    "streaming": ({"data": {"train_files": ["train.jsonl"], "streaming": True}, "training": {"max_steps": 10}}, "cuda"),
    "adamw": ({"optimizer": {"name": "adamw"}}, "cuda"),
    "sgd": ({"optimizer": {"name": "sgd"}}, "cuda"),
    "adafactor": ({"optimizer": {"name": "adafactor"}}, "cuda"),
    "adamw_8bit": ({"optimizer": {"name": "adamw_8bit"}}, "cuda"),
    "fp32": ({"training": {"mixed_precision": "no"}}, "cuda"),
    "bf16": ({"training": {"mixed_precision": "bf16"}}, "cuda"),
    "fp16": ({"training": {"mixed_precision": "fp16"}}, "cuda"),
    "pure bf16": ({"model": {"dtype": "bf16"}}, "cuda"),
}

#: (row, column) -> the test that runs it (file::name; a test checks each exists). A cell the
#: checks refuse must not be listed here.
_DDP = "tests/strategy_ddp/test_ddp_training.py"
_FSDP = "tests/strategy_fsdp/test_fsdp_training.py"
_MESH = "tests/strategy_fsdp/test_mesh.py"
_DS = "tests/strategy_deepspeed/test_deepspeed_training.py"
_LORA = "tests/fine_tune/test_lora_runs.py"
_CELLS = "tests/matrix/test_cells.py::test_combination_trains_and_resumes_exactly"
TESTED: dict[tuple[str, str], str] = {
    ("ddp", "CPU"): f"{_DDP}::test_run_is_real_ddp_on_two_cpu_ranks",
    ("fsdp2", "CPU"): f"{_FSDP}::test_real_fsdp_shards_parameters_across_two_cpu_ranks",
    ("fsdp1", "CPU"): f"{_FSDP}::test_real_fsdp_shards_parameters_across_two_cpu_ranks",
    ("hsdp 2x2", "CPU"): f"{_MESH}::test_hsdp_trains_to_ddps_losses_and_records_its_mesh",
    ("tp 2", "CPU"): f"{_MESH}::test_tensor_parallel_trains_to_ddps_losses_and_records_its_mesh",
    ("fsdp 2 x tp 2", "CPU"): f"{_MESH}::test_tensor_parallel_trains_to_ddps_losses_and_records_its_mesh",
    ("zero1", "CPU"): f"{_DS}::test_stages_1_and_2_train_like_ddp",
    ("zero2", "CPU"): f"{_DS}::test_stages_1_and_2_train_like_ddp",
    ("zero3", "CPU"): f"{_DS}::test_zero3_is_real_deepspeed_and_shards_parameters",
    ("fsdp2", "GPU"): f"{_FSDP}::test_on_gpus_accelerates_own_fsdp_path_runs",
    ("zero3", "GPU"): f"{_DS}::test_on_gpus_accelerates_own_deepspeed_path_runs",
    ("ddp", "LoRA"): f"{_LORA}::test_checkpoints_hold_the_adapters_and_their_optimizer_state_alone",
    **{(row, "LoRA"): f"{_LORA}::test_lora_trains_to_ddps_losses" for row in ("fsdp2", "fsdp1", "zero2", "zero3")},
    ("ddp", "gradient checkpointing"): f"{_DDP}::test_gradient_checkpointing_gives_the_losses_of_the_run_without_it",
    ("fsdp2", "gradient checkpointing"): f"{_FSDP}::test_fsdp2_activation_checkpointing_gives_the_losses_of_the_run_without_it",
    ("fsdp1", "gradient checkpointing"): f"{_FSDP}::test_fsdp1_with_both_switches_checkpoints_each_layer_once",
    ("zero1", "gradient checkpointing"): f"{_DS}::test_zero1_and_zero2_gradient_checkpointing_train_like_ddp",
    ("zero2", "gradient checkpointing"): f"{_DS}::test_zero1_and_zero2_gradient_checkpointing_train_like_ddp",
    ("zero3", "gradient checkpointing"): f"{_DS}::test_zero3_gradient_checkpointing_gives_the_losses_of_the_run_without_it",
    ("ddp", "compile"): "tests/core/test_compile_runs.py::test_compiled_run_is_compiled_and_trains_to_eagers_losses",
    ("fsdp2", "compile"): "tests/core/test_compile_runs.py::test_compiled_run_is_compiled_and_trains_to_eagers_losses",
    ("ddp", "streaming"): "tests/data/test_streaming.py::test_a_streamed_run_resumes_with_the_same_losses_and_refuses_another_world_size",
    ("ddp", "adamw"): f"{_DDP}::test_run_is_real_ddp_on_two_cpu_ranks",
    ("fsdp2", "adamw"): f"{_FSDP}::test_real_fsdp_shards_parameters_across_two_cpu_ranks",
    ("fsdp1", "adamw"): f"{_FSDP}::test_real_fsdp_shards_parameters_across_two_cpu_ranks",
    ("zero3", "adamw"): f"{_DS}::test_zero3_is_real_deepspeed_and_shards_parameters",
    ("ddp", "sgd"): "tests/checkpoints/test_optimizer_resume.py::test_resume_continues_the_uninterrupted_run",
    ("fsdp2", "sgd"): "tests/checkpoints/test_optimizer_resume.py::test_resume_continues_the_uninterrupted_run",
    ("ddp", "adafactor"): "tests/checkpoints/test_optimizer_resume.py::test_resume_continues_the_uninterrupted_run",
    # the reference runs (tests/conftest.py reference_args) train with --mixed-precision no
    ("ddp", "fp32"): f"{_DDP}::test_run_is_real_ddp_on_two_cpu_ranks",
    ("fsdp2", "fp32"): f"{_FSDP}::test_losses_match_ddp_with_the_same_seed_and_data",
    ("fsdp1", "fp32"): f"{_FSDP}::test_losses_match_ddp_with_the_same_seed_and_data",
    ("zero3", "fp32"): f"{_DS}::test_zero3_losses_match_ddp",
    # the mesh runs and ZeRO-1's train fp32 with adamw (the default optimizer) to DDP's losses
    **{("hsdp 2x2", c): f"{_MESH}::test_hsdp_trains_to_ddps_losses_and_records_its_mesh" for c in ("fp32", "adamw")},
    **{(r, c): f"{_MESH}::test_tensor_parallel_trains_to_ddps_losses_and_records_its_mesh" for r in ("tp 2", "fsdp 2 x tp 2") for c in ("fp32", "adamw")},
    **{("zero1", c): f"{_DS}::test_stages_1_and_2_train_like_ddp" for c in ("fp32", "adamw")},
    # the zero2 preset trains steps 11-20 of FSDP2's fp32 run from its checkpoint, to its losses
    **{("zero2", c): "tests/checkpoints/test_portable_resume.py::test_resume_under_another_strategy_or_world_size_continues_its_run" for c in ("fp32", "adamw")},
    # the covering set of combined launches (tests/matrix/combinations.py): each trains its row
    # with several columns at once, and resumes exactly
    **{(c.row, column): f"{_CELLS}[{name}]" for name, c in COMBINATIONS.items() for column in c.columns},
}

#: (row, column) -> the device check's row that trains it on a lent GPU (bench/device/check.py
#: ROWS; at world size 1, bf16): evidence outside CI, for cells no CPU can train
DEVICE: dict[tuple[str, str], str] = {
    ("ddp", "GPU"): "ddp",
}

#: columns only a GPU machine can train (the rest train on CPU processes over gloo): a CUDA
#: device itself, fp16 (a CPU run refuses it: "fp16 mixed precision needs a GPU"), and
#: bitsandbytes' 8-bit optimizer (bitsandbytes' CUDA kernels)
GPU_COLUMNS = ("GPU", "fp16", "adamw_8bit")


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


#: packages a GPU machine is described as having (`pip install acc-train-core[bnb]`), so the page
#: does not depend on what the machine generating it has installed
GPU_PACKAGES = ("bitsandbytes",)


@contextlib.contextmanager
def _gpu_packages(device_type: str) -> Iterator[None]:
    """On the described GPU machine, GPU_PACKAGES count as installed for the optimizer's check
    (only there: other libraries import what find_spec says is present)."""
    if device_type != "cuda":
        yield
        return
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any, **kwargs: Any) -> Any:
        return real(name, *args, **kwargs) or (object() if name in GPU_PACKAGES else None)

    with unittest.mock.patch.object(importlib.util, "find_spec", find_spec):
        yield


def preflight(overrides: dict[str, Any], strategy: dict[str, Any], processes: int, device_type: str) -> str | None:
    """None when the checks ``acc-train`` makes before launch accept the job on ``processes``
    processes of a ``device_type`` machine; else the refusal's message (as the user reads it)."""
    from acc_train.config.optimizer import check_optimizer
    from acc_train.config.resolve import load_job
    from acc_train.errors import UserError
    from acc_train.model.build import check_attn_implementation, check_model_builds
    from acc_train.strategy import Machine

    base = _merge({"strategy": strategy, "launch": {"num_processes": processes}}, overrides)
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # warnings are not refusals
            job = load_job(base=base)
            cfg = job.config
            machine = Machine(device_type, processes, 1)
            check_attn_implementation(cfg.model, device_type)
            job.strategy = job.strategy.bind(machine)  # as acc-train binds the launch's machine before its checks
            job.strategy.check_environment()
            job.strategy.check_job(cfg)
            check_model_builds(cfg, job.strategy)
            with _gpu_packages(device_type):
                check_optimizer(job, machine)
    except UserError as exc:
        return str(exc)
    except ValueError as exc:  # a rule of the schema (pydantic), as `acc-train` prints it
        return str(exc)
    return None


Cell = tuple[str, str]  # (refused | tested | accepted, the message or the test)


def _one_line(message: str) -> str:
    text, _, hint = message.partition("\n  hint: ")
    text = " ".join(text.split()) + (f" (hint: {' '.join(hint.split())})" if hint else "")
    return re.sub(r"\s*\(valid keys here:.*?\)", "", text)


def cells() -> dict[tuple[str, str], Cell]:
    out: dict[tuple[str, str], Cell] = {}
    for row, (strategy, processes) in ROWS.items():
        for column, (overrides, device) in COLUMNS.items():
            message = preflight(overrides, strategy, processes, device)
            test, device_row = TESTED.get((row, column)), DEVICE.get((row, column))
            if message is not None and (test or device_row) is not None:
                raise AssertionError(f"{row} x {column} is refused, yet {test or device_row} trains it: {message}")
            if message is not None:
                out[row, column] = ("refused", _one_line(message))
            elif test:
                out[row, column] = ("tested", test)
            elif device_row:
                out[row, column] = ("device", f"the device check's row {device_row!r} (bench/device/check.py) trains it on a lent GPU; no CI test")
            else:
                out[row, column] = ("accepted", "accepted before launch; no test runs it")
    return out


SYMBOLS = {"refused": "✗", "tested": "✓", "device": "◐", "accepted": "○"}


def untrained_cpu_cells(table: dict[tuple[str, str], Cell]) -> list[tuple[str, str]]:
    """Accepted cells that a CPU machine could train (the row runs on CPU, the column is not a
    GPU's) and no test trains."""
    cpu_rows = [row for row in ROWS if table[row, "CPU"][0] != "refused"]
    return [(r, c) for r in cpu_rows for c in COLUMNS if c not in GPU_COLUMNS and table[r, c][0] == "accepted"]


def _mark(cell: Cell) -> str:
    kind, detail = cell
    title = html.escape(detail, quote=True).replace("|", "&#124;")
    return f'<span class="mx-{kind}" title="{title}">{SYMBOLS[kind]}</span>'


def render() -> str:
    table = cells()
    lines = [
        "---",
        "hide:",
        "  - navigation",
        "  - toc",
        "---",
        "",
        "# Support matrix",
        "",
        "<!-- generated by docs/_gen/matrix.py: do not edit; tests/core/test_docs_site.py checks it -->",
        "",
        "What `acc-train`'s own checks before launch say about a tiny job (the demo model) under each",
        "strategy with each feature: **✓** accepted, and the named test trains it; **◐** accepted, and",
        "only the [device check](#device-check) trains it, on a lent GPU; **○** accepted, but nothing",
        "trains it (it needs a GPU, or several); **✗** refused before anything starts (exit 2), with the",
        "message [below](#refusals). Hover a mark for its message or test.",
        "",
        "Feature columns describe a machine with CUDA GPUs (4 processes; 2 for `tp 2` and `cp 2`); the",
        "CPU column is the same job on a machine without one. `hsdp 2x2`, `tp 2`, `fsdp 2 x tp 2` and",
        "`cp 2` are the `fsdp` strategy's mesh options (`dp_replicate`, `dp_shard`, `tp`, `cp`). Tests",
        "train on CPU processes over gloo, except the GPU column's, which are marked `gpu` and run only",
        "where a CUDA GPU is present. The GPU machine is described with `bitsandbytes` installed",
        "(`pip install acc-train-core[bnb]`; without it, `adamw_8bit` is refused everywhere).",
        "Every accepted cell a CPU can train (rows that run on CPU; all but the GPU, fp16 and",
        "adamw_8bit columns) is trained by a test: most by one of the combined launches of",
        "`tests/matrix/test_cells.py`, each a row with several columns at once (a precision, an",
        "optimizer, LoRA, gradient checkpointing, compile, streaming), which checks that each took",
        "effect, that the loss falls and that a resume from its middle checkpoint is exact.",
        "The page is regenerated by `python -m hatch run docs:matrix`.",
        "",
        '<div class="matrix" markdown>',
        "",
        "| strategy | " + " | ".join(COLUMNS) + " |",
        "|---|" + ":-:|" * len(COLUMNS),
    ]
    for row in ROWS:
        lines.append(f"| **{row}** | " + " | ".join(_mark(table[row, c]) for c in COLUMNS) + " |")
    lines += ["", "</div>", "", "## Refusals", ""]
    lines += [f"- **{r}** with **{c}**: {d}" for (r, c), (k, d) in table.items() if k == "refused"]
    lines += ["", "## Tests", ""]
    lines += [f"- **{r}** with **{c}**: `{d}`" for (r, c), (k, d) in table.items() if k == "tested"]
    lines += ["", "## Device check", ""]
    lines += [
        "`python bench/device/check.py` on a lent GPU (see `bench/device/README.md`) trains these cells,",
        "and runs the suite's `gpu`-marked tests (the GPU column's tests above); its results are in",
        "BENCHMARKS.md.",
        "",
    ]
    lines += [f"- **{r}** with **{c}**: {d}" for (r, c), (k, d) in table.items() if k == "device"]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(render())
    print(f"wrote {PAGE.relative_to(ROOT)}")
