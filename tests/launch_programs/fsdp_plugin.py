"""A program that passes Accelerator an FSDP plugin of its own."""

from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin

accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
