"""launch/train.py with the random planners registered (random_planners.py). Run through
tests/launch/in_turn.py like train.py itself."""

from random_planners import ROOT, script

main = script(ROOT / "launch" / "train.py").main
