"""The schema's building blocks: the strict section base, the constrained number and string
types every section uses, and the constants that bound them (:mod:`acc_train.config.schema`)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "Section", "Count", "NonNegativeCount", "PositiveFloat", "NonNegativeFloat", "Beta", "NonEmptyStr", "DEFAULT_MAX_STEPS",
    "MAX_INT64", "MAX_SEED", "MAX_PROCESSES_PER_MACHINE", "MAX_SEQ_LEN", "MODEL_DTYPES", "FINE_TUNE_DEFAULTS",
    "DEMO_EVAL_FRACTION", "SCHEDULERS",
]  # fmt: skip

DEFAULT_MAX_STEPS = 300

# Constrained types: every number a job holds is finite and in a range that means something, so a
# bad value is refused here, naming its key and origin, never inside the workers.
#: the largest count torch and numpy hold (a C int64); beyond it they overflow, not this check
MAX_INT64 = 2**63 - 1
#: seeds go to numpy's ``np.random.seed``, which takes 0 <= seed < 2**32
MAX_SEED = 2**32 - 1
#: processes per machine: 4x the largest machines made (256 cores, 8-16 accelerators). Each process
#: is a Python interpreter holding a model; thousands would exhaust the machine, not train
MAX_PROCESSES_PER_MACHINE = 1024
#: tokens per sequence: beyond any model's context; a larger value is a typo that would only
#: fail inside the workers, when the first batch is allocated
MAX_SEQ_LEN = 2**24
Count = Annotated[int, Field(ge=1, le=MAX_INT64)]
NonNegativeCount = Annotated[int, Field(ge=0, le=MAX_INT64)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Beta = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]
NonEmptyStr = Annotated[str, Field(min_length=1)]

#: ``model.dtype`` values; the low-precision ones train without an fp32 master copy.
MODEL_DTYPES = ("auto", "fp32", "bf16", "fp16")

#: Defaults for fine-tuning, where the job names a pretrained model (``model.name_or_path``) and
#: leaves the key unset; the demo job (and any key set anywhere) keeps the schema's default.
#: A pretrained model is wrecked by the demo's lr of 1e-3; these follow HF Trainer / TRL / axolotl.
FINE_TUNE_DEFAULTS: dict[tuple[str, str], Any] = {
    ("optimizer", "lr"): 2e-5,
    ("optimizer", "weight_decay"): 0.0,
    ("optimizer", "betas"): [0.9, 0.999],
}

#: ``data.eval_fraction`` unset: the demo text holds out this share for eval; the user's own
#: training files are never held out unless ``data.eval_fraction`` says so.
DEMO_EVAL_FRACTION = 0.02

SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True)
