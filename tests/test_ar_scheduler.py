"""The AR scheduler's own rules (the pipeline scenarios drive it end to end)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import trio

from runtime.connectors.shm import ShmConnector
from runtime.connectors.stores import MemoryStore
from runtime.request import Request, RequestStatus
from runtime.sched.ar import ARScheduler, ARStep
from runtime.transfer.adapter import ChunkTransferAdapter
from runtime.transfer.sender import SaveTask


@dataclass
class CountingWorker:
    """Speaks ``steps`` steps per request once it has input; raises on a request named "bad"."""

    steps: int = 2
    left: dict[str, int] = field(default_factory=dict)

    def apply(self, request: Request, payload: dict[str, Any], *, finished: bool) -> None:
        self.left[request.request_id] = self.steps

    def ready(self, request: Request) -> bool:
        return self.left.get(request.request_id, 0) > 0

    def step(self, request: Request) -> ARStep:
        if request.request_id == "bad":
            raise RuntimeError("boom")
        self.left[request.request_id] -= 1
        stopped = self.left[request.request_id] == 0
        return ARStep(output=request.num_computed_tokens, multimodal_output={"x": 1}, stopped=stopped)

    def release(self, request_id: str) -> None:
        self.left.pop(request_id, None)


def make(*, receives: bool = False, timeout: float = 600.0) -> ARScheduler:
    adapter = ChunkTransferAdapter(
        ShmConnector(MemoryStore(), stage_id=1), receives_chunks=receives, worker_type="ar", name="talker"
    )
    return ARScheduler(adapter, CountingWorker(), input_wait_timeout_s=timeout)


async def test_a_terminal_stop_is_not_a_segment_boundary() -> None:
    scheduler = make()
    request = Request("t", "R")
    scheduler.add_request(request, {"text": "x"})
    first = await scheduler.step()
    last = await scheduler.step()
    assert [o.finished for o in first + last] == [False, True]
    tasks = [t for t in scheduler.adapter.sender._pending_save_reqs if isinstance(t, SaveTask)]
    assert [(t.is_finished, t.is_segment_finished) for t in tasks] == [(False, False), (True, False)]
    assert request.status is RequestStatus.FINISHED_STOPPED and scheduler.residue() == {}


async def test_a_chunk_fed_placeholder_parks_and_times_out() -> None:
    scheduler = make(receives=True, timeout=0.05)
    request = Request("t", "R", prompt_token_ids=[0, 0, 0])
    scheduler.add_request(request)
    assert await scheduler.step() == []
    assert request.status is RequestStatus.WAITING_FOR_CHUNK
    await trio.sleep(0.1)
    (out,) = await scheduler.step()
    assert out.finished and out.error and "Timed out waiting for connector input" in out.error
    assert scheduler.residue() == {} and scheduler.adapter.residue() == {}


async def test_a_failing_model_step_fails_only_its_request() -> None:
    scheduler = make()
    good, bad = Request("good", "G"), Request("bad", "B")
    scheduler.add_request(good, {"text": "x"})
    scheduler.add_request(bad, {"text": "x"})
    outputs = await scheduler.step() + await scheduler.step()
    errors = {o.request_id: o.error for o in outputs if o.finished}
    assert errors["good"] is None and "boom" in (errors["bad"] or "")
    assert bad.status is RequestStatus.FINISHED_ERROR and good.status is RequestStatus.FINISHED_STOPPED


async def test_last_stage_requests_send_nothing_downstream() -> None:
    scheduler = make()
    scheduler.add_request(Request("t", "R"), {"text": "x"}, sends=False)
    await scheduler.step()
    await scheduler.step()
    assert not scheduler.adapter.sender._pending_save_reqs and scheduler.residue() == {}


async def test_a_new_request_no_step_took_up_is_work_whatever_the_doorbell_says() -> None:
    """An idle wait's ``ready=`` is what the simulator's lost-wakeup check reads: it must see a
    request no step took up yet even when the doorbell's flag was cleared (the slip it judges)."""
    scheduler = make(receives=True)
    scheduler.add_request(Request("whole", "W"), {"text": "x"})
    scheduler.add_request(Request("fed", "F", prompt_token_ids=[0]))
    scheduler._new_work = False
    assert scheduler._has_work()
    await scheduler.step()  # decodes the one, registers the other for its first chunk
    scheduler._new_work = False
    assert scheduler._has_work()  # the first has a step left
    await scheduler.step()
    assert not scheduler._has_work() and set(scheduler.requests) == {"fed"}


async def test_max_num_seqs_decodes_the_first_requests_that_can_and_the_others_later() -> None:
    adapter = ChunkTransferAdapter(ShmConnector(MemoryStore(), stage_id=0), worker_type="ar", name="thinker")
    scheduler = ARScheduler(adapter, CountingWorker(), max_num_seqs=2)
    for rid in ("a", "b", "c"):
        scheduler.add_request(Request(rid, rid), {"text": "x"}, sends=False)
    assert [o.request_id for o in await scheduler.step()] == ["a", "b"]  # c waits, in arrival order
    assert [o.request_id for o in await scheduler.step()] == ["a", "b"]  # (a and b finish here)
    assert [o.request_id for o in await scheduler.step()] == ["c"]


async def test_max_num_seqs_counts_only_the_requests_that_can_step() -> None:
    """A request waiting for input takes no place in the batch: the next one that can step does."""
    adapter = ChunkTransferAdapter(ShmConnector(MemoryStore(), stage_id=0), worker_type="ar", name="thinker")
    worker = CountingWorker()
    scheduler = ARScheduler(adapter, worker, max_num_seqs=1)
    for rid in ("a", "b"):
        scheduler.add_request(Request(rid, rid), {"text": "x"}, sends=False)
    worker.left["a"] = 0  # (a has nothing to step on yet)
    assert [o.request_id for o in await scheduler.step()] == ["b"]
