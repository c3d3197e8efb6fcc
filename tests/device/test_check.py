"""The device check (``bench/device/check.py``) rehearsed on CPU: the rows a lent H200 session
runs, here with the tiny model, so the script is tested before the minutes that count."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
CHECK = ROOT / "bench" / "device" / "check.py"
CORE_ROWS = ["ddp", "fsdp", "zero3", "handwritten"]
#: the rehearsal's rows: the core ones and, last as in ROWS, plan --simulate beside fsdp's and zero3's peaks
REHEARSED_ROWS = [*CORE_ROWS, "simulate"]


def load_check():
    spec = importlib.util.spec_from_file_location("device_check", CHECK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def has_mfu_module() -> bool:
    return importlib.util.find_spec("acc_train.outputs.mfu") is not None


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One rehearsal of the four rows every lent session must bring back, and the simulate row
    that reads two of them."""
    out = tmp_path_factory.mktemp("device-check")
    env = dict(os.environ)  # TORCH_EXTENSIONS_DIR: the machine's, shared (conftest)
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(CHECK), "--rehearse", "--out", str(out), "--rows", ",".join(REHEARSED_ROWS)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    return {"proc": proc, "out": out, "results": results, "rows": {r["name"]: r for r in results["rows"]}, "seconds": time.monotonic() - t0}


def row_errors(rehearsal: dict) -> str:
    """Each failed row's error in full, then the end of the check's log: an assertion's message as a
    string, which pytest prints whole (another object it shortens to a line)."""
    errors = "\n".join(f"{name}: {row.get('error')}" for name, row in rehearsal["rows"].items() if row.get("error"))
    return f"row errors:\n{errors or '(none)'}\n--- check.log's end ---\n{log_tail(rehearsal)}"


def log_tail(rehearsal: dict, chars: int = 4000) -> str:
    """The end of the check's combined log (each row's commands and output): what a failed row printed."""
    log = rehearsal["out"] / "check.log"
    return log.read_text(errors="replace")[-chars:] if log.is_file() else rehearsal["proc"].stdout[-chars:]


@pytest.mark.launch
@pytest.mark.xdist_group("device-check")  # one worker shares the rehearsal
def test_the_rehearsal_writes_every_row_and_its_files(rehearsal: dict) -> None:
    assert [r["name"] for r in rehearsal["results"]["rows"]] == REHEARSED_ROWS
    assert rehearsal["results"]["rehearse"] is True
    for name in ("results.json", "results.md", "check.log"):
        assert (rehearsal["out"] / name).is_file(), name
    md = (rehearsal["out"] / "results.md").read_text()
    assert all(f"\n{name} | " in md for name in CORE_ROWS)
    assert "ddp against the hand-written loop" in md, f"{md}\n{row_errors(rehearsal)}"


@pytest.mark.launch
@pytest.mark.xdist_group("device-check")  # one worker shares the rehearsal
def test_every_row_trains_and_reports_throughput_memory_and_loss(rehearsal: dict) -> None:
    rows = rehearsal["rows"]
    for name in ("ddp", "fsdp", "zero3"):
        assert rows[name]["error"] is None, f"{name}: {row_errors(rehearsal)}"
        assert rows[name]["device"] == "cpu"
        assert rows[name]["plan_bytes"] > 0  # acc-train plan's estimate for the same job, beside the run
    for name in CORE_ROWS:
        row = rows[name]
        assert row["error"] is None, f"{name}: {row_errors(rehearsal)}"
        assert row["tokens_per_s"] > 0 and row["peak_memory_bytes"] > 0 and row["seconds"] > 0, name
        assert row["step_time_s"] > 0, name
    distributed = {name: rows[name]["distributed_type"] for name in ("ddp", "fsdp", "zero3")}
    assert distributed == {"ddp": "DistributedType.MULTI_CPU", "fsdp": "DistributedType.FSDP", "zero3": "DistributedType.DEEPSPEED"}


@pytest.mark.launch
@pytest.mark.xdist_group("device-check")  # one worker shares the rehearsal
def test_the_rows_train_the_same_job(rehearsal: dict) -> None:
    """Same model, seed, batches and schedule: acc-train under each strategy and the hand-written
    loop end at the same loss (fp32, one process)."""
    losses = {name: rehearsal["rows"][name]["loss"] for name in CORE_ROWS}
    assert all(isinstance(v, float) for v in losses.values()), f"{losses}\n{row_errors(rehearsal)}"
    assert max(losses.values()) - min(losses.values()) < 1e-3, losses


@pytest.mark.launch
@pytest.mark.xdist_group("device-check")  # one worker shares the rehearsal
def test_mfu_is_reported_or_its_absence_is_the_rows_error(rehearsal: dict) -> None:
    """With acc_train.outputs.mfu (issue 26's item 1) every row has an MFU in (0, 1); without it the
    hand-written row says so in its error (and keeps its other figures), and the check fails."""
    rows, proc = rehearsal["rows"], rehearsal["proc"]
    if has_mfu_module():
        for name in CORE_ROWS:
            assert rows[name]["error"] is None, f"{name}: {row_errors(rehearsal)}"
            assert 0 < rows[name]["mfu"] < 1, (name, rows[name])
        assert proc.returncode == 0, proc.stdout[-3000:]
    else:
        assert "acc_train.outputs.mfu" in rows["handwritten"]["error"]
        assert rows["handwritten"]["mfu"] is None
        assert proc.returncode == 1, proc.stdout[-3000:]


@pytest.mark.launch
@pytest.mark.xdist_group("device-check")  # one worker shares the rehearsal
def test_the_simulation_sits_beside_each_measured_peak(rehearsal: dict) -> None:
    """plan --simulate for the check's job, fsdp2 and zero3, beside the fsdp and zero3 rows' peaks:
    on CPU the measured side is the process's RSS, reported without a ratio."""
    row = rehearsal["rows"]["simulate"]
    assert row["error"] is None, row_errors(rehearsal)
    found = row["simulation"]
    assert list(found) == ["fsdp2", "zero3"]
    for label, trained in (("fsdp2", "fsdp"), ("zero3", "zero3")):
        entry = found[label]
        assert entry["row"] == trained
        assert entry["simulated_peak_bytes"] > 0 and entry["plan_bytes"] > 0, entry
        assert "world size 1" in entry["how"], entry
        assert entry["measured_peak_bytes"] == rehearsal["rows"][trained]["peak_memory_bytes"], entry
        assert "RSS" in entry["measured"] and "simulated_vs_measured" not in entry, entry
    md = (rehearsal["out"] / "results.md").read_text()
    assert "plan --simulate (CPU, fake tensors)" in md and "\nfsdp2 (fsdp row) | " in md and "\nzero3 (zero3 row) | " in md, md


# --- the runner itself, no launches -------------------------------------------------------------------


def test_a_failing_or_overrunning_row_loses_nothing_else(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    check = load_check()

    def fails(c, timeout):
        raise check.RowFailed("boom")

    def hangs(c, timeout):
        c.run([sys.executable, "-c", "import time\ndef waiting_for_nothing():\n    time.sleep(60)\nprint('about to wait', flush=True)\nwaiting_for_nothing()"], 2)

    def buggy(c, timeout):
        return {}["missing"]

    def works(c, timeout):
        return {"tokens_per_s": 123.0, "loss": 1.5}

    rows = tuple(check.Row(n, 5, fn, n) for n, fn in (("fails", fails), ("hangs", hangs), ("buggy", buggy), ("works", works)))
    monkeypatch.setattr(check, "ROWS", rows)
    monkeypatch.setattr(check, "environment_report", lambda env: {"python": "test"})
    t0 = time.monotonic()
    assert check.main(["--rehearse", "--out", str(tmp_path), "--budget", "60"]) == 1
    assert time.monotonic() - t0 < 30
    got = {r["name"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    assert got["fails"]["error"] == "boom"
    assert got["hangs"]["error"].startswith("timed out after")
    # where it hung, in the row's own error: the innermost frame and the last line it printed
    assert "waiting_for_nothing" in got["hangs"]["error"] and "about to wait" in got["hangs"]["error"], got["hangs"]["error"]
    assert got["buggy"]["error"].startswith("KeyError in the check")
    assert got["works"]["error"] is None and got["works"]["tokens_per_s"] == 123.0
    assert set(got["works"]) >= set(check.FIELDS)
    log = (tmp_path / "check.log").read_text()
    assert "===== row hangs" in log
    assert "in waiting_for_nothing" in log  # where the command hung: its Python stack, dumped before the kill


def test_rows_past_the_budget_are_recorded_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    check = load_check()
    ran = []
    rows = tuple(check.Row(n, 5, lambda c, t, n=n: ran.append(n) or {}, n) for n in ("first", "second"))
    monkeypatch.setattr(check, "ROWS", rows)
    monkeypatch.setattr(check, "environment_report", lambda env: {})
    check.main(["--rehearse", "--out", str(tmp_path), "--budget", "5", "--rows", "second"])
    got = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert ran == [] and [r["name"] for r in got] == ["second"]
    assert "budget" in got[0]["error"] and "--rows second" in got[0]["error"]


def test_an_unknown_row_is_refused_naming_the_rows(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(CHECK), "--rehearse", "--out", str(tmp_path), "--rows", "ddp,nope"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "unknown rows nope" in proc.stderr and "zero3-fused-adam" in proc.stderr


def test_the_rows_are_the_issues_in_priority_order() -> None:
    names = [r.name for r in load_check().ROWS]
    assert names[:5] == ["gpu-tests", "ddp", "fsdp", "zero3", "handwritten"]
    assert names[-1] == "simulate"  # last: it must not take the time of the rows before it
    assert set(names) == {"gpu-tests", *CORE_ROWS, "gc", "lora", "compile", "zero3-fused-adam", "trainer-fsdp", "trainer-zero3", "simulate"}


def _plan_output(entries: list[dict]) -> str:
    """What ``plan --simulate --json`` prints, stderr's progress line first (the check reads both together)."""
    return "simulating at world size 1...\n" + json.dumps({"rows": [], "strategies": entries}, indent=2) + "\n"


def test_the_simulate_row_compares_with_cuda_peaks_and_says_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No launches: the ratio where a training row measured CUDA's allocated peak; a training row
    absent is said, not failed; a strategy the simulation could not run is the row's error."""
    check = load_check()
    job = check.REHEARSAL_JOB
    c = check.Check(tmp_path, job, dict(os.environ), 60, True, tmp_path)
    c.results["fsdp"] = {"name": "fsdp", "device": "cuda", "peak_memory_bytes": 20 * 2**30, "error": None}
    printed = {
        "fsdp2": _plan_output([{"name": "fsdp2", "simulated": {"peak_bytes": 19 * 2**30, "how": "simulated: ..."}, "plan": {"device_total_bytes": 21 * 2**30}}]),
        "zero3": _plan_output([{"name": "zero3", "simulated": None, "how": "not simulated: rank 0 stopped", "plan": {"device_total_bytes": 2**30}}]),
    }
    commands = []

    def run(cmd, timeout, *, cwd=None, env=None):
        commands.append((cmd, env))
        label = cmd[cmd.index("--strategies") + 1]
        return subprocess.CompletedProcess(cmd, 0, printed[label], "")

    monkeypatch.setattr(c, "run", run)
    result = check.simulate_row(c, 60)
    fsdp2, zero3 = result["simulation"]["fsdp2"], result["simulation"]["zero3"]
    assert fsdp2["simulated_vs_measured"] == pytest.approx(19 / 20)
    assert "max_memory_allocated" in fsdp2["measured"] and fsdp2["plan_bytes"] == 21 * 2**30
    assert zero3["measured_peak_bytes"] is None and "did not run" in zero3["measured"]
    assert result["error"] == "zero3: not simulated: rank 0 stopped"
    # the job the fsdp and zero3 rows plan, with --json; the simulation sees no GPU
    for cmd, env in commands:
        assert cmd[-len(check.plan_args(job)) :] == check.plan_args(job) and "--json" in cmd
        assert env["CUDA_VISIBLE_DEVICES"] == ""
    md = "\n".join(check.simulation_markdown(result))
    assert "\nfsdp2 (fsdp row) | 19.00 GiB | 20.00 GiB | 0.950 | 21.00 GiB | torch.cuda.max_memory_allocated" in md
    assert "\nzero3 (zero3 row) |  |  |  | 1.00 GiB | none: the zero3 row did not run in this check | not simulated: rank 0 stopped" in md
