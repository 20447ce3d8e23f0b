"""The process group of one executor group's tensor-parallel ranks, and its collectives.

A :class:`TensorParallelGroup` holds its own ``torch.distributed`` process groups, built on a
``TCPStore`` rendezvous rather than torch's global default group, so a process may hold
several (the offline ``LLM`` built twice in one script) and nothing else in the process
sees them:

- the *device* group carries the model's tensors (the row-parallel all-reduce, the LM head's
  gather): NCCL on CUDA, gloo on CPU;
- the *CPU* group (gloo) carries rank 0's step messages and small control values.

Every collective waits at most ``timeout``. On gloo, a rank whose process dies closes its
sockets and every other rank's pending collective raises at once ("Connection closed by
peer"); a lost host or a partition, and on NCCL any failure, shows only when the timeout
passes (NCCL's watchdog then aborts the process) or through the liveness counters every rank
keeps in the rendezvous store (:meth:`TensorParallelGroup.beat` / :meth:`stale_ranks`),
which rank 0 reads off its step thread.

The layers read the group they are built under (:func:`use_tp_group` /
:func:`current_tp_group`), as vLLM's layers read ``get_tp_group()``; a model built outside any
is a single rank (:data:`SINGLE_RANK`).
"""

from __future__ import annotations

import contextlib
import datetime
import struct
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

HEADER_BYTES = 4096  # a step message up to this size (less the length) takes one broadcast


class TensorParallelGroup:
    """Rank ``rank`` of ``world_size`` in one executor group.

    Args:
        rank / world_size: this process's rank and the group's size.
        device_group / cpu_group: the process groups (``None`` for a single rank).
        device: where the model's tensors live (collectives on the device group take them there).
    """

    def __init__(self, rank: int = 0, world_size: int = 1, device_group: dist.ProcessGroup | None = None,
                 cpu_group: dist.ProcessGroup | None = None, device: torch.device | None = None) -> None:
        self.rank, self.world_size = rank, world_size
        self.device_group, self.cpu_group = device_group, cpu_group
        self.device = device or torch.device("cpu")
        self.store: dist.Store | None = None  # the rendezvous store (must outlive the groups)
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (its last counter, when it changed)

    @property
    def is_first_rank(self) -> bool:
        """Rank 0: it receives the plans, samples and answers."""
        return self.rank == 0

    @classmethod
    def connect(cls, rank: int, world_size: int, master_addr: str, master_port: int, device: torch.device,
                timeout_s: float, rendezvous_timeout_s: float = 120.0) -> TensorParallelGroup:
        """Meet the other ranks at ``master_addr:master_port`` (rank 0 listens there) and build
        the groups: gloo for both on CPU, NCCL for the device group on CUDA (its communicator
        created here, by a first all-reduce, so a bad GPU setup fails now, not at the first
        request). Collectives time out after ``timeout_s``.

        Raises:
            RuntimeError / DistStoreError: the other ranks did not arrive within
                ``rendezvous_timeout_s``; NCCL could not start.
        """
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_addr, master_port, world_size, rank == 0,
                              timeout=datetime.timedelta(seconds=rendezvous_timeout_s))
        store.set_timeout(timeout)
        cpu_group = dist.ProcessGroupGloo(dist.PrefixStore("cpu", store), rank, world_size, timeout)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            device_group = dist.ProcessGroupNCCL(dist.PrefixStore("device", store), rank, world_size, options)
        else:
            device_group = cpu_group
        group = cls(rank, world_size, device_group, cpu_group, device)
        group.store = store
        if device.type == "cuda":
            group.all_reduce(torch.zeros(1, device=device))
        return group

    def abort(self) -> None:
        """Leave the group at once (after a failure): pending collectives of this process end,
        where the backend supports it (NCCL); a no-op otherwise."""
        for group in {id(g): g for g in (self.device_group, self.cpu_group) if g is not None}.values():
            try:
                group.abort()
            except Exception:  # gloo: not supported; the process is about to exit anyway
                pass

    # ---------------------------------------------------------------- liveness (the store)

    def beat(self) -> None:
        """Count one more sign of life of this rank in the rendezvous store (a rank's own
        thread, every heartbeat interval)."""
        if self.store is not None:
            self.store.add(f"alive/{self.rank}", 1)

    def stale_ranks(self, timeout_s: float) -> list[int]:
        """Ranks (other than 0) whose counter has not moved for ``timeout_s`` (rank 0, off its
        step thread: store reads do not wait for collectives)."""
        stale = []
        now = time.monotonic()
        for rank in range(1, self.world_size):
            count = self.store.add(f"alive/{rank}", 0)
            last, since = self._seen.get(rank, (-1, now))
            if count != last:
                self._seen[rank] = (count, now)
            elif now - since > timeout_s:
                stale.append(rank)
        return stale

    # ---------------------------------------------------------------- model collectives

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place (returned). A single rank returns it unchanged.

        Raises:
            RuntimeError (``DistBackendError``): a rank is gone, or the timeout passed.
        """
        if self.world_size > 1:
            self.device_group.allreduce([tensor]).wait()
        return tensor

    def gather_last_dim(self, tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        """Rank 0: every rank's ``tensor`` ``[..., sizes[r]]`` concatenated along the last dim
        (``[..., sum(sizes)]``); other ranks: ``None``. Ranges of unequal size travel padded to
        the largest.

        Raises:
            RuntimeError (``DistBackendError``): a rank is gone, or the timeout passed.
        """
        if self.world_size == 1:
            return tensor
        width = max(sizes)
        padded = F.pad(tensor, (0, width - tensor.shape[-1])).contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank != 0:
            self.device_group.gather([], [padded], opts).wait()
            return None
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        self.device_group.gather([parts], [padded], opts).wait()
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes, strict=True)], dim=-1)

    # ---------------------------------------------------------------- control (CPU group)

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0 sends ``payload``; every rank returns it. One broadcast of ``HEADER_BYTES``
        (the length, and the payload when it fits), a second for the rest of a longer one.

        Raises:
            RuntimeError (``DistBackendError``): a rank is gone, or the timeout passed.
        """
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        inline = HEADER_BYTES - 8
        if self.rank == 0:
            data = bytes(payload or b"")
            header[:8] = torch.frombuffer(bytearray(struct.pack("<q", len(data))), dtype=torch.uint8)
            if data:
                head = data[:inline]
                header[8 : 8 + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        self.cpu_group.broadcast([header], opts).wait()
        length = struct.unpack("<q", header[:8].numpy().tobytes())[0]
        if length <= inline:
            return header[8 : 8 + length].numpy().tobytes() if self.rank else bytes(payload or b"")
        rest = torch.zeros(length - inline, dtype=torch.uint8)
        if self.rank == 0:
            rest.copy_(torch.frombuffer(bytearray(payload[inline:]), dtype=torch.uint8))
        self.cpu_group.broadcast([rest], opts).wait()
        return bytes(payload) if self.rank == 0 else header[8:].numpy().tobytes() + rest.numpy().tobytes()

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's ``value`` (e.g. the KV blocks each rank can hold).

        Raises:
            RuntimeError (``DistBackendError``): a rank is gone, or the timeout passed.
        """
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.cpu_group.allreduce([t], opts).wait()
        return int(t.item())


SINGLE_RANK = TensorParallelGroup()
_current: list[TensorParallelGroup] = [SINGLE_RANK]


def current_tp_group() -> TensorParallelGroup:
    """The group the layers being built belong to (:data:`SINGLE_RANK` outside :func:`use_tp_group`)."""
    return _current[-1]


@contextlib.contextmanager
def use_tp_group(group: TensorParallelGroup | None) -> Iterator[TensorParallelGroup]:
    """Build layers under ``group`` (``None``: a single rank)."""
    _current.append(group or SINGLE_RANK)
    try:
        yield _current[-1]
    finally:
        _current.pop()
