"""Tests for slackswap_ds.topology: presets, PCI path grouping, a fake sysfs tree, nvidia-smi
output parsing (samples written in the real `nvidia-smi topo -m` layout), and discovery fallbacks."""

import importlib.util
import os
import shutil
import subprocess
import sys
import time

import pytest

from slackswap_ds import topology as topo
from slackswap_ds.hardware import load_node
from slackswap_ds.topology import Topology

# ---- presets and default --------------------------------------------------------------------------


def test_from_node_dgx_a100():
    t = topo.from_node(load_node("dgx-a100"))
    assert t.uplink_of == (0, 0, 1, 1, 2, 2, 3, 3)
    assert t.socket_of == (0, 0, 0, 0, 1, 1, 1, 1)
    assert t.source == "node:dgx-a100" and t.gpus == 8
    assert t.sharing_uplink(5) == (4, 5)


def test_from_node_subset_and_range():
    node = load_node("dgx-a100")
    assert topo.from_node(node, 3).uplink_of == (0, 0, 1)
    for bad in (0, 9):
        with pytest.raises(ValueError, match="8 GPUs"):
            topo.from_node(node, bad)


def test_default_is_private_links_on_one_socket():
    t = topo.default(4)
    assert t == Topology((0, 1, 2, 3), (0, 0, 0, 0), "default")
    assert all(t.sharing_uplink(g) == (g,) for g in range(4))
    assert topo.default(1, "why").source == "default (why)"
    with pytest.raises(ValueError, match="at least one GPU"):
        topo.default(0)


# ---- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "uplinks, sockets, message",
    [
        ((0, 1), (0,), "one uplink and one socket per GPU"),
        ((), (), "at least one GPU"),
        ((0, -1), (0, 0), "non-negative ints"),
        ((0, True), (0, 0), "non-negative ints"),
        ((0, 1.0), (0, 0), "non-negative ints"),
        ((1, 0), (0, 0), "order of first appearance"),
        ((0, 0), (0, 2), "order of first appearance"),
        ((0, 0), (0, 1), "shares uplink 0 with GPU 0 but not its socket"),
    ],
)
def test_validation(uplinks, sockets, message):
    with pytest.raises(ValueError, match=message):
        Topology(uplinks, sockets, "test")


def test_lists_become_tuples_and_index_is_checked():
    t = Topology([0, 0, 1], [0, 0, 0], "test")
    assert t.uplink_of == (0, 0, 1) and isinstance(t.socket_of, tuple)
    with pytest.raises(IndexError, match="3 GPUs"):
        t.sharing_uplink(3)


# ---- PCI paths ------------------------------------------------------------------------------------

# DGX A100-like: each GPU pair behind two levels of PCIe switches (upstream/downstream ports) on one
# root port of its own root complex; sockets 0 (root complexes 00, 40) and 1 (80, c0).
_SWITCHES = "{d}:{b0}:00.0/{d}:{b1}:08.0/{d}:{b2}:00.0/{d}:{b3}:{slot}.0"
DGX_PATHS = []
for _rc in ("00", "40", "80", "c0"):
    _b = int(_rc, 16)
    for _slot, _gpu in (("10", _b + 7), ("14", _b + 15)):
        _sw = _SWITCHES.format(d="0000", b0=f"{_b + 1:02x}", b1=f"{_b + 2:02x}", b2=f"{_b + 3:02x}",
                               b3=f"{_b + 4:02x}", slot=_slot)
        DGX_PATHS.append(f"/sys/devices/pci0000:{_rc}/0000:{_rc}:01.1/{_sw}/0000:{_gpu:02x}:00.0")


def test_from_pci_paths_dgx_like():
    assert DGX_PATHS[0] == ("/sys/devices/pci0000:00/0000:00:01.1/0000:01:00.0/0000:02:08.0/0000:03:00.0/"
                            "0000:04:10.0/0000:07:00.0")
    t = topo.from_pci_paths(DGX_PATHS, [0, 0, 0, 0, 1, 1, 1, 1])
    assert t == Topology((0, 0, 1, 1, 2, 2, 3, 3), (0, 0, 0, 0, 1, 1, 1, 1), "sysfs")
    assert t.sharing_uplink(6) == (6, 7)


def test_from_pci_paths_workstation_each_gpu_on_its_own_root_port():
    paths = [
        "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0",  # root port 01.0 -> GPU
        "/sys/devices/pci0000:00/0000:00:01.1/0000:02:00.0",  # same root complex, other root port
        "/sys/devices/pci0000:00/0000:00:03.1/0000:0a:00.0",
    ]
    t = topo.from_pci_paths(paths)  # no NUMA info: all socket 0
    assert t == Topology((0, 1, 2), (0, 0, 0), "sysfs")


def test_from_pci_paths_root_complex_integrated_gpus_each_own_uplink():
    # as in many VMs: the GPUs sit directly on the root complex, with no root port above them
    paths = ["/sys/devices/pci0000:00/0000:00:05.0", "/sys/devices/pci0000:00/0000:00:06.0",
             "/sys/devices/pci0000:00/0000:00:07.0/0000:01:00.0"]
    assert topo.from_pci_paths(paths).uplink_of == (0, 1, 2)


def test_from_pci_paths_uses_innermost_root_complex():
    # a GPU behind an Intel VMD domain: the nested pci10000:e0 root complex's root ports are the links
    vmd = "/sys/devices/pci0000:00/0000:00:0e.0/pci10000:e0/10000:e0:{port}/10000:{bus}:00.0"
    paths = [vmd.format(port="06.0", bus="e1"), vmd.format(port="07.0", bus="e2")]
    assert topo.from_pci_paths(paths).uplink_of == (0, 1)


def test_from_pci_paths_numa_renumbering_and_unknown():
    paths = [f"/sys/devices/pci0000:{rc}/0000:{rc}:01.0/0000:{rc[0]}1:00.0" for rc in ("80", "00", "40")]
    assert topo.from_pci_paths(paths, [1, 0, 0]).socket_of == (0, 1, 1)  # first seen socket is 0
    assert topo.from_pci_paths(paths, [-1, None, -1]).socket_of == (0, 0, 0)


def test_from_pci_paths_errors():
    with pytest.raises(ValueError, match="root complex"):
        topo.from_pci_paths(["/sys/devices/platform/gpu0"])
    with pytest.raises(ValueError, match="root complex"):
        topo.from_pci_paths(["/sys/devices/pci0000:00"])
    with pytest.raises(ValueError, match="2 PCI paths but 1 NUMA"):
        topo.from_pci_paths(DGX_PATHS[:2], [0])
    with pytest.raises(ValueError, match="appears twice"):
        topo.from_pci_paths([DGX_PATHS[0], DGX_PATHS[0]])


@pytest.mark.parametrize(
    "raw, expected",
    [("00000000:07:00.0", "0000:07:00.0"), ("0000:4E:00.0", "0000:4e:00.0"), ("07:00.0", "0000:07:00.0"),
     ("00010000:e1:00.0", "10000:e1:00.0"), (" 0000:c7:00.1\n", "0000:c7:00.1")],
)
def test_normalize_bus_id(raw, expected):
    assert topo.normalize_bus_id(raw) == expected


def test_normalize_bus_id_rejects_garbage():
    with pytest.raises(ValueError, match="not a PCI bus id"):
        topo.normalize_bus_id("GPU-1234")


# ---- sysfs ----------------------------------------------------------------------------------------


def fake_sysfs(root, paths, numa):
    """A sysfs-like tree: real device directories under devices/ with numa_node files (None: no file),
    and bus/pci/devices/<bus id> relative symlinks to them, as the kernel lays them out."""
    devices = root / "bus" / "pci" / "devices"
    devices.mkdir(parents=True)
    for path, node in zip(paths, numa):
        rel = path.removeprefix("/sys/")
        target = root / rel
        target.mkdir(parents=True)
        if node is not None:
            (target / "numa_node").write_text(f"{node}\n")
        os.symlink(os.path.join("..", "..", "..", rel), devices / os.path.basename(path))
    return str(devices)


def test_from_sysfs_fake_tree(tmp_path):
    numa = [0, 0, 0, 0, 1, 1, 1, 1]
    root = fake_sysfs(tmp_path, DGX_PATHS, numa)
    bus_ids = [os.path.basename(p).upper().replace("0000:", "00000000:", 1) for p in DGX_PATHS]
    assert bus_ids[1] == "00000000:0F:00.0"  # NVML / nvidia-smi spelling
    t = topo.from_sysfs(bus_ids, root)
    assert t == Topology((0, 0, 1, 1, 2, 2, 3, 3), (0, 0, 0, 0, 1, 1, 1, 1), "sysfs")
    # CUDA order need not be PCI order: results follow the order of the bus ids given
    t = topo.from_sysfs([bus_ids[i] for i in (6, 0, 7, 1)], root)
    assert t == Topology((0, 1, 0, 1), (0, 1, 0, 1), "sysfs")


def test_from_sysfs_numa_unknown_and_missing(tmp_path):
    paths = DGX_PATHS[:3]
    root = fake_sysfs(tmp_path, paths, [-1, None, 1])
    bus_ids = [os.path.basename(p) for p in paths]
    t = topo.from_sysfs(bus_ids, root)
    assert t.uplink_of == (0, 0, 1) and t.socket_of == (0, 0, 0)
    assert topo.from_sysfs(bus_ids + ["0000:ee:00.0"], root) is None
    assert topo.from_sysfs(bus_ids, str(tmp_path / "nowhere")) is None


# ---- NVML levels ----------------------------------------------------------------------------------


def test_from_nvml_levels():
    # 0-1 share a switch (SINGLE), 2 hangs off the same host bridge (HOSTBRIDGE) and 3 is on the
    # other socket (SYSTEM)
    levels = [[0, 10, 30, 50],
              [10, 0, 30, 50],
              [30, 30, 0, 50],
              [50, 50, 50, 0]]
    assert topo.from_nvml_levels(levels) == Topology((0, 0, 1, 2), (0, 0, 0, 1), "nvml")
    dgx = [[0 if i == j else 20 if i // 2 == j // 2 else 40 if i // 4 == j // 4 else 50 for j in range(8)]
           for i in range(8)]
    assert topo.from_nvml_levels(dgx) == Topology((0, 0, 1, 1, 2, 2, 3, 3), (0, 0, 0, 0, 1, 1, 1, 1), "nvml")
    assert topo.from_nvml_levels([[0, 0], [0, 0]]).uplink_of == (0, 0)  # INTERNAL: dual-GPU board


@pytest.mark.skipif(importlib.util.find_spec("pynvml") is not None, reason="pynvml installed")
def test_from_nvml_without_pynvml_is_none():
    assert topo.from_nvml() is None
    assert topo.from_nvml(["0000:07:00.0"]) is None


# ---- nvidia-smi topo -m ---------------------------------------------------------------------------

LEGEND = """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""

# A 2-socket PCIe server: GPUs 0-1 on one switch (PIX), GPUs 2-3 behind two switch levels (PXB),
# NIC0 on socket 0 under another host bridge (NODE), NIC1 next to GPUs 2-3. Header underlined.
PCIE_SERVER = (
    "\t\x1b[4mGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
    "\x1b[1mGPU0\x1b[0m\t X \tPIX\tSYS\tSYS\tNODE\tSYS\t0-15,32-47\t0\t\tN/A\n"
    "\x1b[1mGPU1\x1b[0m\tPIX\t X \tSYS\tSYS\tNODE\tSYS\t0-15,32-47\t0\t\tN/A\n"
    "\x1b[1mGPU2\x1b[0m\tSYS\tSYS\t X \tPXB\tSYS\tPXB\t16-31,48-63\t1\t\tN/A\n"
    "\x1b[1mGPU3\x1b[0m\tSYS\tSYS\tPXB\t X \tSYS\tPXB\t16-31,48-63\t1\t\tN/A\n"
    "\x1b[1mNIC0\x1b[0m\tNODE\tNODE\tSYS\tSYS\t X \tSYS\t\t\t\t\n"
    "\x1b[1mNIC1\x1b[0m\tSYS\tSYS\tPXB\tPXB\tSYS\t X \t\t\t\t\n"
    + LEGEND
    + "\nNIC Legend:\n\n  NIC0: mlx5_0\n  NIC1: mlx5_1\n\n"
)

# DGX A100: every GPU pair NVLinked through NVSwitch, which hides the PCIe relation
_DGX_ROWS = "".join(
    f"GPU{i}\t" + "\t".join(" X " if i == j else "NV12" for j in range(8))
    + "\t" + "\t".join("PXB" if i // 2 == k else "SYS" for k in range(4))
    + ("\t48-63,176-191\t3\t\tN/A\n" if i < 4 else "\t112-127,240-255\t7\t\tN/A\n")
    for i in range(8)
)
DGX = ("\t\x1b[4m" + "\t".join(f"GPU{i}" for i in range(8)) + "\tmlx5_0\tmlx5_1\tmlx5_2\tmlx5_3"
       "\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n" + _DGX_ROWS + LEGEND)

# An older driver's layout: mlx5_* columns, no NUMA Affinity column, spaces instead of tabs.
# Single socket workstation-ish box: 0-1 on a PLX switch, 2 on its own root port, 3 on socket 2.
OLD_FORMAT = """        GPU0    GPU1    GPU2    GPU3    mlx5_0  CPU Affinity
GPU0     X      PIX     PHB     SYS     PHB     0-11
GPU1    PIX      X      PHB     SYS     PHB     0-11
GPU2    PHB     PHB      X      SYS     PHB     0-11
GPU3    SYS     SYS     SYS      X      SYS     12-23
mlx5_0  PHB     PHB     PHB     SYS      X
""" + LEGEND


def test_parse_pcie_server():
    t = topo.parse_nvidia_smi_topo(PCIE_SERVER)
    assert t == Topology((0, 0, 1, 1), (0, 0, 1, 1), "nvidia-smi")


def test_parse_numa_affinity_column_is_renumbered():
    swapped = PCIE_SERVER.replace("0-15,32-47\t0", "0-15,32-47\t1").replace("16-31,48-63\t1", "16-31,48-63\t0")
    assert swapped != PCIE_SERVER
    assert topo.parse_nvidia_smi_topo(swapped).socket_of == (0, 0, 1, 1)


def test_parse_nvlink_returns_none():
    assert "NV12" in DGX and "mlx5_3" in DGX
    assert topo.parse_nvidia_smi_topo(DGX) is None


def test_parse_old_format_sockets_from_matrix():
    t = topo.parse_nvidia_smi_topo(OLD_FORMAT)
    assert t == Topology((0, 0, 1, 2), (0, 0, 0, 1), "nvidia-smi")


def test_parse_single_gpu_and_rubbish():
    one = "\t\x1b[4mGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\nGPU0\t X \t0-31\t0\t\tN/A\n" + LEGEND
    assert topo.parse_nvidia_smi_topo(one) == Topology((0,), (0,), "nvidia-smi")
    assert topo.parse_nvidia_smi_topo("No devices were found\n") is None
    assert topo.parse_nvidia_smi_topo("") is None
    assert topo.parse_nvidia_smi_topo(PCIE_SERVER.replace("PIX\t X ", "???\t X ")) is None
    truncated = PCIE_SERVER.split("\n")
    del truncated[3]  # GPU2's row lost
    assert topo.parse_nvidia_smi_topo("\n".join(truncated)) is None


# ---- discover -------------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_discover_on_this_machine_falls_back_to_default():
    start = time.monotonic()
    t = topo.discover()
    assert time.monotonic() - start < 3
    assert t.source.startswith("default") and "no nvidia-smi" in t.source and t.gpus == 1
    t = topo.discover(["0000:07:00.0", "0000:0f:00.0"], sysfs_root="/nonexistent")
    assert t.source.startswith("default") and "sysfs paths missing" in t.source and t.gpus == 2


def test_discover_uses_sysfs_when_bus_ids_given(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # as on a machine without NVML: `import pynvml` fails
    root = fake_sysfs(tmp_path, DGX_PATHS[:4], [0, 0, 0, 0])
    t = topo.discover([os.path.basename(p) for p in DGX_PATHS[:4]], sysfs_root=root)
    assert t == Topology((0, 0, 1, 1), (0, 0, 0, 0), "sysfs")


@pytest.fixture
def fake_nvidia_smi(tmp_path, monkeypatch):
    """A real `nvidia-smi` executable on PATH that prints a chosen output and exit status."""

    def install(output: str, status: int = 0):
        (tmp_path / "out.txt").write_text(output)
        exe = tmp_path / "bin" / "nvidia-smi"
        exe.parent.mkdir(exist_ok=True)
        exe.write_text(f"#!{sys.executable}\nimport sys\n"
                       f"sys.stdout.write(open({str(tmp_path / 'out.txt')!r}).read())\nsys.exit({status})\n")
        exe.chmod(0o755)
        monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ.get('PATH', '')}")

    return install


@pytest.mark.skipif(importlib.util.find_spec("pynvml") is not None, reason="NVML would answer first")
def test_discover_nvidia_smi_paths(fake_nvidia_smi):
    fake_nvidia_smi(PCIE_SERVER)
    assert topo.discover() == Topology((0, 0, 1, 1), (0, 0, 1, 1), "nvidia-smi")
    t = topo.discover(["0000:01:00.0"], sysfs_root="/nonexistent")  # nvidia-smi shows 4 GPUs, not 1
    assert t.source.startswith("default") and "shows 4 GPUs, not 1" in t.source and t.gpus == 1
    fake_nvidia_smi(DGX)
    t = topo.discover()
    assert t.source.startswith("default") and "NVLink" in t.source
    fake_nvidia_smi("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", 9)
    assert "nvidia-smi topo failed (exit 9)" in topo.discover().source


@pytest.mark.skipif(importlib.util.find_spec("pynvml") is not None, reason="NVML would answer first")
def test_discover_never_raises(fake_nvidia_smi):
    fake_nvidia_smi(PCIE_SERVER)

    def hanging(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])

    t = topo.discover(run=hanging)
    assert t.source.startswith("default (no NVML, no sysfs paths, discovery error: TimeoutExpired")
    t = topo.discover(["not a bus id"])
    assert t.source.startswith("default") and "not a PCI bus id" in t.source
