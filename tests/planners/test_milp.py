"""The region model's MILP with PACK (planners/milp.py, `allow_pack`): a packable tensor may be kept
or swapped packed, which drops its bytes less its packed bytes, copies and pins its packed bytes, and
costs its two kernels; the MILP packs where that saves more than the kernels cost, and its plan is
checked by the simulator like any other."""

import pathlib
import sys

import pytest

from slackswap_ds.plan import Decision, lower
from slackswap_ds.planners.common import RegionModel
from slackswap_ds.planners.milp import _MilpModel, solve_region_milp
from slackswap_ds.planners.optimal import solve_optimal
from slackswap_ds.simulator import simulate

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from conftest import toy_hardware  # noqa: E402
from test_pack_choice import MASK, PACK_S, PACKED, SLOW_LINK, masked_layers  # noqa: E402


def test_the_milp_packs_where_packing_saves_recompute():
    """At 1700 B of keep-all's 3200 (no swap can hide on this link) the three fates must recompute dear
    tensors; packing masks (400 -> 52 B for 0.02 s) recomputes fewer: the optimum with PACK is faster."""
    p, hw = masked_layers(), toy_hardware(**SLOW_LINK)
    plain = solve_optimal(p, hw, 1700)
    packing = solve_optimal(p, hw, 1700, allow_pack=True)
    assert plain.plan.packed == () and packing.plan.packed
    assert packing.planned.result.step_s < plain.planned.result.step_s - 1
    for key in packing.plan.packed:
        assert p.by_key[key].packable and packing.plan.decision[key] is not Decision.RECOMPUTE
    assert simulate(lower(p, packing.plan), hw, budget_bytes=1700).peak_bytes <= 1700
    # its objective is recompute plus both kernels of every tensor it packs
    rerun = {o for a in p.activations if packing.decisions[a.key] is Decision.RECOMPUTE for o in a.producers}
    kernels = 2 * PACK_S * len(packing.plan.packed)  # (release keeps packed whatever it keeps again)
    assert packing.last.objective_s == pytest.approx(sum(p.ops[o].fwd_s for o in rerun) + kernels, rel=1e-6)


def test_nothing_is_packed_where_the_budget_needs_no_drop():
    p, hw = masked_layers(), toy_hardware(**SLOW_LINK)
    assert solve_optimal(p, hw, p.total_bytes, allow_pack=True).plan.packed == ()


def test_a_packed_plan_starts_a_solve():
    p, hw = masked_layers(), toy_hardware(**SLOW_LINK)
    best = solve_optimal(p, hw, 1700, allow_pack=True)
    again = solve_region_milp(RegionModel(p, hw), 1700, allow_swap=True, planner="optimal", allow_pack=True,
                              start=best.plan.decision, start_packed=best.plan.packed)
    assert again.last.objective_s <= best.last.objective_s * (1 + 1e-9)


def test_a_packed_swap_copies_and_pins_its_packed_bytes():
    p, hw = masked_layers(2), toy_hardware()
    model = RegionModel(p, hw)
    milp = _MilpModel(model, allow_swap=True, allow_pack=True)
    milp.decision_variables()
    key = "layers.0:m"
    s, sp, kp = (milp.column(kind, key) for kind in ("s", "sp", "kp"))
    assert None not in (s, sp, kp) and milp.column("sp", "layers.0:y") is None  # (y is not packable)
    milp.choice_rows()
    milp.d2h_queue_rows()
    entries = {}
    for row, col, val in zip(milp.rows, milp.cols, milp.vals):
        entries.setdefault(col, []).append(val)
    unit = milp.second_unit
    assert -model.copy_s(MASK, model.d2h_bps) / unit in entries[s]
    assert -model.copy_s(PACKED, model.d2h_bps) / unit in entries[sp]
    assert 1 in entries[kp] and len(entries[kp]) == 1  # kp is in its activation's choice row alone
