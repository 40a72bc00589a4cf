"""Producer and consumer in different OS processes on one PosixStore namespace (spec §2.6, §2.7,
§2.9): the consumer's get removes what the producer's reap then forgets, flock excludes across
processes, and a FIFO wakeup crosses the process boundary."""

from __future__ import annotations

import json
import os
import select
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from runtime.connectors import posix_store
from runtime.connectors.posix_store import SHM_DIR, PosixStore
from runtime.connectors.shm import ShmConnector
from runtime.connectors.stores import SPARE_MIN_BYTES
from runtime.connectors.wakeup import FifoWakeups
from runtime.real_kernel import RealKernel

REPO_ROOT = Path(__file__).resolve().parent.parent
CHILD_TIMEOUT_S = 60.0


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def spawn(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        cwd=REPO_ROOT,
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def read_json_line(proc: subprocess.Popen[str], timeout: float = CHILD_TIMEOUT_S) -> Any:
    """The child's next stdout line, parsed; fails (and kills the child) if none comes in time."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"child printed nothing within {timeout}s; stderr:\n{err}")
    line = proc.stdout.readline()
    if not line:
        _, err = proc.communicate(timeout=timeout)
        pytest.fail(f"child exited ({proc.returncode}) without output; stderr:\n{err}")
    return json.loads(line)


def reap_child(proc: subprocess.Popen[str]) -> None:
    """Kill a child a failed test left running."""
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def finish(proc: subprocess.Popen[str]) -> None:
    try:
        _, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{err}"


def names_of(namespace: str) -> list[str]:
    """What a namespace holds besides its owner record (which lasts as long as the owner's store)."""
    stem = f"omnisim-{namespace}-"
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(stem) and n != f"{stem}owner")


CONSUMER = r"""
import json, sys, trio
from runtime.connectors.posix_store import PosixStore
from runtime.connectors.shm import ShmConnector

async def main(namespace, n):
    conn = ShmConnector(PosixStore(namespace), stage_id=1)
    out = []
    for i in range(n):
        got = await conn.get("0", "1", f"R_0_{i}")
        out.append(None if got is None else [got[0]["i"], got[0]["t"].tolist(), got[1]])
    missing = await conn.get("0", "1", "R_0_999")
    out.append(missing)
    await conn.close()
    print(json.dumps(out), flush=True)

trio.run(main, sys.argv[1], int(sys.argv[2]))
"""


def test_consumer_process_takes_keys_and_producer_reap_forgets_them() -> None:
    store = PosixStore()
    producer = ShmConnector(store, stage_id=0)
    n = 20
    sizes: list[int] = []

    async def put_all() -> None:
        for i in range(n):
            result = await producer.put("0", "1", f"R_0_{i}", {"i": i, "t": torch.arange(i, dtype=torch.int32)})
            assert result.ok
            sizes.append(result.size)

    try:
        trio.run(put_all)
        assert len(producer.residue()["pending_keys"]) == n
        assert len(store.segments()) == n and len(store.lock_files()) == n

        child = spawn(CONSUMER, store.namespace, str(n))
        try:
            out = read_json_line(child)
            finish(child)
        finally:
            reap_child(child)
        assert out[-1] is None
        assert out[:-1] == [[i, list(range(i)), sizes[i]] for i in range(n)]

        # The consumer removed every segment and lock file; the producer still lists the keys.
        assert store.segments() == [] and store.lock_files() == []
        assert len(producer.residue()["pending_keys"]) == n
        producer.reap_consumed()
        assert producer.residue()["pending_keys"] == []
        trio.run(producer.close)
        assert names_of(store.namespace) == []
    finally:
        store.sweep()


LARGE_CONSUMER = r"""
import json, sys, trio
from runtime.connectors.posix_store import PosixStore
from runtime.connectors.shm import ShmConnector

async def main(upstream, keys):
    own = PosixStore()
    conn = ShmConnector(own, stage_id=1, upstream=PosixStore(upstream))
    out = []
    for key in keys.split(","):
        got = await conn.get("0", "1", key)
        out.append(None if got is None else [float(got[0]["t"][0]), got[0]["t"].numel()])
    await conn.close()
    own.sweep()
    print(json.dumps(out), flush=True)

trio.run(main, sys.argv[1], sys.argv[2])
"""


def test_a_consumer_process_hands_large_segments_back_to_its_producer() -> None:
    """A consumer in another process keeps each large segment it took as a spare of the
    producer's namespace; the producer's next puts write into those, and what the consumer reads
    from them is what was put."""
    store = PosixStore()
    producer = ShmConnector(store, stage_id=0)
    n = SPARE_MIN_BYTES // 4 + 16

    async def put_all(first: int) -> None:
        for i in range(first, first + 3):
            assert (await producer.put("0", "1", f"R_0_{i}", {"t": torch.full((n + i,), float(i))})).ok

    def consume(first: int) -> list[Any]:
        child = spawn(LARGE_CONSUMER, store.namespace, ",".join(f"R_0_{i}" for i in range(first, first + 3)))
        try:
            out = read_json_line(child)
            finish(child)
        finally:
            reap_child(child)
        return out

    try:
        trio.run(put_all, 0)
        assert store.spares() == []
        assert consume(0) == [[float(i), n + i] for i in range(3)]
        assert store.spares() == ["R_0_0", "R_0_1", "R_0_2"] and store.segments() == []
        inodes = {os.stat(os.path.join(SHM_DIR, f"omnisim-{store.namespace}-spare-{k}")).st_ino for k in store.spares()}
        trio.run(put_all, 3)
        assert store.spares() == []
        assert {os.stat(store.segment_path(f"R_0_{i}")).st_ino for i in range(3, 6)} == inodes
        assert consume(3) == [[float(i), n + i] for i in range(3, 6)]
        trio.run(producer.close)
        assert names_of(store.namespace) == []
    finally:
        store.sweep()


LOCK_HOLDER = r"""
import sys
from runtime.connectors.posix_store import PosixStore

store = PosixStore(sys.argv[1])
lock = store.open_lock(sys.argv[2], create=False)
print('{"held": %s}' % ("true" if lock is not None and lock.try_acquire() else "false"), flush=True)
sys.stdin.readline()
lock.close()
print('{"released": true}', flush=True)
"""


def test_lock_held_by_another_process_blocks_get() -> None:
    store = PosixStore()
    conn = ShmConnector(store)
    try:
        assert trio.run(conn.put, "0", "1", "R_0_0", [1, 2]).ok
        child = spawn(LOCK_HOLDER, store.namespace, "R_0_0")
        try:
            assert read_json_line(child) == {"held": True}
            assert trio.run(conn.get, "0", "1", "R_0_0") is None
            mine = store.open_lock("R_0_0", create=False)
            assert mine is not None
            assert mine.try_acquire() is False
            mine.close()
            assert store.segments() == ["R_0_0"]
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
            assert read_json_line(child) == {"released": True}
            finish(child)
        finally:
            reap_child(child)
        got = trio.run(conn.get, "0", "1", "R_0_0")
        assert got is not None and got[0] == [1, 2]
        assert names_of(store.namespace) == []
    finally:
        store.sweep()


WAITER = r"""
import json, sys, time, trio
from runtime.connectors.posix_store import PosixStore
from runtime.connectors.shm import ShmConnector
from runtime.connectors.wakeup import FifoWakeups

async def main(namespace):
    conn = ShmConnector(PosixStore(namespace), stage_id=1, wakeups=FifoWakeups(namespace))
    gen = conn.get_wakeup_generation()
    before = await conn.get("0", "1", "W_0_0")  # the poll pass that found nothing
    print(json.dumps({"generation": gen, "before": before}), flush=True)
    start = time.monotonic()
    changed = await conn.wait_for_change(gen, timeout=5)
    returned = time.monotonic()
    got = await conn.get("0", "1", "W_0_0")
    new_gen = conn.get_wakeup_generation()
    await conn.close()
    print(json.dumps({
        "changed": changed, "start": start, "returned": returned, "new_generation": new_gen,
        "payload": None if got is None else got[0]["v"].tolist(),
    }), flush=True)

trio.run(main, sys.argv[1])
"""


def test_fifo_wakeup_crosses_processes() -> None:
    store = PosixStore()
    namespace = store.namespace
    producer_wakeups = FifoWakeups(namespace)
    producer = ShmConnector(store, stage_id=0, wakeups=producer_wakeups)
    try:
        child = spawn(WAITER, namespace)
        try:
            first = read_json_line(child)
            assert first == {"generation": 0, "before": None}
            fifos = os.listdir(producer_wakeups.directory)
            assert len(fifos) == 1 and fifos[0].startswith("1_")
            time.sleep(0.3)  # let the child settle into its wait

            async def put() -> float:
                put_at = time.monotonic()
                assert (await producer.put("0", "1", "W_0_0", {"v": torch.tensor([7, 8, 9])})).ok
                return put_at

            put_at = trio.run(put)
            report = read_json_line(child, timeout=10)
            finish(child)
        finally:
            reap_child(child)

        assert report["changed"] is True
        assert report["new_generation"] == 1
        assert report["payload"] == [7, 8, 9]
        waited = report["returned"] - report["start"]
        latency = report["returned"] - put_at  # CLOCK_MONOTONIC is system-wide on Linux
        assert 0.1 < waited < 4.5, waited  # it really waited, and did not time out
        assert -0.01 < latency < 1.0, latency
        # The child closed its receiver: its FIFO and the (now empty) directory are gone.
        assert not os.path.exists(producer_wakeups.directory)
        producer.reap_consumed()
        assert producer.residue()["pending_keys"] == []
        trio.run(producer.close)
        assert names_of(namespace) == []
    finally:
        store.sweep()


# -- FifoWakeups in one process --------------------------------------------------------------


async def test_fifo_wakeup_in_process_and_no_spin() -> None:
    namespace = posix_store.new_namespace()  # a namespace no store claimed
    receiver, sender = FifoWakeups(namespace), FifoWakeups(namespace)
    try:
        gen = receiver.generation("1")
        assert gen == 0
        assert receiver.generation("../x") is None  # a channel that is not a safe name has no FIFO
        sender.notify("../x")  # ignored
        sender.notify("2")  # nobody listens on stage 2
        start = time.monotonic()
        assert await receiver.wait_for_change("1", gen, timeout=0.05) is False
        assert time.monotonic() - start >= 0.04

        for _ in range(3):
            sender.notify("1")  # several wakeups before the wait drain as one change
        start = time.monotonic()
        assert await receiver.wait_for_change("1", gen, timeout=5) is True
        assert time.monotonic() - start < 1.0
        gen = receiver.generation("1")
        assert gen == 1
        # Drained: the next wait times out instead of spinning on stale bytes or EOF.
        assert await receiver.wait_for_change("1", gen, timeout=0.05) is False
        # A stale snapshot returns at once.
        assert await receiver.wait_for_change("1", 0, timeout=5) is True
    finally:
        receiver.close()
        sender.close()
    assert names_of(namespace) == []


async def test_a_wait_that_outlives_its_close_reads_nothing_from_a_reused_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wakeups close while a wait is in flight, and the descriptor's number goes to another
    file (found by upstream's own connector tests): the wait ends, said "no change", having read
    nothing of that file."""
    namespace = posix_store.new_namespace()
    receiver = FifoWakeups(namespace)
    gen = receiver.generation("1")
    assert gen is not None
    read_fd = receiver._receivers["1"].read_fd
    other = tmp_path / "unrelated"
    other.write_bytes(b"untouched")
    reused: list[int] = []

    async def closed_while_waiting(*args: object, **kwargs: object) -> bool:
        receiver.close()
        fd = os.open(other, os.O_RDONLY)
        if fd != read_fd:
            os.dup2(fd, read_fd)
            os.close(fd)
        reused.append(read_fd)
        return True

    monkeypatch.setattr(RealKernel, "wait_readable", closed_while_waiting)
    try:
        assert await receiver.wait_for_change("1", gen, timeout=5) is False
        assert os.lseek(read_fd, 0, os.SEEK_CUR) == 0
    finally:
        for fd in reused:
            os.close(fd)
    assert names_of(namespace) == []


async def test_a_poke_wakes_the_processs_own_wait_as_a_put_would() -> None:
    """A registration made while the receive loop waits for a put pokes the loop's own FIFO."""
    namespace = posix_store.new_namespace()
    receiver = FifoWakeups(namespace)
    try:
        receiver.poke("1")  # no FIFO for stage 1 yet: nothing to wake
        gen = receiver.generation("1")
        receiver.poke("1")
        start = time.monotonic()
        assert await receiver.wait_for_change("1", gen, timeout=5) is True
        assert time.monotonic() - start < 1.0
        assert await receiver.wait_for_change("1", receiver.generation("1"), timeout=0.05) is False  # drained
    finally:
        receiver.close()
    assert names_of(namespace) == []


async def test_a_ring_producer_waits_for_room_on_its_own_channel() -> None:
    namespace = posix_store.new_namespace()
    producer, consumer = FifoWakeups(namespace), FifoWakeups(namespace)
    try:
        gen = producer.generation("room_edge_1_2")
        assert gen == 0 and producer.generation("1") == 0
        consumer.notify("room_edge_1_23")  # another edge's channel: not this one
        consumer.notify("1")  # the stage's arrivals: not the room channel
        assert await producer.wait_for_change("room_edge_1_2", gen, timeout=0.05) is False
        consumer.notify("room_edge_1_2")
        assert await producer.wait_for_change("room_edge_1_2", gen, timeout=5) is True
    finally:
        producer.close()
        consumer.close()
    assert names_of(namespace) == []


def test_a_dead_receivers_fifo_is_removed_by_the_next_notify() -> None:
    """A stage process killed with SIGKILL never closes its receiver: its FIFO, with no reader
    left, is removed by the next sender instead of being tried on every notify forever."""
    namespace = posix_store.new_namespace()  # a namespace no store claimed
    live, sender = FifoWakeups(namespace), FifoWakeups(namespace)
    try:
        assert live.generation("1") == 0
        dead = os.path.join(live.directory, "1_" + "0" * 32)
        os.mkfifo(dead, 0o600)  # what a killed receiver leaves: a FIFO nobody reads
        sender.notify("1")
        assert os.listdir(live.directory) == [os.path.basename(live._receivers["1"].path)]
        assert live._receivers["1"].drain()  # the live receiver still got its wakeup
    finally:
        live.close()
        sender.close()
    assert names_of(namespace) == []


def test_fifo_wakeups_close_unlinks_fifo_and_directory() -> None:
    namespace = posix_store.new_namespace()  # a namespace no store claimed
    a, b = FifoWakeups(namespace), FifoWakeups(namespace)
    assert a.generation("1") == 0
    assert b.generation("1") == 0
    entries = sorted(os.listdir(a.directory))
    assert len(entries) == 2
    for entry in entries:
        st = os.stat(os.path.join(a.directory, entry))
        assert (st.st_mode & 0o777) == 0o600
        assert stat.S_ISFIFO(st.st_mode)
    assert (os.stat(a.directory).st_mode & 0o777) == 0o700

    a.close()
    assert os.path.isdir(b.directory)  # b's FIFO is still there: only a's own FIFO went
    assert len(os.listdir(b.directory)) == 1
    assert a.generation("1") is None
    b.close()
    assert not os.path.exists(b.directory)
    b.close()  # idempotent
    assert names_of(namespace) == []


async def test_closed_fifo_wakeups_wait_returns_false() -> None:
    namespace = posix_store.new_namespace()  # a namespace no store claimed
    w = FifoWakeups(namespace)
    gen = w.generation("3")
    assert gen == 0
    w.close()
    start = time.monotonic()
    assert await w.wait_for_change("3", gen, timeout=5) is False
    assert time.monotonic() - start < 0.5
    assert names_of(namespace) == []


async def test_connector_wakeup_generation_needs_stage_id() -> None:
    store = PosixStore()
    conn = ShmConnector(store, wakeups=FifoWakeups(store.namespace))  # stage_id -1
    try:
        assert conn.get_wakeup_generation() is None
        await conn.close()
        assert conn.get_wakeup_generation() is None
        assert await conn.wait_for_change(0, timeout=5) is False
        assert names_of(store.namespace) == []
    finally:
        store.sweep()
