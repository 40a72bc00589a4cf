"""Mutants of #5349, the active-stream window's stall (fixed by #5373): a slot let go when the
stream's upstream finished, or never let go at all."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from omnisim.registry import Patch, mutant
from runtime.transfer import rules
from runtime.transfer.receiver import ChunkReceiver

WINDOW = ("active_stream_window",)


@mutant(
    "stream_evicted_when_upstream_exhausted",
    summary="the window lets a stream go once its upstream sent the terminal, and refuses to take up again any "
    "stream whose upstream finished (one set meant both 'upstream done' and 'stage done'): the Talker stops "
    "mid-answer and the request hangs",
    issue="#5349",
    scenarios=WINDOW,
    expect=("liveness",),
)
def stream_evicted_when_upstream_exhausted() -> Iterator[Patch]:
    admit = ChunkReceiver.admit

    def admit_evicting(self: ChunkReceiver, request_ids: Iterable[str]) -> None:
        for request_id in list(self._active_streams):
            if self.is_done_receiving_chunks(request_id):
                del self._active_streams[request_id]
        admit(self, [rid for rid in request_ids if not self.is_done_receiving_chunks(rid)])

    yield Patch(ChunkReceiver, "admit", admit_evicting)


@mutant(
    "stream_slot_never_freed",
    summary="a request that ends at a stage keeps its slot in the window: after as many requests as the window "
    "holds, the next is never taken up and hangs",
    issue="#5349 (AR _free_request never released the slot)",
    scenarios=WINDOW,
    expect=("liveness",),
)
def stream_slot_never_freed() -> Iterator[Patch]:
    cleanup_receiver = ChunkReceiver.cleanup_receiver

    async def cleanup_keeping_the_slot(self: ChunkReceiver, request_id: str) -> None:
        held = request_id in self._active_streams
        await cleanup_receiver(self, request_id)
        if held:
            self._active_streams[request_id] = None

    yield Patch(ChunkReceiver, "cleanup_receiver", cleanup_keeping_the_slot)


@mutant(
    "window_admits_one_too_many",
    summary="the window's room check is off by one (<= for <): a stage takes up one stream more than its window",
    issue="#5349 (spec §5.2 step 5: up to K streams)",
    scenarios=WINDOW,
    expect=("stream-window-kept",),
)
def window_admits_one_too_many() -> Iterator[Patch]:
    yield Patch(rules, "stream_window_has_room", lambda active, window: active <= window)
