"""The public vocabulary of points and notes: what ``omnisim list points`` prints.

A *point* is a scheduling decision (the ordered strategy can hold a task there, a fault plan can
fire there); a *note* is an observation only. Constraints may order both, but only points can be
held back, so the later element of an order should be a point.
"""

from __future__ import annotations

POINTS: dict[str, tuple[str, str]] = {
    # name: (kind, meaning)
    "shm.put.begin": ("point", "a put starts (before the bounded reap and the encode) [key]"),
    "shm.put.locked": ("point", "the writer holds the key's lock file; no segment yet [key]"),
    "shm.put.created": ("point", "the segment exists, empty: its size not yet reserved [key]"),
    "shm.put.reserved": ("point", "the segment's bytes are reserved (zero-filled), not yet written [key]"),
    "shm.put.written": ("point", "the frame's body is in the segment, not yet committed; the lock is held [key]"),
    "shm.put.committed": ("point", "the commit trailer is written: the frame reads as complete [key]"),
    "shm.put.end": ("point", "the put succeeded: the key is tracked and receivers were woken [key]"),
    "shm.put.failed": ("note", "a put reported failure (storage or encoding error) [key, error]"),
    "shm.get.begin": ("point", "a non-blocking get looks for the key [key]"),
    "shm.get.locked": ("point", "the reader holds the key's lock file and is about to take the bytes [key]"),
    "shm.get.consumed": ("point", "the bytes were taken and the segment unlinked [key]"),
    "shm.get.unlocked": ("note", "the reader removed the consumed chunk's lock file (or it was no longer its) [key]"),
    "shm.get.corrupt": ("note", "a consumed payload was not a committed, intact frame: a corrupt chunk [key]"),
    "shm.cleanup.begin": ("point", "an exact-key cleanup starts [key]"),
    "shm.cleanup.unlinked": ("note", "a cleanup removed a segment that existed [key]"),
    "adapter.save_async": ("point", "the scheduler queued (or had refused) one chunk [ext, req, finished, accepted]"),
    "adapter.save_async.rejected": ("note", "work for an id whose previous generation drains was refused [ext, req]"),
    "adapter.send.begin": ("point", "the save task takes a chunk task of a generation [ext, gen, finished]"),
    "adapter.send.stale": ("note", "the task's generation no longer owns the id (or was cancelled) [ext, gen]"),
    "adapter.send.vetoed": ("note", "the pre-put check found the generation retired [ext, gen]"),
    "adapter.put": (
        "note",
        "the adapter hands a chunk to the connector; the key range is already bounded [ext, gen, key]",
    ),
    "adapter.cleanup_sender.begin": ("point", "cleanup_sender starts [ext]"),
    "adapter.cleanup_sender.end": ("point", "cleanup_sender returns (it never waits for I/O) [ext]"),
    "adapter.cleanup_shm.begin": ("point", "the save task reclaims a retired generation's keys [prefix, n, gen]"),
    "adapter.cleanup_shm.end": ("note", "that reclaim is done [prefix, gen]"),
    "adapter.release.begin": ("point", "the request-level final sweep starts on the save task [ext]"),
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
    "adapter.cleanup_receiver.begin": ("point", "cleanup_receiver starts [req]"),
    "adapter.cleanup_receiver.end": ("point", "cleanup_receiver returns [req]"),
    "orch.submit": ("point", "a client submits a request (before waiting out a reused id's sweep) [req]"),
    "orch.abort.begin": ("point", "the orchestrator starts aborting a request on every stage [req]"),
    "orch.abort.end": ("point", "the abort returned [req]"),
    "orch.fail": ("note", "the orchestrator failed a request (send failure, input deadline) [req, reason]"),
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
    "process.killed": ("note", "a simulated process was SIGKILLed: its tasks stop for good [process]"),
    "world.owner_died": ("note", "the owner of a namespace is dead (its process was killed) [ns]"),
    "scenario.shutdown.wait": ("point", "a scenario lets the engine run before it shuts it down in flight"),
    "kernel.block": ("note", "a task blocked on a held lock [on]"),
    "kernel.wait": ("note", "a task waits on a signal or sleeps [on]"),
    "kernel.crash": ("note", "a task died with an exception [error]"),
    "fault": ("note", "an injected fault fired [kind, at]"),
}
