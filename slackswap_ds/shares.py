"""A rank's share of its node: the copy rates it may plan with and the host bytes it may pin.

Ranks on one node share its PCIe switches' uplinks and its pinned host memory. `split_node` is the
one policy that divides them (an uplink evenly among the GPUs behind it; the pool max-min fairly by
demand, `water_fill`); `tightest` is the share every replica of one plan can honour. A planner plans
with a `Share` (`PRIVATE`: the GPU's own link, no pool limit) and checks its plans on
`Share.limit(hw)`. Torch-free.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Sequence

from .hardware import Hardware, Node


@dataclass(frozen=True)
class Share:
    """One rank's share of its node: copy rates it may plan with and host bytes it may pin.

    `None` rates mean the GPU's own (a private link); `None` host bytes means unlimited."""

    d2h_bps: float | None = None
    h2d_bps: float | None = None
    host_pool_bytes: int | None = None

    @classmethod
    def of_node(cls, node: Node, host_pool_bytes: int | None = None) -> "Share":
        """One GPU's share of `node` when every GPU wants as much as the others: `split_node` with
        the node's switches and equal (unknown) demands."""
        pool = host_pool_bytes if host_pool_bytes is not None else int(node.host_bytes)
        uplinks = [node.switch_of(g) for g in range(node.gpus)]
        return split_node(uplinks, [None] * node.gpus, node.gpu, node.switch_uplink_bps, pool)[0]

    def describe(self) -> str:
        """`d2h <B/s> h2d <B/s> pool <bytes>` ("None" where unlimited): how a plan file records the
        share its plan was made on (plan_file.MadeFor.share); `parse` reads it back exactly."""
        return f"d2h {self.d2h_bps} h2d {self.h2d_bps} pool {self.host_pool_bytes}"

    @classmethod
    def parse(cls, text: str) -> "Share":
        """The share `describe` wrote; ValueError if `text` is not one."""
        match = re.fullmatch(r"d2h (\S+) h2d (\S+) pool (\S+)", text)
        if match is None:
            raise ValueError(f"not a share: {text!r} (expected 'd2h <B/s> h2d <B/s> pool <bytes>')")
        d2h, h2d, pool = (None if v == "None" else v for v in match.groups())
        return cls(None if d2h is None else float(d2h), None if h2d is None else float(h2d),
                   None if pool is None else int(pool))

    def limit(self, hw: Hardware) -> Hardware:
        """`hw` as this rank sees it: every copy rate capped by its share of the link. Planners
        check their plans on this, so a plan made for a shared link fits when the link is shared."""
        if self.d2h_bps is None and self.h2d_bps is None:
            return hw
        d2h, h2d = self.d2h(hw), self.h2d(hw)
        return dataclasses.replace(hw, d2h_bps=d2h, h2d_bps=h2d, duplex_d2h_bps=min(hw.duplex_d2h_bps, d2h),
                                   duplex_h2d_bps=min(hw.duplex_h2d_bps, h2d))

    def beside_zero_offload(self, hw: Hardware, pinned_bytes: int) -> "Share":
        """This share while DeepSpeed's ZeRO-Offload runs on the same GPU: it copies gradients to
        the host during backward, when prefetches run, so those move at the GPU's duplex
        host-to-device rate; and it pins `pinned_bytes` of optimizer state in the host memory the
        pool comes from."""
        pool = self.host_pool_bytes
        return Share(self.d2h_bps, min(self.h2d(hw), hw.duplex_h2d_bps),
                     None if pool is None else max(0, pool - int(pinned_bytes)))

    def d2h(self, hw: Hardware) -> float:
        return hw.d2h_bps if self.d2h_bps is None else min(hw.d2h_bps, self.d2h_bps)

    def h2d(self, hw: Hardware) -> float:
        return hw.h2d_bps if self.h2d_bps is None else min(hw.h2d_bps, self.h2d_bps)


PRIVATE = Share()


def water_fill(capacity: int, demands: Sequence[int | None]) -> list[int]:
    """Max-min fair split of `capacity` whole units: nobody gets more than its demand (None = no
    limit), and what a small demand leaves is shared by the others."""
    share = [0] * len(demands)
    todo = sorted(range(len(demands)), key=lambda i: (demands[i] is None, demands[i] or 0))
    left = capacity
    while todo:
        fair = left // len(todo)
        i = todo[0]
        if demands[i] is not None and demands[i] <= fair:
            share[i] = demands[i]
            left -= demands[i]
            todo.pop(0)
            continue
        for i in todo:
            share[i] = fair
        break
    return share


def split_node(uplinks: Sequence[int], demands: Sequence[int | None], gpu: Hardware, uplink_bps: float,
               host_pool_bytes: int | None) -> list[Share]:
    """Each local rank's Share of one node: the one policy for links and the pinned pool.

    A host uplink's rate is split evenly among the ranks behind it (capped by the GPU's own rates);
    the pool is split max-min fairly by demand (`water_fill`: everyone gets its demand when they
    all fit; otherwise small demands are met and the rest is shared equally). `demands` are bytes
    each rank may want to pin, None when unknown (an equal share)."""
    if len(uplinks) != len(demands):
        raise ValueError(f"need one demand per local rank ({len(uplinks)}), got {len(demands)}")
    if any(d is not None and d < 0 for d in demands):
        raise ValueError(f"demands must be >= 0 bytes, got {list(demands)}")
    pools: list[int | None] = [None] * len(demands)
    if host_pool_bytes is not None:
        pools = water_fill(int(host_pool_bytes), demands)
    shares = []
    for uplink, pool in zip(uplinks, pools):
        link = uplink_bps / sum(1 for u in uplinks if u == uplink)
        shares.append(Share(min(gpu.d2h_bps, link), min(gpu.h2d_bps, link), pool))
    return shares


def tightest(shares: Sequence[Share]) -> Share:
    """The Share every rank can honour: the least link rate and pool of any (None = unlimited)."""
    def least(values):
        known = [v for v in values if v is not None]
        return min(known) if known else None

    return Share(least(s.d2h_bps for s in shares), least(s.h2d_bps for s in shares),
                 least(s.host_pool_bytes for s in shares))


__all__ = ["PRIVATE", "Share", "split_node", "tightest", "water_fill"]
