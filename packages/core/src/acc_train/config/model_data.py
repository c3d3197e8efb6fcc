"""The ``model`` and ``data`` sections of the job config (``model.lora`` included)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from acc_train.config.base import MAX_INT64, MAX_SEQ_LEN, MODEL_DTYPES, NonEmptyStr, PositiveFloat, Section

__all__ = ["LoraConfig", "ModelConfig", "DataConfig"]


class LoraConfig(Section):
    """LoRA adapters through PEFT (``model.lora``): the base model's weights are frozen, and only
    the adapters are trained, in the optimizer and in checkpoints. The defaults follow the QLoRA
    paper and axolotl: rank 16, alpha 32, every linear layer of the transformer blocks."""

    r: int = Field(16, ge=1, le=65536, description="The adapters' rank.")
    alpha: PositiveFloat = Field(32.0, description="Scaling numerator: the adapter's output is scaled by `alpha / r`.")
    dropout: float = Field(0.05, ge=0.0, lt=1.0, allow_inf_nan=False, description="Dropout on the adapters' input, in [0, 1).")
    target_modules: list[NonEmptyStr] | Literal["all-linear"] = Field(
        "all-linear",
        description=(
            "Module names (or suffixes) to adapt, or `all-linear`: every linear layer but the output head, "
            "whatever the architecture calls them (PEFT's own rule)."
        ),
    )
    modules_to_save: list[NonEmptyStr] = Field(
        default_factory=list,
        description=(
            "Modules trained in full beside the adapters and saved with them (e.g. `lm_head` and "
            "`embed_tokens` after adding tokens); PEFT's `modules_to_save`."
        ),
    )


class ModelConfig(Section):
    name_or_path: NonEmptyStr | None = Field(
        None,
        description="A local directory or hub id for `from_pretrained`; None trains the built-in demo model.",
    )
    tokenizer: NonEmptyStr | None = Field(
        None,
        description="Tokenizer path or id; defaults to `name_or_path`. The demo job is byte-level.",
    )
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="Overrides for the demo model's `LlamaConfig` (ignored when `name_or_path` is set).",
    )
    trust_remote_code: bool = Field(
        False,
        description="Run the model's own code from the hub or its directory (transformers' `trust_remote_code`).",
    )
    dtype: Literal[MODEL_DTYPES] = Field(  # type: ignore[valid-type]
        "auto",
        description=(
            "What the trainable parameters are held and stepped in. `auto` and `fp32`: fp32, whatever dtype "
            "the checkpoint is stored in (hub checkpoints are bf16), with `training.mixed_precision` doing "
            "the compute casts. `bf16`/`fp16`: pure low-precision training, with no fp32 master copy (a "
            "warning says so)."
        ),
    )
    attn_implementation: NonEmptyStr | None = Field(
        None,
        description=(
            "Attention kernel (transformers' `attn_implementation`): `sdpa`, `eager`, `flash_attention_2` (a "
            "CUDA GPU and the flash-attn package) or any name transformers accepts. Null: transformers' "
            "default, `sdpa` where the model supports it, else `eager`."
        ),
    )
    lora: LoraConfig | None = Field(
        None,
        description="Train LoRA adapters (PEFT) on the frozen model instead of every weight; null: full fine-tuning.",
    )

    @model_validator(mode="after")
    def _config_only_for_demo(self) -> ModelConfig:
        if self.name_or_path and self.config:
            raise ValueError("model.config overrides the demo model only; remove it when model.name_or_path is set")
        return self


class DataConfig(Section):
    train_files: list[NonEmptyStr] = Field(
        default_factory=list,
        description="Data files for `datasets` (json, jsonl, text, parquet); empty trains on the demo text.",
    )
    eval_files: list[NonEmptyStr] = Field(
        default_factory=list,
        description="Data files held out for evaluation, in the same format as `train_files`.",
    )
    format: Literal["auto", "json", "jsonl", "text", "parquet"] = Field(
        "auto",
        description="The files' format (`auto`: from their names).",
    )
    kind: NonEmptyStr = Field(
        "text",
        description=(
            "What a row is: `text` (pretraining documents), `prompt_completion` or `chat` (loss on the "
            "completion / assistant tokens only), or a kind a plugin registers."
        ),
    )
    text_field: NonEmptyStr = Field(
        "text",
        description="The field holding a row's text (`kind: text`); a `.txt` file's lines need none.",
    )
    prompt_field: NonEmptyStr = Field("prompt", description="The field holding the prompt (`kind: prompt_completion`).")
    completion_field: NonEmptyStr = Field(
        "completion",
        description=(
            "The field holding the completion (`kind: prompt_completion`); the loss counts its tokens and its"
            " EOS."
        ),
    )
    messages_field: NonEmptyStr = Field(
        "messages",
        description=(
            "The field holding a conversation (`kind: chat`): a list of `{role, content}` objects, rendered "
            "with the tokenizer's chat template."
        ),
    )
    seq_len: int = Field(128, ge=2, le=MAX_SEQ_LEN, description="Tokens per row.")
    packing: bool | Literal["best_fit"] | None = Field(
        None,
        description=(
            "Pack short examples into `seq_len` rows (position ids restart at each example, and attention "
            "stays within it). `true`: next-fit, the data's order kept; `best_fit`: best-fit decreasing, "
            "fewer and fuller rows (each example placed in the fullest row it fits; not with `streaming`). "
            "Default: on for `text`, off for the other kinds (examples padded per batch)."
        ),
    )
    overlong: Literal["truncate", "drop"] = Field(
        "truncate",
        description=(
            "An example longer than `seq_len` (not `text`, whose documents are cut into rows): `truncate` "
            "keeps its first `seq_len` tokens, `drop` leaves it out. Both are counted."
        ),
    )
    streaming: bool = Field(
        False,
        description=(
            "Read the files as a stream, tokenized and packed on the fly (for corpora larger than RAM or "
            "disk); needs `training.max_steps`."
        ),
    )
    cache_dir: NonEmptyStr | None = Field(
        None,
        description=(
            "Where tokenized data is cached; default `$XDG_CACHE_HOME/acc-train/data` "
            "(`~/.cache/acc-train/data`)."
        ),
    )
    num_proc: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="Processes that tokenize (`datasets.map(num_proc=...)`); default: the CPU cores.",
    )
    eval_fraction: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        allow_inf_nan=False,
        description=(
            "Share of the training blocks held out for eval when no `eval_files` are given. Unset: 0 for the "
            "user's `train_files` (training data is never held out silently), `DEMO_EVAL_FRACTION` for the "
            "demo text."
        ),
    )
    demo_max_bytes: int = Field(
        1_500_000,
        ge=1024,
        le=MAX_INT64,
        description="How much of the standard library's source the demo job reads.",
    )
    shuffle: bool = Field(
        True,
        description=(
            "Shuffle the training rows each epoch (the order depends only on the seed, the epoch and the "
            "global batch, so a resume repeats it)."
        ),
    )

    @model_validator(mode="after")
    def _best_fit_needs_the_whole_data(self) -> DataConfig:
        if self.packing == "best_fit" and self.kind == "text":
            raise ValueError(
                "data.packing best_fit packs whole examples (prompt_completion, chat); kind text cuts its documents' "
                "token stream into rows wherever the cut falls, with no room left to fill: use packing: true"
            )
        if self.packing == "best_fit" and self.streaming:
            raise ValueError(
                "data.packing best_fit sorts every example by length before placing it, which a stream never has at once; "
                "use packing: true (next-fit, as the stream reads) or streaming: false"
            )
        return self
