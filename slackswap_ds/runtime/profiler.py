"""Measure a `StepProfile` from one real training step (see tracing.py for how ops are named).

Each activation is one saved storage: its bytes are the storage's, its users the ops that saved
it, its region the region of its first saver. Its producers are the ops that would regenerate it
inside that region: the op that wrote it plus, transitively, the in-region ops behind any input
that is not itself saved; the saved tensors those ops read are its deps. A storage made outside
its region (the region's input hidden state, say) has no producers: it can only be kept or swapped.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import nn

from ..profile import Activation, Op, StepProfile
from .tracing import StepTracer, TracedStorage

StepFn = Callable[[nn.Module, Any], torch.Tensor]


def _sync_timer(device: torch.device) -> Callable[[], float]:
    """perf_counter, after the device's queue drains (so each op's time is its own)."""
    if device.type == "cuda":
        def timer() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return timer
    return time.perf_counter


def profile_step(model: nn.Module, step_fn: StepFn, batch: Any, *, name: str | None = None,
                 warmup: int = 1) -> StepProfile:
    """Run `step_fn(model, batch)` (forward + backward) `warmup` times untraced, then once traced,
    and return the measured profile. Gradients the steps accumulate are left to the caller."""
    for _ in range(warmup):
        step_fn(model, batch)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    tracer = StepTracer(model, timer=_sync_timer(device))
    with tracer:
        step_fn(model, batch)
    return build_profile(tracer, name or type(model).__name__)


def build_profile(tracer: StepTracer, name: str) -> StepProfile:
    ops = tracer.ops
    saved = [st for st in tracer.storages.values() if st.saved_by]
    region_of = {st.sid: ops[min(st.saved_by)].region for st in saved}
    keys = _activation_keys(tracer, saved, region_of)
    activations = []
    for st in sorted(saved, key=lambda st: (min(st.saved_by), st.sid)):
        producers, deps = _regeneration(tracer, st, region_of, keys)
        activations.append(Activation(keys[st.sid], st.nbytes, tuple(sorted(st.saved_by)), producers, deps))
    profile_ops = tuple(Op(o.key, o.fwd_s, o.bwd_s, o.region) for o in ops)
    meta = {"source": "measured", "layers": str(len(tracer.layers))}
    return StepProfile(name, profile_ops, tuple(activations), tuple(meta.items()))


def _activation_keys(tracer: StepTracer, saved: list[TracedStorage], region_of: dict[int, str]) -> dict[int, str]:
    """``<region>:<op index>:<op>`` of the writer for storages made in their region (``.<n>`` for
    an op's n-th output beyond the first), ``<region>:input.<n>`` for the others, numbered in the
    order they are first saved (the executor names them the same way as it packs them)."""
    keys: dict[int, str] = {}
    inputs: dict[str, int] = {}
    for st in sorted(saved, key=lambda st: tracer._pack_order.get(st.sid, st.sid)):
        region = region_of[st.sid]
        writer = tracer.ops[st.producer] if st.producer is not None else None
        if writer is not None and writer.region == region:
            n = writer.writes.index(st.sid)
            keys[st.sid] = writer.key + (f".{n}" if n else "")
        else:
            n = inputs.get(region, 0)
            inputs[region] = n + 1
            keys[st.sid] = f"{region}:input.{n}"
    return keys


def _regeneration(tracer: StepTracer, st: TracedStorage, region_of: dict[int, str],
                  keys: dict[int, str]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    region = region_of[st.sid]
    ops, storages = tracer.ops, tracer.storages

    def in_region(writers: list[int]) -> bool:
        return bool(writers) and all(ops[w].region == region for w in writers)

    if st.producer is None or not in_region(st.writers) or max(st.writers) > min(st.saved_by):
        return (), ()
    if region not in tracer.layer_paths:
        return (), ()  # only layers can be re-run: outside them a tensor is kept or swapped
    producers: set[int] = set()
    deps: set[str] = set()
    todo = list(st.writers)
    while todo:
        i = todo.pop()
        if i in producers:
            continue
        producers.add(i)
        for sid in ops[i].reads:
            src = storages[sid]
            if sid == st.sid:
                continue  # an in-place writer reads what it rewrites
            if src.saved_by and region_of.get(sid) == region:
                deps.add(keys[sid])
            elif src.producer is not None and in_region(src.writers):
                todo.extend(src.writers)
            # else: made outside the region and not saved in it (masks, rotary tables): the
            # executor holds such inputs as a checkpoint holds its arguments
    return tuple(sorted(producers)), tuple(sorted(deps))
