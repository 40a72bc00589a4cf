"""The per-edge ring (omnisim issue 13) under the real kernel, on real /dev/shm.

The protocol's interleavings are explored by the simulator (``--store ring``, the ``ring_*``
scenarios and mutants); these tests pin what one connector pair does, in one process and across
two, and what a full /dev/shm does to a ring.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from invariants.dataplane import ring_frames_held
from omnisim import registry
from omnisim.explore import explore
from runtime.connectors import ring as rings
from runtime.connectors.base import CorruptChunk
from runtime.connectors.posix_store import PosixStore
from runtime.connectors.ring import Ring, RingSettings
from runtime.connectors.shm import ShmConnector
from runtime.connectors.stores import MemoryStore, Store
from tests.conftest import REPO_ROOT, fresh_namespace
from tests.test_crash_safety import _in_tiny_shm, needs_root

registry.load()

#: A small ring: four 3.5 KB chunks fill it.
SMALL = RingSettings(capacity=16 << 10)


@pytest.fixture(params=["memory", "posix"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    s: Store = MemoryStore() if request.param == "memory" else PosixStore()
    yield s
    s.sweep()


def chunk(i: int, frames: int = 25) -> dict[str, Any]:
    return {"codes": {"audio": torch.arange(16 * frames, dtype=torch.int64).reshape(16, frames) + i}, "i": i}


def pair(store: Store, settings: RingSettings = SMALL) -> tuple[ShmConnector, ShmConnector]:
    return ShmConnector(store, stage_id=1, send_ring=settings), ShmConnector(store, stage_id=2, receive_ring=True)


async def put(conn: ShmConnector, key: str, data: object) -> None:
    result = await conn.put("1", "2", key, data)
    assert result.ok, result


async def take(conn: ShmConnector, key: str) -> Any:
    got = await conn.get("1", "2", key)
    assert got is not None, f"{key} did not arrive"
    return got[0]


async def close(*conns: ShmConnector) -> None:
    for conn in conns:
        await conn.close()


async def test_a_poll_for_a_chunk_not_there_takes_no_lock(store: Store) -> None:
    """Upstream's rule: an empty poll never waits for the ring's lock (another reader holds it
    while it copies a chunk out; one stopped mid-copy holds it until it goes on)."""
    producer, consumer = pair(store)
    await put(producer, "R_1_0", chunk(0))
    assert await take(consumer, "R_1_0") is not None
    await put(producer, "R_1_1", chunk(1))
    other = store.open_ring("edge_1_2")
    assert other is not None and other.try_lock()  # (a reader mid-copy)
    started = trio.current_time()
    for i in range(50):
        assert await consumer.get("1", "2", f"R_1_{i + 2}") is None
    assert trio.current_time() - started < rings.LOCK_WAIT_S  # (one wait for the lock would be this long)
    assert await consumer.get("1", "2", "R_1_1") is None  # (there: the get waits for the lock, in vain)
    other.unlock()
    assert (await take(consumer, "R_1_1"))["i"] == 1
    other.close()
    await close(producer, consumer)


def test_a_look_without_the_lock_tells_only_when_the_tail_stayed() -> None:
    store = MemoryStore()
    memory = store.create_ring("edge_1_2", SMALL.capacity)
    ring = Ring.made(memory, None)
    taken = ring.reserve("R_1_0", 100)
    assert taken is not None and ring.commit(taken)
    unread = ring.reserve("R_1_1", 100)
    assert unread is not None and ring.commit(unread)
    assert ring.lacks("R_1_9") and not ring.lacks("R_1_1")
    ring.set_state(taken, rings.DONE)
    real = Ring._find

    def look_while_the_tail_moves(self: Ring, key: str, pos: int, head: int) -> Any:
        found = real(self, key, pos, head)
        self.release_finished()  # (another process, between the look and its check)
        return found

    Ring._find = look_while_the_tail_moves  # type: ignore[method-assign]
    try:
        assert not ring.lacks("R_1_9")  # (cannot tell: a frame it walked may have been rewritten)
    finally:
        Ring._find = real  # type: ignore[method-assign]
    assert ring.lacks("R_1_9")
    at = rings.HEADER_SIZE + unread.pos % ring.data_size
    ring.view[at : at + 4] = b"\xff" * 4  # (a stray write over the unread frame's state)
    assert not ring.lacks("R_1_9")  # (the look under the lock finds out)
    ring.close()


async def test_small_chunks_go_on_the_ring_and_round_trip(store: Store) -> None:
    producer, consumer = pair(store)
    for i in range(40):  # ten times round the ring
        await put(producer, f"R_1_{i}", chunk(i))
        assert torch.equal((await take(consumer, f"R_1_{i}"))["codes"]["audio"], chunk(i)["codes"]["audio"])
    assert producer.health()["ring_puts"] == 40
    assert store.segments() == [] and store.lock_files() == []
    assert store.rings() == ["edge_1_2"]
    await close(producer, consumer)
    assert store.rings() == [] and store.open_handles() == []


async def test_a_payload_too_large_for_the_ring_takes_a_segment(store: Store) -> None:
    producer, consumer = pair(store)
    await put(producer, "R_1_0", chunk(0, frames=200))  # 25.6 KB > a quarter of 16 KiB
    assert producer.health()["ring_puts"] == 0 and store.segments() == ["R_1_0"]
    assert (await take(consumer, "R_1_0"))["i"] == 0
    await close(producer, consumer)


async def test_a_full_ring_sends_the_rest_to_segments_and_loses_nothing(store: Store) -> None:
    producer, consumer = pair(store)
    for i in range(10):
        await put(producer, f"R_1_{i}", chunk(i))
    health = producer.health()
    assert health["ring_puts"] == 4 and health["ring_fallbacks"] == 6
    assert len(store.segments()) == 6
    for i in reversed(range(10)):  # any order: a chunk is found by its key, wherever it went
        assert (await take(consumer, f"R_1_{i}"))["i"] == i
    await put(producer, "R_1_10", chunk(10))  # the ring has room again
    assert producer.health()["ring_puts"] == 5
    await close(producer, consumer)


async def test_cleanup_cancels_an_unread_frame_and_frees_its_room(store: Store) -> None:
    producer, consumer = pair(store)
    for i in range(4):
        await put(producer, f"R_1_{i}", chunk(i))
    assert await producer.cleanup_prefix("R_1_") == 4
    assert await consumer.get("1", "2", "R_1_0") is None
    for i in range(4):  # the cancelled frames' room is reused at once
        await put(producer, f"S_1_{i}", chunk(i))
    assert producer.health()["ring_fallbacks"] == 0
    unread = [f"S_1_{i}" for i in range(4)]
    assert producer.residue() == {"pending_keys": unread, "held_locks": [], "ring_keys": unread, "putting": []}
    await close(producer, consumer)


async def test_a_put_replaces_the_unread_frame_of_its_key(store: Store) -> None:
    producer, consumer = pair(store)
    await put(producer, "R_1_0", chunk(1))
    await put(producer, "R_1_0", chunk(2))
    # the replacement goes on the ring too (found by ring-before-segments: it once took a segment,
    # the key looking as if its unread payload were in one once its frame was cancelled)
    assert producer.health()["ring_puts"] == 2 and store.segments() == []
    assert (await take(consumer, "R_1_0"))["i"] == 2
    assert await consumer.get("1", "2", "R_1_0") is None
    # and a replacement too large for the ring leaves no older frame readable either
    await put(producer, "R_1_1", chunk(3))
    await put(producer, "R_1_1", chunk(4, frames=200))
    assert (await take(consumer, "R_1_1"))["i"] == 4
    assert await consumer.get("1", "2", "R_1_1") is None
    await close(producer, consumer)


async def test_corrupt_bytes_on_the_ring_are_a_corrupt_chunk_and_consumed(store: Store) -> None:
    producer, consumer = pair(store)
    await put(producer, "R_1_0", chunk(0))
    memory = store.open_ring("edge_1_2")
    ring = Ring.attach(memory) if memory is not None else None
    assert ring is not None
    frame = ring.find("R_1_0")
    assert frame is not None
    ring.view[frame.payload_at + frame.payload_len // 2] ^= 0xFF
    ring.close()
    with pytest.raises(CorruptChunk, match="R_1_0"):
        await consumer.get("1", "2", "R_1_0")
    assert await consumer.get("1", "2", "R_1_0") is None
    await close(producer, consumer)


def _stray_write(store: Store, where: str) -> None:
    """What a stray write of another process of ours could leave in the edge's ring."""
    memory = store.open_ring("edge_1_2")
    ring = Ring.attach(memory) if memory is not None else None
    assert ring is not None
    frame = next(ring.frames())
    at = ring._at(frame.pos)
    if where == "span":  # unaligned: the next frame would start inside this one's payload
        rings.FRAME.pack_into(ring.view, at, frame.state, len(frame.key), frame.payload_len, frame.span + 3)
    elif where == "payload length":  # longer than its span: a copy-out would run into the next frame
        rings.FRAME.pack_into(ring.view, at, frame.state, len(frame.key), frame.span, frame.span)
    elif where == "magic":  # a header that no longer names a ring
        ring.view[: len(rings.MAGIC)] = b"XXXX"
    elif where == "producer":  # a header naming a producer that is not the namespace's owner
        rings.HEADER.pack_into(ring.view, 0, rings.MAGIC, rings.VERSION, ring.capacity, ring.head, ring.tail, 1, 0, 1)
    else:  # a head past the tail by more than the ring
        ring._words[rings._HEAD_AT // 8] = ring.tail + 2 * ring.data_size
    ring.close()


@pytest.mark.parametrize("where", ["span", "payload length", "head", "magic", "producer"])
async def test_a_corrupt_ring_is_retired_and_the_edge_goes_on_with_a_new_one(store: Store, where: str) -> None:
    """No exception out of bytes a producer of ours never wrote: the reader's get finds nothing
    there and retires the ring, the producer's next put makes a new one, and the edge goes on."""
    if where == "producer" and store.owner() is None:
        pytest.skip("a store without an owner record (in memory) names no producer to check")
    producer, consumer = pair(store)
    await put(producer, "R_1_0", chunk(0))
    await put(producer, "R_1_1", chunk(1))
    _stray_write(store, where)
    assert await consumer.get("1", "2", "R_1_1") is None  # lost with the ring, not raised
    await put(producer, "R_1_2", chunk(2))  # on a new ring
    assert (await take(consumer, "R_1_2"))["i"] == 2
    for key in ("R_1_0", "R_1_1"):  # each lost chunk's get says so now, not at its deadline
        with pytest.raises(CorruptChunk, match=f"{key}: its producer lost it: its frame went with the corrupt ring"):
            await consumer.get("1", "2", key)
    assert producer.health()["ring_puts"] == 3
    await producer.cleanup_prefix("R_1_")
    await close(producer, consumer)
    assert store.rings() == [] and store.segments() == [] and store.lock_files() == []


@pytest.mark.parametrize("where", ["span", "magic"])
@pytest.mark.parametrize("found_by", ["reader", "cleanup"])
async def test_a_producer_removes_its_corrupt_ring_without_waiting_for_a_put(
    store: Store, found_by: str, where: str
) -> None:
    """A corrupt ring holds nothing anyone reads: its producer removes it as soon as it learns,
    from its reader's retirement (at its next reap) or by finding it so itself, even if the edge
    never sees another put."""
    producer, consumer = pair(store)
    await put(producer, "R_1_0", chunk(0))
    await put(producer, "R_1_1", chunk(1))
    _stray_write(store, where)
    if found_by == "reader":
        assert await consumer.get("1", "2", "R_1_1") is None
        producer.reap_consumed()
    else:
        assert await producer.cleanup("R_1_0") is False  # the frame broken: lost with the ring
    assert store.rings() == []
    assert producer.residue()["ring_keys"] == []
    await close(producer, consumer)
    assert store.rings() == [] and store.segments() == [] and store.lock_files() == []


@pytest.mark.parametrize("walk", ["reap", "cleanup"])
async def test_a_frame_released_between_two_looks_of_its_producer_is_taken_not_corrupt(
    store: Store, walk: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The producer walks its frames without the lock; a reader in another process may release
    one between two of its reads of the tail (found by a review of stage processes: a healthy
    ring was retired as corrupt, its unread chunks lost, a request left to its input deadline).
    Here the first read of the tail is the one from before the reader's release."""
    producer, consumer = pair(store)
    await put(producer, "R_1_0", chunk(0))
    await put(producer, "R_1_1", chunk(1))
    stale = [producer._send_rings["edge_1_2"].tail]
    assert (await take(consumer, "R_1_0"))["i"] == 0  # taken and released: the tail moves past it
    fresh = Ring.tail.fget
    monkeypatch.setattr(Ring, "tail", property(lambda ring: stale.pop() if stale else fresh(ring)))
    if walk == "reap":
        producer.reap_consumed()
    else:
        assert await producer.cleanup("R_1_0") is False  # taken already: nothing removed
    monkeypatch.undo()
    assert store.rings() == ["edge_1_2"] and not producer._send_rings["edge_1_2"].retired
    assert (await take(consumer, "R_1_1"))["i"] == 1  # the ring and the chunk on it are still there
    await producer.cleanup_prefix("R_1_")
    await close(producer, consumer)


def test_a_ring_its_producer_is_still_making_is_left_alone_by_a_reader(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new ring is under its name, all zeros, before its producer writes its header (found by
    a soak: a restarted Talker's reader looked in that moment, its producer wrote the header
    meanwhile, the reader retired the new ring, and the chunks put on it were lost). Until the
    header's last store, its magic, a reader finds no ring there and lets it be."""
    created = store.create_ring("edge_1_2", SMALL.capacity)
    well_formed = Ring.well_formed
    made: list[Ring] = []

    def producer_finishes_meanwhile(ring: Ring) -> bool:
        judged = well_formed(ring)
        if not made:
            made.append(Ring.made(created, store.owner()))
        return judged

    monkeypatch.setattr(Ring, "well_formed", producer_finishes_meanwhile)
    memory = store.open_ring("edge_1_2")
    assert memory is not None and Ring.attach(memory, retire_malformed=True) is None
    assert not any(ring.retired for ring in made)  # (made: the reader judged the zeros, then the header came)
    monkeypatch.undo()
    # What `made` leaves just before its last store (every field but the first word), as a
    # reader may find it.
    before_last_store: list[bytes] = []
    header = rings.HEADER

    class Header:
        def pack_into(self, view: memoryview, at: int, *fields: object) -> None:
            header.pack_into(view, at, *fields)
            before_last_store.append(bytes(view[: rings.HEADER_SIZE]))

    monkeypatch.setattr(rings, "HEADER", Header())
    half = Ring.made(created, store.owner())
    half._words.release()  # (its views only: the memory stays open, it is `created`)
    half._u32.release()
    monkeypatch.undo()
    created.view[: rings.HEADER_SIZE] = before_last_store[0]
    memory = store.open_ring("edge_1_2")
    assert memory is not None and Ring.attach(memory, retire_malformed=True) is None
    assert int.from_bytes(created.view[rings._RETIRED_AT : rings._RETIRED_AT + 4], "little") == 0  # (not retired)
    ring = Ring.made(created, store.owner())
    memory = store.open_ring("edge_1_2")
    assert memory is not None
    seen = Ring.attach(memory, retire_malformed=True)
    assert seen is not None and not ring.retired and not seen.retired
    seen.close()
    ring.close()


def test_a_look_without_the_lock_never_sees_a_frame_with_no_state() -> None:
    """A frame's state is written in one store while the other side may look without the lock
    (found by a soak: a reader's DONE written with ``struct.pack_into``, which zeroes the bytes
    before it writes them, read as state 0 by its producer's reap, which retired the healthy ring
    as corrupt and lost its chunks). A process writes states as fast as it can; this one looks."""
    store = PosixStore()
    try:
        ring = Ring.made(store.create_ring("edge_1_2", SMALL.capacity), store.owner())
        frame = ring.reserve("R_1_0", 100)
        assert frame is not None
        child = os.fork()
        if child == 0:  # the writer: it never returns
            ends = time.monotonic() + 0.3
            while time.monotonic() < ends:
                for _ in range(1000):
                    ring.set_state(frame, rings.READY)
                    ring.set_state(frame, rings.DONE)
            os._exit(0)
        seen: set[int] = set()
        ends = time.monotonic() + 0.3
        while time.monotonic() < ends:
            seen.update(ring._state(frame) for _ in range(1000))
        os.waitpid(child, 0)
        assert seen <= {rings.WRITING, rings.READY, rings.DONE} and rings.DONE in seen, seen
        ring.close()
    finally:
        store.sweep()


def test_a_reader_never_retires_a_ring_whose_head_moved_while_it_looked(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader judges a header without the lock: a head and a tail read on either side of a
    move may make no sense together. Only a header that held still while it was judged is
    malformed."""
    made = Ring.made(store.create_ring("edge_1_2", SMALL.capacity), store.owner())
    well_formed = Ring.well_formed
    moves = [True]

    def judged_across_a_move(ring: Ring) -> bool:
        if moves and ring is not made:
            moves.pop()
            made._words[rings._HEAD_AT // 8] += rings.ALIGN  # the producer put a frame meanwhile
            made._words[rings._TAIL_AT // 8] += rings.ALIGN  # and its reader released one
            return False  # (what the two reads on either side of that move added up to)
        return well_formed(ring)

    monkeypatch.setattr(Ring, "well_formed", judged_across_a_move)
    memory = store.open_ring("edge_1_2")
    assert memory is not None
    seen = Ring.attach(memory, retire_malformed=True)
    assert seen is not None and not made.retired
    seen.close()
    made.close()


async def test_a_put_that_finds_its_ring_corrupt_sends_all_the_same(store: Store) -> None:
    producer, consumer = pair(store)
    await put(producer, "R_1_0", chunk(0))
    _stray_write(store, "span")
    await put(producer, "R_1_1", chunk(1))  # its reap walks the ring first: then a new ring
    assert (await take(consumer, "R_1_1"))["i"] == 1
    await producer.cleanup_prefix("R_1_")
    await close(producer, consumer)
    assert store.rings() == [] and store.segments() == [] and store.lock_files() == []


async def test_a_reader_lets_go_of_a_ring_its_producer_replaced(store: Store) -> None:
    producer, consumer = pair(store)
    await put(producer, "R_1_0", chunk(0))
    assert (await take(consumer, "R_1_0"))["i"] == 0  # the consumer now maps the first ring
    successor = ShmConnector(store, stage_id=1, send_ring=SMALL)  # a restarted producer, same namespace
    await put(successor, "R_1_1", chunk(1))
    assert (await take(consumer, "R_1_1"))["i"] == 1
    await close(producer, successor, consumer)


async def test_a_reader_refuses_a_ring_its_namespace_owner_did_not_make() -> None:
    store = PosixStore()
    producer, consumer = pair(store)
    await put(producer, "R_1_0", chunk(0))
    memory = store.open_ring("edge_1_2")
    assert memory is not None
    rings.HEADER.pack_into(memory.view, 0, rings.MAGIC, rings.VERSION, memory.view.nbytes, 0, 0, 1, 0, 1)
    memory.close()
    assert await consumer.get("1", "2", "R_1_0") is None  # not read: its producer is not the owner
    await close(producer, consumer)
    store.sweep()


async def test_a_ring_name_taken_by_something_else_sends_puts_to_segments() -> None:
    store = PosixStore()
    squatter = f"/dev/shm/omnisim-{store.namespace}-ring-edge_1_2"
    with open(squatter, "w") as f:  # mode 0644: not ours
        f.write("x")
    producer, consumer = pair(store)
    try:
        await put(producer, "R_1_0", chunk(0))
        assert producer.health()["ring_puts"] == 0 and store.segments() == ["R_1_0"]
        assert (await take(consumer, "R_1_0"))["i"] == 0
    finally:
        await close(producer, consumer)
        store.sweep()  # which leaves the squatter alone: it is not ours
        os.unlink(squatter)


CHILD = """
import sys, trio, torch
from runtime.connectors.posix_store import PosixStore
from runtime.connectors.ring import RingSettings
from runtime.connectors.shm import ShmConnector

async def main():
    store = PosixStore(sys.argv[1], claim=True)
    conn = ShmConnector(store, stage_id=1, send_ring=RingSettings(capacity=16 << 10))
    for i in range(int(sys.argv[2])):
        ok = (await conn.put("1", "2", f"R_1_{i}", {"i": i, "t": torch.full((16, 25), i)})).ok
        assert ok
    print("ring_puts", conn.health()["ring_puts"], flush=True)
    sys.stdin.readline()
    await conn.close()
    store.sweep()

trio.run(main)
"""


async def test_a_producer_in_another_process_hands_chunks_over_its_ring() -> None:
    namespace = fresh_namespace()
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CHILD), namespace, "12"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )
    own = PosixStore()
    consumer = ShmConnector(own, stage_id=2, upstream=PosixStore(namespace), receive_ring=True)
    try:
        got: dict[int, int] = {}
        with trio.fail_after(30):
            while len(got) < 12:
                for i in set(range(12)) - set(got):
                    found = await consumer.get("1", "2", f"R_1_{i}")
                    if found is not None:
                        got[i] = int(found[0]["t"][0, 0])
                await trio.sleep(0.01)
        assert got == {i: i for i in range(12)}
        assert child.stdout is not None
        line = child.stdout.readline().split()
        assert line[0] == "ring_puts" and int(line[1]) >= 4, line  # the rest waited, or took segments
    finally:
        assert child.stdin is not None
        child.stdin.write("\n")
        child.stdin.close()
        child.wait(timeout=30)
        await consumer.close()
        own.sweep()


CUT_SHORT = r"""
import os, sys, trio
from runtime.connectors.base import CorruptChunk
from runtime.connectors.posix_store import PosixStore
from runtime.connectors.ring import RingSettings, edge_name
from runtime.connectors.shm import ShmConnector

async def main(length):
    store = PosixStore()
    producer = ShmConnector(store, stage_id=1, send_ring=RingSettings())
    consumer = ShmConnector(store, stage_id=2, receive_ring=True)
    try:
        assert (await producer.put("1", "2", "R_1_0", {"i": 0})).ok
        first = await consumer.get("1", "2", "R_1_0")
        assert first is not None and first[0] == {"i": 0} and producer.health()["ring_puts"] == 1, first
        assert (await producer.put("1", "2", "R_1_1", {"i": 1})).ok
        os.truncate(os.path.join(store.directory, f"omnisim-{store.namespace}-ring-{edge_name('1', '2')}"), length)
        try:  # (its frame went with the ring: nothing, or told it is lost)
            print("unread:", await consumer.get("1", "2", "R_1_1"))
        except CorruptChunk as e:
            print("unread: lost", e)
        assert (await producer.put("1", "2", "R_1_2", {"i": 2})).ok
        got = await consumer.get("1", "2", "R_1_2")
        assert got is not None and got[0] == {"i": 2}, got
        print("ok", producer.health()["ring_puts"])
    finally:
        await producer.close()
        await consumer.close()
        store.sweep()

trio.run(main, int(sys.argv[1]))
"""


@pytest.mark.parametrize("length", [0, 4096])
def test_a_ring_cut_short_under_its_mappings_kills_no_one(length: int) -> None:
    """A process outside the protocol truncates a live ring's file: the producer's next put and
    the reader's next get find it cut short and leave it, without touching the pages past its new
    end (SIGBUS), and the edge goes on (found by an outside audit: both sides died of SIGBUS)."""
    proc = subprocess.run(
        [sys.executable, "-c", CUT_SHORT, str(length)], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok" in proc.stdout, proc.stdout


TINY_SHM_RING = r"""
import trio, numpy as np
from runtime.connectors.posix_store import PosixStore
from runtime.connectors.ring import RingSettings
from runtime.connectors.shm import ShmConnector

async def main():
    store = PosixStore()
    conn = ShmConnector(store, stage_id=1, send_ring=RingSettings(capacity=4 << 20))  # 4 MiB > 1 MiB
    result = await conn.put("1", "2", "R_1_0", {"i": np.arange(10)})
    assert result.ok and conn.health()["ring_puts"] == 0, result
    assert store.rings() == [] and store.segments() == ["R_1_0"], (store.rings(), store.segments())
    await conn.close()
    store.sweep()
    print("ok")

trio.run(main)
"""


@needs_root
def test_a_ring_that_does_not_fit_in_dev_shm_is_never_made() -> None:
    proc = _in_tiny_shm("\0".join([sys.executable, "-c", TINY_SHM_RING]))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok")


@pytest.mark.parametrize("scenario", ["ring_full_slow_consumer", "ring_eager_reader", "ring_wrap_cancel"])
def test_the_ring_scenarios_wrap_around_the_ring(scenario: str) -> None:
    """A ring scenario must meet what it is named for: on the ring store its chunks wrap around
    the ring (and, but for the eager reader's paced producer, find it full), and the run is clean."""
    reserved: list[int] = []
    full: list[bool] = []
    reserve, want_room = Ring.reserve, Ring.want_room

    def spy_reserve(self: Ring, key: str, payload_len: int) -> rings.Frame | None:
        frame = reserve(self, key, payload_len)
        if frame is not None:
            reserved.append(frame.pos)
        return frame

    def spy_want_room(self: Ring) -> None:
        full.append(True)
        want_room(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Ring, "reserve", spy_reserve)
        mp.setattr(Ring, "want_room", spy_want_room)
        res = explore(scenario, strategy="random", budget=3, store="ring")
    assert res.violations == []
    assert max(reserved) > SMALL.capacity, "the ring never wrapped around"
    assert full or scenario == "ring_eager_reader", "the ring never filled"


def test_the_pipeline_on_the_ring_says_exactly_what_it_says_on_segments() -> None:
    from runtime.config.pipeline import load_pipeline
    from runtime.pipeline import Models, build_engine, run_request

    models = Models.build()
    audio = {}
    for transport in ("ring", "segments"):
        store = PosixStore()
        try:
            engine = build_engine(load_pipeline("qwen3_omni").with_transport(transport), models, store)
            result = trio.run(lambda engine=engine, store=store: run_request(engine, store, "the ring and the rest"))
        finally:
            store.sweep()
        assert result.error is None and result.residue == {}, (transport, result.error, result.residue)
        audio[transport] = result.audio.numpy().tobytes()
    assert audio["ring"] == audio["segments"] and len(audio["ring"]) > 0


def test_the_harness_reads_which_frames_hold_ring_space() -> None:
    """``invariants.dataplane.ring_frames_held``: the harness's own reading of a ring (residue at
    quiescence): a frame being written, an unread one, and an aborted write that no commit
    cancelled hold their space; a taken or cancelled one does not; garbage reads as nothing."""
    store = MemoryStore()
    ring = Ring.made(store.create_ring("edge_1_2", 4096), None)
    writing = ring.reserve("R_1_0", 100)
    unread = ring.reserve("R_1_1", 100)
    aborted = ring.reserve("R_1_2", 100)
    taken = ring.reserve("R_1_3", 100)
    assert writing is not None and unread is not None and aborted is not None and taken is not None
    assert ring.commit(unread) and ring.commit(taken)
    ring.set_state(taken, rings.DONE)
    assert ring.cancel("R_1_2", aborted.pos)
    assert ring_frames_held(ring.memory.view) == ["R_1_0 (being written)", "R_1_1 (unread)", "R_1_2 (aborted)"]
    assert not ring.commit(aborted)  # the writer comes back: it cancels what the cleanup aborted
    assert ring_frames_held(ring.memory.view) == ["R_1_0 (being written)", "R_1_1 (unread)"]
    assert ring_frames_held(memoryview(b"\xff" * 4096)) == []


_RING_BYTES = 4096
_DATA = _RING_BYTES - rings.HEADER_SIZE


@given(
    frames=st.binary(min_size=_DATA, max_size=_DATA),
    tail=st.integers(0, 3 * _DATA) | st.sampled_from([0, rings.ALIGN, _DATA]),
    ahead=st.integers(-rings.ALIGN, _DATA + rings.ALIGN),
    keys=st.lists(st.sampled_from(["R_1_0", "R_1_1", "x"]), max_size=3),
)
@settings(max_examples=300, deadline=None)
def test_fuzz_any_ring_bytes_give_frames_or_ring_corrupt(frames: bytes, tail: int, ahead: int, keys: list[str]) -> None:
    """Whatever another process wrote into a ring of ours (its header stays ours: a bad one is
    refused at attach), each move of a reader or a producer ends — a frame, nothing, or
    ``RingCorrupt`` — and never raises anything else out of the bytes."""
    store = MemoryStore()
    memory = store.create_ring("edge_1_2", _RING_BYTES)
    ring = Ring.made(memory, None)
    ring.view[rings.HEADER_SIZE :] = frames
    ring._words[rings._TAIL_AT // 8] = tail
    ring._words[rings._HEAD_AT // 8] = max(0, tail + ahead)
    moves = [
        lambda: list(ring.frames()),
        ring.unconsumed,
        ring.release_finished,
        *(lambda key=key: ring.find(key) for key in keys),
        *(lambda key=key, i=i: ring.cancel(key, tail + i * rings.ALIGN) for i, key in enumerate(keys)),
        *(lambda key=key: ring.reserve(key, 100) for key in keys),
        lambda: ring.frame(tail),
    ]
    for move in moves:
        with contextlib.suppress(rings.RingCorrupt):
            move()
    ring.close()
