"""``acc_train.outputs.metrics``: the one reader of ``metrics.jsonl`` and what a row of it is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from acc_train.outputs.metrics import MetricsRow, read_metrics


def test_rows_are_told_apart_once_and_keep_what_plugins_added(tmp_path: Path) -> None:
    lines = [
        {"step": 1, "epoch": 0, "loss": 2.0, "lr": 1e-3, "grad_norm": None, "tokens": 64, "tokens_per_s": 10.0, "elapsed_s": 1.0, "perplexity": 7.4},
        {"step": 1, "eval_loss": 2.5},
        {"step": 2, "epoch": 0, "loss": 1.5, "lr": 1e-3, "grad_norm": 0.5, "tokens": 128, "tokens_per_s": 11.0, "elapsed_s": 2.0},
        {"loss": 9.0},  # no step: not a row
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 3, "lo')  # cut short
    metrics = read_metrics(tmp_path)
    assert sorted(metrics.steps) == [1, 2] and [r.step for r in metrics.training] == [1, 2]
    assert [(r.step, r.eval_loss) for r in metrics.evals] == [(1, 2.5)]
    first = metrics.steps[1]
    assert first.is_training and not first.is_eval and first.extra == {"perplexity": 7.4}
    # it reads like the JSON line it was written as, and writes back the same line
    assert first["perplexity"] == 7.4 and set(first) >= {"step", "loss", "lr", "grad_norm", "tokens", "elapsed_s", "tokens_per_s"}
    assert first.to_dict() == lines[0] and metrics.evals[0].to_dict() == lines[1]
    with pytest.raises(KeyError):
        metrics.evals[0]["loss"]


def test_a_row_from_the_loops_dict_round_trips() -> None:
    metrics = {"step": 4, "epoch": 1}  # a step that is not logged
    row = MetricsRow.from_dict(metrics)
    assert not row.is_training and not row.is_eval and row.to_dict() == metrics
