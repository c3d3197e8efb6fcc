"""Fill the ``launch:`` section from the cluster acc-train runs in: Slurm, or torchrun's variables.

acc-train runs once per machine and starts that machine's workers itself. Under Slurm that is
``srun --ntasks-per-node=1 acc-train ...``; under a Kubernetes PyTorchJob (or anything else that
sets torchrun's variables) it is the container's command. What is detected:

========================  ==========================================  =====================================
launch key                Slurm                                       torchrun-style
========================  ==========================================  =====================================
``num_machines``          ``SLURM_STEP_NUM_NODES``/``SLURM_NNODES``   ``PET_NNODES`` / ``NNODES``
``machine_rank``          ``SLURM_NODEID``                            ``PET_NODE_RANK`` / ``NODE_RANK``
``main_process_ip``       first host of ``SLURM_STEP_NODELIST`` /     ``PET_MASTER_ADDR`` / ``MASTER_ADDR``
                          ``SLURM_JOB_NODELIST`` (python-hostlist)
``main_process_port``     ``SLURM_PORT_BASE + job id % 10000``        ``PET_MASTER_PORT`` / ``MASTER_PORT``
``num_processes``         ``SLURM_GPUS_ON_NODE`` / ``_PER_NODE`` /    ``PET_NPROC_PER_NODE`` /
                          ``SLURM_JOB_GPUS``                          ``NPROC_PER_NODE``
========================  ==========================================  =====================================

Slurm wins over torchrun's variables when both are set (it knows the allocation), except that an
exported ``MASTER_ADDR``/``MASTER_PORT`` names the rendezvous under Slurm too. Keys the job sets
itself (config file, flags, ``--set``) win over anything detected.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from acc_train.config import ResolvedJob
from acc_train.errors import UserError

__all__ = ["CLUSTER_KEYS", "SLURM_PORT_BASE", "Detected", "check_requeue", "detect_cluster", "requeue_job", "resolve_on_cluster", "slurm_port"]

#: Slurm's rendezvous port is ``SLURM_PORT_BASE + job id % 10000``: 20000-29999, the same on
#: every node of a job, different for jobs sharing a node, below Linux's ephemeral ports (32768-).
SLURM_PORT_BASE = 20000

#: the launch keys a cluster environment can fill
CLUSTER_KEYS = ("num_machines", "machine_rank", "main_process_ip", "main_process_port", "num_processes")

_TASK_COUNTS = re.compile(r"(\d+)(?:\(x\d+\))?")


@dataclass
class Detected:
    """What the environment says about the launch: values by launch key, and the variables
    each came from (``{"machine_rank": "$SLURM_NODEID"}``)."""

    kind: str  # "slurm" or "torchrun"
    values: dict[str, Any] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)

    def put(self, key: str, value: Any, origin: str) -> None:
        self.values[key] = value
        self.origins[key] = origin


def _first(env: Mapping[str, str], *names: str) -> tuple[str, str] | tuple[None, None]:
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return None, None


def _int(name: str, value: str, low: int = 0, high: int | None = None) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < low or (high is not None and number > high):
        span = f"from {low}" + (f" to {high}" if high is not None else "")
        raise UserError(f"{value!r} is not a whole number {span}", where=f"${name}", hint="fix or unset the variable")
    return number


def _first_host(name: str, nodelist: str) -> str:
    import hostlist

    try:
        hosts = hostlist.expand_hostlist(nodelist)
    except hostlist.BadHostlist as exc:
        raise UserError(f"{nodelist!r} is not a Slurm host list ({exc})", where=f"${name}") from None
    if not hosts:
        raise UserError(f"${name} names no host", where=f"${name}")
    return str(hosts[0])


def slurm_port(job_id: str) -> int:
    """The rendezvous port of Slurm job ``job_id`` (see :data:`SLURM_PORT_BASE`)."""
    return SLURM_PORT_BASE + _int("SLURM_JOB_ID", job_id) % 10000


def _slurm_gpus(env: Mapping[str, str]) -> tuple[str, int] | None:
    name, value = _first(env, "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "SLURM_JOB_GPUS")
    if name is None or value is None:
        return None
    if name == "SLURM_JOB_GPUS":  # GPU indices: "0,1,2,3"
        return name, len([g for g in value.split(",") if g.strip()])
    if name == "SLURM_GPUS_PER_NODE":  # "4", "a100:4", "a100:4(S:0-1)"
        value = value.split("(")[0].rsplit(":", 1)[-1]
    return name, _int(name, value)


def _check_one_task_per_node(env: Mapping[str, str]) -> None:
    name, value = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
    if name is None or value is None:
        return
    counts = [int(n) for n in _TASK_COUNTS.findall(value)]
    if not counts or max(counts) > 1:
        raise UserError(
            f"Slurm started {value} tasks per node; acc-train runs once per node and starts "
            "that node's workers itself",
            where=f"${name}",
            hint="start it with `srun --ntasks-per-node=1 acc-train ...` (and #SBATCH --ntasks-per-node=1)",
        )


def _slurm(env: Mapping[str, str]) -> Detected:
    found = Detected("slurm")
    _check_one_task_per_node(env)
    n_name, n_value = _first(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    machines = _int(n_name, n_value, low=1) if n_name and n_value else 1
    found.put("num_machines", machines, f"${n_name}" if n_name else "Slurm (no node count: 1)")
    if machines > 1:
        if _first(env, "SLURM_STEP_ID", "SLURM_STEPID")[0] is None:  # srun sets it: without it, not a step
            raise UserError(
                f"this is Slurm job {env['SLURM_JOB_ID']}'s batch script, not a step on each of its {machines} nodes",
                where="$SLURM_STEP_ID",
                hint="start acc-train with `srun --ntasks-per-node=1 acc-train ...`, once per node",
            )
        r_name, r_value = _first(env, "SLURM_NODEID")
        if r_name is None or r_value is None:
            raise UserError("Slurm does not say which node this is", where="$SLURM_NODEID", hint="start acc-train with srun")
        rank = _int(r_name, r_value)
        if rank >= machines:
            raise UserError(f"node {rank} is not below the {machines} nodes of ${n_name}", where="$SLURM_NODEID")
        found.put("machine_rank", rank, "$SLURM_NODEID")
        l_name, l_value = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        if l_name is None or l_value is None:
            raise UserError("Slurm does not list the job's nodes", where="$SLURM_JOB_NODELIST", hint="start acc-train with srun")
        found.put("main_process_ip", _first_host(l_name, l_value), f"${l_name}, first host")
        found.put("main_process_port", slurm_port(env["SLURM_JOB_ID"]), f"$SLURM_JOB_ID: {SLURM_PORT_BASE} + id % 10000")
    gpus = _slurm_gpus(env)
    if gpus is not None and gpus[1] > 0:
        found.put("num_processes", gpus[1], f"${gpus[0]}")
    return found


def _nnodes(name: str, value: str) -> int:
    """torchrun's ``--nnodes``: ``N`` or ``N:N`` (a fixed size; elastic ranges are not run)."""
    low, _, high = value.partition(":")
    if high and high.strip() != low.strip():
        raise UserError(
            f"{value!r} is an elastic range; acc-train runs a fixed number of machines",
            where=f"${name}",
            hint="set it to one number (or MIN:MAX with MIN == MAX)",
        )
    return _int(name, low.strip(), low=1)


def _torchrun(env: Mapping[str, str], found: Detected) -> None:
    """torchrun's variables (``PET_*``, as it reads them and a PyTorchJob sets them, first)."""
    n_name, n_value = _first(env, "PET_NNODES", "NNODES")
    if n_name and n_value and "num_machines" not in found.values:
        machines = _nnodes(n_name, n_value)
        found.put("num_machines", machines, f"${n_name}")
        r_name, r_value = _first(env, "PET_NODE_RANK", "NODE_RANK")
        if machines > 1 and r_name is None:
            raise UserError(f"${n_name} says {machines} machines but no variable says which one this is", where="$NODE_RANK")
        if r_name and r_value:
            rank = _int(r_name, r_value)
            if rank >= machines:
                raise UserError(f"rank {rank} is not below ${n_name}={machines}", where=f"${r_name}", hint="machine ranks count from 0")
            found.put("machine_rank", rank, f"${r_name}")
    if found.values.get("num_machines", 1) > 1:  # one machine needs no rendezvous address
        a_name, a_value = _first(env, "PET_MASTER_ADDR", "MASTER_ADDR")
        if a_name and a_value:
            found.put("main_process_ip", a_value, f"${a_name}")
        elif "main_process_ip" not in found.values:
            raise UserError(f"{found.origins['num_machines']} says several machines but no address of machine 0 is set", where="$MASTER_ADDR")
        p_name, p_value = _first(env, "PET_MASTER_PORT", "MASTER_PORT")
        if p_name and p_value:
            found.put("main_process_port", _int(p_name, p_value, low=1, high=65535), f"${p_name}")
    c_name, c_value = _first(env, "PET_NPROC_PER_NODE", "NPROC_PER_NODE")
    if c_name and c_value and c_value not in ("auto", "gpu") and "num_processes" not in found.values:
        found.put("num_processes", _int(c_name, c_value, low=1), f"${c_name}")


def detect_cluster(env: Mapping[str, str]) -> Detected | None:
    """The launch settings ``env`` (``os.environ``) gives, or None outside a cluster; a bad
    or contradictory variable is a :class:`UserError` naming it."""
    if env.get("SLURM_JOB_ID", "").strip():
        found = _slurm(env)
        _torchrun({k: v for k, v in env.items() if k.endswith(("MASTER_ADDR", "MASTER_PORT"))}, found)
        return found
    if _first(env, "PET_NNODES", "NNODES")[0] is None:
        return None
    found = Detected("torchrun")
    _torchrun(env, found)
    return found


def resolve_on_cluster(load: Callable[[dict[str, Any] | None], ResolvedJob], env: Mapping[str, str]) -> tuple[ResolvedJob, Detected | None]:
    """The job ``load(base)`` resolves, with what the cluster says (``env``, ``os.environ``) as
    ``base``: below the config file, flags and ``--set``, so the job's own keys win. Returns it
    and what was detected, its ``values`` and ``origins`` cut to the keys that were used."""
    try:
        found = detect_cluster(env)
    except UserError as problem:
        try:
            job = load(None)
        except UserError:
            raise problem from None  # the environment's problem first: it is what stops the launch
        if job.config.launch.model_fields_set >= set(CLUSTER_KEYS):  # the job says it all itself
            return job, None
        raise
    if found is None:
        return load(None), None
    try:
        job = load({"launch": dict(found.values)})
    except UserError as exc:
        detected = ", ".join(f"launch.{k}={v} from {found.origins[k]}" for k, v in found.values.items())
        exc.hint = "\n  ".join(h for h in (exc.hint, f"detected from {found.kind}: {detected} (the job's own keys win over them)") if h)
        raise
    launch = job.config.launch  # a key the job sets itself has an origin (or, from an accelerate file, its own value)
    used = [k for k in found.values if f"launch.{k}" not in job.sources.origins and getattr(launch, k) == found.values[k]]
    found.values = {k: found.values[k] for k in used}
    found.origins = {k: found.origins[k] for k in used}
    job.sources.origins.update({f"launch.{k}": found.origins[k] for k in used})
    return job, found


def check_requeue(resume: str | None, env: Mapping[str, str]) -> str | None:
    """Before launch, with ``launch.requeue`` set: a :class:`UserError` where the requeued job
    could not continue the run (``resume`` not ``auto``; Slurm's ``scontrol`` not on PATH), or a
    warning to print outside a Slurm job (nothing will requeue it)."""
    import shutil

    if resume != "auto":
        raise UserError(
            f"launch.requeue runs the same command again after a signal's checkpoint, which must then continue the run, "
            f"but resume is {resume!r}",
            where="launch.requeue",
            hint="add --resume auto (it starts from step 0 when there is no checkpoint yet), or drop launch.requeue",
        )
    if not env.get("SLURM_JOB_ID", "").strip():
        return "launch.requeue is set, but this is not a Slurm job (no SLURM_JOB_ID): a signal saves a checkpoint and stops, and nothing requeues the run"
    if shutil.which("scontrol", path=env.get("PATH")) is None:
        raise UserError(
            "launch.requeue asks Slurm to requeue the job with `scontrol requeue`, but scontrol is not on PATH",
            where="launch.requeue",
            hint="run where Slurm's commands are on PATH, or drop launch.requeue",
        )
    return None


def requeue_job(env: Mapping[str, str]) -> str:
    """``scontrol requeue $SLURM_JOB_ID`` (machine 0's command, after its workers saved and
    stopped); the line to print, whether it worked or not."""
    import subprocess

    job_id = env.get("SLURM_JOB_ID", "").strip()
    if not job_id:
        return "launch.requeue: not a Slurm job (no SLURM_JOB_ID), so nothing was requeued"
    try:
        done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=120, env=dict(env))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"launch.requeue: `scontrol requeue {job_id}` failed ({exc}); submit the job again to continue"
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()
        return (
            f"launch.requeue: `scontrol requeue {job_id}` failed ({why[-1] if why else f'exit code {done.returncode}'}); "
            "submit the job again to continue (sbatch --requeue lets Slurm requeue it)"
        )
    return f"requeued Slurm job {job_id}: when it starts again, it continues from the latest checkpoint (resume: auto)"
