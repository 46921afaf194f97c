"""While a plan runs, nothing in the model fights it: checkpoint calls run inline, caches are off.

SlackSwap replaces activation checkpointing. A model that checkpoints its own layers (Hugging Face
`gradient_checkpointing_enable()`, `torch.utils.checkpoint` in its code, `deepspeed.checkpointing`
in Megatron-DeepSpeed style code) would hide its activations from the plan and recompute them a
second time. So while an executor (or the profiler) is active:

* `torch.utils.checkpoint.checkpoint` runs the function inline, both variants. Its module looks
  up `CheckpointFunction` (reentrant) and `_checkpoint_without_reentrant_generator`
  (non-reentrant) at call time, so replacing those two names reaches every caller, including
  partials bound at import (as Hugging Face binds `checkpoint`). If a torch release renames them,
  nothing is replaced and the model keeps its own checkpointing (still exact; logged once).
* `deepspeed.checkpointing` calls run inline: if DeepSpeed is imported, SlackSwap's drop-in is
  installed for the duration (`checkpointing.install()`, unless the user did already) and set to
  plan mode.
* A Hugging Face model's KV cache is off: `config.use_cache` is set to False for the duration and
  a `use_cache=True` argument is turned into False. A cache updated in forward would be updated
  again by every replay (wrong gradients); training never reads it.

Each of these is logged once per process, the first time it happens. Budgets are then fractions
of the real keep-all footprint, because the profile sees every activation.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from typing import Iterator

from torch import nn

from ..logs import log


_lock = threading.RLock()
_depth = 0
_saved: dict[str, object] = {}
_said: set[str] = set()


_torch_inline_calls = 0  # torch.utils.checkpoint calls run inline in this process


def inline_checkpoint_calls() -> int:
    """How many checkpoint calls (torch.utils.checkpoint and deepspeed.checkpointing) ran inline
    in this process: a count that a step's profiler reads before and after (ProfileSession
    .replaced_checkpointing), so that what a model did is known per model, not per process."""
    from .. import checkpointing

    return _torch_inline_calls + checkpointing.inline_calls()


def _say_once(what: str, message: str) -> None:
    if what not in _said:
        _said.add(what)
        log.info(message)


class _InlineCheckpointFunction:
    """Stands in for torch.utils.checkpoint.CheckpointFunction: `apply` calls the function."""

    @staticmethod
    def apply(function, preserve_rng_state, *args):
        global _torch_inline_calls
        _torch_inline_calls += 1
        _say_once("torch-checkpoint", "slackswap: the model calls torch.utils.checkpoint (e.g. Hugging Face "
                                      "gradient checkpointing); SlackSwap replaces activation checkpointing: "
                                      "those calls run inline and the plan decides what is kept, swapped or "
                                      "recomputed")
        return function(*args)


def _inline_generator(*args, **kwargs):
    """Stands in for torch.utils.checkpoint._checkpoint_without_reentrant_generator: checkpoint()
    advances it once before and once after running the function; it does nothing."""
    _InlineCheckpointFunction.apply(lambda: None, False)
    yield


@contextlib.contextmanager
def inline_checkpoints() -> Iterator[None]:
    """`torch.utils.checkpoint` and `deepspeed.checkpointing` run their functions inline (nestable)."""
    global _depth
    import torch.utils.checkpoint as tuc

    from .. import checkpointing

    with _lock:
        if _depth == 0:
            names = ("CheckpointFunction", "_checkpoint_without_reentrant_generator")
            if all(hasattr(tuc, n) for n in names):
                _saved.update({n: getattr(tuc, n) for n in names})
                tuc.CheckpointFunction = _InlineCheckpointFunction
                tuc._checkpoint_without_reentrant_generator = _inline_generator
            else:
                _say_once("torch-checkpoint-missing", "slackswap: this torch has no CheckpointFunction / "
                                                      "_checkpoint_without_reentrant_generator to replace; "
                                                      "torch.utils.checkpoint calls keep checkpointing")
            if "deepspeed" in sys.modules:
                _saved["installed"] = checkpointing.install()
            _saved["plan_active"] = checkpointing.set_plan_active(True)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for n in ("CheckpointFunction", "_checkpoint_without_reentrant_generator"):
                    if n in _saved:
                        setattr(tuc, n, _saved.pop(n))
                checkpointing.set_plan_active(bool(_saved.pop("plan_active", False)))
                if _saved.pop("installed", False):
                    checkpointing.uninstall()


_CACHE_OFF = ("slackswap: use_cache turned off while SlackSwap runs (config and call arguments; a KV cache "
              "updated in forward would be updated again by every replay, and training does not read it)")


def _no_cache_hook(module, args, kwargs):
    if kwargs.get("use_cache"):
        _say_once("use_cache", _CACHE_OFF)
        kwargs = dict(kwargs, use_cache=False)
        return args, kwargs
    return None


_configs: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()


def _model_configs(model: nn.Module) -> list:
    """The distinct `config` objects of a model's modules (a T5 decoder has its own), found once."""
    found = _configs.get(model)
    if found is None:
        found = []
        for module in model.modules():
            config = getattr(module, "config", None)
            if config is not None and hasattr(config, "use_cache") and all(c is not config for c in found):
                found.append(config)
        _configs[model] = found
    return found


@contextlib.contextmanager
def takeover(model: nn.Module) -> Iterator[None]:
    """Everything of the module docstring, for `model`, undone on exit."""
    configs = [(c, c.use_cache) for c in _model_configs(model) if c.use_cache is True]
    for config, _ in configs:
        config.use_cache = False
    if configs:
        _say_once("use_cache", _CACHE_OFF)
    handle = model.register_forward_pre_hook(_no_cache_hook, with_kwargs=True)
    try:
        with inline_checkpoints():
            yield
    finally:
        handle.remove()
        for config, value in configs:
            config.use_cache = value
