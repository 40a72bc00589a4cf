"""Store semantics shared by MemoryStore and PosixStore, plus the POSIX specifics."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator

import numpy as np
import posix_ipc
import pytest
import torch
from conftest import make_sparse

from runtime.connectors.keys import MAX_KEY_LENGTH, InvalidKeyError
from runtime.connectors.namespaces import Owner, ShmDirectory
from runtime.connectors.posix_store import SHM_DIR, PosixStore
from runtime.connectors.stores import (
    SPARES_KEPT,
    ForeignName,
    MemoryStore,
    Segment,
    Store,
    StoreError,
    StoreFull,
    choose_spare,
)
from runtime.connectors.wakeup import FifoWakeups
from runtime.connectors.wire import EncodedFrame, WireDecodeError, decode, encode, frame_seed


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


def test_an_unlink_of_one_segment_leaves_another_of_the_same_name(store: Store) -> None:
    """What a cleanup of an old put relies on: the name's newer segment is not the one it made."""
    first = store.create_segment("k")
    first.reserve(8)
    old = first.identity
    first.close()
    second = store.create_segment("k")
    second.reserve(8)
    assert second.identity != old
    assert store.unlink_segment("k", only=old) is False
    assert store.segments() == ["k"]
    assert store.unlink_segment("k", only=second.identity) is True
    assert store.unlink_segment("k", only=second.identity) is False
    second.close()


def test_a_segment_made_of_a_spare_is_another_segment(spare_store: Store) -> None:
    made = spare_store.create_segment("R_1_0")
    made.reserve(200)
    made.close()
    spare_store.retire_segment("R_1_0")
    before = spare_store.create_segment("R_1_0")
    empty = before.identity
    before.reserve(200)  # takes the spare
    assert spare_store.spares() == []
    assert before.identity != empty
    assert spare_store.unlink_segment("R_1_0", only=empty) is False
    assert spare_store.unlink_segment("R_1_0", only=before.identity) is True
    before.close()


def test_a_spare_reused_is_the_same_file_and_its_frames_count_on(spare_store: Store) -> None:
    """A spare renamed onto a key keeps its identity (as a tmpfs rename keeps the inode), so the
    generation its next frame commits, one more than its last frame's, is what tells the frames
    apart — also after a writer that died before its commit: it used its number up (else the next
    frame would repeat an earlier one's generation, and a stale handle would find it)."""
    frames = []
    for i in range(3):
        made = spare_store.create_segment("R_1_0")
        frame = EncodedFrame(bytes(300 + i))
        made.reserve(frame.size)
        frame.write_body(made)
        frame.commit(made, frame.checksum(frame_seed("R_1_0", made.generation)), made.generation)
        frames.append((made.identity, made.generation))
        made.close()
        spare_store.retire_segment("R_1_0")
    assert [identity for identity, _ in frames] == [frames[0][0]] * 3
    assert [generation for _, generation in frames] == [0, 1, 2]
    made = spare_store.create_segment("R_1_0")
    made.reserve(300)  # (its writer dies here: the frame is never committed)
    assert made.generation == 3
    made.close()
    spare_store.retire_segment("R_1_0")
    again = spare_store.create_segment("R_1_0")
    again.reserve(300)
    assert (again.identity, again.generation) == (frames[0][0], 4)
    again.close()


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
        # Made by shm_open itself: the store opens what POSIX shared memory makes, by its name.
        shm = posix_ipc.SharedMemory("/" + os.path.basename(store.segment_path("k")), posix_ipc.O_CREX, mode=0o600)
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
    assert a.try_acquire() is False  # (flock would grant it again: another task may share the handle)
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


def test_memory_store_counts_room_as_a_tmpfs_does() -> None:
    """Whole pages, the owner record's page and name included; a name removed under an open
    handle keeps its room until the handle closes; a spare's link needs a name of its own
    (``store_model_agrees`` checks the same against a real tmpfs)."""
    page = 4096
    s = MemoryStore(capacity=8 * page, max_names=4, page=page, owner=Owner(1, 1, "sim"), spare_min_bytes=1)
    assert (s.used(), s.names_used()) == (page, 1)
    write_segment(s, "a", b"x")  # one byte takes a page
    assert (s.used(), s.names_used()) == (2 * page, 2)
    reader = s.open_segment("a")
    assert reader is not None
    assert s.unlink_segment("a") is True
    assert (s.used(), s.names_used()) == (2 * page, 2)  # its reader still holds it
    reader.close()
    assert (s.used(), s.names_used()) == (page, 1)
    write_segment(s, "b", b"y")
    write_segment(s, "c", b"z")
    write_segment(s, "d", b"w")
    assert s.names_used() == 4
    assert s.retire_segment("d") is True
    assert s.spares() == []  # no name was left for the spare's link
    assert s.retire_segment("c") is True
    assert s.spares() == ["c"]


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
    with pytest.raises(ForeignName):
        posix.unlink_segment("k")  # (a cleanup of a key whose chunk went on the ring looks here too)
    assert os.path.lexists(path)
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


# -- spares: consumed segments a producer's next put reuses ----------------------------------

SPARE_MIN = 64


@pytest.fixture(params=["memory", "posix"])
def spare_store(request: pytest.FixtureRequest) -> Iterator[Store]:
    s: Store = (
        MemoryStore(spare_min_bytes=SPARE_MIN) if request.param == "memory" else PosixStore(spare_min_bytes=SPARE_MIN)
    )
    yield s
    s.sweep()


def test_choose_spare_takes_the_smallest_that_fits_else_the_largest() -> None:
    sizes = {"a": 100, "b": 300, "c": 200}
    assert choose_spare(sizes, 150) == "c"
    assert choose_spare(sizes, 200) == "c"
    assert choose_spare(sizes, 400) == "b"
    assert choose_spare({}, 10) is None


def test_a_consumed_segment_becomes_a_spare_the_next_segment_takes(spare_store: Store) -> None:
    old = bytes(range(200))
    write_segment(spare_store, "R_1_0", old)
    assert spare_store.retire_segment("R_1_0")
    assert spare_store.segments() == [] and spare_store.spares() == ["R_1_0"]
    new = spare_store.create_segment("R_1_1")
    new.reserve(200)
    assert spare_store.spares() == [] and spare_store.segments() == ["R_1_1"]
    assert new.size == 200
    new.close()
    got = read_segment(spare_store, "R_1_1")
    assert got is not None and len(got) == 200
    # The old bytes stay where the new frame has not written yet, but never its commit trailer:
    # no commit magic, checksum or length, only the generation the new frame will commit.
    assert got[:176] == old[:176] and got[176:180] == bytes(4) and got[184:] == bytes(16)
    assert int.from_bytes(got[180:184], "little") == (int.from_bytes(old[180:184], "little") + 1) % (1 << 32)


@pytest.mark.parametrize("size", [120, 200, 300])
def test_a_reused_segment_never_reads_as_a_committed_frame(spare_store: Store, size: int) -> None:
    """A frame as large as the new one, smaller, or larger: until its writer commits, the
    segment a spare became reads as uncommitted, whatever the spare held."""
    frame = encode({"x": torch.arange(20)})
    write_segment(spare_store, "R_1_0", frame)
    assert decode(read_segment(spare_store, "R_1_0") or b"")["x"].tolist() == list(range(20))
    spare_store.retire_segment("R_1_0")
    segment = spare_store.create_segment("R_1_1")
    segment.reserve(len(frame) if size == 200 else size)
    segment.close()
    assert spare_store.spares() == []
    with pytest.raises(WireDecodeError, match="uncommitted"):
        decode(read_segment(spare_store, "R_1_1") or b"")


def test_a_spare_grows_with_zeros(spare_store: Store) -> None:
    write_segment(spare_store, "a", b"\xff" * 100)
    spare_store.retire_segment("a")
    write_segment(spare_store, "b", b"\x01" * 300)
    assert read_segment(spare_store, "b") == b"\x01" * 300
    assert spare_store.spares() == []


def test_small_segments_and_those_past_the_pool_are_removed(spare_store: Store) -> None:
    write_segment(spare_store, "small", b"x" * (SPARE_MIN - 1))
    assert spare_store.retire_segment("small")
    assert spare_store.spares() == [] and spare_store.segments() == []
    for i in range(SPARES_KEPT + 2):
        write_segment(spare_store, f"k{i}", b"x" * 100)
    for i in range(SPARES_KEPT + 2):
        assert spare_store.retire_segment(f"k{i}")
    assert spare_store.segments() == []
    assert spare_store.spares() == [f"k{i}" for i in range(SPARES_KEPT)]
    assert not spare_store.retire_segment("k0")  # gone already


def test_a_spare_is_never_replaced_by_one_of_its_name(spare_store: Store) -> None:
    write_segment(spare_store, "R_1_0", b"a" * 100)
    spare_store.retire_segment("R_1_0")
    spare_store.spare_min_bytes = 1 << 30  # (so the next one takes no spare)
    write_segment(spare_store, "R_1_0", b"b" * 150)  # the id is reused: the same key again
    spare_store.spare_min_bytes = SPARE_MIN
    assert spare_store.retire_segment("R_1_0")
    assert spare_store.spares() == ["R_1_0"] and spare_store.segments() == []
    segment = spare_store.create_segment("next")
    segment.reserve(100)  # takes the first one, of its size (a replaced spare would be 150 bytes)
    segment.close()
    assert (read_segment(spare_store, "next") or b"")[:76] == b"a" * 76


def test_a_spare_is_not_renamed_onto_a_key_a_cleanup_removed(spare_store: Store) -> None:
    """A cleanup between a put's create and its reserve removed the key's new segment: the put
    writes into nothing, as it did before spares; taking a spare would bring the key back."""
    write_segment(spare_store, "R_1_0", b"x" * 100)
    spare_store.retire_segment("R_1_0")
    segment = spare_store.create_segment("R_1_1")
    assert spare_store.unlink_segment("R_1_1")
    segment.reserve(100)
    segment.write(0, b"y" * 100)
    segment.close()
    assert spare_store.segments() == [] and spare_store.spares() == ["R_1_0"]


def test_spares_are_swept_and_removed_one_by_one(spare_store: Store) -> None:
    for key in ("a", "b"):
        write_segment(spare_store, key, b"x" * 100)
    for key in ("a", "b"):
        spare_store.retire_segment(key)
    assert spare_store.remove_spare("a") and not spare_store.remove_spare("a")
    removed = spare_store.sweep()
    assert any(name.endswith("b") for name in removed) and spare_store.spares() == []


def test_posix_spare_keeps_its_pages(posix_spares: PosixStore) -> None:
    write_segment(posix_spares, "R_1_0", b"x" * 4096)
    inode = os.stat(posix_spares.segment_path("R_1_0")).st_ino
    posix_spares.retire_segment("R_1_0")
    write_segment(posix_spares, "R_1_1", b"y" * 4096)
    assert os.stat(posix_spares.segment_path("R_1_1")).st_ino == inode
    assert stat.S_IMODE(os.stat(posix_spares.segment_path("R_1_1")).st_mode) == 0o600


def test_posix_a_spare_with_two_names_is_not_taken(posix_spares: PosixStore) -> None:
    """A consumer that died between linking a spare and unlinking the key left one file under two
    names: writing into it would change the unread chunk. It is taken once the key is gone."""
    write_segment(posix_spares, "R_1_0", b"x" * 100)
    os.link(posix_spares.segment_path("R_1_0"), os.path.join(SHM_DIR, f"omnisim-{posix_spares.namespace}-spare-R_1_0"))
    assert posix_spares.spares() == ["R_1_0"]
    write_segment(posix_spares, "R_1_1", b"y" * 100)
    assert posix_spares.spares() == ["R_1_0"] and read_segment(posix_spares, "R_1_0") == b"x" * 100
    posix_spares.unlink_segment("R_1_0")
    write_segment(posix_spares, "R_1_2", b"z" * 100)
    assert posix_spares.spares() == []


def test_posix_a_hostile_spare_is_neither_taken_nor_removed(
    posix_spares: PosixStore, tmp_path: os.PathLike[str]
) -> None:
    target = os.path.join(tmp_path, "target")
    with open(target, "wb") as f:
        f.write(b"t" * 100)
    planted = os.path.join(SHM_DIR, f"omnisim-{posix_spares.namespace}-spare-evil")
    os.symlink(target, planted)
    try:
        write_segment(posix_spares, "R_1_0", b"y" * 100)
        with pytest.raises(ForeignName):
            posix_spares.remove_spare("evil")
        assert os.path.islink(planted)
        with open(target, "rb") as f:
            assert f.read() == b"t" * 100
        entries = {e.name: e.ours for e in ShmDirectory().entries() if e.namespace == posix_spares.namespace}
        assert entries[os.path.basename(planted)] is False
    finally:
        os.unlink(planted)


@pytest.fixture
def posix_spares() -> Iterator[PosixStore]:
    s = PosixStore(spare_min_bytes=SPARE_MIN)
    yield s
    s.sweep()


def test_spares_give_way_to_a_segment_that_would_not_fit_beside_them() -> None:
    store = MemoryStore(capacity=1000, spare_min_bytes=SPARE_MIN)
    for key in ("a", "b"):
        write_segment(store, key, b"x" * 400)
    for key in ("a", "b"):
        store.retire_segment(key)
    assert store.spares() == ["a", "b"]
    write_segment(store, "small", b"y" * (SPARE_MIN - 1))  # too small to take a spare: fits beside them
    assert store.spares() == ["a", "b"]
    store.spare_min_bytes = 1 << 30  # no spare is taken: the new segment needs room of its own
    write_segment(store, "big", b"z" * 600)
    assert store.spares() == [] and read_segment(store, "big") == b"z" * 600
    with pytest.raises(StoreFull):
        write_segment(store, "too_big", b"z" * 600)


def test_posix_spares_give_way_to_a_full_dev_shm(posix_spares: PosixStore, monkeypatch: pytest.MonkeyPatch) -> None:
    write_segment(posix_spares, "a", b"x" * 100)
    posix_spares.retire_segment("a")
    real = os.posix_fallocate
    full = {"left": 1}

    def fallocate(fd: int, offset: int, length: int) -> None:
        if full["left"]:
            full["left"] -= 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    write_segment(posix_spares, "small", b"y" * 10)  # below the spare size: ENOSPC once, then room
    assert posix_spares.spares() == [] and read_segment(posix_spares, "small") == b"y" * 10
    full["left"] = 1
    with pytest.raises(StoreFull):  # no spare left to give way
        write_segment(posix_spares, "next", b"y" * 10)
    assert posix_spares.segments() == ["next", "small"]  # (a failed put's rollback is the connector's)


def test_a_fifo_at_an_owner_record_name_is_no_owner_and_never_blocks(tmp_path: os.PathLike[str]) -> None:
    """Anyone may make a FIFO in /dev/shm, at a name no one holds yet: reading the owner record
    there must not wait for a writer (it froze a stage's loop, and ``omnisim sweep``)."""
    path = os.path.join(str(tmp_path), "omnisim-0123456789ab-owner")
    os.mkfifo(path, 0o600)
    assert ShmDirectory(path=str(tmp_path)).read_owner("0123456789ab") is None


def test_posix_a_sparse_segment_is_refused(posix: PosixStore) -> None:
    """A segment of ours is reserved whole before it is written; one whose size is a hole (a
    header there could claim gigabytes) is refused before a byte of it is read."""
    write_segment(posix, "k", encode({"x": 1}))
    make_sparse(posix.segment_path("k"))
    with pytest.raises(StoreError, match="sparse"):
        posix.open_segment("k")
