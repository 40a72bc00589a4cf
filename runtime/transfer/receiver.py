"""The receiving half of a stage's adapter: the upstream stage's chunks, committed into the
scheduler's requests (spec §3.7–§3.10).

A single receive task polls the next chunk key of every registered request. A registration
(:class:`LoadEntry`) is checked by identity before and after every ``get``, and by the connector
while it holds the key; cleanup drops the registration, so a late chunk is consumed but never
committed, and no tombstone is ever kept.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from runtime.connectors.base import Connector, CorruptChunk
from runtime.connectors.keys import chunk_key
from runtime.kernel import current_kernel
from runtime.request import Request
from runtime.transfer import rules
from runtime.transfer.sender import truthy_scalar

log = logging.getLogger(__name__)

#: Receive loop: wait when nothing is queued; back-off after a pass without progress (L0).
RECV_IDLE_WAIT_S = 0.1
RECV_BACKOFF_S = 0.001
#: With arrival wakeups a pass without progress waits for a put instead (L1).
RECV_WAKEUP_WAIT_S = 0.05
#: While chunks are awaited and none comes, whether their producer still lives is looked at
#: this often: a request waiting on a dead producer fails within a second, not at its deadline.
PRODUCER_CHECK_S = 0.25

#: How a receiving stage takes a chunk (spec §3.8): an AR stage (the Talker) gets the payload as
#: it is; a generation stage (Code2Wav) gets it merged into its request as a one-shot prefill.
WorkerType = Literal["ar", "generation"]


@dataclass(eq=False)
class LoadEntry:
    """One receive registration; its identity is the registration token (spec §3.7)."""

    serial: int
    request: Request

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def external_req_id(self) -> str:
        return self.request.external_req_id

    def __str__(self) -> str:
        return f"entry {self.serial} of {self.request_id}"


def merge_generation_chunk(
    request: Request, payload: dict[str, Any], meta: dict[str, Any], finished: bool, segment_finished: bool
) -> bool:
    """Generation mode (spec §3.8): the chunk becomes the request's one-shot prompt; False if
    it is not ready."""
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
            if name == "codes" and sub == "audio" and not (isinstance(sub_value, torch.Tensor) and sub_value.ndim >= 2):
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


class ChunkReceiver:
    """The chunk receiver of one stage process: registrations, the receive task and commits.

    Its state is keyed by the stage-internal request id. Dicts with None values are ordered
    sets: iteration order must not depend on PYTHONHASHSEED.
    """

    def __init__(
        self,
        connector: Connector,
        *,
        worker_type: WorkerType,
        serials: Iterator[int],
        name: str,
        active_stream_window: int = 0,
    ) -> None:
        k = current_kernel()
        self.connector = connector
        self.stage_id = connector.stage_id
        self.worker_type = worker_type
        self._serials = serials
        self._stopped = False
        #: How many streams may be active at once (0: no limit), and those that are, in the order
        #: they were admitted (spec §5.2 step 5, #5349).
        self.active_stream_window = active_stream_window
        self._active_streams: dict[str, None] = {}

        self._receiver_state_lock = k.lock(f"{name}.receiver_state")
        self._registered_load_entries: dict[str, LoadEntry] = {}
        self.get_req_chunk: dict[str, int] = {}
        self.request_ids_mapping: dict[str, str] = {}
        self.upstream_exhausted_requests: dict[str, None] = {}
        self._finished_load_reqs: dict[str, None] = {}
        self._pending_load_reqs: deque[LoadEntry] = deque()
        #: AR mode: the committed payload of each ready request, applied by the scheduler.
        self._pending_ar_prompt_updates: dict[str, dict[str, Any]] = {}
        self._recv_cond = k.signal(f"{name}.recv")
        #: Notified whenever a chunk is committed or a request's chunk will never come (its
        #: receive failed), so a consumer can wait instead of spinning.
        self.chunk_ready = k.signal(f"{name}.chunk_ready")

        #: The failure side channel: request id -> first reason, drained by the orchestrator.
        self._receive_failures: dict[str, str] = {}

    # == registration ==========================================================================

    async def load_async(self, request: Request) -> None:
        """Register ``request`` to receive its next chunk (no duplicate registrations)."""
        k = current_kernel()
        async with self._receiver_state_lock:
            entry = self._registered_load_entries.get(request.request_id)
            if entry is None:
                entry = LoadEntry(next(self._serials), request)
                self._registered_load_entries[request.request_id] = entry
                self._pending_load_reqs.append(entry)
                k.note("adapter.register", stage=self.stage_id, req=request.request_id, entry=entry.serial)
                self._recv_cond.notify()  # the receive loop, idle
                self.connector.poke()  # or waiting for a put to the stage
        # After the registration, as on upstream's scheduler thread: "still live? then register"
        # cannot be split by an abort.
        await k.point("adapter.load_async", req=request.request_id)

    # == poll and commit =======================================================================

    async def _poll_single_request(self, entry: LoadEntry) -> bool:
        """Poll the next chunk of ``entry``; True drops the entry from the queue."""
        k = current_kernel()
        req_id = entry.request_id
        async with self._receiver_state_lock:
            if not rules.entry_is_current(self._registered_load_entries, entry):
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
                claim=lambda: rules.entry_is_current(self._registered_load_entries, entry),
            )
        except CorruptChunk as e:
            result, unusable = None, f"the chunk {e.key} from stage {self.stage_id - 1} is corrupt: {e.cause}"
        else:
            unusable = None
            if result is not None and not (isinstance(result[0], dict) and result[0]):
                # Upstream commits nothing here and polls the consumed key again until the input
                # deadline (spec §3.8: "senders always include meta"); a bad producer fails it now.
                unusable = f"the chunk {key} from stage {self.stage_id - 1} holds no stage payload: {result[0]!r:.40}"
        async with self._receiver_state_lock:
            if not rules.may_commit(self._registered_load_entries, entry):
                if result is not None or unusable is not None:
                    k.note("adapter.poll.discarded", req=req_id, key=key)
                return True  # (a failure of a cleaned-up entry is not the re-registered id's)
            if unusable is not None:
                # Consumed, and never coming back: the request fails now, not at its input deadline.
                self.record_receive_failure(req_id, unusable)
                ok = True
            elif result is None:
                return False
            else:
                ok = self._commit_received_chunk(entry, result[0], chunk_id)
                if ok:
                    self._registered_load_entries.pop(req_id, None)
                    k.note("adapter.unregister", stage=self.stage_id, req=req_id, why="committed")
        if ok:
            self.chunk_ready.notify()
        return ok

    def _commit_received_chunk(self, entry: LoadEntry, payload: dict[str, Any], chunk_id: int) -> bool:
        """Commit one chunk into the request (spec §3.8); True if it is ready. Under the receiver lock."""
        k = current_kernel()
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
        if self.worker_type == "ar":
            # The scheduler applies it to the ready request, on its own task (spec §3.8 AR mode).
            self._pending_ar_prompt_updates[req_id] = payload
        elif not merge_generation_chunk(request, payload, meta, finished, segment_finished):
            return False
        self._finished_load_reqs[req_id] = None
        return True

    # == what the scheduler takes ==============================================================

    def take_ar_update(self, request_id: str) -> dict[str, Any] | None:
        """AR mode: the payload committed for ``request_id`` (once), to apply after :meth:`pop_ready`."""
        return self._pending_ar_prompt_updates.pop(request_id, None)

    def pop_ready(self, request_id: str) -> bool:
        """True (once) if a committed chunk of ``request_id`` is ready for the scheduler."""
        if request_id in self._finished_load_reqs:
            del self._finished_load_reqs[request_id]
            return True
        return False

    def has_ready_chunks(self, request_id: str | None = None) -> bool:
        """True while a committed chunk (of ``request_id``, if given) waits for its scheduler
        (see :meth:`pop_ready`)."""
        return request_id in self._finished_load_reqs if request_id is not None else bool(self._finished_load_reqs)

    def is_done_receiving_chunks(self, request_id: str) -> bool:
        """True once upstream sent its terminal (not: this stage is done, #5349)."""
        return request_id in self.upstream_exhausted_requests

    # == the active-stream window ================================================================

    def admit(self, request_ids: Iterable[str]) -> None:
        """Make streams active, first come first served, while the window has room. A stream
        stays active until :meth:`cleanup_receiver` ends it — not when upstream is exhausted:
        the stage still has to finish it (#5349)."""
        if not self.active_stream_window:
            return
        for request_id in request_ids:
            if not rules.stream_window_has_room(len(self._active_streams), self.active_stream_window):
                return
            if request_id not in self._active_streams:
                self._active_streams[request_id] = None
                current_kernel().note(
                    "adapter.stream.admitted", stage=self.stage_id, req=request_id, window=self.active_stream_window
                )

    def is_active(self, request_id: str) -> bool:
        """Whether the stage may take up ``request_id``'s stream now (always, with no window)."""
        return not self.active_stream_window or request_id in self._active_streams

    def may_admit(self, request_id: str) -> bool:
        """Whether ``request_id``'s stream is active, or a slot is free for the next :meth:`admit`."""
        return self.is_active(request_id) or rules.stream_window_has_room(
            len(self._active_streams), self.active_stream_window
        )

    # == cleanup ===============================================================================

    async def cleanup_receiver(self, request_id: str) -> None:
        """Forget every receiver structure of ``request_id``; idempotent, keeps no tombstone."""
        k = current_kernel()
        await k.point("adapter.cleanup_receiver.begin", req=request_id)
        async with self._receiver_state_lock:
            k.note("adapter.unregister", stage=self.stage_id, req=request_id, why="cleanup")
            for structure in (
                self._active_streams,
                self._registered_load_entries,
                self.get_req_chunk,
                self.request_ids_mapping,
                self.upstream_exhausted_requests,
                self._finished_load_reqs,
                self._pending_ar_prompt_updates,
            ):
                structure.pop(request_id, None)
            # Its queued poll goes too (a poll already running is stopped by the identity check).
            self._pending_load_reqs = deque(e for e in self._pending_load_reqs if e.request_id != request_id)
        await k.point("adapter.cleanup_receiver.end", req=request_id)

    # == the receive-failure side channel ======================================================

    def record_receive_failure(self, request_id: str, reason: str) -> None:
        """A chunk of ``request_id`` will never arrive (it was corrupt, or its producer died)."""
        current_kernel().note("adapter.receive_failed", stage=self.stage_id, req=request_id)
        self._receive_failures.setdefault(request_id, reason)

    def has_receive_failure(self, request_id: str) -> bool:
        """True while a failure of ``request_id`` waits to be collected: a consumer waiting on
        :attr:`chunk_ready` for its chunk stops waiting (it is rung for failures too)."""
        return request_id in self._receive_failures

    def collect_failed_receive_request_ids(self) -> dict[str, str]:
        failed = dict(self._receive_failures)
        self._receive_failures.clear()
        return failed

    # == the receive loop ======================================================================

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
                await self._recv_cond.wait(RECV_IDLE_WAIT_S, ready=self._recv_loop_has_work)
            elif not progress:
                if generation is not None:
                    # Besides a put: a request registered since this pass began, or the stop.
                    await self.connector.wait_for_change(
                        generation,
                        timeout=RECV_WAKEUP_WAIT_S,
                        ready=lambda: self._stopped or any(e not in batch for e in self._pending_load_reqs),  # noqa: B023
                    )
                else:
                    await self._recv_cond.wait(RECV_BACKOFF_S)

    def _recv_loop_has_work(self) -> bool:
        return bool(self._pending_load_reqs) or self._stopped

    def _fail_if_producer_died(self) -> None:
        """Every request waiting for a chunk of a dead producer fails: nothing will come."""
        if not self.connector.producer_alive():
            self._fail_waiting(f"producer stage {self.stage_id - 1} exited")

    def producer_moved(self) -> None:
        """The producer died and its next life writes into a new namespace: the chunks the dead
        one sent went with its own, swept, so every request still waiting for one fails now
        (a request the dead stage had finished would otherwise wait for its input deadline)."""
        self._fail_waiting(f"producer stage {self.stage_id - 1} died: the chunks it had sent went with it")

    def _fail_waiting(self, reason: str) -> None:
        for entry in self._pending_load_reqs:
            self.record_receive_failure(entry.request_id, reason)
        self._pending_load_reqs.clear()
        self.chunk_ready.notify()

    def stop(self) -> None:
        """End the receive loop after its current pass."""
        self._stopped = True
        self._recv_cond.notify()
        self.connector.poke()
