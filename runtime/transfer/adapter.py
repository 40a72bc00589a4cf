"""ChunkTransferAdapter: the per-stage sender and receiver of async chunks (spec §3), under the
names upstream's ``OmniChunkTransferAdapter`` gives them.

The adapter is a façade over its two halves, each with its own lock and task:

* :class:`~runtime.transfer.sender.ChunkSender` turns scheduler output into chunk puts, one
  sender generation (:mod:`runtime.transfer.generations`) per external id;
* :class:`~runtime.transfer.receiver.ChunkReceiver` polls the upstream stage's chunk keys and
  commits what arrives into the scheduler's requests.

What the protocol decides, both halves ask :mod:`runtime.transfer.rules`. The adapter itself adds
only what spans the two: a request's cleanup, which is both, and the stage's lifetime.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Iterable
from typing import Any

from runtime.connectors.base import Connector
from runtime.kernel import current_kernel
from runtime.request import Request
from runtime.transfer.receiver import ChunkReceiver, WorkerType
from runtime.transfer.sender import ChunkSender, Processor

log = logging.getLogger(__name__)

__all__ = ["ChunkTransferAdapter", "Processor", "WorkerType"]


class ChunkTransferAdapter:
    """The chunk sender and receiver of one stage process."""

    def __init__(
        self,
        connector: Connector,
        *,
        processor: Processor | None = None,
        receives_chunks: bool = True,
        sends_chunks: bool = True,
        worker_type: WorkerType = "generation",
        name: str = "adapter",
        active_stream_window: int = 0,
    ) -> None:
        self.connector = connector
        self.stage_id = connector.stage_id
        self.name = name
        self.receives_chunks = receives_chunks
        self.sends_chunks = sends_chunks
        # One numbering for generations and registrations: the trace names both by serial.
        serials = itertools.count(1)
        self.sender = ChunkSender(
            connector,
            processor=processor,
            sends_chunks=sends_chunks,
            serials=serials,
            cleanup_request=self.cleanup,
            name=name,
        )
        self.receiver = ChunkReceiver(
            connector,
            worker_type=worker_type,
            serials=serials,
            name=name,
            active_stream_window=active_stream_window if self._polls_upstream else 0,
        )
        #: Notified whenever a chunk is committed or a receive failed (see the receiver's).
        self.chunk_ready = self.receiver.chunk_ready

    @property
    def _polls_upstream(self) -> bool:
        return self.receives_chunks and self.stage_id > 0

    # == sender ==================================================================================

    async def save_async(
        self,
        multimodal_output: Any,
        request: Request,
        is_segment_finished: bool = False,
        new_token_ids: list[int] | None = None,
        confirmed_num_computed_tokens: int | None = None,
        segment_generation: int | None = None,
        force_request_finished: bool = False,
    ) -> bool:
        """Queue one chunk of ``request`` for sending (spec §3.3). True if it was queued."""
        return await self.sender.save_async(
            multimodal_output,
            request,
            is_segment_finished,
            new_token_ids,
            confirmed_num_computed_tokens,
            segment_generation,
            force_request_finished,
        )

    def is_draining(self, ext: str) -> bool:
        """True while a cancelled generation of ``ext`` still owns it: new work for ``ext`` is refused."""
        return self.sender.is_draining(ext)

    def has_active_sender(self, ext: str) -> bool:
        """True while a generation owns ``ext`` and is not cancelled (ownership starts at enqueue)."""
        return self.sender.has_active_sender(ext)

    async def cleanup_sender(self, ext: str) -> None:
        """Retire the sender generation of ``ext`` (spec §3.5). Idempotent; returns at once."""
        await self.sender.cleanup_sender(ext)

    async def release_shm_resources(self, ext: str) -> int:
        """Request-level final sweep (spec §2.11): reclaim chunks of ``ext`` that were sent but
        never read; the number removed (see :meth:`ChunkSender.release_shm_resources`)."""
        return await self.sender.release_shm_resources(ext)

    def collect_failed_send_request_ids(self) -> dict[str, str]:
        return self.sender.collect_failed_send_request_ids()

    # == receiver ================================================================================

    async def load_async(self, request: Request) -> None:
        """Register ``request`` to receive its next chunk (no duplicate registrations)."""
        if self._polls_upstream:
            await self.receiver.load_async(request)

    def pop_ready(self, request_id: str) -> bool:
        """True (once) if a committed chunk of ``request_id`` is ready for the scheduler."""
        return self.receiver.pop_ready(request_id)

    def take_ar_update(self, request_id: str) -> dict[str, Any] | None:
        """AR mode: the payload committed for ``request_id`` (once), to apply after :meth:`pop_ready`."""
        return self.receiver.take_ar_update(request_id)

    def has_ready_chunks(self, request_id: str | None = None) -> bool:
        """True while a committed chunk (of ``request_id``, if given) waits for its scheduler
        (see :meth:`pop_ready`)."""
        return self.receiver.has_ready_chunks(request_id)

    def is_done_receiving_chunks(self, request_id: str) -> bool:
        """True once upstream sent its terminal (not: this stage is done, #5349)."""
        return self.receiver.is_done_receiving_chunks(request_id)

    def admit(self, request_ids: Iterable[str]) -> None:
        """Make streams active, in the order given, while the active-stream window has room."""
        self.receiver.admit(request_ids)

    def is_active(self, request_id: str) -> bool:
        """Whether the stage may take up ``request_id``'s stream now (always, with no window)."""
        return self.receiver.is_active(request_id)

    def may_admit(self, request_id: str) -> bool:
        """Whether ``request_id``'s stream is active, or a slot is free for the next :meth:`admit`."""
        return self.receiver.may_admit(request_id)

    def producer_moved(self) -> None:
        """The stage before this one died, and its next life writes elsewhere: every request
        still waiting for a chunk of the dead one fails (see :meth:`ChunkReceiver.producer_moved`)."""
        self.receiver.producer_moved()

    async def cleanup_receiver(self, request_id: str) -> None:
        """Forget every receiver structure of ``request_id``; idempotent, keeps no tombstone."""
        await self.receiver.cleanup_receiver(request_id)

    def has_receive_failure(self, request_id: str) -> bool:
        """True while a receive failure of ``request_id`` waits to be collected."""
        return self.receiver.has_receive_failure(request_id)

    def collect_failed_receive_request_ids(self) -> dict[str, str]:
        return self.receiver.collect_failed_receive_request_ids()

    # == both ====================================================================================

    async def cleanup(self, request_id: str, external_req_id: str | None = None) -> None:
        """Receiver cleanup of this stage's ``request_id`` plus sender cleanup of its external id."""
        ext = (
            external_req_id
            if external_req_id is not None
            else self.receiver.request_ids_mapping.get(request_id, request_id)
        )
        await self.cleanup_receiver(request_id)
        await self.cleanup_sender(ext)

    async def finish_requests(self, requests: list[Request]) -> None:
        """The abort / external-finish hook: both cleanups for each request."""
        for request in requests:
            await self.cleanup_receiver(request.request_id)
            await self.cleanup_sender(request.external_req_id)

    async def finish_parked_streaming_session(self, request: Request) -> None:
        """A streaming request parked between segments receives its terminal update (#6670 b).

        The terminal chunk is queued *before* the request is finished, and only if this stage
        still owns a sender generation for it — ownership starts at enqueue, so chunks queued but
        not yet sent count (#6889 review).
        """
        if self.has_active_sender(request.external_req_id):
            if request.segment_generation is not None:
                request.segment_generation += 1
            await self.save_async({}, request, force_request_finished=True)
        await self.finish_requests([request])

    async def run(self) -> None:
        """Run the save loop (if this stage sends) and the receive loop (if it receives) until
        :meth:`shutdown`, then close the connector."""
        k = current_kernel()
        try:
            async with k.task_group() as tasks:
                if self.sends_chunks:
                    tasks.start_soon(self.sender.save_loop, name=f"{self.name}.save")
                if self._polls_upstream:
                    tasks.start_soon(self.receiver.recv_loop, name=f"{self.name}.recv")
        finally:
            try:
                await self.connector.close()
            except Exception:  # (spec §3.10: swallowed — the stage is stopping either way)
                log.exception("closing the connector of %s failed", self.name)

    def shutdown(self) -> None:
        self.sender.stop()
        self.receiver.stop()

    def residue(self) -> dict[str, list[str]]:
        """Everything this adapter still holds, by structure name (empty structures omitted).

        Every container attribute of either half counts, so a structure added later (or by a
        mutant) cannot hide from the no-tombstones check.
        """
        held: dict[str, list[str]] = {}
        for part in (self.sender, self.sender.tables, self.receiver):
            for name, value in vars(part).items():
                if isinstance(value, (dict, set, deque, list)) and value:
                    held[name.lstrip("_")] = [str(item) for item in value]
        return held
