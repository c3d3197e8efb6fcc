"""Prepare the wheels the device machine lacks, into bench/device/wheels/ (git-ignored), and report their size.

    python bench/device/prepare_wheels.py             # everything (needs the package registry)
    python bench/device/prepare_wheels.py --own-only  # only acc-train's five wheels (offline, seconds)

Run it with the test environment's python (``source /work/wtenv.sh WORKTREE``): the versions
carried are the ones installed there (so the device runs what CI tests), deepspeed is built there
(it is published as a source archive only; ``pip wheel --no-deps --no-build-isolation`` needs
torch), and acc-train's own packages are built there with hatchling. Third-party wheels are
downloaded for CPython 3.12 manylinux x86_64, one version each, with ``--no-deps``: what is
needed is decided here (``wheelset.plan_carry``), not by a resolver. A wheel already in the folder
at the planned version is kept; one no longer planned is removed.

The folder travels to the device in ``run``'s ``carry`` (``bench/device/wheels``); it and the
working tree together must stay under 64 MiB, which the report checks.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename

sys.path.insert(0, str(Path(__file__).resolve().parent))
import wheelset  # noqa: E402

WHEELS = wheelset.HERE / "wheels"
LIMIT = 64 * 2**20
#: the device README's platform tags: pip matches a manylinux_2_N tag exactly, so name several
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
#: published as source archives only: built here (deepspeed's build imports torch, which this environment has)
BUILT_HERE = {"deepspeed", "python-hostlist"}


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def wheel_key(path: Path) -> tuple[str, str]:
    name, version, _, _ = parse_wheel_filename(path.name)
    return str(name), str(version)


def build_own(dest: Path) -> list[Path]:
    """acc-train's five packages as wheels (hatchling from this environment, no network)."""
    for old in dest.glob("acc_train*.whl"):
        old.unlink()
    for folder in wheelset.ACC_TRAIN_PACKAGES:
        pip("wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dest), str(wheelset.ROOT / "packages" / folder))
    return sorted(dest.glob("acc_train*.whl"))


def fetch_third_party(dest: Path) -> list[wheelset.Carry]:
    carry, provided = wheelset.plan_carry()
    have = {wheel_key(p): p for p in dest.glob("*.whl") if not p.name.startswith("acc_train")}
    wanted = {(str(canonicalize_name(c.name)), c.version) for c in carry}
    for key, path in have.items():
        if key not in wanted:
            print(f"removing {path.name}: not in the plan")
            path.unlink()
    missing = [c for c in carry if (str(canonicalize_name(c.name)), c.version) not in have]
    downloads = [f"{c.name}=={c.version}" for c in missing if canonicalize_name(c.name) not in BUILT_HERE]
    if downloads:
        platforms = [a for p in PLATFORMS for a in ("--platform", p)]
        pip("download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest), *downloads)
    for c in missing:
        if canonicalize_name(c.name) in BUILT_HERE:
            pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dest), f"{c.name}=={c.version}")
    for stray in dest.glob("*.tar.gz"):  # pip wheel leaves nothing else, but be sure
        print(f"removing {stray.name}: {parse_sdist_filename(stray.name)[0]} must be a wheel")
        stray.unlink()
    print("\nthe image provides:")
    for name, why in sorted(provided.items()):
        print(f"  {name}: {why}")
    return carry


def tree_bytes() -> int:
    """What the device tool sends besides carried paths: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=wheelset.ROOT, capture_output=True, check=True)
    return sum((wheelset.ROOT / p).stat().st_size for p in out.stdout.decode().split("\0") if p and (wheelset.ROOT / p).is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--own-only", action="store_true", help="rebuild only acc-train's own wheels (offline)")
    parser.add_argument("--dest", type=Path, default=WHEELS)
    args = parser.parse_args()
    args.dest.mkdir(parents=True, exist_ok=True)
    carry = None if args.own_only else fetch_third_party(args.dest)
    own = build_own(args.dest)
    wheels = sorted(args.dest.glob("*.whl"))
    if carry is not None and args.dest == WHEELS:  # committed: the tests check this set without the wheels
        wheelset.write_carried(carry, [p for p in wheels if not p.name.startswith("acc_train")])
    size = sum(p.stat().st_size for p in wheels)
    tree = tree_bytes()
    print(f"\n{len(wheels)} wheels ({len(own)} acc-train's) in {args.dest}: {size / 2**20:.1f} MiB")
    for p in sorted(wheels, key=lambda p: -p.stat().st_size)[:8]:
        print(f"  {p.stat().st_size / 2**20:6.2f} MiB  {p.name}")
    print(f"working tree that travels: {tree / 2**20:.1f} MiB; with the wheels {(size + tree) / 2**20:.1f} MiB of the 64 MiB limit")
    if size + tree > LIMIT:
        sys.exit("over the device tool's 64 MiB limit")
    if carry is not None:  # the whole set: nothing it needs may be missing on the device
        problems = wheelset.unmet_requirements([wheelset.wheel_dist(p) for p in wheels])
        for p in problems:
            print(f"unmet on the device: {p}")
        if problems:
            sys.exit(f"{len(problems)} requirements would be unmet on the device")
        print("every requirement is met by the wheels or the image (bench/device/image_packages.txt)")


if __name__ == "__main__":
    main()
