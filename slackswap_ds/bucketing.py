"""Bucketing of variable-length batches: the sequence dimension padded up to the next multiple of
`multiple`, so that a job sees at most max_len / multiple input shapes (each profiled and planned
once, `max_shapes` of them kept) instead of one per length.

Padding is exact only where the model ignores the padded positions, so only keys whose padding
means "ignore me" in Hugging Face models are padded:

    attention_mask            0      (never attended to; made, all ones, if the batch has input_ids
                                      and none, so that bidirectional models ignore the padding too)
    labels                    -100   (no loss; the loss is the mean over the real tokens)
    input_ids, token_type_ids,
    position_ids, decoder_*   0      (masked, so the value does not matter)

Positions are added at the end (right padding). Any other tensor that has the sequence length is
refused (its padding value is unknown: pass `pad_values`), and tensors of other sizes are left
alone. The model's outputs then have the padded length (logits, hidden states); the loss is, up to
rounding, the unpadded batch's.
"""

from __future__ import annotations

from typing import Mapping

import torch

from .errors import SlackSwapError

PAD_VALUES = {"input_ids": 0, "attention_mask": 0, "labels": -100, "token_type_ids": 0, "position_ids": 0,
              "decoder_input_ids": 0, "decoder_attention_mask": 0}


class BucketingError(SlackSwapError, ValueError):
    """A batch that cannot be padded safely."""


def padded_length(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def pad_to_multiple(batch: Mapping[str, object], multiple: int, pad_values: Mapping[str, int] | None = None,
                    dim: int = 1) -> dict:
    """`batch` (keyword inputs of a model) with its sequence dimension `dim` padded to the next
    multiple of `multiple` (see the module docstring); a new dict, the input is not changed."""
    if multiple < 1:
        raise BucketingError(f"pad_to_multiple must be >= 1; got {multiple}")
    values = {**PAD_VALUES, **(pad_values or {})}
    reference = next((k for k in ("input_ids", "labels", "attention_mask") if isinstance(batch.get(k), torch.Tensor)),
                     None)
    if reference is None:
        raise BucketingError("pad_to_multiple needs a batch with input_ids, labels or attention_mask (keyword "
                             f"inputs of a Hugging Face-style model); got keys {sorted(batch)}")
    length = batch[reference].shape[dim]
    target = padded_length(length, multiple)
    out = dict(batch)
    if "attention_mask" not in out and isinstance(out.get("input_ids"), torch.Tensor):
        out["attention_mask"] = torch.ones_like(out["input_ids"])
    if target == length:
        return out
    for key, value in out.items():
        if not isinstance(value, torch.Tensor) or value.dim() <= dim or value.shape[dim] != length:
            continue
        if key not in values:
            raise BucketingError(f"pad_to_multiple does not know how to pad {key!r} (shape {tuple(value.shape)}, "
                                 f"sequence length {length} in dimension {dim}): pass pad_values={{{key!r}: ...}}")
        shape = list(value.shape)
        shape[dim] = target - length
        out[key] = torch.cat([value, value.new_full(shape, values[key])], dim=dim)
    return out
