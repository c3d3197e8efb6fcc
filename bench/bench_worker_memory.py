"""A worker's peak memory opening its prepared data and summarising it for ``run.json``, as
the corpus grows (issue 41 item 1), with this checkout's acc-train and another's side by side.

For each row count a cache entry is written the way ``acc_train.data.build`` writes one (a
token stream of ``--seq-len``-token rows, its ``starts``, its ``rows`` and ``meta.json``,
synthetic tokens: what is measured never looks at their values), then a fresh interpreter per
side opens it (``build.open_split``, the ``PreparedData`` a worker makes) and calls
``summary()``; it prints the growth of its peak RSS (``VmHWM``) over the span. Rounds alternate
which side goes first; the median is reported.

Usage: python bench/bench_worker_memory.py --before /path/to/other/checkout [--rows 100000 1750000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MEASURE = r"""
import json, sys
from pathlib import Path

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

import numpy as np
from acc_train.data import build
from acc_train.data.cache import PreparedData

entry = Path(sys.argv[1])
meta = json.loads((entry / "meta.json").read_text())
before = hwm()
train = build.open_split(entry, "train")
prepared = PreparedData(train, None, meta["kind"], meta["packing"], meta["train"], meta["train"]["max_token"], "hit", str(entry), "bench", {}, meta["seq_len"])
summary = prepared.summary()
print(json.dumps({"grew": hwm() - before, "packing_efficiency": summary["packing_efficiency"]}))
"""


def write_entry(root: Path, rows: int, seq_len: int, efficiency: bool) -> Path:
    """A cache entry of ``rows`` full rows (kind text, packed), as ``build.write_split`` lays it out."""
    import numpy as np

    entry = root / f"rows-{rows}"
    entry.mkdir()
    tokens = rows * seq_len
    np.lib.format.open_memmap(entry / "train.tokens.npy", mode="w+", dtype=np.uint16, shape=(tokens,))[:] = 7
    np.save(entry / "train.starts.npy", np.asarray([0, tokens], dtype=np.int64))
    begin = np.arange(rows, dtype=np.int64) * seq_len
    np.save(entry / "train.rows.npy", np.stack([begin, begin + seq_len], axis=1))
    train = {"documents": 1, "tokens": tokens, "loss_tokens": tokens, "truncated": 0, "dropped": 0, "empty": 0, "rows": rows, "max_token": 7,
             "files": ["train.rows.npy", "train.starts.npy", "train.tokens.npy"]}  # fmt: skip
    if efficiency:  # what this checkout's builder records (the other side's ignores it)
        train["packing_efficiency"] = 1.0
    meta = {"format_version": 1, "kind": "text", "packing": True, "seq_len": seq_len, "train": train}
    (entry / "meta.json").write_text(json.dumps(meta))
    return entry


def measure(src: Path, entry: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src / "packages" / "core" / "src")}
    out = subprocess.run([sys.executable, "-c", MEASURE, str(entry)], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="another checkout (its packages/core/src is measured as 'before')")
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_750_000])
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    here = Path(__file__).resolve().parents[1]
    print(f"machine: {platform.node()} {os.cpu_count()} cores, python {platform.python_version()}")
    print(f"{'rows':>10} {'before: MiB grown':>18} {'after: MiB grown':>17}")
    with tempfile.TemporaryDirectory() as tmp:
        for rows in args.rows:
            entry = write_entry(Path(tmp), rows, args.seq_len, efficiency=True)
            grew: dict[str, list[int]] = {"before": [], "after": []}
            for r in range(args.rounds):
                sides = [("before", args.before), ("after", here)]
                for side, src in sides if r % 2 == 0 else sides[::-1]:
                    grew[side].append(measure(src, entry)["grew"])
            b, a = (statistics.median(grew[s]) / 2**20 for s in ("before", "after"))
            print(f"{rows:>10,} {b:>18.1f} {a:>17.1f}")


if __name__ == "__main__":
    main()
