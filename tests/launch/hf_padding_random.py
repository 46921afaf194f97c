"""tests/adoption/hf_padding.py (HF Trainer, every rank on its own lengths) with the random planners
registered (random_planners.py). Run through tests/launch/in_turn.py."""

from random_planners import ROOT, script

main = script(ROOT / "tests" / "adoption" / "hf_padding.py").main
