"""The scheduler of an autoregressive stage (the Thinker, the Talker), spec §5.3.

An AR request runs one decoding step at a time. Its input either comes whole when it is added
(the Thinker's prompt, or a payload forwarded by the orchestrator when ``async_chunk`` is off)
or streams in as chunks from the stage before (the Talker with ``async_chunk``): such a request
is added as a prewarm placeholder and stays registered for its next chunk until upstream sent
its terminal. A committed chunk is applied on the scheduler's task (``take_ar_update``), never on
the receive task, so the model state is only ever touched between steps.

Each step:

1. **aborts** asked for since the last step are applied;
2. **process_pending_chunks** — a ready request's committed payload is applied to its model
   state; a chunk-fed request registers for its next chunk; a request that cannot step without
   more input is *stalled* (``WAITING_FOR_CHUNK``) and its input-wait clock runs (#4855 R1.1);
3. **decode** — every request whose model can step runs one step;
4. **update_from_output** — the step's output is handed to the adapter (``save_async``) and to
   the orchestrator. On a stop the request is finished unless it is a resumable session, and
   ``is_segment_finished = not finished``: a terminal stop is *not* a segment boundary (#5383).
   A finished sender's adapter state is reclaimed by its save task after the terminal is sent,
   so freeing the request only drops the receiver side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from runtime.config.deploy import MAX_NUM_SEQS
from runtime.kernel import current_kernel
from runtime.request import Request, RequestStatus
from runtime.sched.base import INPUT_WAIT_TIMEOUT_S, StageOutput, StageScheduler
from runtime.transfer.adapter import ChunkTransferAdapter


@dataclass(frozen=True)
class ARStep:
    """One decoding step: ``output`` for the orchestrator (a text delta, a codec frame),
    ``multimodal_output`` for the adapter's processor, and whether the model stopped."""

    output: Any
    multimodal_output: Any
    stopped: bool


class ARWorker(Protocol):
    """The model side of an AR stage: per-request model state, owned by the worker."""

    def apply(self, request: Request, payload: dict[str, Any], *, finished: bool) -> None:
        """Take an input payload (the whole input, or one chunk); ``finished``: no more follow."""
        ...

    def ready(self, request: Request) -> bool:
        """True if :meth:`step` can run now without more input."""
        ...

    def step(self, request: Request) -> ARStep: ...

    def release(self, request_id: str) -> None:
        """Drop the request's model state (idempotent)."""
        ...


class ARScheduler(StageScheduler):
    """One AR stage: decode every request that can step, one step each per round."""

    def __init__(
        self,
        adapter: ChunkTransferAdapter,
        worker: ARWorker,
        input_wait_timeout_s: float = INPUT_WAIT_TIMEOUT_S,
        *,
        max_num_seqs: int = MAX_NUM_SEQS,
    ) -> None:
        super().__init__(adapter, input_wait_timeout_s, max_num_seqs=max_num_seqs)
        self.worker = worker
        #: Requests whose input streams in as chunks from the stage before.
        self.chunk_fed: dict[str, None] = {}
        #: Chunk-fed requests registered for their next chunk.
        self.registered: dict[str, None] = {}
        #: Requests whose last stage this is: nothing is sent downstream for them.
        self.final_here: dict[str, None] = {}

    def add_request(self, request: Request, payload: dict[str, Any] | None = None, *, sends: bool = True) -> None:
        """Add a request with its whole input, or (``payload`` None) a prewarm placeholder whose
        input will stream in as chunks. ``sends=False``: this is the request's last stage, so its
        outputs go to the orchestrator only, never downstream as chunks."""
        if payload is None:
            if not self.adapter.receives_chunks:
                raise ValueError(f"{request.request_id}: no input, and this stage does not receive chunks")
            self.chunk_fed[request.request_id] = None
        else:
            self.worker.apply(request, payload, finished=True)
        if not sends:
            self.final_here[request.request_id] = None
        request.status = RequestStatus.WAITING
        super().add_request(request)

    def _has_new_request(self) -> bool:
        """A step decodes every request that can decode and registers every chunk-fed one its
        active-stream window lets in for its next chunk: one that can, or is not registered,
        came after the last step looked."""
        unregistered = (rid for rid in self.chunk_fed if rid not in self.registered)
        return any(self._can_decode(r) for r in self.requests.values()) or any(
            not self.adapter.is_done_receiving_chunks(rid) and self.adapter.may_admit(rid) for rid in unregistered
        )

    def _can_decode(self, request: Request) -> bool:
        """Its model has input to step on, and the active-stream window lets it run."""
        return self.worker.ready(request) and self.adapter.is_active(request.request_id)

    async def step(self) -> list[StageOutput]:
        outputs = await self._apply_aborts()
        outputs += await self._process_pending_chunks()
        outputs += await self._expire_stalled()
        outputs += await self._decode()
        return outputs

    async def _process_pending_chunks(self) -> list[StageOutput]:
        failed = []
        self.adapter.admit(self.chunk_fed)  # (in arrival order)
        for rid in list(self.chunk_fed):
            if not self.adapter.is_active(rid):
                continue  # held back by the active-stream window: not registered, not stepped
            request = self.requests[rid]
            if self.adapter.pop_ready(rid):
                self.registered.pop(rid, None)
                payload = self.adapter.take_ar_update(rid)
                try:
                    if payload is not None:
                        self.worker.apply(request, payload, finished=self.adapter.is_done_receiving_chunks(rid))
                except Exception as e:
                    failed.append(await self._fail(request, f"bad input chunk: {type(e).__name__}: {e}"))
                    continue
                self._input_arrived(rid)
            if rid not in self.registered and not self.adapter.is_done_receiving_chunks(rid):
                await self.adapter.load_async(request)
                self.registered[rid] = None
            if self.worker.ready(request):
                request.status = RequestStatus.RUNNING
            else:
                request.status = RequestStatus.WAITING_FOR_CHUNK
                self._start_waiting(rid)
        return failed

    async def _decode(self) -> list[StageOutput]:
        outputs = []
        for request in self._batch():
            try:
                step = await current_kernel().compute(lambda request=request: self.worker.step(request))
            except Exception as e:
                outputs.append(await self._fail(request, f"model step failed: {type(e).__name__}: {e}"))
                continue
            request.num_computed_tokens += 1
            is_segment_finished = False
            if step.stopped:
                finished = self._handle_stopped_request(request)
                is_segment_finished = self._is_segment_boundary(finished)
            if self.adapter.sends_chunks and request.request_id not in self.final_here:
                await self.adapter.save_async(step.multimodal_output, request, is_segment_finished=is_segment_finished)
            outputs.append(StageOutput(request.request_id, step.output, finished=request.is_finished()))
            if request.is_finished():
                # The adapter's sender state is the save task's to reclaim, after the terminal.
                await self.adapter.cleanup_receiver(request.request_id)
                self._free(request, request.status)
        return outputs

    def _batch(self) -> list[Request]:
        """The requests this step decodes: those that can, the first ``max_num_seqs`` of them in
        arrival order (the others wait for a later step, as vLLM's running queue has them)."""
        batch = [r for r in self.requests.values() if self._can_decode(r)][: self.max_num_seqs]
        if batch:
            self._note_batch(len(batch))
        return batch

    @staticmethod
    def _handle_stopped_request(request: Request) -> bool:
        """A stop finishes the request, unless it is a resumable session (then only its segment
        ended); True if finished. A finished request is never resumable again."""
        if request.resumable:
            return False
        request.status = RequestStatus.FINISHED_STOPPED
        return True

    @staticmethod
    def _is_segment_boundary(finished: bool) -> bool:
        """A terminal stop is not a segment boundary (#5383)."""
        return not finished

    def _free(self, request: Request, status: RequestStatus) -> None:
        super()._free(request, status)
        for structure in (self.chunk_fed, self.registered, self.final_here):
            structure.pop(request.request_id, None)
        self.worker.release(request.request_id)

    def _structures(self) -> dict[str, Any]:
        return {
            **super()._structures(),
            "chunk_fed": self.chunk_fed,
            "registered": self.registered,
            "final_here": self.final_here,
        }
