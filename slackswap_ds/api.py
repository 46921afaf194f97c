"""The plain-PyTorch API: run a model's steps under a plan, with no DeepSpeed in sight.

``with ss.apply(model, plan, profile) as stats:`` runs every step inside under `plan` (see
runtime/executor.py: `executor_for`). `plan` is a `Plan` (what ``ss.plan`` returns) or a planner's `Planned`,
whose Schedule is used as it is (a plan is lowered once).

Re-planning after a demotion is policy, decided here rather than in the runtime: by default
(`replan_without`) the failed tensors are made unrecomputable and the plan's own planner plans
again on its hardware within the same budget.
"""

from __future__ import annotations

from torch import nn

from .hardware import preset_by_digest
from .logs import log
from .plan import Plan
from .planners import PLANNERS, Planned
from .runtime.executor import Executor, executor_for
from .runtime.verify import swap_instead
from .shares import PRIVATE
from .step_profile import StepProfile


__all__ = ["apply", "replan_without"]


def apply(model: nn.Module, plan: Plan | Planned, profile: StepProfile, *, verify_every: int = 100,
          **kw) -> Executor:
    """Context manager: every step run inside follows `plan`, made for `profile` of this model.
    ``with apply(model, plan, profile) as stats: ...``; ``stats.last_step`` has the counters.

    The first step that recomputes checks every recomputed tensor bit for bit against forward's, and
    so does every `verify_every`-th step after it (as the DeepSpeed config's `verify_every`): a layer
    that starts reading state which changes between its forward and its backward is demoted there;
    between two checks (and with 0, after the first) it trains with wrong gradients, as under
    torch.utils.checkpoint. Keywords as runtime.executor.executor_for: `pool` (HostPool), `record`
    (measured timelines), `verify` (check at all, default True), `replan` (how to re-plan after a
    demotion; default `replan_without`), `takeover`, `device` (default: the Device of the model's
    parameters)."""
    if isinstance(plan, Planned):
        kw.setdefault("schedule", plan.schedule)
        plan = plan.plan
    kw.setdefault("replan", replan_without)
    kw["verify_every"] = verify_every
    return executor_for(model, plan, profile, **kw)


def replan_without(profile: StepProfile, plan: Plan, failures: dict[str, str]) -> tuple[StepProfile, Plan]:
    """The default re-plan after a demotion: the profile with the failed activations made
    unrecomputable, planned again by the plan's planner on its hardware (a preset recognised by
    its digest) within the same budget; for a planner or hardware it does not know, the failed
    keys are swapped instead (logged)."""
    hw = preset_by_digest(plan.hardware_digest)
    planner = PLANNERS.get(plan.planner)
    if hw is None or planner is None:
        log.info("slackswap: no planner %r on known hardware to re-plan with; the failed tensors are swapped",
                 plan.planner)
        return swap_instead(profile, plan, failures)
    pinned = profile.without_recompute(failures)
    return pinned, planner(pinned, hw, plan.budget_bytes, PRIVATE).plan
