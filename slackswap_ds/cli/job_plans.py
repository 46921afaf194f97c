"""`slackswap plan --plan-file JOB_FILE`: a job's measured steps planned again, offline.

A job with a `plan_file` keeps, beside each plan, the profile of the step it measured and what the
plan was made for (plan_file.py). Here every entry is planned again with the planner and budget
asked for (by default the job's own), for the same hardware and the same share of the node, and the
plans are written as a plan file. A job with that `plan_file` and the same `planner` and
`activation_budget` adopts them ("using the plan in plan_file ...") instead of planning: to try a
planner or a budget on a real job's steps without running it, or to make a slow plan (the MILP
planners on a large model) once, off the training nodes.

The job still checks every entry against what it runs (input shapes, the step's structure, budget,
hardware, planner, share, world): a plan made here for something else is refused with the reason.
Torch-free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..budget import Budget
from ..errors import BudgetInfeasibleError, SlackSwapError
from ..hardware import Hardware, load_hardware, preset_by_digest
from ..plan import Decision
from ..plan_file import PlanEntry
from ..planners import get_planner, keep_all_result
from ..planners.common import refusal
from ..shares import Share
from ..simulator import SimResult


@dataclass(frozen=True)
class Replanned:
    """One entry planned again: the new entry, the hardware it was planned for and its simulated step
    on the job's share (`result.throughput`: against the keep-all step there)."""

    entry: PlanEntry
    hw: Hardware
    result: SimResult


def replan(entries: list[PlanEntry], planner: str | None, budget: Budget | None, hardware: str | None) -> list[Replanned]:
    """Every entry planned again with `planner` and `budget` (None: the entry's own), for its job's
    hardware (a preset found by the digest the entry records, else the `hardware` file or preset
    given, which must have that digest) and its share."""
    if not entries:
        raise SlackSwapError("the plan file has no plans yet: run the job with it as plan_file first")
    if budget is not None and budget.is_auto:
        raise SlackSwapError('-b auto: an "auto" budget is found on the job\'s device; leave -b out to keep the '
                             'budget the job planned with')
    return [_replan(e, planner, budget, hardware) for e in entries]


def _replan(entry: PlanEntry, planner: str | None, budget: Budget | None, hardware: str | None) -> Replanned:
    made_for, profile = entry.made_for, entry.profile
    if profile is None:
        raise SlackSwapError(f"the plan for input shapes {made_for.inputs} was saved without the step's profile "
                             f"(by an older slackswap_ds): run the job once more with this plan_file")
    hw = _hardware_of(made_for.hardware, hardware)
    try:
        share = Share.parse(made_for.share)
    except ValueError as e:
        raise SlackSwapError(f"the plan for input shapes {made_for.inputs}: {e}") from None
    planner = planner or made_for.planner
    budget_bytes = made_for.budget_bytes if budget is None else budget.of(profile.total_bytes)
    try:
        planned = get_planner(planner)(profile, hw, budget_bytes, share)
    except BudgetInfeasibleError as e:
        raise SlackSwapError(f"{planner} finds no plan for input shapes {made_for.inputs} within {budget_bytes:,} B "
                             f"({refusal(planner, e)})") from None
    ideal_s = keep_all_result(profile, hw).step_s
    made_for = dataclasses.replace(made_for, budget_bytes=budget_bytes, planner=planner)
    return Replanned(PlanEntry(made_for, planned.plan, profile), hw,
                     dataclasses.replace(planned.result, ideal_s=ideal_s))


def _hardware_of(recorded: str, given: str | None) -> Hardware:
    """The hardware a job planned for, from what its entry records ("<name> <digest>")."""
    name, _, digest = recorded.rpartition(" ")
    hw = load_hardware(given) if given else preset_by_digest(digest)
    if hw is None:
        raise SlackSwapError(f"the job planned for hardware {name!r}, which is no preset here (or a changed one): "
                             f"give its JSON file with --hardware")
    if hw.digest != digest:
        raise SlackSwapError(f"--hardware {given!r} is not the hardware the job planned for ({name!r}, digest "
                             f"{digest[:12]}); a job adopts only plans made for its own hardware")
    return hw


def say(r: Replanned, output: str) -> str:
    """One line: what an entry's new plan keeps, swaps and recomputes (bytes, as a job's plan lines
    say them), how its step simulates on the job's share, where it went."""
    made_for, plan = r.entry.made_for, r.entry.plan
    by = plan.bytes_by_decision(r.entry.profile)
    split = ", ".join(f"{d.value} {len(plan.keys(d))} ({by[d]:,} B)" for d in Decision)
    over = "" if r.result.feasible else " (OVER BUDGET)"
    return (f"{made_for.planner} plan for input shapes {made_for.inputs} on {r.hw.name}, budget "
            f"{made_for.budget_bytes:,} B: {split}; simulated {100 * r.result.throughput:.1f}% of ideal, peak "
            f"{r.result.peak_bytes:,} B{over}; digest {plan.digest[:12]} -> {output}")
