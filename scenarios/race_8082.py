"""The #8082 race table (spec §8, seed Level 5): cancellation is not one synchronous delete.

Each scenario is one row of the seed's table, at the Talker → Code2Wav edge, and says which
ordering makes its race bite (``constraints``, used by the ``ordered`` strategy).
"""

from __future__ import annotations

from omnisim.faults import Fault, FaultPlan
from omnisim.world import World
from runtime.kernel import current_kernel
from scenarios.edge import (
    TALKER,
    EdgeRequest,
    abort,
    check_failures,
    consume,
    edge_scenario,
    produce,
    produce_then_finish,
    release,
    serve,
    together,
)

ABORTABLE = frozenset({"finished", "aborted"})


@edge_scenario(
    "abort_during_put",
    summary="abort while a chunk put is in flight: the abort returns at once, the put's segment is reclaimed",
    issue="#8082 (a)",
    constraints=(
        "shm.put.begin[key=R_1_0] < orch.abort.begin[req=R] < adapter.cleanup_sender.end[ext=R] "
        "< shm.put.end[key=R_1_0]",
    ),
)
async def abort_during_put(world: World) -> None:
    req = EdgeRequest(world, "R")
    req.stream.allowed_outcomes = ABORTABLE
    await together(
        ("R.consume", lambda: consume(req)),
        ("R.produce", lambda: produce(req, [4, 25, 10])),
        ("orch.abort", lambda: abort(req)),
    )
    await release(req)


@edge_scenario(
    "id_reuse_after_cancel",
    summary="abort R with a put in flight, then reuse external id R: work for R is refused while the old "
    "generation drains, and the old reclaim never deletes the new generation's chunks",
    issue="#8082 (b)",
    constraints=(
        "shm.put.begin[key=R_1_0] < orch.abort.end[req=R] < adapter.save_async[req=new0-talker] "
        "< shm.put.end[key=R_1_0]",
    ),
)
async def id_reuse_after_cancel(world: World) -> None:
    k = current_kernel()
    old = EdgeRequest(world, "R", "old")
    old.stream.allowed_outcomes = ABORTABLE
    talker = world.stages[TALKER].adapter

    async def abort_then_reuse() -> None:
        # The client reuses R as soon as its abort returned, while the old generation may still
        # be draining. (Not earlier: an abort is keyed by external id and would cancel whichever
        # generation owns R by then.)
        await abort(old)
        for attempt in range(20):
            new = EdgeRequest(world, "R", f"new{attempt}")
            new.stream.allowed_outcomes = frozenset({"finished", "failed"})
            draining = talker.is_draining("R")
            sent = await produce(new, [4, 25, 3])
            world.probe(
                "exact-key-ownership",
                not (draining and new.stream.frames_sent),
                f"save_async for {new.sender.request_id} was accepted while R's previous generation was draining",
            )
            if sent:
                # The new chunks (which replace any unread old ones) sit unread for a while: a
                # reclaim of the old generation that runs after them deletes what the new
                # receiver is about to read.
                await k.sleep(0.2)
                await consume(new)
                await release(new)
                await release(old)
                return
            await check_failures(world)  # the refusal ends this attempt: the channel says why
            await k.sleep(0.01)
        world.probe("liveness", False, "external id R was refused 20 times after its old generation was aborted")

    await together(
        ("old.consume", lambda: consume(old)),
        ("old.produce", lambda: produce(old, [4, 25, 10])),
        ("orch.reuse", abort_then_reuse),
    )


SIBLING_SUFFIXES = ("_1_2", "_1", "_suffix")


@edge_scenario(
    "similar_ids",
    summary="abort 'task' while 'task_1_2', 'task_1' and 'task_suffix' hold unread chunks: siblings lose nothing",
    issue="#8082 (c)",
    constraints=(
        "shm.put.end[key=task_1_2_1_0] < shm.put.end[key=task_1_0] < orch.abort.begin[req=task] "
        "< adapter.cleanup_shm.begin[prefix=task_1] < shm.get.begin[key=task_1_2_1_0]",
    ),
)
async def similar_ids(world: World) -> None:
    target = EdgeRequest(world, "task")
    target.stream.allowed_outcomes = ABORTABLE
    siblings = [EdgeRequest(world, f"task{suffix}") for suffix in SIBLING_SUFFIXES]

    async def siblings_then_consume() -> None:
        for sib in siblings:
            await produce(sib, [4, 3])
        await current_kernel().sleep(0.2)  # their chunks sit unread while 'task' is reclaimed
        await together(*[(f"{sib.ext}.consume", lambda sib=sib: consume(sib)) for sib in siblings])
        for sib in siblings:
            await release(sib)

    async def target_then_abort() -> None:
        await produce(target, [4, 25], finish=False)
        await abort(target)
        await release(target)

    await together(("siblings", siblings_then_consume), ("task", target_then_abort))


@edge_scenario(
    "sibling_ids_both_read",
    summary="requests 'R' and 'R_1' stream across the edge at once and both are read: R's chunk keys (R_1_k) are "
    "the start of R_1's (R_1_1_k), and each reader takes its own chunks only, on a segment or a ring",
    issue="#8082 (c), from the reader's side (a bug the harness was not told about: a ring's key matched by prefix)",
)
async def sibling_ids_both_read(world: World) -> None:
    shorter, longer = EdgeRequest(world, "R"), EdgeRequest(world, "R_1")
    await together(
        ("R", lambda: serve(shorter, [4, 25, 3])),
        ("R_1", lambda: serve(longer, [4, 25, 3])),
    )


@edge_scenario(
    "terminal_success_vs_failure",
    summary="a sent terminal survives the sender's cleanup; a failed terminal (its segment left by a raising put) "
    "is reclaimed",
    issue="#8082 (d)",
    faults=lambda seed: FaultPlan([Fault("put_raise_after_create", match={"key": "bad_1_2"})], seed),
)
async def terminal_success_vs_failure(world: World) -> None:
    good = EdgeRequest(world, "good")
    bad = EdgeRequest(world, "bad")
    # The put raised after writing a complete segment: a receiver may still read that terminal.
    bad.stream.allowed_outcomes = frozenset({"failed", "finished"})

    async def bad_sender() -> None:
        # Its chunks are sent first, so the terminal is bad_1_2; the scheduler finishes the
        # request while that terminal is queued, so its failure path owes the reclaim.
        await produce(bad, [4, 25], finish=False)
        await current_kernel().sleep(0.2)
        await produce_then_finish(bad, [3])

    await together(
        ("good", lambda: serve(good, [4, 25, 3])),
        ("bad.consume", lambda: consume(bad)),
        ("bad.produce", bad_sender),
    )
    # The reclaim itself must take what the raising put left: the release sweep below would
    # too (a key whose put raised stays tracked), but a request id that is never released (a
    # stage stopped first) has only the reclaim.
    await current_kernel().sleep(0.5)
    world.probe(
        "no-orphan-shm", "bad_1_2" not in world.chunks_held(), "the reclaim left bad_1_2, which a raising put made"
    )
    await release(bad)


@edge_scenario(
    "stale_receiver_entry",
    summary="cleanup_receiver (and a re-registration of the same id) while a get is in flight: nothing is resurrected",
    issue="#8082 (e)",
    constraints=(
        "shm.get.locked[key=R_1_0] < adapter.cleanup_receiver.begin[req=R-code2wav] "
        "< orch.reregister[req=R-code2wav] < shm.get.consumed[key=R_1_0]",
    ),
)
async def stale_receiver_entry(world: World) -> None:
    req = EdgeRequest(world, "R")
    req.stream.allowed_outcomes = ABORTABLE
    code2wav = req.code2wav.adapter

    async def disrupt() -> None:
        k = current_kernel()
        await code2wav.cleanup_receiver(req.receiver.request_id)
        await k.point("orch.reregister", req=req.receiver.request_id)
        await code2wav.load_async(req.receiver)  # the same id registers again: a new entry
        await k.sleep(0.1)
        await abort(req)

    await together(
        ("R.consume", lambda: consume(req)),
        ("R.produce", lambda: produce(req, [4])),
        ("orch.disrupt", disrupt),
    )
    await release(req)


@edge_scenario(
    "repeated_receiver_cleanups",
    summary="many cleanups of requests that were never queued, and of one that was: no receiver residue remains",
    issue="#8082 (f)",
)
async def repeated_receiver_cleanups(world: World) -> None:
    code2wav = world.stages[2].adapter
    for i in range(20):
        await code2wav.cleanup_receiver(f"gone{i}-code2wav")
    req = EdgeRequest(world, "R")
    await serve(req, [4, 3])
    for _ in range(3):
        await code2wav.cleanup_receiver(req.receiver.request_id)


@edge_scenario(
    "idle_reap",
    summary="after the last send, an idle save loop forgets every key the consumer took",
    issue="#8082 (g)",
)
async def idle_reap(world: World) -> None:
    # No final sweep here: it would forget the consumed keys itself and hide a missing reap.
    reqs = [EdgeRequest(world, f"R{i}") for i in range(2)]
    await together(
        *[(f"{r.ext}.consume", lambda r=r: consume(r)) for r in reqs],
        *[(f"{r.ext}.produce", lambda r=r: produce(r, [1] * 6)) for r in reqs],
    )


@edge_scenario(
    "unread_head_rotation",
    summary="65 unread keys at the head of the pending set do not starve the reap of 65 consumed keys behind them",
    issue="#8082 (h)",
    horizon_s=40.0,
    budget_share=0.25,
)
async def unread_head_rotation(world: World) -> None:
    k = current_kernel()
    unread = EdgeRequest(world, "A")
    unread.stream.allowed_outcomes = frozenset({"aborted"})
    read = EdgeRequest(world, "B")
    await produce(unread, [1] * 65, finish=False)
    await together(("B.consume", lambda: consume(read)), ("B.produce", lambda: produce(read, [1] * 65)))
    await k.sleep(0.35)  # at least three idle reap passes
    pending = world.stages[TALKER].connector.residue()["pending_keys"]
    unread_keys = {f"A_1_{i}" for i in range(65)}
    # An injected fault may have failed some of A's puts (nothing of theirs is left to track);
    # still, once B was consumed, no key of B may stay tracked. (One that failed B itself leaves
    # B's unread keys to the orchestrator's sweep: there is no consumed B to check.)
    faulted = bool(world.fired_faults())
    world.probe(
        "no-tombstones",
        read.stream.outcome != "finished"
        or (set(pending) <= unread_keys if faulted else sorted(pending) == sorted(unread_keys)),
        f"after B was consumed and three idle reaps the sender still tracks {len(pending)} keys "
        f"({sum(key.startswith('B_') for key in pending)} of them consumed); expected exactly A's 65",
    )
    await abort(unread)
    await release(unread)


@edge_scenario(
    "deserialize_failure",
    summary="a payload that fails to decode after its bytes were taken leaves no segment, lock file or pending key",
    issue="#8082 (i)",
    faults=lambda seed: FaultPlan([Fault("decode_fail", match={"key": "R_1_0"})], seed),
)
async def deserialize_failure(world: World) -> None:
    req = EdgeRequest(world, "R")
    req.stream.allowed_outcomes = frozenset({"failed"})  # its first chunk is lost: the deadline ends it
    await serve(req, [4, 3], input_deadline_s=1.0)
