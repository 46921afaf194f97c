"""DeepSpeed as SlackSwap's integration touches it: every use of a DeepSpeed engine's API, private
included, is here, so that a DeepSpeed upgrade has one place to look for the engine. Three other
places touch DeepSpeed on purpose, each for a concept of its own: `checkpointing.py` (the drop-in
`deepspeed.checkpointing` and its PipelineModule binding), `runtime/device.py` (the accelerator and
DeepSpeed's pinned-memory switch, for copies) and `runtime/takeover.py` (checkpoint calls inside the
model, DeepSpeed's among them, run inline under a plan). And two that stand before it: `ds_config.py`
reads a DeepSpeed config as DeepSpeed does (hjson, base64, a pipe read once), and the start-up hook
(`autoroute.py`) binds its guard to `deepspeed.initialize` and keeps Accelerate's "auto" filling out
of the section.

* DeepSpeed's own `initialize`, kept while SlackSwap's is bound in its place (`route_initialize`,
  `original_initialize`), and called without the ``"slackswap"`` section (`initialize_without_section`).
* The data-parallel engine: its `forward` and `backward` wrapped per engine (`hook_forward_backward`).
* The pipeline engine, which never calls those: a per-engine copy of its class's private
  `_INSTRUCTION_MAP` with `ForwardPass` / `BackwardPass` wrapped, and its private `_exec_schedule`
  wrapped (`hook_pipeline`); its `pipe_buffers`, stage id, topology and
  `activation_checkpoint_interval`.
* ZeRO: the host bytes ZeRO-Offload pins, and whether ZeRO-Infinity offloads parameters.
* ZeRO-3: each layer of a block stack made a ZeRO-3 leaf module after the engine was built, its
  hooks registered again (`gather_layers_whole`), and those hooks paused on a layer while a replay
  re-runs it (`ZeroLayers.replaying`).
* `engine.compile()`: whether DeepCompile or compiled autograd is on.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any, Callable, Iterator

from .budget import PINNED_OPTIMIZER_BYTES_PER_PARAM
from .ds_config import UnreadableConfig, config_out_of, read_config

INITIALIZE_MARK = "__slackswap_initialize__"  # set on slackswap_ds.engine.initialize
GUARD_MARK = "__slackswap_autoroute__"  # set on autoroute.py's guard around DeepSpeed's own initialize

_LOCK = threading.RLock()
_ORIGINAL: Callable | None = None  # DeepSpeed's own initialize while SlackSwap's is routed in
_BEFORE: Callable | None = None  # what was bound before (the guard, or DeepSpeed's own), put back by unrouting
_SEEN: Callable | None = None  # DeepSpeed's own initialize, as last seen unpatched


def _own(function: Callable | None) -> Callable | None:
    """DeepSpeed's own initialize behind autoroute.py's guard, if `function` is that guard."""
    return getattr(function, "__wrapped__", None) if getattr(function, GUARD_MARK, False) else function


# ---- deepspeed.initialize ------------------------------------------------------------------------
def remember_original() -> None:
    """Keep DeepSpeed's `initialize` if it is not yet rebound (the engine module calls this when it
    is imported: evaluating ``ss.initialize`` in ``deepspeed.initialize = ss.initialize`` imports it
    before the assignment happens). DeepSpeed is imported here if it was not yet: with
    ``import slackswap_ds`` and ``ss.initialize`` first, ``import deepspeed`` and the assignment
    after, DeepSpeed's own function would be gone before anything saw it."""
    global _SEEN
    try:
        import deepspeed as module
    except Exception:  # noqa: BLE001 - not installed, or broken: its own import says why when it is used
        return
    current = _own(getattr(module, "initialize", None))
    if current is not None and not getattr(current, INITIALIZE_MARK, False):
        _SEEN = current


def original_initialize() -> Callable:
    """DeepSpeed's own `initialize`, whatever `deepspeed.initialize` is bound to now (a binding to
    SlackSwap's made by hand instead of `install()` included)."""
    import deepspeed  # noqa: F401

    remember_original()
    found = _ORIGINAL or _SEEN
    if found is None:
        raise RuntimeError("deepspeed.initialize was rebound to slackswap_ds.initialize before SlackSwap could "
                           "keep DeepSpeed's own function; use ss.install() instead of assigning it by hand")
    return found


def initialize_is_routed() -> bool:
    return _ORIGINAL is not None


def route_initialize(replacement: Callable) -> bool:
    """Bind `deepspeed.initialize` to `replacement`, keeping DeepSpeed's own. True if it changed it."""
    global _ORIGINAL, _BEFORE
    import deepspeed

    with _LOCK:
        if _ORIGINAL is not None:
            return False
        _ORIGINAL = original_initialize()
        _BEFORE = deepspeed.initialize if getattr(deepspeed.initialize, GUARD_MARK, False) else _ORIGINAL
        deepspeed.initialize = replacement
        return True


def unroute_initialize() -> bool:
    """Put back what `deepspeed.initialize` was before routing (DeepSpeed's own, or autoroute.py's
    guard around it). True if it was routed."""
    global _ORIGINAL, _BEFORE
    import deepspeed

    with _LOCK:
        if _ORIGINAL is None:
            return False
        deepspeed.initialize, _ORIGINAL, _BEFORE = _BEFORE, None, None
        return True


def config_file_of(section: dict, name: str) -> str | None:
    """The config file on the command line whose `name` section is `section`, for a config that
    arrived as a dict (the HF Trainer and Accelerate read the file the user named and pass its
    contents): so that an error can name the file to fix. Only regular files named *.json or
    *.hjson are read (never a pipe: its text is the job's)."""
    if section is None:
        return None
    for arg in sys.argv[1:]:
        path = arg.split("=", 1)[-1]
        if not path.endswith((".json", ".hjson")) or not os.path.isfile(path):
            continue
        try:
            if read_config(path).ours.get(name) == section:
                return path
        except UnreadableConfig:
            continue
    return None


def initialize_without_section(ds_config, section: str, args, positional: tuple, kwargs: dict) -> tuple:
    """DeepSpeed's own `initialize(args, *positional, **kwargs)` with `ds_config` (anything
    `ds_config.read_config` reads; read once: a pipe's text is not read again) minus `section` as
    its only config. (DeepSpeed ignores unknown top-level keys, but it refuses a config both in
    `args` and in the call, so the one in `args` is set aside for the call.)"""
    if ds_config is None:
        return original_initialize()(args, *positional, config=None, config_params=None, **kwargs)
    config = {k: v for k, v in read_config(ds_config).config.items() if k != section}
    with config_out_of(args):
        return original_initialize()(args, *positional, config=config, config_params=None, **kwargs)


# ---- the data-parallel engine ----------------------------------------------------------------------
def hook_forward_backward(engine, before_forward: Callable[[tuple, dict], dict], before_backward: Callable[[], None],
                          after_backward: Callable[[BaseException | None], None]) -> None:
    """Wrap this engine's `forward` and `backward` (the class's stay DeepSpeed's):
    `before_forward(args, kwargs)` returns the keyword inputs forward gets; `after_backward(error)`
    runs after backward, also when it raises (`error`: what it raised, else None)."""
    forward, backward = engine.forward, engine.backward

    def slackswap_forward(*args, **kwargs):
        return forward(*args, **before_forward(args, kwargs))

    def slackswap_backward(loss, *args, **kwargs):
        before_backward()
        try:
            result = backward(loss, *args, **kwargs)
        except BaseException as error:
            after_backward(error)
            raise
        after_backward(None)
        return result

    engine.forward = slackswap_forward
    engine.backward = slackswap_backward


# ---- the pipeline engine ------------------------------------------------------------------------------
def is_pipeline_engine(engine) -> bool:
    try:
        from deepspeed.runtime.pipe.engine import PipelineEngine
    except ImportError:  # pragma: no cover - a DeepSpeed without pipeline support
        return False
    return isinstance(engine, PipelineEngine)


PassRunner = Callable[[Callable[[], Any], int], Any]  # (run the pass, buffer id) -> its result


def hook_pipeline(engine, forward_pass: PassRunner, backward_pass: PassRunner,
                  run_batch: Callable[[Callable[[], Any], Any], Any]) -> None:
    """Route this pipeline engine's ForwardPass and BackwardPass instructions through
    `forward_pass(run, buffer_id)` / `backward_pass(run, buffer_id)` (each calls `run()` to run
    DeepSpeed's own pass), and each schedule it executes through `run_batch(run, schedule)`.
    The engine gets its own copy of the instruction map: the class's stays DeepSpeed's."""
    from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass

    instructions = dict(type(engine)._INSTRUCTION_MAP)
    deepspeed_forward, deepspeed_backward = instructions[ForwardPass], instructions[BackwardPass]
    instructions[ForwardPass] = lambda eng, buffer_id: forward_pass(lambda: deepspeed_forward(eng, buffer_id), buffer_id)
    instructions[BackwardPass] = lambda eng, buffer_id: backward_pass(lambda: deepspeed_backward(eng, buffer_id),
                                                                      buffer_id)
    engine._INSTRUCTION_MAP = instructions
    run_schedule = engine._exec_schedule
    engine._exec_schedule = lambda schedule: run_batch(lambda: run_schedule(schedule), schedule)


def is_train_schedule(schedule) -> bool:
    """A training batch (train_batch's schedule, grad on), not eval_batch's."""
    import torch
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    return isinstance(schedule, TrainSchedule) and torch.is_grad_enabled()


def stage_of(engine) -> int:
    return int(engine.stage_id)


def stage_ranks(engine) -> list[int]:
    """The job ranks of this engine's pipeline stage (its data-parallel and tensor-parallel peers), ascending."""
    return sorted(engine.module.topology().filter_match(pipe=stage_of(engine)))


def micro_batch_inputs(engine, buffer_id: int) -> tuple:
    """What a micro-batch's forward takes: its inputs, and on the last stage its labels (else None)."""
    buffers = engine.pipe_buffers
    labels = buffers.get("labels")
    label = labels[buffer_id] if engine.is_last_stage() and labels and len(labels) > buffer_id else None
    return buffers["inputs"][buffer_id], label


@contextlib.contextmanager
def checkpointing_set_aside(module) -> Iterator[int]:
    """The PipelineModule's `activation_checkpoint_interval` is 0 inside (SlackSwap plans every
    activation instead); yields the interval set aside, restored afterwards."""
    interval = module.activation_checkpoint_interval
    module.activation_checkpoint_interval = 0
    try:
        yield interval
    finally:
        module.activation_checkpoint_interval = interval


# ---- ZeRO ---------------------------------------------------------------------------------------------
def zero_offload_pinned_bytes(engine) -> int | None:
    """Host bytes DeepSpeed's ZeRO-Offload pins for this rank's optimizer state (fp32 master, m, v and
    gradient of its 1/dp partition: 16 B per parameter), or None without optimizer offload."""
    offloads = getattr(engine, "zero_cpu_offload", None)
    if offloads is None or not offloads():
        return None
    params = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    return params // max(1, int(getattr(engine, "dp_world_size", 1))) * PINNED_OPTIMIZER_BYTES_PER_PARAM


def partitions_parameters(engine) -> bool:
    """ZeRO stage 3: parameters are partitioned and gathered by hooks around each module's forward
    and backward (collectives of the data-parallel group)."""
    stage = getattr(engine, "zero_optimization_stage", None)
    return stage is not None and stage() == 3


def zero_sharding(engine) -> tuple[int, int]:
    """(ZeRO stage, data-parallel ranks the model state is sharded over); (0, 1) for an engine without."""
    stage = getattr(engine, "zero_optimization_stage", None)
    return (int(stage()) if stage is not None else 0), int(getattr(engine, "dp_world_size", 1) or 1)


class ZeroLayers:
    """ZeRO-3 layers gathered whole, so that a replay needs no collective (see `gather_layers_whole`)."""

    def __init__(self, offload, layers: list):
        self._offload, self.layers = offload, layers

    @contextlib.contextmanager
    def replaying(self, layer) -> Iterator[None]:
        """`layer` runs again inside its own backward: its parameters must be present (gathered by
        ZeRO-3's pre-backward hook on every rank alike), and ZeRO-3's own hooks on it are paused, so
        that the replay fetches, prefetches, releases and traces nothing: no collective of its own,
        and the backward it runs inside keeps its parameters."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        absent = [name for name, p in layer.named_parameters()
                  if getattr(p, "ds_status", ZeroParamStatus.AVAILABLE) != ZeroParamStatus.AVAILABLE]
        if absent:  # never gathered here: a gather on this rank alone would hang the group
            raise RuntimeError(f"ZeRO-3 holds {len(absent)} of this layer's parameters partitioned (e.g. "
                               f"{absent[0]}): its replay ran outside the layer's backward, and gathering them "
                               f"here would be a collective on this rank alone")
        ours = {h.id for h in [*self._offload.forward_hooks, *self._offload.backward_hooks]}
        hooks = (layer._forward_pre_hooks, layer._forward_hooks)
        kept = [dict(d) for d in hooks]
        for d in hooks:
            for key in ours & d.keys():
                del d[key]
        try:
            yield
        finally:
            for d, before in zip(hooks, kept):
                d.clear()
                d.update(before)


def gather_layers_whole(engine, layers: list) -> ZeroLayers | None:
    """ZeRO-3: make each of `layers` (the model's block-stack layers) a ZeRO-3 leaf module, so that
    ZeRO-3 gathers a layer's parameters all at once in the hooks around its forward and its backward,
    on every rank at the same point whatever each rank's plan; a replay inside the layer's backward
    then finds them present. DeepSpeed reads the leaf flag when it registers its hooks, at
    `initialize`: they are registered again (its own `_remove_module_hooks` and
    `setup_zero_stage3_hooks`; the trace it prefetches by is re-recorded). Gradient reduction stays
    per parameter, as the optimizer set it up (so its order, and its bits, are those of the job
    without SlackSwap): the parameters' leaf mark, read only there, is taken off again. None where
    the engine has no ZeRO-3 hooks to register."""
    from deepspeed.utils import set_z3_leaf_module

    optimizer = getattr(engine, "optimizer", None)
    offload = getattr(optimizer, "parameter_offload", None)
    if offload is None and hasattr(optimizer, "setup_zero_stage3_hooks"):  # ZeRO-3 without an optimizer
        offload = optimizer
    if offload is None or not layers:
        return None
    for layer in layers:
        set_z3_leaf_module(layer, True)
    offload._remove_module_hooks()
    offload.setup_zero_stage3_hooks()
    for layer in layers:
        for p in layer.parameters():
            if hasattr(p, "ds_z3_leaf_module"):
                del p.ds_z3_leaf_module
    return ZeroLayers(offload, list(layers))


def offloads_parameters(engine) -> bool:
    """ZeRO-Infinity parameter offload (`offload_param`) is on."""
    return getattr(engine, "zero_offload_param", lambda: None)() is not None


# ---- compile -------------------------------------------------------------------------------------------
def deepcompile_active(engine) -> bool:
    """engine.compile() compiled the model through DeepCompile's passes."""
    return bool(getattr(engine, "is_deepcompile_active", lambda: False)())


def compiled_autograd_enabled(engine) -> bool:
    """engine.compile(compiled_autograd_enabled=True) (a private flag in DeepSpeed 0.19.8)."""
    return bool(getattr(engine, "_is_compiled_autograd_enabled", False))


__all__ = ["GUARD_MARK", "INITIALIZE_MARK", "ZeroLayers", "checkpointing_set_aside", "compiled_autograd_enabled",
           "config_file_of", "deepcompile_active", "gather_layers_whole", "hook_forward_backward", "hook_pipeline",
           "initialize_is_routed", "initialize_without_section", "is_pipeline_engine", "is_train_schedule",
           "micro_batch_inputs", "offloads_parameters", "original_initialize", "partitions_parameters",
           "remember_original", "route_initialize", "stage_of", "stage_ranks", "unroute_initialize",
           "zero_offload_pinned_bytes", "zero_sharding"]
