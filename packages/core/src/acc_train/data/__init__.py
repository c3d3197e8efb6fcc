"""Training data: the files checked before launch, tokenized once into a cache read on demand
(or streamed), made into rows, and read in an order a resumed run repeats exactly."""

from __future__ import annotations

from acc_train.data.cache import PreparedData, cache_root, demo_data, fingerprint, prepare_data
from acc_train.data.demo import demo_text_bytes
from acc_train.data.files import CHECK_BYTES, check_data_files, data_kind, infer_format
from acc_train.data.rows import IGNORE_INDEX, Collate, Split, TokenRows
from acc_train.data.sampler import ResumableSampler

__all__ = [
    "CHECK_BYTES", "IGNORE_INDEX", "Collate", "PreparedData", "ResumableSampler", "Split", "TokenRows", "cache_root",
    "check_data_files", "data_kind", "demo_data", "demo_text_bytes", "fingerprint", "infer_format", "prepare_data",
]  # fmt: skip
