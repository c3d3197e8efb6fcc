"""``python -m acc_train.simulate CONFIG.yaml RANK WORLD LOCAL_WORLD``: one rank simulated in
this process (a fresh one per rank: Accelerate's state and the process group are per process),
its result printed as one JSON line after ``ACC_TRAIN_SIMULATED``."""

from __future__ import annotations

import json
import sys

MARKER = "ACC_TRAIN_SIMULATED "


def main(argv: list[str]) -> int:
    from acc_train.config import load_resolved
    from acc_train.errors import EXIT_USER_ERROR, UserError
    from acc_train.simulate.step import simulate_rank

    config, rank, world, local = argv[0], *map(int, argv[1:4])
    try:
        result = simulate_rank(load_resolved(config), rank, world, local)
    except UserError as exc:
        print(MARKER + json.dumps({"user_error": {"message": exc.message, "where": exc.where, "hint": exc.hint}}), flush=True)
        return EXIT_USER_ERROR
    except Exception as exc:  # noqa: BLE001 - said in the strategy's entry, with where it stopped
        import traceback

        frame = traceback.extract_tb(exc.__traceback__)[-1]
        first = (str(exc).strip().splitlines() or [""])[0]
        print(MARKER + json.dumps({"failed": f"{type(exc).__name__}: {first} (in {frame.name}, {frame.filename}:{frame.lineno})"}), flush=True)
        return 1
    print(MARKER + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
