"""ft-ddp through a lost group: the survivor's stall, the rejoining group's heal, step times.

Two replica groups of one process each train the kit's tiny job (``acc_train.testing``) against
``acc-train lighthouse --heartbeat-timeout H``; group 1 is SIGKILLed between steps (core's fault
point ``train-step@K``: the worker dies, its launcher exits) and started again with the same
command. While group 0 is alone a small plugin of this script holds it, from ``--hold-at`` on,
until the new group 1 is up (its Manager listening), so that it is still training when group 1
asks to join, whatever the machine's start-up time.

Prints, from the groups' run.json (``ft_events``) and metrics.jsonl:

- stall: seconds from the survivor's failed step (or its next quorum) until the quorum without the
  lost group (goal: at most the heartbeat timeout + 1 s);
- heal: the rejoining group's first quorum with the state transfer from a live peer (goal: 5 s);
- relaunch to first step: from the relaunch's start to its first trained step after the heal (interpreter,
  torch, model and data included);
- step times: the survivor's median step with 2 groups and alone (from metrics.jsonl's elapsed_s;
  the steps held for the relaunch left out), and the rejoined group's median step;
- whether both groups end with the same parameters (run.json's param_checksum).

    python bench/bench_ft.py [--steps 60] [--kill-at 8] [--heartbeat-timeout 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOLD_PLUGIN = """
import os, time
from pathlib import Path
from acc_train.api import hookimpl

@hookimpl(trylast=True)
def acc_train_step_end(run, step, metrics):
    if metrics.get("replica_groups", 2) < 2:
        gate = Path(os.environ["FT_BENCH_GATE"])
        while step >= int(os.environ["FT_BENCH_HOLD_AT"]) and not gate.exists():
            time.sleep(0.05)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-at", type=int, default=8)
    parser.add_argument("--hold-at", type=int, default=20)
    parser.add_argument("--heartbeat-timeout", type=float, default=2.0)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()

    from acc_train.testing import build_tiny_assets

    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench-ft-"))
    assets = build_tiny_assets(root / "assets")
    plugins = root / "plugins"
    (plugins / "acc_train_ft_bench_hold-0.0.0.dist-info").mkdir(parents=True, exist_ok=True)
    (plugins / "acc_train_ft_bench_hold-0.0.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: acc-train-ft-bench-hold\nVersion: 0.0.0\n")
    (plugins / "acc_train_ft_bench_hold-0.0.0.dist-info" / "entry_points.txt").write_text("[acc_train]\nft-bench-hold = acc_train_ft_bench_hold\n")
    (plugins / "acc_train_ft_bench_hold.py").write_text(HOLD_PLUGIN)
    gate = root / "relaunched"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FT_BENCH_GATE": str(gate), "FT_BENCH_HOLD_AT": str(args.hold_at),
           "PYTHONPATH": os.pathsep.join([str(plugins), *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
    cli = [sys.executable, "-m", "acc_train_cli"]
    lighthouse = subprocess.Popen([*cli, "lighthouse", "--port", "0", "--heartbeat-timeout", str(args.heartbeat_timeout)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        address = "localhost:" + lighthouse.stdout.readline().split()[-1].rsplit(":", 1)[1]

        def start(group: int, attempt: int, **extra: str) -> subprocess.Popen[str]:
            command = [
                *cli, "--strategy", "ft-ddp", "--num-processes", "1",
                "--set", f"model.name_or_path={assets.model_dir}", "--set", f"data.train_files=[{assets.train_file}]",
                "--set", "data.seq_len=16", "--micro-batch-size", "4", "--lr", "1e-3", "--mixed-precision", "no", "--seed", "7",
                "--max-steps", str(args.steps), "--set", "training.progress_bar=false", "--set", "checkpoint.every=0",
                "--set", f"launch.main_process_port={29650 + group}", "--output-dir", str(root / f"group-{group}"),
                "--set", f"strategy.replica_group={group}", "--set", "strategy.num_groups=2", "--set", f"strategy.lighthouse={address}",
            ]  # fmt: skip
            log = open(root / f"group-{group}-{attempt}.log", "w")  # noqa: SIM115 - lives as long as the process
            return subprocess.Popen(command, env={**env, **extra}, stdout=log, stderr=subprocess.STDOUT, text=True)

        survivor = start(0, 0)
        doomed = start(1, 0, ACC_TRAIN_FAULT=f"train-step@{args.kill_at}")
        doomed.wait()
        relaunched_at = time.time()
        rejoined = start(1, 1)
        log = root / "group-1-1.log"
        while rejoined.poll() is None and "Manager listening" not in log.read_text():
            time.sleep(0.1)
        gate.touch()
        healed_at = None
        metrics = root / "group-1" / "metrics.jsonl"
        while rejoined.poll() is None and healed_at is None:  # its first row after the heal (the first launch's end at kill-at)
            rows1 = metrics.read_text().splitlines() if metrics.exists() else []
            if any(json.loads(line).get("step", 0) > args.kill_at + 1 for line in rows1 if line.strip()):
                healed_at = time.time()
            time.sleep(0.05)
        healed_at = healed_at or time.time()
        codes = survivor.wait(), rejoined.wait()
    finally:
        lighthouse.terminate()
        lighthouse.wait()
    if codes != (0, 0):
        sys.exit(f"a group failed ({codes}); logs in {root}")
    runs = [json.loads((root / f"group-{g}" / "run.json").read_text()) for g in (0, 1)]
    rows = [[json.loads(line) for line in (root / f"group-{g}" / "metrics.jsonl").read_text().splitlines() if '"loss"' in line] for g in (0, 1)]
    events = {e["kind"]: e for e in runs[0]["ft_events"] + runs[1]["ft_events"]}
    heal = events["healed"]

    def steps(group: int, groups: int, skip: set[int]) -> list[float]:
        r = rows[group]
        return [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(r, r[1:]) if b["step"] == a["step"] + 1 and b.get("replica_groups") == groups and a.get("replica_groups") == groups and b["step"] not in skip]

    held = set(range(args.hold_at, heal["step"] + 2))
    together, alone, rejoined_steps = steps(0, 2, held), steps(0, 1, held), steps(1, 2, set())
    print(f"workdir {root}")
    print(f"stall after the lost group: {events['lost']['seconds']:.2f} s (heartbeat timeout {args.heartbeat_timeout:g} s; goal <= {args.heartbeat_timeout + 1:g} s)")
    print(f"heal from a live peer: {heal['seconds']:.2f} s at step {heal['step']} (goal <= 5 s); relaunch to its first step after the heal: {healed_at - relaunched_at:.1f} s (start-up included)")
    print(f"survivor's median step: {statistics.median(together) * 1000:.0f} ms with 2 groups, {statistics.median(alone) * 1000:.0f} ms alone; rejoined group's {statistics.median(rejoined_steps) * 1000:.0f} ms")
    print(f"discarded steps: {runs[0]['ft_discarded_steps']} (group 0), {runs[1]['ft_discarded_steps']} (group 1)")
    same = runs[0]["per_rank"][0]["param_checksum"] == runs[1]["per_rank"][0]["param_checksum"]
    print(f"parameters equal at the end: {same}")


if __name__ == "__main__":
    main()
