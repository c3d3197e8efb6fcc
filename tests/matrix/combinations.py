"""The covering set of launches tests/matrix/test_cells.py trains: each a row of the support
matrix and the columns one launch trains together. Plain data (no pytest), so
docs/_gen/matrix.py names these tests for the cells they train from this one list."""

from __future__ import annotations

from dataclasses import dataclass

STEPS, SAVED = 6, 3

BF16 = ("--mixed-precision", "bf16")
PURE_BF16 = ("--mixed-precision", "no", "--set", "model.dtype=bf16")
#: adapters of rank 4 learn slower than the whole model: at 5e-2 their loss falls as clearly in 6 steps
LORA = ("--set", "model.lora.r=4", "--set", "model.lora.alpha=8", "--lr", "5e-2")
GC = ("--set", "training.gradient_checkpointing=true")
#: aot_eager: dynamo and AOTAutograd capture forward and backward, no C++ compile (tests/core/test_compile_runs.py)
COMPILE = ("--set", "training.compile.enabled=true", "--set", "training.compile.backend=aot_eager")
STREAMING = ("--set", "data.streaming=true")
SGD = ("--set", "optimizer.name=sgd", "--lr", "0.1")  # momentum 0.9, its default

#: the matrix's rows as launches (tests/strategy_fsdp/test_mesh.py's mesh settings)
ROWS = {
    "ddp": ("--strategy", "ddp", "--num-processes", "2"),
    "fsdp2": ("--strategy", "fsdp2", "--num-processes", "2"),
    "fsdp1": ("--strategy", "fsdp1", "--num-processes", "2"),
    "hsdp 2x2": ("--strategy", "fsdp", "--num-processes", "4", "--micro-batch-size", "2", "--set", "strategy.dp_replicate=2"),
    "tp 2": ("--strategy", "fsdp", "--num-processes", "2", "--micro-batch-size", "8", "--set", "strategy.tp=2"),
    "fsdp 2 x tp 2": ("--strategy", "fsdp", "--num-processes", "4", "--set", "strategy.dp_shard=2", "--set", "strategy.tp=2"),
    "zero1": ("--strategy", "zero1", "--num-processes", "2"),
    "zero2": ("--strategy", "zero2", "--num-processes", "2"),
    "zero3": ("--strategy", "zero3", "--num-processes", "2"),
}

#: a matrix column -> the options that ask for it
FEATURES = {
    "bf16": BF16,
    "pure bf16": PURE_BF16,
    "LoRA": LORA,
    "gradient checkpointing": GC,
    "compile": COMPILE,
    "streaming": STREAMING,
    "sgd": SGD,
    "adamw": (),  # optimizer.name's default
}


@dataclass(frozen=True)
class Combination:
    row: str
    columns: tuple[str, ...]

    def args(self) -> list[str]:
        return [arg for column in self.columns for arg in FEATURES[column]] + list(ROWS[self.row])


#: name -> a row and the columns one launch trains together (one precision and one optimizer each)
COMBINATIONS: dict[str, Combination] = {
    "ddp-bf16": Combination("ddp", ("bf16", "adamw")),
    "ddp-pure-bf16": Combination("ddp", ("pure bf16", "adamw")),
    "fsdp2-bf16-streaming": Combination("fsdp2", ("bf16", "streaming", "adamw")),
    "fsdp2-pure-bf16": Combination("fsdp2", ("pure bf16", "adamw")),
    # (compile under FSDP1 is refused: its checkpoints did not resume, found here)
    "fsdp1-bf16-streaming": Combination("fsdp1", ("bf16", "streaming", "adamw")),
    "fsdp1-pure-bf16-sgd": Combination("fsdp1", ("pure bf16", "sgd")),
    "hsdp-bf16-lora-gc-streaming": Combination("hsdp 2x2", ("bf16", "LoRA", "gradient checkpointing", "streaming", "adamw")),
    "hsdp-pure-bf16-sgd-compile": Combination("hsdp 2x2", ("pure bf16", "sgd", "compile")),
    "tp-bf16-gc": Combination("tp 2", ("bf16", "gradient checkpointing", "adamw")),
    "tp-pure-bf16-sgd": Combination("tp 2", ("pure bf16", "sgd")),
    "fsdp-tp-bf16-gc": Combination("fsdp 2 x tp 2", ("bf16", "gradient checkpointing", "adamw")),
    "fsdp-tp-pure-bf16-sgd": Combination("fsdp 2 x tp 2", ("pure bf16", "sgd")),
    "zero1-bf16-lora-compile-streaming": Combination("zero1", ("bf16", "LoRA", "compile", "streaming", "adamw")),
    "zero1-pure-bf16": Combination("zero1", ("pure bf16", "adamw")),
    "zero2-bf16-compile-streaming": Combination("zero2", ("bf16", "compile", "streaming", "adamw")),
    "zero2-pure-bf16": Combination("zero2", ("pure bf16", "adamw")),
    "zero3-bf16-compile-streaming": Combination("zero3", ("bf16", "compile", "streaming", "adamw")),
    "zero3-pure-bf16": Combination("zero3", ("pure bf16", "adamw")),
}
