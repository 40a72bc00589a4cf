"""What a connector answers its callers, checked against what it did (``answers-true``).

The adapter and upstream's callers act on a connector's answers: a put's result (``ok``, the
bytes it put, the metadata a get names the chunk by), a cleanup's whether it removed an unread
chunk, ``cleanup_prefix``'s count of those, a wait's whether its stage's wakeup generation
moved. A chunk a cleanup answered it removed must stay removed: no get that begins after the
answer hands it out (not even one a put in flight when the cleanup decided goes on to commit),
until a put places a new chunk of the key. A slip in an answer leaves the store as it should be,
so no check of the store sees it. A put or a get that raises what its contract never raises
(spec §2.1: a put answers, failed or not, and raises only for an invalid key; a get raises only
that, or a corrupt chunk) is a wrong answer too: its caller turns any exception into a failed
request, so a slip that crashes mid-put would otherwise pass for a storage failure. A put
that answers ok has placed its chunk: when it answers, the chunk is in a segment of ours or
committed on a ring of ours, unless a get or a cleanup of the key ran meanwhile, or the world
made a fault (a slip that loses the chunk would otherwise show only as a reader that waits).
Here every answer is compared with the truth, read with the harness's own code: for a cleanup,
from the store at its ``shm.cleanup.begin`` point, the moment it decides (nothing else runs
between that point and its removal, on the kernel's one thread): whether the key has a segment
of ours, or a frame on the ring of an edge the connector put on, unread or being written. Only an
answer that differs is noted (``connector.answer``), so a clean run's trace is what it was.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from invariants.dataplane import ring_retired, ring_unread_keys
from omnisim.sim_kernel import current_trace
from runtime.connectors.base import CorruptChunk, PutResult
from runtime.connectors.keys import InvalidKeyError
from runtime.connectors.ring import edge_name
from runtime.connectors.shm import ShmConnector
from runtime.connectors.stores import SegmentId, Store, StoreError
from runtime.kernel import current_kernel


@dataclass
class _Cleanup:
    """A cleanup in progress: whose and of what, and the truth once it decides."""

    connector: ShmConnector
    key: str
    #: The rings of the edges the connector put on.
    rings: set[str]
    unread: bool | None = None
    #: The edges whose rings held the key unread when the cleanup decided.
    unread_on: set[str] = field(default_factory=set)
    #: A segment the scenario planted stood at the key's name when the cleanup decided.
    planted_segment: bool = False
    #: The segment that stood at the key's name when the cleanup decided, if any.
    segment: SegmentId | None = None


class Answers:
    """The answers of a world's connectors. ``raw``: a connector's store without its process's
    handle; ``planted``: whether the scenario planted a name of a store's namespace (``seg-K``:
    a segment no put made); ``rings``: a store's rings of ours, by edge, with their bytes."""

    def __init__(
        self,
        raw: Callable[[Store], Store],
        planted: Callable[[Store, str], bool],
        rings: Callable[[Store], Iterator[tuple[str, memoryview]]],
    ) -> None:
        self._raw = raw
        self._planted = planted
        self._rings = rings
        #: The cleanup each trio task is in, and the cleanups a cleanup_prefix of it made.
        self._cleaning: dict[trio.lowlevel.Task, _Cleanup] = {}
        self._removed_by_prefix: dict[trio.lowlevel.Task, int] = {}
        #: Keys a cleanup answered it removed, with the answer's number, until a put places a
        #: new chunk of the key: no get that begins meanwhile may hand one out.
        self._removed_keys: dict[str, int] = {}
        self._answers = 0
        #: Per key: how often a put, a get or a cleanup of it began or ended, and those under
        #: way. Between a put's start and its answer, only another of them may take its chunk away.
        self._touches: Counter[str] = Counter()
        self._under_way: Counter[str] = Counter()

    def watch(self, connector: ShmConnector) -> None:
        """Check every answer ``connector`` gives from now on."""
        put, get, cleanup, cleanup_prefix = connector.put, connector.get, connector.cleanup, connector.cleanup_prefix
        wait_for_change = connector.wait_for_change
        sent_on: set[str] = set()

        async def answered_put(from_stage: str, to_stage: str, put_key: str, data: object) -> PutResult:
            sent_on.add(edge_name(from_stage, to_stage))
            trace = current_trace()
            with self._touching(put_key):
                touches, since = self._touches[put_key], len(trace)
                with _raising_only(f"the put of {put_key}"):  # (a put never raises: spec §2.1)
                    result = await put(from_stage, to_stage, put_key, data)
                # (the world's faults may take a chunk away too: a stray write that broke a
                # ring, a name unlinked under its owner)
                faulted = any(e.name == "fault" or e.name.startswith("fault.") for e in trace[since:])
                alone = self._touches[put_key] == touches and self._under_way[put_key] == 1 and not faulted
            _check(f"the put of {put_key}", _put_answer(result, put_key), "as it went")
            if result.ok and alone:
                _check(f"the put of {put_key}", "ok", self._placed(connector, put_key, result))
            return result

        async def answered_get(from_stage: str, to_stage: str, get_key: str, *args: Any, **kwargs: Any) -> Any:
            removed = self._removed_keys.get(get_key)
            with self._touching(get_key), _raising_only(f"the get of {get_key}", InvalidKeyError, CorruptChunk):
                got = await get(from_stage, to_stage, get_key, *args, **kwargs)
            if got is not None and removed is not None and self._removed_keys.get(get_key) == removed:
                # A get already under way when the cleanup decided may still take the chunk
                # (spec §2.5); one that began after it must find nothing.
                _check(
                    f"the cleanup of {get_key}, then a get of it",
                    "removed, yet the get took its chunk",
                    "removed, and the get found nothing",
                )
            return got

        async def answered_cleanup(key: str) -> bool:
            task = trio.lowlevel.current_task()
            asked = self._cleaning[task] = _Cleanup(connector, key, sent_on)
            try:
                with self._touching(key):
                    removed = await cleanup(key)
            finally:
                del self._cleaning[task]
            if asked.unread is not None:
                _check(f"the cleanup of {key}", f"removed: {removed}", f"removed: {self._removed(asked)}")
            if removed:
                self._answers += 1
                self._removed_keys[key] = self._answers
            if task in self._removed_by_prefix:
                self._removed_by_prefix[task] += removed
            return removed

        async def answered_cleanup_prefix(key_prefix: str) -> int:
            task = trio.lowlevel.current_task()
            self._removed_by_prefix[task] = 0
            try:
                count = await cleanup_prefix(key_prefix)
            finally:
                removed = self._removed_by_prefix.pop(task)
            _check(f"the cleanup of the keys {key_prefix}N", f"{count} removed", f"{removed} removed")
            return count

        async def answered_wait_for_change(
            generation: int, *, timeout: float, ready: Callable[[], bool] | None = None
        ) -> bool:
            changed = await wait_for_change(generation, timeout=timeout, ready=ready)
            now = connector.get_wakeup_generation()
            moved = now is not None and now != generation
            _check(f"a wait for a wakeup past generation {generation}", f"changed: {changed}", f"changed: {moved}")
            return changed

        connector.put = answered_put  # type: ignore[method-assign]
        connector.get = answered_get  # type: ignore[method-assign]
        connector.cleanup = answered_cleanup  # type: ignore[method-assign]
        connector.cleanup_prefix = answered_cleanup_prefix  # type: ignore[method-assign]
        connector.wait_for_change = answered_wait_for_change  # type: ignore[method-assign]

    @contextmanager
    def _touching(self, key: str) -> Iterator[None]:
        """A put, a get or a cleanup of ``key`` under way (counted as it begins and as it ends:
        one begun before a put may take or replace the put's chunk and end before it answers)."""
        self._touches[key] += 1
        self._under_way[key] += 1
        try:
            yield
        finally:
            self._under_way[key] -= 1
            self._touches[key] += 1

    def _placed(self, connector: ShmConnector, key: str, result: PutResult) -> str:
        """``ok`` if the chunk of a put that answered ``result`` (ok) is where it says, when nothing
        could take it away before the answer: the segment its metadata names at the key's name,
        or a committed frame of the key on a ring of ours that is not retired."""
        store = self._raw(connector.store)
        file = result.metadata["shm"].get("file")
        if file is not None:
            # (a look the world fails, as os_errors fails this process's calls, cannot tell)
            put_segment = (file[0], file[1])
            at_key = _segment_at(store, key, unreadable=put_segment)
            return "ok" if at_key == put_segment else "not place its chunk: its segment is gone"
        for _, view in self._rings(store):
            if key in ring_unread_keys(view, written=True) and not ring_retired(view):
                return "ok"
        return "not place its chunk: no committed frame of it is on a ring of ours, and no get or cleanup took it"

    def at_put_created(self, attrs: dict[str, Any]) -> None:
        """A put places a new chunk of its key: a get may hand that one out."""
        self._removed_keys.pop(str(attrs["key"]), None)

    def at_cleanup_begin(self, _task: object, attrs: dict[str, Any]) -> None:
        """A cleanup is about to decide: what is there for it to remove."""
        asked = self._cleaning.get(trio.lowlevel.current_task())
        if asked is not None and asked.key == attrs["key"]:
            asked.unread = self._unread(asked)

    def _unread(self, asked: _Cleanup) -> bool:
        store, key = self._raw(asked.connector.store), asked.key
        if store.segment_exists(key):
            if not self._planted(store, f"seg-{key}"):
                asked.segment = _segment_at(store, key)
                return True
            asked.planted_segment = True
        asked.unread_on = {e for e, view in self._rings(store) if e in asked.rings and key in ring_unread_keys(view)}
        return bool(asked.unread_on) or asked.planted_segment

    def _removed(self, asked: _Cleanup) -> bool:
        """What the cleanup removed, in truth: its unread chunk — unless the chunk was on a ring
        that is retired or gone by now (found corrupt, by a reader before or by the cleanup
        itself): lost with it, not removed. A segment the scenario planted is removed if it is gone
        now (one of ours a cleanup may take or leave; a foreign one it must leave, which other
        checks see to)."""
        store = self._raw(asked.connector.store)
        if not asked.unread_on and not asked.planted_segment:
            # (the segment that stood there is gone: a store may refuse to remove it)
            return bool(asked.unread) and _segment_at(store, asked.key) != asked.segment
        live = {edge for edge, view in self._rings(store) if not ring_retired(view)}
        removed = bool(asked.unread_on & live)
        return removed or (asked.planted_segment and not store.segment_exists(asked.key))


def _segment_at(store: Store, key: str, *, unreadable: SegmentId | None = None) -> SegmentId | None:
    """Which segment the name ``key`` holds now, if one (of ours); ``unreadable`` if the store
    fails the look."""
    try:
        segment = store.open_segment(key)
    except StoreError:
        return unreadable
    if segment is None:
        return None
    try:
        return segment.identity
    finally:
        segment.close()


def _put_answer(result: PutResult, key: str) -> str:
    """``as it went`` if ``result`` is what a put answers: the bytes it put and metadata naming
    the key if it succeeded, no bytes and the cause if it failed."""
    metadata = result.metadata or {}
    if result.ok:
        names = metadata.get("shm", {}).get("name") == key and metadata.get("size") == result.size
        return "as it went" if result.size > 0 and names else f"ok, {result.size} bytes, metadata {metadata}"
    error = metadata.get("error")
    return "as it went" if result.size == 0 and isinstance(error, str) and error else f"failed, {result.size} bytes"


@contextmanager
def _raising_only(what: str, *allowed: type[Exception]) -> Iterator[None]:
    """Note an exception out of the block that is neither ``allowed`` nor injected by the world."""
    try:
        yield
    except Exception as e:
        if isinstance(e, allowed) or hasattr(e, "injected_fault"):  # (a fault of the world's: see Fault.exception)
            raise
        names = "".join(f", or {kind.__name__}" for kind in allowed)
        _check(what, f"raised {type(e).__name__}: {e}", f"an answer{names}")
        raise


def _check(what: str, got: str, want: str) -> None:
    if got != want:
        current_kernel().note("connector.answer", what=what, got=got, want=want)
