"""Property tests: arbitrary JSON and arbitrary bytes in every file acc-train reads that a user
(or a crash) may have changed, ``metrics.jsonl``, ``run.json``, ``config.yaml``, data files, a
checkpoint's ``manifest.json``, and the ``ACC_TRAIN_FAULT`` value, are accepted or refused with a
``UserError``; never another exception.

Mostly in-process (the readers themselves), a few through the CLI (``assert_handled``: exit 0 or
2, no traceback). Hypothesis runs derandomized with no example database (the ``PROFILE`` below),
so CI sees the same examples on every run and nothing is written outside the test's own files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from acc_train.checkpoint import verify_checkpoint
from acc_train.checkpoint.faults import FAULT_POINTS, Fault, parse_fault
from acc_train.config import DataConfig
from acc_train.data import check_data_files
from acc_train.errors import UserError
from acc_train.outputs.metrics import ROW_FIELDS, read_metrics
from acc_train.outputs.report import format_summary, read_configured_strategy, read_run, summary_rows
from tests.bad_input.harness import assert_handled, run_acc_train

#: deterministic in CI: the same examples every run, no database, no timing-based deadline
PROFILE = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
FEW = settings(PROFILE, max_examples=4)

json_scalars = st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats() | st.text(max_size=12)
json_values = st.recursive(
    json_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12
)
#: ``{task: {metric: value}}`` (eval.harness_tasks' scores), or something near it at any depth
harness_like = st.dictionaries(
    st.sampled_from(["t", "u"]), st.dictionaries(st.sampled_from(["acc", "acc_stderr"]), json_scalars, max_size=2) | json_values, max_size=2
)
#: objects that look like rows: known field names with values of any type, and extras
row_like = st.dictionaries(st.sampled_from(ROW_FIELDS) | st.text(max_size=6), json_values, max_size=9) | st.fixed_dictionaries(
    {"step": st.integers(0, 3), "harness": harness_like}
)
summary_like = st.dictionaries(
    st.sampled_from(["strategy", "distributed_type", "world_size", "steps", "start_step", "tokens_per_s", "final_loss", "elapsed_s", "mfu", "harness_step"]),
    json_values,
    max_size=8,
) | st.fixed_dictionaries(
    {
        "harness": harness_like,
        "mfu": json_scalars,
        "mfu_basis": st.dictionaries(st.sampled_from(["peak_flops", "flops_per_token", "precision"]), json_scalars, max_size=3) | json_values,
    }
)
some_bytes = st.binary(max_size=300)


def accepted_or_refused(call, *args):  # type: ignore[no-untyped-def]
    """Run a reader: its result, or None when it refused with a UserError (anything else fails)."""
    try:
        return call(*args)
    except UserError as exc:
        assert str(exc).strip(), "a UserError without a message"
        return None


def _run_dir(tmp: Path, metrics: bytes, run_json: bytes | None = None, config: bytes | None = None) -> Path:
    run = tmp / "run"
    run.mkdir(exist_ok=True)
    for name, content in (("metrics.jsonl", metrics), ("run.json", run_json), ("config.yaml", config)):
        path = run / name
        if content is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(content)
    return run


def _report(run: Path) -> None:
    """What `acc-train report` does with a run's files, and what a tracker is handed of each row."""
    record = read_run(run)
    format_summary(record)
    summary_rows(record)
    for row in record.steps + record.evals:
        assert all(isinstance(v, (int, float)) for v in row.numbers().values()), row


# --- metrics.jsonl, run.json and config.yaml, as `acc-train report` reads them -------------------
@PROFILE
@given(rows=st.lists(row_like | json_values, max_size=6), summary=summary_like | json_values)
def test_report_reads_arbitrary_json_rows_and_summaries(rows: list, summary: object, tmp_path: Path) -> None:
    metrics = "".join(json.dumps(r) + "\n" for r in rows).encode()
    accepted_or_refused(_report, _run_dir(tmp_path, metrics, json.dumps(summary).encode()))


@PROFILE
@given(metrics=some_bytes, run_json=st.none() | some_bytes, config=st.none() | some_bytes)
def test_report_reads_arbitrary_bytes(metrics: bytes, run_json: bytes | None, config: bytes | None, tmp_path: Path) -> None:
    accepted_or_refused(_report, _run_dir(tmp_path, metrics, run_json, config))


@PROFILE
@given(text=st.text(max_size=200))
def test_run_config_reads_arbitrary_text(text: str, tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text, encoding="utf-8")
    name = accepted_or_refused(read_configured_strategy, path)
    assert name is None or isinstance(name, str)


@settings(PROFILE, max_examples=60)
@given(rows=st.lists(row_like, min_size=1, max_size=5), cut=st.integers(min_value=1, max_value=40))
def test_a_last_line_cut_short_is_skipped(rows: list, cut: int, tmp_path: Path) -> None:
    """A crash mid-write leaves a last line without its newline: the lines before it read as
    they would without it."""
    lines = [json.dumps(r) for r in rows]
    whole = tmp_path / "whole.jsonl"
    whole.write_text("".join(line + "\n" for line in lines[:-1]))
    cut_short = tmp_path / "cut.jsonl"
    cut_short.write_text(whole.read_text() + lines[-1][: min(cut, len(lines[-1]) - 1)])
    before = accepted_or_refused(read_metrics, whole)
    if before is not None:
        assert accepted_or_refused(read_metrics, cut_short) == before


@settings(PROFILE, max_examples=6)
@given(rows=st.lists(st.fixed_dictionaries({"step": st.integers(-(2**40), 2**40), "loss": st.floats(), "lr": st.floats(), "tokens_per_s": st.floats()}), min_size=1, max_size=5))
def test_report_png_draws_or_refuses_any_numbers(rows: list, tmp_path: Path) -> None:
    """The plot of any numbers a metrics file may hold (inf, nan, 1e308) is drawn or refused,
    and a refused drawing leaves no file behind."""
    from acc_train.outputs.plot import draw_report

    run = _run_dir(tmp_path, "".join(json.dumps(r) + "\n" for r in rows).encode())
    record = read_run(run)
    if accepted_or_refused(draw_report, record) is None:
        assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]


# --- data files, as checked before launch ---------------------------------------------------------
@PROFILE
@given(content=some_bytes | st.lists(row_like | json_values, max_size=5).map(lambda rs: "".join(json.dumps(r) + "\n" for r in rs).encode()), suffix=st.sampled_from([".jsonl", ".json", ".txt", ".parquet"]))
def test_data_files_are_accepted_or_refused(content: bytes, suffix: str, tmp_path: Path) -> None:
    path = tmp_path / f"data{suffix}"
    path.write_bytes(content)
    accepted_or_refused(check_data_files, DataConfig(train_files=[str(path)]))


# --- ACC_TRAIN_FAULT -------------------------------------------------------------------------------
@PROFILE
@given(value=st.text(max_size=30) | st.builds(lambda p, s, r: p + s + r, st.sampled_from(FAULT_POINTS), st.sampled_from(["", "@", "@1", "@x", "@-1"]), st.sampled_from(["", ":", ":0", ":r"])))
def test_fault_values_are_parsed_or_refused(value: str) -> None:
    fault = accepted_or_refused(parse_fault, value)
    if fault is not None:
        assert isinstance(fault, Fault) and fault.point in FAULT_POINTS


# --- a checkpoint's manifest.json (its structure is being rewritten on another branch) -----------
@PROFILE
@given(manifest=json_values | st.fixed_dictionaries({"files": json_values}) | st.fixed_dictionaries({"files": st.dictionaries(st.sampled_from(["model.safetensors", "x"]), json_values, max_size=2)}))
def test_arbitrary_manifests_verify_or_are_refused(manifest: object, tmp_path: Path) -> None:
    ckpt = tmp_path / "step-000001"
    ckpt.mkdir(exist_ok=True)
    (ckpt / "model.safetensors").write_bytes(b"weights")
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    accepted_or_refused(verify_checkpoint, ckpt)


@PROFILE
@given(content=some_bytes)
def test_manifest_bytes_verify_or_are_refused(content: bytes, tmp_path: Path) -> None:
    ckpt = tmp_path / "step-000001"
    ckpt.mkdir(exist_ok=True)
    (ckpt / "manifest.json").write_bytes(content)
    accepted_or_refused(verify_checkpoint, ckpt)


# --- a few through the CLI, as a user meets them ---------------------------------------------------
@FEW
@given(metrics=some_bytes | st.lists(row_like, max_size=4).map(lambda rs: "".join(json.dumps(r) + "\n" for r in rs).encode()), run_json=st.none() | some_bytes)
def test_report_command_on_arbitrary_files(metrics: bytes, run_json: bytes | None, tmp_path: Path) -> None:
    run = _run_dir(tmp_path, metrics, run_json)
    assert_handled(run_acc_train(["report", "--no-png", str(run)], tmp_path), f"metrics {metrics[:200]!r}, run.json {run_json!r}")


@FEW
@given(content=some_bytes | json_values.map(lambda v: json.dumps(v).encode()))
def test_checkpoint_inspect_command_on_arbitrary_manifests(content: bytes, tmp_path: Path) -> None:
    ckpt = tmp_path / "step-000001"
    ckpt.mkdir(exist_ok=True)
    (ckpt / "manifest.json").write_bytes(content)
    assert_handled(run_acc_train(["checkpoint", "inspect", str(ckpt)], tmp_path), f"manifest {content[:200]!r}")


@pytest.mark.parametrize("value", ["", "train-step", "save-before-manifest@10:1"])
def test_valid_fault_values_parse(value: str) -> None:
    """The values the crash-safety tests use keep working (an empty value means no fault)."""
    if value:
        assert parse_fault(value).point in FAULT_POINTS
