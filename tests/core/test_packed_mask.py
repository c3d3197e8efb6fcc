"""Packed rows get their examples' boundaries as an explicit block-diagonal causal mask (sdpa,
eager), built on the device from the restarting position ids: no example sees another, and
nothing is read back to the host to find the boundaries (transformers' inference does read)."""

from __future__ import annotations

import pytest

from acc_train.loop.loss import _packed_mask, _token_losses, packed_mask_kind


def tiny_llama(attn: str, **config: object):  # type: ignore[no-untyped-def]
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **config
    )
    cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg).eval()


def packed_row():  # type: ignore[no-untyped-def]
    """Three examples (5, 3 and 4 tokens) in one row of 12, and each alone."""
    import torch

    g = torch.Generator().manual_seed(1)
    examples = [torch.randint(1, 64, (n,), generator=g) for n in (5, 3, 4)]
    ids = torch.cat(examples)[None]
    positions = torch.cat([torch.arange(len(e)) for e in examples])[None]
    return examples, ids, positions


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_packed_example_gives_the_logits_it_gives_alone(attn: str) -> None:
    import torch

    model = tiny_llama(attn)
    kind = packed_mask_kind(model)
    assert kind == {"sdpa": "bool", "eager": "additive"}[attn]
    examples, ids, positions = packed_row()
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, attention_mask=_packed_mask(positions, kind, torch.float32), use_cache=False).logits[0]
        start = 0
        for example in examples:
            alone = model(input_ids=example[None], use_cache=False).logits[0]
            torch.testing.assert_close(packed[start : start + len(example)], alone, atol=1e-5, rtol=1e-5)
            start += len(example)
        # the mask is what makes it so: plain causal attention (same positions) lets the later examples see the earlier
        leaky = model(input_ids=ids, position_ids=positions, attention_mask=torch.ones_like(ids), use_cache=False).logits[0]
        assert not torch.allclose(leaky[5:8], packed[5:8], atol=1e-3)


def test_flex_attention_keeps_packed_examples_apart_from_the_position_ids() -> None:
    """The third attention implementation that runs on CPU: given no mask
    (``packed_mask_kind`` None), transformers builds flex attention's block mask from the
    restarting position ids; each example's logits equal its logits alone."""
    import torch

    model = tiny_llama("flex_attention")
    assert packed_mask_kind(model) is None
    examples, ids, positions = packed_row()
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
        start = 0
        for example in examples:
            alone = model(input_ids=example[None], use_cache=False).logits[0]
            torch.testing.assert_close(packed[start : start + len(example)], alone, atol=1e-5, rtol=1e-5)
            start += len(example)


def test_the_loss_of_a_packed_batch_is_the_loss_transformers_infers() -> None:
    """The loop's loss with the explicit mask equals the loss with transformers inferring the
    boundaries from the position ids (what the loop did before)."""
    import torch

    from acc_train.data.rows import IGNORE_INDEX

    model = tiny_llama("sdpa")
    _, ids, positions = packed_row()
    batch = {"input_ids": ids, "position_ids": positions, "labels": ids.masked_fill(positions == 0, IGNORE_INDEX)}
    with torch.no_grad():
        explicit, n = _token_losses(model, batch, "bool")
        inferred, m = _token_losses(model, batch, None)
    assert int(n) == int(m) == 9
    torch.testing.assert_close(explicit, inferred)


@pytest.mark.parametrize(
    ("attn", "config"),
    [("flex_attention", {}), ("sdpa", {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 4})],
)
def test_boundaries_are_left_to_transformers_where_a_single_mask_cannot_say_them(attn: str, config: dict) -> None:
    """Flex attention takes the position ids; a model with per-layer masks (a sliding window)
    needs transformers to build each layer's. (Flash attention is given the collator's varlen
    keywords instead: transformers infers its boundaries only for a batch of one row,
    tests/data/test_packing_boundaries.py.)"""
    from types import SimpleNamespace

    cfg = SimpleNamespace(_attn_implementation=attn, sliding_window=config.get("sliding_window"), layer_types=config.get("layer_types"))
    assert packed_mask_kind(SimpleNamespace(config=cfg)) is None


def _device_reads(fn):  # type: ignore[no-untyped-def]
    """``fn()``'s result and the places it read a tensor's value back (``item``, ``bool``, ...)."""
    import traceback

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    sites: list[str] = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.ops.aten._local_scalar_dense.default:
                outside = [f for f in traceback.extract_stack() if "/torch/" not in f.filename]
                sites.append(f"{outside[-1].filename}:{outside[-1].lineno}")
            return func(*args, **(kwargs or {}))

    with Reads():
        out = fn()
    return out, sites


def _batches():  # type: ignore[no-untyped-def]
    """The three shapes of a training batch: rows that never restart (the demo, continuous text:
    no position ids, no mask), packed rows whose examples restart, and rows padded per batch."""
    import torch

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 64, (2, 12), generator=g)
    _, packed_ids, positions = packed_row()
    padded = {"input_ids": ids.clone(), "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    padded["attention_mask"][1, 7:] = 0
    padded["input_ids"][1, 7:] = 0
    padded["labels"][1, 7:] = -100
    return {
        "continuous": {"input_ids": ids, "labels": ids},
        "packed": {"input_ids": packed_ids, "labels": packed_ids, "position_ids": positions},
        "padded": padded,
    }


@pytest.mark.parametrize("shape", ["continuous", "packed", "padded"])
def test_the_training_forward_reads_nothing_back_and_keeps_the_loss(shape: str) -> None:
    """Issue 41: transformers 5 makes position ids for a row given none and, with no mask, reads
    the device on every forward to ask whether they restart; for padded rows, whether any token
    is padding. The loop's forward runs SDPA with every mask given (none for rows that never
    restart: SDPA's causal kernel) and reads nothing, with the loss transformers computes."""
    import torch

    model = tiny_llama("sdpa")
    batch = _batches()[shape]
    (plain, _), plain_reads = _device_reads(lambda: _token_losses(model, batch, packed_mask_kind(model)))
    if shape != "packed":  # (packed rows already had their mask given)
        assert plain_reads, "transformers' own mask path reads the device (if this fails, transformers changed: the switch may be unneeded)"
    with torch.no_grad():
        (summed, count), reads = _device_reads(lambda: _token_losses(model, batch, packed_mask_kind(model), model.config))
    assert reads == []
    torch.testing.assert_close(summed, plain.detach(), atol=1e-5, rtol=1e-5)
    assert model.config._attn_implementation == "sdpa", "generation and save_pretrained see the model's own implementation"
    # what transformers computes from the labels, for the same rows
    expected = model(**batch, use_cache=False).loss * (batch["labels"][:, 1:] != -100).sum()
    torch.testing.assert_close(summed, expected.detach(), atol=1e-4, rtol=1e-5)
