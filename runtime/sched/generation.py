"""The generation scheduler of a chunk-fed stage (Code2Wav), spec §5.

Each :meth:`GenerationScheduler.step` is one ``schedule() → execute → update_from_output`` round:

1. **process_pending_chunks** — a request with no chunk in hand registers for its next one
   (``load_async``) and is parked as ``WAITING_FOR_CHUNK``; a parked request whose chunk was
   committed becomes *ready*; requests the scheduler no longer tracks are purged (#3736).
2. **input-wait deadline** — a request stalled longer than ``input_wait_timeout_s`` since its
   last arrival fails (#4855 R1.1); 0 disables it.
3. **schedule** — every ready request runs its chunk as one one-shot prefill; a request whose
   upstream is exhausted and that has nothing left finishes *without* a model pass (#3613). The
   ready mark is cleared once scheduled.
4. **execute** — the model callback turns the scheduled chunks into outputs.
5. **update_from_output** — a request finishes when upstream sent its terminal and its last
   chunk was computed; it is freed and the adapter forgets it.
6. **restore_queues** — parked requests return to their queues (a request is parked only for the
   duration of one step).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.kernel import current_kernel
from runtime.request import Request, RequestStatus
from runtime.transfer.adapter import ChunkTransferAdapter

#: VLLM_OMNI_INPUT_WAIT_TIMEOUT_S's default (spec §9).
INPUT_WAIT_TIMEOUT_S = 600.0
#: How long an idle scheduler waits for a chunk before it looks again (deadlines, aborts).
IDLE_WAIT_S = 0.05


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's chunk, as the model runner gets it."""

    request: Request
    prompt_token_ids: list[int]
    left_context_size: int


@dataclass(frozen=True)
class StageOutput:
    request_id: str
    data: Any
    finished: bool
    error: str | None = None


#: The model runner: scheduled chunks in, one output payload per chunk out (same order).
ModelRunner = Callable[[list[ScheduledChunk]], list[Any]]


def validate_input_wait_timeout(value: float) -> float:
    """A negative or non-finite deadline is a start-up error; 0 disables it (#4855 R1.4)."""
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"input wait timeout must be a finite number >= 0, got {value!r}")
    return value


@dataclass
class GenerationScheduler:
    adapter: ChunkTransferAdapter
    run_model: ModelRunner
    input_wait_timeout_s: float = INPUT_WAIT_TIMEOUT_S
    requests: dict[str, Request] = field(default_factory=dict)
    waiting: list[Request] = field(default_factory=list)
    running: list[Request] = field(default_factory=list)
    #: Ready to schedule: a chunk was committed and not yet scheduled.
    ready: dict[str, None] = field(default_factory=dict)
    #: request id -> when it started waiting for its current chunk (reset by every arrival).
    waiting_since: dict[str, float] = field(default_factory=dict)
    #: The queue a parked request returns to.
    origin_status: dict[str, RequestStatus] = field(default_factory=dict)
    #: Aborts asked for since the last step (applied at the start of the next one).
    pending_aborts: dict[str, None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_input_wait_timeout(self.input_wait_timeout_s)

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self.pending_aborts)

    def request_abort(self, request_id: str) -> None:
        """Ask for ``request_id`` to be aborted. Returns at once; the abort is applied at the start
        of the next step, between two schedules, as an engine core applies aborts — so it never
        lands in the middle of one (where a freed request could be re-queued, #3736)."""
        self.pending_aborts[request_id] = None

    async def _apply_aborts(self) -> list[StageOutput]:
        outputs = []
        for request_id in list(self.pending_aborts):
            del self.pending_aborts[request_id]
            request = self.requests.get(request_id)
            if request is None:
                continue
            await self.adapter.finish_requests([request])
            self._free(request, RequestStatus.FINISHED_ABORTED)
            outputs.append(StageOutput(request_id, None, finished=True, error="aborted"))
        return outputs

    async def serve(self, on_output: Callable[[StageOutput], None]) -> None:
        """Step until no request is left, handing every output to ``on_output``; between steps
        that produced nothing, wait for the next committed chunk instead of spinning."""
        while self.has_unfinished():
            outputs = await self.step()
            for out in outputs:
                on_output(out)
            if not outputs:
                await self.adapter.chunk_ready.wait(IDLE_WAIT_S)

    # -- one step ---------------------------------------------------------------------------------

    async def step(self) -> list[StageOutput]:
        outputs = await self._apply_aborts()
        parked = await self._process_pending_chunks()
        outputs += await self._expire_stalled()
        try:
            scheduled, finishing = self._schedule()
            results = self.run_model(scheduled) if scheduled else []
            outputs += await self._update_from_output(scheduled, results, finishing)
        finally:
            self._restore_queues(parked)
        return outputs

    async def _process_pending_chunks(self) -> list[Request]:
        """Register requests for their next chunk and mark arrivals ready; returns the parked."""
        parked: list[Request] = []
        for queue, target in ((self.waiting, RequestStatus.WAITING), (self.running, RequestStatus.RUNNING)):
            for request in list(queue):
                rid = request.request_id
                if not self._is_tracked(request):  # freed by an abort while queued (#3736)
                    queue.remove(request)
                    await self.adapter.cleanup_receiver(rid)
                    continue
                if request.status is not RequestStatus.WAITING_FOR_CHUNK:
                    if rid in self.ready or self.adapter.is_done_receiving_chunks(rid):
                        continue
                    await self.adapter.load_async(request)
                    request.status = RequestStatus.WAITING_FOR_CHUNK
                    self._start_waiting(rid)
                    self.origin_status[rid] = target
                elif self.adapter.pop_ready(rid):
                    request.status = self.origin_status.pop(rid, target)
                    self.ready[rid] = None
                    self._input_arrived(rid)
                    continue
                queue.remove(request)
                parked.append(request)
        return parked

    # The input-wait deadline measures *stall* time: the clock starts when a request parks for a
    # chunk and restarts with every arrival, so a long healthy stream never times out (#4855 R1.1).

    def _start_waiting(self, request_id: str) -> None:
        self.waiting_since.setdefault(request_id, current_kernel().now())

    def _input_arrived(self, request_id: str) -> None:
        self.waiting_since.pop(request_id, None)

    def _timed_out_request_ids(self) -> list[str]:
        """Requests stalled longer than the deadline (upstream ``collect_timed_out_request_ids``)."""
        if self.input_wait_timeout_s <= 0:
            return []  # 0 disables the deadline (validated at start-up, R1.4)
        now = current_kernel().now()
        return [rid for rid, since in self.waiting_since.items() if now - since > self.input_wait_timeout_s]

    async def _expire_stalled(self) -> list[StageOutput]:
        outputs = []
        for rid in self._timed_out_request_ids():
            request = self.requests[rid]
            await self.adapter.finish_requests([request])
            self._free(request, RequestStatus.FINISHED_ERROR)
            reason = f"Timed out waiting for connector input after {self.input_wait_timeout_s:g}s"
            outputs.append(StageOutput(rid, None, finished=True, error=reason))
        return outputs

    def _schedule(self) -> tuple[list[ScheduledChunk], list[Request]]:
        scheduled: list[ScheduledChunk] = []
        finishing: list[Request] = []
        for request in list(self.waiting):
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        for request in self.running:
            rid = request.request_id
            if (
                rid in self.ready
                and request.prompt_token_ids
                and request.num_computed_tokens < len(request.prompt_token_ids)
            ):
                meta = (request.additional_information or {}).get("meta") or {}
                scheduled.append(
                    ScheduledChunk(request, list(request.prompt_token_ids), int(meta.get("left_context_size", 0)))
                )
                request.num_computed_tokens = len(request.prompt_token_ids)  # one-shot prefill
            elif self.adapter.is_done_receiving_chunks(rid):
                finishing.append(request)  # nothing left: finish without a model pass (#3613)
            self.ready.pop(rid, None)
        return scheduled, finishing

    async def _update_from_output(
        self, scheduled: list[ScheduledChunk], results: list[Any], finishing: list[Request]
    ) -> list[StageOutput]:
        outputs = []
        done_now = {r.request_id for r in finishing}
        for chunk, data in zip(scheduled, results, strict=True):
            rid = chunk.request.request_id
            done = self.adapter.is_done_receiving_chunks(rid)
            outputs.append(StageOutput(rid, data, finished=done))
            if done:
                done_now.add(rid)
        for request in finishing:
            outputs.append(StageOutput(request.request_id, None, finished=True))
        for rid in done_now:
            request = self.requests[rid]
            await self.adapter.cleanup(rid, request.external_req_id)
            self._free(request, RequestStatus.FINISHED_STOPPED)
        return outputs

    def _restore_queues(self, parked: list[Request]) -> None:
        for request in parked:
            if not self._is_tracked(request):
                continue  # aborted while parked: never re-inject a freed request (#3736)
            origin = self.origin_status.get(request.request_id, RequestStatus.WAITING)
            (self.running if origin is RequestStatus.RUNNING else self.waiting).append(request)

    def _is_tracked(self, request: Request) -> bool:
        """Still this scheduler's request. A request freed in the middle of a step (the input-wait
        deadline) may sit in that step's parked list; it must never be polled or re-queued again
        (#3736: a worker KeyError on the freed id)."""
        return self.requests.get(request.request_id) is request

    def _free(self, request: Request, status: RequestStatus) -> None:
        rid = request.request_id
        request.status = status
        self.requests.pop(rid, None)
        for structure in (self.ready, self.waiting_since, self.origin_status):
            structure.pop(rid, None)
        for queue in (self.waiting, self.running):
            if request in queue:
                queue.remove(request)

    def residue(self) -> dict[str, list[str]]:
        structures: dict[str, Any] = {
            "requests": self.requests,
            "waiting": [r.request_id for r in self.waiting],
            "running": [r.request_id for r in self.running],
            "ready": self.ready,
            "waiting_since": self.waiting_since,
            "origin_status": self.origin_status,
            "pending_aborts": self.pending_aborts,
        }
        return {name: [str(x) for x in items] for name, items in structures.items() if items}
