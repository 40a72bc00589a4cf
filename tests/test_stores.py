"""Store semantics shared by MemoryStore and PosixStore, plus the POSIX specifics."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator

import numpy as np
import posix_ipc
import pytest

from runtime.connectors.keys import MAX_KEY_LENGTH, InvalidKeyError
from runtime.connectors.posix_store import SHM_DIR, PosixStore
from runtime.connectors.stores import ForeignName, MemoryStore, Segment, Store, StoreError, StoreFull
from runtime.connectors.wakeup import FifoWakeups


@pytest.fixture(params=["memory", "posix"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    s: Store = MemoryStore() if request.param == "memory" else PosixStore()
    yield s
    s.sweep()


@pytest.fixture
def posix() -> Iterator[PosixStore]:
    s = PosixStore()
    yield s
    s.sweep()


def write_segment(store: Store, key: str, data: bytes) -> None:
    seg = store.create_segment(key)
    seg.reserve(len(data))
    seg.write(0, data)
    seg.close()


def read_segment(store: Store, key: str) -> bytes | None:
    seg = store.open_segment(key)
    if seg is None:
        return None
    try:
        return read_all(seg)
    finally:
        seg.close()


def read_all(seg: Segment) -> bytes:
    out = np.empty(seg.size, np.uint8)
    seg.read_into(0, out)
    return out.tobytes()


# -- segments --------------------------------------------------------------------------------


def test_create_open_unlink(store: Store) -> None:
    assert not store.segment_exists("k")
    assert store.open_segment("k") is None
    write_segment(store, "k", b"hello")
    assert store.segment_exists("k")
    assert store.segments() == ["k"]
    assert read_segment(store, "k") == b"hello"
    assert read_segment(store, "k") == b"hello"  # opening does not consume
    assert store.unlink_segment("k") is True
    assert store.unlink_segment("k") is False
    assert not store.segment_exists("k")
    assert store.open_segment("k") is None
    assert store.segments() == []


def test_created_segment_has_exact_size(store: Store) -> None:
    for size in (1, 63, 4096, 10_000):
        seg = store.create_segment(f"s{size}")
        assert seg.size == 0
        seg.reserve(size)
        assert seg.size == size
        seg.close()
        opened = store.open_segment(f"s{size}")
        assert opened is not None
        assert opened.size == size
        opened.close()


def test_create_replaces_existing_segment(store: Store) -> None:
    write_segment(store, "k", b"old-old-old")
    write_segment(store, "k", b"new")
    assert read_segment(store, "k") == b"new"
    assert store.segments() == ["k"]


def test_reader_mapping_survives_replace_and_unlink(store: Store) -> None:
    write_segment(store, "k", b"first")
    seg = store.open_segment("k")
    assert seg is not None
    write_segment(store, "k", b"second")
    assert read_all(seg) == b"first"
    store.unlink_segment("k")
    assert read_all(seg) == b"first"
    seg.close()


def test_open_missing_returns_none(store: Store) -> None:
    assert store.open_segment("missing") is None
    assert store.open_lock("missing", create=False) is None
    assert store.remove_lock("missing") is False
    assert store.unlink_segment("missing") is False
    assert store.lock_files() == []


def test_unsized_segment_opens_empty(store: Store) -> None:
    """A segment its writer never sized opens with size 0: the connector, holding the key's lock,
    knows whether that is a writer at work or one that died (a corrupt chunk)."""
    if isinstance(store, PosixStore):
        shm = posix_ipc.SharedMemory(store._shm_name("k"), posix_ipc.O_CREX, mode=0o600)
        shm.close_fd()
    else:
        store.create_segment("k").close()
    assert store.segment_exists("k")
    seg = store.open_segment("k")
    assert seg is not None and seg.size == 0
    seg.close()


def test_keys_are_independent(store: Store) -> None:
    for key in ("R_1_0", "R_1_0_0", "R_1_", "r_1_0"):
        write_segment(store, key, key.encode())
    store.unlink_segment("R_1_0")
    assert store.segments() == sorted(["R_1_0_0", "R_1_", "r_1_0"])
    for key in store.segments():
        assert read_segment(store, key) == key.encode()


# -- lock files ------------------------------------------------------------------------------


def test_lock_create_and_remove(store: Store) -> None:
    lock = store.open_lock("k", create=True)
    assert lock is not None
    assert store.lock_files() == ["k"]
    again = store.open_lock("k", create=False)
    assert again is not None
    again.close()
    lock.close()
    assert store.lock_files() == ["k"]  # closing does not remove the file
    assert store.remove_lock("k") is True
    assert store.remove_lock("k") is False
    assert store.open_lock("k", create=False) is None


def test_lock_is_exclusive_between_handles(store: Store) -> None:
    a = store.open_lock("k", create=True)
    b = store.open_lock("k", create=False)
    assert a is not None and b is not None
    assert a.try_acquire() is True
    assert b.try_acquire() is False
    assert b.try_acquire() is False
    a.release()
    assert b.try_acquire() is True
    assert a.try_acquire() is False
    b.close()  # closing releases
    assert a.try_acquire() is True
    a.close()


def test_release_without_holding_is_harmless(store: Store) -> None:
    a = store.open_lock("k", create=True)
    b = store.open_lock("k", create=True)
    assert a is not None and b is not None
    assert a.try_acquire()
    b.release()  # b never held it: must not free a's lock
    assert not b.try_acquire()
    a.close()
    b.close()
    b.close()  # idempotent


def test_locks_of_different_keys_are_independent(store: Store) -> None:
    a = store.open_lock("k1", create=True)
    b = store.open_lock("k2", create=True)
    assert a is not None and b is not None
    assert a.try_acquire() and b.try_acquire()
    a.close()
    b.close()


def test_lock_held_through_removed_name_does_not_block_new_lock(store: Store) -> None:
    old = store.open_lock("k", create=True)
    same_inode = store.open_lock("k", create=False)
    assert old is not None and same_inode is not None
    assert old.try_acquire()
    assert store.remove_lock("k") is True
    assert store.open_lock("k", create=False) is None
    new = store.open_lock("k", create=True)
    assert new is not None
    assert new.try_acquire() is True  # a new file is a new lock
    assert same_inode.try_acquire() is False  # the old inode is still locked by `old`
    old.close()
    assert same_inode.try_acquire() is True
    for lock in (new, same_inode):
        lock.close()


def test_sweep_removes_everything(store: Store) -> None:
    for i in range(3):
        write_segment(store, f"k{i}", b"x" * (i + 1))
        lock = store.open_lock(f"k{i}", create=True)
        assert lock is not None
        lock.close()
    held = store.open_lock("held", create=True)
    assert held is not None and held.try_acquire()
    owned = store.owner() is not None
    removed = store.sweep()
    assert len(removed) == 7 + owned
    assert store.segments() == []
    assert store.lock_files() == []
    assert store.sweep() == []
    held.close()


# -- MemoryStore specifics -------------------------------------------------------------------


def test_memory_store_capacity() -> None:
    s = MemoryStore(capacity=100)
    write_segment(s, "a", b"x" * 60)
    with pytest.raises(StoreFull):
        s.create_segment("b").reserve(41)
    s.unlink_segment("b")
    assert s.segments() == ["a"]
    write_segment(s, "b", b"y" * 40)  # exactly full
    with pytest.raises(StoreFull) as info:
        s.create_segment("c").reserve(1)
    s.unlink_segment("c")
    assert isinstance(info.value, StoreError)
    s.unlink_segment("a")
    write_segment(s, "c", b"z" * 60)
    write_segment(s, "c", b"w" * 60)  # replacing counts the old one as freed
    assert s.segments() == ["b", "c"]


def test_memory_store_namespaces_do_not_share_state() -> None:
    a, b = MemoryStore("a"), MemoryStore("b")
    write_segment(a, "k", b"1")
    assert b.open_segment("k") is None


# -- PosixStore specifics --------------------------------------------------------------------


def test_posix_names(posix: PosixStore) -> None:
    ns = posix.namespace
    write_segment(posix, "R_1_0", b"abc")
    lock = posix.open_lock("R_1_0", create=True)
    assert lock is not None
    lock.close()
    assert posix.segment_path("R_1_0") == f"{SHM_DIR}/omnisim-{ns}-seg-R_1_0"
    assert posix.lock_path("R_1_0") == f"{SHM_DIR}/omnisim-{ns}-lock-R_1_0"
    mine = sorted(n for n in os.listdir(SHM_DIR) if ns in n)
    assert mine == [f"omnisim-{ns}-lock-R_1_0", f"omnisim-{ns}-owner", f"omnisim-{ns}-seg-R_1_0"]
    assert all(n.startswith(f"omnisim-{ns}-") for n in mine)


def test_posix_default_namespace_is_fresh() -> None:
    a, b = PosixStore(), PosixStore()
    assert a.namespace != b.namespace
    write_segment(a, "k", b"a")
    assert b.open_segment("k") is None
    assert b.segments() == []
    assert a.sweep() == [f"omnisim-{a.namespace}-seg-k", f"omnisim-{a.namespace}-owner"]
    assert b.sweep() == [f"omnisim-{b.namespace}-owner"]


@pytest.mark.parametrize("namespace", ["UPPER", "with-dash", "a/b", "x" * 25, "..", "ns_1"])
def test_posix_rejects_bad_namespace(namespace: str) -> None:
    with pytest.raises(ValueError):
        PosixStore(namespace)


def test_posix_same_namespace_shares_state(posix: PosixStore) -> None:
    other = PosixStore(posix.namespace)  # attaches: it records no owner of its own
    write_segment(posix, "k", b"shared")
    assert read_segment(other, "k") == b"shared"
    assert other.unlink_segment("k") is True
    assert not posix.segment_exists("k")


def test_posix_modes_are_0600(posix: PosixStore) -> None:
    old_umask = os.umask(0)
    try:
        write_segment(posix, "k", b"data")
        lock = posix.open_lock("k", create=True)
        assert lock is not None
        lock.close()
    finally:
        os.umask(old_umask)
    for path in (posix.segment_path("k"), posix.lock_path("k")):
        st = os.stat(path)
        assert stat.S_ISREG(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)


def test_posix_lock_file_is_not_followed_through_symlink(posix: PosixStore, tmp_path: os.PathLike[str]) -> None:
    target = os.path.join(tmp_path, "target")
    with open(target, "w") as f:
        f.write("keep")
    os.symlink(target, posix.lock_path("k"))
    with pytest.raises(StoreError):
        posix.open_lock("k", create=True)
    with open(target) as f:
        assert f.read() == "keep"
    posix.sweep()
    assert os.path.islink(posix.lock_path("k")), "the sweep removed a name that is not ours"
    os.unlink(posix.lock_path("k"))


BAD_KEYS = ["a/b", "", "x" * 300, "..", ".", "a b", "k\x00", "é", "/abs", "x" * (MAX_KEY_LENGTH + 1)]


@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_posix_invalid_keys_raise(posix: PosixStore, key: str) -> None:
    with pytest.raises(InvalidKeyError):
        posix.create_segment(key)
    with pytest.raises(InvalidKeyError):
        posix.open_segment(key)
    with pytest.raises(InvalidKeyError):
        posix.unlink_segment(key)
    with pytest.raises(InvalidKeyError):
        posix.segment_exists(key)
    with pytest.raises(InvalidKeyError):
        posix.open_lock(key, create=True)
    with pytest.raises(InvalidKeyError):
        posix.remove_lock(key)
    assert posix.segments() == [] and posix.lock_files() == []


def test_posix_longest_key_fits_longest_namespace() -> None:
    s = PosixStore("n" * 24)  # attached, not claimed: nothing of its own to remove but what it makes
    key = "k" * MAX_KEY_LENGTH
    try:
        write_segment(s, key, b"long")
        lock = s.open_lock(key, create=True)
        assert lock is not None
        lock.close()
        assert read_segment(s, key) == b"long"
    finally:
        s.sweep()


@pytest.mark.parametrize("size", [1 << 50, (1 << 62) + 5])
def test_posix_absurd_size_is_store_full(posix: PosixStore, size: int) -> None:
    seg = posix.create_segment("huge")
    with pytest.raises(StoreFull) as info:
        seg.reserve(size)
    seg.close()
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.__cause__.errno in (errno.ENOSPC, errno.EFBIG)
    assert "/dev/shm is full" in str(info.value)


def test_posix_sweep_removes_wakeup_directory(posix: PosixStore) -> None:
    wakeups = FifoWakeups(posix.namespace)
    assert wakeups.generation("1") == 0
    assert os.path.isdir(wakeups.directory)
    write_segment(posix, "k", b"x")
    removed = posix.sweep()
    assert f"omnisim-{posix.namespace}-wake" in removed
    assert not os.path.exists(wakeups.directory)
    wakeups.close()
    assert not any(n.startswith(f"omnisim-{posix.namespace}-") for n in os.listdir(SHM_DIR))


# -- hostile names: refused, never used, followed or removed ------------------------------------

OTHER_UID = 4242


def _plant(path: str, how: str, tmp: str) -> None:
    """Put something that is not ours at ``path``."""
    if how == "symlink":
        target = os.path.join(tmp, "target")
        with open(target, "w") as f:
            f.write("keep")
        os.symlink(target, path)
    elif how == "foreign_owner":
        fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
        os.close(fd)
        os.chown(path, OTHER_UID, OTHER_UID)
    elif how == "mode_0666":
        fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
        os.fchmod(fd, 0o666)
        os.close(fd)
    elif how == "directory":
        os.mkdir(path, 0o700)
    else:
        raise AssertionError(how)


def _gone_or_untouched(path: str, how: str) -> None:
    assert os.path.lexists(path), f"the {how} at {path} was removed"
    if how == "symlink":
        with open(os.path.realpath(path)) as f:
            assert f.read() == "keep"


def _unplant(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        os.rmdir(path)
    else:
        os.unlink(path)


HOSTILE = ["symlink", "foreign_owner", "mode_0666", "directory"]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
@pytest.mark.parametrize("how", HOSTILE)
def test_a_hostile_lock_file_is_refused(posix: PosixStore, how: str, tmp_path: os.PathLike[str]) -> None:
    path = posix.lock_path("k")
    _plant(path, how, str(tmp_path))
    for create in (True, False):
        with pytest.raises(ForeignName):
            posix.open_lock("k", create=create)
    posix.sweep()
    _gone_or_untouched(path, how)
    _unplant(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
@pytest.mark.parametrize("how", HOSTILE)
def test_a_hostile_segment_is_refused(posix: PosixStore, how: str, tmp_path: os.PathLike[str]) -> None:
    path = posix.segment_path("k")
    _plant(path, how, str(tmp_path))
    with pytest.raises(ForeignName):
        posix.create_segment("k")
    with pytest.raises(ForeignName):
        posix.open_segment("k")
    posix.sweep()
    _gone_or_untouched(path, how)
    _unplant(path)


def test_every_handle_is_counted_until_it_is_closed(store: Store) -> None:
    segment = store.create_segment("R_1_0")
    segment.reserve(8)
    reader = store.open_segment("R_1_0")
    lock = store.open_lock("R_1_0", create=True)
    assert reader is not None and lock is not None
    assert store.open_handles() == ["lock R_1_0", "segment R_1_0", "segment R_1_0"]
    for handle in (segment, reader, lock):
        handle.close()
        handle.close()  # closing twice counts once
    assert store.open_handles() == []
    store.unlink_segment("R_1_0")
    store.remove_lock("R_1_0")
