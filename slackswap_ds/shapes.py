"""Input shapes and the plans kept for them.

A step's shape key is the shape and dtype of every tensor it takes (its forward's arguments, a
pipeline micro-batch's inputs and labels). Each shape gets its own profile, plan and executor
(`ShapeState`); at most `max_shapes` are kept, the least recently used dropped first (`ShapeCache`),
and `ShapeCache.runner_for` says how a step of a shape runs: under its plan, profiled, or in the
shelter (`Run`; what then happened in the step is a list of `Transition`s, lifecycle.py). The cache
also keeps the last few measured profiles (`base_for`): a new shape's plan may be derived from one
of them instead of profiled (derive.py).
"""

from __future__ import annotations

import collections
import enum
import math
from dataclasses import dataclass, field

import torch

from .derive import Deriver
from .logs import log
from .plan import Plan
from .runtime.executor import Executor
from .runtime.host_pool import HostPool
from .step_profile import StepProfile


ShapeKey = tuple[tuple[tuple[int, ...], str], ...]  # ((shape, dtype), ...) of a step's tensors


def shape_key(args: tuple, kwargs: dict) -> ShapeKey:
    from torch.utils._pytree import tree_flatten

    leaves = tree_flatten((args, kwargs))[0]
    return tuple((tuple(t.shape), str(t.dtype)) for t in leaves if isinstance(t, torch.Tensor))


def model_dims(module: torch.nn.Module) -> frozenset[int]:
    """Every dim of the module's parameters (ZeRO-3's full shapes, not its partitions): a changing
    input dim equal to one of them cannot be told apart from it (derive.py)."""
    return frozenset(d for p in module.parameters() for d in getattr(p, "ds_shape", p.shape))


def describe(key: ShapeKey) -> str:
    """A shape key as people read it: `(2, 64) torch.int64; (2, 64) torch.int64`."""
    return "; ".join(f"{tuple(shape)} {dtype}" for shape, dtype in key)


def shapes_of(key: ShapeKey) -> list[tuple[int, ...]]:
    return [shape for shape, _ in key]


@dataclass(frozen=True)
class Prediction:
    """What the simulator predicts for a plan on this rank's link share."""

    throughput: float = math.nan  # of the keep-all ideal
    step_s: float = math.nan  # forward and backward
    peak_bytes: int = 0  # device-resident saved bytes, the held micro-batches' included


@dataclass
class ShapeState:
    """One input shape's profile, plan, executor and prediction (None until planned)."""

    profile: StepProfile | None = None
    plan: Plan | None = None
    search: str = ""  # how its planner found the plan (`Planned.search`; empty where the planner does not say)
    executor: Executor | None = None
    prediction: Prediction = field(default_factory=Prediction)
    derived_from: ShapeKey | None = None  # the shapes whose measured profile its profile was derived from
    checked: bool = False  # a step has run under its plan (a derived plan's sizes were checked then)
    refitted: bool = False  # derived again after its first step's sizes fitted the dims (derive.Deriver.learn)
    shelter: bool = False  # no plan could be made for it on this rank: its steps run in the shelter
    profiles_dropped: int = 0  # its profiled steps dropped for a forward without backward (lifecycle.py)


class Run(enum.Enum):
    """How a step of a shape runs."""

    PLANNED = "planned"  # under its shape's executor
    PROFILE = "profile"  # profiled (a shape without a plan yet)
    SHELTER = "shelter"  # every saved tensor to host: what an op reads at once (warm-up; a shape without a plan)


class Transition(enum.Enum):
    """What happened in a step, in the order it happened (lifecycle.py's module docstring)."""

    WARM_UP = "a warm-up step in the shelter"
    WARMED_UP = "the last warm-up step ended"
    PROFILE = "a profiled step"
    DERIVED = "a plan derived for new shapes"
    PLANNED = "a step under its shapes' plan"
    SHELTER = "a step of shapes without a plan, in the shelter"
    AGREED = "the job's first plan, agreed"
    PLANNED_ALONE = "a plan of this rank's own"
    NO_PLAN = "no plan within the budget: the shapes run in the shelter"
    HELD = "a derived plan held on its first step"
    REFITTED = "a derived plan's dims fitted to its first step, derived again"
    UNDERIVABLE = "a derived plan did not fit its step: profiled next"
    REPLANNED = "running the plan its verification re-planned"
    ABANDONED = "a forward without backward ended its step"
    TWO_FORWARDS = "a second forward joined a profiled step"
    PROFILED_AGAIN = "a profiled step had a forward without backward: its shapes are profiled again"
    STALE = ("a planned step saved tensors its plan's profile does not have, or its compiled code saved other sizes: "
             "its shapes are profiled again")
    FALLBACK_PLANNER = "a plan made by a fallback planner (the configured one found none within the budget)"
    UNFINISHED = "micro-batches without backward closed at the step's end"
    COMPILED_ANEW = "the model's compilation changed: plans dropped"
    REPLAY_FAILED = "a replay failed in backward"
    GAVE_UP = "the job's first plan failed: the job stops"


class ShapeCache:
    """The ShapeStates of at most `max_shapes` input shapes, least recently used first."""

    BASES = 4  # measured profiles kept to derive new shapes' plans from

    def __init__(self, max_shapes: int, replan: str):
        self.max_shapes, self.replan = max_shapes, replan
        self.states: "collections.OrderedDict[ShapeKey, ShapeState]" = collections.OrderedDict()
        self.bases: "collections.OrderedDict[ShapeKey, Deriver]" = collections.OrderedDict()
        self.underivable: set[ShapeKey] = set()  # shapes a derived plan did not fit: profiled instead

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self):
        return iter(self.states)

    def __getitem__(self, key: ShapeKey) -> ShapeState:
        return self.states[key]

    def get(self, key: ShapeKey) -> ShapeState | None:
        return self.states.get(key)

    def items(self):
        return self.states.items()

    def values(self):
        return self.states.values()

    def runner_for(self, key: ShapeKey, pool: HostPool | None, add: bool = True) -> Run:
        """How the next step of `key` runs. A planned shape becomes the most recently used; a new
        one that is to be profiled gets its (empty) state now, after room is made for it (unless
        not `add`: a pipeline batch profiles one micro-batch, the others of new shapes wait)."""
        state = self.states.get(key)
        if state is not None and (state.executor is not None or state.shelter):
            self.states.move_to_end(key)
            return Run.SHELTER if state.shelter else Run.PLANNED
        if state is None and self.states and self.replan == "never":
            return Run.SHELTER  # shapes changed, no re-planning: these shapes' steps in the shelter
        if state is None and add:
            self._make_room(pool)
            self.states[key] = ShapeState()
        return Run.PROFILE

    def drop(self, key: ShapeKey) -> None:
        """Forget `key`'s plan: its next step is profiled."""
        self.states.pop(key, None)

    def add_base(self, key: ShapeKey, profile: StepProfile, dims: frozenset[int]) -> None:
        """A profile measured on inputs of `key`, to derive other shapes' plans from (`dims`: the
        model's parameters' dims, derive.input_dims)."""
        self.bases[key] = Deriver(profile, shapes_of(key), dims)
        self.bases.move_to_end(key)
        while len(self.bases) > self.BASES:
            self.bases.popitem(last=False)

    def base_for(self, key: ShapeKey) -> tuple[ShapeKey, Deriver] | None:
        """The Deriver of the measured profile nearest to `key` in input size among those of the
        same inputs' number, ranks and dtypes, or None (also for a shape known to be underivable)."""
        if key in self.underivable:
            return None
        def alike(other: ShapeKey) -> bool:
            return len(other) == len(key) and all(len(a) == len(b) and da == db
                                                  for (a, da), (b, db) in zip(other, key))

        def size(k: ShapeKey) -> int:
            return sum(math.prod(shape) for shape, _ in k)

        found = [(abs(size(k) - size(key)), k) for k in self.bases if alike(k)]
        if not found:
            return None
        _, best = min(found)
        return best, self.bases[best]

    def _make_room(self, pool: HostPool | None) -> None:
        """Before a new shape: keep at most `max_shapes - 1` others, dropping the least recently used."""
        dropped = []
        while len(self.states) >= self.max_shapes:
            key, _ = self.states.popitem(last=False)
            dropped.append(shapes_of(key))
        if dropped:
            freed = pool.trim() if pool is not None else 0
            log.info("slackswap: max_shapes=%d plans kept; dropped the least recently used (input shapes %s; "
                     "%s B of pinned host memory freed); they are profiled again if they come back",
                     self.max_shapes, dropped, f"{freed:,}")


__all__ = ["Prediction", "Run", "ShapeCache", "ShapeKey", "ShapeState", "Transition", "describe", "model_dims",
           "shape_key", "shapes_of"]
