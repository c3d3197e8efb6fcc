"""Training data: checked files, tokenized rows, and the order they are read in."""

from __future__ import annotations

from acc_train.data.blocks import BlockDataset, demo_text_bytes, load_blocks
from acc_train.data.files import CHECK_BYTES, check_data_files, data_kind, infer_format
from acc_train.data.sampler import ResumableSampler

__all__ = ["demo_text_bytes", "load_blocks", "ResumableSampler", "BlockDataset", "infer_format", "check_data_files", "data_kind", "CHECK_BYTES"]
