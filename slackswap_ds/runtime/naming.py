"""The one place that names the parts of a measured step: regions, ops and saved activations.

Names are stable: the same on every step and every rank that runs the same model on the same
shapes, and never built from `id()` or a global counter: plans, plan files and the ranks' agreement
name saved tensors by them (`<region>:<n>:<maker>`).

* **Region labels.** A layer call is labelled by the layer's module path (``transformer.h.3``);
  a layer called again in the same step (a second forward before backward, or one module shared by
  several positions, as in ALBERT) gets ``@<k>`` for its k-th later call (``transformer.h.3@1``).
  Outside layer calls the step is in a gap: ``pre`` before the first layer call, and
  ``after.<label>`` from the end of a layer call to the start of the next one (the last such gap
  holds the head and the loss).
* **Op keys** (the tracer's): ``<region>:<i>:<aten op>``, the i-th compute op of that region.
* **Activation keys**: ``<region>:<n>:<maker>``, the n-th distinct storage saved for backward in
  that region (in the order autograd first saves one of its tensors), and the autograd node that
  made the saved tensor (``gelu``, ``addmm``; ``input`` for a tensor without one). A storage saved
  again in the step keeps its key, also after autograd let go of its earlier saves (a node that
  died in forward, as `topk`'s when only its indices are used). Everything in
  it is known to a saved-tensor hook, so the executor names a tensor at pack time without
  watching every op: steps under a plan pay for naming only per saved tensor, not per op.
"""

from __future__ import annotations

import re

import torch

PRE = "pre"


def call_label(path: str, call: int) -> str:
    """The label of the `call`-th call (0 = first) of the layer at `path` in one step."""
    return path if call == 0 else f"{path}@{call}"


def gap_label(after: str) -> str:
    """The label of the gap that follows the layer call labelled `after`."""
    return f"after.{after}"


def is_gap(region: str) -> bool:
    return region == PRE or region.startswith("after.")


def op_key(region: str, index: int, name: str) -> str:
    return f"{region}:{index}:{name}"


def activation_key(region: str, ordinal: int, maker: str) -> str:
    return f"{region}:{ordinal}:{maker}"


def region_of(key: str) -> str:
    """The region of an activation key (labels may hold ':', ordinals and makers never do)."""
    return key.rsplit(":", 2)[0]


_MAKERS: dict[type, str] = {}
# Nodes whose type depends on whether a dispatch mode is active (eager `reshape` takes a
# `_reshape_alias` fast path that is skipped under a mode): named alike so that a step under the
# profiler's tracer and one under a plan give the same keys.
_SAME_AS = {"reshape_alias": "view"}
_BACKWARD_SUFFIX = re.compile(r"Backward\d*$")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def maker_of(t: torch.Tensor) -> str:
    """``addmm`` for a tensor whose autograd node is AddmmBackward0; ``input`` without a node."""
    node = t.grad_fn
    if node is None:
        return "input"
    kind = type(node)
    name = _MAKERS.get(kind)
    if name is None:
        name = _CAMEL.sub("_", _BACKWARD_SUFFIX.sub("", kind.__name__)).lower() or "node"
        name = _MAKERS[kind] = _SAME_AS.get(name, name)
    return name
