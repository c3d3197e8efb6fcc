"""``acc-train launch`` for a user's own script, multi-node rendezvous, and failing workers."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.launch

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from acc_train import Accelerator

    acc = Accelerator()
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    loss = model(torch.ones(3, 4, device=acc.device)).sum()
    acc.backward(loss)
    opt.step()
    if os.environ.get("FAIL_ON_RANK") == str(acc.process_index):
        raise ValueError("boom on purpose")
    info = {"rank": acc.process_index, "world": acc.num_processes, "type": str(acc.distributed_type),
            "strategy": acc.acc_strategy.name, "args": sys.argv[1:]}
    with open(os.path.join(os.environ["OUT_DIR"], f"rank{acc.process_index}.json"), "w") as f:
        json.dump(info, f)
    """
)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "user_script.py"
    path.write_text(SCRIPT)
    return path


def test_launch_runs_a_user_script_under_the_strategy(script: Path, tmp_path: Path) -> None:
    proc = run_cli("--strategy", "ddp", "launch", "--num-processes", "2", str(script), "--lr", "3", env={"OUT_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    infos = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert {i["world"] for i in infos} == {2}
    assert {i["type"] for i in infos} == {"DistributedType.MULTI_CPU"}
    assert {i["strategy"] for i in infos} == {"ddp"}
    assert infos[0]["args"] == ["--lr", "3"]  # the script's own arguments pass through untouched


def test_a_crash_exits_nonzero_and_names_the_failing_rank_first(script: Path, tmp_path: Path) -> None:
    proc = run_cli("launch", "--num-processes", "2", str(script), env={"OUT_DIR": str(tmp_path), "FAIL_ON_RANK": "1"})
    assert proc.returncode != 0
    report = proc.stderr[proc.stderr.index("error: training failed") :]
    assert report.splitlines()[1].startswith("rank 1 failed first")
    assert "boom on purpose" in report


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_machines_of_one_process_rendezvous_to_world_size_2(script: Path, tmp_path: Path) -> None:
    port = str(_free_port())
    common = ["--num-machines", "2", "--num-processes", "1", "--main-process-ip", "127.0.0.1", "--main-process-port", port]
    env = {"OUT_DIR": str(tmp_path)}
    import os

    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "acc_train_cli", *common, "--machine-rank", str(rank), "launch", str(script)],
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    infos = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [i["world"] for i in infos] == [2, 2]
    assert {i["type"] for i in infos} == {"DistributedType.MULTI_CPU"}
