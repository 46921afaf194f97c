"""The executor on a real GPU (skipped without CUDA): side streams, pinned memory, CUDA RNG and
fused attention kernels (flash / memory-efficient SDPA, whose results include None, ints and CPU
seed tensors). Loss and every gradient bit for bit against the unmodified model, dropout on."""

import pytest
import torch

import slackswap_ds as ss
from slackswap_ds.runtime.device import Device
from slackswap_ds.runtime.host_pool import HostPool

from exactness import assert_exact, profile, random_plan, run, without_caches

transformers = pytest.importorskip("transformers")
import zoo  # noqa: E402  (needs transformers)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def on_gpu(name: str, dtype: torch.dtype):
    transformers.logging.set_verbosity_error()
    model, batch = zoo.ZOO[name].build(dtype)
    model = without_caches(model).cuda()
    return model, {k: v.cuda() for k, v in batch.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["gpt2-sdpa", "llama", "t5", "mixtral"])
def test_plans_on_the_gpu_are_exact(name, dtype):
    model, batch = on_gpu(name, dtype)
    reference = run(model, zoo.step, batch)
    assert_exact(run(model, zoo.step, batch), reference)  # the model itself is deterministic here
    prof = profile(model, zoo.step, batch)
    device = Device.current()
    assert device.has_streams
    plans = [ss.plan(prof, "h200-pcie5", b) for b in (0.5, 0.75)] + [random_plan(prof, s) for s in range(8)]
    for plan in plans:
        ex = ss.apply(model, plan, prof, pool=HostPool(None, device))
        assert_exact(run(model, zoo.step, batch, ex), reference)
        assert_exact(run(model, zoo.step, batch, ex), reference)
        last = ex.stats.last_step
        assert last.fallbacks == {} and ex.stats.demotions == [] and last.unplanned_reruns == 0
    torch.cuda.synchronize()


def test_cuda_attention_kernels_with_dropout_replay_exactly():
    """SDPA's fused kernels draw their dropout mask from the CUDA generator's philox offset: a replay
    that skipped an earlier random op must still hand each its forward state."""
    model, batch = on_gpu("gpt2-sdpa", torch.bfloat16)
    seen = set()

    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Ops():
        zoo.step(model, batch)
    fused = {n for n in seen if n.startswith("_scaled_dot_product") or n.startswith("_efficient_attention")}
    assert fused, f"no fused attention kernel ran: {sorted(seen)[:20]}"
    reference = run(model, zoo.step, batch)
    prof = profile(model, zoo.step, batch)
    for seed in range(16):
        assert_exact(run(model, zoo.step, batch, ss.apply(model, random_plan(prof, seed), prof, verify=False)),
                     reference)


def test_a_cpu_model_on_a_gpu_machine_takes_the_cpu_path():
    """The device comes from the model's tensors: a CPU model is planned and run on the CPU path."""
    transformers.logging.set_verbosity_error()
    model, batch = zoo.ZOO["gpt2-eager"].build(torch.float32)
    without_caches(model)
    reference = run(model, zoo.step, batch)
    prof = profile(model, zoo.step, batch)
    ex = ss.apply(model, random_plan(prof, 2), prof)
    assert_exact(run(model, zoo.step, batch, ex), reference)
    assert not ex.device.has_streams
