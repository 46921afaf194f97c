"""A whole training step of a cut job: pipeline stages under 1F1B (plain or interleaved, `schedules`)
or DeepSpeed's schedule (`deepspeed_pipe`), data-parallel replicas with a ZeRO stage, the optimizer
step, and a SlackSwap plan per stage.

What a step is here (Narayanan et al. 2021, Korthikanti et al. 2022; DeepSpeed ZeRO):

* `Job`: a model cut `tp` ways (with `sp`), into `pp` stages of equal layer counts or of the counts
  given (the first also holds the embedding, the last the head), replicated `dp` ways; `micro_batches` per step and
  pipeline. One rank's share of a stage is `stage_profile` (one micro-batch's forward and backward).
* 1F1B (non-interleaved): stage i runs min(p-i-1, m) warm-up forwards, then alternates one forward
  and one backward, then drains its backwards. F(i, j) waits for F(i-1, j) and the activation's
  point-to-point send; B(i, j) for B(i+1, j) and the gradient's send. At its peak stage i holds
  k_i = min(p-i, m) micro-batches: k_i - 1 finished forwards plus the one it runs.
* Memory per stage: each micro-batch runs the stage's plan. A finished forward leaves its kept
  bytes on the device (swapped ones are on the host, recomputed ones were never stored); the one
  running adds its own simulated peak. So peak_i = (k_i - 1) * kept + peak of one micro-batch, and
  `plan_stage` asks the planners for exactly that (`holds` = k_i): dropping a tensor then helps
  k_i - 1 times over, the last region's too.
* Data-parallel gradient reduction (all-reduce, or reduce-scatter + all-gather with ZeRO >= 1: the
  same bytes) over NVLink when the job fits on one node, else over the network links of the group's
  ranks on each node (`Job.dp_ranks_per_node`: one NIC per GPU, a ring per NIC), one bucket per
  layer: after the stage's last backward (DeepSpeed's `overlap_comm` defaults to false for ZeRO 1-2),
  or with `overlap_grad_comm` each bucket as soon as its layer's last backward is done (that backward
  then slower beside them, `Hardware.beside_collective`). Then the optimizer: fused Adam at HBM speed over
  this rank's parameters (1/dp of them with ZeRO >= 1), or with ZeRO-Offload CPU Adam at this
  GPU's share of its socket's memory bandwidth plus the copy of the updated 16-bit parameters back
  to the device. Stage-to-stage sends carry one micro-batch's boundary activation (1/tp of it per
  rank, Megatron's scatter-gather; DeepSpeed sends it whole) at the same link's rate.
* ZeRO-3 (FSDP FULL_SHARD): every micro-batch gathers each region's parameters before it runs, in
  forward and again in backward, and reduce-scatters its gradients (`sharded`); no gradient
  reduction after the pipeline. Its plans recompute as any others (`Job.recompute`: or not).

Every rate comes from the hardware presets; the step is deterministic.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from . import sharded
from .budget import (ADAM_BYTES_PER_PARAM, CPU_ADAM_BYTES_PER_PARAM, GRAD_BYTES, PINNED_OPTIMIZER_BYTES_PER_PARAM,
                     budget_bytes)
from .deepspeed_pipe import simulate_deepspeed_pipeline
from .errors import ProfileError, SlackSwapError
from .hardware import Node
from .plan import Decision, Instr, Kind, Plan, Schedule
from .planners import get_planner
# (one_f_one_b, simulate_pipeline and stage_peaks are imported from here too)
from .schedules import (PipeEvent, interleaved_order, one_f_one_b, simulate_pipeline, stage_ends,  # noqa: F401
                        stage_peaks)
from .shares import PRIVATE, Share
from .simulator import SimResult, simulate
from .step_profile import StepProfile
from .workloads import ModelSpec, Parallel, region_params, transformer_profile

SCHEDULES = ("1f1b", "deepspeed")  # Megatron's 1F1B; DeepSpeed's PipelineEngine TrainSchedule
MAX_JOB_DIM = 4096  # pp, dp and micro-batches a job may have here (published runs use at most a few hundred)
MAX_STEP_WORK = 2**17  # (virtual) stages x micro-batches: forwards in a step, each an event with its backward


@dataclass(frozen=True)
class Job:
    """How a training job is cut across GPUs, and what a step does."""

    spec: ModelSpec
    par: Parallel = Parallel()
    pp: int = 1
    dp: int = 1
    micro_batches: int = 1  # per step and pipeline (gradient accumulation)
    zero: int = 0  # DeepSpeed ZeRO stage 0-3 (3: parameters sharded and gathered per micro-batch, `sharded`)
    offload_optimizer: bool = False  # ZeRO-Offload: optimizer state and step on the CPU
    overlap_grad_comm: bool = False  # reduce each layer's gradients while backward goes on (DeepSpeed overlap_comm)
    schedule: str = "1f1b"  # "1f1b": Megatron's; "deepspeed": DeepSpeed's PipelineEngine (`deepspeed_pipe`)
    stage_layer_counts: tuple[int, ...] = ()  # layers per stage, first to last; (): layers / pp each
    partition_activations: bool = False  # DeepSpeed: recomputed layers' saved inputs split over tp, gathered again
    chunks: int = 1  # model chunks per device: Megatron's interleaved 1F1B over pp * chunks virtual stages
    logit_metrics: int = 0  # cross-entropies over the logits after each micro-batch (`logit_metric_s`)
    grad_reduce_bytes: int = GRAD_BYTES  # per gradient element in the data-parallel reduction: 4 when
    # reduced in fp32 (FSDP's MixedPrecision reduce_dtype=float32: torchtitan's, Composer's DEFAULT)
    sharding: str = "deepspeed"  # with zero 3, whose code shards: `sharded.SHARDINGS` (its own copies differ)
    recompute: bool = True  # plans may recompute (False: keep or swap only, as SlackSwap ran ZeRO-3 before issue 36)

    def __post_init__(self) -> None:
        problems = []
        for f in ("pp", "dp", "micro_batches", "chunks"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                problems.append(f"{f} must be a positive integer, got {v!r}")
            elif v > MAX_JOB_DIM:
                problems.append(f"{f} {v} is over the simulator's limit of {MAX_JOB_DIM} (a step's schedule grows "
                                f"with it; published runs use at most a few hundred)")
        if not problems and self.stages * self.micro_batches > MAX_STEP_WORK:
            problems.append(f"pp x chunks x micro_batches is {self.stages * self.micro_batches:,}, over the simulator"
                            f"'s limit of {MAX_STEP_WORK:,} (each forward and backward is an event of the step)")
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            problems.append(f"zero must be 0, 1, 2 or 3, got {self.zero!r}")
        elif self.zero == 3 and self.pp > 1:
            problems.append("zero 3 shards the parameters of a pipeline stage, which DeepSpeed refuses "
                            "(ZeRO-3 is incompatible with pipeline parallelism): give pp 1")
        if self.offload_optimizer and self.zero == 0:
            problems.append("offload_optimizer (ZeRO-Offload) needs zero >= 1")
        if self.partition_activations and self.schedule != "deepspeed":
            problems.append("partition_activations is DeepSpeed's activation checkpointing: it needs schedule "
                            "'deepspeed'")
        if isinstance(self.logit_metrics, bool) or not isinstance(self.logit_metrics, int) or self.logit_metrics < 0:
            problems.append(f"logit_metrics must be a whole number >= 0, got {self.logit_metrics!r}")
        if self.grad_reduce_bytes not in (2, 4) or isinstance(self.grad_reduce_bytes, bool):
            problems.append(f"grad_reduce_bytes must be 2 (16-bit) or 4 (fp32), got {self.grad_reduce_bytes!r}")
        if self.sharding not in sharded.SHARDINGS:
            problems.append(f"sharding must be one of {list(sharded.SHARDINGS)}, got {self.sharding!r}")
        elif self.sharding != "deepspeed" and self.zero != 3:
            problems.append(f"sharding {self.sharding!r} is how ZeRO-3 / FSDP FULL_SHARD shards: it needs zero 3")
        if self.schedule not in SCHEDULES:
            problems.append(f"schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        counts = self.stage_layer_counts
        if not problems and self.chunks > 1:
            if self.schedule != "1f1b" or counts or self.pp == 1:
                problems.append("chunks > 1 is Megatron's interleaved schedule: it needs schedule '1f1b', pp > 1 "
                                "and an even split")
            elif self.spec.layers % (self.pp * self.chunks) or self.micro_batches % self.pp:
                problems.append(f"the interleaved schedule needs layers ({self.spec.layers}) divisible by pp x "
                                f"chunks ({self.pp * self.chunks}) and micro_batches ({self.micro_batches}) a "
                                f"multiple of pp ({self.pp})")
        if counts:
            if (not isinstance(counts, tuple) or len(counts) != self.pp
                    or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts)):
                problems.append(f"stage_layer_counts must be {self.pp} positive integers (one per stage), "
                                f"got {counts!r}")
            elif sum(counts) != self.spec.layers:
                problems.append(f"stage_layer_counts {list(counts)} add up to {sum(counts)}, not the model's "
                                f"{self.spec.layers} layers")
        elif not problems and self.spec.layers % self.pp:
            problems.append(f"layers ({self.spec.layers}) must be divisible by pp ({self.pp}), or give "
                            f"stage_layer_counts (an uneven split, e.g. fewer layers beside the embedding and head)")
        if problems:
            raise ProfileError(f"invalid job for {self.spec.name!r}: " + "; ".join(problems))

    def dp_ranks_per_node(self, gpus_per_node: int) -> int:
        """Ranks of one data-parallel group on each node: ranks are laid out tensor-parallel first, then
        data-parallel, then pipeline (Megatron's default order; DeepSpeed's PipeModelDataParallelTopology),
        so a node holds gpus / tp of a group's ranks (at least 1, at most dp)."""
        return max(1, min(self.dp, gpus_per_node // self.par.tp))

    @property
    def gpus(self) -> int:
        return self.par.tp * self.pp * self.dp

    @property
    def stages(self) -> int:
        """(Virtual) stages: pp, or pp x chunks interleaved (chunk c of device i is stage c * pp + i)."""
        return self.pp * self.chunks

    def stage_layers(self, stage: int) -> range:
        counts = self.stage_layer_counts or (self.spec.layers // self.stages,) * self.stages
        first = sum(counts[:stage])
        return range(first, first + counts[stage])

    def in_flight(self, stage: int) -> int:
        """Micro-batches stage `stage` holds at its peak: under 1F1B min(pp - stage, m); interleaved,
        those of its chunk among its device's warm-up forwards and the one that follows them."""
        if self.chunks == 1:
            return min(self.pp - stage, self.micro_batches)
        device, chunk = stage % self.pp, stage // self.pp
        order = interleaved_order(self.pp, self.chunks, self.micro_batches, device)
        first_backward = next(i for i, w in enumerate(order) if w[0] == "B")
        return max(1, sum(1 for kind, c, _ in order[:first_backward] if c == chunk))

    @property
    def boundary_bytes(self) -> int:
        """One micro-batch's activation between layers, whole (what a stage sends the next)."""
        return self.spec.micro_batch * self.spec.seq * self.spec.hidden * self.spec.dtype_bytes

    def device_stages(self, device: int) -> range:
        """The (virtual) stages on pipeline rank `device`."""
        return range(device, self.stages, self.pp)

    def stage_parts(self, stage: int) -> dict:
        return {"layers": self.stage_layers(stage), "embed": stage == 0, "head": stage == self.stages - 1}

    def stage_params(self, stage: int) -> int:
        """Weight elements one rank of the stage owns."""
        return sum(self.region_params(stage).values())

    def region_params(self, stage: int) -> dict[str, int]:
        """Weight elements per region of one rank of the stage (built once per job and stage; read only)."""
        return _region_params(self.spec, self.par, self.stage_layers(stage), stage == 0, stage == self.stages - 1)


@functools.lru_cache(maxsize=256)
def _region_params(spec: ModelSpec, par: Parallel, layers: range, embed: bool, head: bool) -> dict[str, int]:
    return region_params(spec, par, layers=layers, embed=embed, head=head)


def stage_profile(job: Job, hw, stage: int) -> StepProfile:
    """One rank's profile of one micro-batch on `stage`."""
    name = job.spec.name if job.stages == 1 else f"{job.spec.name}/stage{stage}"
    profile = transformer_profile(job.spec, hw, job.par, name=name, **job.stage_parts(stage))
    return profile if job.recompute else profile.without_recompute(a.key for a in profile.activations if a.recomputable)


# ---- ZeRO-Offload's own traffic -------------------------------------------------------------------
ZERO_PREFIX = "zero:grads:"


def offload_grad_bytes(job: Job, stage: int) -> dict[str, int]:
    """Bytes of gradients ZeRO-Offload copies to the host per region of `stage`, in every
    micro-batch's backward (DeepSpeed accumulates them on the CPU): this rank's 1/dp partition of
    the region's gradients, 16-bit. {} without optimizer offload."""
    if not job.offload_optimizer:
        return {}
    return {r: n * GRAD_BYTES // job.dp for r, n in job.region_params(stage).items() if n}


def with_offload_traffic(schedule: Schedule, profile: StepProfile, grad_bytes: dict[str, int]) -> Schedule:
    """`schedule` plus ZeRO-Offload's gradient copies: one D2H copy per region as soon as the
    region's backward has finished (its gradients are complete), queued on the same copy engine
    after the plan's own swap-outs. They hold no activation memory; they take link time (and, while
    they run, the duplex penalty of every prefetch on the same GPU)."""
    if not grad_bytes:
        return schedule
    bwd = {ins.name: i for i, ins in enumerate(schedule.instrs) if ins.kind is Kind.BWD}
    first = {}
    for o in profile.ops:
        first.setdefault(o.region, o.key)
    extra = [Instr("d2h", Kind.COPY_OUT, ZERO_PREFIX + r, nbytes=n, waits=(bwd[first[r]],))
             for r, n in sorted(grad_bytes.items(), key=lambda rn: -profile.region_last_op[rn[0]])]
    return Schedule(schedule.instrs + tuple(extra), schedule.act_bytes, schedule.plan)


def offload_aware(share: Share, hw, job: Job, stage: int) -> Share:
    """The share a plan must fit while ZeRO-Offload runs (`Share.beside_zero_offload`): this rank
    pins the optimizer state of its 1/dp of the stage's parameters."""
    if not job.offload_optimizer:
        return share
    owned = job.stage_params(stage) // job.dp
    return share.beside_zero_offload(hw, owned * PINNED_OPTIMIZER_BYTES_PER_PARAM)


# ---- per-stage plans -------------------------------------------------------------------------------
@dataclass(frozen=True)
class StagePlan:
    stage: int
    layers: range
    in_flight: int
    profile: StepProfile
    plan: Plan
    result: SimResult  # one micro-batch under the plan
    budget_bytes: int  # the stage's
    keep_all_bytes: int  # the stage's peak with nothing dropped: in_flight * saved bytes of a micro-batch
    kept_bytes: int  # bytes a finished forward leaves on the device

    @property
    def fwd_s(self) -> float:
        return self.result.fwd_s

    @property
    def bwd_s(self) -> float:
        return self.result.step_s - self.result.fwd_s

    @property
    def peak_bytes(self) -> int:
        return (self.in_flight - 1) * self.kept_bytes + self.result.peak_bytes


def plan_stage(job: Job, hw, stage: int, budget: float, planner: str = "slackswap", share: Share = PRIVATE,
               profile: StepProfile | None = None, zero_aware: bool = True, holds: int | None = None) -> StagePlan:
    """The stage's plan: one micro-batch's plan made knowing that the stage holds k of them at
    once (the planners' `holds`: the k-1 finished forwards keep their kept bytes), within the
    stage's budget (`budget`: a fraction of the stage's keep-all peak, or bytes when > 1, or a
    `Budget`; inf: no limit). Each micro-batch is simulated with ZeRO-Offload's gradient copies on the link;
    `zero_aware=False` plans as if they were not there (what a planner that does not read the
    DeepSpeed config would do). `holds`: plan for that many micro-batches instead of k (one plan
    policy for every stage plans each for stage 0's count)."""
    profile = profile or stage_profile(job, hw, stage)
    traffic = offload_grad_bytes(job, stage)
    run_share = share
    if zero_aware:
        share = offload_aware(share, hw, job, stage)
    k = job.in_flight(stage)
    keep_all_bytes = k * profile.total_bytes
    stage_budget = keep_all_bytes if budget == float("inf") else budget_bytes(budget, keep_all_bytes)
    plan_holds = k if holds is None else holds  # (planners also split the pinned pool among them)
    planned = get_planner(planner)(profile, hw, stage_budget, share=share, holds=plan_holds)
    plan = planned.plan
    # simulated again on purpose: with ZeRO-Offload's gradient copies, on the link as it is shared
    schedule = with_offload_traffic(planned.schedule, profile, traffic)
    res = simulate(schedule, run_share.limit(hw), record=False)
    kept = sum(n for k, n in plan.stored_bytes(profile).items() if plan.decision[k] is Decision.KEEP)  # (packed: packed)
    return StagePlan(stage, job.stage_layers(stage), k, profile, plan, res, stage_budget, keep_all_bytes, kept)


# ---- the whole step --------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepResult:
    job: Job
    stages: tuple[StagePlan, ...]
    events: tuple[PipeEvent, ...]
    pipeline_s: float  # the 1F1B part (forwards, backwards, bubbles, sends)
    grad_comm_s: float  # data-parallel gradient reduction, exposed
    optimizer_s: float  # optimizer step (and ZeRO-Offload's parameter copy back)
    peaks: tuple[int, ...]  # per device (pipeline rank; per stage without interleaving), from the events
    ideal_s: float = float("nan")  # the same job with every activation kept (no memory limit)
    notes: tuple[str, ...] = field(default=())

    @property
    def step_s(self) -> float:
        return self.pipeline_s + self.grad_comm_s + self.optimizer_s

    @property
    def throughput(self) -> float:
        return self.ideal_s / self.step_s

    def stage_device_peak(self, stage: int) -> int:
        """The peak of the pipeline rank that runs (virtual) stage `stage`."""
        return self.peaks[stage % self.job.pp]

    def device_budget(self, device: int) -> int:
        """The budget of pipeline rank `device`: its stages' budgets together."""
        return sum(self.stages[s].budget_bytes for s in self.job.device_stages(device))

    @property
    def worst_peak_ratio(self) -> float:
        """The highest peak over budget among the pipeline ranks."""
        return max(p / self.device_budget(d) for d, p in enumerate(self.peaks))


def simulate_job(job: Job, node: Node, budget: float | tuple, planner: str = "slackswap",
                 share: Share | None = None, ideal_s: float = float("nan"), zero_aware: bool = True,
                 one_plan: bool = False) -> StepResult:
    """Plan every stage (one rank of it) within `budget` (`plan_stage`'s, or a tuple of one per (virtual)
    stage) and simulate one step of the job on `node`'s hardware. `one_plan`: every stage plans as if it
    held as many micro-batches as the tightest stage (the first), as one job-wide plan policy would."""
    hw, budgets = node.gpu, budget if isinstance(budget, tuple) else (budget,) * job.stages
    share = share if share is not None else Share.of_node(node)
    if job.gpus > node.gpus and node.internode_busbw == float("inf"):
        raise SlackSwapError(f"node {node.name!r} has no internode_busbw: a {job.gpus}-GPU job spans nodes")
    holds = job.in_flight(0) if one_plan else None
    stages = tuple(plan_stage(job, hw, i, budgets[i], planner, share, zero_aware=zero_aware, holds=holds)
                   for i in range(job.stages))
    # point-to-point: one micro-batch's boundary activation, this rank's part (Megatron: 1/tp with
    # the scatter-gather optimisation, Narayanan et al. 4.1; DeepSpeed sends it whole), over this
    # GPU's own network link
    deepspeed = job.schedule == "deepspeed"
    boundary = job.boundary_bytes / (1 if deepspeed else job.par.tp)
    one_node = job.gpus <= node.gpus  # then every collective and send stays on the NVLink board
    link_bps = hw.allreduce_busbw.at(boundary) if one_node and hw.allreduce_busbw else node.internode_busbw
    p2p_s = boundary / link_bps if job.pp > 1 else 0.0
    fwd_s, bwd_s = [s.fwd_s for s in stages], [s.bwd_s for s in stages]
    if job.zero == 3:  # each micro-batch gathers its parameters and reduce-scatters its gradients itself
        times = [_sharded_times(job, hw, node, st, one_node) for st in stages]
        fwd_s, bwd_s = [t.fwd_s for t in times], [t.bwd_s for t in times]
    if job.partition_activations:  # each recomputed region first gathers its input's tp shards again
        bwd_s = [b + partitioned_gathers_s(job, hw, st) for b, st in zip(bwd_s, stages)]
    bwd_s[-1] += job.logit_metrics * logit_metric_s(job, hw)  # the last stage holds the logits
    if deepspeed:
        events = simulate_deepspeed_pipeline(fwd_s, bwd_s, job.micro_batches, p2p_s)
    else:
        events = simulate_pipeline(fwd_s, bwd_s, job.micro_batches, p2p_s, job.chunks)
    pipeline_s = max(e.end for e in events)
    peaks = tuple(stage_peaks(events, [s.kept_bytes for s in stages], [s.result.peak_bytes for s in stages],
                              job.chunks))
    finish, last_backward = stage_ends(events, job.stages)  # (one pass: a step has pp x m events or more)
    if job.dp > 1 and job.zero < 3:
        finish = [_reduce_gradients(job, hw, node, st, last_backward[st.stage], one_node) for st in stages]
    grad_comm_s = max(finish) - pipeline_s  # what gradient reduction adds after the pipeline drains
    grad_comm_s += tied_reduce_s(job, hw, node, one_node) if deepspeed else 0.0
    # the slowest device sets the pace
    params = max(sum(job.stage_params(s) for s in job.device_stages(d)) for d in range(job.pp))
    owned = params // job.dp if job.zero >= 1 else params  # parameters whose optimizer state this rank holds
    if job.offload_optimizer:
        host_bps = node.socket_mem_bps / (node.gpus_per_switch * node.switches_per_socket)
        optimizer_s = owned * CPU_ADAM_BYTES_PER_PARAM / host_bps + owned * GRAD_BYTES / share.h2d(hw)
    else:
        optimizer_s = owned * ADAM_BYTES_PER_PARAM / hw.hbm_bps
    return StepResult(job, stages, events, pipeline_s, grad_comm_s, optimizer_s, peaks, ideal_s)


def logit_metric_s(job: Job, hw) -> float:
    """One training metric's cross-entropy over a micro-batch's logits, outside the model's step:
    Composer computes its train metrics after each micro-batch's backward (``Trainer._eval_train_metrics``,
    under the autocast context), and llm-foundry's models have two, LanguageCrossEntropy and
    LanguagePerplexity, each ``torch.nn.CrossEntropyLoss`` over the 16-bit logits. Under bf16 autocast
    that is a cast to fp32 (read 2 B, write 4 B per logit) and an fp32 log-softmax (read 4, write 4);
    the loss's gather of one logit per token is left out. Memory-bound, two kernels."""
    logits = job.spec.micro_batch * job.spec.seq * -(-job.spec.vocab // job.par.tp)
    return hw.elementwise_s(logits * (2 + 4 + 4 + 4)) + 2 * hw.kernel_overhead_s


def _reduce_gradients(job: Job, hw, node: Node, st: StagePlan, last: PipeEvent, one_node: bool) -> float:
    """When stage `st`'s replicas have reduced their gradients (all-reduce, or reduce-scatter +
    all-gather with ZeRO >= 1: 2(n-1)/n of the buffer either way), over NVLink on one node, else
    over the network links of its ranks on each node. One bucket per region, sent in backward order, each as soon
    as the last micro-batch's backward of its region is done when `overlap_grad_comm` (that backward
    then slower beside them, `sharded.backward_with_reductions`), else all after the stage's last backward."""
    params, per_node = job.region_params(st.stage), job.dp_ranks_per_node(node.gpus)
    _, bwd = _region_times(st.profile)
    order = sorted(bwd, key=lambda r: -st.profile.region_last_op[r])  # backward visits regions in reverse
    scale = (last.end - last.start) / sum(bwd.values()) if sum(bwd.values()) > 0 else 0.0  # recompute, stalls
    reduce_s = {r: _collective_s(hw, node, params.get(r, 0) * job.grad_reduce_bytes, job.dp, one_node,
                                 per_node=per_node) if params.get(r, 0) else 0.0 for r in order}
    if not job.overlap_grad_comm:
        return last.end + sum(reduce_s.values())
    beside = hw.beside_collective(_busbw(hw, node, max(params.values(), default=0) * job.grad_reduce_bytes,
                                         one_node, per_node))
    bwd_b = bwd if beside is hw else _region_times(stage_profile(job, beside, st.stage))[1]
    regions = [sharded.RegionWork(r, 0.0, bwd[r] * scale, 0.0, reduce_s[r], -1.0, bwd_b[r] * scale) for r in order]
    return max(sharded.backward_with_reductions(regions, last.start))


def partitioned_gathers_s(job: Job, hw, st: StagePlan) -> float:
    """DeepSpeed's ``partition_activations``: a checkpointed region keeps 1/tp of its input on each
    tensor-parallel rank and all-gathers it before the region is recomputed (once per micro-batch's
    backward, on the compute stream: the recompute waits for it)."""
    if job.par.tp == 1:
        return 0.0
    recomputed = {st.profile.region_of(a) for a in st.profile.activations
                  if st.plan.decision[a.key] is Decision.RECOMPUTE}
    return len(recomputed) * hw.collective_s("all_gather", job.boundary_bytes, job.par.tp)


def tied_reduce_s(job: Job, hw, node: Node, one_node: bool) -> float:
    """DeepSpeed's ``ReduceTiedGrads`` before the data-parallel reduction: the first and the last
    stage all-reduce the gradients of the embedding table they share (16-bit, this rank's 1/tp)."""
    if job.pp == 1 or not job.spec.tied_embeddings:
        return 0.0
    nbytes = -(-job.spec.vocab // job.par.tp) * job.spec.hidden * GRAD_BYTES
    return _collective_s(hw, node, nbytes, 2, one_node)


def _collective_s(hw, node: Node, nbytes: float, ranks: int, one_node: bool, kind: str = "all_reduce",
                  per_node: int = 1) -> float:
    """An all-reduce (or all-gather / reduce-scatter of the whole buffer) over NVLink (the board's
    measured curve) when the job fits on one node, else over the network: nccl-tests' 2(n-1)/n, or
    (n-1)/n, of the buffer at `_busbw`."""
    if one_node and hw.allreduce_busbw is not None:
        return hw.collective_s(kind, nbytes, ranks)
    factor = 2.0 if kind == "all_reduce" else 1.0
    return nbytes * factor * (ranks - 1) / ranks / _busbw(hw, node, nbytes, one_node, per_node)


def _busbw(hw, node: Node, nbytes: float, one_node: bool, per_node: int = 1) -> float:
    """The bus bandwidth of a collective of `nbytes`: the board's NVLink curve on one node, else the
    `per_node` GPUs' own network links a node gives the group (NCCL runs a ring per NIC, each NIC
    carrying its share; 4-NIC A100 nodes measure ~4x one NIC's rate, benchmarks/fidelity_sources.md
    section 5), at most what NVLink carries inside."""
    if one_node and hw.allreduce_busbw is not None:
        return hw.allreduce_busbw.at(nbytes)
    busbw = per_node * node.internode_busbw
    if per_node > 1 and hw.allreduce_busbw is not None:
        busbw = min(busbw, hw.allreduce_busbw.at(nbytes))
    return busbw


def _sharded_times(job: Job, hw, node: Node, st: StagePlan, one_node: bool) -> sharded.ShardedTimes:
    """One micro-batch of stage `st` under ZeRO-3: its regions' simulated compute (recompute and
    stalls spread over the regions by their op times) with the gathers and reduce-scatters of
    `sharded`, over the dp ranks; beside a collective, each region's compute takes what its ops take
    on `Hardware.beside_collective` (at the bus bandwidth of the largest region's gather)."""
    fwd, bwd = _region_times(st.profile)
    f_scale = st.fwd_s / sum(fwd.values()) if sum(fwd.values()) > 0 else 0.0
    b_scale = st.bwd_s / sum(bwd.values()) if sum(bwd.values()) > 0 else 0.0
    params = job.region_params(st.stage)
    gathers = sharded.gather_bytes(params)
    order = sorted(fwd, key=lambda r: st.profile.region_last_op[r])
    per_node = job.dp_ranks_per_node(node.gpus)

    def collective(kind: str, nbytes: int) -> float:
        return _collective_s(hw, node, nbytes, job.dp, one_node, kind, per_node) if job.dp > 1 else 0.0

    beside = hw.beside_collective(_busbw(hw, node, max(gathers.values(), default=0), one_node, per_node))
    fwd_b, bwd_b = (fwd, bwd) if beside is hw or job.dp == 1 else _region_times(stage_profile(job, beside, st.stage))

    def copies_s(nbytes: float) -> float:  # the sharding code's own casts and copies: memory-bound kernels
        return hw.elementwise_s(nbytes) + hw.kernel_overhead_s if nbytes else 0.0

    regions = []
    for r in order:
        gather_copy, reduce_copy = sharded.copy_bytes(job.sharding, params.get(r, 0), job.dp, job.grad_reduce_bytes)
        fwd_extra, bwd_extra = copies_s(gather_copy), copies_s(gather_copy) + copies_s(reduce_copy)
        regions.append(sharded.RegionWork(
            r, fwd[r] * f_scale + fwd_extra, bwd[r] * b_scale + bwd_extra, collective("all_gather", gathers.get(r, 0)),
            collective("reduce_scatter", params.get(r, 0) * job.grad_reduce_bytes),
            fwd_b[r] * f_scale + fwd_extra, bwd_b[r] * b_scale + bwd_extra))
    return sharded.micro_batch_times(regions)


def _region_times(profile: StepProfile) -> tuple[dict[str, float], dict[str, float]]:
    """Forward and backward seconds of each region's ops (the profile's op times, before any plan)."""
    fwd: dict[str, float] = {}
    bwd: dict[str, float] = {}
    for o in profile.ops:
        fwd[o.region] = fwd.get(o.region, 0.0) + o.fwd_s
        bwd[o.region] = bwd.get(o.region, 0.0) + o.bwd_s
    return fwd, bwd


def ideal_step_s(job: Job, node: Node, share: Share | None = None) -> float:
    """The step with every activation kept and no memory limit (on the same share of the node)."""
    return simulate_job(job, node, float("inf"), planner="keep-all", share=share).step_s
