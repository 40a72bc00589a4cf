"""The production kernel's worker threads (runtime/real_kernel.py)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import trio

from runtime import real_kernel
from runtime.control import Channel
from runtime.kernel import current_kernel
from runtime.real_kernel import OFFLOAD_BYTES, RealKernel


class Boom(Exception):
    pass


@pytest.fixture
def worker_answers(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """What each function trio ran on a worker thread returned: what that worker holds until it
    is done with the job, after the event loop already has the answer."""
    answers: list[object] = []
    run_sync = trio.to_thread.run_sync

    async def watched(fn: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
        def recorded() -> Any:
            assert threading.current_thread() is not threading.main_thread()
            answers.append(fn())
            return answers[-1]

        return await run_sync(recorded, *args, **kwargs)

    monkeypatch.setattr(real_kernel.trio.to_thread, "run_sync", watched)
    return answers


async def test_a_worker_thread_never_holds_what_its_computation_made(worker_answers: list[object]) -> None:
    """A tensor freed by a worker thread while the interpreter exits kills the process (SIGABRT: a
    server stopped by Ctrl-C exited -6 now and then): the worker hands its answer over in a box
    it lets go of, and returns nothing itself, value or exception."""
    kernel = RealKernel(compute_in_threads=True)
    made = {"audio": torch.ones(4)}
    assert await kernel.compute(lambda: made) is made
    assert await kernel.run_blocking(lambda: made, cost=OFFLOAD_BYTES) is made

    def fails() -> None:
        raise Boom("from the worker")

    with pytest.raises(Boom, match="from the worker"):
        await kernel.compute(fails)
    assert worker_answers == [None, None, None]


async def test_a_control_message_larger_than_one_read_arrives_whole() -> None:
    """A stage's output may be megabytes (a long CUMULATIVE audio): the channel reads until the
    frame is complete, never once per part (found by an outside audit's planted bug)."""
    kernel = current_kernel()
    head_end, stage_end = socket.socketpair()
    head, stage = Channel(kernel.stream(head_end), "head"), Channel(kernel.stream(stage_end), "stage")
    message = {"ev": "output", "data": torch.arange(1 << 20, dtype=torch.float32)}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stage.send, message)
        got = await head.receive()
    assert got["ev"] == "output" and torch.equal(got["data"], message["data"])
    await head.aclose()
    await stage.aclose()
