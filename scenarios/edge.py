"""The Talker (stage 1) → Code2Wav (stage 2) edge with synthetic codec payloads.

No models: the Talker's output for one chunk is a ``[16, n]`` block of codec frames and the
Code2Wav side records how many frames each committed chunk carried. The pieces here play the
roles of the AR scheduler (:func:`produce`), the generation scheduler (:func:`consume`) and the
orchestrator (:func:`abort`, :func:`release`), each through the adapter's public API only.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from invariants.observed import Stream
from omnisim.registry import ScenarioBody, scenario
from omnisim.world import Room, Stage, World
from runtime.kernel import current_kernel
from runtime.request import Request, RequestStatus
from runtime.sched.generation import GenerationScheduler
from runtime.transfer.adapter import ChunkTransferAdapter
from runtime.transfer.sender import Processor
from scenarios.merge import TakenChunks, check_merge

TALKER = 1
CODE2WAV = 2
NUM_CODEBOOKS = 16
#: The observer of the chunks Code2Wav's connector handed out (:class:`TakenChunks`).
TAKEN = "code2wav.taken"
#: How long the consumer waits for a chunk before it looks at failures and aborts again.
CONSUMER_WAIT_S = 0.05


@functools.cache
def codec_frames(n: int, offset: int = 0) -> torch.Tensor:
    """``n`` synthetic codec frames, codebook-major ``[16, n]``, distinct per frame index.
    (Cached: nothing mutates them, and building them is a visible share of a simulated run.)"""
    frame = torch.arange(offset, offset + n, dtype=torch.int64)
    return (frame.unsqueeze(0) * NUM_CODEBOOKS + torch.arange(NUM_CODEBOOKS).unsqueeze(1)) % 2048


def synthetic_codec_chunk(
    transfer_manager: Any, multimodal_output: dict[str, Any], request: Request, is_finished: bool
) -> dict[str, Any] | None:
    """The processor: one chunk of codec frames, or nothing when no frame is new."""
    frames = multimodal_output.get("frames")
    if frames is None or frames.shape[1] == 0:
        return None
    # ``num_frames``: a plain value next to the dicts, which a receiver's merge overwrites (§3.8).
    return {"codes": {"audio": frames}, "meta": {"left_context_size": 0}, "num_frames": int(frames.shape[1])}


def edge_scenario(name: str, **kwargs: Any) -> Callable[[ScenarioBody], ScenarioBody]:
    """Register a scenario that runs at this edge (see :func:`omnisim.registry.scenario`)."""
    return scenario(name, build=edge_world, **kwargs)


def edge_world(
    store_kind: str,
    processor: Processor = synthetic_codec_chunk,
    *,
    talker_receives: bool = False,
    code2wav_process: bool = False,
    room: Room | None = None,
) -> World:
    """The edge's world. Its Talker only sends, unless ``talker_receives``: then it also registers
    for the Thinker's chunks (no Thinker sends any: a request waits for input that never comes).
    ``code2wav_process``: Code2Wav runs in a process of its own, as a stage process does (on a
    POSIX store the two then wake each other through FIFOs). ``room``: what the store holds."""
    world = World(store_kind, processes=code2wav_process, room=room)
    # Code2Wav, the final stage, only receives.
    world.add_stage(TALKER, processor=processor, receives=talker_receives)
    world.add_stage(CODE2WAV, sends=False, own_process=code2wav_process)
    watch_code2wav(world)
    return world


def watch_code2wav(world: World) -> None:
    """What every world at this edge does besides its stages: record the chunks Code2Wav takes
    (for the merge check) and settle like an orchestrator by quiescence."""
    world.observers[TAKEN] = TakenChunks(world, CODE2WAV)
    world.settle = functools.partial(settle, world)


class EdgeRequest:
    """One client request across the edge: the Talker's and Code2Wav's views and the stream."""

    def __init__(self, world: World, ext: str, name: str | None = None) -> None:
        name = name or ext
        self.world = world
        self.name = name
        self.ext = ext
        self.sender = Request(f"{name}-talker", ext)
        self.receiver = Request(f"{name}-code2wav", ext)
        self.stream: Stream = world.stream(self.receiver.request_id, ext)
        #: Code2Wav's own scheduler, where it (not the scenario) consumes this request: the
        #: orchestrator ends the request there.
        self.scheduler: GenerationScheduler | None = None
        world.requests.append(self)

    @property
    def shares_its_id(self) -> bool:
        """Whether another request of the run has the same external id (a reuse)."""
        return any(other is not self and other.ext == self.ext for other in self.world.requests)

    @property
    def talker(self) -> Stage:
        return self.world.stages[TALKER]

    @property
    def code2wav(self) -> Stage:
        return self.world.stages[CODE2WAV]


async def produce_then_finish(req: EdgeRequest, chunk_frames: list[int]) -> None:
    """The Talker's scheduler finishes the request right after queueing its terminal (a stop
    condition or an external finish): cleanup_sender runs while the terminal is still queued."""
    if await produce(req, chunk_frames):
        await req.talker.adapter.finish_requests([req.sender])


async def produce(req: EdgeRequest, chunk_frames: list[int], *, finish: bool = True) -> bool:
    """Send one chunk per entry of ``chunk_frames``; the last one is the terminal if ``finish``.

    Returns False as soon as a chunk is refused.
    """
    offset = 0
    for i, n in enumerate(chunk_frames):
        if req.stream.outcome != "open":
            return False
        if finish and i == len(chunk_frames) - 1:
            req.sender.status = RequestStatus.FINISHED_STOPPED
        req.sender.num_computed_tokens += n
        frames = codec_frames(n, offset)
        # Recorded before the hand-off, as what a consumer may accept: checked by content.
        req.stream.sent_frames.extend(tuple(frames[:, j].tolist()) for j in range(n))
        accepted = await req.talker.adapter.save_async({"frames": frames}, req.sender)
        if not accepted:
            # Refused: the producer stops, and — as for the AR scheduler, which never reads the
            # answer — the orchestrator learns from the failure channel whether that ends the
            # request (the id's previous generation still draining, #8082 b).
            del req.stream.sent_frames[-n:]
            return False
        req.stream.frames_sent += n
        offset += n
    return True


async def next_chunk(req: EdgeRequest, *, input_deadline_s: float | None = None) -> bool:
    """Register the Code2Wav request for its next chunk and wait until it is committed (True) or
    the request ended otherwise (False), failing it after ``input_deadline_s`` without input."""
    k = current_kernel()
    adapter = req.code2wav.adapter
    if req.stream.outcome != "open":
        return False
    merge = MergeWatch(req)
    rid = req.receiver.request_id
    # As a scheduler does (spec §5.2 step 2): a chunk already committed (someone else registered
    # the request meanwhile) is taken as it is, and nothing is loaded once upstream is done.
    if not adapter.has_ready_chunks(rid) and not adapter.is_done_receiving_chunks(rid):
        await adapter.load_async(req.receiver)
    waiting_since = k.now()
    while req.stream.outcome == "open":
        if adapter.pop_ready(rid):
            merge.check()
            break
        await wait_for_chunk(adapter, rid)
        await check_failures(req.world)
        if input_deadline_s is not None and k.now() - waiting_since > input_deadline_s:
            await fail(req, f"no chunk for {input_deadline_s}s")
    return req.stream.outcome == "open"


async def wait_for_chunk(adapter: ChunkTransferAdapter, request_id: str) -> None:
    """Wait (a bounded while) for a chunk of ``request_id`` to be committed or for its receive
    to fail: the adapter rings ``chunk_ready`` for both, so a wait that runs out while either
    holds is a lost wakeup."""

    def ready() -> bool:
        return adapter.has_ready_chunks(request_id) or adapter.has_receive_failure(request_id)

    if ready():
        await current_kernel().sleep(0)  # a consumer that spins on a wrong answer still yields
    else:
        await adapter.chunk_ready.wait(CONSUMER_WAIT_S, ready=ready)


class MergeWatch:
    """Around one wait for a chunk: what the request held before, and the chunks Code2Wav's
    connector handed out for its id since; :meth:`check` compares the commit with spec §3.8.
    (Only for an id no other request of the run shares: a reused id's chunks interleave.)"""

    def __init__(self, req: EdgeRequest) -> None:
        self.req = req
        self.taken: TakenChunks | None = None if req.shares_its_id else req.world.observers.get(TAKEN)
        info = req.receiver.additional_information
        self.before = None if info is None else {k: dict(v) if isinstance(v, dict) else v for k, v in info.items()}
        self.count = self.taken.count(req.ext) if self.taken is not None else 0

    def check(self) -> None:
        if self.taken is not None:
            check_merge(self.req.receiver, self.req.ext, self.before, self.taken.since(self.req.ext, self.count))


async def consume(req: EdgeRequest, *, input_deadline_s: float | None = None) -> None:
    """The Code2Wav side of one request: register, wait for each chunk, record it, until the
    terminal arrives or the request ends otherwise; then free the request.

    With ``input_deadline_s``, a stall that long (reset by every arrival) fails the request, as
    the scheduler's input-wait deadline does (#4855 R1.1).
    """
    adapter = req.code2wav.adapter
    request = req.receiver
    while await next_chunk(req, input_deadline_s=input_deadline_s):
        codes = (request.additional_information or {}).get("codes", {})
        audio = codes.pop("audio", None)
        frames = int(audio.shape[1]) if isinstance(audio, torch.Tensor) and audio.ndim >= 2 else 0
        if frames:
            req.stream.received_frames.extend(tuple(audio[:, j].tolist()) for j in range(frames))
        finished = adapter.is_done_receiving_chunks(request.request_id)
        req.stream.chunks.append((frames, finished))
        if finished:
            req.stream.outcome = "finished"
    await adapter.finish_requests([request])


async def abort(req: EdgeRequest) -> None:
    """The orchestrator's abort: both stages finish the request; the client sees it aborted."""
    k = current_kernel()
    await k.point("orch.abort.begin", req=req.ext)
    if req.stream.outcome == "open":
        req.stream.outcome = "aborted"
    await finish_everywhere(req)
    await k.point("orch.abort.end", req=req.ext)


async def finish_everywhere(req: EdgeRequest) -> None:
    """Finish the request on every stage that still tracks it. The Talker's scheduler stops
    tracking its request once the terminal is queued; from then on only the adapter owns it.
    (A stage whose process died does nothing more.) Where Code2Wav's own scheduler holds the
    request, it is aborted there, possibly while parked waiting for a chunk."""
    if not req.sender.is_finished() and req.world.alive(req.talker.process):
        await req.talker.adapter.finish_requests([req.sender])
    if req.scheduler is not None:
        req.scheduler.request_abort(req.receiver.request_id)
    else:
        await req.code2wav.adapter.finish_requests([req.receiver])


async def fail(req: EdgeRequest, reason: str) -> None:
    """A send failure ends the request with an error instead of a hang (#4855 R1.2)."""
    if req.stream.outcome != "open":
        return  # already ended: finishing it again could cancel a newer generation of its id
    current_kernel().note("orch.fail", req=req.name, reason=reason)
    req.stream.outcome = "failed"
    req.stream.error = reason
    await finish_everywhere(req)


async def check_failures(world: World) -> None:
    """Drain the send-failure channel of the Talker (while its process lives: a dead one tells
    nothing) and the receive-failure channel of Code2Wav, and ``fail`` every request they name
    (a channel drained for one request holds its neighbours' failures too)."""
    talker = world.stages[TALKER]
    sent = talker.adapter.collect_failed_send_request_ids() if world.alive(talker.process) else {}
    received = world.stages[CODE2WAV].adapter.collect_failed_receive_request_ids()
    for req in world.requests:
        reason = sent.get(req.sender.request_id) or received.get(req.receiver.request_id)
        if reason is not None:
            await fail(req, reason)


def failure_watch(world: World, reqs: list[EdgeRequest]) -> tuple[str, Callable[[], Awaitable[None]]]:
    """The orchestrator's side of a consumer that does not look at the failure channels itself
    (Code2Wav's own scheduler, which waits for input up to its 600 s deadline): a job that,
    until every request of ``reqs`` ended, looks at them as often as a consumer waiting for a
    chunk would and fails the requests they name (#4855 R1.2)."""

    async def watch() -> None:
        k = current_kernel()
        while any(req.stream.outcome == "open" for req in reqs):
            await k.sleep(CONSUMER_WAIT_S)
            await check_failures(world)

    return ("orch.failures", watch)


async def settle(world: World) -> None:
    """What the orchestrator has done by quiescence that a scenario's own pieces may not have:
    it drained the failure channels, and it swept every failed request's chunks once no stage
    needed them (spec §2.11) — here only for an id no other request of the run reuses, whose
    leftovers the sweep would hide."""
    await check_failures(world)
    for req in world.requests:
        if req.stream.outcome == "failed" and not req.shares_its_id and world.alive(req.talker.process):
            await req.talker.adapter.release_shm_resources(req.ext)


async def together(*jobs: tuple[str, Callable[[], Awaitable[object]]]) -> None:
    """Run named jobs as concurrent tasks and wait for all of them."""
    async with current_kernel().task_group() as tasks:
        for name, job in jobs:
            tasks.start_soon(job, name=name)


async def serve(req: EdgeRequest, chunk_frames: list[int], *, input_deadline_s: float | None = None) -> None:
    """A whole request across the edge: produce and consume concurrently, then the final sweep."""
    await together(
        (f"{req.name}.consume", lambda: consume(req, input_deadline_s=input_deadline_s)),
        (f"{req.name}.produce", lambda: produce(req, chunk_frames)),
    )
    await release(req)


async def release(req: EdgeRequest) -> None:
    """The orchestrator's final sweep once no stage needs the request (spec §2.11), and a last
    look at the send-failure channel (a failure of a request that already ended is dropped)."""
    await req.talker.adapter.release_shm_resources(req.ext)
    await check_failures(req.world)
