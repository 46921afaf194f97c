"""The optimum of the region model with swap and recompute (Checkmate-style MILP with swap added),
solved exactly by HiGHS; an upper bound for any planner that plans within the same model."""

from __future__ import annotations

from ..hardware import Hardware
from ..shares import PRIVATE, Share
from ..step_profile import StepProfile
from .common import Planned, RegionModel
from .milp import MilpOptions, MilpResult, solve_region_milp


def solve_optimal(profile: StepProfile, hw: Hardware, budget_bytes: int, share: Share = PRIVATE,
                  options: MilpOptions = MilpOptions(), holds: int = 1, allow_pack: bool = False,
                  replays_at_first_read: bool = False) -> MilpResult:
    """The optimal plan with its solves (incumbent, proven bound, gap); with `allow_pack`, PACK too
    (the `optimal` planner plans without it, as the tables that compare it with the anchors say);
    with `replays_at_first_read`, the what-if of RegionModel's flag (its plan's simulated step is
    not that model's: read the solves' objective)."""
    return solve_region_milp(RegionModel(profile, hw, share, holds, replays_at_first_read), budget_bytes,
                             allow_swap=True, planner="optimal", options=options, allow_pack=allow_pack)


def plan_optimal(profile: StepProfile, hw: Hardware, budget_bytes: int, share: Share = PRIVATE,
                 holds: int = 1) -> Planned:
    return solve_optimal(profile, hw, budget_bytes, share, holds=holds).planned
