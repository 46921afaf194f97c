"""Regions of a step: the model's block stacks, and which block call (or gap) is running now.

A region is the unit a replay re-runs, as a checkpointed layer is for `torch.utils.checkpoint`.
The layers are the children of *every* block stack of the model, not only the longest: a T5 or
BART model has an encoder stack and a decoder stack, and both are recomputed the same way. A
block stack is an `nn.ModuleList` (or an `nn.Sequential` of at least two modules of one class)
that is not inside another stack; lists of lists are searched through. A module that appears
under two paths is one layer (its first path).

`RegionTracker` follows the calls of one step and labels them (naming.py): each layer call gets
its own label, calls of the same layer are numbered, and the gaps between calls are regions too.
"""

from __future__ import annotations

from torch import nn

from .naming import PRE, call_label, gap_label


def _is_stack(module: nn.Module) -> bool:
    if isinstance(module, nn.ModuleList):
        return len(module) > 0
    if type(module) is nn.Sequential and len(module) >= 2:
        kinds = {type(m) for m in module}
        return len(kinds) == 1
    return False


def _is_container(module: nn.Module) -> bool:
    """Containers are never called themselves: their children are."""
    return isinstance(module, (nn.ModuleList, nn.ModuleDict))


def find_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every layer of every block stack of `model`, as (module path, module), in module order.
    A DeepSpeed PipelineModule (one stage of a pipeline) is a stack itself: its layers are the
    modules it calls in turn (`forward_funcs`), registered as its children "0", "1", ..."""
    funcs = getattr(model, "forward_funcs", None)
    if isinstance(funcs, list) and hasattr(model, "topology"):
        runs = {id(f) for f in funcs if isinstance(f, nn.Module)}
        return [(name, child) for name, child in model.named_children() if id(child) in runs]
    layers: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def add_stack(stack: nn.Module, prefix: str) -> None:
        for i, layer in stack.named_children():
            if _is_container(layer):  # a list of lists: the inner lists are the stacks
                (add_stack if _is_stack(layer) else visit)(layer, f"{prefix}{i}.")
            elif id(layer) not in seen:
                seen.add(id(layer))
                layers.append((f"{prefix}{i}", layer))

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            (add_stack if _is_stack(child) else visit)(child, f"{prefix}{name}.")

    (add_stack if _is_stack(model) else visit)(model, "")
    return layers


class RegionTracker:
    """The label of the region running now in one step (see naming.py for the labels)."""

    __slots__ = ("label", "path", "_calls")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.label = PRE
        self.path: str | None = None  # the layer whose call is running now, if any
        self._calls: dict[str, int] = {}

    @property
    def in_call(self) -> bool:
        return self.path is not None

    def enter(self, path: str) -> str:
        """A call of the layer at `path` starts; its label (numbered if the layer ran before)."""
        k = self._calls.get(path, 0)
        self._calls[path] = k + 1
        self.path, self.label = path, call_label(path, k)
        return self.label

    def leave(self) -> None:
        """The layer call ends: the step is in the gap after it."""
        if self.path is not None:
            self.label, self.path = gap_label(self.label), None
