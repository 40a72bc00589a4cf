"""ShmConnector: a stage edge over shared-memory segments with per-key lock files (spec §2.3–§2.10).

Who creates and who removes:

* the writer (``put``) creates the lock file, takes it, creates and fills the segment, releases the
  lock; the lock file stays;
* the reader (``get``) takes the lock without blocking, copies the payload out, unlinks the
  segment, and removes the lock file whenever it consumed the bytes, **whether or not they
  decoded** (#8082 / #4414);
* ``cleanup(key)`` removes exactly ``key`` (never a prefix) on the abort path;
* ``reap_consumed`` forgets, in bounded rotating sweeps, keys a consumer in another process took;
* ``close`` removes every key this connector still tracks.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from runtime.connectors.base import FAILED_PUT, PutResult
from runtime.connectors.keys import validate_key
from runtime.connectors.stores import LockFile, Segment, Store, StoreError
from runtime.connectors.wakeup import Wakeups
from runtime.connectors.wire import EncodedFrame, WireDecodeError, WireEncodeError, decode
from runtime.kernel import current_kernel

log = logging.getLogger(__name__)

#: Keys examined per reap sweep (spec §2.7): bounds the work, not the size of the pending set.
REAP_BUDGET = 64
#: The small sweep at the start of every put (L1).
PUT_REAP_BUDGET = 4
#: Back-off while another party holds a key's lock file (a reader holds it only briefly).
LOCK_RETRY_S = 0.001


class ShmConnector:
    """The shared-memory connector of one stage process."""

    def __init__(self, store: Store, *, stage_id: int = -1, wakeups: Wakeups | None = None) -> None:
        self.store = store
        self.stage_id = stage_id
        self._wakeups = wakeups
        self._pending_keys: OrderedDict[str, None] = OrderedDict()
        self._closed = False
        self._puts = 0
        self._gets = 0
        self._bytes = 0

    # -- put ---------------------------------------------------------------------------------

    async def put(self, from_stage: str, to_stage: str, put_key: str, data: object) -> PutResult:
        """Store ``data`` under ``put_key``, replacing unread data of the same key.

        Storage and encoding failures (a full /dev/shm included) return :data:`FAILED_PUT` and
        leave neither segment nor lock file. An invalid key raises :class:`InvalidKeyError`.
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
            return FAILED_PUT
        self._pending_keys[put_key] = None
        if self._wakeups is not None:
            self._wakeups.notify(to_stage)
        self._puts += 1
        self._bytes += frame.size
        await k.point("shm.put.end", key=put_key)
        return PutResult(True, frame.size, {"shm": {"name": put_key, "size": frame.size}, "size": frame.size})

    async def _write_locked(self, key: str, frame: EncodedFrame) -> None:
        # The lock file is taken *before* the segment exists and released only once it is
        # filled, so a non-blocking reader never observes a half-written payload.
        k = current_kernel()
        lock = await self._acquire_lock_file(key)
        try:
            await k.point("shm.put.locked", key=key)
            segment: Segment | None = None
            try:
                segment = self.store.create_segment(key, frame.size)
                await k.point("shm.put.created", key=key)
                created = segment
                await k.run_blocking(lambda: frame.write_to(created), cost=frame.size)
            except StoreError:
                if segment is not None:
                    self.store.unlink_segment(key)
                self.store.remove_lock(key)  # still holding it: no reader can be inside
                raise
            finally:
                if segment is not None:
                    segment.close()
            await k.point("shm.put.written", key=key)
        finally:
            lock.close()

    async def _acquire_lock_file(self, key: str) -> LockFile:
        """Create-or-open the key's lock file and take it. A reader that consumed the previous
        payload removes the lock file while holding it, so a lock won on a file that lost its
        name protects nothing: retry on the new file."""
        while True:
            lock = self.store.open_lock(key, create=True)
            assert lock is not None
            if lock.try_acquire() and lock.is_current():
                return lock
            lock.close()
            await current_kernel().sleep(LOCK_RETRY_S)

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
        """Take the payload of ``get_key`` if it is complete now; None otherwise or if it was corrupt.

        ``claim`` is asked once the key's lock is held and before anything is consumed: False
        leaves the payload where it is. A reader whose request was cleaned up while its get was
        in flight says no there, so it can never eat a chunk that a later generation of the
        same id wrote under the same key — no writer of the key can slip in between the answer
        and the consumption, in this process or another.
        """
        k = current_kernel()
        key = validate_key(self._resolve_key(get_key, metadata))
        await k.point("shm.get.begin", key=key)
        segment = self.store.open_segment(key)
        if segment is None:
            return None
        try:
            lock = self.store.open_lock(key, create=False)
        except StoreError:
            lock = None
        if lock is None or not lock.try_acquire() or (claim is not None and not claim()):
            segment.close()
            if lock is not None:
                lock.close()
            return None
        consumed = False
        error: Exception | None = None
        obj: Any = None
        size = segment.size
        try:
            await k.point("shm.get.locked", key=key)
            try:
                obj = await k.run_blocking(lambda: decode(segment), cost=size)
            except WireDecodeError as e:
                error = e
            segment.close()
            self.store.unlink_segment(key)
            consumed = True
            try:
                await k.point("shm.get.consumed", key=key)
            except WireDecodeError as e:
                error = e
        finally:
            if not consumed:
                segment.close()
            if consumed:
                self._remove_lock_after_read(key, lock, decoded=error is None)
            lock.close()
        if error is not None:
            log.warning("dropped undecodable payload of %s: %s", key, error)
            k.note("shm.get.decode_failed", key=key)
            return None
        self._pending_keys.pop(key, None)
        self._gets += 1
        return obj, size

    def _remove_lock_after_read(self, key: str, lock: LockFile, *, decoded: bool) -> None:
        """The bytes were taken and the segment unlinked: the lock file goes too, decoded or not
        (#8082 i; before, a falsy or undecodable payload leaked its lock file).

        It is removed while still held, and only if the name still refers to it: after the
        release, the name may already belong to the next writer of this key.
        """
        if lock.is_current():
            self.store.remove_lock(key)

    # -- cleanup and reap --------------------------------------------------------------------

    async def cleanup(self, key: str) -> bool:
        """Remove exactly ``key`` (segment and lock file); True if a segment was unlinked."""
        k = current_kernel()
        validate_key(key)
        await k.point("shm.cleanup.begin", key=key)
        self._pending_keys.pop(key, None)
        removed = self.store.unlink_segment(key)
        if removed:
            k.note("shm.cleanup.unlinked", key=key)
        self._remove_idle_lock(key)
        return removed

    def _remove_idle_lock(self, key: str) -> None:
        """Remove the key's lock file unless someone holds it. A holder is a reader, which
        removes the file itself once it consumed the bytes; removing a held file by name would
        let the next writer of the key create a new one and run unexcluded past that reader."""
        lock = self.store.open_lock(key, create=False)
        if lock is None:
            return
        try:
            if lock.try_acquire() and lock.is_current():
                self.store.remove_lock(key)
        finally:
            lock.close()

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
        and rotate those still unread to the back, so unread keys never starve the rest."""
        for _ in range(min(max_keys, len(self._pending_keys))):
            key, _ = self._pending_keys.popitem(last=False)
            if self.store.segment_exists(key):
                self._pending_keys[key] = None

    # -- wakeups, health, residue, close -----------------------------------------------------

    def get_wakeup_generation(self) -> int | None:
        if self._wakeups is None or self._closed or self.stage_id < 0:
            return None
        return self._wakeups.generation(str(self.stage_id))

    async def wait_for_change(self, generation: int, *, timeout: float) -> bool:
        if self._wakeups is None or self._closed:
            return False
        return await self._wakeups.wait_for_change(str(self.stage_id), generation, timeout=timeout)

    def health(self) -> dict[str, Any]:
        return {"status": "healthy", "puts": self._puts, "gets": self._gets, "bytes_transferred": self._bytes}

    def residue(self) -> dict[str, list[str]]:
        return {"pending_keys": list(self._pending_keys)}

    async def close(self) -> None:
        """Remove every tracked key, unread ones included. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for key in list(self._pending_keys):
            await self.cleanup(key)
        if self._wakeups is not None:
            self._wakeups.close()
