"""Flat lists of leaves and back, for an aten op's values and for a layer call's arguments.

torch's general pytree leaves a reference cycle behind on every `tree_flatten`; these run on
every op a tracer or a replay sees and on every recorded layer call, so they are written out:

* `flatten` / `unflatten`: an aten op takes and returns a tensor, a scalar, None, or a list/tuple
  of those (one level deep, as in ``Tensor[]`` arguments);
* `flatten_call` / `unflatten_call`: a layer call's ``(args, kwargs)``, nested tuples, lists and
  dicts; anything else (a tensor, a cache object, a flag) is a leaf.

A spec is opaque: only the matching unflatten reads it.
"""

from __future__ import annotations

from typing import Iterator

__all__ = ["flatten", "flatten_call", "unflatten", "unflatten_call"]


def flatten(value) -> tuple[list, object]:
    """(leaves, spec) of an op's result (or argument)."""
    if isinstance(value, (tuple, list)):
        leaves, spec = [], []
        for v in value:
            if isinstance(v, (tuple, list)):
                spec.append((type(v), len(v)))
                leaves.extend(v)
            else:
                spec.append(None)
                leaves.append(v)
        return leaves, (type(value), tuple(spec))
    return [value], None


def unflatten(leaves: list, spec) -> object:
    if spec is None:
        return leaves[0]
    kind, parts = spec
    out, i = [], 0
    for part in parts:
        if part is None:
            out.append(leaves[i])
            i += 1
        else:
            sub_kind, n = part
            out.append(sub_kind(leaves[i:i + n]))
            i += n
    return kind(out)


def flatten_call(obj) -> tuple[list, object]:
    """(leaves, spec) of a layer call's (args, kwargs)."""
    leaves: list = []
    return leaves, _flatten_into(obj, leaves)


def unflatten_call(leaves: list, spec):
    return _build(iter(leaves), spec)


def _flatten_into(obj, leaves: list):
    if type(obj) in (tuple, list):
        return (type(obj), tuple(_flatten_into(v, leaves) for v in obj))
    if type(obj) is dict:
        return (dict, tuple((k, _flatten_into(v, leaves)) for k, v in obj.items()))
    leaves.append(obj)
    return None


def _build(leaves: Iterator, spec):
    if spec is None:
        return next(leaves)
    kind, parts = spec
    if kind is dict:
        return {k: _build(leaves, p) for k, p in parts}
    return kind([_build(leaves, p) for p in parts])
