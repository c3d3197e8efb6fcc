"""Which wheels the device machine needs carried: acc-train's requirements against the image's packages.

The device machine (Python 3.12, manylinux x86_64, no network) has the packages listed in
``image_packages.txt``; everything else acc-train's five packages need, directly or through a
package that is carried, travels as a wheel and is installed there with
``pip install --no-index --no-deps --target``. :func:`plan_carry` decides what to carry from the
versions this (test) environment resolved; :func:`unmet_requirements` checks a wheel set against the
image, reading each wheel's own METADATA.
"""

from __future__ import annotations

import email
import json
import re
import tomllib
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

__all__ = [
    "ACC_TRAIN_PACKAGES",
    "DEVICE_MARKERS",
    "PINNED",
    "TRUST_IMAGE",
    "Carry",
    "acc_train_requirements",
    "image_packages",
    "plan_carry",
    "CARRIED",
    "Dist",
    "own_dists",
    "read_carried",
    "unmet_requirements",
    "wheel_dist",
    "write_carried",
]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

#: acc-train's own distributions, built here as wheels (the image has no hatchling)
ACC_TRAIN_PACKAGES = ("core", "cli", "strategy-ddp", "strategy-deepspeed", "strategy-fsdp")

#: the device's interpreter, for evaluating environment markers (KINDS.md: Python 3.12.3, x86-64 Linux)
DEVICE_MARKERS = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "platform_python_implementation": "CPython",
    "platform_machine": "x86_64",
    "platform_system": "Linux",
    "sys_platform": "linux",
    "os_name": "posix",
    "extra": "",
}

#: image packages whose version nobody has read there but which are too big to carry (or must
#: not be replaced: torch is the image's CUDA build): the image's copy is used whatever it is, and
#: check.py logs its version before the rows run
TRUST_IMAGE = {
    "torch": "the image's CUDA build (~530 MB); cannot travel",
    "numpy": "native, ~16 MB; torch and everything else in the image are built against it",
    "pyarrow": "native, ~40 MB",
    "pandas": "native, ~12 MB",
    "matplotlib": "native, ~8 MB",
}


def image_packages(path: Path = HERE / "image_packages.txt") -> dict[str, Version | None]:
    """The image's packages by canonical name, with the version where one was seen."""
    out: dict[str, Version | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonicalize_name(name)] = Version(version) if version else None
    return out


def applies(req: Requirement) -> bool:
    """A requirement the device's Python installs (its marker holds there; no extra asked for)."""
    return req.marker is None or req.marker.evaluate(DEVICE_MARKERS)


def acc_train_requirements(root: Path = ROOT) -> dict[str, list[Requirement]]:
    """Each acc-train distribution's runtime requirements, from its pyproject.toml."""
    out = {}
    for folder in ACC_TRAIN_PACKAGES:
        project = tomllib.loads((root / "packages" / folder / "pyproject.toml").read_text())["project"]
        out[project["name"]] = [Requirement(r) for r in project.get("dependencies", [])]
    return out


@dataclass(frozen=True)
class Carry:
    """One third-party distribution to carry, at the version this environment has."""

    name: str
    version: str
    why: str


#: carried at this environment's versions even where the image's would meet the requirements:
#: the device then runs the Accelerate and transformers that CI tests (the image has accelerate
#: 1.15 and transformers 5.17; hatch.toml pins neither, so these are what the test env resolved)
PINNED = ("accelerate", "transformers")


def plan_carry(image: dict[str, Version | None] | None = None, root: Path = ROOT, pinned: tuple[str, ...] = PINNED) -> tuple[list[Carry], dict[str, str]]:
    """What to carry, at this environment's versions, and what the image provides (name -> why).

    Walks acc-train's requirements, then the requirements of every package that is carried (the
    image's own packages bring their own). A package is the image's when the image has a version
    that meets every specifier seen for it, when it has the package and nothing constrains the
    version, or when it is in :data:`TRUST_IMAGE`; otherwise it is carried. ``pinned`` names are
    always carried.
    """
    image = image_packages() if image is None else image
    own = {canonicalize_name(n) for n in acc_train_requirements(root)}
    specs: dict[str, list[Requirement]] = {}
    queue = [r for reqs in acc_train_requirements(root).values() for r in reqs if applies(r)]
    carried: dict[str, Carry] = {}
    provided: dict[str, str] = {}
    while queue:
        req = queue.pop(0)
        name = canonicalize_name(req.name)
        if name in own:
            continue
        specs.setdefault(name, []).append(req)
        decision = None if name in pinned else _decide(name, specs[name], image)
        if decision is not None:  # the image's
            provided[name] = decision
            carried.pop(name, None)
            continue
        provided.pop(name, None)
        if name in carried:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError as exc:
            raise SystemExit(f"{name} is needed ({req}) but not installed in this environment: run this with the test environment's python") from exc
        version = dist.version
        bad = [str(r) for r in specs[name] if version not in r.specifier]
        if bad:
            raise SystemExit(f"this environment's {name} {version} does not meet {bad}")
        held = image.get(name, False)
        why = "pinned: the test environment's version" if name in pinned else "not in the image" if held is False else f"the image's {held} is too old" if held else "the image's version is unknown and it is constrained"
        carried[name] = Carry(dist.metadata["Name"], version, why)
        queue += [r for r in (Requirement(s) for s in dist.requires or []) if applies(r)]
    return sorted(carried.values(), key=lambda c: canonicalize_name(c.name)), provided


def _decide(name: str, reqs: list[Requirement], image: dict[str, Version | None]) -> str | None:
    """Why the image's copy of ``name`` will do, or None when it must be carried."""
    if name not in image:
        return None
    version = image[name]
    if version is not None:
        ok = all(version in r.specifier for r in reqs)
        return f"the image's {version} meets {', '.join(str(r.specifier) or 'any' for r in reqs)}" if ok else None
    if name in TRUST_IMAGE:
        return f"the image's (version unread): {TRUST_IMAGE[name]}"
    if all(not r.specifier for r in reqs):
        return "the image's (version unread; nothing constrains it)"
    return None


@dataclass(frozen=True)
class Dist:
    """A distribution as the device will have it: name, version, runtime requirements."""

    name: str
    version: Version
    requires: tuple[Requirement, ...]


def wheel_dist(wheel: Path) -> Dist:
    """A wheel's name, version and requirements, from its METADATA."""
    name, version, _, _ = parse_wheel_filename(wheel.name)
    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        msg = email.message_from_bytes(zf.read(meta_name))
    return Dist(str(name), version, tuple(Requirement(r) for r in msg.get_all("Requires-Dist") or []))


def own_dists(root: Path = ROOT) -> list[Dist]:
    """acc-train's five distributions as their wheels will be, from the pyproject.toml files."""
    out = []
    for folder in ACC_TRAIN_PACKAGES:
        project = tomllib.loads((root / "packages" / folder / "pyproject.toml").read_text())["project"]
        out.append(Dist(str(canonicalize_name(project["name"])), Version(project["version"]), tuple(Requirement(r) for r in project.get("dependencies", []))))
    return out


CARRIED = HERE / "carried.json"


def write_carried(carry: list[Carry], wheels: list[Path], path: Path = CARRIED) -> None:
    """The carry list with each wheel's requirements that apply on the device (from its METADATA;
    extras and other platforms' left out), so the tests check the set without the wheels (they
    are git-ignored) and whatever versions the test environment resolves."""
    why = {str(canonicalize_name(c.name)): c.why for c in carry}
    rows = []
    for wheel in wheels:
        dist = wheel_dist(wheel)
        if dist.name in why:
            rows.append({"name": dist.name, "version": str(dist.version), "why": why[dist.name], "wheel": wheel.name, "requires": [str(r) for r in dist.requires if applies(r)]})
    missing = set(why) - {r["name"] for r in rows}
    if missing:
        raise SystemExit(f"planned but no wheel prepared: {sorted(missing)}")
    doc = {
        "about": "written by bench/device/prepare_wheels.py: the third-party wheels carried to the device (acc-train's five travel too); tests/device/test_wheels.py checks this set",
        "carried": sorted(rows, key=lambda r: r["name"]),
    }
    path.write_text(json.dumps(doc, indent=1) + "\n")


def read_carried(path: Path = CARRIED) -> list[Dist]:
    """The committed carry list as distributions (name, version, requirements)."""
    return [Dist(r["name"], Version(r["version"]), tuple(Requirement(q) for q in r["requires"])) for r in json.loads(path.read_text())["carried"]]


def unmet_requirements(dists: list[Dist], image: dict[str, Version | None] | None = None) -> list[str]:
    """Every requirement of ``dists`` (acc-train's and the carried ones) that neither a carried
    distribution nor the image meets on the device's Python; empty when the set is complete.

    A carried distribution is checked by its version; an image package by its seen version, or,
    where none was seen, accepted only if nothing constrains it or it is in :data:`TRUST_IMAGE`.
    Two of one name are a problem too (the install would stop).
    """
    image = image_packages() if image is None else image
    carried: dict[str, Version] = {}
    problems: list[str] = []
    for dist in dists:
        name = str(canonicalize_name(dist.name))
        if name in carried:
            problems.append(f"two of {name}: {carried[name]} and {dist.version}")
        carried[name] = dist.version
    for dist in dists:
        for req in (r for r in dist.requires if applies(r)):
            name = str(canonicalize_name(req.name))
            owner = f"{dist.name} {dist.version}"
            if name in carried:
                if not req.specifier.contains(carried[name], prereleases=True):
                    problems.append(f"{owner} needs {req}; the carried one is {carried[name]}")
            elif _decide(name, [req], image) is None:
                held = image.get(name, False)
                problems.append(f"{owner} needs {req}; " + ("neither carried nor in the image" if held is False else f"the image has {held or 'a version nobody read'}"))
    return problems
