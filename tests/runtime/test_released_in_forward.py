"""Saved tensors that autograd lets go of in forward (issue 19): a router that keeps only the
indices of a `topk` (its node, and the indices it saved, die at once; `gather` saves the same
storage again) and masks its scores (`masked_fill`'s node, and the mask it saved, die when the
layer returns), as DeepSeek-V3's router does. The profiler's tracer keeps every node alive, so the
profile has one activation per storage, each held until backward; a plan's step must name, hold
and replay them the same way: exact, no fallback, no op re-run that the Schedule did not list,
within the budget, never a crash in a layer call's bookkeeping."""

import pytest
import torch
from torch import nn

import slackswap_ds as ss

from exactness import assert_exact, assert_peak_as_predicted, loss_step, measured, random_plan, run

DIM, EXPERTS, TOP = 16, 4, 2


class Routed(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS)
        self.up = nn.Linear(DIM, DIM)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        scores = self.gate(x).sigmoid()
        masked = scores.masked_fill(~(scores > 0.25), float("-inf"))  # its node dies when the layer returns
        idx = torch.topk(masked, k=TOP, dim=-1, sorted=False)[1]  # its node dies at once
        weights = scores.gather(-1, idx)  # saves the indices' storage again
        return x + self.drop(torch.tanh(self.up(x))) * weights.sum(-1, keepdim=True)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Routed() for _ in range(3))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).square().mean()


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    return measured(Model().train(), torch.randn(4, 8, DIM))


@pytest.mark.parametrize("label", ["slackswap@0.5", "full-recompute", "random 0", "random 1", "random 2"])
def test_saves_released_in_forward_run_as_profiled(setup, label):
    model, x, reference, prof = setup
    if label == "full-recompute":
        plan = ss.plan(prof, "a100-80g-pcie4", 1.0, planner="full-recompute")
    elif label.startswith("random"):
        plan = random_plan(prof, int(label.split()[1]))
    else:
        plan = ss.plan(prof, "a100-80g-pcie4", 0.5)
    ex = ss.apply(model, plan, prof)
    for _ in range(2):  # the verifying step, then a plain one
        assert_exact(run(model, loss_step, x, ex), reference)
        last = ex.stats.last_step
        assert last.fallbacks == {} and last.unplanned_reruns == 0, (last.fallbacks, last.recomputed_ops)
    assert_peak_as_predicted(last.peak_device_bytes, prof, plan)
    assert ex.stats.demotions == []
