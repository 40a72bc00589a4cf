"""The sending half of a stage's adapter: scheduler output becomes chunk puts (spec §3.3–§3.6).

``save_async`` only queues; a single save task takes the queue in order and puts each chunk. Two
ideas make cancellation safe:

* the **terminal fence**: while a request-terminal task is queued, cleanup only marks the
  generation cancelled and defers its reclaim to the terminal task, which runs on every exit path;
* **exact-range reclaim on the save queue**: an aborted generation's keys ``{ext}_{stage}_0 ..
  _{num_puts-1}`` are removed by a cleanup task appended to the same FIFO as the puts, so it runs
  after the old generation's last put and before the first put of a generation that reuses the id.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from runtime.connectors.base import Connector
from runtime.connectors.keys import chunk_key, external_id_of
from runtime.kernel import current_kernel
from runtime.request import Request
from runtime.transfer import rules
from runtime.transfer.generations import GenerationContext, SenderGeneration, SenderTables

log = logging.getLogger(__name__)

#: Idle wait of the save loop; a reap runs after every pass, idle ones included (#8082 g).
SAVE_IDLE_WAIT_S = 0.1

DRAINING_REASON = "previous sender generation is still draining"

#: A processor turns one scheduler output into the payload of one chunk (spec §4). It is called
#: as ``processor(context, multimodal_output, request, is_finished)``, with ``new_token_ids=`` as
#: well if it takes that keyword; ``context`` is the :class:`GenerationContext` of the chunk's
#: generation.
Processor = Callable[..., dict[str, Any] | None]


@dataclass(eq=False)
class SaveTask:
    multimodal_output: Any
    request: Request
    is_finished: bool
    is_segment_finished: bool
    new_token_ids: tuple[int, ...] | None
    sender_token: SenderGeneration

    def __str__(self) -> str:
        return f"save {self.request.request_id} (generation {self.sender_token.serial})"


@dataclass(eq=False)
class CleanupTask:
    """Reclaim the keys ``{prefix}_0 .. {prefix}_{num_puts-1}`` of one retired generation of ``ext``."""

    ext: str
    prefix: str
    num_puts: int
    generation: int


@dataclass(eq=False)
class ReleaseTask:
    """Reclaim every tracked, unread chunk of ``ext`` (spec §2.11)."""

    ext: str
    removed: int | None = None


#: Reclaim work: it still runs when the loop stops, and it never carries a request.
ReclaimTask = CleanupTask | ReleaseTask


def _ext_of(task: SaveTask | ReclaimTask) -> str:
    return task.request.external_req_id if isinstance(task, SaveTask) else task.ext


def truthy_scalar(value: object) -> bool:
    """A flag that may travel as a bool or a one-element tensor."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and bool(value.item())
    return bool(value)


def _snapshot(request: Request) -> Request:
    """A copy a processor may read while the scheduler goes on mutating the live request."""
    snap = copy.copy(request)
    snap.prompt_token_ids = list(request.prompt_token_ids)
    snap.output_token_ids = list(request.output_token_ids)
    if request.additional_information is not None:
        snap.additional_information = {
            k: (dict(v) if isinstance(v, dict) else v) for k, v in request.additional_information.items()
        }
    return snap


def _takes_new_token_ids(processor: Processor) -> bool:
    params = inspect.signature(processor).parameters.values()
    return any(p.name == "new_token_ids" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class ChunkSender:
    """The chunk sender of one stage process: the save queue, its task and the generations.

    ``cleanup_request(request_id, ext)`` is the stage's cleanup of both halves of a request; the
    sender runs it once a request's terminal went out (spec §3.4 step 10).
    """

    def __init__(
        self,
        connector: Connector,
        *,
        processor: Processor | None,
        sends_chunks: bool,
        serials: Iterator[int],
        cleanup_request: Callable[[str, str], Awaitable[None]],
        name: str,
    ) -> None:
        k = current_kernel()
        self.connector = connector
        self.stage_id = connector.stage_id
        self.processor = processor
        self.sends_chunks = sends_chunks
        self._processor_takes_new_ids = processor is not None and _takes_new_token_ids(processor)
        self._serials = serials
        self._cleanup_request = cleanup_request
        self._stopped = False
        self._saving = False

        self._sender_state_lock = k.lock(f"{name}.sender_state")
        self.tables = SenderTables()
        self._pending_save_reqs: deque[SaveTask | ReclaimTask] = deque()
        self._save_cond = k.signal(f"{name}.save")
        self._released = k.signal(f"{name}.released")

        #: The failure side channel: request id -> first reason, drained by the orchestrator.
        self._send_failures: dict[str, str] = {}

    # == enqueue (scheduler side; never does I/O) ==============================================

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
        k = current_kernel()
        ext = request.external_req_id
        is_finished = force_request_finished or (request.is_finished() and not request.resumable)
        generation = segment_generation if segment_generation is not None else int(request.segment_generation or 0)
        confirmed = (
            confirmed_num_computed_tokens
            if confirmed_num_computed_tokens is not None
            else max(0, request.num_computed_tokens - request.num_output_placeholders)
        )
        accepted = await self._enqueue_save(
            multimodal_output, request, is_finished, is_segment_finished, new_token_ids, confirmed, generation
        )
        # The point comes after the enqueue: a scheduler's "is it still live? then save" is atomic
        # with the enqueue, as it is on upstream's single scheduler thread.
        await k.point("adapter.save_async", ext=ext, req=request.request_id, finished=is_finished, accepted=accepted)
        return accepted

    async def _enqueue_save(
        self,
        multimodal_output: Any,
        request: Request,
        is_finished: bool,
        is_segment_finished: bool,
        new_token_ids: list[int] | None,
        confirmed: int,
        generation: int,
    ) -> bool:
        k = current_kernel()
        ext = request.external_req_id
        tables = self.tables
        async with self._sender_state_lock:
            expected = tables.segment_generation.get(ext, generation)
            if generation < expected:
                log.info("Skip late save_async for %s: segment_generation=%d, expected=%d", ext, generation, expected)
                return False
            tables.segment_generation[ext] = generation
            token = tables.sender_tokens.get(ext)
            admission = rules.admit_save(
                token,
                request_id=request.request_id,
                is_segment_finished=is_segment_finished,
                confirmed=confirmed,
                watermark=tables.requests_num_chunks_sent.get(ext, 0),
            )
            if admission is rules.Admission.REPLAY:
                log.warning("Skip save_async replay for %s: %d < watermark", ext, confirmed)
                return False
            if admission is rules.Admission.ACCEPT:
                tables.requests_num_chunks_sent[ext] = confirmed
                if token is None:
                    token = tables.sender_tokens[ext] = SenderGeneration(next(self._serials), request.request_id)
                self._pending_save_reqs.append(
                    SaveTask(
                        multimodal_output=multimodal_output,
                        request=_snapshot(request) if self.processor is not None else request,
                        is_finished=is_finished,
                        is_segment_finished=is_segment_finished,
                        new_token_ids=tuple(new_token_ids) if new_token_ids is not None else None,
                        sender_token=token,
                    )
                )
                if is_finished:
                    token.terminal_pending = True  # the #6670 terminal fence
                if is_segment_finished:
                    after = rules.segment_generation_after_end(request.segment_generation, generation)
                    tables.segment_generation[ext] = after
                    tables.requests_num_chunks_sent.pop(ext, None)
        if admission is rules.Admission.DRAINING:
            log.error("save_async for %s rejected: %s", ext, DRAINING_REASON)
            k.note("adapter.save_async.rejected", ext=ext, req=request.request_id)
            self.record_send_failure(request.request_id, DRAINING_REASON)
            return False
        self._save_cond.notify()
        return True

    def is_draining(self, ext: str) -> bool:
        """True while a cancelled generation of ``ext`` still owns it: new work for ``ext`` is refused."""
        return rules.is_draining(self.tables.sender_tokens.get(ext))

    def has_active_sender(self, ext: str) -> bool:
        """True while a generation owns ``ext`` and is not cancelled (ownership starts at enqueue)."""
        token = self.tables.sender_tokens.get(ext)
        return token is not None and not token.cancelled

    # == the save task =========================================================================

    async def _send_single_request(self, task: SaveTask | ReclaimTask) -> None:
        if isinstance(task, CleanupTask):
            await self._run_cleanup_task(task)
            return
        if isinstance(task, ReleaseTask):
            await self._run_release_task(task)
            return
        k = current_kernel()
        token = task.sender_token
        ext = task.request.external_req_id
        is_terminal = task.is_finished
        await k.point("adapter.send.begin", ext=ext, gen=token.serial, finished=is_terminal)
        async with self._sender_state_lock:
            is_current = self.tables.owns(ext, token)
            if is_current and rules.may_send(token, is_terminal):
                token.in_flight = True
            else:
                is_current = False
        if not is_current:
            k.note("adapter.send.stale", ext=ext, gen=token.serial)
            if is_terminal:
                await self._release_terminal_fence(token)
                if token.failed and self.tables.owns(ext, token):
                    # The terminal that would have retired it will never be sent.
                    await self.cleanup_sender(ext)
            return
        try:
            await self._send_for_generation(task, token)
        except Exception:
            token.failed = True  # a put that raised failed: nothing of this generation follows it
            raise
        finally:
            # The first point where no in-flight code can touch this generation: it owns the
            # reclaim when an abort raced the put.
            if is_terminal:
                await self._release_terminal_fence(token)
            async with self._sender_state_lock:
                if self.tables.owns(ext, token):
                    token.in_flight = False
                    if token.cancelled and not token.terminal_pending:
                        self._retire_generation_locked(ext, token)
            if is_terminal and token.failed and self.tables.owns(ext, token):
                # The terminal itself failed (or raised): no later task of this generation will
                # retire it, and its exact-range reclaim covers the key it may have created.
                await self.cleanup_sender(ext)

    def _run_processor(self, task: SaveTask) -> dict[str, Any] | None:
        if self.processor is None:
            out = task.multimodal_output
            return dict(out) if isinstance(out, dict) else None
        context = GenerationContext(self.tables, task.request.external_req_id)
        flush = rules.processor_flushes(is_segment_finished=task.is_segment_finished, is_finished=task.is_finished)
        extra = {"new_token_ids": task.new_token_ids} if self._processor_takes_new_ids else {}
        try:
            return self.processor(context, task.multimodal_output, task.request, flush, **extra)
        except Exception:
            log.exception("processor failed for %s; sending no data", task.request.request_id)
            return None

    async def _send_for_generation(self, task: SaveTask, token: SenderGeneration) -> None:
        ext = task.request.external_req_id
        chunk_id = self.tables.put_req_chunk.get(ext, 0)
        key = chunk_key(ext, self.stage_id, chunk_id)
        payload = self._run_processor(task)
        if payload is None:
            if not (task.is_segment_finished or task.is_finished):
                return
            payload = {}  # finish markers always travel, even with no data
        meta = payload.get("meta")
        if not isinstance(meta, dict):
            meta = payload["meta"] = {}
        if not (truthy_scalar(meta.get("finished")) and meta.get("codec_streaming")):
            meta["finished"] = torch.tensor(task.is_finished)
        if meta.get("is_segment_finished") is None:
            meta["is_segment_finished"] = torch.tensor(task.is_segment_finished)

        # Upstream looks at ownership again right before the put (its pre-put veto, spec §3.4
        # step 6): its processor ran on another thread meanwhile. Here the processor is
        # synchronous, so nothing has run since the check at the start of the task.
        ok, cause = await self._put_chunk(token, key, chunk_id, payload)

        async with self._sender_state_lock:
            if ok and task.is_finished:
                token.terminal_sent = True
            token.failed = token.failed or not ok
            retiring_without_terminal = token.cancelled and not (task.is_finished or token.terminal_pending)
            if not self.tables.owns(ext, token) or retiring_without_terminal:
                log.debug("Ignoring completed put for retired request %s", ext)
                return
            if ok:
                # A fenced terminal of a cancelled generation still advances: a receiver may
                # already have consumed this key.
                self.tables.put_req_chunk[ext] = chunk_id + 1
        if ok:
            if truthy_scalar(meta["finished"]) and task.is_finished:
                await self._cleanup_request(task.request.request_id, ext)
        else:
            self._put_failed(task, key, cause)
        if task.is_segment_finished:
            self.tables.end_segment(ext)

    async def _put_chunk(
        self, token: SenderGeneration, key: str, chunk_id: int, payload: dict[str, Any]
    ) -> tuple[bool, str]:
        """Put one chunk; whether it went out, and if not, why."""
        # The key range is recorded *before* the put: the in-flight key must be reclaimable even
        # if the abort wins while the put runs, or the put raises after creating the segment.
        token.num_puts = chunk_id + 1
        current_kernel().note("adapter.put", ext=external_id_of(key), gen=token.serial, key=key)
        ok, _, metadata = await self.connector.put(str(self.stage_id), str(self.stage_id + 1), key, payload)
        if not ok:
            # A put that reports failure leaves nothing under its key (the connector's contract):
            # the key is not this generation's to reclaim; an older generation's chunk may be there.
            token.num_puts = chunk_id
        cause = metadata.get("error") if isinstance(metadata, dict) else None
        return ok, str(cause or "connector.put reported failure")

    async def _release_terminal_fence(self, token: SenderGeneration) -> None:
        """Lower the fence, on every exit path of the terminal's task. A cleanup that came while
        it was up only marked the generation cancelled; the task retires it right after."""
        async with self._sender_state_lock:
            token.terminal_pending = False

    async def _run_cleanup_task(self, task: CleanupTask) -> None:
        k = current_kernel()
        await k.point("adapter.cleanup_shm.begin", prefix=task.prefix, n=task.num_puts, gen=task.generation)
        for i in range(task.num_puts):
            key = f"{task.prefix}_{i}"
            try:
                await self.connector.cleanup(key)
            except Exception as e:  # one key that cannot be removed leaves the rest reclaimed
                log.warning("Reclaim of %s gave up: %s: %s", key, type(e).__name__, e)
        k.note("adapter.cleanup_shm.end", prefix=task.prefix, gen=task.generation)

    async def _run_release_task(self, task: ReleaseTask) -> None:
        k = current_kernel()
        await k.point("adapter.release.begin", ext=task.ext, stage=self.stage_id)
        try:
            task.removed = await self.connector.cleanup_prefix(f"{task.ext}_{self.stage_id}_")
        finally:
            # Its caller waits for this answer: a sweep that raised (logged by the save loop)
            # answers too, having removed nothing it can count.
            if task.removed is None:
                task.removed = 0
            k.note("adapter.release.end", ext=task.ext, removed=task.removed)
            self._released.notify()

    # == cleanup (never waits for I/O) =========================================================

    async def cleanup_sender(self, ext: str) -> None:
        """Retire the sender generation of ``ext`` (spec §3.5). Idempotent; returns at once."""
        k = current_kernel()
        await k.point("adapter.cleanup_sender.begin", ext=ext, stage=self.stage_id)
        async with self._sender_state_lock:
            token = self.tables.sender_tokens.get(ext)
            if token is None:
                self.tables.clear(ext)
            else:
                token.cancelled = True
                # Its terminal's task (fenced) or the put in flight retires it when it ends.
                if not rules.cleanup_defers_retire(token):
                    self._retire_generation_locked(ext, token)
        await k.point("adapter.cleanup_sender.end", ext=ext)

    def _retire_generation_locked(self, ext: str, token: SenderGeneration) -> None:
        # Queueing the reclaim and popping the token in one critical section is what puts every
        # task of a reusing generation behind the reclaim.
        self._queue_shm_cleanup_locked(ext, token)
        self.tables.sender_tokens.pop(ext, None)
        self.tables.clear(ext)

    def _queue_shm_cleanup_locked(self, ext: str, token: SenderGeneration) -> None:
        """Append the exact-range reclaim to the save FIFO, if the generation needs one."""
        if rules.needs_reclaim(token):
            self._pending_save_reqs.append(CleanupTask(ext, f"{ext}_{self.stage_id}", token.num_puts, token.serial))
            self._save_cond.notify()

    async def release_shm_resources(self, ext: str) -> int:
        """Request-level final sweep (spec §2.11): reclaim chunks of ``ext`` that were sent but
        never read, e.g. the fenced terminal of an aborted request; the number removed.

        Upstream runs it from another thread; here it runs on the save task like the abort
        reclaim, so it never overtakes a put of ``ext`` nor is overtaken by a later generation's
        — but it is queued right behind the last task of ``ext`` (at the front if there is
        none), not behind every other request's puts. It returns once the sweep ran, so an
        orchestrator that reuses ``ext`` after it can be sure no stale chunk of the old
        generation is left for the new receiver to read.
        """
        if not self.sends_chunks or (self._stopped and not self._saving):
            # No save loop will run (a stage that never sends, or one shut down): sweep here.
            return await self.connector.cleanup_prefix(f"{ext}_{self.stage_id}_")
        task = ReleaseTask(ext)
        behind = max((i + 1 for i, t in enumerate(self._pending_save_reqs) if _ext_of(t) == ext), default=0)
        self._pending_save_reqs.insert(behind, task)
        self._save_cond.notify()
        while task.removed is None:
            await self._released.wait(SAVE_IDLE_WAIT_S, ready=lambda: task.removed is not None)
        return task.removed

    # == the send-failure side channel =========================================================

    # A give-up is recorded under the scheduler's own (internal) request id, the one it can act
    # on; before #4855 R1.2 it was invisible, and the log said "None".

    def _put_failed(self, task: SaveTask, key: str, cause: str) -> None:
        log.warning("Chunk send failed for %s (%s): %s", task.request.request_id, key, cause)
        self.record_send_failure(task.request.request_id, f"could not send chunk {key}: {cause}")

    def _send_raised(self, task: SaveTask, error: Exception) -> None:
        log.warning("Send of %s gave up: %s: %s", task.request.request_id, type(error).__name__, error)
        self.record_send_failure(task.request.request_id, f"{type(error).__name__}: {error}")

    def record_send_failure(self, request_id: str, reason: str) -> None:
        self._send_failures.setdefault(request_id, reason)

    def collect_failed_send_request_ids(self) -> dict[str, str]:
        failed = dict(self._send_failures)
        self._send_failures.clear()
        return failed

    # == the save loop =========================================================================

    async def save_loop(self) -> None:
        self._saving = True
        try:
            await self._save_until_stopped()
        finally:
            self._saving = False

    async def _save_until_stopped(self) -> None:
        while not self._stopped:
            await self._drain_save_queue()
            # The idle reap (#8082 g): consumed keys are forgotten even when nothing more is sent.
            self.connector.reap_consumed()
            if not self._save_loop_has_work():
                await self._save_cond.wait(SAVE_IDLE_WAIT_S, ready=self._save_loop_has_work)
        # Reclaim work queued before the stop still runs; unsent chunks are dropped.
        self._pending_save_reqs = deque(t for t in self._pending_save_reqs if not isinstance(t, SaveTask))
        await self._drain_save_queue()

    def _save_loop_has_work(self) -> bool:
        return bool(self._pending_save_reqs) or self._stopped

    async def _drain_save_queue(self) -> None:
        while self._pending_save_reqs:
            task = self._pending_save_reqs.popleft()
            try:
                await self._send_single_request(task)
            except Exception as e:
                if isinstance(task, SaveTask):
                    self._send_raised(task, e)
                else:
                    log.warning("Reclaim gave up: %s: %s", type(e).__name__, e)

    def stop(self) -> None:
        """End the save loop after its current pass (queued reclaim work still runs)."""
        self._stopped = True
        self._save_cond.notify()
