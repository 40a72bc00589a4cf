"""ChunkTransferAdapter: the per-stage sender and receiver of async chunks (spec §3).

The sender side turns scheduler output into chunk puts on a single save task; the receiver side
polls the upstream stage's chunk keys on a single receive task and commits what arrives into the
scheduler's request. The protocol that makes cancellation safe rests on three ideas:

* a **sender generation** (:class:`SenderGeneration`) per external id, compared by identity,
  so a late completion of an aborted generation never touches its successor;
* the **terminal fence**: while a request-terminal task is queued, cleanup only marks the
  generation cancelled and defers its reclaim to the terminal task, which runs on every exit path;
* **exact-range reclaim on the save queue**: an aborted generation's keys ``{ext}_{stage}_0 ..
  _{num_puts-1}`` are removed by a cleanup task appended to the same FIFO as the puts, so it runs
  after the old generation's last put and before the first put of a generation that reuses the id.

On the receiver side a registration (:class:`LoadEntry`) is checked by identity before and after
every ``get``; cleanup drops the registration, so a late chunk is consumed but never committed,
and no tombstone is ever kept.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from runtime.connectors.base import Connector, CorruptChunk
from runtime.connectors.keys import chunk_key
from runtime.kernel import KTaskGroup, current_kernel
from runtime.request import Request

log = logging.getLogger(__name__)

#: Idle wait of the save loop; a reap runs after every pass, idle ones included (#8082 g).
SAVE_IDLE_WAIT_S = 0.1
#: Receive loop: wait when nothing is queued; back-off after a pass without progress (L0).
RECV_IDLE_WAIT_S = 0.1
RECV_BACKOFF_S = 0.001
#: With arrival wakeups a pass without progress waits for a put instead (L1).
RECV_WAKEUP_WAIT_S = 0.05
#: While chunks are awaited and none comes, whether their producer still lives is looked at
#: this often: a request waiting on a dead producer fails within a second, not at its deadline.
PRODUCER_CHECK_S = 0.25

DRAINING_REASON = "previous sender generation is still draining"

#: How a receiving stage takes a chunk (spec §3.8): an AR stage (the Talker) gets the payload as
#: it is; a generation stage (Code2Wav) gets it merged into its request as a one-shot prefill.
WorkerType = Literal["ar", "generation"]

#: A processor turns one scheduler output into the payload of one chunk (spec §4).
Processor = Callable[..., dict[str, Any] | None]


@dataclass(eq=False)
class SenderGeneration:
    """The sender state of one generation of an external id (spec §3.2). Compared by identity."""

    serial: int
    in_flight: bool = False
    cancelled: bool = False
    terminal_pending: bool = False
    cleanup_deferred: bool = False
    num_puts: int = 0
    terminal_sent: bool = False
    #: A put of this generation failed: it sends nothing more (a later chunk would go out under
    #: the failed key and the receiver would take a gapped stream for a whole one).
    failed: bool = False


@dataclass(eq=False)
class LoadEntry:
    """One receive registration; its identity is the registration token (spec §3.7)."""

    serial: int
    request: Request
    source_metadata: dict[str, Any] | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def __str__(self) -> str:
        return f"entry {self.serial} of {self.request_id}"

    @property
    def external_req_id(self) -> str:
        return self.request.external_req_id


@dataclass(eq=False)
class SaveTask:
    multimodal_output: Any
    request: Request
    is_finished: bool
    is_segment_finished: bool
    new_token_ids: tuple[int, ...] | None
    segment_generation: int
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


class ChunkTransferAdapter:
    """The chunk sender and receiver of one stage process."""

    #: Per-external-id sender dicts; all are popped together when a generation retires.
    SENDER_DICTS = (
        "put_req_chunk",
        "requests_num_chunks_sent",
        "request_payload",
        "code_prompt_token_ids",
        "segment_generation",
        "ramp_chunk_count",
    )

    def __init__(
        self,
        connector: Connector,
        *,
        processor: Processor | None = None,
        receives_chunks: bool = True,
        sends_chunks: bool = True,
        worker_type: WorkerType = "generation",
        name: str = "adapter",
    ) -> None:
        k = current_kernel()
        self.connector = connector
        self.stage_id = connector.stage_id
        self.name = name
        self.processor = processor
        self.receives_chunks = receives_chunks
        self.sends_chunks = sends_chunks
        self.worker_type = worker_type
        self._processor_takes_new_ids = processor is not None and self._accepts_new_token_ids(processor)
        self._serials = 0
        self._stopped = False
        self._tasks: KTaskGroup | None = None
        self._saving = False

        # Sender state, keyed by external id.
        self._sender_state_lock = k.lock(f"{name}.sender_state")
        self._sender_tokens: dict[str, SenderGeneration] = {}
        self.put_req_chunk: dict[str, int] = {}
        self.requests_num_chunks_sent: dict[str, int] = {}
        self.request_payload: dict[str, Any] = {}
        self.code_prompt_token_ids: dict[str, list[Any]] = {}
        self.segment_generation: dict[str, int] = {}
        self.ramp_chunk_count: dict[str, int] = {}
        self._pending_save_reqs: deque[SaveTask | ReclaimTask] = deque()
        self._save_cond = k.signal(f"{name}.save")
        self._released = k.signal(f"{name}.released")

        # Receiver state, keyed by the stage-internal request id. Dicts with None values are
        # ordered sets: iteration order must not depend on PYTHONHASHSEED.
        self._receiver_state_lock = k.lock(f"{name}.receiver_state")
        self._registered_load_entries: dict[str, LoadEntry] = {}
        self.get_req_chunk: dict[str, int] = {}
        self.request_ids_mapping: dict[str, str] = {}
        self.upstream_exhausted_requests: dict[str, None] = {}
        self.segment_finished_requests: dict[str, None] = {}
        self._finished_load_reqs: dict[str, None] = {}
        self._pending_load_reqs: deque[LoadEntry] = deque()
        #: AR mode: the committed payload of each ready request, applied by the scheduler.
        self._pending_ar_prompt_updates: dict[str, dict[str, Any]] = {}
        self._recv_cond = k.signal(f"{name}.recv")
        #: Notified whenever a chunk is committed, so a scheduler can wait instead of spinning.
        self.chunk_ready = k.signal(f"{name}.chunk_ready")

        # The failure side channels: request id -> first reason, drained by the orchestrator.
        self._send_failures: dict[str, str] = {}
        self._receive_failures: dict[str, str] = {}

    def _next_serial(self) -> int:
        self._serials += 1
        return self._serials

    @staticmethod
    def _accepts_new_token_ids(processor: Processor) -> bool:
        params = inspect.signature(processor).parameters.values()
        return any(p.name == "new_token_ids" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)

    # == sender: enqueue (scheduler side; never does I/O) ========================================

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
        rejected: str | None = None
        async with self._sender_state_lock:
            expected = self.segment_generation.get(ext, generation)
            if generation < expected:
                log.info("Skip late save_async for %s: segment_generation=%d, expected=%d", ext, generation, expected)
                return False
            self.segment_generation[ext] = generation
            token = self._sender_tokens.get(ext)
            if self._rejects_while_draining(token):
                rejected = DRAINING_REASON
            elif not is_segment_finished and confirmed < self.requests_num_chunks_sent.get(ext, 0):
                log.warning("Skip save_async replay for %s: %d < watermark", ext, confirmed)
                return False
            else:
                self.requests_num_chunks_sent[ext] = confirmed
                if token is None:
                    token = self._sender_tokens[ext] = SenderGeneration(self._next_serial())
                self._pending_save_reqs.append(
                    SaveTask(
                        multimodal_output=multimodal_output,
                        request=_snapshot(request) if self.processor is not None else request,
                        is_finished=is_finished,
                        is_segment_finished=is_segment_finished,
                        new_token_ids=tuple(new_token_ids) if new_token_ids is not None else None,
                        segment_generation=generation,
                        sender_token=token,
                    )
                )
                if is_finished:
                    token.terminal_pending = True  # the #6670 terminal fence
                if is_segment_finished:
                    if request.segment_generation is not None:
                        self.segment_generation[ext] = generation + 1
                    self.requests_num_chunks_sent.pop(ext, None)
        if rejected is not None:
            log.error("save_async for %s rejected: %s", ext, rejected)
            k.note("adapter.save_async.rejected", ext=ext, req=request.request_id)
            self.record_send_failure(request.request_id, rejected)
            return False
        self._save_cond.notify()
        return True

    @staticmethod
    def _rejects_while_draining(token: SenderGeneration | None) -> bool:
        """New work for an id whose previous generation is cancelled but not yet retired is refused."""
        return token is not None and token.cancelled

    def is_draining(self, ext: str) -> bool:
        """True while a cancelled generation of ``ext`` still owns it: new work for ``ext`` is refused.

        Read from the token itself rather than through the refusal rule above, so that an
        orchestrator (or a scenario probe) sees the state even where that rule is mutated."""
        token = self._sender_tokens.get(ext)
        return token is not None and token.cancelled

    def has_active_sender(self, ext: str) -> bool:
        """True while a generation owns ``ext`` and is not cancelled (ownership starts at enqueue)."""
        token = self._sender_tokens.get(ext)
        return token is not None and not token.cancelled

    # == sender: the save task ===================================================================

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
            is_current = self._sender_tokens.get(ext) is token
            if is_current and self._may_send(token, is_terminal):
                token.in_flight = True
            else:
                is_current = False
        if not is_current:
            k.note("adapter.send.stale", ext=ext, gen=token.serial)
            if is_terminal:
                await self._release_terminal_fence(ext, token)
                if token.failed and self._sender_tokens.get(ext) is token:
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
                await self._release_terminal_fence(ext, token)
            async with self._sender_state_lock:
                if self._sender_tokens.get(ext) is token:
                    token.in_flight = False
                    if token.cancelled and not token.terminal_pending:
                        self._retire_generation_locked(ext, token)
            if is_terminal and token.failed and self._sender_tokens.get(ext) is token:
                # The terminal itself failed (or raised): no later task of this generation will
                # retire it, and its exact-range reclaim covers the key it may have created.
                await self.cleanup_sender(ext)

    @staticmethod
    def _may_send(token: SenderGeneration, is_terminal: bool) -> bool:
        """A cancellation vetoes ordinary chunks but never a terminal (#6670); a failed put
        vetoes everything after it."""
        return not token.failed and (is_terminal or not token.cancelled)

    def _run_processor(self, task: SaveTask) -> dict[str, Any] | None:
        if self.processor is None:
            out = task.multimodal_output
            return dict(out) if isinstance(out, dict) else None
        kwargs: dict[str, Any] = {
            "transfer_manager": self,
            "multimodal_output": task.multimodal_output,
            "request": task.request,
            "is_finished": self._flush_signal(task),
        }
        if self._processor_takes_new_ids:
            kwargs["new_token_ids"] = task.new_token_ids
        try:
            return self.processor(**kwargs)
        except Exception:
            log.exception("processor failed for %s; sending no data", task.request.request_id)
            return None

    @staticmethod
    def _flush_signal(task: SaveTask) -> bool:
        """What the processor sees as ``is_finished``: a segment end *or* a terminal must flush its
        remainder (#5413; the wire's is_segment_finished stays False on a terminal)."""
        return task.is_segment_finished or task.is_finished

    async def _send_for_generation(self, task: SaveTask, token: SenderGeneration) -> None:
        k = current_kernel()
        ext = task.request.external_req_id
        chunk_id = self.put_req_chunk.get(ext, 0)
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

        async with self._sender_state_lock:
            active = self._sender_tokens.get(ext) is token and self._may_send(token, task.is_finished)
        if not active:
            k.note("adapter.send.vetoed", ext=ext, gen=token.serial)
            return
        ok, cause = await self._put_chunk(token, key, chunk_id, payload)

        async with self._sender_state_lock:
            if ok and task.is_finished:
                token.terminal_sent = True
            token.failed = token.failed or not ok
            still_current = self._sender_tokens.get(ext) is token
            retiring_without_terminal = token.cancelled and not (task.is_finished or token.terminal_pending)
            if not still_current or retiring_without_terminal:
                log.debug("Ignoring completed put for retired request %s", ext)
                return
            if ok:
                # A fenced terminal of a cancelled generation still advances: a receiver may
                # already have consumed this key.
                self.put_req_chunk[ext] = chunk_id + 1
                self.ramp_chunk_count[ext] = self.ramp_chunk_count.get(ext, 0) + 1
        if ok:
            if truthy_scalar(meta["finished"]) and task.is_finished:
                await self.cleanup(task.request.request_id, ext)
        else:
            self._put_failed(task, key, cause)
        if task.is_segment_finished:
            for name in ("code_prompt_token_ids", "ramp_chunk_count"):
                getattr(self, name).pop(ext, None)

    async def _put_chunk(
        self, token: SenderGeneration, key: str, chunk_id: int, payload: dict[str, Any]
    ) -> tuple[bool, str]:
        """Put one chunk; whether it went out, and if not, why."""
        # The key range is recorded *before* the put: the in-flight key must be reclaimable even
        # if the abort wins while the put runs, or the put raises after creating the segment.
        token.num_puts = chunk_id + 1
        current_kernel().note("adapter.put", ext=key.rsplit("_", 2)[0], gen=token.serial, key=key)
        ok, _, metadata = await self.connector.put(str(self.stage_id), str(self.stage_id + 1), key, payload)
        if not ok:
            # A put that reports failure leaves nothing under its key (the connector's contract):
            # the key is not this generation's to reclaim; an older generation's chunk may be there.
            token.num_puts = chunk_id
        cause = metadata.get("error") if isinstance(metadata, dict) else None
        return ok, str(cause or "connector.put reported failure")

    async def _release_terminal_fence(self, ext: str, token: SenderGeneration) -> None:
        """Lower the fence and run a cleanup deferred while it was up, on every exit path."""
        async with self._sender_state_lock:
            token.terminal_pending = False
            deferred = token.cleanup_deferred
            token.cleanup_deferred = False
            still_current = self._sender_tokens.get(ext) is token
        # If the token no longer owns ext, its successor already reclaimed; cleaning now would
        # wipe the successor's state.
        if deferred and still_current:
            await self.cleanup_sender(ext)

    async def _run_cleanup_task(self, task: CleanupTask) -> None:
        k = current_kernel()
        await k.point("adapter.cleanup_shm.begin", prefix=task.prefix, n=task.num_puts, gen=task.generation)
        for i in range(task.num_puts):
            await self.connector.cleanup(f"{task.prefix}_{i}")
        k.note("adapter.cleanup_shm.end", prefix=task.prefix, gen=task.generation)

    async def _run_release_task(self, task: ReleaseTask) -> None:
        k = current_kernel()
        await k.point("adapter.release.begin", ext=task.ext, stage=self.stage_id)
        task.removed = await self.connector.cleanup_prefix(f"{task.ext}_{self.stage_id}_")
        k.note("adapter.release.end", ext=task.ext, removed=task.removed)
        self._released.notify()

    # == sender: cleanup (never waits for I/O) ===================================================

    async def cleanup_sender(self, ext: str) -> None:
        """Retire the sender generation of ``ext`` (spec §3.5). Idempotent; returns at once."""
        k = current_kernel()
        await k.point("adapter.cleanup_sender.begin", ext=ext, stage=self.stage_id)
        async with self._sender_state_lock:
            token = self._sender_tokens.get(ext)
            if token is None:
                self._clear_sender_state_locked(ext)
            elif self._fence_defers_cleanup(token):
                token.cancelled = token.cleanup_deferred = True
            else:
                token.cancelled = True
                if not token.in_flight:
                    self._retire_generation_locked(ext, token)
        await k.point("adapter.cleanup_sender.end", ext=ext)

    @staticmethod
    def _fence_defers_cleanup(token: SenderGeneration) -> bool:
        """While a terminal is queued, cleanup only marks the generation; the terminal task owes
        the reclaim (the #6670 fence)."""
        return token.terminal_pending

    def _retire_generation_locked(self, ext: str, token: SenderGeneration) -> None:
        # Queueing the reclaim and popping the token in one critical section is what puts every
        # task of a reusing generation behind the reclaim.
        self._queue_shm_cleanup_locked(ext, token)
        self._sender_tokens.pop(ext, None)
        self._clear_sender_state_locked(ext)

    def _queue_shm_cleanup_locked(self, ext: str, token: SenderGeneration) -> None:
        """Append the exact-range reclaim to the save FIFO, unless downstream still needs the
        successfully sent terminal."""
        if token.num_puts and not token.terminal_sent:
            self._pending_save_reqs.append(CleanupTask(ext, f"{ext}_{self.stage_id}", token.num_puts, token.serial))
            self._save_cond.notify()

    def _clear_sender_state_locked(self, ext: str) -> None:
        for name in self.SENDER_DICTS:
            getattr(self, name).pop(ext, None)

    # == receiver ================================================================================

    async def load_async(self, request: Request) -> None:
        """Register ``request`` to receive its next chunk (no duplicate registrations)."""
        if self.stage_id <= 0 or not self.receives_chunks:
            return
        k = current_kernel()
        if request.additional_information is None:
            request.additional_information = {}
        async with self._receiver_state_lock:
            entry = self._registered_load_entries.get(request.request_id)
            if entry is None:
                entry = LoadEntry(self._next_serial(), request)
                self._registered_load_entries[request.request_id] = entry
                self._pending_load_reqs.append(entry)
                k.note("adapter.register", stage=self.stage_id, req=request.request_id, entry=entry.serial)
                self._recv_cond.notify()
        # After the registration, as on upstream's scheduler thread: "still live? then register"
        # cannot be split by an abort.
        await k.point("adapter.load_async", req=request.request_id)

    def _entry_is_current_locked(self, entry: LoadEntry, phase: str) -> bool:
        """Identity, not membership: a re-registered id has a new entry (spec §3.7)."""
        return self._registered_load_entries.get(entry.request_id) is entry

    async def _poll_single_request(self, entry: LoadEntry) -> bool:
        """Poll the next chunk of ``entry``; True drops the entry from the queue."""
        k = current_kernel()
        req_id = entry.request_id
        async with self._receiver_state_lock:
            if not self._entry_is_current_locked(entry, "before_get"):
                return True
            # Published under the lock, so a stale entry cannot recreate it after cleanup.
            self.request_ids_mapping[req_id] = entry.external_req_id
            chunk_id = self.get_req_chunk.get(req_id, 0)
        key = chunk_key(entry.external_req_id, self.stage_id - 1, chunk_id)
        k.note("adapter.poll", stage=self.stage_id, req=req_id, entry=entry.serial, key=key)
        try:
            # The identity check is asked again while the key is held, before anything is
            # consumed: a poll that outlived its registration must leave a reused id's chunk.
            result = await self.connector.get(
                str(self.stage_id - 1),
                str(self.stage_id),
                key,
                entry.source_metadata,
                claim=lambda: self._entry_is_current_locked(entry, "claim"),
            )
        except CorruptChunk as e:
            # Consumed, and never coming back: the request fails now, not at its input deadline.
            self.record_receive_failure(
                req_id, f"the chunk {e.key} from stage {self.stage_id - 1} is corrupt: {e.cause}"
            )
            self.chunk_ready.notify()
            return True
        async with self._receiver_state_lock:
            if not self._entry_is_current_locked(entry, "after_get"):
                if result is not None:
                    k.note("adapter.poll.discarded", req=req_id, key=key)
                return True  # cleanup is a commit barrier
            if result is None:
                return False
            ok = self._commit_received_chunk(entry, result[0], chunk_id)
            if ok:
                self._registered_load_entries.pop(req_id, None)
                k.note("adapter.unregister", stage=self.stage_id, req=req_id, why="committed")
        if ok:
            self.chunk_ready.notify()
        return ok

    def _commit_received_chunk(self, entry: LoadEntry, payload: Any, chunk_id: int) -> bool:
        """Commit one chunk into the request (spec §3.8); True if it is ready. Under the receiver lock."""
        k = current_kernel()
        if not payload:
            return False
        req_id = entry.request_id
        request = entry.request
        self.get_req_chunk[req_id] = chunk_id + 1  # even an empty non-terminal chunk uses its id
        meta = payload.get("meta", {})
        if not isinstance(meta, dict):
            meta = {}
        finished = truthy_scalar(meta.get("finished"))
        segment_finished = truthy_scalar(meta.get("is_segment_finished"))
        k.note("adapter.commit", stage=self.stage_id, req=req_id, entry=entry.serial, chunk=chunk_id, finished=finished)
        if finished:
            self.upstream_exhausted_requests[req_id] = None
            request.resumable = False
        if segment_finished:
            self.segment_finished_requests[req_id] = None
        if self.worker_type == "ar":
            # The scheduler applies it to the ready request, on its own task (spec §3.8 AR mode).
            self._pending_ar_prompt_updates[req_id] = payload
        elif not self._merge_generation_chunk(request, payload, meta, finished, segment_finished):
            return False
        self._finished_load_reqs[req_id] = None
        return True

    @staticmethod
    def _merge_generation_chunk(
        request: Request, payload: dict[str, Any], meta: dict[str, Any], finished: bool, segment_finished: bool
    ) -> bool:
        """Generation mode: the chunk becomes the request's one-shot prompt; False if not ready."""
        codes = payload.get("codes") if isinstance(payload.get("codes"), dict) else {}
        audio = codes.get("audio")
        if isinstance(audio, torch.Tensor):
            new_ids = ([0] if audio.numel() else []) if audio.ndim >= 2 else audio.tolist()
        elif isinstance(audio, list):
            new_ids = audio
        else:
            new_ids = []
        replace = meta.get("replace_runtime_additional_information") is True
        info: dict[str, Any] = {} if replace else dict(request.additional_information or {})
        for name, value in payload.items():
            if not isinstance(value, dict):
                info[name] = value
                continue
            merged = dict(info.get(name) or {}) if isinstance(info.get(name), dict) else {}
            for sub, sub_value in value.items():
                if (
                    name == "codes"
                    and sub == "audio"
                    and not (isinstance(sub_value, torch.Tensor) and sub_value.ndim >= 2)
                ):
                    continue  # 1-D codes live only in the prompt
                if name == "meta" and sub == "finished":
                    continue  # finished steers exhaustion and is never merged
                merged[sub] = sub_value
            info[name] = merged
        request.additional_information = info
        request.prompt_token_ids = list(new_ids)
        request.num_computed_tokens = 0  # every chunk is a fresh one-shot prefill
        if not new_ids and segment_finished:
            request.prompt_token_ids = [0]
        if not new_ids and not finished and not segment_finished:
            return False  # an empty non-terminal chunk is not ready: keep polling the next id
        request.num_prompt_tokens = len(request.prompt_token_ids)
        return True

    def take_ar_update(self, request_id: str) -> dict[str, Any] | None:
        """AR mode: the payload committed for ``request_id`` (once), to apply after :meth:`pop_ready`."""
        return self._pending_ar_prompt_updates.pop(request_id, None)

    def pop_ready(self, request_id: str) -> bool:
        """True (once) if a committed chunk of ``request_id`` is ready for the scheduler."""
        if request_id in self._finished_load_reqs:
            del self._finished_load_reqs[request_id]
            return True
        return False

    def has_ready_chunks(self) -> bool:
        """True while a committed chunk waits for its scheduler (see :meth:`pop_ready`)."""
        return bool(self._finished_load_reqs)

    def is_done_receiving_chunks(self, request_id: str) -> bool:
        """True once upstream sent its terminal (not: this stage is done, #5349)."""
        return request_id in self.upstream_exhausted_requests

    async def cleanup_receiver(self, request_id: str) -> None:
        """Forget every receiver structure of ``request_id``; idempotent, keeps no tombstone."""
        k = current_kernel()
        await k.point("adapter.cleanup_receiver.begin", req=request_id)
        async with self._receiver_state_lock:
            k.note("adapter.unregister", stage=self.stage_id, req=request_id, why="cleanup")
            for structure in (
                self._registered_load_entries,
                self.get_req_chunk,
                self.request_ids_mapping,
                self.upstream_exhausted_requests,
                self.segment_finished_requests,
                self._finished_load_reqs,
                self._pending_ar_prompt_updates,
            ):
                structure.pop(request_id, None)
            # Its queued poll goes too (a poll already running is stopped by the identity check).
            self._pending_load_reqs = deque(e for e in self._pending_load_reqs if e.request_id != request_id)
        await k.point("adapter.cleanup_receiver.end", req=request_id)

    async def cleanup(self, request_id: str, external_req_id: str | None = None) -> None:
        """Receiver cleanup of this stage's ``request_id`` plus sender cleanup of its external id."""
        ext = external_req_id if external_req_id is not None else self.request_ids_mapping.get(request_id, request_id)
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
            await self._released.wait(SAVE_IDLE_WAIT_S)
        return task.removed

    # == the send-failure side channel ========================================================

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

    def record_receive_failure(self, request_id: str, reason: str) -> None:
        """A chunk of ``request_id`` will never arrive (it was corrupt, or its producer died)."""
        current_kernel().note("adapter.receive_failed", stage=self.stage_id, req=request_id)
        self._receive_failures.setdefault(request_id, reason)

    def collect_failed_receive_request_ids(self) -> dict[str, str]:
        failed = dict(self._receive_failures)
        self._receive_failures.clear()
        return failed

    # == background loops ========================================================================

    async def save_loop(self) -> None:
        self._saving = True
        try:
            await self._save_until_stopped()
        finally:
            self._saving = False

    async def _save_until_stopped(self) -> None:
        while not self._stopped:
            await self._drain_save_queue()
            self._reap_after_pass()
            if not self._pending_save_reqs and not self._stopped:
                await self._save_cond.wait(SAVE_IDLE_WAIT_S)
        # Reclaim work queued before the stop still runs; unsent chunks are dropped.
        self._pending_save_reqs = deque(t for t in self._pending_save_reqs if not isinstance(t, SaveTask))
        await self._drain_save_queue()

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

    def _reap_after_pass(self) -> None:
        """The idle reap (#8082 g): consumed keys are forgotten even when nothing more is sent."""
        self.connector.reap_consumed()

    async def recv_loop(self) -> None:
        k = current_kernel()
        producer_checked = k.now()
        while not self._stopped:
            generation = self.connector.get_wakeup_generation()
            progress = 0
            batch = list(self._pending_load_reqs)
            self._pending_load_reqs.clear()
            for entry in batch:
                try:
                    drop = await self._poll_single_request(entry)
                except Exception:
                    log.warning("poll of %s failed", entry.request_id, exc_info=True)
                    drop = False
                if drop:
                    progress += 1
                else:
                    self._pending_load_reqs.append(entry)
            if self._stopped:
                break
            if not progress and self._pending_load_reqs and k.now() - producer_checked >= PRODUCER_CHECK_S:
                producer_checked = k.now()
                self._fail_if_producer_died()
            if not self._pending_load_reqs:
                await self._recv_cond.wait(RECV_IDLE_WAIT_S)
            elif not progress:
                if generation is not None:
                    await self.connector.wait_for_change(generation, timeout=RECV_WAKEUP_WAIT_S)
                else:
                    await self._recv_cond.wait(RECV_BACKOFF_S)

    def _fail_if_producer_died(self) -> None:
        """Every request waiting for a chunk of a dead producer fails: nothing will come."""
        if self.connector.producer_alive():
            return
        reason = f"producer stage {self.stage_id - 1} exited"
        for entry in self._pending_load_reqs:
            self.record_receive_failure(entry.request_id, reason)
        self._pending_load_reqs.clear()
        self.chunk_ready.notify()

    async def run(self) -> None:
        """Run the save loop (if this stage sends) and the receive loop (if it receives) until
        :meth:`shutdown`, then close the connector."""
        k = current_kernel()
        try:
            async with k.task_group() as tasks:
                self._tasks = tasks
                if self.sends_chunks:
                    tasks.start_soon(self.save_loop, name=f"{self.name}.save")
                if self.receives_chunks and self.stage_id > 0:
                    tasks.start_soon(self.recv_loop, name=f"{self.name}.recv")
        finally:
            await self.connector.close()

    def shutdown(self) -> None:
        self._stopped = True
        self._save_cond.notify()
        self._recv_cond.notify()

    # == introspection ===========================================================================

    def residue(self) -> dict[str, list[str]]:
        """Everything this adapter still holds, by structure name (empty structures omitted).

        Every container attribute counts, so a structure added later (or by a mutant) cannot
        hide from the no-tombstones check.
        """
        held: dict[str, list[str]] = {}
        for name, value in vars(self).items():
            if isinstance(value, (dict, set, deque, list)) and value:
                held[name.lstrip("_")] = [str(item) for item in value]
        return held
