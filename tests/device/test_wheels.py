"""The device kit's wheel set: everything acc-train needs on the H200's Python 3.12 is either
carried (``bench/device/carried.json``, prepared by ``bench/device/prepare_wheels.py``) or in the
image (``bench/device/image_packages.txt``, from the device tool's KINDS.md), and the wheels
install with ``pip install --no-index --no-deps --target`` into a folder from which acc-train and
its three strategies import and register."""

from __future__ import annotations

import json
import os
from importlib import metadata
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
DEVICE = ROOT / "bench" / "device"
WHEELS = DEVICE / "wheels"
sys.path.insert(0, str(DEVICE))
import wheelset  # noqa: E402

#: the device's interpreter, for pip's wheel tags
DEVICE_TAGS = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
               *(a for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64") for a in ("--platform", p))]  # fmt: skip


def prepared_wheels() -> list[Path]:
    """The prepared third-party wheels, or skip (they are git-ignored; prepare_wheels.py makes them)."""
    wheels = sorted(p for p in WHEELS.glob("*.whl") if not p.name.startswith("acc_train"))
    if not wheels:
        pytest.skip(f"no prepared wheels in {WHEELS.relative_to(ROOT)}: run `python bench/device/prepare_wheels.py` (needs the package registry)")
    return wheels


def test_the_image_list_is_kinds_md_s() -> None:
    image = wheelset.image_packages()
    assert len(image) > 150
    assert str(image["torch"]) == "2.11.0" and str(image["accelerate"]) == "1.15.0" and str(image["transformers"]) == "5.17.0"
    for absent in ("deepspeed", "datasets", "pydantic", "hjson", "python-hostlist"):
        assert absent not in image


def test_carried_set_and_image_meet_every_requirement_on_python_312() -> None:
    """acc-train's requirements from its pyproject.toml, each carried package's from its wheel's
    METADATA (recorded in carried.json), markers evaluated for CPython 3.12 on x86-64 Linux."""
    carried = wheelset.read_carried()
    names = {d.name for d in carried}
    assert {"deepspeed", "datasets", "pydantic", "pydantic-core", "accelerate", "transformers", "huggingface-hub", "kernels"} <= names
    assert wheelset.unmet_requirements([*wheelset.own_dists(), *carried]) == []


def test_an_unmet_requirement_is_found() -> None:
    """The check can fail: without the carried set, acc-train's requirements are unmet, and a
    carried package too old for its dependant is named."""
    problems = wheelset.unmet_requirements(wheelset.own_dists())
    assert any("needs pydantic>=2.7; neither carried nor in the image" in p for p in problems)
    assert any("needs deepspeed>=0.16" in p for p in problems)
    carried = [d for d in wheelset.read_carried() if d.name != "huggingface-hub"]
    old_hub = wheelset.Dist("huggingface-hub", wheelset.Version("1.0.0"), ())
    problems = wheelset.unmet_requirements([*wheelset.own_dists(), *carried, old_hub])
    assert any(p.startswith("transformers ") and "huggingface-hub" in p and "the carried one is 1.0.0" in p for p in problems), problems


def test_accelerate_and_transformers_are_the_test_environments() -> None:
    """The device runs the Accelerate and transformers CI tests: carried at the versions this
    environment has, which hatch.toml pins."""
    carried = {d.name: str(d.version) for d in wheelset.read_carried()}
    hatch = (ROOT / "hatch.toml").read_text()
    for name in wheelset.PINNED:
        assert carried[name] == metadata.version(name), f"rerun bench/device/prepare_wheels.py: {name} is {metadata.version(name)} here"
        assert f'"{name}=={carried[name]}"' in hatch, f"hatch.toml does not pin {name}=={carried[name]}"


def test_the_prepared_wheels_are_the_carried_set_and_fit() -> None:
    wheels = prepared_wheels()
    got = {(d.name, d.version, frozenset(map(str, d.requires))) for d in (wheelset.wheel_dist(p) for p in wheels)}
    want = {(d.name, d.version, frozenset(map(str, d.requires))) for d in wheelset.read_carried()}
    assert {(n, v) for n, v, _ in got} == {(n, v) for n, v, _ in want}, "rerun bench/device/prepare_wheels.py"
    own = sorted(WHEELS.glob("acc_train*.whl"))
    assert len(own) == 5, own
    assert wheelset.unmet_requirements([wheelset.wheel_dist(p) for p in [*wheels, *own]]) == []
    assert sum(p.stat().st_size for p in [*wheels, *own]) < 48 * 2**20  # leaves the tree 16 of the 64 MiB


@pytest.fixture(scope="module")
def own_wheels(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """acc-train's five wheels, built from this tree now (offline; hatchling from the test env)."""
    dest = tmp_path_factory.mktemp("own-wheels")
    proc = subprocess.run([sys.executable, str(DEVICE / "prepare_wheels.py"), "--own-only", "--dest", str(dest)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    wheels = sorted(dest.glob("acc_train*.whl"))
    assert len(wheels) == 5
    return wheels


def test_the_whole_set_installs_for_python_312_without_an_index(own_wheels: list[Path], tmp_path: Path) -> None:
    """The device's install command (no index, no resolution, one version each), for its Python."""
    wheels = [*prepared_wheels(), *own_wheels]
    target = tmp_path / "site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--target", str(target), *DEVICE_TAGS, *map(str, wheels)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for package in ("acc_train", "acc_train_cli", "acc_train_ddp", "acc_train_fsdp", "acc_train_deepspeed", "deepspeed", "datasets", "pydantic_core", "transformers"):
        assert (target / package).is_dir(), package


REGISTERED = """
import json, importlib.metadata as md
import acc_train, acc_train_ddp, acc_train_fsdp, acc_train_deepspeed, acc_train_cli
from acc_train.plugins import plugin_failures, strategies
print(json.dumps({
    "files": {m.__name__: m.__file__ for m in (acc_train, acc_train_ddp, acc_train_fsdp, acc_train_deepspeed, acc_train_cli)},
    "entry_points": {f"{ep.name}={ep.value}": str(ep.dist.locate_file("")) for ep in md.entry_points(group="acc_train")},
    "strategies": {name: strategies().owner(name) for name in strategies().names()},
    "failures": [str(f) for f in plugin_failures()],
}))
"""


def test_acc_train_and_its_strategies_import_and_register_from_the_wheels(own_wheels: list[Path], tmp_path: Path) -> None:
    """Installed with this machine's Python into a fresh folder (the third-party packages from
    this environment: the prepared ones are built for 3.12), found through their entry points."""
    target = tmp_path / "site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", str(target), *map(str, own_wheels)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(target)}  # the wheels alone: not this tree's sources
    proc = subprocess.run([sys.executable, "-c", REGISTERED], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for module, path in got["files"].items():
        assert path.startswith(str(target)), (module, path)
    ours = ("ddp=acc_train_ddp.plugin", "fsdp=acc_train_fsdp.plugin", "deepspeed=acc_train_deepspeed.plugin")
    for ep in ours:  # registered by the installed wheels' metadata, not an editable install elsewhere
        assert got["entry_points"].get(ep, "").startswith(str(target)), (ep, got["entry_points"])
    assert got["failures"] == []
    owners = got["strategies"]
    assert {"ddp", "fsdp", "zero3"} <= set(owners), owners
    assert [owners[n] for n in ("ddp", "fsdp", "zero3")] == ["ddp", "fsdp", "deepspeed"], owners  # the entry points' names
