"""What every stage scheduler shares: the request table, aborts applied between steps, the
input-wait deadline, the serve loop, and the no-residue bookkeeping.

A scheduler runs in steps. The subclasses (:mod:`runtime.sched.generation`,
:mod:`runtime.sched.ar`) say what one step does; this class says how steps are driven and how a
request leaves: it is *freed* (forgotten by every structure) exactly once, and a freed request is
never polled or re-queued again (#3736).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runtime.config.deploy import MAX_NUM_SEQS
from runtime.kernel import current_kernel
from runtime.request import Request, RequestStatus
from runtime.transfer.adapter import ChunkTransferAdapter

log = logging.getLogger(__name__)

#: VLLM_OMNI_INPUT_WAIT_TIMEOUT_S's default (spec §9).
INPUT_WAIT_TIMEOUT_S = 600.0
#: How long an idle scheduler waits for work before it looks again (deadlines, aborts).
IDLE_WAIT_S = 0.05


@dataclass(frozen=True)
class StageOutput:
    """What a stage reports for one request after a step: ``data`` (or None), whether the
    request finished, and the error it finished with (None for a normal finish)."""

    request_id: str
    data: Any
    finished: bool
    error: str | None = None


def validate_input_wait_timeout(value: float) -> float:
    """A negative or non-finite deadline is a start-up error; 0 disables it (#4855 R1.4)."""
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"input wait timeout must be a finite number >= 0, got {value!r}")
    return value


class StageScheduler:
    """The driving half of a stage scheduler; subclasses implement :meth:`step`."""

    def __init__(
        self,
        adapter: ChunkTransferAdapter,
        input_wait_timeout_s: float = INPUT_WAIT_TIMEOUT_S,
        *,
        max_num_seqs: int = MAX_NUM_SEQS,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        self.adapter = adapter
        self.input_wait_timeout_s = validate_input_wait_timeout(input_wait_timeout_s)
        #: The most requests one step runs (vLLM's ``max_num_seqs``).
        self.max_num_seqs = max_num_seqs
        self.requests: dict[str, Request] = {}
        #: request id -> when it started waiting for its current chunk (reset by every arrival).
        self.waiting_since: dict[str, float] = {}
        #: Aborts asked for since the last step (applied at the start of the next one).
        self.pending_aborts: dict[str, None] = {}
        self._new_work = False
        self._stopped = False
        # One doorbell for "work arrived": a committed chunk, a new request or an abort.
        self._wakeup = adapter.chunk_ready

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        current_kernel().note("sched.add", stage=self.adapter.stage_id, req=request.request_id)
        self._ring()

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self.pending_aborts)

    def request_abort(self, request_id: str) -> None:
        """Ask for ``request_id`` to be aborted. Returns at once; the abort is applied at the start
        of the next step, between two schedules, as an engine core applies aborts — so it never
        lands in the middle of one (where a freed request could be re-queued, #3736)."""
        self.pending_aborts[request_id] = None
        current_kernel().note("sched.abort", stage=self.adapter.stage_id, req=request_id)
        self._ring()

    def shutdown(self) -> None:
        self._stopped = True
        self._ring()

    def _ring(self) -> None:
        self._new_work = True
        self._wakeup.notify()

    async def serve(self, on_output: Callable[[StageOutput], None], *, forever: bool = False) -> None:
        """Step, handing every output to ``on_output``, until no request is left (or, with
        ``forever``, until :meth:`shutdown`). Between steps that produced nothing and found no
        new work, wait for the doorbell instead of spinning."""
        while not self._stopped and (forever or self.has_unfinished()):
            self._new_work = False
            outputs = await self.step()
            for out in outputs:
                on_output(out)
            if not outputs and not self._has_news():
                await self._wakeup.wait(IDLE_WAIT_S, ready=self._has_work)
            else:
                await current_kernel().sleep(0)  # one step at a time: let the other stages run

    def _has_news(self) -> bool:
        """Whether the doorbell rang or a chunk waits: the next step has something to act on."""
        return self._new_work or self.adapter.has_ready_chunks()

    def _has_work(self) -> bool:
        """:meth:`_has_news`, or work whose doorbell must have rung since the last step began (an
        abort is applied, and the stop seen, at a step's start; a new request is taken up by the
        step after it came): what makes an idle wait a lost wakeup, whether or not the flag says
        so (the flag is what a slip would clear)."""
        return self._has_news() or bool(self.pending_aborts) or self._stopped or self._has_new_request()

    def _has_new_request(self) -> bool:
        """Whether a request came that no step took up yet (each scheduler knows by its own state)."""
        return False

    def _note_batch(self, size: int) -> None:
        """One step runs ``size`` requests' model work (at most :attr:`max_num_seqs`)."""
        current_kernel().note("sched.batch", stage=self.adapter.stage_id, size=size, max=self.max_num_seqs)

    async def step(self) -> list[StageOutput]:
        raise NotImplementedError

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

    # -- the input-wait deadline (#4855 R1.1) ------------------------------------------------------
    # It measures *stall* time: the clock starts when a request parks for a chunk and restarts
    # with every arrival, so a long healthy stream never times out.

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
        reason = f"Timed out waiting for connector input after {self.input_wait_timeout_s:g}s"
        return [await self._fail(self.requests[rid], reason) for rid in self._timed_out_request_ids()]

    async def _fail(self, request: Request, reason: str) -> StageOutput:
        """End one request with an error (its input was bad, its model raised, it stalled); the
        stage and its other requests go on."""
        log.warning("%s failed: %s", request.request_id, reason)
        await self.adapter.finish_requests([request])
        self._free(request, RequestStatus.FINISHED_ERROR)
        return StageOutput(request.request_id, None, finished=True, error=reason)

    # -- leaving ----------------------------------------------------------------------------------

    def _is_tracked(self, request: Request) -> bool:
        """Still this scheduler's request. A request freed in the middle of a step (the input-wait
        deadline) may sit in that step's parked list; it must never be polled or re-queued again
        (#3736: a worker KeyError on the freed id)."""
        return self.requests.get(request.request_id) is request

    def _free(self, request: Request, status: RequestStatus) -> None:
        """Forget ``request`` everywhere; subclasses extend it with their own structures."""
        request.status = status
        self.requests.pop(request.request_id, None)
        self.waiting_since.pop(request.request_id, None)
        # An abort asked for meanwhile has nothing left to act on: a stage that stops before its
        # next step would otherwise keep it for good.
        self.pending_aborts.pop(request.request_id, None)

    def _structures(self) -> dict[str, Any]:
        """Every per-request structure, by name (for :meth:`residue`)."""
        return {"requests": self.requests, "waiting_since": self.waiting_since, "pending_aborts": self.pending_aborts}

    def residue(self) -> dict[str, list[str]]:
        return {name: [str(x) for x in items] for name, items in self._structures().items() if items}
