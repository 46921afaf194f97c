"""What this process finds out about the machine it runs on: the GPU preset to plan for, which GPUs
share a host uplink, this rank's GPU, and whether an MPI launcher started the job."""

from __future__ import annotations

import os

import torch

from .hardware import Hardware, load_hardware, load_node
from .logs import log
from .runtime.device import device_of
from .topology import Topology


MPI_LAUNCH_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")  # set by MPICH/Hydra, Open MPI, PMIx


def resolve_hardware(name: str) -> Hardware:
    """A preset, a path, or "auto": the preset of the CUDA device in use (A100/H100/H200/GH200);
    without one, a100-80g-pcie4 (logged)."""
    if name != "auto":
        return load_hardware(name)
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name().lower()
        total = torch.cuda.get_device_properties(0).total_memory
        for key, preset in (("gh200", "gh200"), ("h200", "h200-pcie5"), ("h100", "h100-pcie5")):
            if key in device:
                return load_hardware(preset)
        if "a100" in device:
            return load_hardware("a100-80g-pcie4" if total > 50e9 else "a100-40g-pcie4")
        log.warning("slackswap: no hardware preset for %r; planning for a100-80g-pcie4", device)
    else:
        log.info("slackswap: no CUDA device; planning for a100-80g-pcie4 (set \"hardware\" to choose)")
    return load_hardware("a100-80g-pcie4")


def device_room(module: torch.nn.Module, hw: Hardware, zero: int, dp: int) -> tuple[int, int, str]:
    """(the device's memory, what the model state takes of it, how that was found) for an "auto"
    budget. On a GPU the allocator says: what is allocated now (weights, gradients, optimizer state:
    the step's saved tensors are gone by then) beside the device's total, and memory the allocator
    holds unused counts as free. On a CPU the `hw` preset's memory, and the model state at 16 B per
    parameter, sharded by ZeRO (budget.model_state_bytes)."""
    from .budget import model_state_bytes

    device = device_of(module)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(total), int(total - free - unused), "measured by the allocator"
    params = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())  # (ZeRO-3: partitioned)
    return int(hw.hbm_bytes), model_state_bytes(params, zero, dp), (
        f"{hw.name}'s memory; model state at 16 B per parameter, ZeRO stage {zero} over {dp} rank(s)")


def host_uplinks(node: str | None, hw: Hardware) -> tuple[Topology, float]:
    """(this node's Topology, the rate of one host uplink per direction): the `node` preset's;
    else discovered on a CUDA machine (a shared uplink taken as fast as one GPU's link); else (no
    CUDA) every GPU its own link."""
    from . import topology

    if node is not None:
        preset = load_node(node)
        return topology.from_node(preset), preset.switch_uplink_bps
    link = max(hw.d2h_bps, hw.h2d_bps)
    if torch.cuda.is_available():
        found = topology.discover(pci_bus_ids())
        if found.source.startswith("default"):
            log.info("slackswap: host uplinks not discovered (%s); every GPU plans with its own link", found.source)
        return found, link
    return topology.default(int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)), link


def gpu_index() -> int:
    """This rank's GPU on its node: the CUDA device, else the local rank."""
    if torch.cuda.is_available():
        return torch.cuda.current_device()
    return int(os.environ.get("LOCAL_RANK") or 0)


def pci_bus_ids() -> list[str] | None:
    """PCI bus ids of the visible CUDA devices, in ordinal order (None if torch does not say)."""
    ids = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        if not all(hasattr(p, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
            return None
        ids.append(f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0")
    return ids


def mpi_launched() -> bool:
    return any(v in os.environ for v in MPI_LAUNCH_VARS)


def has_mpi4py() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = ["MPI_LAUNCH_VARS", "gpu_index", "has_mpi4py", "host_uplinks", "mpi_launched", "pci_bus_ids",
           "resolve_hardware"]
