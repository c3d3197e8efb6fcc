"""ft-ddp through a lost group: two replica groups of one process and a lighthouse on localhost.

One scenario, launched once: group 1 is killed between steps (SIGKILL after step 8, through core's
fault point); group 0 keeps stepping alone; group 1 is started again with the same command, takes
its output directory over and heals from group 0; that launch is killed inside the backward of
step 27 (group 0's all-reduce fails: its step is discarded and trained again); the third launch
heals again; both groups end with the same parameters.
While group 0 is alone a test plugin slows its steps, so that the relaunch (10-20 s of start-up on
a busy 2-core machine) finds it still training.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import read_metrics, tiny_job_args

torchft = pytest.importorskip("torchft")

pytestmark = [pytest.mark.launch, pytest.mark.xdist_group("ft-ddp")]

STEPS = 50
KILLED_AT = 8
KILLED_IN_ALLREDUCE = 26
HEARTBEAT_TIMEOUT_S = 2.0

#: a plugin of the test. While group 0 trains alone, from step 20 it waits for the relaunched group
#: 1 to be up (its Manager listening: the test then adds a line to the gate file, one per relaunch),
#: and slows its steps a little, so that it is still training when group 1 asks to join (ft-ddp's
#: step_end hook has put the quorum's group count into the step's metrics first). With
#: FT_TEST_KILL_IN_BACKWARD=N, the group SIGKILLs itself inside the backward of step N + 1, where
#: its peer is in (or about to start) the gradient all-reduce.
SLOW_PLUGIN = """
import os, signal, time
from pathlib import Path
from acc_train.api import hookimpl

ALONE = [0, False]

@hookimpl
def acc_train_train_start(run):
    kill_after = int(os.environ.get("FT_TEST_KILL_IN_BACKWARD", "0"))
    if kill_after:
        def die(param):
            if run.step >= kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
        next(run.model.parameters()).register_post_accumulate_grad_hook(die)

@hookimpl(trylast=True)
def acc_train_step_end(run, step, metrics):
    alone = metrics.get("replica_groups", 2) < 2
    if alone and not ALONE[1]:
        ALONE[0] += 1
    ALONE[1] = alone
    if alone:
        gate = Path(os.environ["FT_TEST_GATE"])
        while step >= 20 and (len(gate.read_text().splitlines()) if gate.exists() else 0) < ALONE[0]:
            time.sleep(0.1)
        time.sleep(0.3)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def lighthouse() -> str:
    """``acc-train lighthouse`` on a free port, as a user starts it; its first line names it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "acc_train_cli", "lighthouse", "--port", "0", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        first = proc.stdout.readline()
        assert first.startswith("lighthouse listening on "), first
        yield f"localhost:{first.split()[-1].rsplit(':', 1)[1]}"
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


@pytest.fixture(scope="module")
def failure_runs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, tiny_data: dict[str, Path], lighthouse: str) -> dict[str, object]:
    root = tmp_path_factory.mktemp("ft-ddp")
    plugin_dir = root / "plugins"
    (plugin_dir / "acc_train_ft_test_slow-0.0.0.dist-info").mkdir(parents=True)
    (plugin_dir / "acc_train_ft_test_slow-0.0.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: acc-train-ft-test-slow\nVersion: 0.0.0\n")
    (plugin_dir / "acc_train_ft_test_slow-0.0.0.dist-info" / "entry_points.txt").write_text("[acc_train]\nft-test-slow = acc_train_ft_test_slow\n")
    (plugin_dir / "acc_train_ft_test_slow.py").write_text(SLOW_PLUGIN)
    gate = root / "group-1-relaunched"
    env = {**os.environ, "FT_TEST_GATE": str(gate), "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([str(plugin_dir), *filter(None, [os.environ.get("PYTHONPATH")])])}
    ports = [_free_port(), _free_port()]

    def command(group: int) -> list[str]:
        return [
            sys.executable, "-m", "acc_train_cli", "--strategy", "ft-ddp", "--num-processes", "1",
            *tiny_job_args(tiny_model_dir, tiny_data, root / f"group-{group}"),
            "--max-steps", str(STEPS), "--set", "checkpoint.every=20", "--set", "training.eval_every=0",
            "--set", f"launch.main_process_port={ports[group]}",
            "--set", f"strategy.replica_group={group}", "--set", "strategy.num_groups=2", "--set", f"strategy.lighthouse={lighthouse}",
        ]  # fmt: skip

    def start(group: int, **extra: str) -> subprocess.Popen[str]:
        log = open(root / f"group-{group}-{len(list(root.glob(f'group-{group}-*.log')))}.log", "w")  # noqa: SIM115 - closed with the process
        return subprocess.Popen(command(group), env={**env, **extra}, stdout=log, stderr=subprocess.STDOUT, text=True)

    def relaunch(**extra: str) -> subprocess.Popen[str]:
        """Group 1 again, the same command; the gate opens once its Manager listens."""
        attempt = len(list(root.glob("group-1-*.log")))
        proc = start(1, **extra)
        log, began = root / f"group-1-{attempt}.log", time.time()
        while proc.poll() is None and "Manager listening" not in log.read_text() and time.time() - began < 300:
            time.sleep(0.2)
        with gate.open("a") as f:
            f.write(f"relaunch {attempt}\n")
        return proc

    survivor = start(0)
    doomed = start(1, ACC_TRAIN_FAULT=f"train-step@{KILLED_AT}")  # between steps
    killed_rc = doomed.wait(timeout=300)
    relaunched_at = time.time()
    doomed_again = relaunch(FT_TEST_KILL_IN_BACKWARD=str(KILLED_IN_ALLREDUCE))  # inside the gradient all-reduce
    killed_again_rc = doomed_again.wait(timeout=300)
    rejoined = relaunch()
    rcs = [survivor.wait(timeout=300), rejoined.wait(timeout=300)]
    logs = {p.name: p.read_text() for p in root.glob("group-*.log")}
    assert rcs == [0, 0], f"exit codes {rcs}:\n" + "\n".join(f"--- {n}\n{t[-3000:]}" for n, t in logs.items())
    return {"root": root, "killed_rc": killed_rc, "killed_again_rc": killed_again_rc, "relaunched_at": relaunched_at, "logs": logs}


def _summary(run: Path) -> dict:
    return json.loads((run / "run.json").read_text())


def test_survivor_trains_through_the_lost_group_and_the_relaunch_heals(failure_runs: dict) -> None:
    root = failure_runs["root"]
    assert failure_runs["killed_rc"] != 0 and failure_runs["killed_again_rc"] != 0  # both earlier group 1s died
    survivor, healed = _summary(root / "group-0"), _summary(root / "group-1")
    assert survivor["steps"] == healed["steps"] == STEPS
    events = survivor["ft_events"]
    # killed between steps: the survivor lost group 1, stalled about the heartbeat timeout, stepped on alone
    lost = [e for e in events if e["kind"] == "lost"]
    assert [e["group"] for e in lost] == [1, 1] and KILLED_AT <= lost[0]["step"] <= KILLED_AT + 1
    assert lost[0]["seconds"] < HEARTBEAT_TIMEOUT_S + 5  # (the goal, heartbeat + 1 s, is bench_ft.py's: this machine is shared)
    rows = read_metrics(root / "group-0")
    assert sorted(rows) == list(range(1, STEPS + 1))  # every step once: a discarded step is trained again, not logged twice
    alone = [s for s, row in rows.items() if row.get("replica_groups") == 1]
    assert len(alone) >= 3 and min(alone) > KILLED_AT
    joined = [e for e in events if e["kind"] == "joined"]
    assert [e["group"] for e in joined] == [1, 1]
    # the relaunches took the output directory over and healed from group 0 at the step it had reached
    heals = [e for e in healed["ft_events"] if e["kind"] == "healed"]
    assert heals and heals[-1]["step"] == joined[-1]["step"] and heals[-1]["seconds"] < 10
    assert sorted(read_metrics(root / "group-1"))[0] > KILLED_IN_ALLREDUCE  # the last launch's rows start after its heal
    # killed inside the all-reduce: the survivor's step was discarded (not counted), then trained again
    discarded = [e for e in events if e["kind"] == "discarded"]
    assert [e["step"] for e in discarded] == [KILLED_IN_ALLREDUCE + 1] and survivor["ft_discarded_steps"] == 1
    assert lost[1]["step"] == KILLED_IN_ALLREDUCE
    # the same model on both groups at the end, and every row after the last heal counts both groups
    assert survivor["per_rank"][0]["param_checksum"] == healed["per_rank"][0]["param_checksum"]
    assert all(row.get("replica_groups") == 2 for s, row in rows.items() if s > joined[-1]["step"])
