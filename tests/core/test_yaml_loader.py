"""The one YAML loader: what people write is read, what they never mean is refused with its line."""

from __future__ import annotations

import pytest
import yaml

from acc_train.files.yaml_loader import MAX_ALIAS_EXPANSION, MAX_DEPTH, YamlRefused, load_yaml


def test_yaml_as_people_write_it() -> None:
    value, node = load_yaml("lr: 1e-4\nbetas: [0.9, 0.95]\n", "job.yaml")
    assert value == {"lr": 1e-4, "betas": [0.9, 0.95]}
    assert node is not None and node.start_mark.name == "job.yaml"
    assert load_yaml("") == (None, None)


def test_anchors_and_merge_keys_are_not_duplicates() -> None:
    text = "base: &base\n  lr: 0.01\n  eps: 1.0e-8\noptimizer:\n  <<: *base\n  lr: 0.02\nother: *base\n"
    value, _ = load_yaml(text, "job.yaml")
    assert value["optimizer"] == {"lr": 0.02, "eps": 1e-8}
    assert value["other"] == {"lr": 0.01, "eps": 1e-8}


@pytest.mark.parametrize(
    ("text", "lines"),
    [
        ("training:\n  seed: 1\n  seed: 2\n", ["job.yaml:2", "job.yaml:3"]),
        ("training: {}\nmodel: {}\ntraining: {}\n", ["job.yaml:1", "job.yaml:3"]),
        ("optimizer: {lr: 0.1, 'lr': 0.2}\n", ["job.yaml:1"]),
    ],
)
def test_a_key_given_twice_is_refused_naming_both_lines(text: str, lines: list[str]) -> None:
    with pytest.raises(YamlRefused) as info:
        load_yaml(text, "job.yaml")
    assert "given twice" in info.value.problem
    for line in lines:
        assert line in info.value.problem


def test_aliases_are_bounded_by_their_expansion_not_their_use() -> None:
    row = "[" + ", ".join(["1"] * 90) + "]"
    value, _ = load_yaml(f"a: &a {row}\nb: [" + ", ".join(["*a"] * 100) + "]\n")  # 9,000 values added
    assert len(value["b"]) == 100
    bomb = "a0: &a0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]\n" for i in range(1, 30)
    )
    with pytest.raises(YamlRefused, match=f"more than {MAX_ALIAS_EXPANSION:,} values"):
        load_yaml(bomb)  # 9**30 values: refused after walking 30 distinct nodes


def test_a_value_that_contains_itself_is_refused() -> None:
    with pytest.raises(YamlRefused, match="contains it"):
        load_yaml("x: &x [1, *x]\n")


@pytest.mark.parametrize("depth", [MAX_DEPTH + 5, 100_000])
def test_absurd_nesting_is_refused(depth: int) -> None:
    with pytest.raises(YamlRefused, match="nest"):
        load_yaml("x: " + "[" * depth + "]" * depth)


def test_refusals_are_yaml_errors_for_every_caller() -> None:
    """Callers that handle a YAML syntax error (the wizard's answers) handle these too."""
    assert issubclass(YamlRefused, yaml.YAMLError)
