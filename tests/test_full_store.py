"""A store with little room: the spares give way for space and for names, and a full one fails
a put cleanly. On POSIX, in a private tmpfs that the kernel fills for real (needs root)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import pytest

from omnisim import explore, registry, tmpfs
from omnisim.base import UsageError
from omnisim.cli import check_plans
from runtime.connectors.posix_store import PosixStore
from runtime.connectors.stores import MemoryStore, Store, StoreFull

#: Four pages of space, and a few names: the owner record, a folder and four more.
ROOM_BYTES, ROOM_NAMES = 4 * 4096, 5

registry.load()

needs_tmpfs = pytest.mark.skipif(tmpfs.why_unavailable() is not None, reason=str(tmpfs.why_unavailable()))


@pytest.fixture(params=["memory", pytest.param("posix", marks=needs_tmpfs)])
def small(request: pytest.FixtureRequest) -> Iterator[Store]:
    if request.param == "memory":
        yield MemoryStore(capacity=ROOM_BYTES, max_names=ROOM_NAMES - 1, spare_min_bytes=0)
        return
    path = tmpfs.mount(ROOM_BYTES, ROOM_NAMES + 1)
    try:
        store = PosixStore(directory=path, spare_min_bytes=0)
        yield store
        store.sweep()
    finally:
        tmpfs.unmount(path)


def put(store: Store, key: str, size: int) -> None:
    segment = store.create_segment(key)
    try:
        segment.reserve(size)
    finally:
        segment.close()


def test_spares_give_way_for_names(small: Store) -> None:
    for key in ("a", "b", "c"):
        put(small, key, 64)
    for key in ("a", "b", "c"):
        small.retire_segment(key)
    assert len(small.spares()) == 3
    # Three spares and the owner fill the names: a lock file still gets one.
    lock = small.open_lock("d", create=True)
    assert lock is not None
    lock.close()
    assert small.lock_files() == ["d"]


def test_spares_give_way_for_space(small: Store) -> None:
    put(small, "a", 4096)
    small.retire_segment("a")
    assert small.spares() == ["a"]
    put(small, "b", 3 * 4096 - 64)  # the spare grows as far as it can, then gives way
    assert small.segments() == ["b"]


def test_a_full_store_refuses_a_reservation_cleanly(small: Store) -> None:
    put(small, "a", 2 * 4096)
    with pytest.raises(StoreFull, match="/dev/shm is full"):
        put(small, "b", 3 * 4096)


def test_a_scenario_that_cannot_run_here_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    scenario = dataclasses.replace(
        registry.SCENARIOS["store_fills_up"], unavailable=lambda store: None if store == "memory" else "no mount here"
    )
    monkeypatch.setitem(registry.SCENARIOS, "store_fills_up", scenario)
    assert {store for _, store, _, _ in check_plans(scenario, 8, ["memory", "posix", "ring"])} == {"memory"}
    with pytest.raises(UsageError, match="no mount here"):
        explore.run("store_fills_up", store="posix")


@needs_tmpfs
def test_a_dead_harness_mount_is_reclaimed() -> None:
    path = tmpfs.mount(4096, 4)
    dead = path.replace(f"omnisim-tmpfs-{os.getpid()}-", "omnisim-tmpfs-999999999-")
    os.mkdir(dead)
    try:
        assert tmpfs._libc.mount(b"tmpfs", dead.encode(), b"tmpfs", 0, b"size=4096") == 0
        assert tmpfs.reclaim_stale() == [dead]  # this process's own mount stays
        assert not os.path.exists(dead) and os.path.ismount(path)
    finally:
        tmpfs.unmount(path)
        if os.path.ismount(dead):
            tmpfs.unmount(dead)


def test_a_consumed_segment_goes_even_with_no_name_left_for_a_spare(small: Store) -> None:
    for key in ("a", "b"):
        put(small, key, 64)
        lock = small.open_lock(key, create=True)
        assert lock is not None
        lock.close()
    # Every name is taken (on a tmpfs a link takes one too): no spare can be kept.
    assert small.retire_segment("a") is True
    assert "a" not in small.segments()
