"""ShmConnector under the real kernel (plain trio), over both stores (spec §2.3–§2.7, §2.10)."""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Iterator
from typing import Any
from unittest.mock import ANY

import numpy as np
import pytest
import torch
import trio
from conftest import make_sparse

import runtime.connectors.shm as shm_module
from runtime.connectors.base import CorruptChunk
from runtime.connectors.keys import InvalidKeyError
from runtime.connectors.posix_store import PosixStore
from runtime.connectors.ring import Ring, RingSettings, edge_name
from runtime.connectors.shm import PUT_REAP_BUDGET, REAP_BUDGET, ShmConnector
from runtime.connectors.stores import SPARE_MIN_BYTES, MemoryStore, Store, StoreError
from runtime.connectors.wire import BufferIO, EncodedFrame, WireDecodeError, encode


@pytest.fixture(params=["memory", "posix"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    s: Store = MemoryStore() if request.param == "memory" else PosixStore()
    yield s
    s.sweep()


def residue(store: Store) -> tuple[list[str], list[str]]:
    return store.segments(), store.lock_files()


def pending(conn: ShmConnector) -> list[str]:
    return conn.residue()["pending_keys"]


async def put(conn: ShmConnector, key: str, data: object, to_stage: str = "1") -> None:
    result = await conn.put("0", to_stage, key, data)
    assert result.ok, f"put of {key} failed"


async def get(conn: ShmConnector, key: str) -> Any:
    got = await conn.get("0", "1", key)
    assert got is not None, f"get of {key} returned None"
    return got[0]


# -- put / get -------------------------------------------------------------------------------


async def test_put_get_round_trip(store: Store) -> None:
    conn = ShmConnector(store, stage_id=0)
    payload = {
        "codes": {"audio": torch.arange(32, dtype=torch.int64).reshape(2, 16)},
        "meta": {"finished": torch.tensor(False), "left_context_size": 25},
        "arr": np.linspace(0, 1, 5, dtype=np.float32),
    }
    result = await conn.put("0", "1", "R_0_0", payload)
    assert result.ok
    assert result.size > 0
    file = [*store.open_segment("R_0_0").identity, 0]  # type: ignore[union-attr]  # (a new file: generation 0)
    assert result.metadata == {"shm": {"name": "R_0_0", "size": result.size, "file": file}, "size": result.size}
    assert pending(conn) == ["R_0_0"]
    assert residue(store) == (["R_0_0"], ["R_0_0"])  # the writer leaves its lock file

    got = await conn.get("0", "1", "R_0_0")
    assert got is not None
    obj, size = got
    assert size == result.size
    assert torch.equal(obj["codes"]["audio"], payload["codes"]["audio"])
    assert obj["meta"]["finished"].item() is False
    assert obj["meta"]["left_context_size"] == 25
    np.testing.assert_array_equal(obj["arr"], payload["arr"])
    assert pending(conn) == []  # a shared instance forgets the key it consumed
    assert residue(store) == ([], [])
    assert await conn.get("0", "1", "R_0_0") is None
    assert conn.health() == {
        "status": "healthy",
        "puts": 1,
        "gets": 1,
        "bytes_transferred": result.size,
        "ring_puts": 0,
        "ring_fallbacks": 0,
    }


async def test_get_by_metadata_handle(store: Store) -> None:
    conn = ShmConnector(store)
    meta = (await conn.put("0", "1", "A_0_0", "a")).metadata
    await put(conn, "B_0_0", "b")
    await put(conn, "C_0_0", "c")
    assert await conn.get("0", "1", "ignored", meta) == ("a", meta["size"])
    # Upstream's metadata of several keys, by key: the get's own entry is the one read.
    many = {"B_0_0": {"shm": {"name": "B_0_0", "size": 1}}, "C_0_0": {"shm": {"name": "C_0_0", "size": 1}}}
    got_b = await conn.get("0", "1", "B_0_0", many)
    assert got_b is not None and got_b[0] == "b"
    junks = (None, {}, {"source_host": "h", "source_port": 1}, {"shm": "nope"}, {"shm": {"name": "../x"}})
    for junk in (*junks, {"get_key": "A_0_0"}, {"C_0_0": 5}):
        await put(conn, "C_0_0", "c")
        got_c = await conn.get("0", "1", "C_0_0", junk)
        assert got_c is not None and got_c[0] == "c"
    assert residue(store) == ([], [])


@pytest.mark.parametrize("transport", ["segments", "ring"])
async def test_the_handle_of_a_replaced_put_finds_nothing(store: Store, transport: str) -> None:
    """A handle names one put's payload: once a later put of its key replaced it, the old handle
    finds nothing (it never takes the later payload), the new one and the bare key find it."""
    ring = RingSettings() if transport == "ring" else None
    producer, consumer = ShmConnector(store, send_ring=ring), ShmConnector(store, receive_ring=ring)
    old = (await producer.put("0", "1", "R_1_0", "old")).metadata
    new = (await producer.put("0", "1", "R_1_0", "new")).metadata
    assert ("frame" in new["shm"]) == (transport == "ring")
    assert await consumer.get("0", "1", "R_1_0", old) is None
    assert await consumer.get("0", "1", "R_1_0", new) == ("new", new["size"])
    await put(producer, "R_1_0", "newer")
    assert await get(consumer, "R_1_0") == "newer"  # (the key alone: whichever put is there)
    big = (await producer.put("0", "1", "R_1_0", torch.zeros(1 << 20, dtype=torch.uint8))).metadata
    assert "file" in big["shm"]  # (too large for a ring: a segment either way)
    assert await consumer.get("0", "1", "R_1_0", old) is None
    assert (await consumer.get("0", "1", "R_1_0", big))[1] == big["size"]  # type: ignore[index]
    await producer.close()
    await consumer.close()
    assert residue(store) == ([], [])


async def test_the_handle_of_a_consumed_put_never_finds_a_later_put_in_its_reused_file(store: Store) -> None:
    """A consumed large segment is kept as a spare, and the next put of about its size reuses
    the same file: a second get by the first put's handle finds nothing (it would take the later
    put's payload from its reader), the later handle finds its own."""
    conn = ShmConnector(store)
    first = (await conn.put("0", "1", "R_2_0", torch.zeros(1 << 20, dtype=torch.uint8))).metadata
    assert (await conn.get("0", "1", "R_2_0", first))[1] == first["size"]  # type: ignore[index]
    assert store.spares() == ["R_2_0"]
    second = (await conn.put("0", "1", "R_2_0", torch.ones(1 << 20, dtype=torch.uint8))).metadata
    assert store.spares() == []  # (it took the spare: the same file)
    assert second["shm"]["file"][:2] == first["shm"]["file"][:2]
    assert second["shm"]["file"][2] == first["shm"]["file"][2] + 1
    assert await conn.get("0", "1", "R_2_0", first) is None
    got = await conn.get("0", "1", "R_2_0", second)
    assert got is not None and bool(got[0].eq(1).all())
    await conn.close()
    assert residue(store) == ([], [])


async def test_the_handle_of_a_ring_frame_never_finds_a_later_ring_s_frame_at_its_position(store: Store) -> None:
    """A ring made again for an edge (its predecessor retired) numbers its frames from the start:
    a handle names the ring's file as well as the frame's position, so a read put's handle finds
    nothing when a later put of its key lands at the same position of the new ring."""
    producer, consumer = ShmConnector(store, send_ring=RingSettings()), ShmConnector(store, receive_ring=True)
    first = (await producer.put("0", "1", "R_3_0", "first")).metadata
    assert await consumer.get("0", "1", "R_3_0", first) == ("first", first["size"])
    ring = Ring.attach(store.open_ring(edge_name("0", "1")))  # type: ignore[arg-type]
    assert ring is not None
    ring.retire()  # (what a reader that found it corrupt does)
    ring.close()
    later = (await producer.put("0", "1", "R_3_0", "later")).metadata
    assert later["shm"]["frame"][2] == first["shm"]["frame"][2]  # (the same position, in another ring)
    assert later["shm"]["frame"][:2] != first["shm"]["frame"][:2]
    assert await consumer.get("0", "1", "R_3_0", first) is None
    assert await consumer.get("0", "1", "R_3_0", later) == ("later", later["size"])
    await producer.close()
    await consumer.close()
    assert residue(store) == ([], [])


async def test_a_ring_frame_s_handle_finds_it_whatever_stages_or_ring_setting_the_get_names(store: Store) -> None:
    """The handle is used directly (spec §2.4): it names its ring's edge, so a get by it finds the
    frame from a connector that reads no rings, or names its stages differently. A get by the key
    alone looks only where the connector was told to look."""
    producer = ShmConnector(store, send_ring=RingSettings())
    by_key_only = ShmConnector(store)  # (receive_ring=False)
    first = (await producer.put("0", "1", "R_4_0", "first")).metadata
    assert first["shm"]["edge"] == edge_name("0", "1")
    assert await by_key_only.get("0", "1", "R_4_0") is None
    assert await by_key_only.get("0", "1", "R_4_0", first) == ("first", first["size"])
    second = (await producer.put("0", "1", "R_4_1", "second")).metadata
    assert await by_key_only.get("thinker", "talker", "R_4_1", second) == ("second", second["size"])
    assert await by_key_only.get("0", "1", "R_4_1", second) is None  # (read: it is gone)
    forged = {"shm": {**second["shm"], "edge": "../x"}}  # (an edge that is no name of ours: nothing there)
    assert await by_key_only.get("0", "1", "R_4_1", forged) is None
    await producer.close()
    await by_key_only.close()
    assert residue(store) == ([], [])


async def test_a_segment_a_stray_rename_moved_under_another_key_is_refused_there() -> None:
    """A frame's checksum is seeded with the key it was put under: moved under another key's name
    by a process outside the protocol, it reads as corrupt there, never as that key's chunk
    (found by an outside audit: the other key's get handed it out)."""
    store = PosixStore(spare_min_bytes=1 << 40)
    try:
        conn = ShmConnector(store)
        await put(conn, "R_0_0", {"x": "zero"})
        await put(conn, "R_1_0", {"x": "one"})
        os.rename(store.segment_path("R_0_0"), store.segment_path("R_1_0"))
        with pytest.raises(CorruptChunk, match="checksum mismatch"):
            await conn.get("0", "1", "R_1_0")
        await conn.close()
    finally:
        store.sweep()


async def test_a_connector_used_with_async_with_is_closed_at_the_end(store: Store) -> None:
    async with ShmConnector(store) as conn:
        await put(conn, "W_0_0", {"v": torch.zeros(8)})  # (unread: the close removes it)
    assert residue(store) == ([], [])
    assert not (await conn.put("0", "1", "W_0_1", 1)).ok  # (closed)


@pytest.mark.parametrize("transport", ["segments", "ring"])
async def test_a_connector_used_with_a_plain_with_is_closed_at_the_end(store: Store, transport: str) -> None:
    """Code that cannot await closes a connector with a plain ``with`` (spec §2.1): unread keys,
    large ones kept as spares, and the ring all go."""
    ring = RingSettings() if transport == "ring" else None
    with ShmConnector(store, send_ring=ring) as conn, ShmConnector(store, receive_ring=True) as reader:
        await put(conn, "W_1_0", {"v": torch.zeros(8)})  # (unread: the close removes it)
        await put(conn, "W_1_1", torch.zeros(SPARE_MIN_BYTES, dtype=torch.uint8))
        assert await get(reader, "W_1_1") is not None  # (its segment becomes a spare)
    assert residue(store) == ([], [])
    assert store.spares() == [] and store.open_ring(edge_name("0", "1")) is None
    assert not (await conn.put("0", "1", "W_1_2", 1)).ok  # (closed)
    conn.__exit__(None, None, None)  # (idempotent)


async def test_get_missing_returns_none(store: Store) -> None:
    conn = ShmConnector(store)
    assert await conn.get("0", "1", "nothing_0_0") is None
    assert residue(store) == ([], [])


async def test_put_replaces_unread_data(store: Store) -> None:
    conn = ShmConnector(store)
    await put(conn, "R_0_0", {"v": torch.zeros(1000)})
    await put(conn, "R_0_0", {"v": 2})
    assert pending(conn) == ["R_0_0"]
    assert residue(store) == (["R_0_0"], ["R_0_0"])
    assert await get(conn, "R_0_0") == {"v": 2}
    assert await conn.get("0", "1", "R_0_0") is None
    assert residue(store) == ([], [])


async def test_get_of_locked_key_returns_none(store: Store) -> None:
    producer, consumer = ShmConnector(store), ShmConnector(store)
    await put(producer, "R_0_0", [1, 2, 3])
    lock = store.open_lock("R_0_0", create=False)
    assert lock is not None
    assert lock.try_acquire()
    try:
        for _ in range(3):
            assert await consumer.get("0", "1", "R_0_0") is None
        assert residue(store) == (["R_0_0"], ["R_0_0"])  # nothing consumed, nothing removed
    finally:
        lock.close()
    assert await get(consumer, "R_0_0") == [1, 2, 3]
    assert residue(store) == ([], [])


async def test_get_without_lock_file_returns_none(store: Store) -> None:
    conn = ShmConnector(store)
    await put(conn, "R_0_0", "x")
    store.remove_lock("R_0_0")
    assert await conn.get("0", "1", "R_0_0") is None
    assert store.segments() == ["R_0_0"]
    await conn.close()
    assert residue(store) == ([], [])


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (WireDecodeError("injected"), "R_0_0: injected"),
        # A decoder that breaks on the bytes some other way (upstream's own test of #4414) would
        # break on them again: consumed as corrupt too, never left to fail every later get.
        (ValueError("invalid payload"), "R_0_0: the decoder failed on it: ValueError: invalid payload"),
    ],
)
@pytest.mark.parametrize("ring", [False, True])
async def test_consumed_undecodable_payload_removes_lock_and_segment(
    store: Store, monkeypatch: pytest.MonkeyPatch, error: Exception, said: str, ring: bool
) -> None:
    producer = ShmConnector(store, stage_id=0, send_ring=RingSettings() if ring else None)
    consumer = ShmConnector(store, stage_id=1, receive_ring=ring)
    await put(producer, "R_0_0", {"x": 1})
    assert producer.health()["ring_puts"] == ring

    def broken_finish(self: object, checksum: int) -> object:
        raise error

    monkeypatch.setattr(shm_module.FrameDecoder, "finish", broken_finish)
    with pytest.raises(CorruptChunk, match=re.escape(said)):
        await consumer.get("0", "1", "R_0_0")
    assert residue(store) == ([], [])
    assert await consumer.get("0", "1", "R_0_0") is None
    producer.reap_consumed()
    assert pending(producer) == []
    await producer.close()
    await consumer.close()


def _uncommitted(payload: object) -> bytes:
    frame = EncodedFrame(payload)
    out = bytearray(frame.size)
    frame.write_body(BufferIO(out))
    return bytes(out)


def _flipped(frame: bytes, pos: int) -> bytes:
    out = bytearray(frame)
    out[pos] ^= 0x5A
    return bytes(out)


@pytest.mark.parametrize(
    "garbage",
    [
        b"",
        bytes(4096),
        b"XXXX" + bytes(60),
        encode({"t": torch.arange(100)})[:80],
        b"OMW2\xff\xff\xff\xff" + bytes(56),
        encode({"t": torch.arange(1 << 20)})[:-8],  # 8 MB: decoded on a worker thread
        _uncommitted({"t": torch.arange(1000)}),
        _flipped(encode({"t": torch.arange(1000)}), 200),
    ],
    ids=[
        "zero_length",
        "zero_filled",
        "bad_magic",
        "truncated",
        "header_past_end",
        "large_truncated",
        "uncommitted",
        "flipped_byte",
    ],
)
async def test_consumed_corrupt_segment_is_a_corrupt_chunk(store: Store, garbage: bytes) -> None:
    """A segment its writer never finished — killed before the commit, a zero-length one, a
    truncated one — or whose bytes changed is a corrupt chunk, never "not arrived yet": get
    raises CorruptChunk, and the consumed bytes take the segment and the lock file with them."""
    seg = store.create_segment("R_0_0")
    if garbage:
        seg.reserve(len(garbage))
        seg.write(0, garbage)
    seg.close()
    lock = store.open_lock("R_0_0", create=True)
    assert lock is not None
    lock.close()
    conn = ShmConnector(store)
    with pytest.raises(CorruptChunk) as info:
        await conn.get("0", "1", "R_0_0")
    assert info.value.key == "R_0_0"
    assert residue(store) == ([], [])


@pytest.mark.parametrize("payload", [{}, 0, [], "", None, False], ids=repr)
async def test_falsy_payload_removes_lock_file(store: Store, payload: object) -> None:
    producer, consumer = ShmConnector(store), ShmConnector(store)
    await put(producer, "R_0_0", payload)
    got = await consumer.get("0", "1", "R_0_0")
    assert got is not None
    assert got[0] == payload and type(got[0]) is type(payload)
    assert residue(store) == ([], [])


async def test_an_invalid_key_fails_a_put_and_raises_from_a_get_or_a_cleanup(store: Store) -> None:
    """A put never raises (spec §2.1): it fails, saying why; a get or cleanup of a key that names
    no chunk is refused with a clear error."""
    conn = ShmConnector(store)
    for key in ("a/b", "", "x" * 300, ".."):
        result = await conn.put("0", "1", key, 1)
        assert not result.ok and "chunk key" in result.metadata["error"]  # type: ignore[index]
        with pytest.raises(InvalidKeyError):
            await conn.get("0", "1", key)
        with pytest.raises(InvalidKeyError):
            await conn.cleanup(key)
    assert pending(conn) == []
    assert residue(store) == ([], [])


UNENCODABLE = {
    "object": lambda: {"bad": object()},
    "set": lambda: [{1, 2}],
    "int_too_big": lambda: 1 << 80,
    "sparse_tensor": lambda: {"t": torch.eye(2).to_sparse()},
    "meta_tensor": lambda: {"t": torch.empty(2, device="meta")},
}


@pytest.mark.parametrize("name", sorted(UNENCODABLE))
async def test_unencodable_payload_fails_cleanly(store: Store, name: str) -> None:
    """put never raises for a payload problem: it reports failure and leaves nothing."""
    conn = ShmConnector(store)
    await put(conn, "R_0_0", "earlier")
    result = await conn.put("0", "1", "R_0_1", UNENCODABLE[name]())
    assert not result.ok and result.size == 0
    assert "encode" in result.metadata["error"]
    assert pending(conn) == ["R_0_0"]
    assert residue(store) == (["R_0_0"], ["R_0_0"])
    assert conn.health()["puts"] == 1
    await conn.close()


# -- store full ------------------------------------------------------------------------------


def make_frames_huge(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every frame claim 1 PiB, so PosixStore's posix_fallocate meets a real ENOSPC."""
    monkeypatch.setattr(
        shm_module.EncodedFrame, "size", property(lambda self: 1 << 50, lambda self, v: None), raising=False
    )


async def test_store_full_put_fails_and_leaves_nothing() -> None:
    store = MemoryStore(capacity=100)
    conn = ShmConnector(store)
    result = await conn.put("0", "1", "R_0_0", {"t": torch.zeros(1000)})
    assert not result.ok and result.size == 0
    assert "/dev/shm is full" in result.metadata["error"]
    assert pending(conn) == []
    assert residue(store) == ([], [])
    await put(conn, "R_0_1", 1)  # a small one still fits
    assert residue(store) == (["R_0_1"], ["R_0_1"])


async def test_posix_store_full_put_fails_and_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    store = PosixStore()
    try:
        conn = ShmConnector(store)
        # A frame too large for /dev/shm: the reservation fails before anything is mapped.
        big = torch.empty(0)
        make_frames_huge(monkeypatch)
        result = await conn.put("0", "1", "R_0_0", {"t": big})
        assert not result.ok and "/dev/shm is full" in result.metadata["error"]
        assert pending(conn) == []
        assert residue(store) == ([], [])
    finally:
        store.sweep()


@pytest.mark.parametrize(
    "kind",
    [
        "memory",
        "posix",
    ],
)
async def test_store_full_replace_leaves_nothing(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed put that would have replaced unread data leaves neither segment nor lock file
    (spec §2.3 step 9: the failed create removes the lock file; the old segment was replaced)."""
    store: Store = MemoryStore(capacity=4096) if kind == "memory" else PosixStore()
    try:
        conn = ShmConnector(store)
        await put(conn, "R_0_0", "small")
        if kind == "memory":
            result = await conn.put("0", "1", "R_0_0", {"t": torch.zeros(2000)})
        else:
            make_frames_huge(monkeypatch)
            result = await conn.put("0", "1", "R_0_0", "big")
        assert not result.ok
        segments, locks = residue(store)
        assert locks == []
        # Whatever the store did with the old segment, it must not be a segment without a
        # lock file (unreadable by any get, invisible to the producer's reap).
        assert segments == []
    finally:
        store.sweep()


# -- cleanup ---------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["_1_2", "_1", "_suffix"])
async def test_cleanup_is_exact_key(store: Store, suffix: str) -> None:
    conn = ShmConnector(store)
    sibling = f"task{suffix}_1_0"
    await put(conn, "task_1_0", "mine")
    await put(conn, sibling, "sibling")
    assert await conn.cleanup("task") is False  # a raw request id matches nothing
    assert await conn.cleanup("task_1") is False
    assert await conn.cleanup("task_1_0") is True
    assert await conn.cleanup("task_1_0") is False
    assert pending(conn) == [sibling]
    assert residue(store) == ([sibling], [sibling])
    assert await get(conn, sibling) == "sibling"
    assert residue(store) == ([], [])


async def test_cleanup_removes_lock_file_of_consumed_key_and_reports_no_unlink(store: Store) -> None:
    producer, consumer = ShmConnector(store), ShmConnector(store)
    await put(producer, "R_1_0", 1)
    assert await get(consumer, "R_1_0") == 1
    assert await producer.cleanup("R_1_0") is False
    assert pending(producer) == []
    store.open_lock("R_1_0", create=True).close()  # type: ignore[union-attr]
    assert await producer.cleanup("R_1_0") is False
    assert residue(store) == ([], [])


async def test_cleanup_prefix_integer_suffix_rule(store: Store) -> None:
    conn = ShmConnector(store)
    keys = ["R_1_0", "R_1_12", "R_1_2_0", "R_1_x", "R_10_0", "R_1_", "Q_1_0"]
    for key in keys:
        await put(conn, key, key)
    assert await conn.cleanup_prefix("R_1_") == 2
    assert sorted(pending(conn)) == sorted(set(keys) - {"R_1_0", "R_1_12"})
    assert store.segments() == sorted(set(keys) - {"R_1_0", "R_1_12"})
    assert await get(conn, "R_1_2_0") == "R_1_2_0"
    assert await conn.cleanup_prefix("R_1_") == 0
    await conn.close()
    assert residue(store) == ([], [])


async def test_cleanup_prefix_counts_only_real_unlinks(store: Store) -> None:
    producer, consumer = ShmConnector(store), ShmConnector(store)
    for i in range(3):
        await put(producer, f"R_1_{i}", i)
    assert await get(consumer, "R_1_1") == 1  # consumed elsewhere: still tracked by producer
    assert await producer.cleanup_prefix("R_1_") == 2
    assert pending(producer) == []
    assert residue(store) == ([], [])


async def test_cleanup_prefix_ignores_untracked_keys(store: Store) -> None:
    producer, other = ShmConnector(store), ShmConnector(store)
    await put(other, "R_1_0", 0)
    assert await producer.cleanup_prefix("R_1_") == 0  # never a directory scan
    assert store.segments() == ["R_1_0"]
    await other.close()


# -- a cleanup that fails (spec §2.12) ---------------------------------------------------------


def failing_unlinks(store: Store, monkeypatch: pytest.MonkeyPatch, key: str, times: int) -> list[str]:
    """Make the store's first ``times`` removals of ``key``'s segment fail as a file system can
    (EACCES); the removals tried, in order, ``failed`` or ``done``."""
    tried: list[str] = []
    real = store.unlink_segment

    def unlink_segment(name: str, **kwargs: Any) -> bool:
        if name == key:
            tried.append("failed" if len(tried) < times else "done")
            if tried[-1] == "failed":
                raise StoreError(f"cannot remove segment {name!r}: Permission denied")
        return real(name, **kwargs)

    monkeypatch.setattr(store, "unlink_segment", unlink_segment)
    return tried


async def test_a_failed_cleanup_keeps_its_key_until_the_reap_removes_the_segment(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = ShmConnector(store)
    await put(conn, "R_1_0", "unread")
    tried = failing_unlinks(store, monkeypatch, "R_1_0", times=1)
    assert await conn.cleanup("R_1_0") is False
    assert pending(conn) == ["R_1_0"]
    assert residue(store) == (["R_1_0"], ["R_1_0"])  # (the lock file goes with its segment)
    conn.reap_consumed()
    assert tried == ["failed"]  # (not before its back-off)
    await trio.sleep(shm_module.CLEANUP_RETRY_S)
    conn.reap_consumed()
    assert tried == ["failed", "done"]
    assert pending(conn) == [] and residue(store) == ([], [])


async def test_the_retries_of_a_cleanup_are_bounded_and_the_close_tries_once_more(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = ShmConnector(store)
    await put(conn, "R_1_0", "unread")
    tried = failing_unlinks(store, monkeypatch, "R_1_0", times=99)
    await conn.cleanup("R_1_0")
    for _ in range(8):
        await trio.sleep(2 * shm_module.CLEANUP_RETRY_S)
        conn.reap_consumed()
    assert len(tried) == 1 + shm_module.CLEANUP_RETRIES
    await conn.close()
    assert len(tried) == 2 + shm_module.CLEANUP_RETRIES
    assert pending(conn) == ["R_1_0"]  # (what it could not remove, it still names)
    monkeypatch.undo()
    store.sweep()


async def test_the_retry_of_a_cleanup_leaves_a_later_puts_segment_of_the_same_name(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another producer's put of the same key (a restarted stage in the namespace) made a new
    segment after the cleanup failed: the retry must not remove it, nor its lock file (#8082)."""
    old, new, reader = ShmConnector(store), ShmConnector(store), ShmConnector(store)
    await put(old, "R_1_0", "old generation")
    failing_unlinks(store, monkeypatch, "R_1_0", times=1)
    await old.cleanup("R_1_0")
    await put(new, "R_1_0", "new generation")
    await trio.sleep(shm_module.CLEANUP_RETRY_S)
    old.reap_consumed()
    await old.close()
    assert residue(store) == (["R_1_0"], ["R_1_0"])
    assert await get(reader, "R_1_0") == "new generation"


async def test_a_put_again_of_a_key_whose_cleanup_failed_is_not_cleaned_up_by_the_retry(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn, reader = ShmConnector(store), ShmConnector(store)
    await put(conn, "R_1_0", "old")
    tried = failing_unlinks(store, monkeypatch, "R_1_0", times=1)
    await conn.cleanup("R_1_0")
    await put(conn, "R_1_0", "new")
    before = len(tried)  # (a POSIX put removes the old segment first, the memory store's replaces it)
    await trio.sleep(shm_module.CLEANUP_RETRY_S)
    conn.reap_consumed()
    assert len(tried) == before
    assert await get(reader, "R_1_0") == "new"


# -- reap ------------------------------------------------------------------------------------


async def test_reap_rotates_past_unread_keys(store: Store) -> None:
    a, b = ShmConnector(store), ShmConnector(store)
    for i in range(130):
        await put(a, f"k_{i}", i)
    assert len(pending(a)) == 130
    for i in range(65, 130):
        assert await get(b, f"k_{i}") == i
    for _ in range(3):
        a.reap_consumed()
    left = pending(a)
    assert len(left) == 65
    assert set(left) == {f"k_{i}" for i in range(65)}
    assert await get(b, "k_0") == 0
    a.reap_consumed()
    assert len(pending(a)) == 64
    await a.close()
    assert residue(store) == ([], [])


async def test_reap_examines_at_most_budget(store: Store) -> None:
    a, b = ShmConnector(store), ShmConnector(store)
    for i in range(10):
        await put(a, f"k_{i}", i)
    for i in range(10):
        await get(b, f"k_{i}")
    a.reap_consumed(max_keys=3)
    assert len(pending(a)) == 7
    a.reap_consumed(max_keys=0)
    assert len(pending(a)) == 7
    a.reap_consumed()
    assert pending(a) == []
    assert REAP_BUDGET == 64 and PUT_REAP_BUDGET == 4


async def test_sender_reaps_keys_consumed_by_another_connector(store: Store) -> None:
    sender, receiver = ShmConnector(store), ShmConnector(store)
    worst = 0
    for i in range(256):
        await put(sender, f"R_1_{i}", {"i": i})
        worst = max(worst, len(pending(sender)))
        assert await get(receiver, f"R_1_{i}") == {"i": i}
        worst = max(worst, len(pending(sender)))
    assert worst <= 1
    sender.reap_consumed()
    assert pending(sender) == []
    assert residue(store) == ([], [])


async def test_put_reap_keeps_up_with_a_lagging_consumer(store: Store) -> None:
    """With a consumer one put behind, the budget-4 reap inside put still bounds pending."""
    sender, receiver = ShmConnector(store), ShmConnector(store)
    worst = 0
    for i in range(256):
        await put(sender, f"R_1_{i}", i)
        if i >= 2:
            assert await get(receiver, f"R_1_{i - 2}") == i - 2
        worst = max(worst, len(pending(sender)))
    assert worst <= PUT_REAP_BUDGET
    await sender.close()
    assert residue(store) == ([], [])


# -- close -----------------------------------------------------------------------------------


async def test_close_removes_unread_keys(store: Store) -> None:
    producer, consumer = ShmConnector(store), ShmConnector(store)
    for i in range(5):
        await put(producer, f"R_1_{i}", i)
    assert await get(consumer, "R_1_0") == 0
    await producer.close()
    assert residue(store) == ([], [])
    assert pending(producer) == []
    await producer.close()  # idempotent
    assert await consumer.get("0", "1", "R_1_1") is None


async def test_close_leaves_other_connectors_keys(store: Store) -> None:
    a, b = ShmConnector(store), ShmConnector(store)
    await put(a, "A_0_0", "a")
    await put(b, "B_0_0", "b")
    await a.close()
    assert residue(store) == (["B_0_0"], ["B_0_0"])
    await b.close()
    assert residue(store) == ([], [])


async def test_a_closed_connector_puts_nothing_and_maps_nothing(store: Store) -> None:
    producer = ShmConnector(store, send_ring=RingSettings())
    consumer = ShmConnector(store, receive_ring=True)
    await put(producer, "R_1_0", 0)
    await producer.close()
    result = await producer.put("0", "1", "R_1_1", 1)
    assert not result.ok and "closed" in result.metadata["error"]
    assert residue(store) == ([], []) and store.rings() == []
    await consumer.close()
    assert await consumer.get("0", "1", "R_1_0") is None
    assert store.open_handles() == []


async def test_a_put_in_flight_at_the_close_leaves_nothing(store: Store) -> None:
    """The close removes what its connector tracks; a put that places its payload after that
    removes it itself and says it failed (nobody would ever read or remove it)."""
    conn = ShmConnector(store)
    payload = {"x": torch.zeros(1 << 20)}
    async with trio.open_nursery() as nursery:
        results: list[Any] = []

        async def putting() -> None:
            results.append(await conn.put("0", "1", "R_1_0", payload))

        nursery.start_soon(putting)
        await trio.sleep(0)  # the put is under way: past its first point
        await conn.close()
    assert not results[0].ok and "closed" in results[0].metadata["error"]
    assert residue(store) == ([], []) and pending(conn) == []


@pytest.mark.parametrize("stages", [(None, "1"), ("0", 1.0), (True, "1")])
async def test_a_stage_neither_a_string_nor_an_int_is_refused_before_anything_is_stored(
    store: Store, stages: tuple[Any, Any]
) -> None:
    conn = ShmConnector(store, send_ring=RingSettings())
    result = await conn.put(*stages, "R_1_0", {"x": 1})
    assert not result.ok and "_stage must be a str (or an int)" in result.metadata["error"]  # type: ignore[index]
    with pytest.raises(TypeError, match="_stage must be a str"):
        await conn.get(*stages, "R_1_0")
    assert residue(store) == ([], []) and store.rings() == []
    await conn.close()


async def test_int_stages_are_their_digits(store: Store) -> None:
    """Upstream's callers pass ``str(stage_id)``; some pass the int: the same edge either way."""
    producer = ShmConnector(store, stage_id=0, send_ring=RingSettings())
    consumer = ShmConnector(store, stage_id=1, receive_ring=True)
    await put(producer, "R_0_0", {"x": 1})
    assert (await producer.put(0, 1, "R_0_1", {"x": 2})).ok
    assert [(await consumer.get(0, 1, k))[0]["x"] for k in ("R_0_0", "R_0_1")] == [1, 2]  # type: ignore[index]
    assert producer.health()["ring_puts"] == 2
    await producer.close()
    await consumer.close()
    assert residue(store) == ([], [])


async def test_get_with_deadline_is_a_get_until_the_deadline(store: Store) -> None:
    conn = ShmConnector(store)
    await put(conn, "R_0_0", "r")
    assert await conn.get_with_deadline("0", "1", "R_0_0", deadline=time.monotonic() - 1) is None
    assert await conn.get_with_deadline("0", "1", "R_0_0", deadline=time.monotonic() + 60) == ("r", ANY)
    assert residue(store) == ([], [])


@pytest.mark.parametrize("seconds", [math.inf, math.nan, -1.0])
def test_an_unbounded_or_negative_lock_wait_is_refused(seconds: float) -> None:
    with pytest.raises(ValueError, match="finite number of seconds"):
        ShmConnector(MemoryStore(), lock_timeout_s=seconds)


async def test_a_sparse_segment_is_a_corrupt_chunk_and_consumed() -> None:
    """No put of ours leaves a hole in a segment: one that has one is a corrupt chunk, consumed
    with its lock file like any other (the key is free again), never kept as a spare."""
    store = PosixStore()
    conn = ShmConnector(store)
    await put(conn, "R_1_0", {"x": torch.zeros(1 << 16)})
    make_sparse(store.segment_path("R_1_0"))
    with pytest.raises(CorruptChunk, match="sparse"):
        await conn.get("0", "1", "R_1_0")
    assert residue(store) == ([], []) and store.spares() == []
    await put(conn, "R_1_0", 1)
    assert await get(conn, "R_1_0") == 1
    await conn.close()
    store.sweep()


# -- large payloads take the worker-thread path ----------------------------------------------


async def test_large_payload_round_trip(store: Store) -> None:
    conn = ShmConnector(store)
    big = torch.arange(2_000_000, dtype=torch.float32)  # 8 MB: above the off-loop threshold
    result = await conn.put("0", "1", "R_0_0", {"big": big})
    assert result.ok and result.size >= big.numel() * 4
    got = await get(conn, "R_0_0")
    assert torch.equal(got["big"], big)
    assert residue(store) == ([], [])


async def test_large_payloads_reuse_the_segments_their_consumer_handed_back(store: Store) -> None:
    """From ``SPARE_MIN_BYTES`` on a consumed segment is kept as a spare of the producer's
    namespace and the next large put writes into it; the producer's close removes the spares."""
    own: Store = MemoryStore("consumer") if isinstance(store, MemoryStore) else PosixStore()
    producer, consumer = ShmConnector(store, stage_id=0), ShmConnector(own, stage_id=1, upstream=store)
    chunks = [torch.full((SPARE_MIN_BYTES // 4 + i,), float(i)) for i in range(3)]
    for i, chunk in enumerate(chunks):
        await put(producer, f"R_0_{i}", {"audio": chunk})
        assert store.spares() == []  # the put took the spare the previous get left
        assert torch.equal((await get(consumer, f"R_0_{i}"))["audio"], chunk)
        assert store.spares() == [f"R_0_{i}"]
        assert residue(store) == ([], [])
    await consumer.close()
    own.sweep()
    assert store.spares() == ["R_0_2"]  # (the consumer's close leaves its producer's namespace alone)
    await producer.close()
    assert store.spares() == []


# -- a put racing a get of the same key ------------------------------------------------------


def lock_is_held(store: Store, key: str) -> bool:
    probe = store.open_lock(key, create=False)
    if probe is None:
        return False
    try:
        return not probe.try_acquire()
    finally:
        probe.close()


async def test_put_waiting_on_a_reader_leaves_a_readable_payload(store: Store) -> None:
    producer, consumer = ShmConnector(store), ShmConnector(store)
    await put(producer, "R_0_0", {"big": torch.zeros(2_000_000)})  # 8 MB: decoded on a worker thread
    first: list[Any] = []

    async def reader() -> None:
        first.append(await consumer.get("0", "1", "R_0_0"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        while not lock_is_held(store, "R_0_0"):
            await trio.sleep(0)
        await put(producer, "R_0_0", "second")  # waits for the reader's lock
    assert first[0] is not None and torch.equal(first[0][0]["big"], torch.zeros(2_000_000))
    try:
        assert residue(store) == (["R_0_0"], ["R_0_0"])
        assert await get(consumer, "R_0_0") == "second"
    finally:
        await producer.close()


# -- every storage error a clean failure; hostile names refused ---------------------------------


def _chown_foreign(path: str) -> None:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
    os.close(fd)
    os.chown(path, 4242, 4242)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
async def test_put_over_a_foreign_segment_fails_and_leaves_no_lock() -> None:
    store = PosixStore()
    try:
        _chown_foreign(store.segment_path("R_0_0"))
        conn = ShmConnector(store)
        result = await conn.put("0", "1", "R_0_0", {"x": 1})
        assert not result.ok and "not ours" in result.metadata["error"]
        assert store.lock_files() == []  # rolled back
        assert os.path.exists(store.segment_path("R_0_0"))  # and the foreign name left alone
        os.unlink(store.segment_path("R_0_0"))
    finally:
        store.sweep()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
async def test_get_through_a_foreign_lock_file_consumes_nothing() -> None:
    store = PosixStore()
    try:
        conn = ShmConnector(store)
        await put(conn, "R_0_0", {"x": 1})
        os.chown(store.lock_path("R_0_0"), 4242, 4242)
        with pytest.raises(CorruptChunk, match="not ours"):
            await conn.get("0", "1", "R_0_0")
        assert store.segments() == ["R_0_0"]  # not consumed: nothing lost to a hostile name
        os.unlink(store.lock_path("R_0_0"))
    finally:
        store.sweep()


async def test_a_symlink_at_a_segment_name_is_a_corrupt_chunk_not_eloop(tmp_path: os.PathLike[str]) -> None:
    store = PosixStore()
    try:
        conn = ShmConnector(store)
        await put(conn, "R_0_0", {"x": 1})
        store.unlink_segment("R_0_0")
        os.symlink(os.path.join(tmp_path, "elsewhere"), store.segment_path("R_0_0"))
        with pytest.raises(CorruptChunk):
            await conn.get("0", "1", "R_0_0")
        os.unlink(store.segment_path("R_0_0"))
    finally:
        store.sweep()


async def test_a_lock_held_forever_fails_the_put_in_bounded_time(store: Store) -> None:
    conn = ShmConnector(store, lock_timeout_s=0.2)
    holder = store.open_lock("R_0_0", create=True)
    assert holder is not None and holder.try_acquire()
    try:
        with trio.fail_after(5):
            result = await conn.put("0", "1", "R_0_0", {"x": 1})
        assert not result.ok and "stayed held" in result.metadata["error"]
    finally:
        holder.close()
    await put(conn, "R_0_0", {"x": 2})  # once it is free, the key works again
    assert await get(conn, "R_0_0") == {"x": 2}


@pytest.mark.parametrize("stage_id", [None, "talker", -1])
async def test_a_stage_id_that_is_not_an_int_polls(stage_id: Any) -> None:
    from runtime.connectors.wakeup import LocalWakeups

    conn = ShmConnector(MemoryStore(), stage_id=stage_id, wakeups=LocalWakeups())
    assert conn.get_wakeup_generation() is None
    assert await conn.wait_for_change(0, timeout=0.01) is False


async def test_reap_removes_the_lock_file_a_dead_reader_left(store: Store) -> None:
    """A reader killed after it unlinked the segment but before it removed the lock file leaves
    the lock file alone; the producer's reap forgets the key and removes that file."""
    producer = ShmConnector(store)
    await put(producer, "R_0_0", {"x": 1})
    store.unlink_segment("R_0_0")  # what the dead reader did
    assert residue(store) == ([], ["R_0_0"])
    producer.reap_consumed()
    assert pending(producer) == []
    assert residue(store) == ([], [])


async def test_a_get_acts_on_one_namespace_even_if_its_producer_moves_meanwhile() -> None:
    """A producer restarted in a new namespace while a get of the old one's key is under way: the
    get consumes, retires and unlocks the old namespace's key, and leaves the new one's alone."""
    old, new = PosixStore(), PosixStore()
    try:
        for store, value in ((old, 1), (new, 2)):
            await put(ShmConnector(store), "R_0_0", {"v": value})
        consumer = ShmConnector(old, upstream=old)

        def producer_moves() -> bool:  # asked under the key's lock, before the bytes are taken
            consumer.upstream = new
            return True

        got = await consumer.get("0", "1", "R_0_0", claim=producer_moves)
        assert got is not None and got[0] == {"v": 1}
        assert residue(old) == ([], [])
        assert residue(new) == (["R_0_0"], ["R_0_0"])
        assert (await get(consumer, "R_0_0")) == {"v": 2}
    finally:
        old.sweep()
        new.sweep()


@pytest.mark.parametrize("then", ["cleanup_prefix", "close", "failed_cleanup"])
async def test_a_put_that_raises_after_making_its_segment_leaves_it_tracked(
    store: Store, monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    """A put that raises (a bug, an interrupted call) may leave its segment; if no exact cleanup of
    the key comes (it raised too: found by cleanup_raises under sampled faults), or one that fails
    (found by failed_cleanup: the key was tracked as of unknown make, and forgotten), the
    request's prefix cleanup or the connector's close must still find it."""
    conn = ShmConnector(store, stage_id=1)

    async def raises(frame: EncodedFrame, segment: Any, generation: int = 0) -> int:
        raise RuntimeError("interrupted")

    monkeypatch.setattr(ShmConnector, "_write_body", staticmethod(raises))
    with pytest.raises(RuntimeError):
        await conn.put("1", "2", "R_1_0", {"x": 1})
    monkeypatch.undo()
    assert store.segments() == ["R_1_0"]
    if then == "cleanup_prefix":
        assert await conn.cleanup_prefix("R_1_") == 1
    if then == "failed_cleanup":
        failing_unlinks(store, monkeypatch, "R_1_0", times=1)
        assert await conn.cleanup("R_1_0") is False
    await conn.close()
    assert store.segments() == [] and store.lock_files() == []
