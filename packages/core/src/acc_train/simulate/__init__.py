"""``acc-train plan --simulate``: the job's step rehearsed on one CPU at the target world size.

Each rank kind is simulated in a fresh process of its own, side by side (:mod:`acc_train.simulate.__main__`): the job's
model at full size from fake tensors, torch's fake process group as one rank of the world, the
strategy applied by the Accelerator a run builds (:mod:`acc_train.simulate.step`), measured by
torch's own memory trackers. Rank 0 and the last rank are simulated: the last holds the smaller
shard where a dimension does not divide evenly, and the other end of a tensor- or
context-parallel group; ranks whose figures agree are reported once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from acc_train.config import ResolvedJob
    from acc_train.strategy import Strategy

__all__ = ["simulate_strategy", "job_under", "rank_kinds", "SimulationFailed"]


class SimulationFailed(RuntimeError):
    """The simulation of one strategy stopped: what it printed last says why."""


def job_under(job: ResolvedJob, strategy: Strategy[Any]) -> ResolvedJob:
    """The job with its strategy replaced by ``strategy`` (by its name, with all its options)."""
    config = job.config.model_copy(update={"strategy": {"name": strategy.name, **strategy.options.model_dump(mode="json")}})
    return dataclasses.replace(job, config=config, strategy=strategy)


def rank_kinds(world_size: int) -> list[int]:
    """The ranks simulated: the first and, where there are several, the last."""
    return [0] if world_size == 1 else [0, world_size - 1]


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    keys = ("peak_bytes", "parameters_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes", "other_bytes", "collectives")
    return all(a[k] == b[k] for k in keys)


def _start_rank(config_file: Path, rank: int, world: int, local: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "acc_train.simulate", str(config_file), str(rank), str(world), str(local)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _result(proc: subprocess.Popen[str], rank: int, timeout: float | None) -> dict[str, Any]:
    from acc_train.simulate.__main__ import MARKER

    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise SimulationFailed(f"rank {rank} ran past {timeout:.0f} s") from None
    for line in out.splitlines():
        if line.startswith(MARKER):
            result = json.loads(line[len(MARKER):])
            if "failed" in result:
                raise SimulationFailed(f"rank {rank} stopped: {result['failed']}")
            return result
    tail = [line for line in (err or out).strip().splitlines() if line.strip()]
    raise SimulationFailed(f"rank {rank} stopped (exit {proc.returncode}): {tail[-1] if tail else 'no output'}")


def simulate_strategy(job: ResolvedJob, world_size: int, local_world_size: int, timeout: float | None = None) -> dict[str, Any]:
    """Simulate every rank kind of ``job`` (already under the strategy to simulate): ``{"ranks":
    [result, ...]}`` (ranks whose figures agree merged, ``ranks`` naming them) or
    ``{"user_error": ...}`` where the strategy refused the job as a run would."""
    with tempfile.TemporaryDirectory(prefix="acc-train-simulate-") as tmp:
        config_file = Path(tmp) / "config.yaml"
        config_file.write_text(job.to_yaml())
        results: list[dict[str, Any]] = []
        ranks = rank_kinds(world_size)
        procs = [_start_rank(config_file, rank, world_size, local_world_size) for rank in ranks]  # side by side: one core each
        try:
            found = [_result(proc, rank, timeout) for proc, rank in zip(procs, ranks)]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
        for rank, result in zip(ranks, found):
            if "user_error" in result:
                return result
            same = next((r for r in results if _same(r, result)), None)
            if same is not None:
                same["ranks"].append(rank)
                same["seconds"] = max(same["seconds"], result["seconds"])  # side by side
                same["rss_bytes"] = max(same["rss_bytes"], result["rss_bytes"])
            else:
                results.append({**result, "ranks": [rank]})
    return {"ranks": results}
