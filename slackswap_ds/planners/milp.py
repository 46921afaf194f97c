"""MILP over the region model (see common.py), solved with HiGHS (highspy, the HiGHS team's binding).

Variables, all binary: s[a] (swap a), r[a] (recompute a), u[o] (producer op o re-runs).
    minimise   sum_o u[o] * fwd_s(o)                                  (recompute time)
    s[a] + r[a] <= 1;  u[o] >= r[a] for o in producers(a)
    M(r) = kept(<r) + bytes(r) + swapped(r-1)
           + (holds-1) * kept(all) <= budget                           for every region r
    sum_{a saved at op >= k} s[a] * copy_d2h(a) <= fwd_s(ops > k)   for every op k (the D2H queue
                                                                      drains before forward ends)
    sum_{a in r} s[a] * copy_h2d(a) <= bwd_s(r+1) + recompute(r+1)   (H2D hidden under the next
                                                                      region's backward)
    sum_a s[a] * bytes(a) <= host pool
With PACK (`allow_pack`), a packable a also has sp[a] (swap it packed) and kp[a] (keep it packed):
    s + r + sp + kp <= 1; kp drops (bytes - packed_bytes) from kept(<r); sp drops bytes and copies,
    prefetches and pins packed_bytes; either stores packed_bytes in bytes(r) (unpacked at its first
    read, in the simulator); each costs its two kernels, 2 * pack_s, in the objective.
Every swap is hidden by construction, so the objective is the model's whole overhead. Swaps the
peak does not need (free in the objective) are kept again (`common.release`). After the solve, the
plan is simulated; if the simulator's peak overshoots (transients the model does not see), the
model budget is lowered by the overshoot and the MILP solved again (`common.repair`).

A solve may start from a plan (`start`: the greedy planner's, in the default planner): HiGHS takes
its decisions as the first incumbent, so a solve stopped by its time limit is never worse than it,
and the branch and bound prunes against it from the root on (scipy's `milp` takes no start). A solve
may tie the variables of identical layers (`ties`, planners/ties.py): the same MILP restricted, much
faster to search.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import numpy as np

from ..errors import BudgetInfeasibleError
from ..plan import Decision, Plan
from ..step_profile import Activation, StepProfile
from .common import Planned, RegionModel, release, repair
from .solver_output import solver_output_dropped
from .ties import NO_TIES, Ties

ACT_KINDS = ("s", "r", "sp", "kp")  # an activation's variables: swap, recompute, swap packed, keep packed
SWAP_KINDS = ("s", "sp")  # those that copy it to the host
PACK_KINDS = ("sp", "kp")  # those that pack it


class OutOfTime(Exception):
    """The search's time ran out before HiGHS found any plan (not a proof that none exists)."""


@dataclass(frozen=True)
class MilpOptions:
    """How long HiGHS may search and how close to optimal it must prove its incumbent."""

    time_limit_s: float = 20.0
    mip_rel_gap: float = 5e-3  # of recompute time: < 1e-4 of a step, far below what the tables show
    # HiGHS also stops once its plan is proven within this many seconds of recompute of the optimum
    # (0: no such stop): 1% of 1 ms of recompute in a 100 ms step is not worth proving away
    mip_abs_gap_s: float = 0.0
    more: tuple[tuple[str, object], ...] = ()  # further HiGHS options by name, e.g. (("mip_max_improving_sols", 1),)


@dataclass(frozen=True)
class MilpSolve:
    """One solve: the incumbent's recompute seconds, HiGHS's proven lower bound on them (the solve
    stops at the time limit, so the bound shows how far from optimal the incumbent can be), and the
    model budget it was solved for (lower than the plan's when the simulator made it repair)."""

    objective_s: float
    bound_s: float
    model_budget_bytes: int
    message: str
    stopped_early: bool = False  # at its time limit: the incumbent is not proven within mip_rel_gap

    @property
    def gap(self) -> float:
        """Relative gap (incumbent - bound) / incumbent; 0 when both are 0, nan without an incumbent."""
        if math.isnan(self.objective_s) or math.isnan(self.bound_s):
            return math.nan
        return (self.objective_s - self.bound_s) / self.objective_s if self.objective_s > 0 else 0.0


@dataclass(frozen=True)
class MilpResult:
    planned: Planned
    solves: tuple[MilpSolve, ...]  # in order; the last one made the plan
    decisions: Mapping[str, Decision] = field(default_factory=dict)  # the last solve's, before `release`

    @property
    def plan(self) -> Plan:
        return self.planned.plan

    @property
    def last(self) -> MilpSolve:
        return self.solves[-1]


def solve_region_milp(model: RegionModel, budget_bytes: int, *, allow_swap: bool, planner: str,
                      options: MilpOptions = MilpOptions(), deadline: float | None = None,
                      version: str = "1", start: Mapping[str, Decision] | None = None,
                      ties: Ties = NO_TIES, allow_pack: bool = False, start_packed: tuple[str, ...] = ()) -> MilpResult:
    """The MILP's plan (through the repair loop every planner shares) and every solve it took.
    `deadline` (a `time.perf_counter()` value): every solve stops by then, taking HiGHS's best plan
    so far; OutOfTime if a solve has none (or the time is gone before a repair's solve starts).
    `start`: a plan's decisions every solve begins from (ignored by HiGHS where they break a row), and
    `start_packed` the tensors it packs.
    `ties` (planners/ties.py): variables the solves share, a restriction of the MILP. `allow_pack`:
    the profile's packable tensors may also be kept or swapped packed (PACK, planners/packing.py)."""
    solves: list[MilpSolve] = []
    raw: list[dict[str, Decision]] = []

    def decide(target: int) -> tuple[dict[str, Decision], tuple[str, ...]]:
        limited = options
        if deadline is not None:
            left = deadline - time.perf_counter()
            if left <= 0:
                raise OutOfTime(f"{planner}: no time left for a solve")
            limited = replace(options, time_limit_s=min(options.time_limit_s, left))
        dec, packed, solve = _solve(model, target, allow_swap, limited, planner, start, ties, allow_pack, start_packed)
        solves.append(solve)
        raw.append(dec)
        released = release(model, dec, target, packed)
        return released, tuple(k for k in packed if released[k] is not Decision.RECOMPUTE)

    planned = repair(model.profile, model.hw, budget_bytes, model.share, planner, decide, version=version,
                     holds=model.holds)
    return MilpResult(planned, tuple(solves), MappingProxyType(raw[-1]))


def _solve(model: RegionModel, budget: int, allow_swap: bool, options: MilpOptions, planner: str,
           start: Mapping[str, Decision] | None, ties: Ties = NO_TIES,
           allow_pack: bool = False, start_packed: tuple[str, ...] = ()
           ) -> tuple[dict[str, Decision], tuple[str, ...], MilpSolve]:
    # The families are added in this order on purpose: columns and rows reach HiGHS in the order
    # they are created, and a different order may tie-break to a different optimum.
    milp_model = _MilpModel(model, allow_swap, ties, allow_pack)
    milp_model.decision_variables()
    milp_model.choice_rows()
    milp_model.memory_rows(budget)
    if allow_swap:
        milp_model.d2h_queue_rows()
        milp_model.h2d_rows()
        milp_model.host_pool_row()
    found = milp_model.solve(options, start, start_packed)
    unit = milp_model.second_unit
    solve = MilpSolve(found.objective * unit if found.x is not None else math.nan, found.bound * unit, budget,
                      found.status, found.time_limit)
    if found.x is None and found.time_limit:
        raise OutOfTime(f"{planner}: HiGHS found no plan within {options.time_limit_s:.2f} s")
    if found.x is None:
        raise BudgetInfeasibleError(
            f"{planner}: no plan can keep the estimated peak within {budget:,} B ({found.status})"
        )
    return (*milp_model.decode(found.x), solve)


def _made_at_first_read(profile: StepProfile, region: str, a: Activation) -> bool:
    """Whether a replay could make `a` at its first read in backward: made and read in `region`, and
    everything its replay reads still held then (or made again in the region)."""
    ops = profile.ops
    return (ops[a.first_read].region == region and all(ops[i].region == region for i in a.producers)
            and all(dep.freed_after <= a.first_read and not (dep.recomputable and profile.region_of(dep) != region)
                    for dep in (profile.by_key[d] for d in a.deps)))


@dataclass(frozen=True)
class _Found:
    """What HiGHS returned: its incumbent (None without one), its objective and proven bound (in
    the model's units), its model status in words, whether its time limit stopped it."""

    x: np.ndarray | None
    objective: float
    bound: float
    status: str
    time_limit: bool


class _MilpModel:
    """The MILP of one solve (the formulation in the module docstring), one constraint family per
    method, as a sparse matrix in coordinate form. With `ties` (planners/ties.py), the activations
    and ops it ties share their columns: a restriction of the same MILP (every plan it finds is one
    of the full MILP's), with as many binaries as it has tie groups."""

    def __init__(self, model: RegionModel, allow_swap: bool, ties: Ties = NO_TIES, allow_pack: bool = False) -> None:
        self.model, self.profile, self.ties, self.allow_pack = model, model.profile, ties, allow_pack
        self.acts = model.profile.activations
        self.nreg = len(model.regions)
        self.col: dict[tuple[str, object], int] = {}  # (kind, key) -> column
        self.n_binary = 0
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.region = [model.region_of[a.key] for a in self.acts]
        # the last region to run forward has no copy window before its backward needs it
        self.swappable = [allow_swap and self.region[i] < self.nreg - 1 for i in range(len(self.acts))]
        self.by_region: list[list[int]] = [[] for _ in range(self.nreg)]
        for i in range(len(self.acts)):
            self.by_region[self.region[i]].append(i)
        # Rows in bytes (up to 1e11) beside costs in seconds (down to 1e-5) are badly scaled for
        # HiGHS's tolerances: it stalls at the root node. Bytes are counted in units of the largest
        # tensor and seconds in units of the longest op, so every coefficient is at most 1.
        self.byte_unit = float(max((a.bytes for a in self.acts), default=1) or 1)
        self.second_unit = max((o.fwd_s for o in self.profile.ops), default=1.0) or 1.0

    def _tied(self, kind: str, key: object) -> tuple[str, object]:
        if kind in ACT_KINDS:
            return kind, self.ties.acts.get(key, key)
        if kind == "u":
            return kind, self.ties.ops.get(key, key)
        return kind, key

    def var(self, kind: str, key: object) -> int:
        return self.col.setdefault(self._tied(kind, key), len(self.col))

    def column(self, kind: str, key: object) -> int | None:
        """The column of variable `kind` of activation (s, r) or op (u) `key`, None if it has none."""
        return self.col.get(self._tied(kind, key))

    def add(self, coefs: dict[int, float], lower: float, upper: float) -> None:
        row = len(self.lo)
        for j, v in coefs.items():
            self.rows.append(row)
            self.cols.append(j)
            self.vals.append(v)
        self.lo.append(lower)
        self.hi.append(upper)

    def terms(self, r: int, weights: Mapping[str, Callable[[Activation], float]]) -> dict[int, float]:
        """{column: weight(activation)} over region r's activations' variables of each kind in `weights`."""
        out: dict[int, float] = {}
        for i in self.by_region[r]:
            for kind, weight in weights.items():
                j = self.column(kind, self.acts[i].key)
                if j is not None:
                    out[j] = out.get(j, 0.0) + weight(self.acts[i])
        return out

    def kept_change(self) -> dict[str, Callable[[Activation], float]]:
        """What each kind of variable adds to its region's kept bytes, in byte units: minus what it drops."""
        unit = self.byte_unit
        whole = lambda a: -a.bytes / unit  # noqa: E731
        return {"s": whole, "r": whole, "sp": whole, "kp": lambda a: -(a.bytes - a.packed_bytes) / unit}

    def stored(self, a: Activation, kind: str) -> int:
        """The bytes a swap of kind `kind` ("s" or "sp", packed) copies and pins."""
        return a.packed_bytes if kind == "sp" else a.bytes

    def decision_variables(self) -> None:
        """The binaries: s[a] (swap), r[a] (recompute), u[o] (producer op o re-runs); with PACK, for a
        packable a: sp[a] (swap packed), kp[a] (keep packed)."""
        for i, a in enumerate(self.acts):
            if self.swappable[i]:
                self.var("s", a.key)
            if self.allow_pack and a.packable:
                if self.swappable[i]:
                    self.var("sp", a.key)
                self.var("kp", a.key)
            if a.recomputable:
                self.var("r", a.key)
                for p in a.producers:
                    self.var("u", p)
        self.n_binary = len(self.col)

    def choice_rows(self) -> None:
        """s[a] + r[a] (+ sp[a] + kp[a]) <= 1; u[o] >= r[a] for o in producers(a)."""
        seen = set()  # (tied activations share their rows too)
        for a in self.acts:
            fates = [j for j in (self.column(kind, a.key) for kind in ACT_KINDS) if j is not None]
            r = self.column("r", a.key)
            if len(fates) > 1 and tuple(fates) not in seen:
                seen.add(tuple(fates))
                self.add(dict.fromkeys(fates, 1), -np.inf, 1)
            if a.recomputable:
                for p in a.producers:
                    u = self.column("u", p)
                    if ("ur", u, r) not in seen:
                        seen.add(("ur", u, r))
                        self.add({u: 1, r: -1}, 0, np.inf)

    def memory_rows(self, budget: int) -> None:
        """M(r) <= budget for every region r.

        Sparse form (dense prefix sums make HiGHS slow): continuous D[r] = bytes dropped in regions < r.
          D[r] = D[r-1] + dropped(r-1);  kept0(<r) - D[r] + bytes(r) + swapped(r-1) <= budget
        (in units of the largest tensor, `byte_unit`)"""
        model, nreg, unit = self.model, self.nreg, self.byte_unit
        D = [self.var("D", r) for r in range(nreg)]
        # Micro-batches in flight (holds > 1) keep their kept bytes: (holds-1) * (total - all dropped),
        # with all dropped = D[nreg-1] + dropped in the last region.
        held = model.holds - 1
        change = self.kept_change()
        prefetched = {kind: lambda a, kind=kind: self.stored(a, kind) / unit for kind in SWAP_KINDS}
        # region r's own packed tensors are still packed as its backward starts (each is unpacked at
        # its first read, the simulator's transient; planners/packing.py's view counts them so too)
        still_packed = dict.fromkeys(PACK_KINDS, change["kp"])
        if held:
            everything = self.var("D", nreg)
            row_ = {everything: 1.0, D[nreg - 1]: -1.0}
            row_.update(self.terms(nreg - 1, change))
            self.add(row_, 0, 0)
        total = sum(model.bytes)
        below = 0
        for r in range(nreg):
            if r:
                row_ = {D[r]: 1.0, D[r - 1]: -1.0}
                row_.update(self.terms(r - 1, change))
                self.add(row_, 0, 0)
                mem = {D[r]: -1.0, **self.terms(r - 1, prefetched)}
            else:
                self.add({D[0]: 1.0}, 0, 0)
                mem = {D[0]: -1.0}
            if held:
                mem[everything] = mem.get(everything, 0.0) - held
            if model.replays_at_first_read:
                self.rows_at_first_reads(r, mem, (budget - below - held * total) / unit)
            else:
                for j, v in self.terms(r, still_packed).items():
                    mem[j] = mem.get(j, 0.0) + v
                self.add(mem, -np.inf, (budget - below - model.bytes[r] - held * total) / unit)
            below += model.bytes[r]

    def rows_at_first_reads(self, r: int, mem: dict[int, float], room: float) -> None:
        """`RegionModel.replays_at_first_read`: region r's memory at its backward's start and at each
        first read of a tensor a replay could make there (made and read in r, everything it reads still
        held then): r's tensors not freed yet (`room` less them, in byte units), less the recomputed ones
        not made again yet, packed ones not read yet packed."""
        unit, acts, still_packed = self.byte_unit, [self.acts[i] for i in self.by_region[r]], self.kept_change()["kp"]
        made_late = [a for a in acts if self.column("r", a.key) is not None
                     and _made_at_first_read(self.profile, self.model.regions[r], a)]
        start = max((a.first_read for a in acts), default=0)
        for at in sorted({start} | {a.first_read for a in made_late}):
            row_ = dict(mem)
            for b in acts:  # (as backward enters r all its packed tensors are still packed, as in the plain rows)
                for kind in PACK_KINDS if b.first_read < at or at == start else ():
                    j = self.column(kind, b.key)
                    if j is not None:
                        row_[j] = row_.get(j, 0.0) + still_packed(b)
            for b in made_late:
                if b.first_read < at:
                    j = self.column("r", b.key)
                    row_[j] = row_.get(j, 0.0) - b.bytes / unit
            self.add(row_, -np.inf, room - sum(b.bytes for b in acts if b.freed_after <= at) / unit)

    def d2h_queue_rows(self) -> None:
        """The D2H queue drains before forward ends, at op granularity: a tensor saved by op i is
        released at the start of op i+1. Backlog Q[b] >= Q[b-1] + released(b) - fwd(op b), Q >= 0,
        Q[n] = 0; equivalent to "for every k, copies released from op k on fit under ops k..".
        """
        model, profile = self.model, self.profile
        nops = len(profile.ops)
        released: list[dict[int, float]] = [{} for _ in range(nops + 1)]
        for a in self.acts:
            for kind in SWAP_KINDS:
                j = self.column(kind, a.key)
                if j is not None:
                    out = released[a.saved_at + 1]
                    out[j] = out.get(j, 0.0) - model.copy_s(self.stored(a, kind), model.d2h_bps) / self.second_unit
        Q = [self.var("Q", b) for b in range(nops + 1)]
        for b in range(nops + 1):
            window = profile.ops[b].fwd_s / self.second_unit if b < nops else 0.0
            row_ = {Q[b]: 1.0, **released[b]}
            if b:
                row_[Q[b - 1]] = -1.0
            self.add(row_, -window, np.inf)
        self.add({Q[-1]: 1.0}, -np.inf, 0)

    def h2d_rows(self) -> None:
        """Region r's copy-ins are hidden under region r+1's backward and recompute."""
        model, profile, unit = self.model, self.profile, self.second_unit
        for r in range(self.nreg - 1):
            back = self.terms(r, {kind: lambda a, kind=kind: model.copy_s(self.stored(a, kind), model.h2d_bps) / unit
                                  for kind in SWAP_KINDS})
            if back:
                for o in model.ops[r + 1]:
                    j = self.column("u", o)
                    if j is not None:
                        back[j] = back.get(j, 0.0) - profile.ops[o].fwd_s / unit
                self.add(back, -np.inf, model.bwd_s[r + 1] / unit)

    def host_pool_row(self) -> None:
        """Swapped bytes fit the host pool; each micro-batch in flight pins its own."""
        model = self.model
        if model.share.host_pool_bytes is not None:
            unit = self.byte_unit
            pool: dict[int, float] = {}
            for a in self.acts:
                for kind in SWAP_KINDS:
                    j = self.column(kind, a.key)
                    if j is not None:
                        pool[j] = pool.get(j, 0.0) + self.stored(a, kind) / unit
            if pool:
                self.add(pool, -np.inf, model.share.host_pool_bytes // model.holds / unit)

    def solve(self, options: MilpOptions, start: Mapping[str, Decision] | None = None,
              start_packed: tuple[str, ...] = ()) -> _Found:
        """HiGHS on the model: minimise the recompute time of the re-run ops (binaries integral in
        [0, 1], continuous variables in [0, inf)), from `start`'s decisions where given."""
        import highspy  # here: a process that never solves a MILP does not pay its import

        n, n_binary, inf = len(self.col), self.n_binary, highspy.kHighsInf
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = n, len(self.lo)
        cost = np.zeros(n)
        for o, op in enumerate(self.profile.ops):
            j = self.column("u", o)
            if j is not None:
                cost[j] += op.fwd_s / self.second_unit
        for a in self.acts:  # a packed tensor's two kernels (packing after its save, unpacking before its read)
            for kind in PACK_KINDS:
                j = self.column(kind, a.key)
                if j is not None:
                    cost[j] += 2 * a.pack_s / self.second_unit
        lp.col_cost_ = cost
        lp.col_lower_ = np.zeros(n)
        lp.col_upper_ = np.r_[np.ones(n_binary), np.full(n - n_binary, inf)]
        lp.row_lower_ = np.maximum(np.asarray(self.lo, dtype=float), -inf)
        lp.row_upper_ = np.minimum(np.asarray(self.hi, dtype=float), inf)
        # rows are added in order and each names a column once: the entries are already row-wise
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = np.searchsorted(self.rows, np.arange(len(self.lo) + 1)).astype(np.int32)
        lp.a_matrix_.index_ = np.asarray(self.cols, dtype=np.int32)
        lp.a_matrix_.value_ = np.asarray(self.vals, dtype=float)
        lp.integrality_ = [highspy.HighsVarType.kInteger] * n_binary + [highspy.HighsVarType.kContinuous] * (n - n_binary)
        with solver_output_dropped():
            h = highspy.Highs()
            settings = {"output_flag": False, "threads": 1, "time_limit": float(options.time_limit_s),
                        "mip_rel_gap": float(options.mip_rel_gap)}
            if options.mip_abs_gap_s > 0:  # else HiGHS's own default
                settings["mip_abs_gap"] = float(options.mip_abs_gap_s / self.second_unit)
            for option, value in (*settings.items(), *options.more):
                if h.setOptionValue(option, value) != highspy.HighsStatus.kOk:
                    raise ValueError(f"HiGHS refused its option {option}={value!r}")
            h.passModel(lp)
            if start is not None:  # the binaries only: HiGHS solves for the continuous rest
                h.setSolution(n_binary, np.arange(n_binary, dtype=np.int32), self.binaries(start, start_packed))
            h.run()
        info, status = h.getInfo(), h.getModelStatus()
        has_plan = info.primal_solution_status == 2  # kSolutionStatusFeasible
        return _Found(np.asarray(h.getSolution().col_value) if has_plan else None,
                      float(info.objective_function_value), float(info.mip_dual_bound),
                      h.modelStatusToString(status), status == highspy.HighsModelStatus.kTimeLimit)

    def binaries(self, decisions: Mapping[str, Decision], packed: tuple[str, ...] = ()) -> np.ndarray:
        """The binary columns' values for a plan's decisions and the tensors it packs (a fate the model
        cannot take is 0; with ties, the plan's tied layers must decide alike: each group's first says)."""
        x = np.zeros(self.n_binary)
        packed = set(packed)
        for a in self.acts:
            if a.key in self.ties.acts:
                continue  # (a tied activation's columns are its representative's: that one says)
            fate = decisions.get(a.key, Decision.KEEP)
            s, r = self.column("s", a.key), self.column("r", a.key)
            if a.key in packed and fate is not Decision.RECOMPUTE:
                j = self.column("sp" if fate is Decision.SWAP else "kp", a.key)
                if j is not None:
                    x[j] = 1
            elif fate is Decision.SWAP and s is not None:
                x[s] = 1
            elif fate is Decision.RECOMPUTE and r is not None:
                x[r] = 1
                for p in a.producers:
                    x[self.column("u", p)] = 1
        return x

    def decode(self, solution) -> tuple[dict[str, Decision], tuple[str, ...]]:
        """The decisions of HiGHS's solution, and the tensors it packs (kept or swapped packed)."""
        x = np.round(solution).astype(int)
        dec, packed = {}, []
        for a in self.acts:
            fate = next((kind for kind in ACT_KINDS if (j := self.column(kind, a.key)) is not None and x[j]), None)
            dec[a.key] = {"s": Decision.SWAP, "sp": Decision.SWAP, "r": Decision.RECOMPUTE}.get(fate, Decision.KEEP)
            if fate in PACK_KINDS:
                packed.append(a.key)
        return dec, tuple(packed)
