"""launch/train.py with the random planners registered (random_planners.py). Run through
tests/launch/in_turn.py like train.py itself."""

from in_turn import load_script
from random_planners import ROOT

main = load_script(ROOT / "launch" / "train.py").main
