"""SlackSwap under DeepSpeed's PipelineEngine: one plan per pipeline stage, through the shape lifecycle.

The ranks of one stage (its data-parallel replicas; with tensor parallelism, the shards of its
layers too) run the same layers on the same shapes; other stages run other layers, and under 1F1B
stage i holds the saved tensors of k = min(stages - i, micro-batches) micro-batches at once. So:

    hooks       PipelineEngine never calls engine.forward/backward: it runs its schedule's
                instructions. Its ForwardPass and BackwardPass run each micro-batch in a runner of
                the lifecycle (lifecycle.py), a step of the executor's own from its forward to the
                end of its backward, keyed by the micro-batch's pipe buffer; a train_batch is one
                lifecycle step. deepspeed_api.hook_pipeline is where that touches DeepSpeed.
    profiling   in the step that profiles, the first micro-batch of new shapes is traced; the others
                run in the shelter (every saved tensor to host), so the batch fits any budget. The
                most micro-batches open at once is counted: the plan holds that many (k).
    planning    the budget is the config's of the stage's keep-all peak, k x one micro-batch's saved
                bytes. At the job's first plan the stage's ranks agree on one plan (coordination.py:
                the coordinator's group is the stage; every rank of the job then names every stage's
                plan); later shapes, derived or profiled, are each rank's own, as on the engine.
    later       every micro-batch runs under its shapes' executor; the measured peak counts every
                micro-batch in flight.

Plan files and Chrome traces are not supported per stage yet (compatibility.for_pipeline).
"""

from __future__ import annotations

import logging

from .compatibility import for_pipeline
from .config import SlackSwapConfig
from .deepspeed_api import (checkpointing_set_aside, hook_pipeline, is_train_schedule, micro_batch_inputs,
                            stage_of, stage_ranks)
from .lifecycle import ShapeLifecycle, lifecycle_for
from .plan_maker import PlanMaker
from .shapes import shape_key


class StageHooks:
    """A PipelineEngine's train batches and their micro-batches' passes, as lifecycle steps."""

    def __init__(self, engine, cfg: SlackSwapConfig):
        self.engine, self.cfg = engine, for_pipeline(cfg)
        self.lifecycle: ShapeLifecycle | None = None

    def attach(self) -> ShapeLifecycle:
        stage, members = stage_of(self.engine), stage_ranks(self.engine)
        plans = PlanMaker.for_engine(self.engine, self.cfg, stage=stage, members=members)
        self.lifecycle = lifecycle_for(self.engine, self.cfg, plans)
        hook_pipeline(self.engine, self.forward_pass, self.backward_pass, self.run_batch)
        return self.lifecycle

    def run_batch(self, run_schedule, schedule) -> None:
        if not is_train_schedule(schedule):
            return run_schedule()  # evaluation: not ours to manage
        lifecycle = self.lifecycle
        lifecycle.begin_step()
        with checkpointing_set_aside(self.engine.module) as interval:
            if interval:  # SlackSwap replaces checkpointing: the plan sees and manages every activation
                lifecycle.say_once("checkpoint", logging.INFO, "slackswap: the pipeline's "
                                   "activation_checkpoint_interval=%d is set aside for batches run under SlackSwap "
                                   "plans", interval)
            try:
                run_schedule()
            except BaseException as error:
                lifecycle.end_step(error)
                raise
        lifecycle.end_step()

    def forward_pass(self, run, buffer_id: int):
        if self.lifecycle.step is None:
            return run()
        key = shape_key(micro_batch_inputs(self.engine, buffer_id), {})
        return self.lifecycle.micro_batch_forward(buffer_id, key, run)

    def backward_pass(self, run, buffer_id: int):
        return self.lifecycle.micro_batch_backward(buffer_id, run)


__all__ = ["StageHooks"]
