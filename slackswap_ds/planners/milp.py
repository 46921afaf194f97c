"""MILP over the region model (see common.py), solved with HiGHS through scipy.optimize.milp.

Variables, all binary: s[a] (swap a), r[a] (recompute a), u[o] (producer op o re-runs).
    minimise   sum_o u[o] * fwd_s(o)                                  (recompute time)
    s[a] + r[a] <= 1;  u[o] >= r[a] for o in producers(a)
    M(r) = kept(<r) + bytes(r) + swapped(r-1) <= budget              for every region r
    sum_{a in r} s[a] * copy_d2h(a) <= fwd_s(r)                      (D2H hidden under r's forward)
    sum_{a in r} s[a] * copy_h2d(a) <= bwd_s(r+1) + recompute(r+1)   (H2D hidden under the next
                                                                      region's backward)
    sum_a s[a] * bytes(a) <= host pool
Every swap is hidden by construction, so the objective is the model's whole overhead. After the
solve, the plan is simulated; if the simulator's peak overshoots (transients the model does not
see), the model budget is lowered by the overshoot and the MILP solved again.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from ..errors import BudgetInfeasibleError
from ..plan import Decision, Plan, lower
from ..simulator import simulate
from .common import RegionModel, alap_triggers

MAX_REPAIRS = 8


def solve_region_milp(model: RegionModel, budget_bytes: int, *, allow_swap: bool, planner: str,
                      time_limit_s: float = 60.0) -> Plan:
    profile, hw = model.profile, model.hw
    target = budget_bytes
    for _ in range(MAX_REPAIRS):
        dec = _solve(model, target, allow_swap, time_limit_s, planner)
        triggers = alap_triggers(profile, dec, hw, model.share)
        plan = Plan.build(profile, dec, budget_bytes=budget_bytes, hardware_digest=hw.digest, planner=planner,
                          prefetch=triggers)
        res = simulate(lower(profile, plan), hw, budget_bytes=budget_bytes, record=False)
        if res.feasible:
            return plan
        target -= res.peak_bytes - budget_bytes
    raise BudgetInfeasibleError(f"{planner}: no plan within {budget_bytes:,} B after {MAX_REPAIRS} repairs")


def _solve(model: RegionModel, budget: int, allow_swap: bool, time_limit_s: float, planner: str) -> dict:
    profile = model.profile
    acts = profile.activations
    nreg = len(model.regions)
    col: dict[tuple[str, object], int] = {}

    def var(kind: str, key: object) -> int:
        return col.setdefault((kind, key), len(col))

    region = [model.region_of[a.key] for a in acts]
    # the last region to run forward has no copy window before its backward needs it
    swappable = [allow_swap and region[i] < nreg - 1 for i in range(len(acts))]
    for i, a in enumerate(acts):
        if swappable[i]:
            var("s", a.key)
        if a.recomputable:
            var("r", a.key)
            for p in a.producers:
                var("u", p)
    n = len(col)
    cost = np.zeros(n)
    for (kind, key), j in col.items():
        if kind == "u":
            cost[j] = profile.ops[key].fwd_s

    rows, cols, vals, lo, hi = [], [], [], [], []
    row = 0

    def add(coefs: dict[int, float], lower: float, upper: float) -> None:
        nonlocal row
        for j, v in coefs.items():
            rows.append(row)
            cols.append(j)
            vals.append(v)
        lo.append(lower)
        hi.append(upper)
        row += 1

    for i, a in enumerate(acts):
        if swappable[i] and a.recomputable:
            add({col["s", a.key]: 1, col["r", a.key]: 1}, -np.inf, 1)
        if a.recomputable:
            for p in a.producers:
                add({col["u", p]: 1, col["r", a.key]: -1}, 0, np.inf)

    # M(r) <= budget:  -sum_{a<r} b (s+r) + sum_{a in r-1} b s <= budget - kept0(<r) - bytes(r)
    by_region: list[list[int]] = [[] for _ in range(nreg)]
    for i in range(len(acts)):
        by_region[region[i]].append(i)
    below = 0
    for r in range(nreg):
        coefs: dict[int, float] = {}
        for i in (i for rr in range(r) for i in by_region[rr]):
            a = acts[i]
            for kind in ("s", "r"):
                if (kind, a.key) in col:
                    coefs[col[kind, a.key]] = coefs.get(col[kind, a.key], 0.0) - a.bytes
        if r:
            for i in by_region[r - 1]:
                if ("s", acts[i].key) in col:
                    j = col["s", acts[i].key]
                    coefs[j] = coefs.get(j, 0.0) + acts[i].bytes
        add(coefs, -np.inf, budget - below - model.bytes[r])
        below += model.bytes[r]

    if allow_swap:
        pool = 0
        for r in range(nreg - 1):
            out = {col["s", acts[i].key]: model.copy_s(acts[i].bytes, model.d2h_bps)
                   for i in by_region[r] if ("s", acts[i].key) in col}
            if out:
                add(out, -np.inf, model.fwd_s[r])
                back = {col["s", acts[i].key]: model.copy_s(acts[i].bytes, model.h2d_bps)
                        for i in by_region[r] if ("s", acts[i].key) in col}
                for (kind, key), j in col.items():
                    if kind == "u" and model.index[profile.ops[key].region] == r + 1:
                        back[j] = back.get(j, 0.0) - profile.ops[key].fwd_s
                add(back, -np.inf, model.bwd_s[r + 1])
        if model.share.host_pool_bytes is not None:
            pool = {col["s", a.key]: a.bytes for a in acts if ("s", a.key) in col}
            if pool:
                add(pool, -np.inf, model.share.host_pool_bytes)

    A = coo_matrix((vals, (rows, cols)), shape=(row, n)).tocsr()
    res = milp(cost, constraints=LinearConstraint(A, lo, hi), integrality=np.ones(n), bounds=Bounds(0, 1),
               options={"time_limit": time_limit_s, "disp": False})
    if res.x is None:
        raise BudgetInfeasibleError(
            f"{planner}: no plan can keep the estimated peak within {budget:,} B ({res.message})"
        )
    x = np.round(res.x).astype(int)
    dec = {}
    for a in acts:
        if ("s", a.key) in col and x[col["s", a.key]]:
            dec[a.key] = Decision.SWAP
        elif ("r", a.key) in col and x[col["r", a.key]]:
            dec[a.key] = Decision.RECOMPUTE
        else:
            dec[a.key] = Decision.KEEP
    return dec
