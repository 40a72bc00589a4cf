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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runtime.config.deploy import MAX_NUM_SEQS
from runtime.kernel import current_kernel
from runtime.request import Request, RequestStatus
from runtime.sched.base import INPUT_WAIT_TIMEOUT_S, StageOutput, StageScheduler
from runtime.transfer.adapter import ChunkTransferAdapter

__all__ = ["INPUT_WAIT_TIMEOUT_S", "GenerationScheduler", "ModelRunner", "ScheduledChunk", "StageOutput"]


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's chunk, as the model runner gets it."""

    request: Request
    prompt_token_ids: list[int]
    left_context_size: int
    #: The request's whole input, forwarded at once (``async_chunk`` off): decode it offline.
    whole: bool = False


#: The model runner: scheduled chunks in, one output payload per chunk out (same order).
ModelRunner = Callable[[list[ScheduledChunk]], list[Any]]


class GenerationScheduler(StageScheduler):
    """Code2Wav's scheduler: each committed chunk is one one-shot prefill."""

    def __init__(
        self,
        adapter: ChunkTransferAdapter,
        run_model: ModelRunner,
        input_wait_timeout_s: float = INPUT_WAIT_TIMEOUT_S,
        *,
        max_num_seqs: int = MAX_NUM_SEQS,
    ) -> None:
        super().__init__(adapter, input_wait_timeout_s, max_num_seqs=max_num_seqs)
        self.run_model = run_model
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        #: Ready to schedule: a chunk was committed and not yet scheduled.
        self.ready: dict[str, None] = {}
        #: The queue a parked request returns to.
        self.origin_status: dict[str, RequestStatus] = {}
        #: Requests whose whole input was forwarded (never chunk-fed).
        self.forwarded: dict[str, None] = {}

    def add_request(self, request: Request, codes: list[int] | None = None) -> None:
        """Add a chunk-fed request, or (with ``codes``, codebook-major flat ids) one whose whole
        input was forwarded: it runs once and finishes (``async_chunk`` off)."""
        request.status = RequestStatus.WAITING
        if codes is not None:
            request.prompt_token_ids = list(codes)
            request.num_computed_tokens = 0
            self.forwarded[request.request_id] = None
            self.ready[request.request_id] = None
        self.waiting.append(request)
        super().add_request(request)

    def _input_complete(self, request_id: str) -> bool:
        """Upstream has nothing more for the request: its terminal chunk arrived, or it was forwarded whole."""
        return request_id in self.forwarded or self.adapter.is_done_receiving_chunks(request_id)

    def _has_new_request(self) -> bool:
        """A step moves every waiting request its active-stream window lets in on (to running, as
        far as ``max_num_seqs`` leaves room, or parked waiting for its chunk): one still plainly
        waiting that it lets in, with room to run, came after."""
        return self._has_room() and any(
            r.status is RequestStatus.WAITING and self.adapter.may_admit(r.request_id) for r in self.waiting
        )

    # -- one step ---------------------------------------------------------------------------------

    async def step(self) -> list[StageOutput]:
        outputs = await self._apply_aborts()
        parked = await self._process_pending_chunks()
        self._preempt()
        outputs += await self._expire_stalled()
        try:
            scheduled, finishing = self._schedule()
            try:
                results = await current_kernel().compute(lambda: self.run_model(scheduled)) if scheduled else []
            except Exception as e:
                reason = f"model run failed: {type(e).__name__}: {e}"
                outputs += [await self._fail(chunk.request, reason) for chunk in scheduled]
                scheduled, results = [], []
            outputs += await self._update_from_output(scheduled, results, finishing)
        finally:
            self._restore_queues(parked)
        return outputs

    async def _process_pending_chunks(self) -> list[Request]:
        """Register requests for their next chunk and mark arrivals ready; returns the parked."""
        parked: list[Request] = []
        self.adapter.admit(rid for rid in self.requests if rid not in self.forwarded)  # (in arrival order)
        for queue, target in ((self.waiting, RequestStatus.WAITING), (self.running, RequestStatus.RUNNING)):
            for request in list(queue):
                rid = request.request_id
                if not self._is_tracked(request):  # freed by an abort while queued (#3736)
                    queue.remove(request)
                    await self.adapter.cleanup_receiver(rid)
                    continue
                if not self.adapter.is_active(rid) and rid not in self.forwarded:
                    # Held back by the active-stream window for this step: not loaded, not run.
                    self.origin_status[rid] = target
                    queue.remove(request)
                    parked.append(request)
                    continue
                if request.status is not RequestStatus.WAITING_FOR_CHUNK:
                    if rid in self.ready or self._input_complete(rid):
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

    def _has_room(self) -> bool:
        """Another request may run: fewer run than ``max_num_seqs``."""
        return len(self.running) < self.max_num_seqs

    def _preempt(self) -> None:
        """Spec §5.2 step 4: while more requests run than ``max_num_seqs``, the last one goes back
        to the front of the waiting queue (what it holds — a chunk ready to run — it keeps)."""
        while len(self.running) > self.max_num_seqs:
            request = self.running.pop()
            request.status = RequestStatus.PREEMPTED
            self.waiting.insert(0, request)
            current_kernel().note("sched.preempted", stage=self.adapter.stage_id, req=request.request_id)

    def _schedule(self) -> tuple[list[ScheduledChunk], list[Request]]:
        scheduled: list[ScheduledChunk] = []
        finishing: list[Request] = []
        while self.waiting and self._has_room():
            request = self.waiting.pop(0)
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
                    ScheduledChunk(
                        request,
                        list(request.prompt_token_ids),
                        int(meta.get("left_context_size", 0)),
                        whole=rid in self.forwarded,
                    )
                )
                request.num_computed_tokens = len(request.prompt_token_ids)  # one-shot prefill
            elif self._input_complete(rid):
                finishing.append(request)  # nothing left: finish without a model pass (#3613)
            self.ready.pop(rid, None)
        if scheduled:
            self._note_batch(len(scheduled))
        return scheduled, finishing

    async def _update_from_output(
        self, scheduled: list[ScheduledChunk], results: list[Any], finishing: list[Request]
    ) -> list[StageOutput]:
        outputs = []
        # In the order they finished: a set's order would follow the string hash seed, and the
        # cleanups' order is in the trace.
        done_now = dict.fromkeys(r.request_id for r in finishing)
        for chunk, data in zip(scheduled, results, strict=True):
            rid = chunk.request.request_id
            done = self._input_complete(rid)
            outputs.append(StageOutput(rid, data, finished=done))
            if done:
                done_now[rid] = None
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

    def _free(self, request: Request, status: RequestStatus) -> None:
        super()._free(request, status)
        for structure in (self.ready, self.origin_status, self.forwarded):
            structure.pop(request.request_id, None)
        for queue in (self.waiting, self.running):
            if request in queue:
                queue.remove(request)

    def _structures(self) -> dict[str, Any]:
        return {
            **super()._structures(),
            "waiting": [r.request_id for r in self.waiting],
            "running": [r.request_id for r in self.running],
            "ready": self.ready,
            "origin_status": self.origin_status,
            "forwarded": self.forwarded,
        }
