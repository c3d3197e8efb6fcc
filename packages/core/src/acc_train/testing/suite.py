"""The standard suite: what every acc-train strategy must do, checked the way a user sees it.

Each test takes ``acc_train_strategy_name`` (parametrized by the kit's pytest plugin from the
``acc_train_strategy`` marker or ``--acc-train-strategy``) and ``acc_train_kit`` (the session's
:class:`acc_train.testing.KitRuns`). Failures say what the strategy got wrong.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from acc_train.outputs.metrics import MetricsRow, read_metrics
from acc_train.testing.runs import KIT_RESUME_STEP, KIT_STEPS, REFERENCE_STRATEGY, KitRuns

__all__ = ["TestStrategyConformance"]

_PROBE = r"""
import json, sys
from acc_train import Strategy, StrategyOptions, plugins
name = sys.argv[1]
reg = plugins.strategies()
out = {"names": reg.names(), "failures": [str(f) for f in plugins.plugin_failures()]}
if name in out["names"]:
    s = reg.get(name)
    out.update(
        owner=reg.owner(name),
        is_strategy=isinstance(s, Strategy),
        primary=s.name,
        schema_ok=isinstance(s.options_schema, type) and issubclass(s.options_schema, StrategyOptions),
        infos={i.name: i.distribution for i in plugins.plugin_infos()},
    )
out["heavy_imports"] = sorted(m for m in ("torch", "accelerate", "transformers") if m in sys.modules)  # every heavy library imports torch
print(json.dumps(out))
"""


def _metrics(run: Path) -> dict[int, MetricsRow]:
    return read_metrics(run).steps


_MISSING = object()  # a key run.json lacks


def _fact(summary: dict[str, Any], key: str) -> Any:
    """run.json's value at ``key`` (dots reach into nested objects), or :data:`_MISSING`."""
    node: Any = summary
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _strategy(name: str) -> Any:
    """The strategy configured with its default options (or its preset's), in this process."""
    from acc_train import plugins
    from acc_train.config import resolve_strategy

    plugins.reset()  # see the installed plugins, not what another test registered in-process
    return resolve_strategy(name)


class TestStrategyConformance:
    """acc-train's conformance suite for one strategy (see :mod:`acc_train.testing`)."""

    def test_registers_and_lists(self, acc_train_strategy_name: str) -> None:
        name = acc_train_strategy_name
        probe = subprocess.run([sys.executable, "-c", _PROBE, name], capture_output=True, text=True, timeout=300)
        assert probe.returncode == 0, f"loading the plugins failed:\n{probe.stderr[-3000:]}"
        found = json.loads(probe.stdout.strip().splitlines()[-1])
        assert name in found["names"], (
            f'strategy "{name}" is not registered; registered: {", ".join(found["names"]) or "none"}. '
            f"Plugin problems: {found['failures'] or 'none'}. Is the package installed, with an "
            "[project.entry-points.acc_train] entry and an acc_train_register_strategies hook?"
        )
        owner = found["owner"]
        problems = [f for f in found["failures"] if f'plugin "{owner}"' in f]
        assert not problems, f'plugin "{owner}" breaks the hook contract: {problems}'
        assert found["is_strategy"], f'"{name}" was registered, but not as an acc_train.Strategy instance'
        assert found["schema_ok"], f'"{name}".options_schema must be a subclass of acc_train.StrategyOptions'
        assert not found["heavy_imports"], (
            f"loading the plugins imported {found['heavy_imports']}: import heavy libraries inside the "
            "strategy's methods, so listing strategies and --help stay fast"
        )
        listing = subprocess.run(
            [sys.executable, "-m", "acc_train_cli", "strategies"], capture_output=True, text=True, timeout=300
        )
        assert listing.returncode == 0, listing.stderr[-3000:]
        rows = [line.split()[0] for line in listing.stdout.splitlines()[1:] if line.strip()]
        assert found["primary"] in rows, f'`acc-train strategies` does not list "{found["primary"]}":\n{listing.stdout}'
        plugins_json = subprocess.run(
            [sys.executable, "-m", "acc_train_cli", "plugins"], capture_output=True, text=True, timeout=300
        )
        assert plugins_json.returncode == 0, plugins_json.stderr[-3000:]
        entry = {p["name"]: p for p in json.loads(plugins_json.stdout)["plugins"]}.get(owner)
        assert entry is not None and found["primary"] in entry["registered"].get("strategies", []), (
            f'`acc-train plugins` does not show plugin "{owner}" registering "{found["primary"]}"'
        )

    def test_options_schema_rejects_unknown_keys(self, acc_train_strategy_name: str) -> None:
        from pydantic import BaseModel

        from acc_train import UserError
        from acc_train.config import load_job

        name = acc_train_strategy_name
        strategy = _strategy(name)
        flags = {"strategy.name": (name, "--strategy")}
        job = load_job(flags=flags)  # its defaults validate
        assert job.strategy.options == strategy.options
        paths = ["strategy.no_such_option_kit"]
        for field, info in strategy.options_schema.model_fields.items():
            nested = info.annotation
            for candidate in (nested, *getattr(nested, "__args__", ())):
                if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                    paths.append(f"strategy.{field}.no_such_option_kit")
                    break
        for path in paths:
            try:
                accepted = load_job(flags=flags, sets=[f"{path}=1"])
            except UserError as exc:
                assert path in str(exc), f"the error for the unknown key {path} does not name it: {exc}"
            else:
                raise AssertionError(
                    f'the options schema of "{name}" accepted the unknown key {path} '
                    f"(parsed as {accepted.strategy.options!r}); derive it from acc_train.StrategyOptions, "
                    'which sets extra="forbid", at every level'
                )

    @pytest.mark.launch
    def test_trains_on_two_cpu_processes(self, acc_train_strategy_name: str, acc_train_kit: KitRuns) -> None:
        name = acc_train_strategy_name
        _strategy(name)  # an unknown name fails here, before a launch
        run = acc_train_kit.full(name)
        summary = json.loads((run / "run.json").read_text())
        assert summary["world_size"] == 2 and summary["steps"] == KIT_STEPS, summary
        assert summary["strategy"] == name
        metrics = _metrics(run)
        assert sorted(metrics) == list(range(1, KIT_STEPS + 1)), "metrics.jsonl must log every step"
        losses = [metrics[s]["loss"] for s in sorted(metrics)]
        assert all(math.isfinite(v) for v in losses), losses
        assert losses[-1] < losses[0], f"the loss did not fall in {KIT_STEPS} steps: {losses}"
        final = run / "final"
        assert (final / "config.json").is_file(), "final/ holds no save_pretrained model"
        self._final_model(run)

    @staticmethod
    def _final_model(run: Path) -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(run / "final")
        logits = model(torch.tensor([[2, 3, 4, 5]])).logits
        assert torch.isfinite(logits).all(), "the exported model gives non-finite logits"
        return model

    @pytest.mark.launch
    def test_exported_model_holds_the_checkpointed_weights(self, acc_train_strategy_name: str, acc_train_kit: KitRuns) -> None:
        """``final/`` holds the weights of the last checkpoint, where its format can give the whole
        state (``CheckpointFormat.read_full_state``): the exported model is the trained one."""
        import torch

        from acc_train import UserError
        from acc_train.checkpoint_tools import read_full_state

        name = acc_train_strategy_name
        _strategy(name)
        run = acc_train_kit.full(name)
        model = self._final_model(run)
        last = run / "checkpoints" / f"step-{KIT_STEPS:06d}"
        try:
            saved = read_full_state(last, json.loads((last / "manifest.json").read_text()))
        except UserError as exc:  # a format that keeps no whole state (per-rank replicas, say)
            pytest.skip(f"the checkpoint format gives no whole state to compare with: {exc}")
        for key, tensor in model.state_dict().items():
            assert f"model.{key}" in saved, f"final/ has {key}, which the step-{KIT_STEPS} checkpoint lacks"
            assert torch.allclose(tensor.float(), saved[f"model.{key}"].float(), rtol=0, atol=1e-6), (
                f"final/'s {key} differs from the step-{KIT_STEPS} checkpoint's: the exported model is not the trained one "
                "(full_state_dict must gather the trained weights, and where ranks hold different replicas the checkpoint must keep each)"
            )

    @pytest.mark.launch
    def test_runs_as_the_distributed_type_it_claims(self, acc_train_strategy_name: str, acc_train_kit: KitRuns) -> None:
        """run.json's ``distributed_type`` is Accelerate's state during the run; it must be one the
        strategy accepts on 2 CPU processes and, where the strategy declares which Accelerate
        types it is (``accelerate_distributed_types``), one of those: never a silent fallback."""
        from acc_train import Machine

        name = acc_train_strategy_name
        strategy = _strategy(name)
        ran = json.loads((acc_train_kit.full(name) / "run.json").read_text())["distributed_type"].removeprefix("DistributedType.")
        expected = strategy.bind(Machine("cpu", 2)).expected_distributed_types()
        assert ran in expected, f'"{name}" ran as {ran}, but the strategy expects {sorted(expected)} on 2 CPU processes'
        declared = tuple(strategy.accelerate_distributed_types)
        assert not declared or ran in declared, (
            f'"{name}" declares itself Accelerate\'s {" / ".join(declared)} (accelerate_distributed_types), but its run on 2 CPU '
            f"processes ran as {ran}: it silently fell back to another distributed type (on CPU, Accelerate runs sharded "
            "strategies' requests as DDP unless the strategy switches its state: acc_train.api.run_sharded_on_cpu)"
        )

    @pytest.mark.launch
    def test_each_rank_holds_the_parameter_share_it_claims(self, acc_train_strategy_name: str, acc_train_kit: KitRuns) -> None:
        """run.json's per-rank parameter elements, counted on the prepared model, against
        ``StrategyPlanner.parameter_shards``: a replica holds every element, a shard about total/shards."""
        from acc_train import Machine

        name = acc_train_strategy_name
        shards = _strategy(name).planner().parameter_shards(Machine("cpu", 2))
        summary = json.loads((acc_train_kit.full(name) / "run.json").read_text())
        total = summary["model_parameters"]
        held = {r["rank"]: r["param_elements"] for r in summary["per_rank"]}
        assert sorted(held) == [0, 1], f"run.json's per_rank lists ranks {sorted(held)}"
        if shards == 1:
            wrong = {rank: n for rank, n in held.items() if n != total}
            assert not wrong, (
                f'"{name}" claims every rank holds the whole model (StrategyPlanner.parameter_shards is 1), but of its '
                f"{total} parameter elements, rank: elements held = {wrong}: it shards what it says it replicates"
            )
        else:
            share = total / shards
            wrong = {rank: n for rank, n in held.items() if abs(n - share) > 0.1 * share}
            assert not wrong, (
                f'"{name}" claims its parameters are split into {shards} shards (StrategyPlanner.parameter_shards), so each rank '
                f"should hold about {share:.0f} of the {total} parameter elements, but rank: elements held = {wrong}"
                + (": it replicates the model instead of sharding it" if all(n >= total for n in wrong.values()) else "")
            )

    @pytest.mark.launch
    def test_stop_and_resume_reproduces_the_uninterrupted_run(self, acc_train_strategy_name: str, acc_train_kit: KitRuns) -> None:
        name = acc_train_strategy_name
        full, resumed = acc_train_kit.full(name), acc_train_kit.resumed(name)
        a, b = _metrics(full), _metrics(resumed)
        summary = json.loads((resumed / "run.json").read_text())
        assert summary["start_step"] == KIT_RESUME_STEP, f"the resumed run started at step {summary['start_step']}"
        assert sorted(b) == list(range(1, KIT_STEPS + 1)), sorted(b)
        for step in range(KIT_RESUME_STEP + 1, KIT_STEPS + 1):
            assert b[step]["loss"] == pytest.approx(a[step]["loss"], abs=1e-6), (
                f"resumed from step {KIT_RESUME_STEP}, step {step} gave loss {b[step]['loss']!r}, the uninterrupted "
                f"run {a[step]['loss']!r}: the checkpoint does not hold everything training depends on "
                "(every rank's model and optimizer state, if ranks differ?)"
            )
            assert b[step]["lr"] == pytest.approx(a[step]["lr"], rel=1e-9), f"step {step}: the learning rate differs"

    @pytest.mark.launch
    def test_checkpoints_carry_a_valid_manifest(self, acc_train_strategy_name: str, acc_train_kit: KitRuns) -> None:
        from acc_train import UserError, plugins
        from acc_train.checkpoint import verify_checkpoint

        name = acc_train_strategy_name
        fmt = _strategy(name).checkpoint_format_name()
        assert fmt in plugins.checkpoint_formats().names(), f'checkpoint format "{fmt}" is not registered'
        ckpts = acc_train_kit.full(name) / "checkpoints"
        assert (ckpts / "latest").read_text().strip() == f"step-{KIT_STEPS:06d}"
        assert not list(ckpts.glob(".staging-*")), "a staging directory was left behind"
        for step in (KIT_RESUME_STEP, KIT_STEPS):
            directory = ckpts / f"step-{step:06d}"
            manifest = json.loads((directory / "manifest.json").read_text())
            assert manifest["format"] == fmt, f"step {step}: manifest format {manifest['format']!r}, strategy says {fmt!r}"
            assert manifest["step"] == step and manifest["world_size"] == 2, manifest
            assert manifest["strategy"] == name
            try:  # every file listed, none unlisted, sizes and sha256 as written
                verify_checkpoint(directory)
            except UserError as exc:
                pytest.fail(f"step {step}: {exc} (write everything inside save())")

    @pytest.mark.launch
    def test_losses_match_ddp_where_declared_equivalent(self, acc_train_strategy_name: str, acc_train_kit: KitRuns) -> None:
        from acc_train import plugins

        name = acc_train_strategy_name
        if not _strategy(name).planner().equivalent_to_ddp():
            pytest.skip(f'"{name}" does not declare itself equivalent to DDP (StrategyPlanner.equivalent_to_ddp)')
        if REFERENCE_STRATEGY not in plugins.strategies().names():
            pytest.skip("comparing with DDP needs the ddp strategy: pip install acc-train-strategy-ddp")
        ours, ddp = _metrics(acc_train_kit.full(name)), _metrics(acc_train_kit.full(REFERENCE_STRATEGY))
        for step in range(1, KIT_STEPS + 1):
            assert ours[step]["loss"] == pytest.approx(ddp[step]["loss"], abs=1e-4), (
                f'"{name}" declares itself equivalent to DDP, but at step {step} its loss is {ours[step]["loss"]!r} '
                f"and DDP's {ddp[step]['loss']!r}"
            )

    @pytest.mark.launch
    def test_ranks_hold_the_same_parameters(self, acc_train_strategy_name: str, acc_train_kit: KitRuns) -> None:
        """After the run's steps, every rank holds the same model: a strategy claiming replicas
        (``StrategyPlanner.parameter_shards`` 1) holds equal parameters on every rank; one claiming
        shards holds either the same gathered view on every rank or parts that add up to the
        exported model. Compared by run.json's per-rank ``param_checksum`` (float64 sums)."""
        from acc_train import Machine

        name = acc_train_strategy_name
        shards = _strategy(name).planner().parameter_shards(Machine("cpu", 2))
        run = acc_train_kit.full(name)
        sums = {r["rank"]: r["param_checksum"] for r in json.loads((run / "run.json").read_text())["per_rank"]}
        agree = all(v == pytest.approx(sums[0], rel=1e-7, abs=1e-9) for v in sums.values())
        if shards == 1:
            assert agree, (
                f'"{name}" claims every rank holds the whole model (StrategyPlanner.parameter_shards is 1), but after {KIT_STEPS} '
                f"steps the ranks' parameters diverge (rank: sum of parameters = {sums}): the ranks do not stay in sync "
                "(are gradients all-reduced, or parameters averaged, by the last step?)"
            )
            return
        if agree:  # every rank reports the whole (gathered) model
            return
        exported = float(sum(p.detach().double().sum().item() for p in self._final_model(run).parameters()))
        assert sum(sums.values()) == pytest.approx(exported, rel=1e-6), (
            f'"{name}" claims its parameters are split into {shards} shards, but the ranks\' parts (rank: sum of parameters = '
            f"{sums}) neither agree nor add up to the exported model's {exported}: the ranks hold inconsistent shards"
        )

    @pytest.mark.launch
    def test_its_distinguishing_effect_shows_in_run_json(
        self, acc_train_strategy_name: str, acc_train_effect: str | None, acc_train_kit: KitRuns
    ) -> None:
        """The effect the plugin states (``effects={"NAME": "KEY"}`` on the marker, or
        ``--acc-train-effect NAME=KEY``) is a run.json key counting the strategy's own work in a
        launch (compressed all-reduces, parameter averages): present and non-zero in the kit's
        run, and different in its resumed launch, which trains half the steps. A strategy that
        registers but silently does nothing of its own (a hook never installed) fails here."""
        name = acc_train_strategy_name
        _strategy(name)  # an unknown name fails here
        if acc_train_effect is None:
            pytest.skip(
                f'no distinguishing effect stated for "{name}": name the run.json key that counts its own work, '
                f'pytest.mark.acc_train_strategy("{name}", effects={{"{name}": "KEY"}}) or --acc-train-effect {name}=KEY'
            )
        key = acc_train_effect
        full = json.loads((acc_train_kit.full(name) / "run.json").read_text())
        value = _fact(full, key)
        assert value is not _MISSING and value not in (None, 0, False, "", [], {}), (
            f'"{name}" states its effect as run.json\'s {key!r}, but its run of {KIT_STEPS} steps shows '
            f"{'no such key' if value is _MISSING else repr(value)}: the effect is absent, the strategy silently did nothing of its own "
            "(count its work in Strategy.summary; is its hook installed?)"
        )
        resumed = _fact(json.loads((acc_train_kit.resumed(name) / "run.json").read_text()), key)
        assert resumed != value, (
            f'"{name}"\'s effect {key!r} is {value!r} both in the kit\'s launch of {KIT_STEPS} steps and in its resumed launch '
            f"of {KIT_STEPS - KIT_RESUME_STEP}: it does not count the strategy's work in a launch (a constant, such as an option?)"
        )
