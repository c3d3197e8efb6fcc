"""Cluster launch (``acc_train.launch.cluster``): the launch section filled from Slurm's and torchrun's
variables, the job's own keys winning, errors naming the variable, docs/cluster.md's scripts, and
two faked "machines" on 127.0.0.1 under each environment training with a 2-process run's losses."""

from __future__ import annotations

import os
import random
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from acc_train.launch.cluster import SLURM_PORT_BASE, detect_cluster, slurm_port
from acc_train.errors import UserError
from click.testing import CliRunner

from acc_train_cli.main import cli
from tests.conftest import REFERENCE_STEPS, ROOT, assert_same_losses, read_metrics, tiny_job_args


SLURM = {
    "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "4", "SLURM_NODEID": "2",
    "SLURM_STEP_NODELIST": "node[01-03,07]", "SLURM_STEP_TASKS_PER_NODE": "1(x4)", "SLURM_GPUS_ON_NODE": "8",
}  # fmt: skip
TORCHRUN = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "4", "MASTER_ADDR": "trainer-0", "MASTER_PORT": "23456"}


def _error(env: dict[str, str]) -> UserError:
    with pytest.raises(UserError) as info:
        detect_cluster(env)
    return info.value


# ---- detection --------------------------------------------------------------------------------


def test_outside_a_cluster_nothing_is_detected() -> None:
    assert detect_cluster({}) is None
    assert detect_cluster({"MASTER_ADDR": "x", "MASTER_PORT": "1"}) is None  # no node count: not a launch


def test_slurm_fills_every_launch_key() -> None:
    found = detect_cluster(SLURM)
    assert found is not None and found.kind == "slurm"
    assert found.values == {
        "num_machines": 4, "machine_rank": 2, "main_process_ip": "node01",
        "main_process_port": SLURM_PORT_BASE + 4242, "num_processes": 8,
    }  # fmt: skip
    assert found.origins["machine_rank"] == "$SLURM_NODEID"
    assert found.origins["main_process_ip"].startswith("$SLURM_STEP_NODELIST")


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [("node[01-03,07]", "node01"), ("gpu-a[1-2],gpu-b5", "gpu-a1"), ("gpu-b5,gpu-a[1-2]", "gpu-b5"), ("127.0.0.1,localhost", "127.0.0.1"), ("n[009-011]", "n009")],
)
def test_the_main_address_is_the_first_host_of_the_node_list(nodelist: str, first: str) -> None:
    found = detect_cluster({**SLURM, "SLURM_STEP_NODELIST": nodelist})
    assert found is not None and found.values["main_process_ip"] == first


def test_the_step_s_nodes_come_before_the_job_s() -> None:
    env = {**SLURM, "SLURM_JOB_NODELIST": "big[1-8]", "SLURM_NNODES": "8"}
    found = detect_cluster(env)
    assert found is not None and (found.values["num_machines"], found.values["main_process_ip"]) == (4, "node01")
    del env["SLURM_STEP_NODELIST"], env["SLURM_STEP_NUM_NODES"]
    found = detect_cluster(env)
    assert found is not None and (found.values["num_machines"], found.values["main_process_ip"]) == (8, "big1")


def test_the_port_is_derived_from_the_job_id_in_a_safe_range() -> None:
    assert slurm_port("4242") == slurm_port("14242") == 24242
    assert all(SLURM_PORT_BASE <= slurm_port(str(j)) < SLURM_PORT_BASE + 10000 < 32768 for j in (0, 9999, 123456789))


@pytest.mark.parametrize(
    ("gpus", "count"),
    [({"SLURM_GPUS_PER_NODE": "4"}, 4), ({"SLURM_GPUS_PER_NODE": "a100:2"}, 2), ({"SLURM_JOB_GPUS": "0,1,2"}, 3), ({}, None), ({"SLURM_GPUS_ON_NODE": "0"}, None)],
)
def test_processes_per_node_come_from_the_gpus_slurm_gave(gpus: dict[str, str], count: int | None) -> None:
    env = {k: v for k, v in SLURM.items() if k != "SLURM_GPUS_ON_NODE"} | gpus
    found = detect_cluster(env)
    assert found is not None and found.values.get("num_processes") == count


def test_a_one_node_allocation_is_one_machine() -> None:
    found = detect_cluster({"SLURM_JOB_ID": "7", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "n1", "SLURM_NODEID": "0"})
    assert found is not None and found.values == {"num_machines": 1}


@pytest.mark.parametrize(("name", "value"), [("SLURM_STEP_TASKS_PER_NODE", "2(x4)"), ("SLURM_STEP_TASKS_PER_NODE", "1,2"), ("SLURM_NTASKS_PER_NODE", "8")])
def test_several_tasks_per_node_are_refused(name: str, value: str) -> None:
    env = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_TASKS_PER_NODE"} | {name: value}
    exc = _error(env)
    assert exc.where == f"${name}" and "--ntasks-per-node=1" in str(exc)


def test_the_batch_script_of_a_multi_node_job_is_refused() -> None:
    exc = _error({k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"})
    assert exc.where == "$SLURM_STEP_ID" and "srun" in str(exc)


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ({"SLURM_STEP_NODELIST": "node[01-"}, "$SLURM_STEP_NODELIST"),
        ({"SLURM_NODEID": "4"}, "$SLURM_NODEID"),
        ({"SLURM_NODEID": "two"}, "$SLURM_NODEID"),
        ({"SLURM_STEP_NUM_NODES": "0"}, "$SLURM_STEP_NUM_NODES"),
        ({"SLURM_JOB_ID": "12x"}, "$SLURM_JOB_ID"),
        ({"SLURM_GPUS_PER_NODE": "lots", "SLURM_GPUS_ON_NODE": ""}, "$SLURM_GPUS_PER_NODE"),
    ],
)
def test_bad_slurm_values_name_the_variable(change: dict[str, str], where: str) -> None:
    assert _error({**SLURM, **change}).where == where


def test_torchrun_variables_fill_the_launch_keys() -> None:
    found = detect_cluster(TORCHRUN)
    assert found is not None and found.kind == "torchrun"
    assert found.values == {"num_machines": 2, "machine_rank": 1, "main_process_ip": "trainer-0", "main_process_port": 23456, "num_processes": 4}
    plain = detect_cluster({"NNODES": "3", "NODE_RANK": "2", "MASTER_ADDR": "10.0.0.1", "NPROC_PER_NODE": "auto"})
    assert plain is not None and plain.values == {"num_machines": 3, "machine_rank": 2, "main_process_ip": "10.0.0.1"}
    fixed = detect_cluster({**TORCHRUN, "PET_NNODES": "2:2"})
    assert fixed is not None and fixed.values["num_machines"] == 2
    alone = detect_cluster({"NNODES": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "1"})  # no rendezvous to name
    assert alone is not None and alone.values == {"num_machines": 1}


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ({"PET_NODE_RANK": "2"}, "$PET_NODE_RANK"),
        ({"PET_NODE_RANK": "", "NODE_RANK": "5"}, "$NODE_RANK"),
        ({"PET_NODE_RANK": ""}, "$NODE_RANK"),
        ({"MASTER_ADDR": ""}, "$MASTER_ADDR"),
        ({"MASTER_PORT": "70000"}, "$MASTER_PORT"),
        ({"PET_NNODES": "1:4"}, "$PET_NNODES"),
        ({"PET_NPROC_PER_NODE": "many"}, "$PET_NPROC_PER_NODE"),
    ],
)
def test_bad_torchrun_values_name_the_variable(change: dict[str, str], where: str) -> None:
    assert _error({**TORCHRUN, **change}).where == where


def test_slurm_wins_over_torchrun_variables_but_an_exported_address_names_the_rendezvous() -> None:
    found = detect_cluster({**SLURM, **TORCHRUN})
    assert found is not None and found.kind == "slurm"
    assert (found.values["num_machines"], found.values["machine_rank"], found.values["num_processes"]) == (4, 2, 8)
    assert (found.values["main_process_ip"], found.values["main_process_port"]) == ("trainer-0", 23456)
    assert found.origins["main_process_ip"] == "$MASTER_ADDR"


# ---- the command line: the job's own keys win ----------------------------------------------------


def _print_config(args: list[str], env: dict[str, str], cwd: Path | None = None) -> tuple[dict, str]:
    """``acc-train ARGS --print-config`` in-process: the resolved launch section and stderr."""
    old = Path.cwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        result = CliRunner().invoke(cli, [*args, "--print-config"], env=env)
    finally:
        os.chdir(old)
    assert result.exit_code == 0, result.output + result.stderr
    return yaml.safe_load(result.stdout)["launch"], result.stderr


def test_flags_and_config_win_over_the_environment(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("launch:\n  num_processes: 2\n  main_process_port: 29999\n")
    launch, log = _print_config(["--config", str(config), "--machine-rank", "3"], SLURM)
    assert launch == {**launch, "num_machines": 4, "machine_rank": 3, "main_process_ip": "node01", "main_process_port": 29999, "num_processes": 2}
    # the launch log names what came from the environment, and only that
    assert "launch settings from slurm: num_machines=4 ($SLURM_STEP_NUM_NODES), main_process_ip=node01" in log
    assert "machine_rank" not in log and "num_processes" not in log
    single, _ = _print_config(["--num-machines", "1"], {**TORCHRUN, "PET_NODE_RANK": "0"})
    assert (single["num_machines"], single["machine_rank"], single["num_processes"]) == (1, 0, 4)


def test_a_config_of_several_machines_takes_the_address_from_the_environment(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("launch:\n  num_machines: 2\n")  # no main_process_ip: alone, an error
    launch, _ = _print_config(["--config", str(config)], TORCHRUN)
    assert (launch["num_machines"], launch["machine_rank"], launch["main_process_ip"]) == (2, 1, "trainer-0")


def test_a_job_that_contradicts_the_environment_is_an_error_naming_both() -> None:
    result = CliRunner().invoke(cli, ["--num-machines", "2", "--print-config"], env=SLURM)  # rank 2 of 4 nodes
    assert result.exit_code == 2
    assert "launch.machine_rank (2) must be below launch.num_machines (2)" in result.stderr
    assert "launch.machine_rank=2 from $SLURM_NODEID" in result.stderr


def test_several_tasks_per_node_exit_2_with_the_fix() -> None:
    result = CliRunner().invoke(cli, ["--print-config"], env={**SLURM, "SLURM_STEP_TASKS_PER_NODE": "8(x4)"})
    assert result.exit_code == 2
    assert "error: $SLURM_STEP_TASKS_PER_NODE" in result.stderr and "srun --ntasks-per-node=1" in result.stderr


def test_a_job_that_sets_every_launch_key_ignores_a_broken_environment() -> None:
    flags = ["--num-machines", "2", "--machine-rank", "1", "--main-process-ip", "h", "--main-process-port", "1234", "--num-processes", "1"]
    launch, _ = _print_config(flags, {**SLURM, "SLURM_STEP_NODELIST": "node[01-"})
    assert (launch["num_machines"], launch["machine_rank"], launch["main_process_ip"]) == (2, 1, "h")


def test_env_shows_what_it_detects() -> None:
    out = CliRunner().invoke(cli, ["env"], env=SLURM)
    assert out.exit_code == 0, out.output
    lines = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in out.stdout.splitlines() if "  " in line)
    assert lines["cluster"] == "slurm"
    assert lines["launch.machine_rank"] == "2  ($SLURM_NODEID)"
    assert lines["launch.main_process_ip"].startswith("node01")
    bad = CliRunner().invoke(cli, ["env"], env={**TORCHRUN, "PET_NODE_RANK": "9"})
    assert bad.exit_code == 0 and "error: $PET_NODE_RANK" in bad.stdout
    none = CliRunner().invoke(cli, ["env"])
    assert "cluster" in none.stdout and "none" in none.stdout


# ---- docs/cluster.md -------------------------------------------------------------------------------

DOC = (ROOT / "docs" / "cluster.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", DOC, flags=re.MULTILINE | re.DOTALL)


def _doc_job() -> str:
    [job] = [b for b in _blocks("yaml") if b.startswith("# job.yaml")]
    return job


def test_the_sbatch_script_runs_one_task_per_node_and_resolves(tmp_path: Path) -> None:
    [script] = [b for b in _blocks("bash") if b.startswith("#!/bin/bash\n#SBATCH")]
    sbatch = dict(line.removeprefix("#SBATCH --").partition("=")[::2] for line in script.splitlines() if line.startswith("#SBATCH"))
    assert sbatch["ntasks-per-node"] == "1"
    [srun] = [shlex.split(line) for line in script.splitlines() if line.startswith("srun ")]
    assert "--ntasks-per-node=1" in srun
    args = srun[srun.index("acc-train") + 1 :]
    (tmp_path / "job.yaml").write_text(_doc_job())
    env = {
        "SLURM_JOB_ID": "777123", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": sbatch["nodes"], "SLURM_NODEID": "1",
        "SLURM_STEP_NODELIST": "gpu[01-02]", "SLURM_STEP_TASKS_PER_NODE": f"1(x{sbatch['nodes']})",
        "SLURM_GPUS_PER_NODE": sbatch["gpus-per-node"],
    }  # fmt: skip
    launch, _ = _print_config(args, env, cwd=tmp_path)
    assert launch == {**launch, "num_machines": 2, "machine_rank": 1, "main_process_ip": "gpu01", "main_process_port": 27123, "num_processes": 8}


def test_the_preemption_script_requeues_and_resumes(tmp_path: Path) -> None:
    [script] = [b for b in _blocks("bash") if b.startswith("#SBATCH --signal=USR1@")]
    assert "#SBATCH --requeue" in script
    [srun] = [shlex.split(line) for line in script.splitlines() if line.startswith("srun ")]
    args = srun[srun.index("acc-train") + 1 :]
    (tmp_path / "job.yaml").write_text(_doc_job())
    env = {"SLURM_JOB_ID": "777123", "SLURM_STEP_NUM_NODES": "1", "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "gpu01", "SLURM_STEP_TASKS_PER_NODE": "1"}
    launch, _ = _print_config(args, env, cwd=tmp_path)
    assert launch["requeue"] is True and launch["save_signals"] == ["SIGTERM", "SIGINT", "SIGUSR1"]
    assert args[args.index("--resume") + 1] == "auto"  # what the requeued job needs (refused without it)


def test_the_pytorchjob_manifest_runs_acc_train_and_resolves(tmp_path: Path) -> None:
    [manifest] = [b for b in _blocks("yaml") if "kind: PyTorchJob" in b]
    docs = {d["kind"]: d for d in yaml.safe_load_all(manifest)}
    assert docs["ConfigMap"]["data"]["job.yaml"] == _doc_job()  # the page's job.yaml, as mounted
    job = docs["PyTorchJob"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    specs = job["spec"]["pytorchReplicaSpecs"]
    machines = sum(s["replicas"] for s in specs.values())
    for role, spec in specs.items():
        [container] = spec["template"]["spec"]["containers"]
        assert container["name"] == "pytorch", role
        command = container["command"]
        assert command[0] == "acc-train"
        mounted = tmp_path / "job.yaml"
        mounted.write_text(docs["ConfigMap"]["data"]["job.yaml"])
        args = [str(mounted) if a.endswith("/job.yaml") else a for a in command[1:]]
        env = {
            "PET_NNODES": str(machines), "PET_NODE_RANK": "1" if role == "Worker" else "0",
            "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"], "MASTER_ADDR": "acc-train-master-0", "MASTER_PORT": "23456",
        }  # fmt: skip
        launch, _ = _print_config(args, env)
        assert launch == {**launch, "num_machines": 2, "machine_rank": int(env["PET_NODE_RANK"]), "main_process_ip": "acc-train-master-0", "num_processes": 8}


def test_the_readme_and_the_site_link_the_page() -> None:
    assert "(docs/cluster.md)" in (ROOT / "README.md").read_text()
    assert "cluster.md" in (ROOT / "mkdocs.yml").read_text()  # in the site's nav


# ---- two faked machines on 127.0.0.1 -----------------------------------------------------------------


def _free_port_in_slurm_range() -> int:
    for port in random.sample(range(SLURM_PORT_BASE, SLURM_PORT_BASE + 10000), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in the Slurm range")


def _two_machines(args: list[str], envs: list[dict[str, str]]) -> list[str]:
    """Run ``acc-train ARGS`` as machine 0 and machine 1 at once; their stderr."""
    procs = [
        subprocess.Popen([sys.executable, "-m", "acc_train_cli", *args], env={**os.environ, "PYTHONUNBUFFERED": "1", **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for env in envs
    ]
    results = [p.communicate(timeout=600) for p in procs]
    for rank, (p, (_, err)) in enumerate(zip(procs, results)):
        assert p.returncode == 0, f"machine {rank}:\n{err[-4000:]}"
    return [err for _, err in results]


@pytest.mark.launch
@pytest.mark.xdist_group("reference-runs")
def test_faked_slurm_and_torchrun_machines_on_loopback_train_like_a_2_process_run(
    ddp_run: Path, tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]
) -> None:
    """Two "machines" of one process each: under Slurm (the node list's first host is
    127.0.0.1, the port comes from the job id) and under torchrun's variables. Both machines
    share one output directory, as on a cluster's shared filesystem (machine 0 writes it)."""
    small = {"train": tiny_data["train_small"], "eval": tiny_data["eval"]}
    port = _free_port_in_slurm_range()
    job_id = str(port - SLURM_PORT_BASE + 3_000_000)
    slurm = {
        "SLURM_JOB_ID": job_id, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "127.0.0.1,localhost",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_GPUS_ON_NODE": "1",
    }  # fmt: skip
    out = tmp_path / "slurm"
    logs = _two_machines(tiny_job_args(tiny_model_dir, small, out, "--strategy", "ddp", *REFERENCE_STEPS), [{**slurm, "SLURM_NODEID": str(r)} for r in (0, 1)])
    assert f"main_process_ip=127.0.0.1 ($SLURM_STEP_NODELIST, first host), main_process_port={port}" in logs[1]
    summary = yaml.safe_load((out / "run.json").read_text())
    assert summary["world_size"] == 2
    assert_same_losses(read_metrics(out), read_metrics(ddp_run))

    torchrun = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port_in_slurm_range())}
    out = tmp_path / "torchrun"
    logs = _two_machines(tiny_job_args(tiny_model_dir, small, out, "--strategy", "ddp", *REFERENCE_STEPS), [{**torchrun, "PET_NODE_RANK": str(r)} for r in (0, 1)])
    assert "launch settings from torchrun: num_machines=2 ($PET_NNODES), machine_rank=1 ($PET_NODE_RANK)" in logs[1]
    assert yaml.safe_load((out / "run.json").read_text())["world_size"] == 2
    assert_same_losses(read_metrics(out), read_metrics(ddp_run))


def test_requeue_needs_resume_auto_and_scontrol_and_says_when_nothing_will_requeue(tmp_path: Path) -> None:
    from acc_train.launch.cluster import check_requeue, requeue_job

    with pytest.raises(UserError) as err:
        check_requeue(None, {"SLURM_JOB_ID": "7"})
    assert err.value.where == "launch.requeue" and "--resume auto" in str(err.value)
    assert "not a Slurm job (no SLURM_JOB_ID)" in (check_requeue("auto", {"PATH": os.environ["PATH"]}) or "")
    with pytest.raises(UserError, match="scontrol is not on PATH"):
        check_requeue("auto", {"SLURM_JOB_ID": "7", "PATH": str(tmp_path)})
    failing = tmp_path / "scontrol"
    failing.write_text("#!/bin/sh\necho 'Requested operation is presently disabled for job 7' >&2\nexit 1\n")
    failing.chmod(0o755)
    assert check_requeue("auto", {"SLURM_JOB_ID": "7", "PATH": str(tmp_path)}) is None
    said = requeue_job({"SLURM_JOB_ID": "7", "PATH": str(tmp_path)})
    assert said.startswith("launch.requeue: `scontrol requeue 7` failed (Requested operation is presently disabled for job 7); submit the job again")
