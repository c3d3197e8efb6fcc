"""The ``eval`` section of the job config: what a run does at each evaluation besides its
``eval_loss`` (generation samples, lm-evaluation-harness tasks), the settings of that work. When and how much it evaluates
(``training.eval_every``, ``training.eval_batches``) stay in the ``training`` section."""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from acc_train.config.base import MAX_SEED, NonEmptyStr, PositiveFloat, Section
from acc_train.config.harness import HarnessSettings

__all__ = ["ChatMessage", "EvalConfig", "Prompt", "MAX_SAMPLE_PROMPTS", "evaluator_options"]

#: prompts per evaluation: each is generated at every evaluation, in the training time
MAX_SAMPLE_PROMPTS = 1000


class ChatMessage(Section):
    """One message of a chat prompt, as the tokenizer's chat template takes it."""

    role: NonEmptyStr = Field(description="`system`, `user`, `assistant` or any role the chat template knows.")
    content: str = Field(description="The message's text.")


def _prompt_form(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    return "messages" if isinstance(value, list) else None


#: a prompt: text, tokenized as training tokenizes text, or chat messages rendered with the
#: tokenizer's chat template (with the generation prompt after them). Told apart by their type,
#: so a problem is reported for the form given (``eval.samples.1.messages.0.content``), not
#: once for each form
Prompt = Annotated[
    Union[Annotated[NonEmptyStr, Tag("text")], Annotated[list[ChatMessage], Tag("messages")]],
    Discriminator(
        _prompt_form,
        custom_error_type="prompt_form",
        custom_error_message="a prompt is a string, or a list of chat messages ({role: ..., content: ...})",
    ),
]


class EvalConfig(HarnessSettings):
    """``eval``: at every evaluation (``training.eval_every`` steps and after the last),
    generation samples (``samples`` and their settings), written to ``samples.jsonl`` and the
    trackers that take text, and benchmark tasks through lm-evaluation-harness (``harness_*``).
    Any other key names an evaluator a plugin registered (``eval.NAME: {its options}``), checked
    against the registry and the evaluator's options schema (:mod:`acc_train.evaluation.kinds`)."""

    model_config = ConfigDict(extra="allow", strict=True, validate_default=True)

    samples: list[Prompt] = Field(
        default_factory=list,
        max_length=MAX_SAMPLE_PROMPTS,
        description=(
            "Prompts the model completes at every evaluation: each a string, or a list of chat messages "
            "(`{role, content}`) rendered with the tokenizer's chat template. Empty: no samples."
        ),
    )
    max_new_tokens: int = Field(32, ge=1, le=65536, description="Tokens generated per prompt at most (fewer where the model ends its text).")
    temperature: float = Field(
        0.0,
        ge=0,
        le=100,
        allow_inf_nan=False,
        description="0: greedy decoding (the same completion for the same weights); above 0: sampling at this temperature.",
    )
    top_p: PositiveFloat = Field(1.0, le=1, description="Nucleus sampling's probability mass, when `temperature` is above 0.")
    seed: int | None = Field(
        None,
        ge=0,
        le=MAX_SEED,
        description=(
            "Seeds sampling, with the step and the prompt's position, on a random stream of its own: training's "
            "random numbers (dropout, data order) are never drawn from. Null: `training.seed`."
        ),
    )

    @model_validator(mode="after")
    def _plugin_evaluators(self) -> EvalConfig:
        evaluator_options(self)  # (only a key that is not a setting loads the plugins)
        return self

    @field_validator("samples")
    @classmethod
    def _chat_has_messages(cls, value: list[Prompt]) -> list[Prompt]:
        for i, prompt in enumerate(value):
            if isinstance(prompt, list) and not prompt:
                raise ValueError(f"prompt {i} is an empty list of chat messages: give it a {{role: user, content: ...}} message, or a string")
        return value


def evaluator_options(config_eval: Any) -> None:
    """Check the keys of the ``eval`` section that are not its own settings: each names a
    registered evaluator and is validated by its options schema (stored back, resolved, so
    ``config.yaml`` shows every option). Raises pydantic's ValidationError naming the key."""
    from pydantic import ValidationError

    from acc_train.errors import UserError, closest
    from acc_train.plugins import NameConflictError, evaluators

    extras = config_eval.model_extra or {}
    if not extras:
        return
    registry = evaluators()
    own = [name for name in type(config_eval).model_fields]
    errors: list[Any] = []

    def refuse(loc: tuple[Any, ...], value: Any, message: str) -> None:
        errors.append({"type": "value_error", "loc": loc, "input": value, "ctx": {"error": ValueError(message)}})

    for key, value in list(extras.items()):
        try:
            kind = registry.get(key)
        except NameConflictError as exc:
            refuse((key,), value, f"{exc.message}; {exc.hint}")
            continue
        except UserError:
            kind = None
        if kind is not None and kind.where != f"eval.{key}":
            refuse((key,), value, f"evaluator {key!r} is not asked for under eval: {kind.where} asks for it")
            continue
        if kind is None:
            sections = sorted(k.name for k, _ in registry.registered() if k.where == f"eval.{k.name}" and k.name not in own)
            near = closest(key, own + sections)
            message = (
                "unknown key: neither an eval setting nor an installed evaluator"
                + (f'; did you mean "eval.{near}"?' if near else "")
                + f" (eval settings: {', '.join(own)}; evaluators installed: {', '.join(sections) or 'none'};"
                " a plugin adds evaluators through the acc_train_register_evaluators hook)"
            )
            refuse((key,), value, message)
            continue
        if value is True or value is None:
            value = {}
        if not isinstance(value, dict):
            refuse((key,), value, f"evaluator {key!r} takes a mapping of its options, or true for its defaults")
            continue
        if kind.options_schema is None:
            if value:
                refuse((key,), value, f"evaluator {key!r} takes no options (got {', '.join(map(str, value))}); give `{key}: true`")
            else:
                extras[key] = {}
            continue
        try:
            extras[key] = kind.options_schema.model_validate(value).model_dump(mode="json")
        except ValidationError as exc:
            fields = list(kind.options_schema.model_fields)
            for err in exc.errors():
                if err["type"] == "extra_forbidden":
                    near = closest(str(err["loc"][-1]), fields)
                    err["msg"] = "unknown key" + (f'; did you mean "{near}"?' if near else "") + f" (valid keys here: {', '.join(fields)})"
                refuse((key, *err["loc"]), err.get("input"), err["msg"].removeprefix("Value error, "))
    if errors:
        raise ValidationError.from_exception_data(type(config_eval).__name__, errors)
