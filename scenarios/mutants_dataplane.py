"""Mutants of the crash-safe data plane (omnisim issue 9): each undoes one of its rules.

Not here: "the commit marker is written first". With the checksum in the same trailer it is an
equivalent mutant — a writer killed between an early trailer and its body leaves a frame whose
CRC does not match its zeros, which the reader refuses exactly as it refuses an uncommitted one
(600 schedules of ``writer_crash``, random and PCT, found no difference). The commit marker and
the checksum are two defences of the same rule; the mutants below take away each one that has a
consequence of its own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from omnisim.registry import Patch, mutant
from runtime.connectors import namespaces, posix_store, shm, stores, wire
from runtime.connectors.namespaces import Owner, ProcessTable
from runtime.connectors.shm import LOCK_RETRY_MAX_S, ShmConnector
from runtime.connectors.stores import LockFile
from runtime.connectors.wakeup import LocalWakeups
from runtime.kernel import current_kernel
from runtime.transfer.receiver import ChunkReceiver as Receiver


@mutant(
    "checksum_not_checked",
    summary="frames carry no working checksum: bytes changed after the commit decode as the chunk",
    issue="omnisim issue 9 (checksums)",
    scenarios=("corrupt_chunk",),
    expect=("no-corrupt-accept",),
)
def checksum_not_checked() -> Iterator[Patch]:
    yield Patch(wire, "new_digest", _Unchecked)


class _Unchecked:
    """A checksum that is always 0: every frame's matches, whatever its bytes (and generation)."""

    def __init__(self, seed: int = 0) -> None:
        """(Nothing to seed.)"""

    def update(self, data: object) -> None:
        return None

    def intdigest(self) -> int:
        return 0


@mutant(
    "handle_names_the_file_only",
    summary="a get by a put's handle takes whatever frame the handle's file holds: once that put was read and a "
    "later put of its key reused the file (a spare), the old handle takes the later payload from its reader",
    issue="omnisim issue 13 (spares), found by an outside audit of the connector",
    scenarios=("hostile_keys_and_payloads",),
    expect=("bad-input-refused",),
)
def handle_names_the_file_only() -> Iterator[Patch]:
    yield Patch(shm, "_holds", lambda segment, put: not put.on_ring and segment.identity == put.file)


@mutant(
    "spare_keeps_its_commit",
    summary="a spare segment takes a key's name with the commit trailer of the frame it held: reused for the key "
    "it last carried (an id reused), its writer killed before it wrote a byte leaves the old generation's chunk "
    "there, whole, and the new generation's reader takes it",
    issue="omnisim issue 13 (reusable segments)",
    scenarios=("writer_crash_after_reuse",),
    expect=("no-corrupt-accept",),
)
def spare_keeps_its_commit() -> Iterator[Patch]:
    def nothing_made_uncommitted(size: int, generation: int) -> tuple[int, bytes]:
        return size, b""

    yield Patch(stores, "uncommitted_tail", nothing_made_uncommitted)
    yield Patch(posix_store, "uncommitted_tail", nothing_made_uncommitted)


@mutant(
    "overlapping_buffers_accepted",
    summary="the decoder lets buffer references overlap: a forged frame decodes into bytes nobody sent (and a "
    "1 MiB frame into gigabytes)",
    issue="omnisim issue 9 (decode safety)",
    scenarios=("corrupt_chunk",),
    expect=("no-corrupt-accept",),
)
def overlapping_buffers_accepted() -> Iterator[Patch]:
    yield Patch(wire._Refs, "check_disjoint", lambda self: None)


@mutant(
    "sweep_ignores_start_time",
    summary="the sweep takes a pid for its owner: a dead engine whose pid was reused looks alive, and what it "
    "left is never reclaimed",
    issue="omnisim issue 9 (owner-tracked namespaces)",
    scenarios=("sweep_vs_live_owner",),
    expect=("no-residue-after-sweep",),
)
def sweep_ignores_start_time() -> Iterator[Patch]:
    def owner_state(owner: Owner, processes: ProcessTable) -> str:
        return "alive" if processes.identity(owner.pid) is not None else "dead"

    yield Patch(namespaces, "owner_state", owner_state)


@mutant(
    "sweep_removes_live_namespace",
    summary="the sweep does not ask whether an owner lives: it removes a live engine's chunks under its feet",
    issue="omnisim issue 9 (owner-tracked namespaces)",
    scenarios=("sweep_vs_live_owner",),
    expect=("no-residue-after-sweep",),
)
def sweep_removes_live_namespace() -> Iterator[Patch]:
    yield Patch(namespaces, "owner_state", lambda owner, processes: "dead")


@mutant(
    "lock_wait_unbounded",
    summary="a put waits for a key's lock file for ever: a reader that hangs holding it hangs the writer too",
    issue="omnisim issue 9 (bounded waits)",
    scenarios=("stalled_reader",),
    expect=("bounded-wait",),
)
def lock_wait_unbounded() -> Iterator[Patch]:
    async def acquire(self: ShmConnector, key: str) -> LockFile:
        k = current_kernel()
        k.note("wait.begin", what="lock", key=key, limit_us=round(self.lock_timeout_s * 1e6))
        while True:  # no deadline
            lock = self.store.open_lock(key, create=True)
            assert lock is not None
            if lock.try_acquire() and lock.is_current():
                k.note("wait.end", what="lock", key=key)
                return lock
            lock.close()
            await k.sleep(LOCK_RETRY_MAX_S)

    yield Patch(ShmConnector, "_acquire_lock_file", acquire)


@mutant(
    "storage_error_not_rolled_back",
    summary="a put that meets a storage error leaves its lock file (and segment) behind",
    issue="omnisim issue 9 (every storage error a clean failure)",
    scenarios=("failed_put",),
    expect=("no-orphan-lock",),
)
def storage_error_not_rolled_back() -> Iterator[Patch]:
    yield Patch(ShmConnector, "_roll_back", lambda self, key, *, created: None)


@mutant(
    "producer_death_ignored",
    summary="a consumer never asks whether its producer lives: a request waiting on a dead stage waits for its "
    "input deadline (600 s) instead of failing within a second",
    issue="omnisim issue 9 (bounded waits)",
    scenarios=("writer_crash",),
    expect=("liveness", "bounded-wait"),
)
def producer_death_ignored() -> Iterator[Patch]:
    yield Patch(Receiver, "_fail_if_producer_died", lambda self: None)


@mutant(
    "segment_never_closed",
    summary="a segment's handle is never closed after its copy-in or copy-out: every chunk leaks a file "
    "descriptor, and a consumed segment's memory stays allocated while the process lives",
    issue="omnisim issue 11 (a blind spot the mutation score showed)",
    scenarios=("abort_during_put", "deserialize_failure"),
    expect=("no-leaked-handle",),
)
def segment_never_closed() -> Iterator[Patch]:
    yield Patch(stores._MemReader, "close", wire.BufferIO.close)
    yield Patch(posix_store._PosixSegment, "close", lambda self: None)


@mutant(
    "checksum_covers_padding",
    summary="the writer's checksum also covers the zero padding after the header, which the reader's does not: "
    "every chunk whose header is not aligned reads as corrupt, with nothing in the world to corrupt it",
    issue="omnisim issue 11 (a blind spot of the mutation score: a put that fails every get went unnoticed)",
    scenarios=("abort_during_put", "pipeline_requests"),
    expect=("failures-have-causes",),
)
def checksum_covers_padding() -> Iterator[Patch]:
    def checksum(self: wire.EncodedFrame, seed: int = 0) -> int:
        digest = wire.new_digest(seed)
        digest.update(self._head)
        for _, data in self._buffers:
            if data.nbytes:
                digest.update(data)
        return digest.intdigest()

    yield Patch(wire.EncodedFrame, "checksum", checksum)


@mutant(
    "wakeup_counts_nothing",
    summary="the wakeup bus neither counts a put nor wakes anyone: every receiver waiting for a chunk sits out "
    "its poll timeout, however soon the chunk was there",
    issue="omnisim issue 11 (a blind spot of the mutation score: a put that woke nobody went unnoticed)",
    scenarios=("pipeline_requests", "abort_during_put"),
    expect=("no-lost-wakeup",),
)
def wakeup_counts_nothing() -> Iterator[Patch]:
    yield Patch(LocalWakeups, "notify", lambda self, to_stage: None)


@mutant(
    "registration_never_pokes",
    summary="a registration (or a stop) rings only the receive loop's idle signal: a request registered while the "
    "loop waits for a put to its stage sits out that wait with its chunk already there",
    issue="omnisim issue 11 (found once waits said what they wait for: code2wav_stream)",
    scenarios=("code2wav_stream",),
    expect=("no-lost-wakeup",),
)
def registration_never_pokes() -> Iterator[Patch]:
    yield Patch(ShmConnector, "poke", lambda self: None)


@mutant(
    "spares_outlive_their_producer",
    summary="a spare segment is never removed, neither by its producer's close nor by a sweep: memory of a "
    "finished run stays in /dev/shm",
    issue="omnisim issue 13 (reusable segments)",
    scenarios=("writer_crash", "abort_during_put"),
    expect=("no-orphan-shm", "no-residue-after-sweep"),
)
def spares_outlive_their_producer() -> Iterator[Patch]:
    yield Patch(stores.MemoryStore, "remove_spare", lambda self, name: False)
    yield Patch(posix_store.PosixStore, "remove_spare", lambda self, name: False)


@mutant(
    "spares_never_give_way",
    summary="a full store keeps its spares: a put that needs their space or their names fails with /dev/shm full, "
    "though nothing unread fills it (the cache costs room)",
    issue="spec §2.2 (a full /dev/shm), omnisim issue 13 (reusable segments)",
    scenarios=("store_fills_up",),
    expect=("full-store-clean",),
)
def spares_never_give_way() -> Iterator[Patch]:
    yield Patch(stores.MemoryStore, "_drop_spares", lambda self: 0)
    yield Patch(posix_store.PosixStore, "_drop_spares", lambda self: 0)


def _regrant(self: Any) -> bool:
    self._held = posix_store._try_flock(self._fd)
    return self._held


@mutant(
    "lock_regranted_to_its_holder",
    summary="a lock file's handle that holds its flock is granted it again (flock re-grants to the same open file): "
    "two tasks of one process sharing the handle would both hold the key's lock, where the store in memory, and "
    "every simulated run on it, refuses the second",
    issue="omnisim issue 11 (the store model checked against the real store: this was the real store's code)",
    scenarios=("store_model_agrees",),
    expect=("store-model-faithful",),
)
def lock_regranted_to_its_holder() -> Iterator[Patch]:
    yield Patch(posix_store._PosixLock, "try_acquire", _regrant)


@mutant(
    "every_store_error_reads_as_full",
    summary="every failure of a system call the POSIX store makes is reported as a full /dev/shm: an operator frees "
    "space that is not short, and the real error (an I/O error) is never seen",
    issue="omnisim issue 9 (every storage error a clean failure, naming its cause)",
    scenarios=("os_errors",),
    expect=("os-errors-clean",),
    store="posix",
)
def every_store_error_reads_as_full() -> Iterator[Patch]:
    yield Patch(posix_store, "_store_error", lambda what, key, e: stores.StoreFull(key, 0, inodes=True))


_remove_all = namespaces._remove_all


@mutant(
    "sweep_reports_a_failure_twice",
    summary="a sweep's second look at a dead namespace tries again what it could not remove the first time: its "
    "report lists the same failure twice, as the sweep did before sweep_reports found it",
    issue="omnisim issue 9 (the sweep an operator runs), issue 11 (nothing read a sweep's report of errors)",
    scenarios=("sweep_reports",),
    expect=("sweep-reports-true",),
)
def sweep_reports_a_failure_twice() -> Iterator[Patch]:
    def remove_all(*args: Any) -> set[str]:
        _remove_all(*args)
        return set()

    yield Patch(namespaces, "_remove_all", remove_all)


@mutant(
    "sweep_looks_once",
    summary="a sweep does not look at a dead namespace again once it removed what it listed: the spare a live "
    "consumer hands back meanwhile is left behind",
    issue="omnisim issue 13 (reusable segments)",
    scenarios=("sweep_during_read",),
    expect=("no-residue-after-sweep",),
)
def sweep_looks_once() -> Iterator[Patch]:
    yield Patch(namespaces, "_made_meanwhile", lambda directory, namespace: [])


_health = ShmConnector.health


@mutant(
    "health_counts_ring_puts_twice",
    summary="a stage's health report counts a chunk put on the edge's ring twice, once as a put and once more "
    "among the ring's puts added on top: a dashboard shows more chunks sent than were",
    issue="omnisim issue 11 (a blind spot of the mutation score: nothing read the health counters)",
    scenarios=("ring_full_slow_consumer",),
    expect=("health-counts-true",),
    store="ring",
)
def health_counts_ring_puts_twice() -> Iterator[Patch]:
    def health(self: ShmConnector) -> dict[str, object]:
        report = _health(self)
        return report | {"puts": report["puts"] + report["ring_puts"]}

    yield Patch(ShmConnector, "health", health)


@mutant(
    "decoded_lists_as_tuples",
    summary="the decoder builds the payload with the fast unpacking of its first pass: lists arrive as tuples, and a "
    "chunk is not what was put, though every frame is",
    issue="omnisim issue 11 (a payload checked whole, not only its frames)",
    scenarios=("generation_merge",),
    expect=("no-corrupt-accept",),
)
def decoded_lists_as_tuples() -> Iterator[Patch]:
    unpack = wire._unpack

    def first_pass_unpack(header: memoryview, ext_hook: Any, *, exact: bool = True) -> Any:
        return unpack(header, ext_hook, exact=False)

    yield Patch(wire, "_unpack", first_pass_unpack)
