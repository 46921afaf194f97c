"""What an aten op is, as the tracer (tracing.py) and a replay (replay.py) see it.

A *compute* op is one that makes or changes data: views and aliases are free and not numbered
(`FREE_OPS`), so the tracer and a replay count the ops of a layer call alike and op k means the
same op to both. For a compute op they need to know whether it draws random numbers and from
which generator, which arguments it writes into (in place, out=, or unmarked as batch norm's
running statistics), and how to see a tensor again over a storage (`meta_of`, `rebuild`). The
answers per op are cached: each op is asked about on every call.

`no_dispatch` is how the runtime does its own tensor work (copies, views over storages) without
any dispatch mode (the tracer, a Recorder, a ReplayMode) seeing it. Those modes are `RuntimeMode`s:
code compiled by torch.compile that a layer calls runs compiled under them, as without SlackSwap.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["FREE_OPS", "RuntimeMode", "arg_at", "by_value", "bytes_of", "generator_of", "is_compute", "is_random",
           "meta_of", "mutated_args", "no_dispatch", "rebuild", "tensors_in", "written_args"]

no_dispatch = torch._C._DisableTorchDispatch  # our own tensor work: invisible to every dispatch mode

# Ops that move no data or only describe tensors: not compute ops (the tracer skips them too).
FREE_OPS = frozenset({"detach", "alias", "lift_fresh", "sym_size", "sym_stride", "sym_numel", "is_same_size",
                      "_unsafe_view", "_reshape_alias"})  # the last two alias their input: views in all but name

# Ops that write into arguments their schema does not mark (``Tensor?`` running statistics of
# batch norm, updated in place by the kernel): argument positions, by op name.
_UNMARKED_WRITES = {"native_batch_norm": (3, 4), "cudnn_batch_norm": (3, 4), "miopen_batch_norm": (3, 4)}


class RuntimeMode(TorchDispatchMode):
    """A dispatch mode of the runtime under which compiled code still runs compiled. Dynamo runs a
    compiled function called under any other mode eagerly ("non-infra torch dispatch mode present"):
    a `torch.compile`d function inside an eager layer (an activation, HF's compiled flex attention)
    then ran other kernels and, with inductor, drew other dropout masks than the user's compiled
    model (the loss differed, under every plan). With this, the mode is off while Dynamo compiles and
    sees only what the compiled code dispatches when it runs (its extern kernels, the allocation of
    buffers its fused kernels then write unseen): a replay cannot redo such code, so the profiled step
    finds the layers that call it (tracing.StepTracer.compiled_in) and they are never recomputed.

    A higher-order operator that reaches the mode (the `run_with_rng_state` of a compiled block's
    backward under activation checkpointing, flex attention run eagerly) runs as it is: it is not a
    compute op (`is_compute`), so it is neither numbered nor recorded, and a replay runs it again.
    Without this, torch raised "no rule registered for HigherOrderOperator"."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


_COMPUTE: dict[OpOverload, bool] = {}
_RANDOM: dict[OpOverload, bool] = {}
_MUTATED: dict[OpOverload, tuple[int, ...]] = {}
_WRITES: dict[OpOverload, tuple[int, ...]] = {}


def is_compute(func: OpOverload) -> bool:
    """A numbered op (not a view, alias or shape query; not a higher-order operator: RuntimeMode)."""
    out = _COMPUTE.get(func)
    if out is None:
        out = _COMPUTE[func] = isinstance(func, OpOverload) and not (func.is_view or
                                                                     func.overloadpacket.__name__ in FREE_OPS)
    return out


def is_random(func: OpOverload) -> bool:
    out = _RANDOM.get(func)
    if out is None:
        out = _RANDOM[func] = torch.Tag.nondeterministic_seeded in func.tags
    return out


def mutated_args(func: OpOverload) -> tuple[int, ...]:
    """Positions (in the schema) of the arguments `func` marks as written (``Tensor(a!)``): an
    in-place or out= op, whose result is its argument."""
    out = _MUTATED.get(func)
    if out is None:
        out = tuple(i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write)
        _MUTATED[func] = out
    return out


def written_args(func: OpOverload) -> tuple[int, ...]:
    """Every argument `func` writes into: the marked ones and the unmarked ones we know of."""
    out = _WRITES.get(func)
    if out is None:
        out = tuple(sorted(set(mutated_args(func)) | set(_UNMARKED_WRITES.get(func.overloadpacket.__name__, ()))))
        _WRITES[func] = out
    return out


def arg_at(func: OpOverload, i: int, args: tuple, kwargs: dict):
    """The value of schema argument `i` in one call of `func` (positional or by keyword)."""
    if i < len(args):
        return args[i]
    return kwargs.get(func._schema.arguments[i].name)


def tensors_in(args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    """The tensors among an op's arguments (lists of tensors included)."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (tuple, list)):
            for w in v:
                if isinstance(w, torch.Tensor):
                    yield w


def generator_of(func: OpOverload, args: tuple, kwargs: dict) -> torch.Generator | None:
    """The generator a random op draws from: its ``generator=`` argument, else its device's default."""
    gen = kwargs.get("generator")
    if gen is not None:
        return gen
    device = kwargs.get("device")
    if device is None:
        device = next((t.device for t in tensors_in(args, kwargs)), None)
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type, None)
    gens = getattr(module, "default_generators", None)
    if not gens:
        return None
    return gens[device.index if device.index is not None else module.current_device()]


def by_value(t: torch.Tensor, device_type: str) -> bool:
    """A result a record keeps by value: empty, or a few numbers on another device than the model's
    (fused attention's philox seed and offset on the CPU): no saved entry will ever hold it."""
    return t.numel() == 0 or (t.numel() <= 16 and t.device.type != device_type)


# ---- tensors over storages ---------------------------------------------------------------------
def meta_of(t: torch.Tensor) -> tuple:
    """(dtype, shape, stride, storage offset): how to view a storage as `t` again."""
    return (t.dtype, t.size(), t.stride(), t.storage_offset())


def rebuild(storage_owner: torch.Tensor, meta: tuple) -> torch.Tensor:
    """A tensor with `meta` (dtype, shape, stride, offset) over the storage of `storage_owner`."""
    dtype, shape, stride, offset = meta
    with no_dispatch():  # (a fresh tensor that requires no grad: set_ records nothing, grad mode or not)
        return torch.empty(0, dtype=dtype, device=storage_owner.device).set_(
            storage_owner.untyped_storage(), offset, shape, stride)


def bytes_of(st: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over a whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, 0, (st.nbytes(),), (1,))
