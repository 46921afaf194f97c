import pytest

from slackswap_ds.hardware import Hardware, load_hardware
from slackswap_ds.profile import Activation, Op, StepProfile


@pytest.fixture(scope="session")
def a100():
    return load_hardware("a100-80g-pcie4")


def toy_hardware(d2h=10.0, h2d=10.0, duplex_d2h=10.0, duplex_h2d=5.0, latency=0.0) -> Hardware:
    """Integer-friendly rates: bytes per second, so event times can be checked by hand."""
    return Hardware("toy", peak_flops=1e12, matmul_efficiency=1.0, hbm_bytes=1e9, hbm_bps=1e9, d2h_bps=d2h,
                    h2d_bps=h2d, duplex_d2h_bps=duplex_d2h, duplex_h2d_bps=duplex_h2d, copy_latency_s=latency)


def two_region_profile() -> StepProfile:
    """Two regions of two ops (fwd 1 s, bwd 2 s); each region saves x (10 B, its input) and
    y (20 B, recomputable from x by the region's first op)."""
    ops = [Op("r0:0:a", 1, 2, "r0"), Op("r0:1:b", 1, 2, "r0"), Op("r1:0:a", 1, 2, "r1"), Op("r1:1:b", 1, 2, "r1")]
    acts = [
        Activation("r0:x", 10, (0,)),
        Activation("r0:y", 20, (1,), (0,), ("r0:x",)),
        Activation("r1:x", 10, (2,)),
        Activation("r1:y", 20, (3,), (2,), ("r1:x",)),
    ]
    return StepProfile("toy", ops, acts)
