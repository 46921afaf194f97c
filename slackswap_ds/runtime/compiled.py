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
  (replay.run_whole_replay, as torch.utils.checkpoint does): the compiled forward saves the same
  tensors in the same order, so its n-th save regenerates forward's n-th (calls.py counts them);
  a verifying step checks the bytes, as for any replay;
* the eager rest of the model (embeddings, head, eager layers) is planned as before.

A model compiled another way (the whole model: `torch.compile(model)`, `engine.compile()`, Hugging
Face's `torch_compile=True`; a compiled part inside a layer or outside the block stacks) is changed
to this layout first, and the log says so (compile_layout.py).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from .compile_layout import CompiledCodeError, compiled_parts, is_compiled, log, to_per_block
from .regions import find_layers

__all__ = ["CompiledCodeError", "CompiledLayers", "ModesSuspended", "check_model", "compiled_layers",
           "dynamo_never_compiles", "is_compiled"]


def _say_compiled_around(model: nn.Module) -> None:
    """Warn that `model` was called from compiled code SlackSwap was not given: `torch.compile(model)`
    kept by the user while `model` itself went to ss.apply / ss.profile_step. Dynamo then traces
    SlackSwap's hooks, and what its graphs save does not reach the plan (each such save is handled as
    one the plan does not know: swapped, counted in stats.fallbacks)."""
    log.warning("slackswap: %s was called from compiled code that SlackSwap was not given (torch.compile(model) "
                "around the module passed to ss.apply or ss.profile_step): Dynamo traced SlackSwap's hooks, and "
                "the saves of its graphs are not the plan's (they are swapped as unplanned: stats.fallbacks). Give "
                "SlackSwap the compiled module itself (it then compiles each block on its own), or the model "
                "uncompiled", type(model).__name__)


def dynamo_never_compiles(*fns: Callable) -> None:
    """Dynamo runs each of `fns`, and what it calls, as plain Python, never as a frame of its own to
    compile. A saved-tensor hook is called from the eager code between a compiled block's graphs (a
    graph break: MoE routing), where Dynamo's frame callback is active, and Dynamo compiled the hook
    there as a function of its own (tracing SlackSwap's pack hook as the identity: those saves went
    unseen by the plan and the budget; measured on torch 2.13 with Mixtral's blocks). Uses Dynamo's
    per-code execution strategy (torch 2.6+); without it, nothing changes. Before anything imported
    Dynamo nothing is compiled, and importing it costs seconds: then nothing to do (a model compiled
    after its executor was made is refused when the executor is entered: check_unchanged)."""
    if "torch._dynamo" not in sys.modules:
        return
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:  # pragma: no cover - another torch
        return
    for fn in fns:
        set_code_exec_strategy(getattr(fn, "__func__", fn).__code__,
                               FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


def check_model(model: nn.Module) -> frozenset[str]:
    """The compiled layers of `model`'s block stacks, after changing it to SlackSwap's compile
    layout (compiled_layers)."""
    return compiled_layers(model, find_layers(model))


def compiled_layers(model: nn.Module, layers: list[tuple[str, nn.Module]]) -> frozenset[str]:
    """The paths of `layers` (regions.find_layers) that are compiled, once `model` is in SlackSwap's
    compile layout (compile_layout.to_per_block: every compiled part is then one of them)."""
    to_per_block(model, layers)
    return frozenset(compiled_parts(model))


def _maybe_compiled(model: nn.Module) -> bool:
    """False if no module of `model` is compiled (a compiled module's forward, or its compiled call,
    is its own attribute: `OptimizedModule`, `torch.compile(module.forward)`, `module.compile()`);
    True also where a forward was only replaced (hooks of other libraries): compiled_parts tells."""
    stack = [model]
    while stack:
        attrs = stack.pop().__dict__
        if "forward" in attrs or attrs.get("_compiled_call_impl") is not None:
            return True
        stack.extend(m for m in attrs["_modules"].values() if m is not None)
    return False


class CompiledLayers:
    """The compiled layers of a model's block stacks (`paths`, once the model is in SlackSwap's
    compile layout) and the hooks their calls run under; `saved`: the executor's saved-tensor hooks."""

    def __init__(self, model: nn.Module, layers: list[tuple[str, nn.Module]], saved: tuple[Callable, Callable]):
        self.paths = compiled_layers(model, layers)
        self._suspended = ModesSuspended()
        dynamo_never_compiles(*saved)  # the executor's (pack, unpack): called from compiled blocks' eager parts too
        self.around = self._said_around = False  # the model called from compiled code it was not given

    def check_unchanged(self, model: nn.Module) -> None:
        """CompiledCodeError if `model`'s compiled parts are not those it had when this was made: a
        plan made before the model was compiled (or compiled otherwise) is for another program, and
        Dynamo would trace SlackSwap's hooks inside the new compiled code."""
        if not self.paths and not _maybe_compiled(model):  # (every step: the walk of compiled_parts is slow)
            return
        now = frozenset(compiled_parts(model))
        if now != self.paths:
            def named(paths):
                return ", ".join(path or "the whole model" for path in sorted(paths)) or "none"
            raise CompiledCodeError(
                f"{type(model).__name__} was compiled after SlackSwap took it (compiled parts now: {named(now)}; "
                f"when its plan was made: {named(self.paths)}): "
                f"the plan is for the program it had then. Compile the model first, then profile and plan it "
                f"(ss.profile_step, ss.plan, ss.apply); ss.initialize's engine does this by itself")

    def model_called(self) -> None:
        """The model's forward pre-hook ran: if Dynamo is tracing it, compiled code SlackSwap was not
        given calls the model (`say_if_around` tells, once)."""
        if torch.compiler.is_compiling():
            self.around = True  # (an attribute set: Dynamo replays it as a side effect of its graph)

    def say_if_around(self, model: nn.Module) -> None:
        if self.around and not self._said_around:
            self._said_around = True
            _say_compiled_around(model)

    def hooks(self, path: str, layer: nn.Module, tracer: Callable[[], Any]) -> list:
        """The handles of `layer`'s hooks if it is compiled (else none): its call runs with dispatch
        modes suspended, and is one opaque op to `tracer()` (None: no tracer watches the step). (A call
        recorded to be run again has its saves counted by the hooks its record entered: calls.py.)
        Registered between the executor's call and return hooks, so the region is the call's."""
        if path not in self.paths:
            return []

        def pre(module, args, kwargs):
            watching = tracer()
            if watching is not None:
                watching.opaque_begin(args, kwargs)
            self._suspended.enter()

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
