"""Which local GPUs share a PCIe uplink to the host, and which socket (NUMA node) each sits on.

A rank's share of host bandwidth depends on who else copies over the same link: on a DGX A100 the
GPU pairs 0-1, 2-3, 4-5, 6-7 each sit behind one PCIe switch whose single uplink to a CPU root port
they share, and four GPUs share each socket's memory. This module finds that out on the machine at
hand (NVML, then sysfs, then ``nvidia-smi topo -m``), or takes it from a `hardware.Node` preset.

Stdlib only, no torch, and nothing probed at import: discovery runs only when asked, never raises,
and falls back to `default` (every GPU on a private link), saying why in `Topology.source`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from .hardware import Node

# Pairwise relations, from closest to farthest; NVML levels and nvidia-smi tokens both map onto these.
UPLINK, SOCKET, SYSTEM = 0, 1, 2  # same host uplink / same socket, other uplink / other socket
_SMI_RELATION = {"PIX": UPLINK, "PXB": UPLINK, "PHB": SOCKET, "NODE": SOCKET, "SYS": SYSTEM, "SOC": SYSTEM}


@dataclass(frozen=True)
class Topology:
    """Which host uplink (switch group) and socket each local GPU (CUDA ordinal order) uses.

    Ids are numbered 0, 1, ... in order of first appearance, so two topologies describing the same
    grouping compare equal whatever the machine's own numbering was."""

    uplink_of: tuple[int, ...]  # per GPU: id of the uplink group it shares
    socket_of: tuple[int, ...]  # per GPU: NUMA node / socket id (0 when unknown)
    source: str  # how it was found: "nvml", "sysfs", "nvidia-smi", "node:<preset>", "default ..."

    def __post_init__(self) -> None:
        object.__setattr__(self, "uplink_of", tuple(self.uplink_of))
        object.__setattr__(self, "socket_of", tuple(self.socket_of))
        up, so = self.uplink_of, self.socket_of
        if not up or len(up) != len(so):
            raise ValueError(f"topology needs one uplink and one socket per GPU (at least one GPU); "
                             f"got {len(up)} uplinks and {len(so)} sockets")
        for name, ids in (("uplink_of", up), ("socket_of", so)):
            if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
                raise ValueError(f"topology {name} must hold non-negative ints, got {ids}")
            if _first_appearance(ids) != ids:
                raise ValueError(f"topology {name} must number ids 0, 1, ... in order of first appearance, "
                                 f"got {ids}")
        for g, (u, s) in enumerate(zip(up, so)):
            if so[up.index(u)] != s:  # one uplink ends at one root port, which belongs to one socket
                raise ValueError(f"GPU {g} shares uplink {u} with GPU {up.index(u)} but not its socket")

    @property
    def gpus(self) -> int:
        return len(self.uplink_of)

    def sharing_uplink(self, gpu: int) -> tuple[int, ...]:
        """The GPUs (`gpu` included) whose host copies contend on `gpu`'s uplink."""
        if not 0 <= gpu < self.gpus:
            raise IndexError(f"GPU {gpu} out of range: this topology has {self.gpus} GPUs")
        return tuple(g for g, u in enumerate(self.uplink_of) if u == self.uplink_of[gpu])


def _first_appearance(keys: Sequence) -> tuple[int, ...]:
    """Renumber hashable keys 0, 1, ... in the order they first appear."""
    ids: dict = {}
    return tuple(ids.setdefault(k, len(ids)) for k in keys)


def from_node(node: Node, gpus: int | None = None) -> Topology:
    """The first `gpus` GPUs (all by default) of a `hardware.Node` preset, laid out as it says."""
    n = node.gpus if gpus is None else gpus
    if not 1 <= n <= node.gpus:
        raise ValueError(f"node {node.name!r} has {node.gpus} GPUs; cannot describe {n}")
    uplinks = [g // node.gpus_per_switch for g in range(n)]
    return Topology(tuple(uplinks), tuple(u // node.switches_per_socket for u in uplinks), f"node:{node.name}")


def default(gpus: int, why: str = "") -> Topology:
    """What we assume when nothing can be discovered: every GPU on a private link, one socket.
    Optimistic on purpose: it is what a single-GPU run or a workstation really has; a shared uplink
    wrongly taken as private makes a plan count on slack it lacks (slower steps, not wrong results)."""
    if gpus < 1:
        raise ValueError(f"default topology needs at least one GPU, got {gpus}")
    return Topology(tuple(range(gpus)), (0,) * gpus, f"default ({why})" if why else "default")


_ROOT_COMPLEX = re.compile(r"pci[0-9a-f]{4,}:[0-9a-f]{2}")


def from_pci_paths(paths: Sequence[str], numa: Sequence[int | None] | None = None) -> Topology:
    """Group GPUs by their resolved sysfs device paths (pure; `from_sysfs` gathers the inputs).

    Rule: the uplink of a GPU is the first component below its (innermost) ``pciDDDD:BB`` root
    complex component. Below a root complex every link into the host starts at a root port, and
    whatever hangs below one root port (a switch, or two levels of them) shares that port's link.
    If the GPU itself is that first component (a root-complex integrated device, as in many VMs) it
    is its own uplink, which the same rule yields. `numa`: per GPU NUMA node, None or -1 when
    unknown; unknown counts as socket 0 (the first known node is renumbered 0 as well)."""
    numa = [None] * len(paths) if numa is None else list(numa)
    if len(numa) != len(paths):
        raise ValueError(f"got {len(paths)} PCI paths but {len(numa)} NUMA nodes")
    if len(set(paths)) != len(paths):
        raise ValueError(f"the same PCI device path appears twice: {list(paths)}")
    keys = []
    for path in paths:
        parts = [p for p in path.lower().split("/") if p]
        roots = [i for i, p in enumerate(parts) if _ROOT_COMPLEX.fullmatch(p)]
        if not roots or roots[-1] + 1 >= len(parts):
            raise ValueError(f"{path!r} is not a PCI device path below a 'pciDDDD:BB' root complex")
        keys.append("/".join(parts[: roots[-1] + 2]))  # up to and including the root port
    ids: dict[int, int] = {}
    sockets = tuple(ids.setdefault(n, len(ids)) if n is not None and n >= 0 else 0 for n in numa)
    return Topology(_first_appearance(keys), sockets, "sysfs")


_BUS_ID = re.compile(r"(?:([0-9a-f]{1,8}):)?([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])")


def normalize_bus_id(bus_id: str) -> str:
    """A bus id as NVML and nvidia-smi write it ("00000000:07:00.0") or without domain ("07:00.0"),
    in sysfs's spelling ("0000:07:00.0": lower case, at least 4 domain digits)."""
    m = _BUS_ID.fullmatch(bus_id.strip().lower())
    if not m:
        raise ValueError(f"not a PCI bus id: {bus_id!r} (expected e.g. '0000:07:00.0')")
    domain, bus, dev, fn = m.groups()
    return f"{int(domain or '0', 16):04x}:{bus}:{dev}.{fn}"


def from_sysfs(bus_ids: Sequence[str], sysfs_root: str = "/sys/bus/pci/devices") -> Topology | None:
    """Topology of the GPUs with these PCI bus ids (in that order) from Linux sysfs; None if any
    device is missing there or its path is not recognised."""
    paths, numa = [], []
    for bus_id in bus_ids:
        link = os.path.join(sysfs_root, normalize_bus_id(bus_id))
        if not os.path.exists(link):
            return None
        paths.append(os.path.realpath(link))
        try:
            with open(os.path.join(link, "numa_node")) as f:
                numa.append(int(f.read().strip()))
        except (OSError, ValueError):
            numa.append(None)  # no NUMA info (single-socket kernels, some VMs): unknown
    try:
        return from_pci_paths(paths, numa)
    except ValueError:
        return None


def from_relations(rel: Sequence[Sequence[int]], source: str) -> Topology:
    """Topology from a pairwise UPLINK / SOCKET / SYSTEM matrix (diagonal ignored): GPUs joined by
    UPLINK share an uplink, by anything closer than SYSTEM a socket (transitively)."""
    n = len(rel)

    def groups(joined: Callable[[int], bool]) -> tuple[int, ...]:
        label = list(range(n))  # connected components by repeated relabelling: n is a handful of GPUs
        for _ in range(n):
            for i in range(n):
                for j in range(n):
                    if i != j and joined(rel[i][j]):
                        label[i] = label[j] = min(label[i], label[j])
        return _first_appearance(label)

    return Topology(groups(lambda r: r == UPLINK), groups(lambda r: r != SYSTEM), source)


def from_nvml_levels(levels: Sequence[Sequence[int]]) -> Topology:
    """NVML common-ancestor levels (nvmlGpuTopologyLevel_t) per GPU pair: INTERNAL (0), SINGLE (10)
    and MULTIPLE (20) switches stay below the root port -> same uplink; HOSTBRIDGE (30) and
    NODE (40) -> same socket; SYSTEM (50) -> other socket."""
    return from_relations([[UPLINK if v <= 20 else SOCKET if v <= 40 else SYSTEM for v in row]
                           for row in levels], "nvml")


def from_nvml(bus_ids: Sequence[str] | None = None) -> Topology | None:
    """Ask NVML (the optional `pynvml` / nvidia-ml-py package) about the GPUs with these bus ids,
    or all GPUs in NVML (PCI bus) order. None when pynvml, the driver or a query is unavailable."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # not installed, no driver, no GPU: nothing to ask
        return None
    try:
        if bus_ids is None:
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        else:
            handles = [pynvml.nvmlDeviceGetHandleByPciBusId(normalize_bus_id(b)) for b in bus_ids]
        levels = [[0 if i == j else int(pynvml.nvmlDeviceGetTopologyCommonAncestor(a, b))
                   for j, b in enumerate(handles)] for i, a in enumerate(handles)]
        return from_nvml_levels(levels)
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_GPU = re.compile(r"GPU\d+")


def parse_nvidia_smi_topo(text: str) -> Topology | None:
    """Parse ``nvidia-smi topo -m``. PIX/PXB between GPUs -> same uplink, PHB/NODE -> same socket,
    SYS -> other socket; sockets from the "NUMA Affinity" column when every GPU has one. None when
    no GPU matrix is found, a cell is unknown, or any GPU pair is NVLinked (NV#): then nvidia-smi
    shows only the NVLink and hides the PCIe relation, and guessing would be worse than falling back."""
    header: list[str] | None = None
    extras: list[str] = []
    rows: dict[str, list[str]] = {}
    for line in _ANSI.sub("", text).splitlines():
        tokens = line.split()
        if not tokens:
            continue
        if tokens[0].startswith("Legend"):
            break
        if header is None:
            if _GPU.fullmatch(tokens[0]):  # the header row: device columns, then affinity columns
                cut = tokens.index("CPU") if "CPU" in tokens else len(tokens)
                header = tokens[:cut]
                extras = re.findall(r"CPU Affinity|NUMA Affinity|GPU NUMA ID", " ".join(tokens[cut:]))
        elif _GPU.fullmatch(tokens[0]):  # NIC / mlx5_* rows are skipped; their columns are ignored
            rows[tokens[0]] = tokens[1:]
    gpu_cols = [i for i, name in enumerate(header or []) if _GPU.fullmatch(name)]
    if not gpu_cols or any(header[i] not in rows or len(rows[header[i]]) < len(header) for i in gpu_cols):
        return None
    rel = []
    for i in gpu_cols:
        cells = [rows[header[i]][j] for j in gpu_cols]
        if any(c not in _SMI_RELATION for a, c in zip(gpu_cols, cells) if a != i):
            return None  # NV# (NVLink, hiding the PCIe relation) or a token we do not know
        rel.append([_SMI_RELATION.get(c, UPLINK) for c in cells])
    topo = from_relations(rel, "nvidia-smi")
    if "NUMA Affinity" in extras:
        k = len(header) + extras.index("NUMA Affinity")
        numa = [rows[header[i]][k] if k < len(rows[header[i]]) else "" for i in gpu_cols]
        if all(v.isdigit() for v in numa):
            try:
                return Topology(topo.uplink_of, _first_appearance(numa), "nvidia-smi")
            except ValueError:
                pass  # NUMA column disagrees with the matrix: trust the matrix
    return topo


def discover(bus_ids: Sequence[str] | None = None, run=subprocess.run, *,
             sysfs_root: str = "/sys/bus/pci/devices") -> Topology:
    """This machine's topology for the GPUs with these PCI bus ids (CUDA ordinal order), or for
    all GPUs when None. Tries NVML, sysfs (needs bus ids), then ``nvidia-smi topo -m`` (in
    nvidia-smi's PCI order: used only when no bus ids are given or the GPU counts agree), else
    `default`. Never raises; a fallback's `source` says why each step was skipped."""
    why = []
    try:
        topo = from_nvml(bus_ids)
        if topo is not None:
            return topo
        why.append("no NVML")
        if bus_ids:
            topo = from_sysfs(bus_ids, sysfs_root)
            if topo is not None:
                return topo
            why.append("sysfs paths missing or unrecognised")
        else:
            why.append("no sysfs paths")
        if shutil.which("nvidia-smi") is None:
            why.append("no nvidia-smi")
        else:
            out = run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=10, check=False)
            topo = parse_nvidia_smi_topo(out.stdout or "") if out.returncode == 0 else None
            if topo is not None and (not bus_ids or topo.gpus == len(bus_ids)):
                return topo
            why.append(f"nvidia-smi topo failed (exit {out.returncode})" if out.returncode else
                       "nvidia-smi topo unusable (NVLink hides PCIe, or unknown format)" if topo is None else
                       f"nvidia-smi shows {topo.gpus} GPUs, not {len(bus_ids)}")
    except Exception as e:  # discovery is advisory: any surprise falls back rather than stopping training
        why.append(f"discovery error: {type(e).__name__}: {e}")
    return default(len(bus_ids) if bus_ids else 1, ", ".join(why))
