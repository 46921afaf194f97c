"""Drop-in for the ``deepspeed.checkpointing`` API, served by SlackSwap plans.

Megatron-DeepSpeed-style models call ``deepspeed.checkpointing.checkpoint(fn, *args)`` for every
layer, and ``deepspeed.pipe.PipelineModule`` does the same when ``activation_checkpoint_interval >
0``. Under a SlackSwap plan those calls must not checkpoint: every activation has to reach the
executor's saved-tensor hooks so that the plan, not the call site, decides keep / swap / recompute.

Two modes, switched by :func:`set_plan_active` (the engine sets it while a plan is applied):

* **plan mode** (``plan_active()``): :func:`checkpoint` and :func:`non_reentrant_checkpoint` call
  ``fn(*args, **kwargs)`` directly and return its outputs the way DeepSpeed returns them (a lone
  tensor, or a tuple with a single element, comes back unwrapped; a list comes back as a tuple).
  :class:`CheckpointFunction` ``.apply`` does the same, so code bound to DeepSpeed's *original*
  ``checkpoint`` (which looks ``CheckpointFunction`` up in its module at call time) is routed too
  once :func:`install` has run.
* **delegate mode** (no plan, e.g. before profiling or with SlackSwap disabled): DeepSpeed's own
  implementation runs, with two deliberate differences, both grad-exact:

  - keyword arguments: DeepSpeed 0.19's ``checkpoint`` accepts them (tensor kwargs take part in
    autograd), older releases do not, and ``non_reentrant_checkpoint`` never does. We fold kwargs
    into positional arguments the way DeepSpeed 0.19 does, so both functions accept them on every
    DeepSpeed version.
  - inputs that do not require grad: DeepSpeed's reentrant ``checkpoint`` runs ``fn`` under
    ``no_grad`` inside an ``autograd.Function``; when no tensor argument requires grad the outputs
    do not either, and the gradients of ``fn``'s parameters are **silently dropped** (or backward
    fails with "element 0 of tensors does not require grad" when nothing else does). When grad is
    enabled and no top-level tensor argument requires grad, our ``checkpoint`` therefore routes
    through DeepSpeed's ``non_reentrant_checkpoint`` (the saved-tensor-hooks mechanism of
    ``torch.utils.checkpoint(use_reentrant=False)``, plus DeepSpeed's model-parallel RNG tracker,
    partitioning and CPU-checkpointing settings). If ``fn`` has no trainable parameters the result
    is the same as DeepSpeed's: outputs that do not require grad.

The RNG tracker functions and ``configure`` / ``is_configured`` / ``reset`` always delegate to
DeepSpeed's (they own the model-parallel RNG states and DeepSpeed's checkpointing settings).

:func:`install` routes ``deepspeed.checkpointing.*`` through this module for code that calls it
directly, and rebinds the default of ``PipelineModule.__init__(activation_checkpoint_func=...)``,
which DeepSpeed binds to ``checkpointing.checkpoint`` when the class is defined (patching the
module attribute alone does not reach it). A ``PipelineModule`` built *before* ``install()`` keeps
DeepSpeed's function in ``module.activation_checkpoint_func``; in plan mode its calls are still
routed through :class:`CheckpointFunction`. :func:`uninstall` restores every patched object.

DeepSpeed is imported on first use, never at import time of this module.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from typing import Any, Callable, Iterator

from .errors import SlackSwapError
from .logs import log

__all__ = ["CheckpointFunction", "checkpoint", "configure", "get_cuda_rng_tracker", "install", "is_configured",
           "is_installed", "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed",
           "non_reentrant_checkpoint", "plan_active", "plan_scope", "reset", "set_plan_active", "uninstall"]

_DS_MODULE = "deepspeed.runtime.activation_checkpointing.checkpointing"
_ORIGINALS_ATTR = "_slackswap_originals"  # set on DeepSpeed's module while installed
_MARK = "__slackswap_dropin__"  # marks our replacements, so they are never mistaken for DeepSpeed's

_LOCK = threading.RLock()
_PLAN_ACTIVE = False
_INLINE_CALLS = 0  # checkpoint calls of a model run inline under a plan or the profiler (the first said)
_INSTALLED: list[tuple[Any, str, bool, Any]] | None = None  # (owner, attribute, had it, old value)


class CheckpointingError(SlackSwapError, RuntimeError):
    """The drop-in checkpointing layer is in a state it cannot serve from."""


# --------------------------------------------------------------------------------------------
# plan hook (the engine calls these; the executor itself is not touched)


def set_plan_active(active: bool) -> bool:
    """Mark whether a SlackSwap plan is being applied; returns the previous value.

    While active, :func:`checkpoint` and friends call the function directly so that every
    activation reaches the executor's saved-tensor hooks."""
    global _PLAN_ACTIVE
    with _LOCK:
        previous, _PLAN_ACTIVE = _PLAN_ACTIVE, bool(active)
    return previous


def plan_active() -> bool:
    """True while a SlackSwap plan is applied (see :func:`set_plan_active`)."""
    return _PLAN_ACTIVE


def inline_calls() -> int:
    """How many `deepspeed.checkpointing` calls ran inline under a plan or the profiler in this
    process (the profiler compares the count before and after its step: that model has
    checkpointing of its own, which SlackSwap replaced)."""
    return _INLINE_CALLS


def _inline() -> None:
    global _INLINE_CALLS
    _INLINE_CALLS += 1
    if _INLINE_CALLS == 1:
        log.info("slackswap: the model calls deepspeed.checkpointing; SlackSwap replaces activation checkpointing: "
                 "those calls run inline and the plan decides what is kept, swapped or recomputed")


@contextlib.contextmanager
def plan_scope(active: bool = True) -> Iterator[None]:
    """``with plan_scope():`` sets :func:`plan_active` for the block and restores it afterwards."""
    previous = set_plan_active(active)
    try:
        yield
    finally:
        set_plan_active(previous)


# --------------------------------------------------------------------------------------------
# DeepSpeed's originals


def _ds_module():
    return importlib.import_module(_DS_MODULE)


def _original(name: str) -> Any:
    """DeepSpeed's own object `name`, even while :func:`install` has replaced it."""
    mod = _ds_module()
    saved = mod.__dict__.get(_ORIGINALS_ATTR)
    value = saved[name] if saved is not None and name in saved else getattr(mod, name)
    if getattr(value, _MARK, False):
        raise CheckpointingError(
            f"expected DeepSpeed's own {_DS_MODULE}.{name}, found slackswap_ds's replacement there without "
            "slackswap_ds.checkpointing.install() having recorded the original (was it patched by hand?); "
            "restore DeepSpeed's function, then use install()/uninstall()")
    return value


def _mark(obj):
    setattr(obj, _MARK, True)
    return obj


# --------------------------------------------------------------------------------------------
# checkpoint functions


def _is_tensor(x) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def _fold_kwargs(function: Callable, args: tuple, kwargs: dict) -> tuple[Callable, tuple]:
    """Positional-only form of ``function(*args, **kwargs)``, exactly as DeepSpeed 0.19's
    ``checkpoint`` builds it (tensor kwargs then take part in autograd like positional ones)."""
    if not kwargs:
        return function, args
    keys, count = tuple(kwargs), len(args)

    def function_with_kwargs(*all_args):
        return function(*all_args[:count], **dict(zip(keys, all_args[count:])))

    return function_with_kwargs, args + tuple(kwargs.values())


def _as_deepspeed_outputs(outputs):
    """DeepSpeed's output convention: a tensor is returned as is; otherwise the outputs are
    collected in a list (``all_outputs += outputs``) and one element comes back unwrapped, several
    as a tuple. Non-tensors keep their positions."""
    if _is_tensor(outputs):
        return outputs
    all_outputs: list = []
    all_outputs += outputs  # the same TypeError as DeepSpeed for a non-iterable result
    return all_outputs[0] if len(all_outputs) == 1 else tuple(all_outputs)


def _run_direct(function: Callable, args: tuple, kwargs: dict):
    _inline()
    return _as_deepspeed_outputs(function(*args, **kwargs))


def _no_input_requires_grad(args: tuple) -> bool:
    return not any(_is_tensor(a) and a.requires_grad for a in args)


@_mark
def checkpoint(function: Callable, *args, **kwargs):
    """``deepspeed.checkpointing.checkpoint``: direct call under an active plan, DeepSpeed's
    reentrant checkpoint otherwise (non-reentrant when no tensor input requires grad, so that the
    parameters of `function` keep their gradients). See the module docstring."""
    if _PLAN_ACTIVE:
        return _run_direct(function, args, kwargs)
    import torch

    function, args = _fold_kwargs(function, args, kwargs)
    if torch.is_grad_enabled() and _no_input_requires_grad(args):
        return _original("non_reentrant_checkpoint")(function, *args)
    return _original("checkpoint")(function, *args)


@_mark
def non_reentrant_checkpoint(function: Callable, *args, **kwargs):
    """``deepspeed.checkpointing.non_reentrant_checkpoint``: direct call under an active plan,
    DeepSpeed's non-reentrant checkpoint otherwise. Also accepts keyword arguments (DeepSpeed's
    does not)."""
    if _PLAN_ACTIVE:
        return _run_direct(function, args, kwargs)
    function, args = _fold_kwargs(function, args, kwargs)
    return _original("non_reentrant_checkpoint")(function, *args)


_CHECKPOINT_FUNCTION = None


def _checkpoint_function_class():
    global _CHECKPOINT_FUNCTION
    with _LOCK:
        if _CHECKPOINT_FUNCTION is None:
            base = _original("CheckpointFunction")

            class CheckpointFunction(base):
                """DeepSpeed's ``CheckpointFunction``; under an active plan ``apply`` runs the function
                directly (filling ``all_outputs`` and returning the tensor outputs, as DeepSpeed's
                forward does) instead of checkpointing it."""

                @classmethod
                def apply(cls, run_function, all_outputs, *args):
                    if not _PLAN_ACTIVE:
                        return super().apply(run_function, all_outputs, *args)
                    _inline()
                    outputs = run_function(*args)
                    if _is_tensor(outputs):
                        all_outputs += [outputs]
                        return outputs
                    all_outputs += outputs
                    return tuple(o for o in outputs if _is_tensor(o))

            CheckpointFunction.__module__ = __name__
            CheckpointFunction.__qualname__ = "CheckpointFunction"
            _CHECKPOINT_FUNCTION = _mark(CheckpointFunction)
    return _CHECKPOINT_FUNCTION


def __getattr__(name: str):
    if name == "CheckpointFunction":  # built on first use so that importing us does not import DeepSpeed
        return _checkpoint_function_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------------------------
# configuration and RNG: always DeepSpeed's


@_mark
def configure(mpu_=None, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None):
    """``deepspeed.checkpointing.configure`` (DeepSpeed's, same keywords; ``mpu_`` may be omitted).
    Its settings (partitioning, CPU checkpointing, ...) apply in delegate mode; in plan mode the plan
    decides. Like DeepSpeed's, it needs ``deepspeed.comm`` initialised."""
    return _original("configure")(mpu_, deepspeed_config=deepspeed_config,
                                  partition_activations=partition_activations,
                                  contiguous_checkpointing=contiguous_checkpointing,
                                  num_checkpoints=num_checkpoints, checkpoint_in_cpu=checkpoint_in_cpu,
                                  synchronize=synchronize, profile=profile)


@_mark
def is_configured() -> bool:
    """``deepspeed.checkpointing.is_configured`` (DeepSpeed's)."""
    return _original("is_configured")()


@_mark
def reset():
    """``deepspeed.checkpointing.reset`` (DeepSpeed's: frees its contiguous buffers and drains its
    CPU-offload engine; nothing of SlackSwap's to reset)."""
    return _original("reset")()


@_mark
def get_cuda_rng_tracker():
    """DeepSpeed's model-parallel RNG tracker (the same object, so forks and states are shared)."""
    return _original("get_cuda_rng_tracker")()


@_mark
def model_parallel_cuda_manual_seed(seed: int):
    """DeepSpeed's ``model_parallel_cuda_manual_seed`` (needs ``configure(mpu_)`` first)."""
    return _original("model_parallel_cuda_manual_seed")(seed)


@_mark
def model_parallel_reconfigure_tp_seed(seed: int):
    """DeepSpeed's ``model_parallel_reconfigure_tp_seed``."""
    return _original("model_parallel_reconfigure_tp_seed")(seed)


# --------------------------------------------------------------------------------------------
# install / uninstall

_API = ("checkpoint", "non_reentrant_checkpoint", "configure", "is_configured", "reset", "get_cuda_rng_tracker",
        "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed", "CheckpointFunction")


def _replacement(name: str):
    return _checkpoint_function_class() if name == "CheckpointFunction" else globals()[name]


def _pipeline_init_functions():
    """``__init__`` of PipelineModule and every subclass defined so far that has its own."""
    from deepspeed.runtime.pipe.module import PipelineModule

    seen, stack, out = set(), [PipelineModule], []
    while stack:
        cls = stack.pop()
        if cls in seen:
            continue
        seen.add(cls)
        init = vars(cls).get("__init__")
        if init is not None and hasattr(init, "__defaults__"):
            out.append(init)
        stack.extend(cls.__subclasses__())
    return out


def is_installed() -> bool:
    """True between :func:`install` and :func:`uninstall`."""
    return _INSTALLED is not None


def install() -> bool:
    """Route ``deepspeed.checkpointing.*`` through this module: replaces the API functions (and
    ``CheckpointFunction``) on DeepSpeed's checkpointing module, and the bound default
    ``activation_checkpoint_func`` of ``PipelineModule.__init__`` (and subclasses defined so far).
    Idempotent; returns True if it changed anything."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED is not None:
            return False
        import deepspeed  # noqa: F401  (deepspeed.checkpointing is bound by deepspeed/__init__)

        mod = _ds_module()
        originals = {name: _original(name) for name in _API}
        _checkpoint_function_class()  # built from the original before anything is replaced
        owners = [mod]
        public = getattr(importlib.import_module("deepspeed"), "checkpointing", None)
        if public is not None and public is not mod:
            owners.append(public)
        record: list[tuple[Any, str, bool, Any]] = []
        try:
            for owner in owners:
                for name in _API:
                    record.append((owner, name, name in vars(owner), vars(owner).get(name)))
                    setattr(owner, name, _replacement(name))
            # PipelineModule(activation_checkpoint_func=checkpointing.checkpoint): a default bound at
            # class definition, so it has to be rebound where it lives.
            swap = {id(originals[n]): _replacement(n) for n in ("checkpoint", "non_reentrant_checkpoint")}
            for init in _pipeline_init_functions():
                if init.__defaults__ and any(id(v) in swap for v in init.__defaults__):
                    record.append((init, "__defaults__", True, init.__defaults__))
                    init.__defaults__ = tuple(swap.get(id(v), v) for v in init.__defaults__)
                if init.__kwdefaults__ and any(id(v) in swap for v in init.__kwdefaults__.values()):
                    record.append((init, "__kwdefaults__", True, init.__kwdefaults__))
                    init.__kwdefaults__ = {k: swap.get(id(v), v) for k, v in init.__kwdefaults__.items()}
            record.append((mod, _ORIGINALS_ATTR, _ORIGINALS_ATTR in vars(mod), vars(mod).get(_ORIGINALS_ATTR)))
            setattr(mod, _ORIGINALS_ATTR, originals)
        except BaseException:
            _restore(record)
            raise
        _INSTALLED = record
        return True


def _restore(record) -> None:
    for owner, name, had, old in reversed(record):
        if had:
            setattr(owner, name, old)
        else:
            delattr(owner, name)


def uninstall() -> bool:
    """Undo :func:`install` exactly (every patched attribute gets back the very object it had).
    Returns True if something was installed."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED is None:
            return False
        record, _INSTALLED = _INSTALLED, None
        _restore(record)
        return True
