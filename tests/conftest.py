import os
import time
from pathlib import Path

# One thread per test process, set before anything imports torch: the suite's two pytest-xdist
# workers and the ranks of its jobs share the machine's cores, and threads beyond them only spin.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The default planner's exact search stops after 2 s of wall-clock time (planners/refine.py): on a
# machine loaded by two workers and their jobs' ranks, where it stops would vary from run to run, and
# tests that plan the same step twice (a table and its JSON, a rank and its replan) would see two
# plans. 4 s lets the searches the suite plans twice finish (1.2-1.4 s alone, twice that under load); the
# 2 s default itself is tested in tests/planners/test_refine.py.
os.environ.setdefault("SLACKSWAP_PLAN_SEARCH_S", "4")

import pytest  # noqa: E402

from slackswap_ds.hardware import Hardware, load_hardware  # noqa: E402
from slackswap_ds.step_profile import Activation, Op, StepProfile  # noqa: E402

from jobs import free_loopback_port  # noqa: E402


_SESSION_BEGAN = time.time()
WORKERS = 2  # pytest-xdist workers, where it is installed and the command line chose none


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Two workers grouped by `--dist loadgroup` where pytest-xdist is installed, unless the command
    line says how to distribute (`-n`, `--dist`) or not at all (`-p no:xdist`); plain `python -m
    pytest` also works without the plugin (one process). (Runs before xdist's own hook reads them.)"""
    option = config.option
    if hasattr(config, "workerinput") or not config.pluginmanager.hasplugin("xdist"):
        return
    if option.numprocesses is None and option.dist == "no" and not option.collectonly and not option.usepdb:
        option.numprocesses, option.dist = WORKERS, "loadgroup"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """A worker parses the command line it was given, which does not say loadgroup when this file
    chose it: it is told here (xdist names a test by its group only under loadgroup)."""
    node.workerinput["slackswap_loadgroup"] = node.config.option.dist == "loadgroup"


def pytest_configure(config):
    if getattr(config, "workerinput", {}).get("slackswap_loadgroup"):
        config.option.loadgroup = True


def pytest_sessionstart(session):
    global _SESSION_BEGAN
    _SESSION_BEGAN = time.time()


def pytest_sessionfinish(session):
    """No shared memory left behind. DeepSpeed's CPU all-reduce leaves a 67 MB file per rank in
    /dev/shm when its job ends (it never unlinks them), and MPICH leaves its segments behind when a
    rank is killed: a few runs of the suite would fill /dev/shm, and the machine's memory with it. At
    the end of the run, remove the ones made since it began that no process still holds. Under
    pytest-xdist only the controller does, once every worker is done: a worker that swept at its own
    end could take a segment that a job on another worker has made and not yet mapped."""
    if hasattr(session.config, "workerinput"):  # an xdist worker
        return
    shm = Path("/dev/shm")
    leftovers = [*shm.glob("deepspeed_allreduce_buffer_*"), *shm.glob("mpich_shm_*")] if shm.is_dir() else []
    if not leftovers:
        return
    held: set[str] = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            held.update(os.readlink(fd) for fd in (proc / "fd").iterdir())
            held.update(line.split(maxsplit=5)[-1].strip() for line in (proc / "maps").read_text().splitlines()
                        if "/dev/shm/" in line)
        except OSError:
            continue
    for f in leftovers:
        try:
            if f.stat().st_mtime >= _SESSION_BEGAN and str(f) not in held:
                f.unlink()
        except OSError:
            pass


@pytest.fixture(autouse=True)
def emulated_copies_settle():
    """Under SLACKSWAP_ASYNC_EMULATION=1 each test ends with the process device's copies landed, and a
    broken Stream-protocol rule still pending (found by a copy's worker thread) fails the test that
    caused it, not a later one."""
    yield
    from slackswap_ds.runtime.emulation import emulation_requested

    if emulation_requested():
        from slackswap_ds.runtime.device import Device

        if Device._current is not None and Device._current.has_streams:
            Device._current.synchronize()


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


# ---- a real single-rank process group (gloo on 127.0.0.1) for in-process DeepSpeed tests -----
@pytest.fixture(scope="session")
def single_process_group():
    """torch.distributed and deepspeed.comm for one rank on loopback, torn down at the end of the
    session: one group for every test module (DeepSpeed caches groups in `deepspeed.utils.groups`,
    so a second group after a destroyed one is refused as "not registered")."""
    import deepspeed
    import torch.distributed as tdist
    import deepspeed.comm.comm as dcomm

    if tdist.is_initialized():  # someone else's group: use it, leave it
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
        yield
        return
    port = free_loopback_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    saved_env = {k: os.environ.get(k) for k in env}
    saved_cdb = dcomm.cdb
    os.environ.update(env)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
        yield
    finally:
        if tdist.is_initialized():
            tdist.destroy_process_group()
        dcomm.cdb = saved_cdb
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v




# ---- a plan travels once: how often a plan is lowered and simulated ---------------------------
class PlanCounts:
    """Every Schedule made (lower and retrigger both make one) and every simulation, counted by the
    digest of the plan it is of; simulations also by (digest, GPU name): a link share of the
    planning GPU keeps its name, the synchronous-copies check runs on another GPU."""

    def __init__(self, monkeypatch):
        import collections
        import importlib

        from slackswap_ds import simulator

        plan_module = importlib.import_module("slackswap_ds.plan")  # (ss.plan, the function, shadows it)
        self.lowered, self.simulated = collections.Counter(), collections.Counter()
        self.simulated_on = collections.Counter()
        real_schedule, real_simulate_node = plan_module.Schedule, simulator.simulate_node

        def schedule(instrs, act_bytes, plan):
            self.lowered[plan.digest] += 1
            return real_schedule(instrs, act_bytes, plan)

        def simulate_node(schedules, node, **kw):
            self.simulated[schedules[0].plan.digest] += 1
            self.simulated_on[schedules[0].plan.digest, node.gpu.name] += 1
            return real_simulate_node(schedules, node, **kw)

        monkeypatch.setattr(plan_module, "Schedule", schedule)
        monkeypatch.setattr(simulator, "simulate_node", simulate_node)


@pytest.fixture
def plan_counts(monkeypatch) -> PlanCounts:
    return PlanCounts(monkeypatch)
