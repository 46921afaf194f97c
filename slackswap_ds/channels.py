"""The two transports of `agreement.Channel`: MPI point to point (mpi4py) and the key-value store
of torch.distributed (the TCPStore every `init_process_group` has, whatever the backend).

Neither blocks: a rank that is gone is simply never heard from, and the protocol's deadline names it.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import zlib
from typing import Callable, Sequence

from .agreement import AgreementError
from .errors import import_extra
from .logs import EVERY_RANK, SayOnce

_TAG_BASE, _TAG_SPAN = 7000, 20000  # MPI tags of our messages: MPI guarantees tags up to 32767
_TAG_SHOUT = _TAG_BASE - 1  # below every message tag: a shout never matches a message


def mpi_module():
    """mpi4py's MPI module; MissingExtraError naming `pip install 'slackswap_ds[mpi]'` if it cannot
    be imported (mpi4py is the `mpi` extra's: a single-node job never needs it)."""
    return import_extra("mpi4py.MPI", "mpi", 'the MPI transport of the plan agreement ("sync": "mpi")')


class MpiChannel:
    """Messages as MPI point-to-point sends. Messages with one (sender, tag) never overtake each
    other, so successive rounds need no numbering; a name's tag is a hash of the name."""

    def __init__(self, comm=None, members: Sequence[int] | None = None):
        MPI = mpi_module()
        self.mpi = MPI
        self.comm = comm or MPI.COMM_WORLD
        self.rank, self.world = self.comm.Get_rank(), self.comm.Get_size()
        self.members = list(members) if members is not None else None  # job ranks of a group's comm
        self._sends: list = []  # (request, buffer): the buffer must live until the send completes
        self._heard: tuple[int, bytes] | None = None

    @staticmethod
    def tag(name: str) -> int:
        return _TAG_BASE + zlib.crc32(name.encode()) % _TAG_SPAN

    def post(self, name: str, data: bytes, to: Sequence[int]) -> None:
        self._send(data, to, self.tag(name))

    def _send(self, data: bytes, to: Sequence[int], tag: int) -> None:
        buf = bytearray(data)
        for r in to:
            self._sends.append((self.comm.Isend([buf, self.mpi.BYTE], dest=r, tag=tag), buf))

    def poll(self, name: str, sender: int) -> bytes | None:
        return self._receive(sender, self.tag(name))

    def _receive(self, sender: int, tag: int) -> bytes | None:
        status = self.mpi.Status()
        if not self.comm.Iprobe(source=sender, tag=tag, status=status):
            return None
        buf = bytearray(status.Get_count(self.mpi.BYTE))
        self.comm.Recv([buf, self.mpi.BYTE], source=status.Get_source(), tag=tag)
        return bytes(buf)

    def shout(self, data: bytes) -> None:
        self._send(data, [r for r in range(self.world) if r != self.rank], _TAG_SHOUT)

    def hear(self) -> tuple[int, bytes] | None:
        if self._heard is None:
            status = self.mpi.Status()
            if self.comm.Iprobe(source=self.mpi.ANY_SOURCE, tag=_TAG_SHOUT, status=status):
                sender = status.Get_source()
                self._heard = (sender, self._receive(sender, _TAG_SHOUT) or b"")
        return self._heard

    def finish(self, deadline: float) -> None:
        # Nothing to wait for: a send reaches a live receiver whether or not its sender waits, and
        # waiting for one to a stopped rank would only delay this rank's own error past the point
        # where a launcher tears the job down. Never MPI_Cancel: cancelling a send that a receiver
        # has already matched crashes MPICH 5.0 (segfault in MPI_Cancel). MPI may read a buffer until
        # its request completes, so unfinished requests and their buffers are kept, and dropped
        # only once complete.
        self._sends = [(q, b) for q, b in self._sends if not q.Test()]


class StoreSilent(AgreementError):
    """The torch.distributed store did not answer in time: its host (rank 0's process) is stopped
    or unreachable."""


class _BoundedCalls:
    """Store calls on one worker thread, each waited for at most `silence_s`. A TCPStore call
    blocks while the process that hosts the store is stopped, whatever the store's own timeout
    (`set_timeout` does not bound `check`: tried with SIGSTOP on torch 2.13), so a call that does
    not return in time is abandoned on its daemon thread, which then never serves again."""

    def __init__(self, silence_s: float):
        self.silence_s = silence_s
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._silent = False
        threading.Thread(target=self._serve, name="slackswap-store", daemon=True).start()

    def _serve(self) -> None:
        while True:
            call, result, done = self._jobs.get()
            try:
                result.append((True, call()))
            except BaseException as e:  # handed to the caller, which re-raises it
                result.append((False, e))
            done.set()

    def __call__(self, call: Callable):
        if self._silent:
            return None, False
        result: list = []
        done = threading.Event()
        self._jobs.put((call, result, done))
        if not done.wait(self.silence_s):
            self._silent = True
            return None, False
        ok, value = result[0]
        if not ok:
            raise value
        return value, True


class StructureLedger:
    """Each rank's profile structure per input shapes, in the torch.distributed store, compared
    lazily: a rank that planned shapes sets its digest for them and reads the digests of the ranks
    that did so before it; those that differ are returned for the caller to log. Nothing waits for
    another rank: a rank that has not published yet is skipped (it compares when it publishes), and
    every store call is bounded as StoreChannel's are (a stopped rank 0 makes the ledger silent)."""

    silence_s = 2.0

    def __init__(self, store=None, rank: int | None = None, world: int | None = None,
                 prefix: str = "slackswap/structure"):
        import torch.distributed as dist

        if store is None:
            from torch.distributed import distributed_c10d

            store = distributed_c10d._get_default_store()
        self.store, self.prefix = store, prefix
        self.rank = dist.get_rank() if rank is None else rank
        self.world = dist.get_world_size() if world is None else world
        self._calls = _BoundedCalls(self.silence_s)
        self.say_once = SayOnce()

    def publish(self, shapes: str, structure: str) -> dict[int, str]:
        """Set this rank's `structure` digest for input shapes `shapes`; every other rank's digest
        for them that differs (rank -> digest), of the ranks that published before this one."""
        key = f"{self.prefix}/{hashlib.sha256(shapes.encode()).hexdigest()[:16]}"

        def theirs(r: int):
            return self.store.get(f"{key}/{r}").decode() if self.store.check([f"{key}/{r}"]) else None

        differ: dict[int, str] = {}
        try:
            _, answered = self._calls(lambda: self.store.set(f"{key}/{self.rank}", structure))
            for r in range(self.world) if answered else ():
                if r != self.rank:
                    value, answered = self._calls(lambda r=r: theirs(r))
                    if not answered:
                        break
                    if value is not None and value != structure:
                        differ[r] = value
            if not answered:
                self._say_silent()
        except RuntimeError:  # the store's host process is gone: nothing to compare with
            pass
        return differ

    def _say_silent(self) -> None:
        """Said once: the comparison stops, and its call is left waiting on its thread. A process
        that exits while a thread waits inside a TCPStore call aborts (SIGABRT, exit status 134 or a
        launcher's 250) even after a finished job (tried on torch 2.13): this line names why."""
        self.say_once("silent", logging.WARNING, "slackswap rank %d: the torch.distributed store did not answer for "
                      "%g s (rank 0's process, which hosts it, is stopped or overloaded): profile structures are no "
                      "longer compared across ranks, and the unanswered call waits on a thread of its own; if this "
                      "process exits while it waits, it ends by SIGABRT after the job's end", self.rank,
                      self.silence_s, extra=EVERY_RANK)


class StoreChannel:
    """Messages as keys of the torch.distributed store: `<prefix>/<round>/<name>/<sender>`. A round
    is one call of the protocol; every rank counts rounds the same way, since every rank runs the
    same sequence of exchanges and agreements (one each per new input shape). Rank 0 deletes a
    round's keys when it ends: by then it has read every other rank's, and every rank that
    acknowledged has read its own, so the store does not grow with each shape.

    Every store call waits at most `silence_s`: the store lives in rank 0's process (in a thread
    of its own, so a busy rank 0 still answers in milliseconds); silence for that long means the
    process is stopped or unreachable, and it is named (`StoreSilent`)."""

    silence_s = 2.0

    def __init__(self, store=None, rank: int | None = None, world: int | None = None, prefix: str = "slackswap",
                 members: Sequence[int] | None = None):
        import torch.distributed as dist

        if store is None:
            from torch.distributed import distributed_c10d

            # the default group's store: the rendezvous store every rank of the job already reaches
            store = distributed_c10d._get_default_store()
        self.store, self.prefix, self.round = store, prefix, 0
        self.rank = dist.get_rank() if rank is None else rank
        self.world = dist.get_world_size() if world is None else world
        self.members = list(members) if members is not None else None  # a group's job ranks (agreement.Channel)
        self._keys: list[str] = []  # this round's keys this rank wrote or read
        self._calls = _BoundedCalls(self.silence_s)
        self._heard: tuple[int, bytes] | None = None

    def _key(self, name: str, sender: int) -> str:
        return f"{self.prefix}/{self.round}/{name}/{sender}"

    def _call(self, call: Callable):
        try:
            value, answered = self._calls(call)
        except RuntimeError as e:  # the store's host process is gone (connection refused or reset)
            raise AgreementError(f"rank {self.rank}: lost the torch.distributed store ({e}); "
                                 f"rank 0, whose process hosts it, exited") from e
        if not answered:
            raise StoreSilent(f"rank {self.rank}: the torch.distributed store did not answer for "
                              f"{self.silence_s:g} s: rank 0, whose process hosts it, is stopped or unreachable")
        return value

    def post(self, name: str, data: bytes, to: Sequence[int]) -> None:
        key = self._key(name, self.rank)
        self._call(lambda: self.store.set(key, data))
        self._keys.append(key)

    def _get_if_set(self, key: str) -> bytes | None:
        return self._call(lambda: self.store.get(key) if self.store.check([key]) else None)

    def poll(self, name: str, sender: int) -> bytes | None:
        key = self._key(name, sender)
        data = self._get_if_set(key)
        if data is not None:
            self._keys.append(key)
        return data

    def present(self, name: str) -> list[int]:
        """The ranks whose message `name` of this round is in the store."""
        keys = [self._key(name, r) for r in range(self.world)]
        return self._call(lambda: [r for r, k in enumerate(keys) if self.store.check([k])])

    def shout(self, data: bytes) -> None:
        key = f"{self.prefix}/shout"

        def first_shout_wins():  # an atomic counter: a later shout has nothing to add
            if self.store.add(key + "s", 1) == 1:
                self.store.set(key, f"{self.rank}\n".encode() + data)

        self._call(first_shout_wins)

    def hear(self) -> tuple[int, bytes] | None:
        if self._heard is None:
            data = self._get_if_set(f"{self.prefix}/shout")
            if data is not None:
                sender, _, text = data.partition(b"\n")
                self._heard = (int(sender), text)
        return self._heard

    def finish(self, deadline: float) -> None:
        if self.rank == 0:
            for key in self._keys:
                try:
                    self._call(lambda: self.store.delete_key(key))
                except AgreementError:  # best effort: a leftover key only costs store memory
                    break
        self._keys = []
        self.round += 1
