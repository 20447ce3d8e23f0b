"""Rank 0's hold on the other ranks of its tensor-parallel group: it forms the group, keeps
its ranks alive and watches them, and stops them.

The executor service (rank 0) owns one ``RankZero`` when ``tensor_parallel_size`` > 1; the
step loop and NATS stay the service's. The design and the failure story are ``ranks.py``'s.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from services.executor.model_runner import ModelRunner
from services.executor.tp_group.ranks import (
    RankProcesses,
    TensorParallelDriver,
    check_same_settings,
    check_splittable,
    connect_rank,
    free_port,
)
from shared.config import Settings
from shared.logging import get_logger
from shared.model_source import ModelInfo
from shared.service import FatalServiceError

log = get_logger(__name__)


class RankZero:
    """Ranks 1..N-1 of ``group_id``'s group as rank 0 sees them.

    Args:
        torch_thread: the service's one torch thread: the group's collectives (forming it,
            keep-alives) run there, in order with its steps.
    """

    def __init__(self, settings: Settings, model_info: ModelInfo, group_id: str,
                 torch_thread: ThreadPoolExecutor) -> None:
        self.settings = settings
        self.model_info = model_info
        self.group_id = group_id
        self.torch_thread = torch_thread
        self.ranks: RankProcesses | None = None  # ranks 1..N-1 when this process started them
        self.driver: TensorParallelDriver | None = None  # once formed
        self._last_keepalive = 0.0  # monotonic time of the last keep-alive to the other ranks

    async def form(self) -> TensorParallelDriver:
        """Start the other ranks (unless ``tensor_parallel_rank`` says they are started by
        hand), join them and load this rank's part of the model. Returns rank 0's runner.

        Raises:
            ValueError: the model's heads cannot be split over ``tensor_parallel_size`` ranks;
                ``tensor_parallel_rank`` >= 1 (that rank runs as ``pagedllm service executor``).
            FatalServiceError: a rank process exited while the group was forming.
        """
        settings = self.settings
        if settings.tensor_parallel_rank:
            raise ValueError(f"tensor_parallel_rank={settings.tensor_parallel_rank}: only rank 0 serves NATS; "
                             "run the other ranks with `pagedllm service executor --tensor-parallel-rank K`")
        check_splittable(self.model_info, settings.tensor_parallel_size)
        port = settings.tensor_parallel_master_port or free_port(settings.tensor_parallel_master_addr)
        if settings.tensor_parallel_rank is None:
            self.ranks = RankProcesses(settings, port)

        def rank_zero() -> TensorParallelDriver:
            tp = connect_rank(settings, 0, port)
            check_same_settings(tp, settings, self.model_info)
            return TensorParallelDriver(ModelRunner(settings, self.model_info, tp))

        forming = asyncio.get_running_loop().run_in_executor(self.torch_thread, rank_zero)
        try:
            while not forming.done():  # a rank that dies before joining would leave us waiting
                await asyncio.wait([forming], timeout=0.2)
                if not forming.done() and self.ranks is not None and (exited := self.ranks.exited()):
                    raise FatalServiceError(f"tensor-parallel rank {exited[0]} exited (code {exited[1]}) while "
                                            "the group was forming")
            self.driver = forming.result()
        except BaseException:
            if self.ranks is not None:
                self.ranks.stop(timeout=0)
            raise
        return self.driver

    async def watch(self) -> None:
        """Keep the waiting ranks alive (a message every heartbeat interval, queued behind a
        running step) and end the service when a rank is gone: its process exited, its
        liveness counter stopped (``heartbeat_timeout_s``), or a keep-alive failed. The checks
        run off the step thread, which a collective may hold.

        Raises:
            FatalServiceError: a rank is gone (the group is aborted first).
        """
        driver = self.driver
        assert driver is not None, "form the group first"
        loop = asyncio.get_running_loop()
        keepalive: asyncio.Future | None = None
        while True:
            await asyncio.sleep(min(0.2, self.settings.heartbeat_interval_s))
            reason = None
            if self.ranks is not None and (exited := self.ranks.exited()) is not None:
                reason = f"tensor-parallel rank {exited[0]} of group {self.group_id} exited (code {exited[1]})"
            elif stale := await loop.run_in_executor(None, driver.tp.stale_ranks,
                                                     self.settings.heartbeat_timeout_s):
                reason = f"tensor-parallel rank {stale[0]} of group {self.group_id} stopped answering"
            elif keepalive is not None and keepalive.done() and keepalive.exception() is not None:
                reason = f"tensor-parallel group {self.group_id} failed: {keepalive.exception()}"
            elif (keepalive is None or keepalive.done()) and \
                    time.monotonic() - self._last_keepalive >= self.settings.heartbeat_interval_s:
                self._last_keepalive = time.monotonic()
                keepalive = loop.run_in_executor(self.torch_thread, driver.keepalive)
            if reason is not None:
                log.error("tp_group_failed", group_id=self.group_id, reason=reason)
                driver.broken = True
                driver.tp.abort()
                raise FatalServiceError(f"{reason}; the group stops")

    async def stop(self) -> None:
        """Ask the other ranks to exit (5 s at most, on the torch thread: not after a failure),
        then wait for the rank processes started here, killing what is left."""
        loop = asyncio.get_running_loop()
        if self.driver is not None:
            try:
                await asyncio.wait_for(loop.run_in_executor(self.torch_thread, self.driver.stop), 5.0)
            except Exception:
                pass
        if self.ranks is not None:
            await loop.run_in_executor(None, self.ranks.stop)
