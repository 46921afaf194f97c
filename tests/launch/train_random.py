"""launch/train.py with planners `"random-1"` .. `"random-3"` registered: seeded random keep / swap /
recompute decisions for every saved tensor (tests/runtime/exactness.random_plan, the seed in the
name), their budget the keep-all peak: for exactness checks of any plan under DeepSpeed
(tests/test_zero_plans.py). Run through tests/launch/in_turn.py like train.py itself."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))

from exactness import random_plan  # noqa: E402

from slackswap_ds import planners  # noqa: E402
from slackswap_ds.planners.common import PRIVATE, simulated  # noqa: E402


def plan_random(seed, profile, hw, budget_bytes, share=PRIVATE, holds=1):
    return simulated(profile, random_plan(profile, seed), hw, share, holds)


for _seed in (1, 2, 3):
    planners.PLANNERS[f"random-{_seed}"] = functools.partial(plan_random, _seed)
_spec = importlib.util.spec_from_file_location("train", ROOT / "launch" / "train.py")
train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train)


def main(argv=None) -> int:
    return train.main(argv)
