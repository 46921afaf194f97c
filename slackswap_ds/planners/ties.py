"""Identical layers tied together: a coarse copy of the MILP that finds a good plan fast.

A transformer's middle layers are the same region again and again (same tensors, bytes and ops;
in a measured profile, times that differ by noise), and that symmetry is what makes the region
model's MILP slow to search: HiGHS meets the same choice once per layer, in every order. Tying
each group of `group` consecutive identical layers (their swap, recompute, pack and re-run
variables shared: layer 5 swaps its softmax output exactly when layer 4 does) leaves a MILP with
`group` times fewer binaries whose plans are all plans of the full MILP. Its optimum is found in a
fraction of the time, and as the full search's start it prunes from the root on
(planners/refine.py). The first layer of a run and the last `EDGE` stay free: the D2H queue must
drain before forward ends, so the last layers swap less, and the first sits after the embedding,
which is not like the others.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ..step_profile import layer_class
from .common import RegionModel

EDGE = 2  # the last layers of a run left untied (the D2H queue drains there)


@dataclass(frozen=True)
class Ties:
    """Which activations (by key) and ops (by index) share their group's representative's
    variables; `groups`: how many groups of more than one region were tied."""

    acts: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    ops: Mapping[int, int] = field(default_factory=lambda: MappingProxyType({}))
    groups: int = 0


NO_TIES = Ties()


def identical_runs(model: RegionModel) -> list[list[int]]:
    """Runs of two or more consecutive regions that are the same layer (`_signature`), by region
    index; the last region to run forward is never in one (it cannot swap: milp.py)."""
    runs: list[list[int]] = []
    previous = None
    for r in range(len(model.regions) - 1):
        sig = _signature(model, r)
        if sig is not None and sig == previous:
            runs[-1].append(r)
        else:
            runs.append([r])
        previous = sig
    return [run for run in runs if len(run) > 1]


def layer_ties(model: RegionModel, group: int) -> Ties:
    """Every `group` consecutive regions of each identical run tied to the first of them, but the
    run's first region and its last EDGE. NO_TIES where nothing would be tied."""
    if group < 2:
        return NO_TIES
    profile = model.profile
    acts, ops, groups = {}, {}, 0
    for run in identical_runs(model):
        middle = run[1:len(run) - EDGE]
        for start in range(0, len(middle), group):
            chunk = middle[start:start + group]
            if len(chunk) < 2:
                continue
            groups += 1
            head = chunk[0]
            head_acts = profile.region_acts[model.regions[head]]
            for r in chunk[1:]:
                for member, rep in zip(profile.region_acts[model.regions[r]], head_acts):
                    acts[member.key] = rep.key
                for member, rep in zip(model.ops[r], model.ops[head]):
                    ops[member] = rep
    if not groups:
        return NO_TIES
    return Ties(MappingProxyType(acts), MappingProxyType(ops), groups)


def _signature(model: RegionModel, r: int) -> tuple | None:
    """What makes region r the same layer as another: its ops' keys without the
    layer index, and its activations' classes, bytes, packed bytes, and producers, users and dependencies
    relative to the region's first op, in order. Not times: a measured profile's layers differ by noise,
    and tying is a restriction whatever the times (each tied column costs its layers' times summed).
    None for a region whose ops are not contiguous."""
    profile, ops = model.profile, model.ops[r]
    if not ops or ops != list(range(ops[0], ops[0] + len(ops))):
        return None
    first = ops[0]
    op_sig = tuple(layer_class(profile.ops[o].key) for o in ops)
    act_sig = tuple((a.layer_class, a.bytes, a.packed_bytes, tuple(p - first for p in a.producers),
                     tuple(u - first for u in a.users), tuple(layer_class(d) for d in a.deps))
                    for a in profile.region_acts[model.regions[r]])
    return op_sig, act_sig
