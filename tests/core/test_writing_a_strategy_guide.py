"""docs/writing-a-strategy.md is enough to write a working plugin: the package made of the guide's
file blocks alone, installed with pip, shows up in ``acc-train strategies`` and trains."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from acc_train.testing import KitRuns
from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "writing-a-strategy.md"

pytestmark = [pytest.mark.launch, pytest.mark.xdist_group("writing-a-strategy-guide")]


def guide_files() -> dict[str, str]:
    """The guide's blocks headed by a file name (```lang title="PATH"), joined per file in order."""
    files: dict[str, str] = {}
    for path, body in re.findall(r'^```\w+ title="([^"]+)"\n(.*?)^```', GUIDE.read_text(), flags=re.M | re.S):
        files[path] = files.get(path, "") + body
    return files


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The guide's package, pip-installed (offline, into its own folder); the env that sees it."""
    src = tmp_path_factory.mktemp("guide-src")
    for rel, text in guide_files().items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    site = tmp_path_factory.mktemp("guide-site")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(site), str(src / "acc-train-strategy-mirror")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])), "SRC": str(src)}


def test_the_guide_holds_a_whole_package() -> None:
    assert set(guide_files()) == {
        "acc-train-strategy-mirror/pyproject.toml",
        "acc-train-strategy-mirror/src/acc_train_mirror/__init__.py",
        "acc-train-strategy-mirror/src/acc_train_mirror/plugin.py",
        "acc-train-strategy-mirror/tests/test_conformance.py",
    }


def test_installed_it_lists_its_strategy_policy_and_format(installed: dict[str, str]) -> None:
    env = {"PYTHONPATH": installed["PYTHONPATH"]}
    listing = run_cli("strategies", env=env)
    assert listing.returncode == 0, listing.stderr
    row = next(line for line in listing.stdout.splitlines() if line.startswith("mirror "))
    assert "mirrored, mirror-small-buckets" in row and "acc-train-strategy-mirror" in row and "0.1.0" in row
    assert "warning" not in listing.stderr, listing.stderr
    data = json.loads(run_cli("plugins", env=env).stdout)
    mirror = {p["name"]: p for p in data["plugins"]}["mirror"]
    assert mirror["distribution"] == "acc-train-strategy-mirror"
    assert mirror["registered"] == {"strategies": ["mirror"], "wrap_policies": ["every-linear"], "checkpoint_formats": ["mirror-full"]}
    assert not data["failures"]
    # the guide's conformance test module runs the kit's cheap checks as they stand
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-m", "not launch",
         "-o", "addopts=", "--rootdir", installed["SRC"], str(Path(installed["SRC"]) / "acc-train-strategy-mirror" / "tests")],
        capture_output=True, text=True, env={**os.environ, **env}, cwd=installed["SRC"], timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "2 passed" in proc.stdout, proc.stdout[-2000:]


def test_installed_it_trains_on_two_processes(installed: dict[str, str], tmp_path: Path) -> None:
    kit = KitRuns(tmp_path / "assets")
    out = tmp_path / "run"
    proc = run_cli(*kit.job_args("mirror", out, "--max-steps", "4", "--set", "checkpoint.every=2"), env={"PYTHONPATH": installed["PYTHONPATH"]})
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "run.json").read_text())
    assert (summary["strategy"], summary["world_size"], summary["steps"]) == ("mirror", 2, 4)
    assert summary["distributed_type"] == "DistributedType.MULTI_CPU"
    manifest = json.loads((out / "checkpoints" / "step-000004" / "manifest.json").read_text())
    assert manifest["format"] == "mirror-full" and "mirror.json" in manifest["files"]
