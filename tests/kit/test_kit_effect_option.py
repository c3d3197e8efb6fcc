"""The kit's ``--acc-train-effect NAME=KEY``: what a plugin author writes, and what a mistake gets."""

from __future__ import annotations

import pytest

from acc_train.testing.plugin import EFFECT_OPTION, _effects


def test_effects_are_read_by_strategy_name() -> None:
    assert _effects(["local-sgd=local_sgd_averages", "zero=zero.stage"]) == {"local-sgd": "local_sgd_averages", "zero": "zero.stage"}


@pytest.mark.parametrize("value", ["local_sgd_averages", "=key", "name="])
def test_an_effect_without_its_strategy_or_key_is_a_usage_error_showing_the_form(value: str) -> None:
    with pytest.raises(pytest.UsageError, match=f"{EFFECT_OPTION} '{value}': write NAME=KEY"):
        _effects([value])
