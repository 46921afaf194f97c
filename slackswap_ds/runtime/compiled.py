"""Compiled parts of a model: which ones a plan can work around, and how a step runs beside them.

A dispatch mode (the profiler's tracer, a recording of a layer call to replay) that is active while
torch.compile'd code runs makes Dynamo run that code eagerly, and the compiled module keeps running
eagerly on later calls too (measured with torch 2.13, inductor on CPU: the loss becomes the
uncompiled model's). So SlackSwap never lets a dispatch mode see compiled code. What it can do
today is plan at the boundary of compiled layers, torchtitan's pattern (`blocks[i] = torch.compile(blocks[i])`):

* each compiled layer of a block stack is one opaque region: its call runs with every dispatch
  mode suspended (`ModesSuspended`), so it runs as compiled, and the profiler times it as one op;
* its saved tensors (AOTAutograd's, packed by the ordinary saved-tensor hooks when the compiled
  forward saves them) are kept, swapped, or recomputed per tensor. Recomputing runs the call
  again, whole and compiled, in backward, from the default generators' states it started from
  (replay.run_compiled_replay, as torch.utils.checkpoint does): the compiled forward saves the same
  tensors in the same order, so its n-th save regenerates forward's n-th (`hooks` counts them);
  a verifying step checks the bytes, as for any replay;
* the eager rest of the model (embeddings, head, eager layers) is planned as before.

A compiled module anywhere else (the whole model: `torch.compile(model)`, `engine.compile()`, Hugging
Face's `torch_compile=True`; or a compiled part inside an eager layer) is refused with
`CompiledCodeError`, naming it and what to do: its saved tensors cannot be planned from outside
without running it eagerly.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import SlackSwapError
from .regions import find_layers

__all__ = ["CompiledCodeError", "CompiledLayers", "ModesSuspended", "check_model", "compiled_layers", "is_compiled"]


class CompiledCodeError(SlackSwapError):
    """A compiled part of the model that SlackSwap cannot plan around (see the module docstring)."""


def is_compiled(module: nn.Module) -> bool:
    """torch.compile(module) (an OptimizedModule) or module.compile() (in place; DeepSpeed's
    engine.compile() does this to the model)."""
    return type(module).__name__ == "OptimizedModule" or getattr(module, "_compiled_call_impl", None) is not None


def _compiled_parts(model: nn.Module) -> list[str]:
    """Paths of the outermost compiled modules of `model` ("" for the model itself)."""
    found: list[str] = []

    def visit(module: nn.Module, path: str) -> None:
        if is_compiled(module):
            found.append(path)
            return
        for name, child in module.named_children():
            visit(child, f"{path}.{name}" if path else name)

    visit(model, "")
    return found


def check_model(model: nn.Module) -> frozenset[str]:
    """The compiled layers of `model`'s block stacks; CompiledCodeError for any compiled part that is
    not one (compiled_layers)."""
    return compiled_layers(model, find_layers(model))


def compiled_layers(model: nn.Module, layers: list[tuple[str, nn.Module]]) -> frozenset[str]:
    """The paths of `layers` (regions.find_layers) that are compiled; CompiledCodeError for a
    compiled part of `model` that is not one of them."""
    paths = {path for path, _ in layers}
    parts = _compiled_parts(model)
    others = [p for p in parts if p not in paths]
    if not others:
        return frozenset(parts)
    if others == [""]:
        what = f"the whole model ({type(model).__name__}) is compiled: torch.compile(model), engine.compile() " \
               f"or Hugging Face's torch_compile=True"
    else:
        what = f"{', '.join(others[:4])}{' ...' if len(others) > 4 else ''} {'is' if len(others) == 1 else 'are'} " \
               f"compiled inside an eager layer or outside the block stacks"
    raise CompiledCodeError(
        f"SlackSwap cannot plan this model: {what}. It plans around compiled layers, each layer of a block stack "
        f"compiled on its own (`for i, block in enumerate(blocks): blocks[i] = torch.compile(block)`, as "
        f"torchtitan does), each block's call one unit it keeps, swaps or runs again. Compile the blocks instead, "
        f"or train uncompiled under SlackSwap, or compiled without it (\"enabled\": false)")


class CompiledLayers:
    """The compiled layers of a model's block stacks (`paths`; CompiledCodeError for a compiled part
    that is not one) and the hooks their calls run under."""

    def __init__(self, model: nn.Module, layers: list[tuple[str, nn.Module]]):
        self.paths = compiled_layers(model, layers)
        self._suspended = ModesSuspended()

    def hooks(self, path: str, layer: nn.Module, tracer: Callable[[], Any], calls, saved: tuple) -> list:
        """The handles of `layer`'s hooks if it is compiled (else none): its call runs with dispatch
        modes suspended, and is one opaque op to `tracer()` (None: no tracer watches the step); a call
        recorded to be run again (`calls.compiled_call`, calls.py) has its saves counted, so that each
        is known by the order it was packed in (the executor's `saved` = (pack, unpack) do the rest).
        Registered between the executor's call and return hooks, so the region is the call's."""
        if path not in self.paths:
            return []
        pack, unpack = saved

        def pre(module, args, kwargs):
            watching = tracer()
            if watching is not None:
                watching.opaque_begin(args, kwargs)
            call = calls.compiled_call  # (None in a replay: its own hooks count its saves)
            if call is None or call.module is not module:
                return self._suspended.enter()

            def counted(t):
                call.packing, call.packs = call.packs, call.packs + 1
                try:
                    return pack(t)
                finally:
                    call.packing = None
            self._suspended.enter(torch.autograd.graph.saved_tensors_hooks(counted, unpack))

        def post(module, args, output):
            self._suspended.leave()
            watching = tracer()
            if watching is not None:
                watching.opaque_end(output)
        return [layer.register_forward_pre_hook(pre, with_kwargs=True),
                layer.register_forward_hook(post, always_call=True)]


class ModesSuspended:
    """Forward pre- and post-hooks for a compiled layer: every dispatch mode is suspended for its
    call, so that the call runs as compiled (see the module docstring). Per thread; the calls of
    compiled layers do not nest."""

    def __init__(self) -> None:
        self._local = threading.local()

    def enter(self, *also) -> None:
        """Suspend the dispatch modes, and enter the context managers `also` until `leave`."""
        stack = contextlib.ExitStack()
        stack.enter_context(_disable_current_modes())
        for cm in also:
            stack.enter_context(cm)
        self._stack().append(stack)

    def leave(self) -> None:
        stack = self._stack()
        if stack:
            stack.pop().close()

    def _stack(self) -> list:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack
