"""A ring's head and tail move only under its lock (``ring-writes-locked``).

A ring's producer moves its head (reserving a frame) and whoever releases finished frames moves
its tail, each with the ring's lock held: across processes, two writers of one word without it
lose an update (two puts reserve the same space; a release undoes another's). The simulator runs
one task at a time, so a section that skips the lock still runs whole, and no outcome shows the
lock missing. The words themselves show it: every handle on a ring of the world's stores is
watched as it takes the lock and lets it go, and whenever anyone takes the lock the ring's head
and tail must be as its last holder left them (and at quiescence, when nobody holds it). A change
in between was made by someone who did not hold the lock.

A writer that goes on without the lock while a reader holds it (a reader stopped mid-copy holds it
for as long as it is stopped) writes inside the reader's hold, where the two checks above cannot
see it: whatever the reader leaves counts as left by a holder. But a reader never reserves a
frame, so the head moving while a reader holds the lock was someone else's write.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from typing import Any

from runtime.connectors.stores import RingMemory, Store, StoreError
from runtime.kernel import current_kernel

#: Where a ring's head and tail are (see :mod:`runtime.connectors.ring`): two u64 from byte 16.
_WORDS = struct.Struct("<QQ")
_WORDS_AT = 16


def _file_of(handle: Any) -> int:
    """Which ring ``handle`` is on: the same for every handle on one ring, in any process (a ring
    made anew under the same name is another)."""
    inode = getattr(handle, "_inode", None)  # (a ring in memory)
    return id(inode) if inode is not None else os.fstat(handle._fd).st_ino


class RingLocks:
    """The rings of a world's stores: for each, its head and tail as the last holder of its lock
    left them, and the handles that hold it now (with the head and tail as each found them)."""

    def __init__(self) -> None:
        self._left: dict[int, tuple[str, tuple[int, int]]] = {}
        #: Each handle holding a lock now: its ring, and the head and tail as it found them.
        self._holders: dict[int, tuple[int, tuple[int, int]]] = {}
        self._watched: dict[type, type] = {}

    def watch(self, store: Store) -> None:
        """Watch every ring handle ``store`` gives out from now on."""
        for name in ("create_ring", "open_ring"):
            setattr(store, name, self._watching(getattr(store, name), made=name == "create_ring"))

    def _watching(self, give: Callable[[str], RingMemory | None], *, made: bool) -> Callable[..., RingMemory | None]:
        def watched(edge: str, *args: Any) -> RingMemory | None:
            handle = give(edge, *args)
            if handle is not None:
                handle.__class__ = self._watched_class(type(handle))
                handle._locks_edge = edge  # type: ignore[attr-defined]
                handle._locks_reader = not made  # type: ignore[attr-defined]
                if made or _file_of(handle) not in self._left:
                    self._left[_file_of(handle)] = (edge, _words(handle))
            return handle

        return watched

    def _watched_class(self, cls: type) -> type:
        if cls not in self._watched:
            locks = self

            class Watched(cls):  # type: ignore[misc, valid-type]
                def try_lock(self) -> bool:
                    taken = super().try_lock()
                    if taken:
                        locks._taken(self)
                    return taken

                def unlock(self) -> None:
                    if id(self) in locks._holders:
                        locks._let_go(self)
                    super().unlock()

            Watched.__name__ = f"Watched{cls.__name__}"
            self._watched[cls] = Watched
        return self._watched[cls]

    def _taken(self, handle: Any) -> None:
        ring, now = _file_of(handle), _words(handle)
        self._holders[id(handle)] = (ring, now)
        self._check(ring, now, "taken")

    def _let_go(self, handle: Any) -> None:
        (ring, found), now = self._holders.pop(id(handle)), _words(handle)
        if handle._locks_reader and now[0] != found[0]:
            current_kernel().note(
                "ring.unlocked_write",
                edge=handle._locks_edge,
                when="let go by a reader (which never moves the head)",
                left=str(found),
                found=str(now),
            )
        self._left[ring] = (handle._locks_edge, now)

    def _check(self, ring: int, now: tuple[int, int], when: str) -> None:
        edge, left = self._left[ring]
        if now != left:
            current_kernel().note("ring.unlocked_write", edge=edge, when=when, left=str(left), found=str(now))
            self._left[ring] = (edge, now)

    def held(self, handle: RingMemory) -> bool:
        """Whether anyone holds the lock of the ring ``handle`` is on."""
        ring = _file_of(handle)
        return any(held == ring for held, _ in self._holders.values())

    def check_idle(self, stores: list[Store]) -> None:
        """At quiescence, nobody holding a lock: every ring of ``stores`` as its last holder left it."""
        for store in stores:
            for edge in store.rings():
                try:
                    handle = store.open_ring(edge)
                except StoreError:
                    continue  # (a name a scenario planted there: no ring of ours)
                if handle is not None:
                    try:
                        if not self._holders:
                            self._check(_file_of(handle), _words(handle), "looked at, at quiescence")
                    finally:
                        handle.close()


def _words(handle: Any) -> tuple[int, int]:
    return _WORDS.unpack_from(handle.view, _WORDS_AT)
