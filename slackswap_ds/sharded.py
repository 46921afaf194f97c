"""ZeRO stage 3 / FSDP FULL_SHARD: a micro-batch's forward and backward with its parameter gathers.

Each data-parallel rank holds 1/dp of every parameter. Per micro-batch (DeepSpeed ZeRO-3; PyTorch
FSDP with ``reshard_after_forward``, the FULL_SHARD default):

* forward: before a region (the embedding, each layer, the head) runs, its 16-bit parameters are
  all-gathered from the dp ranks, and freed after it; the gather of the next region is issued when
  this one starts (a prefetch one region deep: DeepSpeed's ``prefetch_bucket_size``, FSDP's
  ``forward_prefetch`` / ``limit_all_gathers``);
* backward, regions in reverse: the parameters are gathered again (prefetched one region ahead,
  FSDP's ``BACKWARD_PRE``), and each region's gradients are reduce-scattered as soon as its
  backward ends (in 16 bits, or fp32 with `Job.grad_reduce_bytes`).

Gathers and reduce-scatters share one communication stream, in the order they are issued (NCCL runs
a rank's collectives one after another); compute waits only for its own region's gather. While a
collective runs, compute proceeds at its slower *beside* speed (`RegionWork.fwd_beside_s`: the SMs
and HBM bandwidth NCCL holds are not the compute's, `Hardware.beside_collective`). Nothing here knows
a plan: a region's compute time is what its stage plan simulated (recompute included).
"""

from __future__ import annotations

from dataclasses import dataclass

from .budget import GATHER_BYTES_PER_PARAM, MASTER_BYTES

# Whose code shards the parameters. Their own memory-bound work around the collectives differs:
SHARDINGS = {
    "deepspeed": "DeepSpeed ZeRO-3 (its own copies are not modelled)",
    "fsdp1": "PyTorch FSDP (FullyShardedDataParallel's FlatParameter; Composer's): casts each gradient in full",
}


def copy_bytes(sharding: str, params: int, dp: int, reduce_bytes: int) -> tuple[float, float]:
    """HBM bytes the sharding code itself moves for a region of `params` weights: per gather (each
    pass) and per gradient reduction (each micro-batch's backward). PyTorch FSDP with MixedPrecision
    (torch/distributed/fsdp/_runtime_utils.py; the same in the older and the recent version read):

    * before each all-gather, the rank's fp32 shard is cast to 16 bits (``_use_low_precision_shard``:
      read 4, write 2 bytes per shard element);
    * after backward, the full 16-bit gradient is cast to the reduce dtype when it differs
      (``_post_backward_hook``: ``flat_param.grad.to(handle._reduce_dtype)``, read 2, write 4) and
      divided in place by the pre-divide factor before the reduce-scatter (``_reduce_grad`` ->
      ``_div_if_needed``; the factor is > 1 for every dp >= 2: read and write the reduce dtype).
    The all-gather writes straight into the unsharded FlatParameter (no copy out), and the shard's
    post-divide and accumulation touch 1/dp of it (left out)."""
    if sharding == "deepspeed" or dp == 1 or not params:
        return 0.0, 0.0
    gather = params / dp * (MASTER_BYTES + GATHER_BYTES_PER_PARAM)
    cast = params * (GATHER_BYTES_PER_PARAM + reduce_bytes) if reduce_bytes != GATHER_BYTES_PER_PARAM else 0.0
    return gather, cast + params * 2 * reduce_bytes


@dataclass(frozen=True)
class RegionWork:
    """One region's part of a micro-batch: compute seconds each way and collective seconds."""

    region: str
    fwd_s: float
    bwd_s: float
    gather_s: float  # all-gather of its parameters (once in forward, once again in backward)
    reduce_s: float  # reduce-scatter of its gradients after its backward
    fwd_beside_s: float = -1.0  # its forward with a collective running all along (< 0: fwd_s)
    bwd_beside_s: float = -1.0

    def compute_s(self, pass_: str, comm_busy_s: float) -> float:
        """Seconds of its forward or backward (`pass_`) when a collective runs beside it for the
        first `comm_busy_s` seconds: the work done meanwhile at the beside speed, the rest at full."""
        alone = getattr(self, f"{pass_}_s")
        beside = getattr(self, f"{pass_}_beside_s")
        if beside < 0 or comm_busy_s <= 0 or alone <= 0:
            return alone
        if comm_busy_s >= beside:
            return beside
        return comm_busy_s + (1.0 - comm_busy_s / beside) * alone


@dataclass(frozen=True)
class ShardedTimes:
    fwd_s: float  # the micro-batch's forward, from its first gather to its last region's end
    bwd_s: float  # its backward, to the last reduce-scatter's end
    exposed_s: float  # time the collectives cost the compute: waits, the reduce-scatter tail, and
    # compute slowed beside them (both passes)


def gather_bytes(region_params: dict[str, int]) -> dict[str, int]:
    """Bytes of 16-bit parameters each region gathers, in full, per pass of each micro-batch."""
    return {r: n * GATHER_BYTES_PER_PARAM for r, n in region_params.items() if n}


def micro_batch_times(regions: list[RegionWork]) -> ShardedTimes:
    """Forward and backward of one micro-batch with `regions` (forward order): compute waits for its
    region's gather; the next gather is issued when a region starts; reduce-scatters are issued as
    each region's backward ends; one stream runs all collectives in issue order; compute is slower
    while one runs (`RegionWork.compute_s`). The stream's queue is never idle between a region's
    start and the last collective issued so far, so that span is the region's time beside one."""
    if not regions:
        return ShardedTimes(0.0, 0.0, 0.0)
    compute_only = sum(r.fwd_s + r.bwd_s for r in regions)

    def pass_(order: list[RegionWork], pass_name: str, t0: float, with_reduce: bool) -> float:
        comm_free = t0

        def collective(issued: float, seconds: float) -> float:  # runs after what was issued before it
            nonlocal comm_free
            comm_free = max(comm_free, issued) + seconds
            return comm_free

        gathered = [collective(t0, order[0].gather_s)]  # the first gather is not hidden by anything
        end = t0
        for i, r in enumerate(order):
            start = max(end, gathered[i])
            if i + 1 < len(order):
                gathered.append(collective(start, order[i + 1].gather_s))
            end = start + r.compute_s(pass_name, comm_free - start)
            if with_reduce:
                collective(end, r.reduce_s)
        return max(end, comm_free)

    fwd_end = pass_(regions, "fwd", 0.0, False)  # (no collective outlives the last region's gather)
    bwd_end = pass_(list(reversed(regions)), "bwd", fwd_end, True)
    return ShardedTimes(fwd_end, bwd_end - fwd_end, bwd_end - compute_only)


def backward_with_reductions(regions: list[RegionWork], t0: float) -> tuple[float, float]:
    """A backward from `t0` whose regions (in backward order) reduce their gradients as each ends, on
    one stream beside the compute (DDP's and DeepSpeed's ``overlap_comm``), each region's compute
    slower while a reduction runs (`RegionWork.compute_s`): when the compute and the last reduction end."""
    end = comm_free = t0
    for r in regions:
        end += r.compute_s("bwd", comm_free - end)
        comm_free = max(comm_free, end) + r.reduce_s
    return end, comm_free
