"""What every bad input must get: exit 2, one message naming what and where, no traceback, and
every watched file exactly as it was (checked by hashes taken before and after).

A case runs ``acc-train`` inside a workspace directory the case fills with its own files;
everything under the workspace is watched. It runs in this process
(:func:`tests.conftest.cli_in_process`: exit code, stdout and stderr as the real command's, a
traceback for an exception the command lets through), or in a fresh interpreter with ``fresh=True``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Case", "snapshot", "run_acc_train", "assert_refused", "assert_handled", "check_case", "TIMEOUT_S"]

#: a bad input is refused in seconds; more means a hang (an alias bomb, a wait on a dead peer)
TIMEOUT_S = 120


@dataclass(frozen=True)
class Case:
    """One bad input: the command line, the files it needs, and the words its message must hold.

    ``args`` and ``files`` may use ``{ws}`` for the workspace directory. ``names`` are what the
    message must name (the key, flag or file), case-insensitively.
    """

    id: str
    args: Sequence[str]
    names: Sequence[str]
    files: Mapping[str, bytes | str] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.id


def snapshot(root: Path) -> dict[str, str]:
    """Every path under ``root`` -> the sha256 of its content ("dir" for a directory)."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        base = Path(dirpath)
        for d in dirnames:
            out[str((base / d).relative_to(root))] = "dir"
        for f in filenames:
            p = base / f
            if p.is_symlink():
                out[str(p.relative_to(root))] = "link:" + os.readlink(p)
            else:
                out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def run_acc_train(
    args: Sequence[str], cwd: Path, env: Mapping[str, str] | None = None, timeout: float = TIMEOUT_S, fresh: bool = False
) -> subprocess.CompletedProcess[str]:
    """``acc-train ARGS`` in this process (``fresh``: in a fresh interpreter); a hang fails the
    test instead of the suite."""
    from tests.conftest import cli_in_process

    try:
        if not fresh:
            return cli_in_process(*args, env=dict(env or {}), cwd=cwd, timeout=timeout)
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        return subprocess.run(
            [sys.executable, "-m", "acc_train_cli", *args], capture_output=True, text=True, errors="replace", env=full_env, cwd=cwd, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"acc-train {' '.join(args)} did not finish in {timeout} s (a hang on bad input)") from exc


def assert_refused(result: subprocess.CompletedProcess[str], names: Sequence[str], what: str = "") -> None:
    """Exit 2, an ``error:`` message naming each of ``names``, and no traceback."""
    shown = f"{what}\nexit {result.returncode}\nstdout:\n{result.stdout[-2000:]}\nstderr:\n{result.stderr[-4000:]}"
    assert "Traceback (most recent call last)" not in result.stderr + result.stdout, f"a traceback for a bad input:{shown}"
    assert result.returncode == 2, f"expected exit 2 for a bad input:{shown}"
    assert "error:" in result.stderr.lower(), f"no `error:` message on stderr:{shown}"  # click says "Error:"
    message = result.stderr.lower()
    missing = [n for n in names if n.lower() not in message]
    assert not missing, f"the message does not name {missing}:{shown}"


def assert_handled(result: subprocess.CompletedProcess[str], what: str = "") -> None:
    """For arbitrary input (property tests): accepted (exit 0) or refused as a user error (exit 2),
    never a traceback."""
    shown = f"{what}\nexit {result.returncode}\nstderr:\n{result.stderr[-4000:]}"
    assert "Traceback (most recent call last)" not in result.stderr + result.stdout, f"a traceback:{shown}"
    assert result.returncode in (0, 2), f"expected exit 0 or 2:{shown}"
    if result.returncode == 2:
        assert "error:" in result.stderr, f"exit 2 without an `error:` message:{shown}"


def check_case(case: Case, workspace: Path, fresh: bool = False) -> subprocess.CompletedProcess[str]:
    """Create the case's files in ``workspace``, run it (``fresh``: in a fresh interpreter),
    assert it was refused and nothing under the workspace changed."""
    for rel, content in case.files.items():
        path = workspace / rel.format(ws=workspace)
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            path.write_text(content.format(ws=workspace) if "{ws}" in content else content, encoding="utf-8")
        else:
            path.write_bytes(content)
    before = snapshot(workspace)
    args = [a.format(ws=workspace) for a in case.args]
    env = {k: v.format(ws=workspace) for k, v in case.env.items()}
    result = run_acc_train(args, workspace, env, fresh=fresh)
    assert_refused(result, [n.format(ws=workspace) for n in case.names], f"case {case.id}: acc-train {' '.join(args)}")
    after = snapshot(workspace)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"case {case.id}: a refused command changed {changed}"
    return result
