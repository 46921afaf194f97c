"""One rank of a real torch.distributed (gloo) job on 127.0.0.1, started by tests/test_agreement.py
with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set. Writes its result as JSON to
$SLACKSWAP_TEST_OUT/<rank>.json."""

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import slackswap_ds as ss
from slackswap_ds.agreement import AgreementError, agree
from slackswap_ds.channels import StoreChannel
from slackswap_ds.config import load_config
from slackswap_ds.engine import EngineHooks
from slackswap_ds.plan import Decision, Plan

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "mpi"))
from worker import grads, model_and_batch, step  # noqa: E402  (the MPI worker's models and step)


class EngineShim:
    """What EngineHooks wraps: a module with forward and backward."""

    def __init__(self, module):
        self.module = module
        self.forward = module.forward

    def backward(self, loss):
        loss.backward()


class GarblingChannel(StoreChannel):
    """The real store, but the plan this rank receives arrives as bytes that are not a plan."""

    def poll(self, name, sender):
        data = super().poll(name, sender)
        return b"\xb0" + data[1:] if data is not None and name == "plan" else data


def emit(row: dict) -> None:
    with open(os.path.join(os.environ["SLACKSWAP_TEST_OUT"], f"{row['rank']}.json"), "w") as f:
        json.dump(row, f)


def main(scenario: str, timeout_s: float) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    out = {"rank": rank}
    model, batch = model_and_batch(trains=scenario == "agree")
    profile = ss.profile_step(model, step, batch, warmup=0)
    if scenario.startswith("coordinate"):
        # the engine's own node coordination: 4 ranks as 2 nodes x 2, dgx-a100 switches, a 64 KiB pool
        cfg = load_config({"slackswap": {"hardware": "a100-80g-pcie4", "node": "dgx-a100", "ranks_per_node": 2,
                                         "host_pool_bytes_per_node": 65536, "sync": "torch",
                                         "sync_timeout_s": timeout_s}})
        os.environ["LOCAL_RANK"] = str(rank % 2)
        runtime = EngineHooks(EngineShim(model), cfg).attach()
        coordinator = runtime.coordinator
        channel = coordinator.job_channel()
        budget = profile.total_bytes // 2 + 1000 * rank  # unequal demands: rank r wants 1000*r B less
        if scenario == "coordinate-exit3" and rank == 3:
            emit({**out, "exited": True})
            os._exit(0)
        import time

        began = time.monotonic()
        try:
            coordinator.exchange_facts(profile, budget, "input shapes (2, 16, 32) torch.float32")
        except AgreementError as e:
            emit({**out, "error": str(e), "seconds": time.monotonic() - began})
            os._exit(0)
        own, plan = coordinator.shares.own, coordinator.shares.plan
        out.update(d2h=own.d2h_bps, h2d=own.h2d_bps, pool=own.host_pool_bytes, plan_d2h=plan.d2h_bps,
                   plan_pool=plan.host_pool_bytes,
                   demand=profile.total_bytes - budget, channel=type(channel).__name__)
        emit(out)
        return
    plan = ss.plan(profile, "a100-80g-pcie4", 0.5) if rank == 0 else None
    if scenario.startswith("exit") and rank == int(scenario[4:]):
        emit({**out, "exited": True})
        os._exit(0)  # no goodbye: as a crashed rank
    tamper = None
    if scenario == "tamper" and rank == 2:
        def tamper(p):
            key, dec = p.decisions[0]
            flipped = Decision.KEEP if dec is not Decision.KEEP else Decision.SWAP
            return Plan(((key, flipped),) + p.decisions[1:], p.prefetch, p.budget_bytes, p.profile_digest,
                        p.hardware_digest, p.planner, p.planner_version, p.blocking)
    import time

    if scenario == "stuck1" and rank == 1:
        time.sleep(timeout_s + 5)  # alive, but far too late
    began = time.monotonic()
    channel = GarblingChannel() if scenario == "garble" and rank == 2 else StoreChannel()
    keys_before = channel.store.num_keys() if scenario == "agree" else 0
    try:
        agreed_profile, agreed = agree(channel, profile, plan, timeout_s, on_receive=tamper)
    except AgreementError as e:
        emit({**out, "error": str(e), "seconds": time.monotonic() - began})
        os._exit(0)  # skip the process group's shutdown: a peer is gone
    reference = grads(model, batch)
    result = grads(model, batch, ss.apply(model, agreed, agreed_profile))
    exact = torch.equal(result[0], reference[0]) and all(torch.equal(result[1][k], reference[1][k]) for k in reference[1])
    emit({**out, "digest": agreed.digest, "exact": exact,
          "store_keys_left": channel.store.num_keys() - keys_before if scenario == "agree" else None})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
