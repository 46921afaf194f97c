"""A profile of input shapes never run, derived from a measured profile of other shapes.

A data-parallel rank whose collator pads each batch to its own longest sequence sees a new
sequence length at almost every step. Profiling each one would keep the job profiling. But a
transformer step at another sequence length (or batch size) is the same step: the same ops, the
same saved tensors under the same names, each with the dims that were the old length now the new
one (hidden states linear in the length, attention scores quadratic). So:

* `input_dims` maps each input dim that changed to its new value (sequence 37 -> 52, say);
* each saved tensor's recorded shape (profile.Activation.shape) has those dims replaced, and its
  bytes scale by the change in element count;
* each op's times scale by the largest change in what it saves (its work grows with its output:
  a GEMM's with the tokens, an attention kernel's with the scores), or by the change in tokens
  (the largest input's elements) for an op that saves nothing.

The derived profile is planned like a measured one and carries `meta["source"] = "derived"`, so
that its executor sends a tensor that turns out larger than derived to host rather than keep it
or regenerate it in backward, and measures every saved tensor's size. The engine checks the first step run under it: where a
saved tensor had another size (a dim that is s - 1, or b * s), `Deriver.learn` fits that dim to
the two measurements, and the shape is derived again, exactly; where the step saved tensors the
base never did, the shape is profiled after all.

Refused, with the reason, where a substitution could be wrong: inputs that differ in number or
rank, a dim that changes in one place and not another, a changed dim of 1 (every keepdim
reduction has one), one equal to a dim of the model's parameters (a hidden size of 64 and a
sequence of 64 cannot be told apart in a saved tensor's shape), or a fitted dim that would fall below
1 on the new inputs (s - 8 at a shorter sequence than 9). Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from .step_profile import StepProfile

Shapes = Sequence[Sequence[int]]

__all__ = ["Derivation", "Deriver", "derive", "derived", "input_dims"]


@dataclass(frozen=True)
class Derivation:
    """A derived profile, or None and why not."""

    profile: StepProfile | None
    why: str = ""


def input_dims(old: Shapes, new: Shapes, model_dims: frozenset[int] = frozenset()) -> dict[int, int] | str:
    """Old value -> new value of every input dim that changed, or why no such map is safe."""
    if len(old) != len(new) or any(len(a) != len(b) for a, b in zip(old, new)):
        return "the inputs differ in number or rank"
    changes: dict[int, int] = {}
    unchanged: set[int] = set()
    for a, b in zip(old, new):
        for o, n in zip(a, b):
            if o == n:
                unchanged.add(o)
            elif changes.setdefault(o, n) != n:
                return f"input dim {o} becomes both {changes[o]} and {n}"
    if not changes:
        return "the same input shapes"
    for o in changes:
        if o in unchanged:
            return f"input dim {o} changes in one place and not in another"
        if o == 1:
            return "a dim of 1 changes (every keepdim reduction has one)"
        if o in model_dims:
            return f"input dim {o} is also a dim of the model's parameters"
    return changes


Rule = tuple[int, int, int]  # a dim that is a * (the new value of base input dim o) + k: (o, a, k)


class Deriver:
    """Derives profiles of new input shapes from `base`, measured on inputs of shapes `old` (see
    the module docstring); `model_dims`: every dim of the model's parameters.

    By default a saved tensor's dim that equals a changed input dim becomes its new value. Where a
    step run under a derived plan measured other sizes (a loss over the sequence shifted by one
    token is s - 1 long, a flattened one b * s), `learn` fits each such dim as a * (input dim) + k
    from the two measurements, and later derivations follow the fit."""

    def __init__(self, base: StepProfile, old: Shapes, model_dims: frozenset[int] = frozenset()):
        self.base, self.old, self.model_dims = base, [tuple(s) for s in old], model_dims
        self.rules: dict[str, tuple[Rule | None, ...]] = {}  # activation key -> per dim (None: constant)

    def derive(self, new: Shapes) -> Derivation:
        """The base profile on inputs of shapes `new`, or None and why not."""
        changes = input_dims(self.old, new, self.model_dims)
        if isinstance(changes, str):
            return Derivation(None, changes)
        if any(a.shape is None for a in self.base.activations):
            return Derivation(None, "the profile has no tensor shapes (not measured by this version)")
        if self.base.runs_compiled_code:
            # Dynamo may compile another graph for other shapes (dynamic after the second), whose
            # saves come in another order: the keys of a derived plan would name other tensors
            return Derivation(None, "the model runs compiled code, whose saved tensors change with its graph")
        unchanged = {d for shape in self.old for d in shape if d > 1} - set(changes)
        acts, ratio_at = [], {}
        for a in self.base.activations:
            shape = self.shape_of(a.key, a.shape, changes, unchanged)
            if any(d < 1 and d != d0 for d, d0 in zip(shape, a.shape)):  # a fitted a * n + k below its range
                return Derivation(None, f"saved tensor {a.key} would have shape {shape} on these inputs "
                                        f"(its dims were fitted on others)")
            ratio = _ratio(a.shape, shape)
            before = math.prod(a.shape)  # (in integers: a float ratio rounds 504 bytes up to 505)
            scaled = (lambda n: -(-n * math.prod(shape) // before)) if before else (lambda n: n)
            packed = None if a.packed_bytes is None else min(scaled(a.packed_bytes), scaled(a.bytes))
            acts.append(replace(a, shape=shape, bytes=scaled(a.bytes), packed_bytes=packed, pack_s=a.pack_s * ratio))
            ratio_at[a.saved_at] = max(ratio_at.get(a.saved_at, 0.0), ratio)
        biggest = max(self.old, key=math.prod, default=())
        tokens = _ratio(biggest, [changes.get(d, d) for d in biggest])
        ops = tuple(replace(o, fwd_s=o.fwd_s * ratio_at.get(i, tokens), bwd_s=o.bwd_s * ratio_at.get(i, tokens))
                    for i, o in enumerate(self.base.ops))
        meta = {k: v for k, v in self.base.meta if k != "profiled_peak_bytes"}
        meta.update(source="derived", derived_from=self.base.digest[:16],
                    inputs=" -> ".join(_dims(s) for s in (self.old, new)))
        return Derivation(StepProfile(self.base.name, ops, tuple(acts), tuple(meta.items())))

    def shape_of(self, key: str, shape: tuple[int, ...], changes: dict[int, int],
                 unchanged: set[int] = frozenset()) -> tuple[int, ...]:
        """Activation `key` (of `shape` in the base) on inputs whose dims changed as `changes` (the
        other input dims: `unchanged`): a dim that fitted a rule on an earlier step follows it;
        else a changed input dim becomes its new value, and a product of one with an unchanged input
        dim (a flattened batch x sequence) scales with it; other dims stay."""
        rules = self.rules.get(key)
        if rules is None:
            return tuple(changes.get(d, self._product(d, changes, unchanged)) for d in shape)
        return tuple(d if rule is None or rule[0] not in changes else rule[1] * changes[rule[0]] + rule[2]
                     for d, rule in zip(shape, rules))

    def _product(self, d: int, changes: dict[int, int], unchanged: set[int]) -> int:
        """`d` as changed input dim o times unchanged input dim u (n * u), where exactly one such
        pair makes it and it is no dim of the model's parameters; else `d`."""
        if d in self.model_dims:
            return d
        found = {n * (d // o) for o, n in changes.items() if d % o == 0 and d // o in unchanged}
        return found.pop() if len(found) == 1 else d

    def learn(self, new: Shapes, measured: dict[str, tuple[tuple[int, ...], int]]) -> list[str]:
        """Fit the dims of the saved tensors that a step on inputs of shapes `new` measured
        (`measured`: key -> (shape, bytes)); the keys whose sizes no fit explains (none: every
        saved tensor is now derived as measured)."""
        changes = input_dims(self.old, new, self.model_dims)
        if isinstance(changes, str):
            return sorted(measured)
        unexplained = []
        for a in self.base.activations:
            got = measured.get(a.key)
            if got is None or a.shape is None or len(got[0]) != len(a.shape):
                continue
            rules = tuple(_fit(d0, d1, changes) for d0, d1 in zip(a.shape, got[0]))
            if any(r is False for r in rules):
                unexplained.append(a.key)
                continue
            self.rules[a.key] = rules
        return unexplained


def _fit(d0: int, d1: int, changes: dict[int, int]) -> Rule | None | bool:
    """A dim that is d0 on the base's inputs and d1 on the changed ones: None (constant), the rule
    a * n + k of the one changed input dim that explains it with whole a >= 1, or False."""
    if d0 == d1:
        return None
    fits = [(o, (d1 - d0) // (n - o), d0 - (d1 - d0) // (n - o) * o) for o, n in changes.items()
            if (d1 - d0) % (n - o) == 0 and (d1 - d0) // (n - o) >= 1]
    return fits[0] if len(fits) == 1 else False


def derive(base: StepProfile, old: Shapes, new: Shapes, model_dims: frozenset[int] = frozenset()) -> Derivation:
    """`base` (measured on inputs of shapes `old`) as it would be on inputs of shapes `new`."""
    return Deriver(base, old, model_dims).derive(new)


def derived(profile: StepProfile) -> bool:
    return dict(profile.meta).get("source") == "derived"


def _ratio(old: Sequence[int], new: Sequence[int]) -> float:
    before = math.prod(old)
    return math.prod(new) / before if before else 1.0


def _dims(shapes: Shapes) -> str:
    return ", ".join("x".join(map(str, s)) for s in shapes)
