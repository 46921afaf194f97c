"""Planners `"random-1"` .. `"random-3"`, registered on import: seeded random keep / swap /
recompute decisions for every saved tensor (tests/runtime/exactness.random_plan, the seed in the
name), their budget the keep-all peak: for exactness checks of any plan under DeepSpeed
(tests/test_zero_plans.py, through train_random.py and hf_padding_random.py)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))

from exactness import random_plan  # noqa: E402

from slackswap_ds import planners  # noqa: E402
from slackswap_ds.planners.common import simulated  # noqa: E402
from slackswap_ds.shares import PRIVATE  # noqa: E402


def plan_random(seed, profile, hw, budget_bytes, share=PRIVATE, holds=1):
    return simulated(profile, random_plan(profile, seed), hw, share, holds)


for _seed in (1, 2, 3):
    planners.PLANNERS[f"random-{_seed}"] = functools.partial(plan_random, _seed)

