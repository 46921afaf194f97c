"""slackswap_ds: per-activation keep / swap / recompute plans for DeepSpeed training.

Layers, bottom up: a module imports from its own layer or a lower one, never a higher one; no
import cycles; no module imports another module's underscore names; core and planning import no
torch (tests/test_structure.py holds the package to this block):

    core         errors budget profile hardware plan model_config workloads
    planning     simulator planners pipeline report
    runtime      runtime checkpointing bucketing topology dist channels agreement planfile
    integration  config logs deepspeed_api machine coordination shapes plans reporting api engine stages routing run
    entry        cli

The runtime names below (`apply`, `profile_step`, `initialize`, ...) are imported on first use.
"""

from __future__ import annotations

from .hardware import Hardware, Node, load_hardware, load_node
from .plan import Decision, Plan
from .profile import StepProfile

__all__ = ["Decision", "Hardware", "Node", "Plan", "StepProfile", "apply", "initialize", "install", "uninstall",
           "load_hardware", "load_node", "pad_to_multiple", "plan", "profile_step"]


def plan(profile: StepProfile, hardware: str | Hardware = "a100-80g-pcie4", budget: float | int = 0.5, *,
         planner: str = "slackswap", share=None) -> Plan:
    """A plan for `profile` on `hardware` (preset name, path or Hardware) within `budget` (a
    fraction of the keep-all peak, or bytes)."""
    from .budget import resolve_budget
    from .planners import PRIVATE, get_planner

    hw = load_hardware(hardware) if not isinstance(hardware, Hardware) else hardware
    return get_planner(planner)(profile, hw, resolve_budget(budget, profile), share or PRIVATE).plan


def __getattr__(name: str):
    if name == "profile_step":
        from .runtime.profiler import profile_step

        return profile_step
    if name == "apply":
        from .api import apply

        return apply
    if name == "initialize":
        from .engine import initialize

        return initialize
    if name == "pad_to_multiple":
        from .bucketing import pad_to_multiple

        return pad_to_multiple
    if name in ("install", "uninstall"):
        from . import routing as module

        return getattr(module, name)
    raise AttributeError(f"module 'slackswap_ds' has no attribute {name!r}")
