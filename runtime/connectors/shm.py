"""ShmConnector: a stage edge over shared-memory segments with per-key lock files (spec §2.3–§2.10).

Who creates and who removes:

* the writer (``put``) takes the key's lock file, creates the segment, reserves it, writes the
  frame and **commits it last** (the frame's trailer), then releases the lock; the lock file stays;
* the reader (``get``) takes the lock without blocking, copies the payload out, unlinks the
  segment, and removes the lock file whenever it consumed the bytes, **whether or not they
  decoded** (#8082 / #4414); bytes that are not a committed, intact frame — a writer killed
  mid-write, a zero-length or truncated segment, corrupt bytes — are a :class:`CorruptChunk`,
  never "not arrived yet";
* ``cleanup(key)`` removes exactly ``key`` (never a prefix) on the abort path;
* ``reap_consumed`` forgets, in bounded rotating sweeps, keys a consumer in another process took
  (and the lock file such a consumer may have left if it died before removing it);
* ``close`` removes every key this connector still tracks.

Nothing here waits without a bound (a lock file held by someone else is waited for at most
``lock_timeout_s``) and no storage error escapes as a raw exception: a put that meets one reports
failure with its cause and leaves nothing behind; a get never loses a payload it consumed.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from runtime.connectors.base import CorruptChunk, PutResult
from runtime.connectors.keys import validate_key
from runtime.connectors.stores import LockFile, Segment, Store, StoreError
from runtime.connectors.wakeup import Wakeups
from runtime.connectors.wire import EncodedFrame, FrameDecoder, WireDecodeError, WireEncodeError
from runtime.kernel import current_kernel

log = logging.getLogger(__name__)

#: Keys examined per reap sweep (spec §2.7): bounds the work, not the size of the pending set.
REAP_BUDGET = 64
#: The small sweep at the start of every put (L1).
PUT_REAP_BUDGET = 4
#: Back-off while another party holds a key's lock file (a reader holds it only while it copies
#: the payload out): 1 ms, doubling up to 50 ms.
LOCK_RETRY_S = 0.001
LOCK_RETRY_MAX_S = 0.05
#: The longest a put waits for a key's lock file before it fails.
LOCK_TIMEOUT_S = 10.0
#: From this size on a put computes the frame's checksum beside the copy, not after it.
PARALLEL_CHECKSUM_BYTES = 4 << 20


class LockTimeout(StoreError):
    """The key's lock file stayed held by someone else for longer than the put may wait."""


class ShmConnector:
    """The shared-memory connector of one stage process."""

    def __init__(
        self,
        store: Store,
        *,
        stage_id: int = -1,
        wakeups: Wakeups | None = None,
        lock_timeout_s: float = LOCK_TIMEOUT_S,
        upstream: Store | None = None,
        upstream_alive: Callable[[], bool] | None = None,
    ) -> None:
        """``store``: where this stage's puts go (its own namespace). ``upstream``: where the
        stage it receives from puts (default: the same store, stages of one process);
        ``upstream_alive`` says whether that producer still lives (default: it always does)."""
        self.store = store
        self.upstream = upstream if upstream is not None else store
        self._upstream_alive = upstream_alive
        self.stage_id = stage_id
        self.lock_timeout_s = lock_timeout_s
        self._wakeups = wakeups
        self._pending_keys: OrderedDict[str, None] = OrderedDict()
        #: Keys whose lock file this connector had to leave because someone held it (a reader
        #: in another process): removed by a later reap, once it is free.
        self._held_locks: dict[str, None] = {}
        self._closed = False
        self._puts = 0
        self._gets = 0
        self._bytes = 0

    # -- put ---------------------------------------------------------------------------------

    async def put(self, from_stage: str, to_stage: str, put_key: str, data: object) -> PutResult:
        """Store ``data`` under ``put_key``, replacing unread data of the same key.

        Storage and encoding failures (a full /dev/shm, a name that is not ours, a lock file
        held too long) return ``(False, 0, {"error": cause})`` and leave neither segment nor lock
        file. An invalid key raises :class:`InvalidKeyError`.
        """
        k = current_kernel()
        validate_key(put_key)
        try:
            await k.point("shm.put.begin", key=put_key)
            self.reap_consumed(max_keys=PUT_REAP_BUDGET)
            frame = EncodedFrame(data)
            await self._write_locked(put_key, frame)
        except (StoreError, WireEncodeError) as e:
            log.warning("put of %s failed: %s", put_key, e)
            k.note("shm.put.failed", key=put_key, error=type(e).__name__)
            return PutResult(False, 0, {"error": str(e)})
        self._pending_keys[put_key] = None
        if self._wakeups is not None:
            self._wakeups.notify(to_stage)
        self._puts += 1
        self._bytes += frame.size
        await k.point("shm.put.end", key=put_key)
        return PutResult(True, frame.size, {"shm": {"name": put_key, "size": frame.size}, "size": frame.size})

    async def _write_locked(self, key: str, frame: EncodedFrame) -> None:
        # The lock file is taken *before* the segment exists and released only once the frame is
        # committed, so a non-blocking reader never finds a writer at work; and the commit
        # trailer goes last, so a reader after a writer that died mid-frame finds no commit.
        k = current_kernel()
        lock = await self._acquire_lock_file(key)
        segment: Segment | None = None
        try:
            await k.point("shm.put.locked", key=key)
            segment = self.store.create_segment(key)
            await k.point("shm.put.created", key=key)
            created = segment
            created.reserve(frame.size)
            await k.point("shm.put.reserved", key=key)
            checksum = await self._write_body(frame, created)
            await k.point("shm.put.written", key=key)
            frame.commit(created, checksum)
            await k.point("shm.put.committed", key=key)
        except StoreError:
            self._roll_back(key, created=segment is not None)
            raise
        finally:
            if segment is not None:
                segment.close()
            lock.close()

    @staticmethod
    async def _write_body(frame: EncodedFrame, segment: Segment) -> int:
        """Copy the frame's body into the segment; its checksum. A large frame's checksum is
        computed beside the copy (it reads only the payload's memory), not after it."""
        k = current_kernel()
        if frame.size < PARALLEL_CHECKSUM_BYTES:
            return await k.run_blocking(lambda: (frame.write_body(segment), frame.checksum())[1], cost=frame.size)
        checksum: list[int] = []

        async def compute() -> None:
            checksum.append(await k.run_blocking(frame.checksum, cost=frame.size))

        async def copy() -> None:
            await k.run_blocking(lambda: frame.write_body(segment), cost=frame.size)

        async with k.task_group() as both:
            both.start_soon(compute, name="shm.put.checksum")
            both.start_soon(copy, name="shm.put.copy")
        return checksum[0]

    def _roll_back(self, key: str, *, created: bool) -> None:
        """Undo a failed put while still holding the key's lock (no reader can be inside)."""
        try:
            if created:
                self.store.unlink_segment(key)
            self.store.remove_lock(key)
        except StoreError as e:
            log.warning("rolling back the failed put of %s: %s", key, e)

    async def _acquire_lock_file(self, key: str) -> LockFile:
        """Create-or-open the key's lock file and take it, waiting at most ``lock_timeout_s``.

        A reader that consumed the previous payload removes the lock file while holding it, so a
        lock won on a file that lost its name protects nothing: retry on the new file."""
        k = current_kernel()
        deadline = k.now() + self.lock_timeout_s
        backoff = LOCK_RETRY_S
        waiting = False
        while True:
            lock = self.store.open_lock(key, create=True)
            assert lock is not None
            if lock.try_acquire() and lock.is_current():
                if waiting:
                    k.note("wait.end", what="lock", key=key)
                return lock
            lock.close()
            if not waiting:
                waiting = True
                k.note("wait.begin", what="lock", key=key, limit_us=round(self.lock_timeout_s * 1e6))
            if k.now() >= deadline:
                k.note("wait.end", what="lock", key=key)
                raise LockTimeout(f"the lock file of {key!r} stayed held for more than {self.lock_timeout_s:g}s")
            await k.sleep(backoff)
            backoff = min(backoff * 2, LOCK_RETRY_MAX_S)

    # -- get ---------------------------------------------------------------------------------

    @staticmethod
    def _resolve_key(get_key: str, metadata: dict[str, Any] | None) -> str:
        if isinstance(metadata, dict):
            if isinstance(metadata.get("get_key"), str):
                return metadata["get_key"]
            shm = metadata.get("shm")
            if isinstance(shm, dict) and isinstance(shm.get("name"), str):
                return shm["name"]
        return get_key

    async def get(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
        *,
        claim: Callable[[], bool] | None = None,
    ) -> tuple[Any, int] | None:
        """Take the payload of ``get_key`` if it is complete now; None if it has not arrived.

        Raises :class:`CorruptChunk` when the bytes taken were not a committed, intact frame
        (they are consumed all the same) or the key's names are not ours.

        ``claim`` is asked once the key's lock is held and before anything is consumed: False
        leaves the payload where it is. A reader whose request was cleaned up while its get was
        in flight says no there, so it can never eat a chunk that a later generation of the
        same id wrote under the same key — no writer of the key can slip in between the answer
        and the consumption, in this process or another.
        """
        k = current_kernel()
        key = validate_key(self._resolve_key(get_key, metadata))
        await k.point("shm.get.begin", key=key)
        try:
            lock = self.upstream.open_lock(key, create=False)
        except StoreError as e:
            raise CorruptChunk(key, str(e)) from None
        if lock is None:
            return None
        try:
            if not lock.try_acquire() or not lock.is_current():
                return None  # a writer is at work (or a reader just took it)
            try:
                segment = self.upstream.open_segment(key)
            except StoreError as e:
                raise CorruptChunk(key, str(e)) from None
            if segment is None or (claim is not None and not claim()):
                if segment is not None:
                    segment.close()
                return None
            obj, size, error = await self._consume(key, segment, lock)
        finally:
            lock.close()
        if error is not None:
            log.warning("dropped the corrupt chunk %s: %s", key, error)
            k.note("shm.get.corrupt", key=key)
            raise CorruptChunk(key, str(error))
        self._pending_keys.pop(key, None)
        self._gets += 1
        return obj, size

    async def _consume(self, key: str, segment: Segment, lock: LockFile) -> tuple[Any, int, Exception | None]:
        """Copy the payload out, then remove the segment and lock file — decoded or not."""
        k = current_kernel()
        size = segment.size
        obj: Any = None
        error: Exception | None = None
        try:
            await k.point("shm.get.locked", key=key)
            try:
                obj = await self._decode(segment)
            except WireDecodeError as e:
                error = e
        finally:
            segment.close()
        try:
            self.upstream.unlink_segment(key)
        except StoreError as e:
            log.warning("could not remove the consumed segment %s: %s", key, e)
        try:
            try:
                await k.point("shm.get.consumed", key=key)
            except WireDecodeError as e:
                error = e
        finally:
            self._remove_lock_after_read(key, lock)
        return obj, size, error

    @staticmethod
    async def _decode(segment: Segment) -> Any:
        """Decode a segment's frame. For a large one the checksum of the segment's bytes is
        computed beside the copy of them, not after it (both hold the key's lock: the bytes
        cannot change in between)."""
        k = current_kernel()
        decoder = FrameDecoder(segment)  # the header: small, checked before anything is allocated
        if decoder.nbytes < PARALLEL_CHECKSUM_BYTES:
            return await k.run_blocking(decoder.decode, cost=decoder.nbytes)
        checksum: list[int] = []

        async def compute() -> None:
            checksum.append(await k.run_blocking(decoder.checksum, cost=decoder.nbytes))

        async def copy() -> None:
            await k.run_blocking(decoder.read, cost=decoder.nbytes)

        async with k.task_group() as both:
            both.start_soon(compute, name="shm.get.checksum")
            both.start_soon(copy, name="shm.get.copy")
        return decoder.finish(checksum[0])

    def _remove_lock_after_read(self, key: str, lock: LockFile) -> None:
        """The bytes were taken and the segment unlinked: the lock file goes too, decoded or not
        (#8082 i; before, a falsy or undecodable payload leaked its lock file).

        It is removed while still held, and only if the name still refers to it: after the
        release, the name may already belong to the next writer of this key. A failure to
        remove it loses nothing: the payload is returned all the same.
        """
        try:
            if lock.is_current():
                self.upstream.remove_lock(key)
            current_kernel().note("shm.get.unlocked", key=key)
        except StoreError as e:
            log.warning("could not remove the lock file of the consumed chunk %s: %s", key, e)

    # -- cleanup and reap --------------------------------------------------------------------

    async def cleanup(self, key: str) -> bool:
        """Remove exactly ``key`` (segment and lock file); True if a segment was unlinked."""
        k = current_kernel()
        validate_key(key)
        await k.point("shm.cleanup.begin", key=key)
        self._pending_keys.pop(key, None)
        try:
            removed = self.store.unlink_segment(key)
        except StoreError as e:
            log.warning("cleanup of %s: %s", key, e)
            removed = False
        if removed:
            k.note("shm.cleanup.unlinked", key=key)
        self._remove_idle_lock(key)
        return removed

    def _remove_idle_lock(self, key: str) -> None:
        """Remove the key's lock file unless someone holds it. A holder is a reader, which
        removes the file itself once it consumed the bytes; removing a held file by name would
        let the next writer of the key create a new one and run unexcluded past that reader.
        A held file is looked at again by later reaps (its holder may die without removing it)."""
        try:
            lock = self.store.open_lock(key, create=False)
            if lock is None:
                self._held_locks.pop(key, None)
                return
            try:
                if lock.try_acquire() and lock.is_current():
                    self.store.remove_lock(key)
                    self._held_locks.pop(key, None)
                else:
                    self._held_locks[key] = None
            finally:
                lock.close()
        except StoreError as e:
            log.warning("could not remove the idle lock file of %s: %s", key, e)

    async def cleanup_prefix(self, key_prefix: str) -> int:
        """Clean up the tracked keys ``key_prefix + digits`` (``R_1_`` matches ``R_1_12``, not
        ``R_1_2_0``, which belongs to request ``R_1_2``). Never scans the directory."""
        matching = [
            key for key in self._pending_keys if key.startswith(key_prefix) and key[len(key_prefix) :].isdigit()
        ]
        removed = 0
        for key in matching:
            removed += await self.cleanup(key)
        return removed

    def reap_consumed(self, *, max_keys: int = REAP_BUDGET) -> None:
        """Examine at most ``max_keys`` of the oldest tracked keys; forget those already consumed
        (and the lock file a consumer that died before removing it left) and rotate those still
        unread to the back, so unread keys never starve the rest."""
        for _ in range(min(max_keys, len(self._pending_keys))):
            key, _ = self._pending_keys.popitem(last=False)
            if self.store.segment_exists(key):
                self._pending_keys[key] = None
            else:
                self._remove_idle_lock(key)
        for key in list(self._held_locks)[:max_keys]:
            if key not in self._pending_keys and not self.store.segment_exists(key):
                self._remove_idle_lock(key)

    # -- wakeups, health, residue, close -----------------------------------------------------

    def _wakeup_stage(self) -> str | None:
        """This receiver's stage as wakeups name it; None (keep polling) for a stage id that is
        not a non-negative int, as upstream's connector accepts any stage id at its API edge."""
        if self._wakeups is None or self._closed or not isinstance(self.stage_id, int) or self.stage_id < 0:
            return None
        return str(self.stage_id)

    def get_wakeup_generation(self) -> int | None:
        stage = self._wakeup_stage()
        return None if stage is None or self._wakeups is None else self._wakeups.generation(stage)

    async def wait_for_change(self, generation: int, *, timeout: float) -> bool:
        stage = self._wakeup_stage()
        if stage is None or self._wakeups is None:
            return False
        return await self._wakeups.wait_for_change(stage, generation, timeout=timeout)

    def producer_alive(self) -> bool:
        """Whether the stage this one receives from still lives (a dead one sends nothing more)."""
        return self._upstream_alive is None or self._upstream_alive()

    def health(self) -> dict[str, Any]:
        return {"status": "healthy", "puts": self._puts, "gets": self._gets, "bytes_transferred": self._bytes}

    def residue(self) -> dict[str, list[str]]:
        return {"pending_keys": list(self._pending_keys), "held_locks": list(self._held_locks)}

    async def close(self) -> None:
        """Remove every tracked key, unread ones included. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for key in list(self._pending_keys):
            await self.cleanup(key)
        if self._wakeups is not None:
            self._wakeups.close()
