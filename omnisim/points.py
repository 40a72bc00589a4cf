"""The public vocabulary of points and notes: what ``omnisim list points`` prints.

A *point* is a scheduling decision (the ordered strategy can hold a task there, a fault plan can
fire there); a *note* is an observation only. Constraints may order both, but only points can be
held back, so the later element of an order should be a point.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

POINTS: dict[str, tuple[str, str]] = {
    # name: (kind, meaning)
    "shm.put.begin": ("point", "a put starts (before the bounded reap and the encode) [key]"),
    "shm.put.locked": (
        "point",
        "the writer holds the key's lock file; no segment yet (on a ring: the put is about to reserve a frame) [key]",
    ),
    "shm.put.created": (
        "point",
        "the segment exists, empty: its size not yet reserved (on a ring: the frame) [key, via: ring or segment]",
    ),
    "shm.put.reserved": ("point", "the segment's bytes are reserved (zero-filled), not yet written [key, bytes]"),
    "shm.put.written": ("point", "the frame's body is in the segment, not yet committed; the lock is held [key]"),
    "shm.put.committed": (
        "point",
        "the commit trailer is written: the frame reads as complete (a ring frame is published right after) [key]",
    ),
    "shm.put.wake": ("note", "the put wakes the receivers of its stage, whoever waits for a chunk there [key, to]"),
    "shm.put.end": ("point", "the put succeeded: the key is tracked and receivers were woken [key]"),
    "shm.put.failed": ("note", "a put reported failure (storage or encoding error) [key, error]"),
    "shm.get.begin": ("point", "a non-blocking get looks for the key [key]"),
    "shm.get.locked": (
        "point",
        "the reader holds the key's lock file (or the ring's lock) and is about to take the bytes [key]",
    ),
    "shm.get.consumed": ("point", "the bytes were taken and the segment unlinked (or the ring frame done) [key]"),
    "shm.get.unlocked": ("note", "the reader removed the consumed chunk's lock file (or it was no longer its) [key]"),
    "shm.get.corrupt": ("note", "a consumed payload was not a committed, intact frame: a corrupt chunk [key]"),
    "shm.cleanup.begin": ("point", "an exact-key cleanup starts [key]"),
    "shm.cleanup.unlinked": ("note", "a cleanup removed a segment that existed (or cancelled a ring frame) [key]"),
    "shm.cleanup.failed": (
        "note",
        "a cleanup could not remove the segment its put made: the key stays, the reap tries again [key, retries]",
    ),
    "ring.full": (
        "note",
        "a put found the edge's ring full (or held) past its wait: it takes a segment [key, edge, bytes, held]",
    ),
    "ring.room_wait_timed_out": (
        "note",
        "a put waiting for room on a full ring was not woken before its wait ended [key, edge, bytes]",
    ),
    "ring.unavailable": ("note", "an edge's ring could not be made: its puts take segments for now [edge, error]"),
    "ring.refused": ("note", "a reader will not read a ring: retired, malformed, or not its producer's [edge]"),
    "ring.corrupt": ("note", "a ring's bytes are not a ring's (a stray write): whoever found it retired it [edge]"),
    "shm.lost": (
        "note",
        "a chunk that went unread with a ring its producer dropped is marked lost (its get says so) [key]",
    ),
    "adapter.save_async": ("point", "the scheduler queued (or had refused) one chunk [ext, req, finished, accepted]"),
    "adapter.save_async.rejected": ("note", "work for an id whose previous generation drains was refused [ext, req]"),
    "adapter.send.begin": ("point", "the save task takes a chunk task of a generation [ext, gen, finished]"),
    "adapter.send.stale": (
        "note",
        "the pre-put check: the task's generation no longer owns the id, or may not send (cancelled or failed) "
        "[ext, gen]",
    ),
    "adapter.put": (
        "note",
        "the adapter hands a chunk to the connector; the key range is already bounded [ext, gen, key]",
    ),
    "adapter.cleanup_sender.begin": ("point", "cleanup_sender starts [ext, stage]"),
    "adapter.cleanup_sender.end": ("point", "cleanup_sender returns (it never waits for I/O) [ext]"),
    "adapter.cleanup_shm.begin": ("point", "the save task reclaims a retired generation's keys [prefix, n, gen]"),
    "adapter.cleanup_shm.end": ("note", "that reclaim is done [prefix, gen]"),
    "adapter.release.begin": ("point", "the request-level final sweep starts on the save task [ext, stage]"),
    "adapter.release.end": ("note", "the final sweep is done [ext, removed]"),
    "adapter.load_async": ("point", "the scheduler registered a request for its next chunk [req]"),
    "adapter.register": ("note", "a new receive registration was created [stage, req, entry]"),
    "adapter.unregister": ("note", "a registration ended (cleanup, or its chunk committed) [stage, req, why]"),
    "adapter.commit": (
        "note",
        "a received chunk was committed into a registration [stage, req, entry, chunk, finished]",
    ),
    "adapter.poll": ("note", "the receive task polls the next chunk of a registration [stage, req, entry, key]"),
    "adapter.poll.discarded": ("note", "a chunk consumed by a stale registration was dropped [req, key]"),
    "adapter.stream.admitted": (
        "note",
        "the active-stream window took up a request's chunk stream: it stays until cleanup_receiver [stage, req, "
        "window]",
    ),
    "adapter.cleanup_receiver.begin": ("point", "cleanup_receiver starts [req]"),
    "adapter.cleanup_receiver.end": ("point", "cleanup_receiver returns [req]"),
    "orch.submit": ("point", "a client submits a request (before waiting out a reused id's sweep) [req]"),
    "orch.abort.begin": ("point", "the orchestrator starts aborting a request on every stage [req]"),
    "orch.abort.end": ("point", "the abort returned [req]"),
    "orch.stage_died": ("note", "a stage's process died; the requests bound to it fail [stage, reason]"),
    "sched.add": ("note", "a stage's scheduler got a request (its whole input, or a placeholder) [stage, req]"),
    "sched.abort": ("note", "a stage's scheduler was asked to abort a request (applied at its next step) [stage, req]"),
    "sched.batch": (
        "note",
        "one step of a stage's scheduler runs model work for size requests; max_num_seqs is max [stage, size, max]",
    ),
    "sched.preempted": (
        "note",
        "a running request went back to the front of the waiting queue: over max_num_seqs [stage, req]",
    ),
    "orch.accepted": ("note", "a request was accepted: a new generation of its id starts on the stages [req]"),
    "orch.released": (
        "note",
        "a request's release sweep ran on every stage; its id is free [req, answered: it ended whole, reclaimed]",
    ),
    "stage.ready": ("point", "a stage process built its stage and is about to tell the head it is ready [stage]"),
    "stage.life": ("note", "a stage's supervisor starts a life of it, writing into a namespace [stage, ns]"),
    "stage.buried": (
        "note",
        "a dead life of a stage is gone for sure and its namespace swept; a restart backs off from here [stage, ns]",
    ),
    "stage.died": ("note", "a stage's supervisor found its life dead (exited, or silent too long) [stage, reason]"),
    "orch.fail": ("note", "the orchestrator failed a request (send failure, input deadline) [req, reason]"),
    "orch.failure_unclaimed": (
        "note",
        "a stage reported a failure of a stage request the orchestrator no longer knows [stage, req, reason]",
    ),
    "scenario.client.wait": ("point", "a scenario's client lets time pass before it disconnects [req]"),
    "orch.reregister": ("point", "a scenario re-registers a request id that was just cleaned up [req]"),
    "mutant.window": ("point", "a window a mutant opens where the correct code has none [ext]"),
    "wait.begin": ("note", "a bounded wait starts (e.g. for a key's lock file) [what, key, limit_us]"),
    "wait.end": ("note", "that wait ended (the awaited thing came, or its deadline passed) [what, key]"),
    "adapter.receive_failed": (
        "note",
        "a chunk of a request will never arrive (corrupt, or its producer died) [stage, req]",
    ),
    "sweep.judge": ("point", "a sweep judges whether a namespace's owner lives, right before removing it [ns]"),
    "sweep.removed": ("note", "a sweep removed one name of a dead owner's namespace [ns, name]"),
    "kernel.killed": ("note", "this task stopped for good: its process was killed, or it hangs [process]"),
    "process.paused": ("note", "a simulated process was SIGSTOPped; it continues later [process, for_us]"),
    "world.owner_claimed": ("note", "a live process claimed a namespace (it now owns it) [ns]"),
    "process.killed": ("note", "a simulated process was SIGKILLed: its tasks stop for good [process]"),
    "process.started": ("note", "a task started a child process, a program of the world (start_process) [process]"),
    "process.exited": (
        "note",
        "a child process ended by itself: its main returned (code 0) or raised (1) [process, code]",
    ),
    "probe.failed": ("note", "a scenario saw an invariant fail by its own check [invariant, message]"),
    "stream.held": (
        "note",
        "a scenario saw an audio chunk Code2Wav handed out stay off its client's stream [req: the stage request]",
    ),
    "merge.case": ("note", "what a receiver merged after a commit, next to what spec §3.8 says [req, ext, got, want]"),
    "sender.answer": ("note", "what save_async answered, next to what spec §3.3 says it must [req, got, want]"),
    "processor.view": ("note", "what a processor was handed, next to what was queued [req, got, want]"),
    "processor.flags": ("note", "the finish flags a chunk carried, next to spec §3.4 step 5's [req, chunk, got, want]"),
    "config.fact": ("note", "what resolving or validating a config gave, and what spec §1 says [fact, got, want]"),
    "input.case": ("note", "what a bad or boundary input gave, and what it must give [what, got, want]"),
    "connector.answer": ("note", "what a connector answered, next to what it did [what, got, want]"),
    "sweep.case": ("note", "what a sweep's report or the folder after it said, and what it must [what, got, want]"),
    "ring.unlocked_write": (
        "note",
        "a ring's head or tail moved with its lock free (seen when it was next taken), or its head while a reader "
        "held it [edge, when, left, found]",
    ),
    "os.case": ("note", "what a put or get gave as a system call of the store failed, and what must [what, got, want]"),
    "model.case": ("note", "what a call gave on the store in memory, and what on the real one [what, got, want]"),
    "room.case": ("note", "what a put or get on a store of bounded room gave, and what it must give [what, got, want]"),
    "shm.planted": ("note", "what became of a name a scenario planted in /dev/shm, and what must [what, got, want]"),
    "serving.timestamps_over_http": ("note", "an HTTP streaming request with word timestamps was judged [accepted]"),
    "client.timestamps": ("note", "where a client's last word ends, and how long its audio is [req, end_ms, audio_ms]"),
    "client.left": ("note", "a client stopped listening before its request ended (generate() closed) [req]"),
    "world.owner_died": ("note", "the owner of a namespace is dead (its process was killed) [ns]"),
    "scenario.shutdown.wait": ("point", "a scenario lets the engine run before it shuts it down in flight"),
    "kernel.block": ("note", "a task blocked on a held lock [on]"),
    "kernel.wait": ("note", "a task waits on a signal or sleeps [on]"),
    "kernel.timeout": (
        "note",
        "a task's wait on a signal ended by its timeout, not by a notify [on; missed: what it waited for was there]",
    ),
    "kernel.crash": ("note", "a task died with an exception [error]"),
    "fault": ("note", "an injected fault of the fault plan fired [kind, at, key where its point has one]"),
    "fault.os": ("note", "a system call of the store failed as the os_errors scenario made it [at, errno]"),
    "fault.store": ("note", "the store refused a call as the failed_cleanup scenario made it [at, key]"),
    "fault.close": ("note", "a scenario closes a connector while its puts are in flight [connector]"),
}


def attributes(name: str) -> frozenset[str] | None:
    """The attributes the event ``name`` carries, as its meaning lists them in brackets
    (``[key, via: ring or segment]``); None for an event this vocabulary does not know."""
    entry = POINTS.get(name)
    if entry is None:
        return None
    listed = re.search(r"\[([^\]]*)\]\s*$", entry[1])
    parts = re.split(r"[,;]", listed.group(1)) if listed else []
    return frozenset(m.group(1) for part in parts if (m := re.match(r"\s*(\w+)", part)))


def check_attributes(name: str, used: Iterable[str]) -> str | None:
    """Why matching the event ``name`` on the attributes ``used`` can never succeed (one it
    never carries: a misspelling), or None."""
    known = attributes(name)
    unknown = sorted(set(used) - known) if known is not None else []
    if not unknown:
        return None
    carries = f"it carries {', '.join(sorted(known))}" if known else "it carries none"
    return f"{name} has no attribute {', '.join(map(repr, unknown))}: {carries}"
