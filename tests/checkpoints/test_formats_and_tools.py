"""What core's checkpoint code learns from the registered formats and plugins rather than
knowing it: the convert targets, how a format's own files are read for convert and export,
and the library versions in a manifest. In one process, with in-test plugins registered in
fixtures; no launches."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from acc_train import UserError, hookimpl, plugins
from acc_train.checkpoint import (
    MANIFEST,
    CheckpointFormat,
    file_table,
    flatten_optimizer_state,
    read_portable_full,
    verify_checkpoint,
    write_json,
)
from acc_train.checkpoint_tools import convert_checkpoint, convert_targets
from acc_train.plugins import library_versions


@pytest.fixture(autouse=True)
def fresh_plugins() -> Iterator[None]:
    plugins.reset()
    yield
    plugins.reset()


def register(plugin: object, name: str) -> None:
    plugins.get_plugin_manager().register(plugin, name=name)


class PortableOnly(CheckpointFormat):
    """Resumes from the portable state alone: a convert target."""

    name = "portable-only"
    writes_portable = True
    convert_target = True

    def save(self, accelerator: Any, model: Any, optimizer: Any, directory: Path) -> None:
        raise NotImplementedError

    def load(self, accelerator: Any, model: Any, optimizer: Any, directory: Path) -> None:
        raise NotImplementedError


class ByName(CheckpointFormat):
    """Writes no portable state, but one safetensors file keyed by name, which it reads back."""

    name = "by-name"

    def save(self, accelerator: Any, model: Any, optimizer: Any, directory: Path) -> None:
        raise NotImplementedError

    def load(self, accelerator: Any, model: Any, optimizer: Any, directory: Path) -> None:
        raise NotImplementedError

    def read_full_state(self, directory: Path, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return {f"model.{k}": v for k, v in load_file(str(directory / "weights.safetensors")).items()}


class FormatsPlugin:
    @hookimpl
    def acc_train_register_checkpoint_formats(self, register: Any) -> None:
        register(PortableOnly())
        register(ByName())


def _checkpoint(directory: Path, fmt: str, write_state: Any) -> Path:
    """A committed checkpoint of ``fmt`` at step 3 on one rank: the format's files (written by
    ``write_state``), trainer state, RNG and a manifest over all of them."""
    from safetensors.torch import save_file

    directory.mkdir()
    write_state(directory)
    write_json(directory / "trainer_state.json", {"step": 3, "epoch": 0, "scheduler": {}})
    write_json(directory / "rng-rank00000.json", {"python": None})
    save_file({"torch": torch.zeros(4, dtype=torch.uint8)}, str(directory / "rng-rank00000.safetensors"))
    manifest = {"format": fmt, "portable": None, "step": 3, "world_size": 1, "files": file_table(directory)}
    write_json(directory / MANIFEST, manifest)
    return directory


def test_convert_targets_are_the_registered_formats_that_say_so() -> None:
    assert convert_targets() == ["dcp", "deepspeed"]  # the workspace's: fsdp-full and local-sgd's are not
    plugins.reset()
    register(FormatsPlugin(), "formats")
    assert convert_targets() == ["dcp", "deepspeed", "portable-only"]
    with pytest.raises(UserError) as info:
        convert_checkpoint("unused", "by-name", "unused")
    assert "cannot convert to 'by-name'" in str(info.value)
    assert info.value.hint == "choose one of: dcp, deepspeed, portable-only"


def test_convert_reads_a_format_s_own_files_through_the_format(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    weights = {"layer.weight": torch.randn(3, 2), "layer.bias": torch.randn(3)}
    source = _checkpoint(tmp_path / "source", "by-name", lambda d: save_file(weights, str(d / "weights.safetensors")))
    with pytest.raises(UserError, match="checkpoint format 'by-name' has no portable state to convert"):
        convert_checkpoint(str(source), "dcp", str(tmp_path / "unregistered"))  # nothing knows its files
    assert not (tmp_path / "unregistered").exists()

    plugins.reset()  # the registry is read once per process
    register(FormatsPlugin(), "formats")
    out = convert_checkpoint(str(source), "dcp", str(tmp_path / "out"))
    manifest = verify_checkpoint(out)
    assert manifest["format"] == "dcp" and manifest["portable"] == "state" and manifest["converted_from"]["format"] == "by-name"
    assert {"trainer_state.json", "rng-rank00000.json", "rng-rank00000.safetensors"} <= set(manifest["files"])
    converted = read_portable_full(out)
    assert converted.keys() == {f"model.{k}" for k in weights}
    for key, tensor in weights.items():
        torch.testing.assert_close(converted[f"model.{key}"], tensor, rtol=0, atol=0)


def test_an_fsdp_full_checkpoint_converts_through_the_fsdp_package_s_format(tmp_path: Path) -> None:
    """``fsdp-full``'s gathered files (model.safetensors, optimizer.safetensors + JSON, keyed by
    name) become the portable state: read by ``FullFormat.read_full_state``, not by core."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict

    pytest.importorskip("acc_train_fsdp")
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.LayerNorm(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 2)).sum().backward()
    optimizer.step()
    msd, osd = get_state_dict(model, optimizer)  # keyed by name, as FullFormat.save writes them

    def write_full(directory: Path) -> None:
        save_file({k: v.detach().clone() for k, v in msd.items()}, str(directory / "model.safetensors"))
        tensors, meta = flatten_optimizer_state(osd)
        save_file(tensors, str(directory / "optimizer.safetensors"))
        (directory / "optimizer.json").write_text(json.dumps(meta))

    source = _checkpoint(tmp_path / "source", "fsdp-full", write_full)
    out = convert_checkpoint(str(source), "dcp", str(tmp_path / "out"), world_size=2)
    assert verify_checkpoint(out)["world_size"] == 2
    converted = read_portable_full(out)
    expected = {f"model.{k}": v for k, v in msd.items()}
    expected |= {f"optim.state.{fqn}.{name}": v for fqn, state in osd["state"].items() for name, v in state.items()}
    assert converted.keys() == expected.keys()
    for key, tensor in expected.items():
        torch.testing.assert_close(converted[key], tensor, rtol=0, atol=0)


class VersionsPlugin:
    @hookimpl
    def acc_train_library_versions(self) -> dict[str, str]:
        return {"my-backend": "1.2.3", "torch": "0.0.1"}


def test_library_versions_come_from_every_plugin_core_s_first(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib.metadata import version

    versions = library_versions()
    assert list(versions)[:2] == ["acc-train-core", "torch"] and versions["torch"] == version("torch")
    assert versions["deepspeed"] == version("deepspeed")  # reported by acc-train-strategy-deepspeed's plugin
    owners = [impl.plugin_name for impl in plugins.get_plugin_manager().hook.acc_train_library_versions.get_hookimpls()]
    assert "builtin" in owners and "deepspeed" in owners

    plugins.reset()
    monkeypatch.setenv(plugins.ENV_BLOCK, "deepspeed")
    register(VersionsPlugin(), "versions")
    versions = library_versions()
    assert "deepspeed" not in versions  # core itself names no strategy's library
    assert versions["my-backend"] == "1.2.3" and versions["torch"] == version("torch")  # core's answer stands
