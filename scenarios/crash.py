"""The data plane when processes die and storage turns hostile (omnisim issue 9).

At the Talker → Code2Wav edge, with the stage that fails in a process of its own (it writes into
a namespace it owns; the other stage reads from there):

* ``writer_crash`` — the Talker is SIGKILLed in the middle of a put (after creating the segment,
  after reserving it, after writing the body, after the commit) while Code2Wav waits: a frame
  that was not committed is a corrupt chunk, a committed one is accepted whole; either way the
  request fails within a second ("producer stage 1 exited", or the corrupt chunk named), and
  the operator's sweep leaves nothing of the dead Talker;
* ``writer_crash_after_reuse`` — the same, once the id was reused: the Talker dies in the new
  generation's put of a key the old generation's chunk was read from, after it took that chunk's
  segment back as a spare and before it wrote a byte: the old chunk is never accepted again;
* ``reader_crash`` — Code2Wav is SIGKILLed holding a key's lock (before or after it took the
  bytes): the Talker, alive, reclaims the request's keys and the lock file the reader left;
* ``sweep_vs_live_owner`` — an operator's sweep runs while a live Talker streams, next to the
  namespace a dead engine left, whose pid a new process now has: the dead one goes, entirely,
  and nothing of the live one does;
* ``stalled_reader`` — a reader hangs (SIGSTOP) holding a key's lock while the id is reused:
  the new generation's put gives up within its deadline instead of waiting for ever (over a
  ring, which the hung reader holds, the put takes a segment instead, never blocked);
* ``storage_errors`` — a put meets a full /dev/shm (space or inodes) or a segment name taken by
  someone else: the request fails at once, naming the cause, and nothing is left;
* ``sweep_during_read`` — the Talker dies right after committing a chunk and an operator's sweep
  runs while Code2Wav may still be taking it (handing its segment back as a spare of the dead
  Talker's namespace): the sweep leaves nothing all the same;
* ``corrupt_chunk`` — the bytes of a committed chunk change (a flipped byte, or a forged frame
  with a valid checksum whose header lies about its buffers): the consumer never accepts them;
* ``cleanup_raises`` — the connector's cleanup of one key raises, in the reclaim an abort queued
  or in the release sweep: the reclaim goes on past it, the release still answers.

Every frame is recorded as sent and as received, so ``no-corrupt-accept`` checks content.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import torch

from omnisim.faults import Fault, FaultPlan
from omnisim.processes import FORGERIES
from omnisim.registry import DEFAULT_INVARIANTS, Param, Params, ScenarioBody, scenario
from omnisim.sim_kernel import MAIN_PROCESS, SimKernel
from omnisim.world import World
from runtime.kernel import current_kernel
from runtime.request import RequestStatus
from scenarios.edge import (
    CODE2WAV,
    CONSUMER_WAIT_S,
    TALKER,
    EdgeRequest,
    MergeWatch,
    abort,
    check_failures,
    codec_frames,
    produce,
    release,
    synthetic_codec_chunk,
    wait_for_chunk,
    watch_code2wav,
)

#: The invariants of the data plane, on top of the defaults.
DATA_PLANE = (*DEFAULT_INVARIANTS, "no-residue-after-sweep", "bounded-wait")
#: How soon a consumer must learn that its producer died (issue 9: "within one second").
PRODUCER_NOTICE_S = 1.0
#: How long a scenario's client waits for its request before it gives up (a hang, for liveness).
CLIENT_PATIENCE_S = 30.0
CHUNKS = [4, 25, 10]
#: ``writer_crash``'s chunks: the one the writer dies in is the size of the one before it, so the
#: segment it writes into may be that one's, handed back as a spare — byte for byte the same size,
#: its old commit trailer exactly where the new one goes.
WRITER_CHUNKS = [25, 25, 10]
#: How often ``sweep_during_read``'s operator looks whether the Talker died.
SWEEP_POLL_S = 0.001
#: How long ``stalled_reader``'s client waits for the new generation: past a put's lock deadline
#: (10 s), within the run's horizon.
STALLED_PATIENCE_S = 12.0


def crash_scenario(
    name: str,
    *,
    own: int,
    faults: Callable[[Params], FaultPlan | None],
    params: tuple[Param, ...] = (),
    prepare: Callable[[World, Params], None] | None = None,
    invariants: tuple[str, ...] = DATA_PLANE,
    **kwargs: Any,
) -> Callable[[ScenarioBody], ScenarioBody]:
    """Register a data-plane scenario at the edge, with stage ``own`` in a process of its own
    and the fault plan ``faults`` builds from the run's configuration; ``prepare`` readies the
    world before anything of it runs."""

    def build(store_kind: str, run_params: Params | None = None) -> World:
        world = World(store_kind, processes=True)
        world.add_stage(TALKER, processor=synthetic_codec_chunk, receives=False, own_process=own == TALKER)
        world.add_stage(CODE2WAV, sends=False, own_process=own == CODE2WAV)
        if prepare is not None:
            prepare(world, run_params or {})
        world.inject(faults(run_params or {}))
        watch_code2wav(world)
        return world

    return scenario(name, build=build, invariants=invariants, params=params, **kwargs)


# -- the two sides, recording content ------------------------------------------------------------


async def send(
    req: EdgeRequest,
    chunk_frames: list[int],
    *,
    pause_s: float = 0.0,
    output: Mapping[str, object] | None = None,
    first_frame: int = 0,
) -> None:
    """The Talker's scheduler: one chunk per entry, the last one the terminal; every frame sent
    is recorded. Stops when the request ended (or its process died: then it never returns).
    ``pause_s``: a slow producer, computing that long before each chunk; ``output``: more of the
    model's output beside each chunk's frames, for a processor that sends it; ``first_frame``:
    the index its frames start at (another generation of an id sends other frames)."""
    offset = first_frame
    for i, n in enumerate(chunk_frames):
        if pause_s:
            await current_kernel().sleep(pause_s)
        if req.stream.outcome != "open":
            return
        if i == len(chunk_frames) - 1:
            req.sender.status = RequestStatus.FINISHED_STOPPED
        req.sender.num_computed_tokens += n
        frames = codec_frames(n, offset)
        # Recorded before the hand-off: the process may die right after it, chunk and all queued.
        sent = [tuple(frames[:, j].tolist()) for j in range(n)]
        req.stream.sent_frames.extend(sent)
        if not await req.talker.adapter.save_async({**(output or {}), "frames": frames}, req.sender):
            del req.stream.sent_frames[-n:]
            return
        req.stream.frames_sent += n
        offset += n


async def receive(req: EdgeRequest, *, pause_s: float = 0.0) -> float | None:
    """Code2Wav's side: register for each chunk, record its frames, until the terminal or a
    failure the adapters report (or the client's patience runs out). The time it failed.
    ``pause_s``: a slow consumer, idle that long before it asks for each chunk."""
    k = current_kernel()
    adapter = req.code2wav.adapter
    request = req.receiver
    started = k.now()
    while req.stream.outcome == "open":
        if pause_s:
            await k.sleep(pause_s)
            if req.stream.outcome != "open":
                break  # ended meanwhile (another consumer's look at the failure channels failed it)
        merge = MergeWatch(req)
        await adapter.load_async(request)
        while req.stream.outcome == "open" and not adapter.pop_ready(request.request_id):
            await wait_for_chunk(adapter, request.request_id)
            await check_failures(req.world)
            if req.stream.outcome == "failed":
                return k.now()
            if k.now() - started > CLIENT_PATIENCE_S:
                req.stream.outcome = "gave up"
                await adapter.finish_requests([request])
                return None
        if req.stream.outcome != "open":
            break
        merge.check()
        codes = (request.additional_information or {}).get("codes", {})
        audio = codes.pop("audio", None)
        if isinstance(audio, torch.Tensor) and audio.ndim >= 2:
            req.stream.chunks.append((int(audio.shape[1]), False))
            req.stream.received_frames.extend(tuple(audio[:, j].tolist()) for j in range(audio.shape[1]))
        if adapter.is_done_receiving_chunks(request.request_id):
            req.stream.chunks[-1] = (req.stream.chunks[-1][0], True) if req.stream.chunks else (0, True)
            req.stream.outcome = "finished"
    if req.stream.outcome != "failed":  # (a failed request was finished where it failed)
        await adapter.finish_requests([request])
    return None


async def in_process(jobs: list[tuple[str, str, Callable[[], Awaitable[object]]]]) -> None:
    """Run named jobs concurrently, each in the given simulated process, and wait for the live ones."""
    k = current_kernel()
    assert isinstance(k, SimKernel)
    async with k.task_group() as tasks:
        for job_process, name, job in jobs:
            with k.as_process(job_process):
                tasks.start_soon(job, name=name)


# -- the scenarios --------------------------------------------------------------------------------


@crash_scenario(
    "sweep_during_read",
    summary="the Talker process dies right after committing a chunk, and an operator's sweep of its namespace "
    "runs while Code2Wav may still be taking that chunk: what Code2Wav accepts is what was sent, and the sweep "
    "leaves nothing of the dead Talker, not even the spare Code2Wav hands back meanwhile",
    issue="omnisim issue 13 (spares) and issue 9 (the sweep)",
    own=TALKER,
    faults=lambda p: FaultPlan([Fault("crash_writer", at="shm.put.committed", match={"key": "R_1_1"})]),
)
async def sweep_during_read(world: World) -> None:
    req = EdgeRequest(world, "R")
    req.stream.allowed_outcomes = frozenset({"failed"})
    k = current_kernel()

    async def sweep_once_dead() -> None:
        # The operator sweeps as soon as the Talker is dead (or, if it never dies, after a while).
        deadline = k.now() + PRODUCER_NOTICE_S
        while world.death_time("stage1") is None and k.now() < deadline:
            await k.sleep(SWEEP_POLL_S)
        await world.sweep_dead()

    await in_process(
        [
            (MAIN_PROCESS, "R.consume", lambda: receive(req)),
            ("stage1", "R.produce", lambda: send(req, WRITER_CHUNKS)),
            (MAIN_PROCESS, "operator.sweep", sweep_once_dead),
        ]
    )


AT_PUT = Param("at", ("created", "reserved", "written", "committed"), "the point of the put the writer dies at")


@crash_scenario(
    "writer_crash",
    summary="the Talker process is SIGKILLed in the middle of a put (segment created / reserved / body written "
    "/ committed) while Code2Wav waits: no uncommitted frame is accepted, the request fails within a second, "
    "and the sweep leaves nothing of the dead Talker",
    issue="omnisim issue 9 (commit protocol, producer liveness, sweep)",
    own=TALKER,
    params=(AT_PUT,),
    faults=lambda p: FaultPlan([Fault("crash_writer", at=f"shm.put.{p['at']}", match={"key": "R_1_1"})]),
)
async def writer_crash(world: World) -> None:
    req = EdgeRequest(world, "R")
    req.stream.allowed_outcomes = frozenset({"failed"})
    failed_at: list[float | None] = []

    async def consume() -> None:
        failed_at.append(await receive(req))

    await in_process([(MAIN_PROCESS, "R.consume", consume), ("stage1", "R.produce", lambda: send(req, WRITER_CHUNKS))])
    died = world.death_time("stage1")
    if died is not None and failed_at and failed_at[0] is not None:
        world.probe(
            "bounded-wait",
            failed_at[0] - died <= PRODUCER_NOTICE_S,
            f"the consumer learned {failed_at[0] - died:.3f}s after its producer died (at most {PRODUCER_NOTICE_S}s)",
        )
    await world.sweep_dead()


@crash_scenario(
    "writer_crash_after_reuse",
    summary="an id's chunk is read (its segment kept as a spare), the id is reused, and the Talker is SIGKILLed "
    "in the new generation's put of the same key, once it took that spare under the key's name and before it "
    "wrote a byte: the old generation's chunk, whole under that very key, is never accepted again",
    issue="omnisim issue 13 (spares) and issue 9 (commit protocol)",
    own=TALKER,
    faults=lambda p: FaultPlan([Fault("crash_writer", at="shm.put.reserved", match={"key": "R_1_0"}, nth=2)]),
)
async def writer_crash_after_reuse(world: World) -> None:
    old = EdgeRequest(world, "R", "old")
    new = EdgeRequest(world, "R", "new")

    await in_process(
        [(MAIN_PROCESS, "old.consume", lambda: receive(old)), ("stage1", "old.produce", lambda: send(old, [25]))]
    )
    await old.talker.adapter.finish_requests([old.sender])
    await old.talker.adapter.release_shm_resources(old.ext)
    # The new generation's chunk 0 has the old one's size (its spare fits it byte for byte) and
    # other frames, so the old chunk handed out again is told from it.
    await in_process(
        [
            (MAIN_PROCESS, "new.consume", lambda: receive(new)),
            ("stage1", "new.produce", lambda: send(new, [25, 10], first_frame=100)),
        ]
    )
    if world.death_time("stage1") is None:
        # No death: a fault added to the run failed a put of the old generation's first, so the
        # kill, at the key's second put, never came. The live Talker ends the request.
        new.stream.allowed_outcomes = frozenset({"finished"})
        await new.talker.adapter.finish_requests([new.sender])
        await new.talker.adapter.release_shm_resources(new.ext)
    else:
        new.stream.allowed_outcomes = frozenset({"failed"})
    await world.sweep_dead()


AT_GET = Param("at", ("locked", "consumed"), "the point of the get the reader dies at")


@crash_scenario(
    "reader_crash",
    summary="the Code2Wav process is SIGKILLed inside a get (holding the key's lock; before or after it took the "
    "bytes): the live Talker reclaims the request's keys and the lock file the dead reader left",
    issue="omnisim issue 9 (reclaimable lock files)",
    own=CODE2WAV,
    params=(AT_GET,),
    faults=lambda p: FaultPlan([Fault("crash_reader", at=f"shm.get.{p['at']}", match={"key": "R_1_1"})]),
)
async def reader_crash(world: World) -> None:
    k = current_kernel()
    req = EdgeRequest(world, "R")
    req.stream.allowed_outcomes = frozenset({"aborted"})
    await in_process(
        [("stage2", "R.consume", lambda: receive(req)), (MAIN_PROCESS, "R.produce", lambda: send(req, CHUNKS))]
    )
    # The consumer's process is gone: its client will hear nothing more. The orchestrator ends
    # the request on the live stage and sweeps the dead one's namespace.
    while world.death_time("stage2") is None and req.stream.outcome == "open":
        await k.sleep(0.01)
    if req.stream.outcome == "open":
        req.stream.outcome = "aborted"
    await req.talker.adapter.finish_requests([req.sender])
    await req.talker.adapter.release_shm_resources(req.ext)
    await world.sweep_dead()


@crash_scenario(
    "sweep_vs_live_owner",
    summary="an operator's sweep runs while a live Talker process streams, next to a namespace a dead engine left "
    "whose pid a new process now has: the dead namespace goes entirely, nothing of the live one does",
    issue="omnisim issue 9 (owner-tracked namespaces)",
    own=TALKER,
    faults=lambda p: None,
)
async def sweep_vs_live_owner(world: World) -> None:
    world.leave_dead_namespace(keys=["X_1_0", "X_1_1"], reuse_pid_of="stage1")
    req = EdgeRequest(world, "R")

    async def sweep() -> None:
        await world.sweep_dead()

    await in_process(
        [
            (MAIN_PROCESS, "R.consume", lambda: receive(req)),
            ("stage1", "R.produce", lambda: send(req, CHUNKS)),
            (MAIN_PROCESS, "operator.sweep", sweep),
        ],
    )
    await req.talker.adapter.release_shm_resources(req.ext)


@crash_scenario(
    "stalled_reader",
    summary="a Code2Wav reader hangs (SIGSTOP) holding a key's lock while the id is reused: the new generation's "
    "put gives up within its lock deadline and its request fails, instead of waiting for ever",
    issue="omnisim issue 9 (bounded waits)",
    own=CODE2WAV,
    faults=lambda p: FaultPlan([Fault("stall", at="shm.get.locked", match={"key": "R_1_0"})]),
)
async def stalled_reader(world: World) -> None:
    k = current_kernel()
    old = EdgeRequest(world, "R", "old")
    old.stream.allowed_outcomes = frozenset({"aborted"})
    new = EdgeRequest(world, "R", "new")
    # Over segments the new put waits for the hung reader's lock file and fails. Over the ring it
    # cancels the old frame and, the ring being held, takes a segment: it is never blocked, and
    # the request waits for a reader that never comes, until its client gives up.
    new.stream.allowed_outcomes = frozenset({"gave up" if world.store_kind == "ring" else "failed"})

    async def old_request() -> None:
        await in_process(
            [("stage2", "old.consume", lambda: receive(old)), (MAIN_PROCESS, "old.produce", lambda: send(old, [4]))],
        )

    async def reuse() -> None:
        while not world.stalled and old.stream.outcome == "open":
            await k.sleep(0.01)
        if not world.stalled:
            # An injected fault ended the old request before its reader could stall: the new
            # generation meets no held lock, and no reader of it is coming.
            new.stream.allowed_outcomes |= {"gave up"}
        if old.stream.outcome == "open":
            old.stream.outcome = "aborted"
        await old.talker.adapter.finish_requests([old.sender])
        await old.talker.adapter.release_shm_resources(old.ext)
        await send(new, [4, 3])
        started = k.now()
        while new.stream.outcome == "open":
            await k.sleep(CONSUMER_WAIT_S)
            failed = new.talker.adapter.collect_failed_send_request_ids()
            if new.sender.request_id in failed:
                new.stream.outcome = "failed"
            elif k.now() - started > STALLED_PATIENCE_S:
                new.stream.outcome = "gave up"
        await new.talker.adapter.finish_requests([new.sender])
        await new.talker.adapter.release_shm_resources(new.ext)
        world.crash("stage2")  # the operator kills the hung reader
        await world.sweep_dead()

    await in_process([(MAIN_PROCESS, "old", old_request), (MAIN_PROCESS, "reuse", reuse)])


STORAGE_FAULT = Param(
    "fault", ("store_full", "reserve_full", "enospc_inodes", "foreign_name"), "what the put of chunk 1 meets"
)
#: How the error of each fault a put or a get may meet names its cause.
CAUSES = {
    "store_full": "/dev/shm is full",
    "reserve_full": "/dev/shm is full",
    "enospc_inodes": "no inodes left",
    "foreign_name": "not ours",
    "put_fail": "injected put failure",
    "put_raise_after_create": "injected raise",
    "decode_fail": "injected decode failure",
}


def names_its_cause(world: World, error: str | None) -> tuple[bool, list[str]]:
    """Whether ``error`` names the cause of a fault that fired in this run (the scenario's own,
    or one sampled on top of it that struck first), and those causes. A forged frame's cause is
    the lie it tells (``world.forgery``)."""
    causes = [
        FORGERIES[world.forgery] if f.kind == "forged_frame" else CAUSES[f.kind]
        for f in World.fired_faults()
        if f.kind in CAUSES or f.kind == "forged_frame"
    ]
    return any(cause in (error or "") for cause in causes), causes


@crash_scenario(
    "storage_errors",
    summary="the put of a chunk meets a full /dev/shm (space, or inodes) or a segment name taken by someone else: "
    "the request fails at once with that cause, nothing later is sent, and nothing is left behind",
    issue="omnisim issue 9 (every storage error a clean failure)",
    own=TALKER,
    params=(STORAGE_FAULT,),
    faults=lambda p: FaultPlan([Fault(p["fault"], match={"key": "R_1_1"})]),
)
async def storage_errors(world: World) -> None:
    req = EdgeRequest(world, "R")
    req.stream.allowed_outcomes = frozenset({"failed"})
    await in_process(
        [(MAIN_PROCESS, "R.consume", lambda: receive(req)), ("stage1", "R.produce", lambda: send(req, CHUNKS))]
    )
    named, causes = names_its_cause(world, req.stream.error)
    world.probe(
        "terminal-delivered",
        req.stream.outcome != "failed" or named,
        f"the request failed with {req.stream.error!r}, which names none of the causes {causes}",
    )
    await req.talker.adapter.finish_requests([req.sender])
    await req.talker.adapter.release_shm_resources(req.ext)


CORRUPTION = Param(
    "how",
    ("flipped_byte", *(f"forged_{lie}" for lie in FORGERIES)),
    "how the committed chunk's bytes change: a flipped byte, or a forged frame whose header lies about its buffers",
)


def corrupt_as(world: World, params: Params) -> None:
    world.forgery = params["how"].removeprefix("forged_")


@crash_scenario(
    "corrupt_chunk",
    summary="the bytes of a committed chunk change before Code2Wav reads them (a flipped byte; a forged frame with "
    "a valid checksum whose header lies: buffers that overlap, a buffer too short for its shape, one that runs "
    "into the commit trailer or starts before the buffers, a reference that is not one; an intact frame of something "
    "that is no stage payload): they are never accepted, and the request fails naming the key and, for a forged "
    "frame, the lie",
    issue="omnisim issue 9 (checksums, decode safety)",
    own=TALKER,
    params=(CORRUPTION,),
    faults=lambda p: FaultPlan(
        [Fault("corrupt_bytes" if p["how"] == "flipped_byte" else "forged_frame", match={"key": "R_1_1"})]
    ),
    prepare=corrupt_as,
)
async def corrupt_chunk(world: World) -> None:
    req = EdgeRequest(world, "R")
    req.stream.allowed_outcomes = frozenset({"failed"})
    await in_process(
        [(MAIN_PROCESS, "R.consume", lambda: receive(req)), ("stage1", "R.produce", lambda: send(req, CHUNKS))]
    )
    if world.params["how"] != "flipped_byte":  # (a flipped byte may land anywhere: any check may catch it)
        named, causes = names_its_cause(world, req.stream.error)
        world.probe(
            "terminal-delivered",
            req.stream.outcome != "failed" or named,
            f"the request failed with {req.stream.error!r}, which names none of the causes {causes}",
        )
    await req.talker.adapter.finish_requests([req.sender])
    await req.talker.adapter.release_shm_resources(req.ext)


@crash_scenario(
    "transient_read_error",
    summary="Code2Wav's get of a chunk raises before it touched anything (an I/O error of the moment): the receive "
    "loop polls again, and the request finishes with every frame, each once, nothing left behind",
    issue="omnisim issue 11 (a blind spot of the mutation score: the receive loop's retry)",
    own=TALKER,
    faults=lambda p: FaultPlan([Fault("get_raise", match={"key": "R_1_1"})]),
)
async def transient_read_error(world: World) -> None:
    req = EdgeRequest(world, "R")
    req.stream.allowed_outcomes = frozenset({"finished"})
    await in_process(
        [(MAIN_PROCESS, "R.consume", lambda: receive(req)), ("stage1", "R.produce", lambda: send(req, CHUNKS))]
    )
    await req.talker.adapter.release_shm_resources(req.ext)


@crash_scenario(
    "failed_put",
    summary="a connector's put meets a full /dev/shm or a segment name that is not ours: it reports the cause "
    "and leaves the key as it found it (no lock file, no segment) — nothing else will clean up after it",
    issue="omnisim issue 9 (every storage error a clean failure)",
    own=TALKER,
    params=(Param("fault", ("store_full", "reserve_full", "foreign_name"), "what the put meets"),),
    faults=lambda p: FaultPlan([Fault(p["fault"], match={"key": "P_1_0"})]),
)
async def failed_put(world: World) -> None:
    connector = world.stages[TALKER].connector
    result = await connector.put("1", "2", "P_1_0", {"codes": {"audio": codec_frames(4)}})
    named, causes = names_its_cause(world, str((result.metadata or {}).get("error")))
    world.probe(
        "terminal-delivered",
        not result.ok and named,
        f"the failed put reported {result.metadata!r}, which names none of the causes {causes}",
    )


RAISING_SWEEP = Param(
    "raises",
    ("reclaim", "release"),
    "which sweep meets the cleanup that raises: the reclaim of an aborted request's unread chunks, or the release "
    "sweep of a finished request's",
)
#: The chunk whose cleanup raises, of the three the request sends.
RAISING_KEY = "R_1_1"


@crash_scenario(
    "cleanup_raises",
    summary="request R sends three chunks nobody reads; the connector's cleanup of the second one raises (a bug, or "
    "an interrupted call), in the reclaim its abort queued or in the release sweep once it finished: the reclaim "
    "goes on to the keys after it, the release still answers (the id is freed), and the key it could not remove "
    "goes with the next sweep of the id",
    issue="omnisim issue 11 (a blind spot of the mutation score: sweeps that raise)",
    own=TALKER,
    params=(RAISING_SWEEP,),
    faults=lambda p: FaultPlan([Fault("cleanup_raise", match={"key": RAISING_KEY})]),
)
async def cleanup_raises(world: World) -> None:
    req = EdgeRequest(world, "R")
    k = current_kernel()
    reclaim = world.params["raises"] == "reclaim"
    req.stream.allowed_outcomes = frozenset({"aborted"})
    await produce(req, [4, 3, 3], finish=not reclaim)  # (a sent terminal: no reclaim, the release sweeps)
    await k.sleep(0.5)
    await abort(req)
    if reclaim:
        await k.sleep(0.5)  # the reclaim runs on the save loop
        left = sorted(world.chunks_held())
        # (only where the cleanup raised, and no other fault moved the keys: ``--faults sampled``)
        if {f.kind for f in World.fired_faults()} == {"cleanup_raise"}:
            world.probe("no-orphan-shm", left == [RAISING_KEY], f"the reclaim left {left}, not only {RAISING_KEY}")
    await release(req)  # (a release that never answered would hang here)
    await release(req)
