"""PACK: a saved storage whose elements take at most two bit patterns, stored in one bit per element.

Dropout leaves such tensors behind: CUDA's `native_dropout` saves a bool mask (one byte per
element), CPU dropout its float noise, every value 0 or 1/(1-p) (four bytes). The profile marks
them by the ops that made them, never by their values (profiler.py, `two_valued`); packing then
stores, in one uint8 buffer on the tensor's device,

    [ the first element's bit pattern | the other pattern | one bit per element: 1 = the other ]

and unpacking writes every element's pattern back. Both compare and select whole bit patterns (the
elements viewed as integers of their width), so the round trip is exact by construction: -0.0,
NaN payloads and bool bytes come back as they were. A storage with a third pattern cannot be
packed; an executor checks the round trip of each key's first packing (entries.py) so that a mark
made wrongly costs memory, never correctness.

Each way is one memory-bound pass over the storage on the compute stream (the planners charge
`Activation.pack_s` each way).
"""

from __future__ import annotations

import numpy as np
import torch

from ..step_profile import packed_size

__all__ = ["Packed", "pack", "packed_size", "unpack"]

_BY_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BIT = {}  # device -> the weights 1, 2, 4, ..., 128 (uint8)


class Packed:
    """A packed storage: the buffer, and how to unpack it (element width and count, storage bytes)."""

    __slots__ = ("buffer", "width", "count", "nbytes")

    def __init__(self, buffer: torch.Tensor, width: int, count: int, nbytes: int):
        self.buffer, self.width, self.count, self.nbytes = buffer, width, count, nbytes


def _bits(device: torch.device) -> torch.Tensor:
    bits = _BIT.get(device)
    if bits is None:
        bits = _BIT[device] = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=device)
    return bits


def packable_width(dtype: torch.dtype) -> bool:
    return dtype.itemsize in _BY_WIDTH


@torch.no_grad()
def pack(st: torch.UntypedStorage, dtype: torch.dtype, torch_ops: bool = False) -> Packed:
    """Storage `st` (of `dtype` elements) packed; the caller has made sure it is two-valued.
    (`torch_ops`: the device path on a CPU storage too, for tests without a GPU.)"""
    width = dtype.itemsize
    nbytes = st.nbytes()
    count = nbytes // width
    values = torch.empty(0, dtype=_BY_WIDTH[width], device=st.device).set_(st, 0, (count,), (1,))
    out = torch.empty(packed_size(nbytes, width), dtype=torch.uint8, device=st.device)
    if count == 0:
        return Packed(out, width, 0, nbytes)
    if values.is_cpu and not torch_ops:  # NumPy: a few passes in C, without torch's per-op dispatch (several times faster here)
        v, o = values.numpy(), out.numpy()
        other = v != v[0]
        o[:2 * width].view(v.dtype)[:] = (v[0], v[other.argmax()])  # the first other pattern (the first if none)
        o[2 * width:] = np.packbits(other, bitorder="little")
        return Packed(out, width, count, nbytes)
    other = values != values[0]
    pair = out[:2 * width].view(values.dtype)
    pair[0] = values[0]
    pair[1] = values[other.view(torch.uint8).argmax()]
    bits = other
    if count % 8:
        bits = torch.cat([other, other.new_zeros(8 - count % 8)])
    torch.sum(bits.view(-1, 8).view(torch.uint8) * _bits(st.device), dim=1, dtype=torch.uint8,
              out=out[2 * width:])
    return Packed(out, width, count, nbytes)


@torch.no_grad()
def unpack(packed: Packed, buffer: torch.Tensor | None = None, torch_ops: bool = False) -> torch.Tensor:
    """The storage's bytes again, as a flat uint8 tensor on the buffer's device (`buffer`: the
    packed bytes where they are now, e.g. copied back in; default: `packed.buffer`; `torch_ops`: as
    for `pack`)."""
    buffer = packed.buffer if buffer is None else buffer
    width, count = packed.width, packed.count
    if count == 0:
        return torch.empty(packed.nbytes, dtype=torch.uint8, device=buffer.device)
    if buffer.is_cpu and not torch_ops:
        b = buffer.numpy()
        first, second = b[:2 * width].view(np.dtype(f"<u{width}"))
        # first ^ (other * (first ^ second)): each element's pattern, exact (the product is 0 or first ^ second)
        values = np.unpackbits(b[2 * width:], count=count, bitorder="little").astype(first.dtype)
        values *= first ^ second
        values ^= first
        return torch.from_numpy(values.view(np.uint8))
    pair = buffer[:2 * width].view(_BY_WIDTH[width])
    out = torch.empty(packed.nbytes, dtype=torch.uint8, device=buffer.device)
    other = (buffer[2 * width:].unsqueeze(1) & _bits(buffer.device)).ne(0).view(-1)[:count]
    torch.where(other, pair[1], pair[0], out=out.view(pair.dtype))
    return out
