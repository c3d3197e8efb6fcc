"""The house plan, enforced: import-linter's contracts (.importlinter), deptry on every package,
core's module sizes, and core naming no strategy. Each check runs the well-kept tool as CI does."""

from __future__ import annotations

import io
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

import deptry  # noqa: F401  (hard dependencies of the test environment: no silent skip)
import importlinter  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "packages" / "core" / "src" / "acc_train"
PACKAGES = [
    "packages/core",
    "packages/cli",
    "packages/strategy-ddp",
    "packages/strategy-fsdp",
    "packages/strategy-deepspeed",
    "packages/strategy-ft",
    "examples/strategy-localsgd",
]
MAX_CORE_MODULE_LINES = 400


def _tool(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def test_import_contracts_hold() -> None:
    proc = subprocess.run([_tool("lint-imports"), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"lint-imports found a broken contract (.importlinter):\n{proc.stdout[-6000:]}{proc.stderr[-2000:]}"
    assert "0 broken" in proc.stdout or "broken" not in proc.stdout.split("Contracts:")[-1], proc.stdout


@pytest.mark.parametrize("package", PACKAGES)
def test_every_import_is_declared(package: str) -> None:
    proc = subprocess.run([_tool("deptry"), ".", "--no-ansi"], cwd=ROOT / package, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"deptry: {package} imports what its pyproject.toml does not declare (or the reverse):\n{proc.stdout}{proc.stderr}"


def test_no_core_module_exceeds_the_size_of_one_job() -> None:
    sizes = {str(p.relative_to(CORE)): len(p.read_text().splitlines()) for p in CORE.rglob("*.py")}
    too_big = {name: n for name, n in sizes.items() if n > MAX_CORE_MODULE_LINES}
    assert not too_big, f"core modules over {MAX_CORE_MODULE_LINES} lines (make each a package of small modules): {too_big}"



#: core's root holds the modules a newcomer reads first; everything else lives in a package by concern
MAX_CORE_ROOT_MODULES = 15


def test_core_root_is_grouped_by_concern() -> None:
    root = sorted(p.name for p in CORE.glob("*.py"))
    assert len(root) <= MAX_CORE_ROOT_MODULES, f"{len(root)} modules at core's root (at most {MAX_CORE_ROOT_MODULES}): {root}"


def test_the_lower_layers_protocols_describe_what_they_are_handed() -> None:
    """Lower layers are typed against acc_train.contracts.protocols (so no TYPE_CHECKING import climbs a
    layer); the objects the upper layers hand them must really have those members."""
    from types import SimpleNamespace

    from acc_train.config import load_job
    from acc_train.contracts.protocols import JobConfigView, JobView, MachineView, RunView
    from acc_train.run import RunContext
    from acc_train.strategy import Machine

    job = load_job()
    assert isinstance(job.config, JobConfigView)
    assert isinstance(job, JobView)
    assert isinstance(Machine(device_type="cpu", world_size=2), MachineView)
    run = RunContext(job=job, accelerator=SimpleNamespace(is_main_process=True), output_dir=Path("out"), max_steps=1)  # type: ignore[arg-type]
    assert isinstance(run, RunView)
    for name in RunView.__annotations__:  # dataclass fields, not only what isinstance sees
        assert name in RunContext.__dataclass_fields__, name

#: the one place core names strategies on purpose: which package to install for a missing one
HINT_TABLE = "KNOWN_STRATEGY_PACKAGES"


def _code_mentions(path: Path, words: tuple[str, ...]) -> list[str]:
    """Lines where code (not a comment or docstring) names one of ``words``, outside the hint table."""
    found = []
    tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
    in_table = False
    previous = tokenize.NEWLINE
    for tok in tokens:
        if tok.type == tokenize.NAME and tok.string == HINT_TABLE:
            in_table = True
        if in_table and tok.type == tokenize.NEWLINE:
            in_table = False
        docstring = tok.type == tokenize.STRING and previous in (tokenize.NEWLINE, tokenize.INDENT, tokenize.NL, tokenize.DEDENT)
        if tok.type in (tokenize.NAME, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)) and not docstring and not in_table:
            if any(w in tok.string.lower() for w in words):
                found.append(f"{path.relative_to(CORE)}:{tok.start[0]}: {tok.line.strip()}")
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            previous = tok.type
    return found


def test_core_names_no_strategy() -> None:
    mentions = [m for p in sorted(CORE.rglob("*.py")) for m in _code_mentions(p, ("deepspeed", "fsdp", "ds_tensor", "torchft", "acc_train_ft", "ft-ddp"))]
    assert not mentions, "core's code names a strategy; move the fact into the strategy's package:\n" + "\n".join(mentions)
