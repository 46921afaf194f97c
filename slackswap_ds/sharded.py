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
a rank's collectives one after another); compute waits only for its own region's gather. Nothing
here knows a plan: a region's compute time is what its stage plan simulated (recompute included).
"""

from __future__ import annotations

from dataclasses import dataclass

GATHER_BYTES_PER_PARAM = 2  # 16-bit parameters gathered (bf16/fp16 training)


@dataclass(frozen=True)
class RegionWork:
    """One region's part of a micro-batch: compute seconds each way and collective seconds."""

    region: str
    fwd_s: float
    bwd_s: float
    gather_s: float  # all-gather of its parameters (once in forward, once again in backward)
    reduce_s: float  # reduce-scatter of its gradients after its backward


@dataclass(frozen=True)
class ShardedTimes:
    fwd_s: float  # the micro-batch's forward, from its first gather to its last region's end
    bwd_s: float  # its backward, to the last reduce-scatter's end
    exposed_s: float  # collective time compute waited for (both passes, reduce-scatter tail included)


def gather_bytes(region_params: dict[str, int]) -> dict[str, int]:
    """Bytes of 16-bit parameters each region gathers, in full, per pass of each micro-batch."""
    return {r: n * GATHER_BYTES_PER_PARAM for r, n in region_params.items() if n}


def micro_batch_times(regions: list[RegionWork]) -> ShardedTimes:
    """Forward and backward of one micro-batch with `regions` (forward order): compute waits for its
    region's gather; the next gather is issued when a region starts; reduce-scatters are issued as
    each region's backward ends; one stream runs all collectives in issue order."""
    if not regions:
        return ShardedTimes(0.0, 0.0, 0.0)
    compute_only = sum(r.fwd_s + r.bwd_s for r in regions)

    def pass_(order: list[RegionWork], compute: str, t0: float, with_reduce: bool) -> float:
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
            end = start + getattr(r, compute)
            if with_reduce:
                collective(end, r.reduce_s)
        return max(end, comm_free)

    fwd_end = pass_(regions, "fwd_s", 0.0, False)  # (no collective outlives the last region's gather)
    bwd_end = pass_(list(reversed(regions)), "bwd_s", fwd_end, True)
    return ShardedTimes(fwd_end, bwd_end - fwd_end, bwd_end - compute_only)
