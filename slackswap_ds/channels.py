"""The two transports of `agreement.Channel`: MPI point to point (mpi4py) and the key-value store
of torch.distributed (the TCPStore every `init_process_group` has, whatever the backend).

Neither blocks: a rank that is gone is simply never heard from, and the protocol's deadline names it.
"""

from __future__ import annotations

import time
import zlib
from typing import Sequence

from .agreement import AgreementError

_TAG_BASE, _TAG_SPAN = 7000, 20000  # MPI tags of our messages: MPI guarantees tags up to 32767


class MpiChannel:
    """Messages as MPI point-to-point sends. Messages with one (sender, tag) never overtake each
    other, so successive rounds need no numbering; a name's tag is a hash of the name."""

    def __init__(self, comm=None):
        from mpi4py import MPI

        self.mpi = MPI
        self.comm = comm or MPI.COMM_WORLD
        self.rank, self.world = self.comm.Get_rank(), self.comm.Get_size()
        self._sends: list = []  # (request, buffer): the buffer must live until the send completes
        self._abandoned: list = []  # cancelled sends: MPI may still read their buffers

    @staticmethod
    def tag(name: str) -> int:
        return _TAG_BASE + zlib.crc32(name.encode()) % _TAG_SPAN

    def post(self, name: str, data: bytes, to: Sequence[int]) -> None:
        buf = bytearray(data)
        for r in to:
            self._sends.append((self.comm.Isend([buf, self.mpi.BYTE], dest=r, tag=self.tag(name)), buf))

    def poll(self, name: str, sender: int) -> bytes | None:
        status = self.mpi.Status()
        if not self.comm.Iprobe(source=sender, tag=self.tag(name), status=status):
            return None
        buf = bytearray(status.Get_count(self.mpi.BYTE))
        self.comm.Recv([buf, self.mpi.BYTE], source=sender, tag=self.tag(name))
        return bytes(buf)

    def finish(self, deadline: float) -> None:
        while self._sends and time.monotonic() < deadline:
            self._sends = [(q, b) for q, b in self._sends if not q.Test()]
            time.sleep(0.001)
        for q, _ in self._sends:  # the receiver is gone or stuck: do not wait for it
            q.Cancel()
        # a cancel may fail (a late receiver matched the send first), and MPI reads the buffer
        # until the request completes: keep request and buffer for the channel's life, since
        # freeing them would hand a late receiver garbage
        self._abandoned += self._sends
        self._sends = []


class StoreChannel:
    """Messages as keys of the torch.distributed store: `<prefix>/<round>/<name>/<sender>`. A round
    is one call of the protocol; every rank counts rounds the same way, since every rank runs the
    same sequence of exchanges and agreements (one each per new input shape). Rank 0 deletes a
    round's keys when it ends: by then it has read every other rank's, and every rank that
    acknowledged has read its own, so the store does not grow with each shape."""

    def __init__(self, store=None, rank: int | None = None, world: int | None = None, prefix: str = "slackswap"):
        import torch.distributed as dist

        if store is None:
            from torch.distributed import distributed_c10d

            # the default group's store: the rendezvous store every rank of the job already reaches
            store = distributed_c10d._get_default_store()
        self.store, self.prefix, self.round = store, prefix, 0
        self.rank = dist.get_rank() if rank is None else rank
        self.world = dist.get_world_size() if world is None else world
        self._keys: list[str] = []  # this round's keys this rank wrote or read

    def _key(self, name: str, sender: int) -> str:
        return f"{self.prefix}/{self.round}/{name}/{sender}"

    def post(self, name: str, data: bytes, to: Sequence[int]) -> None:
        key = self._key(name, self.rank)
        try:
            self.store.set(key, data)
        except RuntimeError as e:
            raise self._lost(e) from e
        self._keys.append(key)

    def poll(self, name: str, sender: int) -> bytes | None:
        key = self._key(name, sender)
        try:
            if not self.store.check([key]):
                return None
            data = self.store.get(key)
        except RuntimeError as e:
            raise self._lost(e) from e
        self._keys.append(key)
        return data

    def _lost(self, e: RuntimeError) -> AgreementError:
        # the store lives in rank 0's process (TCPStore): it is gone
        return AgreementError(f"rank {self.rank}: lost the torch.distributed store ({e}); rank 0 exited?")

    def finish(self, deadline: float) -> None:
        if self.rank == 0:
            for key in self._keys:
                try:
                    self.store.delete_key(key)
                except RuntimeError:  # best effort: a leftover key only costs store memory
                    pass
        self._keys = []
        self.round += 1
