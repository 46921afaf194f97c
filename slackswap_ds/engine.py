"""DeepSpeed integration: `initialize(...)`, same signature and return as `deepspeed.initialize`.

With an enabled `"slackswap"` section, the engine's steps follow the shape lifecycle
(lifecycle.py): the first `profile_steps` warm up in the shelter, the next is profiled and its plan
agreed by the ranks, later shapes get plans of their own (derived or profiled), and a model
compiled later is planned anew. This module only connects DeepSpeed's entry points to it:

    EngineHooks    a data-parallel engine's `forward` (a training forward begins a step; evaluation
                   forwards are left alone) and `backward` (the step ends after it)
    StageHooks     a PipelineEngine, which never calls those: its schedule's passes (stages.py)

`engine.slackswap` is the lifecycle: `last_stats`, `active_plan`, `shapes`, `end_of_job()`.
"""

from __future__ import annotations

import torch

from .compatibility import check_compile_section, take_compiled_model
from .config import SECTION, ConfigError, SlackSwapConfig, load_config, read_deepspeed_config
from .deepspeed_api import (INITIALIZE_MARK, config_file_of, hook_forward_backward, initialize_without_section,
                            is_pipeline_engine, remember_original)
from .ds_config import config_given
from .lifecycle import ShapeLifecycle, lifecycle_for
from .logs import said_once_per_job, setup_logging
from .plan_maker import PlanMaker
from .shapes import shape_key

# `deepspeed.initialize = ss.initialize` written by hand imports this module before the assignment
# happens: DeepSpeed's own function is kept now (deepspeed_api.py)
remember_original()


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, *rest, config=None, config_params=None, **kwargs):
    """`deepspeed.initialize`, plus the `"slackswap"` section of the config. Returns the same
    tuple (engine, optimizer, training_dataloader, lr_scheduler); the engine's forward/backward
    then follow SlackSwap plans. Without a section, or with `"enabled": false`, it is plain DeepSpeed."""
    given = config_given(args, config, config_params)  # (a pipe's config arrives read, from autoroute.py's guard)
    read = None
    try:
        read = read_deepspeed_config(given) if given is not None else None  # read once: a pipe is read once
        cfg = load_config(read if read is not None else {})
        if cfg.enabled:
            check_compile_section(read.config)
    except ConfigError as e:  # every rank raises it alike: said once for the job, the file named if found
        section = read.ours.get(SECTION) if read is not None and read.source is None else None
        source = e.source or config_file_of(section, SECTION)
        raise said_once_per_job(ConfigError(e.problems, source) if source != e.source else e) from None
    out = initialize_without_section(read, SECTION, args,
                                     (model, optimizer, model_parameters, training_data, lr_scheduler, *rest), kwargs)
    engine = out[0]
    if cfg.enabled:
        setup_logging(cfg.log_level)
        take_compiled_model(engine)
        if is_pipeline_engine(engine):  # its own schedule, several micro-batches in flight
            from .stages import StageHooks

            StageHooks(engine, cfg).attach()
        else:
            EngineHooks(engine, cfg).attach()
    return out


setattr(initialize, INITIALIZE_MARK, True)  # recognised as SlackSwap's wherever it is bound


def bucketed(multiple: int, module, args: tuple, kwargs: dict) -> dict:
    """A training forward's keyword inputs padded to `multiple` (bucketing.py; 0: as they are)."""
    if not multiple or not torch.is_grad_enabled() or not module.training:
        return kwargs
    from .bucketing import BucketingError, pad_to_multiple

    if any(isinstance(a, torch.Tensor) for a in args):
        raise BucketingError("pad_to_multiple pads keyword inputs (engine(input_ids=..., labels=...)); this "
                             "forward got positional tensors, whose meaning is unknown: pass them by name, or "
                             "pad in your collator and drop pad_to_multiple")
    return pad_to_multiple(kwargs, multiple)


class EngineHooks:
    """A data-parallel engine's forward and backward, as lifecycle steps."""

    def __init__(self, engine, cfg: SlackSwapConfig):
        self.engine, self.cfg = engine, cfg
        self.lifecycle: ShapeLifecycle | None = None

    def attach(self) -> ShapeLifecycle:
        self.lifecycle = lifecycle_for(self.engine, self.cfg, PlanMaker.for_engine(self.engine, self.cfg))
        hook_forward_backward(self.engine, self.before_forward, self.lifecycle.before_backward,
                              self.lifecycle.after_backward)
        return self.lifecycle

    def before_forward(self, args: tuple, kwargs: dict) -> dict:
        module = self.engine.module
        kwargs = bucketed(self.cfg.pad_to_multiple, module, args, kwargs)
        if torch.is_grad_enabled() and module.training:  # (evaluation: not ours to manage)
            self.lifecycle.forward(shape_key(args, kwargs))
        return kwargs


__all__ = ["EngineHooks", "initialize"]
