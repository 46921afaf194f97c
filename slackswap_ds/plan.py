"""Plans (what to do with each saved activation) and their lowering to per-stream Schedules.

A `Plan` is a frozen, canonical-JSON, digest-checked record: one `Decision` per activation key,
a prefetch trigger per swapped key, the budget, and the digests of the profile and hardware it was
made for. `lower(profile, plan)` turns it into a `Schedule`: an ordered instruction list for each of
three streams (compute, d2h, h2d). The simulator executes a Schedule in virtual time; the runtime
executor executes the same Schedule for real.

Schedule protocol (the simulator and the executor both follow it; comments elsewhere refer here):

    compute: FWD(op) for every op in order. After FWD(op) the activations it saves are resident,
             except RECOMPUTE ones (they are not saved at all).
             Then, for ops in reverse: at the first backward op of a region that holds RECOMPUTE
             activations, RECOMPUTE(op) re-runs each producer op of the region in forward order
             (the recomputed tensors become resident when their last producer finishes);
             BWD(op) waits for the copy-in of every swapped tensor it reads, and frees every
             tensor whose last reader it is.
             PACK: a packed tensor's bytes are its packed ones (kept, or copied out and in); the
             FWD that saves it also packs it and the BWD that first reads it unpacks it (each
             `pack_s`); the unpacked tensor (UNPACKED key) is resident from that BWD's start
             until the tensor is freed.
    d2h:     COPY_OUT(act) for swapped tensors in the order they are saved; each waits for the FWD
             that saved it, and the device copy is released only when the copy ends.
    h2d:     COPY_IN(act) in the order backward needs them; each waits for its own COPY_OUT and for
             its trigger (the BWD of the trigger op, or the end of forward when the trigger is "");
             its device bytes count from the moment the copy starts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from pathlib import Path
from typing import Mapping

from .errors import InvalidFileError, PlanError
from .files import read_json
from .step_profile import Activation, StepProfile

PLAN_FORMAT = "slackswap.plan/1"
END_OF_FORWARD = ""  # prefetch trigger meaning "as soon as backward starts"
UNPACKED = "#unpacked"  # suffix of the Schedule key of a packed tensor's unpacked bytes in backward


class Decision(str, Enum):
    KEEP = "keep"
    SWAP = "swap"
    RECOMPUTE = "recompute"


@dataclass(frozen=True)
class Plan:
    """Decision per activation key, prefetch trigger per swapped key, and what the plan was made for."""

    decisions: tuple[tuple[str, Decision], ...]
    prefetch: tuple[tuple[str, str], ...]
    budget_bytes: int
    profile_digest: str
    hardware_digest: str
    planner: str
    planner_version: str = "1"
    blocking: bool = False  # forward waits for each copy-out before its next op (torch save_on_cpu)
    # ops re-run in backward although no tensor needs them: a baseline that replays whole
    # checkpointed blocks (DeepSpeed, Megatron) pays for them. The simulator charges them; the
    # runtime executor skips them (it re-runs only what rebuilds a RECOMPUTE tensor).
    replay: tuple[str, ...] = ()
    # PACK: kept or swapped activations stored packed (runtime/packing.py; their bytes and copies
    # are the packed ones, plus a packing kernel after their save and an unpacking one before their
    # first read). Orthogonal to the decision: a packed tensor is kept or swapped packed.
    packed: tuple[str, ...] = ()

    @classmethod
    def build(
        cls,
        profile: StepProfile,
        decisions: Mapping[str, Decision],
        *,
        budget_bytes: int,
        hardware_digest: str,
        planner: str,
        planner_version: str = "1",
        prefetch: Mapping[str, str] | None = None,
        blocking: bool = False,
        replay: tuple[str, ...] = (),
        packed: tuple[str, ...] = (),
    ) -> "Plan":
        """A checked plan; swapped keys without an explicit trigger prefetch at the end of forward."""
        prefetch = dict(prefetch or {})
        for key, d in decisions.items():
            if d is Decision.SWAP:
                prefetch.setdefault(key, END_OF_FORWARD)
        plan = cls(
            decisions=tuple(sorted((k, Decision(v)) for k, v in decisions.items())),
            prefetch=tuple(sorted(prefetch.items())),
            budget_bytes=int(budget_bytes),
            profile_digest=profile.digest,
            hardware_digest=hardware_digest,
            planner=planner,
            planner_version=planner_version,
            blocking=blocking,
            replay=tuple(sorted(set(replay))),
            packed=tuple(sorted(set(packed))),
        )
        plan.check(profile)
        return plan

    def rebuilt(self, profile: StepProfile, decisions: Mapping[str, Decision] | None = None,
                prefetch: Mapping[str, str] | None = None, packed: tuple[str, ...] | None = None) -> "Plan":
        """This plan for `profile` (the same step measured again, or a profile with some tensors made
        unrecomputable), with `decisions`, `prefetch` or `packed` replaced where given; budget,
        hardware, planner and blocking kept (and, by default, the packing of what is still kept or
        swapped). Checked like any plan."""
        decisions = self.decision if decisions is None else decisions
        if packed is None:
            packed = tuple(k for k in self.packed if decisions.get(k) in (Decision.KEEP, Decision.SWAP))
        return Plan.build(profile, decisions, budget_bytes=self.budget_bytes,
                          hardware_digest=self.hardware_digest, planner=self.planner,
                          planner_version=self.planner_version,
                          prefetch=self.trigger if prefetch is None else prefetch, blocking=self.blocking,
                          replay=self.replay, packed=packed)

    @cached_property
    def decision(self) -> dict[str, Decision]:
        return dict(self.decisions)

    @cached_property
    def trigger(self) -> dict[str, str]:
        return dict(self.prefetch)

    def keys(self, decision: Decision) -> list[str]:
        return [k for k, d in self.decisions if d is decision]

    @cached_property
    def is_packed(self) -> frozenset[str]:
        return frozenset(self.packed)

    def packed_bytes(self, profile: StepProfile) -> tuple[int, int]:
        """(bytes of the packed activations, the bytes they are stored in)."""
        acts = [profile.by_key[k] for k in self.packed]
        return sum(a.bytes for a in acts), sum(a.packed_bytes for a in acts)

    def stored_bytes(self, profile: StepProfile) -> dict[str, int]:
        """Each activation's bytes as the plan stores it (packed ones packed)."""
        return {a.key: a.packed_bytes if a.key in self.is_packed else a.bytes for a in profile.activations}

    def bytes_by_decision(self, profile: StepProfile) -> dict[Decision, int]:
        out = {d: 0 for d in Decision}
        for a in profile.activations:
            out[self.decision[a.key]] += a.bytes
        return out

    def check(self, profile: StepProfile) -> None:
        """Raise PlanError if this plan does not fit `profile` (all problems at once)."""
        problems = []
        keys = {a.key for a in profile.activations}
        missing = sorted(keys - self.decision.keys())
        unknown = sorted(self.decision.keys() - keys)
        if missing:
            problems.append(f"no decision for {len(missing)} activation(s), e.g. {missing[:3]}")
        if unknown:
            problems.append(f"decisions for {len(unknown)} unknown activation(s), e.g. {unknown[:3]}")
        op_index = {o.key: i for i, o in enumerate(profile.ops)}
        for a in profile.activations:
            d = self.decision.get(a.key)
            if d is Decision.RECOMPUTE and not a.recomputable:
                problems.append(f"{a.key!r} cannot be recomputed inside its region (no producers); keep or swap it")
            if d is Decision.SWAP:
                trig = self.trigger.get(a.key)
                if trig is None:
                    problems.append(f"swapped {a.key!r} has no prefetch trigger")
                elif trig != END_OF_FORWARD:
                    if trig not in op_index:
                        problems.append(f"prefetch trigger {trig!r} of {a.key!r} is not an op of the profile")
                    elif op_index[trig] <= need_op(profile, self, a.key):
                        problems.append(f"prefetch trigger {trig!r} of {a.key!r} comes after backward needs it")
        for key in self.packed:
            a = profile.by_key.get(key)
            if a is None or not a.packable:
                problems.append(f"{key!r} is packed but the profile does not mark it packable")
            elif self.decision.get(key) not in (Decision.KEEP, Decision.SWAP):
                problems.append(f"{key!r} is packed but not kept or swapped")
        stray = [k for k in self.replay if k not in op_index]
        if stray:
            problems.append(f"replay names {len(stray)} op(s) not in the profile, e.g. {stray[:3]}")
        for key in self.trigger:
            if self.decision.get(key) is not Decision.SWAP:
                problems.append(f"prefetch trigger given for {key!r}, which is not swapped")
        if self.budget_bytes < 0:
            problems.append("budget_bytes is negative")
        if problems:
            raise PlanError(f"plan from {self.planner!r} does not fit profile {profile.name!r}: " + "; ".join(problems))

    # ---- JSON ----------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "format": PLAN_FORMAT,
            "decisions": {k: d.value for k, d in self.decisions},
            "prefetch": dict(self.prefetch),
            "budget_bytes": self.budget_bytes,
            "profile_digest": self.profile_digest,
            "hardware_digest": self.hardware_digest,
            "planner": self.planner,
            "planner_version": self.planner_version,
            "blocking": self.blocking,
            # only when present, so that every plan without one keeps its digest
            **({"replay": list(self.replay)} if self.replay else {}),
            **({"packed": list(self.packed)} if self.packed else {}),
        }

    def canonical_json(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @cached_property
    def digest(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    @classmethod
    def from_json(cls, d: dict) -> "Plan":
        if not isinstance(d, dict) or d.get("format") != PLAN_FORMAT:
            raise InvalidFileError(f"not a slackswap plan: expected a JSON object with \"format\": \"{PLAN_FORMAT}\"")
        try:
            return cls(
                decisions=tuple(sorted((str(k), Decision(v)) for k, v in d["decisions"].items())),
                prefetch=tuple(sorted((str(k), str(v)) for k, v in d["prefetch"].items())),
                budget_bytes=_byte_count(d["budget_bytes"]),
                profile_digest=str(d["profile_digest"]),
                hardware_digest=str(d["hardware_digest"]),
                planner=str(d["planner"]),
                planner_version=str(d["planner_version"]),
                blocking=_strict_bool(d.get("blocking", False)),
                replay=tuple(sorted(str(k) for k in d.get("replay", []))),
                packed=tuple(sorted(str(k) for k in d.get("packed", []))),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InvalidFileError(f"malformed slackswap plan: {e!r}") from e

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path, profile: StepProfile | None = None) -> "Plan":
        """Read a plan file; with `profile`, also refuse a plan made for another profile."""
        plan = cls.from_json(read_json(path, "plan"))
        if profile is not None:
            if plan.profile_digest != profile.digest:
                raise PlanError(
                    f"plan {str(path)!r} was made for profile {plan.profile_digest[:12]}, "
                    f"not for this step's profile {profile.digest[:12]}; delete it to re-plan"
                )
            plan.check(profile)
        return plan


def _byte_count(v: object) -> int:
    """A JSON integer >= 0 (not a float, a string or a bool, which int() would quietly turn into one)."""
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"budget_bytes must be an integer >= 0, got {v!r}")
    return v


def _strict_bool(v: object) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"blocking must be true or false, got {v!r}")
    return v


def need_op(profile: StepProfile, plan: Plan, key: str) -> int:
    """The op at whose backward a tensor is first needed: its first reader, or, when a RECOMPUTE
    activation depends on it, that activation's region's first backward op (recompute runs there)
    if it comes first."""
    need = profile.by_key[key].first_read
    for other in profile.dependents.get(key, ()):
        if plan.decision.get(other.key) is Decision.RECOMPUTE:
            need = max(need, profile.region_last_op[profile.region_of(other)])
    return need


# ---- Schedule ----------------------------------------------------------------------------------
class Kind(str, Enum):
    FWD = "fwd"
    BWD = "bwd"
    RECOMPUTE = "recompute"
    COPY_OUT = "copy_out"
    COPY_IN = "copy_in"


STREAMS = ("compute", "d2h", "h2d")


@dataclass(frozen=True)
class Instr:
    """One instruction of one stream. `waits` are indices into Schedule.instrs that must be done."""

    stream: str
    kind: Kind
    name: str  # op key (FWD/BWD/RECOMPUTE) or activation key (copies)
    seconds: float = 0.0  # compute time; copies take bytes / link rate
    nbytes: int = 0  # bytes moved by a copy
    waits: tuple[int, ...] = ()
    alloc_start: tuple[str, ...] = ()  # activation keys resident from the instruction's start
    alloc_end: tuple[str, ...] = ()  # ... from its end
    free_end: tuple[str, ...] = ()  # released at its end


@dataclass(frozen=True)
class Schedule:
    """Per-stream instruction lists; `instrs` holds all of them, each stream's in its own order."""

    instrs: tuple[Instr, ...]
    act_bytes: Mapping[str, int]
    plan: Plan  # the plan it executes (its digest is computed only when asked for)

    def stream(self, name: str) -> list[int]:
        return [i for i, ins in enumerate(self.instrs) if ins.stream == name]


def lower(profile: StepProfile, plan: Plan) -> Schedule:
    """The Schedule that executes `plan` on `profile` (protocol in the module docstring)."""
    steps = _Lowering(profile, plan)
    fwd_id, copy_out_id = steps.forward()
    recompute_ops, completes_at = steps.recompute_work()
    copy_in_order, copy_in_id = steps.copy_in_ids(recompute_ops)
    bwd_id = steps.backward(recompute_ops, completes_at, copy_in_id)
    steps.copy_ins(copy_in_order, copy_out_id, fwd_id, bwd_id)
    return Schedule(tuple(steps.instrs), steps.sizes, plan)


class _Lowering:
    """`lower`'s steps, in the order they emit instructions: forward and copy-outs, then backward
    with its recomputes, then copy-ins. A wait names an instruction by its index, so the copy-ins'
    indices are worked out before backward, which waits on them, is emitted."""

    def __init__(self, profile: StepProfile, plan: Plan) -> None:
        self.profile, self.plan, self.decision = profile, plan, plan.decision
        self.instrs: list[Instr] = []
        self.swapped = [a for a in profile.activations if self.decision[a.key] is Decision.SWAP]
        self.op_index = {o.key: i for i, o in enumerate(profile.ops)}
        self.first_copy_in = -1  # set by copy_in_ids
        self.sizes = plan.stored_bytes(profile)
        self.packed = [profile.by_key[k] for k in plan.packed]
        for a in self.packed:
            self.sizes[a.key + UNPACKED] = a.bytes - a.packed_bytes  # (the packed bytes stay counted)

    def emit(self, ins: Instr) -> int:
        self.instrs.append(ins)
        return len(self.instrs) - 1

    def forward(self) -> tuple[list[int], dict[str, int]]:
        """FWD of every op, then the copy-outs. Returns (FWD index per op, COPY_OUT index per key)."""
        ops = self.profile.ops
        saved_at: dict[int, list[str]] = {}
        for a in self.profile.activations:
            if self.decision[a.key] is not Decision.RECOMPUTE:
                saved_at.setdefault(a.saved_at, []).append(a.key)
        out_order = sorted(self.swapped, key=lambda a: a.saved_at)
        copy_out_id = {a.key: len(ops) + j for j, a in enumerate(out_order)}
        # A blocking plan makes FWD(i) wait for the copy-outs of what op i-1 saved.
        fwd_waits: dict[int, list[int]] = {}
        if self.plan.blocking:
            for a in out_order:
                fwd_waits.setdefault(a.saved_at + 1, []).append(copy_out_id[a.key])
        packing = [0.0] * len(ops)
        for a in self.packed:
            packing[a.saved_at] += a.pack_s
        fwd_id = [
            self.emit(Instr("compute", Kind.FWD, o.key, o.fwd_s + packing[i], waits=tuple(fwd_waits.get(i, ())),
                            alloc_end=tuple(saved_at.get(i, ()))))
            for i, o in enumerate(ops)
        ]
        for a in out_order:
            self.emit(Instr("d2h", Kind.COPY_OUT, a.key, nbytes=self.sizes[a.key], waits=(fwd_id[a.saved_at],),
                            free_end=(a.key,)))
        return fwd_id, copy_out_id

    def recompute_work(self) -> tuple[dict[str, set[int]], dict[int, list[str]]]:
        """Per region, the ops its recompute re-runs: the producers of its RECOMPUTE activations and
        the ops the plan replays. Returns (those ops per region, the keys each op's recompute completes)."""
        profile = self.profile
        recompute_ops: dict[str, set[int]] = {}
        completes_at: dict[int, list[str]] = {}
        for a in profile.activations:
            if self.decision[a.key] is Decision.RECOMPUTE:
                recompute_ops.setdefault(profile.region_of(a), set()).update(a.producers)
                completes_at.setdefault(max(a.producers), []).append(a.key)
        for key in self.plan.replay:
            i = self.op_index[key]
            recompute_ops.setdefault(profile.ops[i].region, set()).add(i)
        return recompute_ops, completes_at

    def copy_in_ids(self, recompute_ops: dict[str, set[int]]) -> tuple[list[Activation], dict[str, int]]:
        """The copy-ins in the order backward needs them, and the index each will have: after every
        compute instruction (one BWD per op and one RECOMPUTE per re-run op)."""
        need = {a.key: need_op(self.profile, self.plan, a.key) for a in self.swapped}
        in_order = sorted(self.swapped, key=lambda a: (-need[a.key], a.saved_at, a.key))
        n_backward = len(self.profile.ops) + sum(len(s) for s in recompute_ops.values())
        self.first_copy_in = len(self.instrs) + n_backward
        return in_order, {a.key: self.first_copy_in + j for j, a in enumerate(in_order)}

    def backward(self, recompute_ops: dict[str, set[int]], completes_at: dict[int, list[str]],
                 copy_in_id: dict[str, int]) -> dict[int, int]:
        """BWD of every op in reverse, each region's recomputes before its first backward op; each
        waits for the copy-ins of the swapped tensors it reads. Returns the BWD index per op."""
        ops, decision = self.profile.ops, self.decision
        freed_after: dict[int, list[str]] = {}
        recompute_waits: dict[int, set[str]] = {}
        for a in self.profile.activations:
            freed_after.setdefault(a.freed_after, []).append(a.key)
            if decision[a.key] is Decision.RECOMPUTE:
                for d in a.deps:
                    if decision[d] is Decision.SWAP:
                        recompute_waits.setdefault(min(a.producers), set()).add(d)
        # a packed tensor is unpacked where it is first needed: at its first reader's BWD, or before
        # the first RECOMPUTE of a region whose replay reads it (keys "bwd"/"recompute", op index)
        unpacking: dict[tuple[str, int], list[Activation]] = {}
        for a in self.packed:
            need = need_op(self.profile, self.plan, a.key)
            unpacking.setdefault(("bwd", need) if need == a.first_read else ("recompute", need), []).append(a)
            freed_after[a.freed_after].append(a.key + UNPACKED)
        bwd_waits: dict[int, list[str]] = {}
        for a in self.swapped:
            bwd_waits.setdefault(a.first_read, []).append(a.key)

        last_op = self.profile.region_last_op
        bwd_id: dict[int, int] = {}
        for i in range(len(ops) - 1, -1, -1):
            region = ops[i].region
            if last_op[region] == i:
                unpacked = unpacking.get(("recompute", i), ())
                for j in sorted(recompute_ops.get(region, ())):
                    waits = tuple(sorted(copy_in_id[k] for k in recompute_waits.get(j, ())))
                    self.emit(Instr("compute", Kind.RECOMPUTE, ops[j].key, ops[j].fwd_s + sum(a.pack_s for a in unpacked),
                                    waits=waits, alloc_start=tuple(a.key + UNPACKED for a in unpacked),
                                    alloc_end=tuple(completes_at.get(j, ()))))
                    unpacked = ()
            waits = tuple(sorted(copy_in_id[k] for k in bwd_waits.get(i, ())))
            unpacked = unpacking.get(("bwd", i), ())
            bwd_id[i] = self.emit(Instr("compute", Kind.BWD, ops[i].key, ops[i].bwd_s + sum(a.pack_s for a in unpacked),
                                        waits=waits, alloc_start=tuple(a.key + UNPACKED for a in unpacked),
                                        free_end=tuple(freed_after.get(i, ()))))
        assert len(self.instrs) == self.first_copy_in, "compute instruction count mismatch"
        return bwd_id

    def copy_ins(self, in_order: list[Activation], copy_out_id: dict[str, int], fwd_id: list[int],
                 bwd_id: dict[int, int]) -> None:
        """Each copy-in waits for its own copy-out and for its trigger."""
        for a in in_order:
            trig = self.plan.trigger[a.key]
            trig_id = fwd_id[-1] if trig == END_OF_FORWARD else bwd_id[self.op_index[trig]]
            self.emit(Instr("h2d", Kind.COPY_IN, a.key, nbytes=self.sizes[a.key], waits=(copy_out_id[a.key], trig_id),
                            alloc_start=(a.key,)))


def retrigger(schedule: Schedule, profile: StepProfile, plan: Plan) -> Schedule:
    """`lower(profile, plan)` for a plan that differs from `schedule`'s only in its prefetch
    triggers: only the copy-ins' trigger waits change (planners try several trigger sets)."""
    if (plan.decisions, plan.blocking, plan.replay, plan.packed) != (schedule.plan.decisions, schedule.plan.blocking,
                                                                       schedule.plan.replay, schedule.plan.packed):
        raise PlanError("retrigger needs a plan with the same decisions as the schedule's")
    ids = {(ins.kind, ins.name): i for i, ins in enumerate(schedule.instrs) if ins.stream == "compute"}
    end_of_forward = ids[Kind.FWD, profile.ops[-1].key]
    instrs = list(schedule.instrs)
    for i, ins in enumerate(instrs):
        if ins.kind is Kind.COPY_IN:
            trig = plan.trigger[ins.name]
            waits = (ins.waits[0], end_of_forward if trig == END_OF_FORWARD else ids[Kind.BWD, trig])
            instrs[i] = dataclasses.replace(ins, waits=waits)
    return Schedule(tuple(instrs), schedule.act_bytes, plan)
