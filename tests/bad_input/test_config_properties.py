"""Property tests of the config side: any YAML document, any text and any bytes, as a config file,
as an accelerate config file or as a ``--set`` value, is either accepted or refused with a
``UserError``; nothing else escapes.

Most examples run in-process (``load_job``, ``check_config_file``, ``parse_set``) for speed; a
few go through the command line (:func:`tests.bad_input.harness.assert_handled`: exit 0 or 2, no
traceback). Documents are built from the schema's own keys, so they reach deep into validation.

Deterministic in CI: ``derandomize=True`` and no example database, so every run tries the same
examples (a failure reproduces from the test's name alone). No deadline: a hang is caught by the
harness's timeout on the command-line examples, and the loader bounds the work any
document can cause (aliases, nesting), which the in-process examples exercise.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from acc_train.config import JobConfig, check_config_file, load_job, parse_set
from acc_train.errors import UserError
from acc_train_deepspeed.config import AccelerateDeepSpeedSection
from acc_train_fsdp.accelerate_config import FsdpSection
from tests.bad_input.harness import assert_handled, run_acc_train

QUICK = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=120,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
#: through the command line (the whole command, in process): a handful
CLI = settings(QUICK, max_examples=6)

SECTIONS: dict[str, list[str]] = {
    name: list(getattr(field.annotation, "model_fields", {})) for name, field in JobConfig.model_fields.items()
}
STRATEGY_KEYS = ["name", "stage", "version", "offload_optimizer", "offload_param", "sharding_strategy", "config_file", "auto_wrap_policy"]
ACCELERATE_TOP = [
    "compute_environment", "distributed_type", "mixed_precision", "num_processes", "num_machines", "machine_rank",
    "main_process_ip", "main_process_port", "rdzv_backend", "use_cpu", "gpu_ids", "main_training_function", "debug",
]  # fmt: skip
WORDS = [
    "no", "auto", "bf16", "fp16", "fp8", "ddp", "fsdp", "deepspeed", "zero3", "cosine", "latest", "static", "c10d",
    "NO", "MULTI_CPU", "MULTI_GPU", "FSDP", "DEEPSPEED", "LOCAL_MACHINE", "FULL_SHARD", "TRANSFORMER_BASED_WRAP",
    "SIZE_BASED_WRAP", "FULL_STATE_DICT", "BACKWARD_PRE", "none", "cpu", "nvme", "tensorboard", "all", "",
]  # fmt: skip

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.integers(min_value=-3, max_value=4)
    | st.floats()
    | st.sampled_from(WORDS)
    | st.text(max_size=12)
)
any_key = st.text(max_size=10) | st.sampled_from([k for keys in SECTIONS.values() for k in keys] + list(SECTIONS))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_key, inner, max_size=4), max_leaves=12)


@st.composite
def section(draw: Any, keys: list[str]) -> dict[str, Any]:
    """Some of ``keys`` (and now and then another key), each with any value."""
    chosen = draw(st.lists(st.sampled_from(keys), max_size=min(5, len(keys)), unique=True)) if keys else []
    out = {key: draw(scalars | values) for key in chosen}
    if draw(st.booleans()):
        out.update(draw(st.dictionaries(any_key, values, max_size=2)))
    return out


@st.composite
def config_documents(draw: Any) -> Any:
    """An acc-train config: the schema's sections with some of their keys; sometimes a section
    that is not a mapping, sometimes not a mapping at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(values)
    names = draw(st.lists(st.sampled_from(list(SECTIONS)), max_size=5, unique=True))
    doc: dict[str, Any] = {}
    for name in names:
        keys = STRATEGY_KEYS if name == "strategy" else SECTIONS[name]
        doc[name] = draw(section(keys)) if keys and draw(st.integers(0, 5)) else draw(values)
    return doc


@st.composite
def accelerate_documents(draw: Any) -> dict[str, Any]:
    """A file as ``accelerate config`` writes it, with any values, and its strategy sections."""
    doc = draw(section(ACCELERATE_TOP))
    doc["distributed_type"] = draw(st.sampled_from(["NO", "MULTI_CPU", "FSDP", "DEEPSPEED", "MULTI_GPU"]) | scalars)
    if draw(st.booleans()):
        doc["fsdp_config"] = draw(section(list(FsdpSection.model_fields))) if draw(st.integers(0, 5)) else draw(values)
    if draw(st.booleans()):
        doc["deepspeed_config"] = draw(section(list(AccelerateDeepSpeedSection.model_fields))) if draw(st.integers(0, 5)) else draw(values)
    return doc


def _dump(doc: Any) -> str:
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)


def _resolve_in_process(content: str | bytes) -> None:
    """A config file with ``content`` through everything that reads one: resolving it (and
    printing the job, as --print-config does) and ``config validate``. Only UserError may escape."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.yaml"
        path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
        try:
            load_job(path).to_yaml()
        except UserError:
            pass
        job, problems = check_config_file(path)
        assert (job is None) == bool(problems), problems


@QUICK
@given(config_documents())
def test_any_yaml_config_is_accepted_or_refused(doc: Any) -> None:
    _resolve_in_process(_dump(doc))


@QUICK
@given(accelerate_documents())
def test_any_accelerate_config_file_is_accepted_or_refused(doc: dict[str, Any]) -> None:
    _resolve_in_process(_dump(doc))


@settings(QUICK, max_examples=80)
@given(st.text(max_size=200))
def test_any_text_as_a_config_file_is_accepted_or_refused(text: str) -> None:
    _resolve_in_process(text)


@settings(QUICK, max_examples=60)
@given(st.binary(max_size=200))
def test_any_bytes_as_a_config_file_are_accepted_or_refused(data: bytes) -> None:
    _resolve_in_process(data)


@settings(QUICK, max_examples=80)
@given(st.sampled_from(["training.seed", "optimizer.betas", "model.config", "launch", "strategy", "data.train_files", "x"]), values.map(_dump) | st.text(max_size=40))
def test_any_set_value_is_accepted_or_refused(key: str, raw: str) -> None:
    item = f"{key}={raw.strip()}"
    try:
        parse_set(item)
        load_job(sets=[item]).to_yaml()
    except UserError:
        pass


@CLI
@given(config_documents() | accelerate_documents())
def test_any_config_file_through_the_command_line(doc: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "job.yaml").write_text(_dump(doc), encoding="utf-8")
        assert_handled(run_acc_train(["--config", "job.yaml", "--print-config"], Path(tmp)), _dump(doc))
        assert_handled(run_acc_train(["config", "validate", "job.yaml"], Path(tmp)), _dump(doc))
