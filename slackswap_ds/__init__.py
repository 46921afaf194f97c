"""slackswap_ds: per-activation keep / swap / recompute plans for DeepSpeed training.

Layers, bottom up: a module imports from its own layer or a lower one, never a higher one; no
import cycles; no module imports another module's underscore names; core and planning import no
torch (tests/test_structure.py holds the package to this block and to the map below):

    core         errors files ds_config budget shares step_profile derive attention_rates hardware plan model_config plan_file workloads
    planning     simulator planners schedules sharded deepspeed_pipe pipeline job_memory sim_report
    runtime      logs runtime checkpointing bucketing topology node_facts channels agreement
    integration  config deepspeed_api compatibility machine coordination shapes plan_maker job_report shape_plans lifecycle api engine stages routing run autoroute
    entry        cli

The map, one line per module (the one map: README.md and docs/ link here):

    errors          the package's exceptions: what was expected, what was found, what to do
    files           JSON read with errors that name the file; atomic writes, never through a link
    ds_config       the one reader of DeepSpeed configs: once, as DeepSpeed reads them (dict, hjson, pipe, base64)
    budget          budgets and sizes: the one parser; a fraction of the keep-all peak -> bytes; bytes per parameter
    shares          a rank's share of its node: link rates and pinned pool (Share, split_node, tightest)
    step_profile    StepProfile, Op, Activation: a measured or modelled step; canonical JSON and digests
    derive          a profile of new input shapes from a measured one (sequence, batch)
    attention_rates measured fused-attention speed by kernel, mask, head dim and sequence length
    hardware        GPU and node presets (configs/hardware/), each number with its source
    plan            Decision, Plan, and its lowering to a per-stream Schedule
    model_config    a Hugging Face config.json as a ModelSpec
    plan_file       plan files: a plan per input shape, with what it was made for
    workloads/      analytic per-op profiles: spec, presets (configs/workloads/), builder, layer
    simulator       discrete-event simulation of Schedules on a GPU or a node
    planners/       one signature -> Planned: common, slackswap, refine, ties, packing, milp, solver_output,
                    optimal, baselines, anchors
    schedules       Megatron's pipeline schedules as event times: 1F1B and interleaved 1F1B; per-device peaks
    sharded         ZeRO-3 / FSDP: a micro-batch with its parameter gathers and gradient reduce-scatters
    deepspeed_pipe  DeepSpeed's PipelineEngine schedule: lockstep steps, blocking sends, tied-weight reduce
    pipeline        whole jobs: TP, SP, PP (1F1B or DeepSpeed's), DP, ZeRO 0-3 and ZeRO-Offload
    job_memory      one GPU of a whole job: its model state by ZeRO stage, its stages' budgets, whether it fits
    sim_report      traces, plots and the text tables of `slackswap simulate`
    logs            the slackswap_ds logger: which rank says what, said once per job
    runtime/        plans run for real: executor, steps, entries, swaps, packing, calls, replay, verify,
                    residency, program, records, stats, aten, flat, tracing, op_clock, profiler, regions,
                    naming, takeover, compiled, compile_layout, host_pool, device, emulation,
                    stream_sanitizer, timeline
    checkpointing   drop-in deepspeed.checkpointing (inline under a plan)
    bucketing       pad_to_multiple for variable-length batches
    topology        which GPUs share a host uplink
    node_facts      what ranks tell each other before planning; the node layout; each rank's share
    channels        the agreement's MPI and torch.distributed-store transports
    agreement       the plan-agreement protocol over any channel (torch- and MPI-free)
    config          the "slackswap" section of a DeepSpeed config
    deepspeed_api   every touch of a DeepSpeed engine's API, private or not
    compatibility   what SlackSwap runs beside, declared in one place: refusals and unsupported options
    machine         this machine: GPU preset, host uplinks, this rank's GPU, MPI launch
    coordination    channels, node facts and shares, the group that agrees, giving up without hanging
    shapes          input-shape keys, the LRU of shape plans, how a step runs and what happened in it
    plan_maker      a plan within budget, fitted, agreed, installed, re-planned; plan files
    job_report      what a job reports: log_every reports, the end-of-job summary, trace paths
    shape_plans     plans for a rank's input shapes: from a profile, derived, checked
    lifecycle       the shape lifecycle: what a step of shape K runs under and what follows it
    api             ss.apply (a Plan or a Planned) and its default re-plan
    engine          ss.initialize and the DeepSpeed engine's hooks (a thin adapter of the lifecycle)
    stages          the PipelineEngine's hooks: per-stage plans through the same lifecycle
    routing, run    ss.install() / ss.uninstall(); python -m slackswap_ds.run
    autoroute       the start-up hook (setup.py's .pth): a config with a section routed at deepspeed.initialize;
                    the section's "auto" values kept from Accelerate's placeholder filling
    cli/            `slackswap simulate | plan`: arguments and printing; sweep; job_plans (plan --plan-file)

The runtime names below (`apply`, `profile_step`, `initialize`, ...) are imported on first use.
"""

from __future__ import annotations

from .hardware import Hardware, Node, load_hardware, load_node
from .plan import Decision, Plan
from .step_profile import StepProfile

__all__ = ["Decision", "Hardware", "Node", "Plan", "StepProfile", "apply", "initialize", "install", "uninstall",
           "load_hardware", "load_node", "pad_to_multiple", "plan", "profile_step"]


def plan(profile: StepProfile, hardware: str | Hardware = "a100-80g-pcie4", budget: float | int = 0.5, *,
         planner: str = "slackswap", share=None) -> Plan:
    """A plan for `profile` on `hardware` (preset name, path or Hardware) within `budget` (a
    fraction of the keep-all peak, or bytes)."""
    from .budget import resolve_budget
    from .planners import get_planner
    from .shares import PRIVATE

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
    if name == "autoroute":  # loaded at start-up by its path, before the package (setup.py)
        import importlib

        return importlib.import_module(".autoroute", __name__)
    if name in ("install", "uninstall"):
        from . import routing as module

        return getattr(module, name)
    raise AttributeError(f"module 'slackswap_ds' has no attribute {name!r}")
