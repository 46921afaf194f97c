"""Activation budgets and byte sizes: the one place they are read and turned into bytes.

A budget bounds the device bytes of saved activations at any instant (runtime/residency.py). It is
written the same way in the DeepSpeed config, on the command line and in the Python API:

- a number in (0, 1] is a fraction of the keep-all peak of saved activations (``0.5``; the integer
  ``1`` is the fraction 1.0, the whole peak), and so is a percentage (``"50%"``);
- an integer > 1 is bytes (``12884901888``);
- a string is a size: ``"12GiB"``, ``"512MiB"``, ``"8GB"``, ``"1.5e9"`` (KiB/MiB/GiB/TiB are powers of
  two, KB/MB/GB/TB powers of ten, B or no unit is bytes);
- a float > 1 (``1.5``, or ``8e9``, which JSON reads as a float) is refused: ``1.5`` is most likely a
  mistaken fraction, and bytes are whole. Write bytes as an integer or a quoted size string;
- ``"auto"``: what the device has room for beside the model state, less a margin
  (`auto_budget_bytes`; the runtime measures the room with the allocator on a GPU, and takes the
  hardware preset's memory less 16 B per parameter on a CPU).

A fraction becomes bytes as ``int(fraction * keep_all_bytes)`` (`Budget.of`). Sizes (the host pool)
follow the same rules without the fraction case. This module imports no torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
UNIT_NAMES = "B, KB, MB, GB, TB (powers of ten), KiB, MiB, GiB, TiB (powers of two)"
SIZE_EXAMPLES = '"12GiB", "512MiB", "8GB" or "1.5e9"'
BUDGET_FIX = f"Fix: a fraction of the keep-all peak in (0, 1] such as 0.5, or a size such as {SIZE_EXAMPLES}"
SIZE_FIX = f"Fix: an integer number of bytes, a size such as {SIZE_EXAMPLES}, or null for no limit"

_SIZE_PATTERN = re.compile(r"^\s*([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z%]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in a size string: ``"12GiB"`` -> 12884901888, ``"8GB"`` -> 8000000000, ``"1.5e9"`` ->
    1500000000, ``"4096"`` -> 4096. A size with a unit is rounded to the nearest byte; a plain number
    must be whole. Raises ValueError saying what is wrong if `text` is not a positive size."""
    match = _SIZE_PATTERN.match(text) if isinstance(text, str) else None
    if not match:
        raise ValueError("not a size (a number and an optional unit)")
    number, unit = float(match.group(1)), match.group(2)
    if unit.lower() not in UNITS:
        raise ValueError(f"unknown unit {unit!r} (units: {UNIT_NAMES})")
    if not math.isfinite(number):
        raise ValueError(f"{match.group(1)} is not a finite number")
    if number <= 0:
        raise ValueError("a size must be positive")
    if unit == "" and number != int(number):
        raise ValueError(f"{number:g} is not a whole number of bytes")
    n = int(round(number * UNITS[unit.lower()]))
    if n < 1:
        raise ValueError("less than one byte")
    return n


def parse_optional_size(value: Any) -> int | None:
    """A size from a JSON value: integer bytes, a size string, or None (no limit). Raises
    ValueError("what is wrong. Fix: ...")."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"not a size. {SIZE_FIX}")
    if isinstance(value, str):
        try:
            return parse_size(value)
        except ValueError as e:
            raise ValueError(f"{e}. {SIZE_FIX}") from None
    if isinstance(value, float):
        raise ValueError(f"a float is not a size (bytes are whole; JSON reads 64e9 as a float). {SIZE_FIX}")
    if value <= 0:
        raise ValueError(f"a size must be > 0. {SIZE_FIX}")
    return int(value)


def _parse_percentage(text: str) -> float:
    try:
        percent = float(text[:-1])
    except ValueError:
        percent = math.nan
    if not (math.isfinite(percent) and 0 < percent <= 100):
        raise ValueError('a percentage must be in (0%, 100%]. Fix: e.g. "50%", or 0.5')
    return percent / 100


AUTO = "auto"  # the budget is what the device has room for (auto_budget_bytes)
# kept free by an "auto" budget, of the device's memory: backward's own temporaries, the allocator's
# fragmentation, communication buffers (a rule of thumb, not a measurement: say a number if it is wrong)
AUTO_MARGIN = 0.10


def auto_budget_bytes(device_bytes: float, state_bytes: float, margin: float = AUTO_MARGIN) -> int:
    """An "auto" budget: the device's memory less the model state (weights, gradients, optimizer
    state) and a margin of the device's memory; 0 if nothing is left."""
    return max(0, int(device_bytes - state_bytes - margin * device_bytes))


def parse_budget_value(value: Any) -> float | int | str:
    """A budget from a JSON value or a string: a fraction of the keep-all peak (a float in (0, 1]),
    bytes (an int > 1), or "auto", by the rules of the module docstring. Raises ValueError("what is
    wrong. Fix: ...")."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"not a budget. {BUDGET_FIX}")
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == AUTO:
            return AUTO
        if text.endswith("%"):
            return _parse_percentage(text)
        try:
            plain = float(text)
        except ValueError:
            plain = None
        if plain is not None and 0 < plain <= 1:
            return float(plain)
        try:
            return parse_size(text)
        except ValueError as e:
            raise ValueError(f"{e}. {BUDGET_FIX}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"not a finite number. {BUDGET_FIX}")
    if value <= 0:
        raise ValueError(f"the budget must be > 0. {BUDGET_FIX}")
    if value <= 1:
        return float(value)  # 1 (int) is the fraction 1.0, the whole keep-all peak
    if isinstance(value, float):
        raise ValueError(
            "a float > 1 is ambiguous (a mistaken fraction? bytes must be whole). Fix: for a fraction of "
            'the keep-all peak use (0, 1] such as 0.5; for bytes an integer (12884901888) or a quoted size ("12GiB", "8e9")'
        )
    return int(value)


@dataclass(frozen=True)
class Budget:
    """A parsed budget: `value` is a fraction of the keep-all peak (float) or bytes (int); `text`
    is how it was written (for messages)."""

    value: float | int | str  # (str: AUTO)
    text: str = field(default="", compare=False)

    @classmethod
    def parse(cls, written: Any) -> "Budget":
        """`written` by the rules of the module docstring; ValueError says what is wrong."""
        return cls(parse_budget_value(written), str(written))

    @property
    def is_fraction(self) -> bool:
        return isinstance(self.value, float)

    @property
    def is_auto(self) -> bool:
        return self.value == AUTO

    def of(self, keep_all_bytes: int, auto_bytes: int | None = None) -> int:
        """The budget in bytes for a step whose keep-all peak of saved activations is `keep_all_bytes`
        (`auto_bytes`: what an "auto" budget came to on this device, `auto_budget_bytes`)."""
        if isinstance(keep_all_bytes, bool) or not isinstance(keep_all_bytes, int) or keep_all_bytes < 0:
            raise ValueError(f"keep_all_bytes must be a non-negative int, got {keep_all_bytes!r}")
        if self.is_auto:
            if auto_bytes is None:
                raise ValueError('an "auto" budget needs the device\'s room for activations (auto_bytes)')
            return int(auto_bytes)
        return int(self.value * keep_all_bytes) if self.is_fraction else int(self.value)

    @property
    def json_value(self) -> float | int | str:
        return self.value if self.is_auto else float(self.value) if self.is_fraction else int(self.value)

    def __str__(self) -> str:
        if self.is_auto:
            return AUTO
        return f"{self.value * 100:g}%" if self.is_fraction else f"{int(self.value) / 1e9:.2f} GB"


def budget_bytes(budget: float | int | str | Budget, keep_all_bytes: int) -> int:
    """`budget` (as written, or parsed) in bytes for a keep-all peak of `keep_all_bytes`."""
    if not isinstance(budget, Budget):
        try:
            budget = Budget.parse(budget)
        except ValueError as e:
            raise ValueError(f"budget must be a fraction in (0, 1] or a positive number of bytes, got {budget!r}: "
                             f"{e}") from None
    return budget.of(keep_all_bytes)


def resolve_budget(budget: float | int | str | Budget, profile) -> int:
    """The budget in bytes for `profile` (a StepProfile: a fraction is of its keep-all bytes)."""
    return budget_bytes(budget, profile.total_bytes)


# ---- bytes per parameter (the one place: the runtime, the planners and the whole-job simulator read them)
# Model state per parameter, mixed-precision training with Adam (Rajbhandari et al. 2020, "ZeRO",
# section 3.1: 2 + 2 + K bytes, K = 12): 16-bit weights, 16-bit gradients, and the optimizer's fp32
# master weights, momentum and variance.
WEIGHT_BYTES, GRADIENT_BYTES, OPTIMIZER_BYTES = 2, 2, 12
PINNED_OPTIMIZER_BYTES_PER_PARAM = 16  # ZeRO-Offload keeps fp32 master, m, v and gradient in pinned host memory
ADAM_BYTES_PER_PARAM = 30  # fused Adam reads fp32 master, grad, m, v (16 B), writes master, m, v (12 B) + 16-bit copy (2 B)
CPU_ADAM_BYTES_PER_PARAM = 28  # the same on the host, without the 16-bit copy
GRAD_BYTES = 2  # gradients reduced and offloaded in 16 bits (DeepSpeed's communication_data_type for bf16/fp16)
GATHER_BYTES_PER_PARAM = 2  # 16-bit parameters gathered (bf16/fp16 training)
MASTER_BYTES = 4  # the fp32 shard each rank keeps and casts to 16 bits before it is gathered


def model_state_bytes(params: int, zero: int = 0, dp: int = 1) -> int:
    """Device bytes of one rank's model state for `params` weight elements: ZeRO stage 1 shards
    the optimizer state over the `dp` data-parallel ranks, stage 2 the gradients too, stage 3 the
    weights too (the ZeRO paper's 4 + K, 2 + (2 + K) / dp, (4 + K) / dp bytes per parameter)."""
    return sum(model_state_parts(params, zero, dp))


def model_state_parts(params: int, zero: int = 0, dp: int = 1) -> tuple[int, int, int]:
    """`model_state_bytes` as (weights, gradients, optimizer state), each sharded by its ZeRO stage."""
    if zero not in (0, 1, 2, 3) or isinstance(zero, bool) or dp < 1:
        raise ValueError(f"zero must be 0-3 and dp >= 1, got zero {zero!r}, dp {dp!r}")
    shard = [1, 1, 1]  # weights, gradients, optimizer
    for stage, part in ((1, 2), (2, 1), (3, 0)):
        if zero >= stage:
            shard[part] = dp
    weights, grads, optimizer = (-(-params * b // n) for b, n in zip((WEIGHT_BYTES, GRADIENT_BYTES,
                                                                       OPTIMIZER_BYTES), shard))
    return weights, grads, optimizer


__all__ = ["ADAM_BYTES_PER_PARAM", "AUTO", "AUTO_MARGIN", "CPU_ADAM_BYTES_PER_PARAM", "GATHER_BYTES_PER_PARAM",
           "GRAD_BYTES", "MASTER_BYTES", "PINNED_OPTIMIZER_BYTES_PER_PARAM", "Budget", "auto_budget_bytes",
           "budget_bytes", "model_state_bytes", "model_state_parts", "parse_budget_value", "parse_optional_size",
           "parse_size", "resolve_budget"]
