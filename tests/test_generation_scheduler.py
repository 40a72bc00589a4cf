"""The generation scheduler's own rules (the code2wav_stream scenario drives it end to end)."""

from __future__ import annotations

import math

import pytest

from runtime.connectors.shm import ShmConnector
from runtime.connectors.stores import MemoryStore
from runtime.request import Request, RequestStatus
from runtime.sched.base import validate_input_wait_timeout
from runtime.sched.generation import GenerationScheduler, ScheduledChunk
from runtime.transfer.adapter import ChunkTransferAdapter


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan])
def test_a_bad_input_wait_deadline_is_a_startup_error(bad: float) -> None:
    with pytest.raises(ValueError, match="input wait timeout"):
        validate_input_wait_timeout(bad)


def make_scheduler(timeout: float) -> GenerationScheduler:
    adapter = ChunkTransferAdapter(ShmConnector(MemoryStore(), stage_id=2), sends_chunks=False)
    return GenerationScheduler(adapter, lambda chunks: [], input_wait_timeout_s=timeout)


async def test_a_request_without_input_parks_and_then_times_out() -> None:
    import trio

    scheduler = make_scheduler(0.05)
    request = Request("r-code2wav", "r")
    scheduler.add_request(request)
    assert await scheduler.step() == []
    assert request.status is RequestStatus.WAITING_FOR_CHUNK  # parked for its first chunk
    await trio.sleep(0.1)
    (out,) = await scheduler.step()
    assert out.finished and out.error and "Timed out waiting for connector input" in out.error
    assert scheduler.residue() == {} and request.status is RequestStatus.FINISHED_ERROR


async def test_an_abort_asked_for_while_its_request_ends_leaves_nothing_behind() -> None:
    """Found by a pipeline scenario once ``sleep(0)`` yielded as trio's does: a client's abort
    lands in the middle of the step that ends its request; a stage stopped before its next step
    kept the abort for good (a tombstone)."""
    import trio

    scheduler = make_scheduler(0.05)
    request = Request("r-code2wav", "r")
    scheduler.add_request(request)
    await scheduler.step()
    await trio.sleep(0.1)
    finish = scheduler.adapter.finish_requests

    async def finish_as_the_abort_lands(requests: list[Request]) -> None:
        scheduler.request_abort(request.request_id)
        await finish(requests)

    scheduler.adapter.finish_requests = finish_as_the_abort_lands  # type: ignore[method-assign]
    (out,) = await scheduler.step()
    assert out.error and "Timed out" in out.error
    scheduler.shutdown()
    assert scheduler.residue() == {}


async def test_zero_disables_the_deadline_and_abort_frees_the_request() -> None:
    scheduler = make_scheduler(0)
    request = Request("r-code2wav", "r")
    scheduler.add_request(request)
    await scheduler.step()
    scheduler.request_abort("r-code2wav")
    (out,) = await scheduler.step()  # applied between two schedules
    assert out.error == "aborted"
    assert await scheduler.step() == []  # the parked request is purged, never re-injected (#3736)
    assert scheduler.residue() == {}
    assert scheduler.adapter.residue() == {}  # its queued poll went with the registration


async def test_a_new_request_no_step_took_up_is_work_whatever_the_doorbell_says() -> None:
    """As for the AR scheduler: what the lost-wakeup check reads sees a request no step took up."""
    scheduler = make_scheduler(600.0)
    scheduler.add_request(Request("r-code2wav", "r"))
    scheduler._new_work = False
    assert scheduler._has_work()
    await scheduler.step()  # parks it, registered for its first chunk
    assert not scheduler._has_work()


async def test_max_num_seqs_runs_the_first_requests_and_a_preempted_one_keeps_its_chunk() -> None:
    """Spec §5.2 step 4: while more requests run than ``max_num_seqs``, the last one goes back to
    the front of the waiting queue — still holding the chunk it had ready, which a later step
    runs."""
    batches: list[list[str]] = []

    def run(chunks: list[ScheduledChunk]) -> list[object]:
        batches.append([chunk.request.request_id for chunk in chunks])
        return [None] * len(chunks)

    adapter = ChunkTransferAdapter(ShmConnector(MemoryStore(), stage_id=2), sends_chunks=False)
    scheduler = GenerationScheduler(adapter, run, max_num_seqs=1)
    first, second, third = (Request(rid, rid) for rid in ("a", "b", "c"))
    for request in (first, second, third):
        scheduler.add_request(request, codes=[1, 2])  # (forwarded whole: ready at once)
    await scheduler.step()
    assert batches == [["a"]]  # one a step: b and c wait, in order
    # Two running at once (as a step of a larger cap left them): the last one is preempted.
    scheduler.running.append(scheduler.waiting.pop(0))
    scheduler.running.append(scheduler.waiting.pop(0))
    await scheduler.step()
    assert batches[-1] == ["b"]
    assert third.status is RequestStatus.PREEMPTED and scheduler.waiting == [third] and "c" in scheduler.ready
    await scheduler.step()
    assert batches[-1] == ["c"] and scheduler.residue() == {}


def test_max_num_seqs_is_at_least_one() -> None:
    adapter = ChunkTransferAdapter(ShmConnector(MemoryStore(), stage_id=2), sends_chunks=False)
    with pytest.raises(ValueError, match="max_num_seqs must be at least 1"):
        GenerationScheduler(adapter, lambda chunks: [], max_num_seqs=0)
