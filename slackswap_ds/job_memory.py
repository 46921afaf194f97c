"""What one GPU of a simulated job holds, and the budgets its stages plan within.

A GPU here is one rank of a pipeline stage (every chunk of it, interleaved): it holds

* its **model state**: the 16-bit weights, the 16-bit gradients and the optimizer's fp32 master
  weights, momentum and variance (2 + 2 + 12 B per parameter, `budget.model_state_parts`) of the
  parameters of its stages, each part sharded over the `dp` replicas by its ZeRO stage (1: the
  optimizer state, 2: the gradients too, 3: the weights too). With ZeRO-Offload the optimizer state
  and the gradients are on the host (`pipeline.offload_grad_bytes` copies each region's gradients
  there in every backward). A tied embedding table held by one GPU (embedding and head on one stage)
  counts once;
* under ZeRO-3, the **gathered parameters** of two neighbouring regions at once: the one running and
  the one prefetched (`sharded`: a prefetch one region deep), in 16 bits;
* its **saved activations**, at most the simulated peak of its plan (`StepResult.peaks`).

Not counted, because the simulator does not model them: backward's temporaries (what an op
allocates while it runs), gradient buckets and communication buffers, the allocator's fragmentation,
the CUDA context and library workspaces. So "fits" is necessary, not sufficient: an "auto" budget
keeps 10% of the GPU for them (`budget.AUTO_MARGIN`), a rule of thumb.

Budgets of a job's stages: a fraction is of each stage's keep-all peak; a size is one GPU's bytes;
"auto" is what each GPU has room for beside its model state (`budget.auto_budget_bytes`). A GPU of
an interleaved job splits a size or its "auto" room evenly among its chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

from .budget import AUTO_MARGIN, GATHER_BYTES_PER_PARAM, Budget, auto_budget_bytes, model_state_parts
from .errors import SlackSwapError
from .pipeline import Job, StepResult


@dataclass(frozen=True)
class DeviceState:
    """One GPU of a job before its saved activations: bytes of each part."""

    device: int  # pipeline rank
    params: int  # weight elements of its stages (one rank of the tensor-parallel cut), before ZeRO
    weights: int
    grads: int
    optimizer: int
    gathered: int  # ZeRO-3: the 16-bit parameters of the running and the prefetched region

    @property
    def state_bytes(self) -> int:
        """The model state: weights, gradients and optimizer state on the device."""
        return self.weights + self.grads + self.optimizer

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.gathered


def device_params(job: Job, device: int) -> int:
    """Weight elements of the stages on pipeline rank `device`; a tied embedding table counts once
    when the GPU holds both the embedding and the head (`workloads.model_params`)."""
    stages = job.device_stages(device)
    total = sum(job.stage_params(s) for s in stages)
    if job.spec.tied_embeddings and 0 in stages and job.stages - 1 in stages:
        total -= job.spec.vocab * job.spec.hidden // job.par.tp
    return total


def device_state(job: Job, device: int) -> DeviceState:
    """What pipeline rank `device` holds besides its saved activations (see the module docstring)."""
    params = device_params(job, device)
    weights, grads, optimizer = model_state_parts(params, job.zero, job.dp)
    if job.offload_optimizer:  # ZeRO-Offload: the optimizer state and the gradients live on the host
        grads = optimizer = 0
    gathered = 0
    if job.zero == 3 and job.dp > 1:
        regions = [n * GATHER_BYTES_PER_PARAM for s in job.device_stages(device)
                   for n in job.region_params(s).values()]  # forward order
        gathered = max((a + b for a, b in zip(regions, regions[1:] + [0])), default=0)
    return DeviceState(device, params, weights, grads, optimizer, gathered)


def stage_budgets(job: Job, device_bytes: float, budget: Budget) -> tuple[Budget, ...]:
    """Each (virtual) stage's budget for `pipeline.simulate_job`: a fraction as it is; a size, or
    what "auto" leaves on each GPU of `device_bytes`, split evenly among the GPU's chunks.
    SlackSwapError if "auto" leaves a GPU no room."""
    if budget.is_fraction:
        return (budget,) * job.stages
    per_device = []
    for d in range(job.pp):
        held = device_state(job, d).total_bytes
        room = auto_budget_bytes(device_bytes, held) if budget.is_auto else int(budget.value)
        if room <= 0:
            raise SlackSwapError(
                f"budget auto leaves no room for activations on pipeline rank {d}: what it holds besides them "
                f"(model state, gathered parameters) is {held / 1e9:.2f} GB of the GPU's {device_bytes / 1e9:.2f} GB, "
                f"and auto keeps {AUTO_MARGIN:.0%} of the GPU free; shard the model state (--dp with --zero) or cut "
                f"the model (--tp, --pp)")
        per_device.append(room // job.chunks)
    return tuple(Budget(per_device[s % job.pp]) for s in range(job.stages))


def device_fits(job: Job, res: StepResult, device_bytes: float) -> list[bool]:
    """Per pipeline rank: its model state, gathered parameters and simulated peak of saved
    activations within `device_bytes` (what is not counted: the module docstring)."""
    return [device_state(job, d).total_bytes + res.peaks[d] <= device_bytes for d in range(job.pp)]


def tokens_per_s(job: Job, res: StepResult) -> float:
    """The job's tokens per second: every replica's micro-batches of seq x micro-batch tokens per step."""
    return job.dp * job.micro_batches * job.spec.micro_batch * job.spec.seq / res.step_s
