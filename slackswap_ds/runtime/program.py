"""The lowered Schedule as the executor reads it: a `Program`, built once per plan.

The Schedule (plan.py) is one instruction list that the simulator and the executor both
interpret. The executor's hooks do not walk it: they ask, per saved tensor and per backward
position, what to do now. `Program` indexes the Schedule for those questions, kept apart from the
hooks that ask them (as TransformerEngine keeps *when* to act in plain maps apart from its hooks):

* per activation key, a `PlannedTensor`: its decision, bytes, the profile op whose backward reads
  it first, and the op of its layer call that writes it (what a replay must reach);
* per region, the ops its replay re-runs (the Schedule's RECOMPUTE instructions, as indices
  within the layer call), and whether that is every op up to the last one the replay needs (then a
  call proven replayable whole is run again whole, without a dispatch mode: `whole`, calls.py);
* the COPY_IN triggers, by profile op, in the order backward passes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..derive import derived
from ..plan import Decision, Kind, Schedule
from ..step_profile import Activation, StepProfile

__all__ = ["PlannedTensor", "Program"]


@dataclass(frozen=True)
class PlannedTensor:
    """One activation of the plan, as the executor needs it when the tensor is saved."""

    decision: Decision
    nbytes: int
    first_read: int  # profile op whose backward reads it first
    writer: int | None  # the op of its layer call (index within the call) that makes it; None: not recomputable
    packed: bool = False  # stored packed (PACK)


class Program:
    """What the executor needs from a lowered Schedule, indexed for hooks (see the module docstring)."""

    def __init__(self, schedule: Schedule, profile: StepProfile):
        plan = schedule.plan
        self.plan, self.profile, self.blocking = plan, profile, plan.blocking
        # a derived profile's sizes are predictions (derive.py): a tensor larger than derived goes
        # to host rather than stay or be regenerated, so that the budget holds while the step checks them
        self.guarded = derived(profile)
        # and its budget is held at run time too: a keep or a prefetch that would take the device's
        # saved bytes over it goes to host, or waits until backward reads the tensor (sizes off
        # either way push a derived plan's peak past its prediction)
        self.cap = plan.budget_bytes if self.guarded else None
        ops = profile.ops
        op_index = {o.key: i for i, o in enumerate(ops)}
        self.n_ops = len(ops)
        first: dict[str, int] = {}
        for i, o in enumerate(ops):
            first.setdefault(o.region, i)

        def writer(a: Activation) -> int | None:  # a replay's last op is the one that writes the tensor
            return max(a.producers) - first[ops[max(a.producers)].region] if a.producers else None

        self.acts = {a.key: PlannedTensor(plan.decision[a.key], a.bytes, a.first_read, writer(a),
                                          a.key in plan.is_packed) for a in profile.activations}
        self.region_of_op = [o.region for o in ops]
        self.op_keys = {(o.region, i - first[o.region]): o.key for i, o in enumerate(ops)}
        # RECOMPUTE instructions: the ops each region's replay re-runs (indices within the region)
        rerun: dict[str, set[int]] = {}
        triggers: dict[int, list[str]] = {}
        instrs = schedule.instrs
        # ops only a baseline's whole-block replay re-runs rebuild nothing: skipped (Plan.replay)
        needed = {p for a in profile.activations if plan.decision[a.key] is Decision.RECOMPUTE for p in a.producers}
        for ins in instrs:
            if ins.kind is Kind.RECOMPUTE and op_index[ins.name] in needed:
                i = op_index[ins.name]
                rerun.setdefault(ops[i].region, set()).add(i - first[ops[i].region])
            elif ins.kind is Kind.COPY_IN:
                trigger = instrs[ins.waits[1]]  # waits = (its copy-out, its trigger)
                # FWD(last op): at the end of forward, i.e. as soon as backward starts
                at = self.n_ops if trigger.kind is Kind.FWD else op_index[trigger.name]
                triggers.setdefault(at, []).append(ins.name)
        self.rerun = {r: frozenset(s) for r, s in rerun.items()}
        # regions whose replay re-runs every op up to the last one it needs: a whole run of the call
        # re-runs nothing the Schedule does not (beyond the ops after that, where it stops)
        self.whole = frozenset(r for r, s in self.rerun.items() if len(s) == max(s) + 1)
        self.triggers = sorted(triggers.items(), reverse=True)  # fire while backward passes them
        self.any_backward_work = bool(self.triggers or self.rerun)
