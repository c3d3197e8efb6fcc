"""Checkpoints: atomic, pickle-free, with a manifest written last.

One job per module:

- :mod:`~acc_train.checkpoint.format`: the ``CheckpointFormat`` contract and core's ``dcp`` format
- :mod:`~acc_train.checkpoint.portable`: the portable state (DCP safetensors shards keyed by
  parameter name, resharded on load) and the pickle-free optimizer-state split
- :mod:`~acc_train.checkpoint.manifest`: writing and verifying manifests, model fingerprints
- :mod:`~acc_train.checkpoint.hashing`: hashing a checkpoint's files, shared by the ranks
- :mod:`~acc_train.checkpoint.layout`: directory names, ``latest``, resolving ``--resume``
- :mod:`~acc_train.checkpoint.rng`: every rank's random state
- :mod:`~acc_train.checkpoint.strategy_state`: the state a strategy owns beyond model and
  optimizer (``Strategy.state_dict``), per rank
- :mod:`~acc_train.checkpoint.manager`: ``CheckpointManager`` (save, commit, retain, check,
  load) and ``TrainerState``
- :mod:`~acc_train.checkpoint.faults`: fault injection for crash-safety tests
  (imported from there, not re-exported here)

``acc-train checkpoint inspect | convert | export`` live above the plugin manager, in
:mod:`acc_train.checkpoint_tools`; library versions come from the plugins
(:func:`acc_train.plugins.library_versions`).
"""

from __future__ import annotations

from acc_train.checkpoint.faults import fault_point
from acc_train.checkpoint.format import CheckpointFormat, DCPFormat
from acc_train.checkpoint.layout import (
    LATEST,
    STAGING_PREFIX,
    find_checkpoint,
    resolve_checkpoint,
    step_dir_name,
)
from acc_train.checkpoint.manager import (
    CheckpointManager,
    TrainerState,
    check_async_save,
)
from acc_train.checkpoint.manifest import (
    MANIFEST,
    check_same_model,
    file_table,
    model_fingerprint,
    sha256,
    verify_checkpoint,
    write_json,
)
from acc_train.checkpoint.portable import (
    PORTABLE_DIR,
    flatten_optimizer_state,
    load_portable_into,
    read_portable_full,
    read_portable_state,
    state_dict_options,
    torch_optimizer,
    unflatten_optimizer_state,
    write_portable_full,
    write_portable_state,
)
from acc_train.checkpoint.rng import capture_rng, restore_rng
from acc_train.checkpoint.strategy_state import read_strategy_state, write_strategy_state

__all__ = [
    "CheckpointFormat",
    "DCPFormat",
    "PORTABLE_DIR",
    "flatten_optimizer_state",
    "unflatten_optimizer_state",
    "torch_optimizer",
    "state_dict_options",
    "write_portable_state",
    "write_portable_full",
    "read_portable_state",
    "read_portable_full",
    "load_portable_into",
    "MANIFEST",
    "write_json",
    "sha256",
    "file_table",
    "verify_checkpoint",
    "check_same_model",
    "model_fingerprint",
    "LATEST",
    "STAGING_PREFIX",
    "step_dir_name",
    "find_checkpoint",
    "resolve_checkpoint",
    "capture_rng",
    "restore_rng",
    "read_strategy_state",
    "write_strategy_state",
    "CheckpointManager",
    "TrainerState",
    "check_async_save",
    "fault_point",
]
