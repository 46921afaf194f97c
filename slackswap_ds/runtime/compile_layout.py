"""SlackSwap's compile layout: each layer of a block stack compiled on its own, the rest eager.

A plan is carried out at the boundaries of compiled block calls (compiled.py), for two reasons
measured on torch 2.13: the backward of one compiled graph reads all of that graph's saved tensors
at once, so nothing planned inside a whole-model graph lowers the step's peak; and the only
recompute that reproduces compiled code bit for bit (inductor's own random streams and rounding
included) is running the same compiled code again, so the unit that can be run again is the block.

A model compiled any other way is changed to this layout when SlackSwap takes it, once, and the
log says what changed:

* a compiled part holding block stacks (the whole model: `torch.compile(model)`, `model.compile()`,
  DeepSpeed's `engine.compile()`, Hugging Face's `torch_compile=True`) runs eagerly, and each
  block-stack layer inside it is compiled on its own with the same Dynamo context: the same
  backend, mode, options, `dynamic` and `fullgraph`, as `torch.compile(block, **same)` would;
* a compiled part inside a layer: that layer is compiled whole with the part's settings instead
  (the part's own compilation is undone: the layer's compiled code covers it);
* a compiled part outside the block stacks that holds none (Accelerate's regional compilation
  compiles the embedding, final norm and head each on its own) runs eagerly.

What this does to the numbers: with the `aot_eager` (or `eager`) backend the new layout computes
the same loss as the old one, and the same gradients (the test zoo's decoder-only and encoder-only
models, dropout on: every gradient equal, whole model vs per block) except where one tensor feeds
several blocks: an encoder's output is read by every decoder layer, and autograd sums the parts of
its gradient in another order than one compiled backward graph did (T5, BART, Pegasus: last bits of
the encoder's gradients). With `inductor` it does not: the per-block graphs run other backward
kernels (inductor fuses across block boundaries, and its partitioner chooses per graph), so every
gradient differs in its last bits even with dropout off (tiny GPT-2 and Llama: the same loss, no
gradient bit-equal), and inductor draws each graph's dropout masks from one seed per graph, so with
dropout on the masks differ too. The job then trains the model compiled per block (torchtitan's
layout), and every plan is exact to that. `"enabled": false` keeps the user's layout untouched.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from torch import nn

from ..errors import SlackSwapError
from ..logs import SAME_ON_EVERY_RANK, log

__all__ = ["CompiledCodeError", "LayoutChange", "compiled_parts", "is_compiled", "to_per_block"]


_MADE_EAGER: weakref.WeakSet = weakref.WeakSet()  # OptimizedModules whose forward now runs their module eagerly


class CompiledCodeError(SlackSwapError):
    """A compiled part of the model that SlackSwap cannot plan around (see compiled.py)."""


def is_compiled(module: nn.Module) -> bool:
    """torch.compile(module) (an OptimizedModule) or module.compile() (in place; DeepSpeed's
    engine.compile() does this to the model), unless SlackSwap made it run eagerly."""
    if _is_wrapper(module):
        return module not in _MADE_EAGER
    return _compiled_in_place(module) or _forward_compiled(module)


def _is_wrapper(module: nn.Module) -> bool:
    """torch.compile(module)'s OptimizedModule (by name: no import of Dynamo for an eager model)."""
    return type(module).__name__ == "OptimizedModule"


def _forward_compiled(module: nn.Module) -> bool:
    """`module.forward = torch.compile(module.forward)` (how SlackSwap compiles a block: its hooks
    run eagerly around the compiled code)."""
    return hasattr(vars(module).get("forward"), "_torchdynamo_orig_callable")


def compiled_parts(model: nn.Module) -> list[str]:
    """Paths of the outermost compiled modules of `model` ("" for the model itself). (A walk with a
    stack: a recursive closure is a reference cycle, garbage for the collector at every step.)"""
    found: list[str] = []
    stack = [("", model)]
    while stack:
        path, module = stack.pop()
        if is_compiled(module):
            found.append(path)
            continue
        stack += reversed([(f"{path}.{name}" if path else name, child) for name, child in module.named_children()])
    return found


@dataclass(frozen=True)
class LayoutChange:
    """What SlackSwap changed about one compiled part: `part` (its path, "" for the model) now runs
    eagerly; `compiled` are the layers compiled on their own in its stead (its settings, `backend`)."""

    part: str
    how: str
    backend: str
    compiled: tuple[str, ...]

    def describe(self) -> str:
        where = f"{self.part} ({self.how}, backend {self.backend})" if self.part else \
            f"the whole model ({self.how}, backend {self.backend})"
        if not self.compiled:
            return f"{where} runs eagerly (it is outside the block stacks)"
        stacks = sorted({path.rpartition(".")[0] or "<model>" for path in self.compiled})
        return (f"{where} runs eagerly around its blocks, and {len(self.compiled)} block(s) of {', '.join(stacks)} "
                f"are compiled each on its own with the same settings")


def to_per_block(model: nn.Module, layers: list[tuple[str, nn.Module]]) -> tuple[LayoutChange, ...]:
    """Change `model` to SlackSwap's compile layout (see the module docstring), given its block-stack
    `layers` (regions.find_layers), and say so once; what changed (nothing if it already was).
    CompiledCodeError for a compiled part whose torch.compile settings cannot be read."""
    paths = [path for path, _ in layers]
    changes = []
    for part in compiled_parts(model):
        module = model.get_submodule(part) if part else model
        if part in paths and not _compiled_in_place(module):
            continue
        context = _dynamo_context(module)
        if context is None:
            raise CompiledCodeError(
                f"SlackSwap cannot plan this model: {part or 'the model'} ({type(module).__name__}) is compiled by "
                f"something other than torch.compile / module.compile(), whose settings SlackSwap cannot read to "
                f"compile its blocks instead. Compile each block on its own (`blocks[i] = torch.compile(blocks[i])`), "
                f"or train without SlackSwap (\"enabled\": false)")
        if part in paths:  # block.compile(): its call compiled with its hooks (SlackSwap's own); compile its forward
            module._compiled_call_impl = None
            _compile_forward(module, context)
            continue
        how = "torch.compile(module)" if _is_wrapper(module) else "module.compile()"
        enclosing = next((p for p in paths if _within(part, p)), None)
        targets = [enclosing] if enclosing is not None else [p for p in paths if _within(p, part)]
        _run_eagerly(module)
        for path in targets:
            layer = model.get_submodule(path)
            if not is_compiled(layer):
                _compile_forward(layer, context)
        changes.append(LayoutChange(part, how, _backend_name(context), tuple(targets)))
    if changes:
        # (what it says was measured: docs/compiled.md; issue 35 found "the numbers are the same" promised more)
        log.warning("slackswap: plans are carried out per compiled block, so this model's compilation changed: %s. "
                    "The job trains the model compiled per block, and every plan is exact to it; it can differ from "
                    "your whole-model compile in the gradients' last bits, and from there in later losses: with "
                    "aot_eager where the whole graph adds a tensor's gradient parts in another order (an encoder's "
                    "output read by every decoder layer; decoder-only and encoder-only models measured equal), with "
                    "inductor always (other kernels, other dropout masks). \"enabled\": false keeps your compilation "
                    "as it was (docs/compiled.md)",
                    "; ".join(c.describe() for c in changes), extra=SAME_ON_EVERY_RANK)
    return tuple(changes)


def _within(path: str, ancestor: str) -> bool:
    return ancestor == "" or path == ancestor or path.startswith(ancestor + ".")


def _dynamo_context(module: nn.Module):
    """The Dynamo context (backend and settings) `module` was compiled with, or None."""
    from torch._dynamo.eval_frame import _TorchDynamoContext

    if _is_wrapper(module):
        context = getattr(module, "dynamo_ctx", None)
        return context if isinstance(context, _TorchDynamoContext) else None
    # module.compile() keeps only torch.compile's wrapper of _call_impl; the context is in its closure
    for cell in getattr(module._compiled_call_impl, "__closure__", None) or ():
        if isinstance(cell.cell_contents, _TorchDynamoContext):
            return cell.cell_contents
    return None


def _compiled_in_place(module: nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None


def _compile_forward(layer: nn.Module, context) -> None:
    """torch.compile(layer.forward, **the settings of `context`): compiled code between the layer's
    hooks (module.compile() would compile the hooks too, and SlackSwap's must run eagerly)."""
    layer.forward = context(layer.forward)


def _run_eagerly(module: nn.Module) -> None:
    if _is_wrapper(module):
        module.forward = module._orig_mod.__call__  # (OptimizedModule keeps `forward` on itself)
        _MADE_EAGER.add(module)
    else:
        module._compiled_call_impl = None


def _backend_name(context) -> str:
    """The backend's name as the user gave it ("inductor", "aot_eager"), found through Dynamo's
    wrappers of it; "its own" if none says."""
    backend, seen = getattr(context, "callback", None), 0
    while backend is not None and seen < 8:
        name = getattr(backend, "compiler_name", None)
        if isinstance(name, str):
            return name
        backend, seen = getattr(backend, "_torchdynamo_orig_backend", None), seen + 1
    return "its own"
