"""ft-ddp's options: what cannot work is refused before launch (exit 2), in process."""

from __future__ import annotations

from pathlib import Path

import pytest

from acc_train import resolve_strategy
from tests.conftest import cli_in_process, tiny_job_args

pytest.importorskip("acc_train_ft")


@pytest.mark.parametrize(
    ("sets", "where", "says"),
    [
        (["strategy.num_groups=1", "strategy.lighthouse=localhost:29510"], "strategy.num_groups", "one replica group cannot train through its own loss"),
        (["strategy.num_groups=2"], "strategy.lighthouse", "needs the lighthouse's address"),
        (["strategy.num_groups=2", "strategy.replica_group=2", "strategy.lighthouse=localhost:29510"], "strategy.replica_group", "out of range"),
        (["strategy.num_groups=2", "strategy.min_groups=3", "strategy.lighthouse=localhost:29510"], "strategy.min_groups", "no step could commit"),
    ],
)
def test_refused_before_launch(sets: list[str], where: str, says: str, tiny_model_dir: Path, tiny_data: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    args = [a for s in sets for a in ("--set", s)]
    result = cli_in_process("--strategy", "ft-ddp", "--num-processes", "1", *tiny_job_args(tiny_model_dir, tiny_data, tmp_path / "out"), *args)
    assert result.returncode == 2, result.stderr
    assert where in result.stderr and says in result.stderr
    assert not (tmp_path / "out").exists()


def test_groups_of_several_processes_are_refused() -> None:
    from acc_train import Machine, UserError

    strategy = resolve_strategy("ft-ddp", {"num_groups": 2, "lighthouse": "h:1"}).bind(Machine("cpu", 2))
    with pytest.raises(UserError, match="one process each"):
        strategy.check_environment()


def test_the_lighthouse_comes_from_the_option_or_torchft_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "head:29510")
    assert resolve_strategy("ft-ddp").lighthouse_address() == "http://head:29510"
    assert resolve_strategy("ft-ddp", {"lighthouse": "other:1"}).lighthouse_address() == "http://other:1"
    from acc_train.api import ReplicaGroups

    groups = resolve_strategy("ft-ddp", {"replica_group": 1, "num_groups": 3}).replica_groups
    assert issubclass(groups, ReplicaGroups)
    assert groups(resolve_strategy("ft-ddp", {"replica_group": 1, "num_groups": 3})).data_part() == (1, 3)


def test_the_plugin_adds_the_lighthouse_command() -> None:
    result = cli_in_process("lighthouse", "--help")
    assert result.returncode == 0, result.stderr
    assert "--heartbeat-timeout" in result.stdout and "--min-groups" in result.stdout
