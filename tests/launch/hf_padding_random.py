"""tests/adoption/hf_padding.py (HF Trainer, every rank on its own lengths) with the random planners
registered (random_planners.py). Run through tests/launch/in_turn.py."""

from in_turn import load_script
from random_planners import ROOT

main = load_script(ROOT / "tests" / "adoption" / "hf_padding.py").main
