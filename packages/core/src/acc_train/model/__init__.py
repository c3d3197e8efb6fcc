"""The model of a job: building or loading it, LoRA adapters, the demo's byte tokenizer, prompt text, optimizers."""
