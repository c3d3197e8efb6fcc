"""The docs site (mkdocs.yml, docs/) is true to the code: it builds strictly, its config reference
holds every key of the live schema with its default and description, the committed support
matrix is what the pre-launch checks say today, the 7B guide's plan is what `acc-train plan`
prints, and the shell and YAML examples resolve (or are marked GPU-only, with the reason)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import click
import pytest
import yaml
from click.testing import CliRunner

from tests.conftest import ROOT

DOCS = ROOT / "docs"


def _generator(name: str) -> ModuleType:
    """A script of docs/_gen, imported under a name of its own (it is not a package)."""
    spec = importlib.util.spec_from_file_location(f"acc_train_docs_{name}", DOCS / "_gen" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


matrix = _generator("matrix")
reference = _generator("reference")

BUILTIN = ("ddp", "fsdp", "deepspeed")
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_gen" not in p.parts)
EXAMPLE_PAGES = [ROOT / "README.md", *PAGES]  # the README's examples are held to the same rule
GPU_ONLY = "<!-- gpu-only: "


def blocks(page: Path, lang: str) -> list[tuple[str, str, str]]:
    """(info after the language, body, the comment line just before the fence) of each block."""
    text = page.read_text()
    found = re.finditer(rf"(?:^(<!--[^\n]*-->)\n)?^```{lang}([^\n]*)\n(.*?)^```", text, flags=re.M | re.S)
    return [(m.group(2).strip(), m.group(3), m.group(1) or "") for m in found]


# ---- the schema and the config reference ----------------------------------------------------------


def _schema_keys(node: dict[str, Any], defs: dict[str, Any], prefix: str) -> list[tuple[str, dict[str, Any]]]:
    """Every key under ``node`` of the JSON Schema, nested sections included."""
    out = []
    for name, prop in node.get("properties", {}).items():
        path = prefix + name
        out.append((path, prop))
        for sub in [prop, *prop.get("anyOf", [])]:
            if "$ref" in sub:
                out += _schema_keys(defs[sub["$ref"].rsplit("/", 1)[1]], defs, path + ".")
    return out


def schema_keys() -> list[tuple[str, dict[str, Any]]]:
    """``acc-train config schema``'s keys: core's, then each built-in strategy's options."""
    from acc_train.config.json_schema import job_json_schema

    schema = job_json_schema()
    defs = schema["$defs"]
    keys = [(p, s) for p, s in _schema_keys(schema, defs, "") if p != "strategy"]
    for choice in schema["properties"]["strategy"]["anyOf"]:
        if choice.get("title", "").removeprefix("strategy ") in BUILTIN:
            keys += [(p, s) for p, s in _schema_keys(choice, defs, "strategy.") if p != "strategy.name"]
    return keys


def test_every_key_of_the_schema_has_a_description() -> None:
    missing = [path for path, prop in schema_keys() if not prop.get("description")]
    assert not missing, f"Field(description=...) missing for: {', '.join(missing)}"


def test_the_config_reference_has_every_key_with_its_default_and_description() -> None:
    page = reference.config_reference()
    entries = dict(re.findall(r"^#{2,4} `([^`]+)`\n\n(.*?)(?=^#{2,4} |\Z)", page, flags=re.M | re.S))
    for path, prop in schema_keys():
        assert path in entries, f"config reference: no entry for {path}"
        entry = " ".join(entries[path].split())
        assert " ".join(prop["description"].split()) in entry, f"{path}: the description differs from the schema's"
        if "default" in prop:
            assert f"**default** `{json.dumps(prop['default'])}`" in entry, f"{path}: default {prop['default']!r} not shown"


# ---- the support matrix ----------------------------------------------------------------------------


def test_the_committed_support_matrix_is_what_the_checks_say() -> None:
    assert matrix.PAGE.read_text() == matrix.render(), (
        "docs/reference/support-matrix.md differs from what the pre-launch checks say now: "
        "run `python -m hatch run docs:matrix` (python docs/_gen/matrix.py) and commit the page"
    )


def test_every_test_the_matrix_names_exists() -> None:
    from tests.matrix.combinations import COMBINATIONS

    for (row, column), test in matrix.TESTED.items():
        assert row in matrix.ROWS and column in matrix.COLUMNS, (row, column)
        path, name = test.split("::")
        name, _, param = name.partition("[")
        assert re.search(rf"^\s*def {name}\(", (ROOT / path).read_text(), flags=re.M), f"{row} x {column}: {test} is gone"
        if param:  # a combination of tests/matrix/combinations.py, which claims this cell
            combination = COMBINATIONS[param.rstrip("]")]
            assert (combination.row, column) == (row, column) and column in combination.columns, (row, column, test)


def test_the_device_checks_rows_the_matrix_names_exist() -> None:
    from tests.device.test_check import load_check

    rows = {r.name for r in load_check().ROWS}
    for cell, row in matrix.DEVICE.items():
        assert row in rows, (cell, row)


def test_every_accepted_cell_a_cpu_can_train_is_trained_by_a_test() -> None:
    """Rows that run on a CPU, in every column but a GPU's: accepted means a test trains it."""
    untrained = matrix.untrained_cpu_cells(matrix.cells())
    assert not untrained, f"accepted on a CPU row, and no test trains them: {untrained}"
    from tests.matrix.combinations import COMBINATIONS

    for name, combination in COMBINATIONS.items():
        assert combination.row in matrix.ROWS and set(combination.columns) <= set(matrix.COLUMNS), name


# ---- the site builds -------------------------------------------------------------------------------


@pytest.mark.docs
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """What `python -m hatch run docs:build` runs: a broken link, a missing page or a page
    left out of the nav fails it."""
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    config_page = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    assert "training.max_steps" in config_page and "strategy.bucket_cap_mb" in config_page
    assert "acc-train plan" in (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()


def test_every_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    generated = {"reference/config.md"}
    for page in PAGES:
        rel = page.relative_to(DOCS).as_posix()
        assert rel in nav or rel in generated, f"{rel} is not in mkdocs.yml's nav"


def test_every_code_block_is_closed_and_not_empty() -> None:
    for page in EXAMPLE_PAGES:
        fences = re.findall(r"^ *```.*$", page.read_text(), flags=re.M)
        assert len(fences) % 2 == 0, f"{page.name}: a code block is not closed"
        assert not re.search(r"^```\n```\n", page.read_text(), flags=re.M), f"{page.name}: an empty code block"


# ---- the 7B guide ----------------------------------------------------------------------------------

GUIDE = DOCS / "guides" / "fine-tune-7b-zero3.md"


def _guide_files(tmp_path: Path) -> None:
    for info, body, _ in [*blocks(GUIDE, "json"), *blocks(GUIDE, "yaml")]:
        name = re.search(r'title="([^"]+)"', info)
        name = name.group(1) if name else re.match(r"# (\S+\.yaml):", body).group(1)  # type: ignore[union-attr]
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(body)


def test_the_7b_guides_config_resolves_to_zero3_bf16_on_4_processes(tmp_path: Path) -> None:
    _guide_files(tmp_path)
    result = CliRunner().invoke(_cli(), ["--config", str(tmp_path / "seed-7b.yaml"), "--print-config"])
    assert result.exit_code == 0, result.output
    job = yaml.safe_load(result.stdout)
    assert job["strategy"]["name"] == "zero3" and job["training"]["mixed_precision"] == "bf16"
    assert job["optimizer"]["lr"] == 2e-5  # fine-tuning defaults


def test_the_7b_guides_plan_is_what_acc_train_plan_prints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guide's plan block is the command's output for 4 processes, up to the notes (rows of
    third-party strategies installed here left out)."""
    _guide_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(_cli(), ["plan", "--config", "seed-7b.yaml", "--num-processes", "4"])
    assert result.exit_code == 0, result.output
    builtin_rows = [line for line in result.stdout.splitlines() if "local-sgd" not in line]
    text = GUIDE.read_text()
    shown = text[text.index("```\nmodel: ./llama-7b") + 4 :].split("```", 1)[0]
    shown_rows = shown.splitlines()
    assert shown_rows == builtin_rows[: len(shown_rows)] and len(shown_rows) > 12, (
        "the guide's plan is stale: paste the table of `acc-train plan --config seed-7b.yaml --num-processes 4`"
    )


# ---- every example --------------------------------------------------------------------------------


def _cli() -> click.Group:
    from acc_train_cli.main import cli

    return cli


def _parse(args: list[str]) -> list[str]:
    """The command path click resolves ``acc-train ARGS`` to, every flag checked; a bad flag,
    command or value raises click's error."""
    cli = _cli()
    ctx = cli.make_context("acc-train", list(args))
    path, command = ["acc-train"], cli
    while isinstance(command, click.Group):
        rest = [*ctx._protected_args, *ctx.args]
        if not rest:
            break
        name, command, rest = command.resolve_command(ctx, rest)  # type: ignore[assignment]
        assert command is not None
        path.append(name)  # type: ignore[arg-type]
        ctx = command.make_context(name, rest, parent=ctx)
    return path


#: arguments that stand for a value the reader chooses
PLACEHOLDERS = {"R": "0", "N": "2", "H": "10.0.0.1", "P": "29500"}
#: commands run in-process (quick, nothing trained): the main command gets --print-config
RUN = {("acc-train",), ("acc-train", "strategies"), ("acc-train", "plugins"), ("acc-train", "env"),
       ("acc-train", "config", "schema"), ("acc-train", "config", "validate"), ("acc-train", "plan")}  # fmt: skip
#: pages whose examples another test runs in full
ELSEWHERE = {"writing-a-strategy.md": "tests/core/test_writing_a_strategy_guide.py"}


def _needs_missing_file(args: list[str], cwd: Path) -> bool:
    values = [a for i, a in enumerate(args) if not (i and args[i - 1] == "--output-dir")]
    return any(("/" in a or a.endswith((".yaml", ".json", ".py"))) and not (cwd / a).exists() for a in values if not a.startswith("-"))


def _page_files(page: Path, cwd: Path) -> None:
    for info, body, _ in [*blocks(page, "yaml"), *blocks(page, "json")]:
        name = re.search(r'title="([^"]+)"', info) or re.match(r"# (\S+\.yaml)", body)
        if name:
            (cwd / name.group(1)).parent.mkdir(parents=True, exist_ok=True)
            (cwd / name.group(1)).write_text(body)


@pytest.mark.parametrize("page", [p for p in EXAMPLE_PAGES if p.name not in ELSEWHERE], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_each_shell_example_parses_and_the_cheap_ones_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every `acc-train` line of a ```bash block is a command and flags the CLI has; the
    commands that train nothing run (a training command as far as --print-config: resolved);
    a block marked `<!-- gpu-only: REASON -->` is parsed only, and so is `plan --simulate`."""
    monkeypatch.chdir(tmp_path)
    _page_files(page, tmp_path)
    for _, body, comment in blocks(page, "bash"):
        gpu_only = comment.startswith(GPU_ONLY)
        if gpu_only:
            assert len(comment.removeprefix(GPU_ONLY).removesuffix("-->").strip()) > 10, f"{page.name}: say why it needs a GPU"
        for line in body.splitlines():
            line = re.split(r"\s+#", line)[0].strip()
            if not line.startswith("acc-train "):
                continue
            line, _, redirect = line.partition(" > ")
            args = [PLACEHOLDERS.get(a, a) for a in shlex.split(line)[1:]]
            with contextlib.redirect_stdout(io.StringIO()):
                try:
                    path = _parse(args)
                except click.exceptions.Exit:  # --help
                    continue
                except click.ClickException as exc:
                    pytest.fail(f"{page.name}: `{line}`: {exc.format_message()}")
            if gpu_only or tuple(path) not in RUN or _needs_missing_file(args, tmp_path):
                continue
            if "--simulate" in args:  # a minute of simulation per strategy: tests/cli/test_plan_simulate.py runs it
                continue
            if path == ["acc-train"] and "--print-config" not in args:
                args.append("--print-config")
            result = CliRunner().invoke(_cli(), args)
            assert result.exit_code == 0, f"{page.name}: `{line}` exited {result.exit_code}:\n{result.output[-2000:]}"
            if redirect:
                (tmp_path / redirect.strip()).write_text(result.stdout)


def test_the_accelerate_config_and_its_acc_train_twin_resolve_to_one_job(tmp_path: Path) -> None:
    from acc_train.config.resolve import load_job

    files = {}
    for _, body, _ in blocks(DOCS / "guides" / "from-accelerate-launch.md", "yaml"):
        name = re.match(r"# (\S+\.yaml)", body)
        if name:
            (tmp_path / name.group(1)).write_text(body)
            files[name.group(1)] = load_job(tmp_path / name.group(1)).to_dict()
    assert set(files) == {"accelerate.yaml", "job.yaml"}
    assert files["accelerate.yaml"] == files["job.yaml"]


#: YAML blocks that are not job configs, and the test that checks each
NOT_JOBS = {"kind: PyTorchJob": "tests/cli/test_cluster.py", "output_type: multiple_choice": "tests/core/test_harness.py"}


@pytest.mark.parametrize("page", [p for p in EXAMPLE_PAGES if blocks(p, "yaml")], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_each_yaml_example_is_a_job_that_resolves(page: Path, tmp_path: Path) -> None:
    """A job config, or a part of one, as `acc-train --config FILE --print-config` resolves it."""
    from acc_train.config.resolve import load_job

    for _, body, _ in blocks(page, "yaml"):
        if any(marker in body for marker in NOT_JOBS):
            continue
        path = tmp_path / "example.yaml"
        path.write_text(body)
        with contextlib.redirect_stderr(io.StringIO()):
            load_job(path)  # a UserError names the key and the line
