"""Questions of the ``acc-train config`` wizard, contributed by strategy plugins.

A strategy plugin answers ``acc_train_config_questions`` with a list of :class:`Question`;
the wizard asks them after the user picks the strategy, parses each answer and validates it
through the strategy's own options schema, so it never writes a file the config would reject.
This module holds data only: the prompting lives in the CLI.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from acc_train.files.yaml_loader import Loader

__all__ = ["Question", "parse_answer", "show_answer"]


@dataclass(frozen=True)
class Question:
    """One question for one config key.

    ``key`` is a dotted path inside the section the question belongs to (for a strategy's
    questions, inside ``strategy:``: ``"stage"``, ``"mixed_precision_policy.param_dtype"``).
    ``default`` must be a valid value: ``acc-train config --yes`` writes the defaults as they
    are. ``when`` sees the answers given so far in the same section (by key) and says whether
    to ask; a question not asked is left out of the file.
    """

    key: str
    prompt: str
    default: Any
    #: The allowed answers; empty means any value the schema accepts (read as YAML: ``25``,
    #: ``true``, ``null``).
    choices: tuple[Any, ...] = ()
    #: One line shown above the prompt.
    help: str = ""
    when: Callable[[Mapping[str, Any]], bool] | None = None
    #: What the user types (and sees as the default) for None.
    none_text: str = "null"

    def applies(self, answers: Mapping[str, Any]) -> bool:
        return self.when is None or bool(self.when(answers))


def show_answer(question: Question, value: Any) -> str:
    """How ``value`` is shown and typed."""
    if value is None:
        return question.none_text
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def parse_answer(question: Question, text: str) -> Any:
    """The value typed as ``text``; raises ValueError with the reason for an answer that is not one."""
    text = text.strip()
    if question.choices:
        for choice in question.choices:
            if text == show_answer(question, choice):
                return choice
        raise ValueError(f"{text!r} is not one of: {', '.join(show_answer(question, c) for c in question.choices)}")
    if text == question.none_text:
        return None
    try:
        return yaml.load(text, Loader=Loader)
    except yaml.YAMLError:
        return text
