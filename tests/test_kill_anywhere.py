"""Kill -9 between any two lines: a real producer or consumer process killed at every line the
connector runs, on the real /dev/shm (segments and the ring).

The simulator kills a process only where a task yields (at a point or an await); a real process
dies wherever it is. Here a forked child runs puts or gets with every line of
``runtime/connectors`` counted and ends itself with ``os._exit`` at the N-th — as SIGKILL ends
it: no ``finally``, no ``atexit``, its flocks released by the kernel — for every N. Then, in this
process: a reader gets each key whole, or not at all, or as a corrupt chunk (never a torn or
foreign payload, never a hang); and what is left is reclaimable — the sweep reclaims a dead
producer's whole namespace, and a live producer's cleanups leave nothing of a dead consumer's
reads (no lock file, no segment, no ring frame).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
import trio
from conftest import OneNamespace

from omnisim.payloads import as_carried, fingerprint
from runtime.connectors import namespaces, posix_store
from runtime.connectors.base import CorruptChunk
from runtime.connectors.posix_store import SHM_DIR, PosixStore
from runtime.connectors.ring import RingSettings
from runtime.connectors.shm import ShmConnector

CONNECTORS = str(Path(__file__).resolve().parent.parent / "runtime" / "connectors")
KILLED = 137
#: Each run's chunks: a tensor beside a list and a flag, and a map keyed by a tuple.
PAYLOADS = (
    {"codes": {"audio": torch.arange(512).reshape(16, 32)}, "meta": {"ids": [1, 2, 3], "finished": False}},
    {"hidden": torch.ones(64, dtype=torch.float16), ("span", 0): [0.5, 1.5]},
)
KEYS = [f"R_0_{i}" for i in range(len(PAYLOADS))]
#: Longer than any get of a few kilobytes may take: a get that outlasts it hangs.
GET_DEADLINE_S = 10.0


class Child:
    """A forked child that runs ``work`` counting every line of ``runtime/connectors`` it executes,
    and ends itself (as SIGKILL would) at the ``n``-th; None: it runs to the end."""

    def __init__(self, n: int | None, work: Callable[[], None]) -> None:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: it never returns
            os.close(read_end)
            count = 0

            def on_line(frame: FrameType, event: str, arg: Any) -> Any:
                nonlocal count
                if event == "line":
                    count += 1
                    if count == n:
                        os._exit(KILLED)
                return on_line

            def on_call(frame: FrameType, event: str, arg: Any) -> Any:
                return on_line if frame.f_code.co_filename.startswith(CONNECTORS) else None

            try:
                sys.settrace(on_call)
                work()
                sys.settrace(None)
                os.write(write_end, str(count).encode())
                os._exit(0)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
        os.close(write_end)
        self.n, self.pid, self.read_end = n, pid, read_end

    def lines(self) -> int:
        """Wait for the child: the lines it ran, or -1 if it was killed."""
        _, status = os.waitpid(self.pid, 0)
        with os.fdopen(self.read_end, "rb") as reader:
            reported = reader.read()
        if os.waitstatus_to_exitcode(status) == KILLED:
            return -1
        assert os.waitstatus_to_exitcode(status) == 0, f"the child failed (status {status}) before line {self.n}"
        return int(reported)


def killed_at_every_line(total: int, work_for: Callable[[int], Callable[[], None]]) -> Iterator[int]:
    """A child killed at each line ``1..total`` of its ``work_for(n)``, each n yielded once its
    child is dead; the next child runs meanwhile (the machine has two cores, a child one)."""

    def dead(child: Child) -> int:
        assert child.lines() == -1 and child.n is not None
        return child.n

    running: deque[Child] = deque()
    for n in range(1, total + 1):
        running.append(Child(n, work_for(n)))
        if len(running) == 2:
            yield dead(running.popleft())
    while running:
        yield dead(running.popleft())


def names_of(namespace: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"omnisim-{namespace}-"))


def connector(store: PosixStore, stage_id: int, ring: bool) -> ShmConnector:
    return ShmConnector(store, stage_id=stage_id, send_ring=RingSettings() if ring else None, receive_ring=ring)


async def put_all(conn: ShmConnector) -> None:
    for key, payload in zip(KEYS, PAYLOADS, strict=True):
        assert (await conn.put("0", "1", key, payload)).ok


async def get_each(conn: ShmConnector) -> list[str]:
    """What a get of each key gave: "whole", "none" or "corrupt"; anything else fails the test."""
    seen = []
    for key, payload in zip(KEYS, PAYLOADS, strict=True):
        try:
            with trio.fail_after(GET_DEADLINE_S):
                got = await conn.get("0", "1", key)
        except CorruptChunk:
            seen.append("corrupt")
            continue
        if got is None:
            seen.append("none")
            continue
        assert fingerprint(got[0]) == fingerprint(as_carried(payload)), f"{key} arrived torn or foreign: {got[0]!r}"
        seen.append("whole")
    return seen


def lines_of(work: Callable[[], None]) -> int:
    lines = Child(None, work).lines()
    assert lines > 0
    return lines


@pytest.mark.parametrize("ring", [False, True], ids=["segments", "ring"])
def test_a_producer_killed_at_any_line_of_its_puts_leaves_only_what_the_sweep_reclaims(ring: bool) -> None:
    def produce(namespace: str) -> Callable[[], None]:
        return lambda: trio.run(put_all, connector(PosixStore(namespace, claim=True), 0, ring))

    async def read_then_sweep(namespace: str) -> list[str]:
        reader = connector(PosixStore(namespace), 1, ring)
        seen = await get_each(reader)
        await reader.close()
        await namespaces.sweep(OneNamespace(namespace), namespaces.ProcTable(), grace_s=0.0)
        return seen

    whole = posix_store.new_namespace()
    total = lines_of(produce(whole))
    assert trio.run(read_then_sweep, whole) == ["whole"] * len(KEYS)
    outcomes: set[str] = set()
    namespace_of = {n: posix_store.new_namespace() for n in range(1, total + 1)}
    for n in killed_at_every_line(total, lambda n: produce(namespace_of[n])):
        outcomes.update(trio.run(read_then_sweep, namespace_of[n]))
        left = names_of(namespace_of[n])
        assert left == [], f"killed at line {n} of {total}, the sweep left {left}"
    assert outcomes >= {"whole", "none"}  # (it died before and after chunks became readable)


@pytest.mark.parametrize("ring", [False, True], ids=["segments", "ring"])
def test_a_consumer_killed_at_any_line_of_its_gets_leaves_nothing_after_the_producer_cleans_up(ring: bool) -> None:
    def consume(namespace: str) -> Callable[[], None]:
        return lambda: trio.run(get_each, connector(PosixStore(namespace), 1, ring))

    async def produce(store: PosixStore) -> ShmConnector:
        producer = connector(store, 0, ring)
        await put_all(producer)
        return producer

    async def read_then_clean_up(producer: ShmConnector, namespace: str) -> list[str]:
        reader = connector(PosixStore(namespace), 1, ring)
        seen = await get_each(reader)
        await reader.close()
        for key in KEYS:
            await producer.cleanup(key)
        producer.reap_consumed()
        await producer.close()
        return seen

    # A namespace and a producer for each line: the child killed at one line reads while the one
    # before it is checked.
    stores: dict[int, PosixStore] = {}
    producers: dict[int, ShmConnector] = {}

    def produced(n: int) -> Callable[[], None]:
        stores[n] = PosixStore(posix_store.new_namespace(), claim=True)
        producers[n] = trio.run(produce, stores[n])
        return consume(stores[n].namespace)

    try:
        total = lines_of(produced(0))
        trio.run(read_then_clean_up, producers[0], stores[0].namespace)
        outcomes: set[str] = set()
        for n in killed_at_every_line(total, produced):
            outcomes.update(trio.run(read_then_clean_up, producers.pop(n), stores[n].namespace))
            left = [name for name in names_of(stores[n].namespace) if not name.endswith("-owner")]
            assert left == [], f"killed at line {n} of {total}, the producer's cleanups left {left}"
            stores.pop(n).sweep()
        assert outcomes >= {"whole", "none"}
    finally:
        for store in stores.values():
            store.sweep()
