"""Mutants of the sender's word to its scheduler and processor (spec §3.3–§3.4): each breaks one
promise the ``processor_contract`` and ``streaming_segments`` scenarios check."""

from __future__ import annotations

from collections.abc import Iterator

from omnisim.registry import Patch, mutant
from runtime.request import Request
from runtime.transfer import sender


@mutant(
    "processor_sees_live_request",
    summary="the processor is handed the live request, not a snapshot: it reads tokens the scheduler made after "
    "the chunk was queued",
    issue="spec §3.3 step 4 (the processor's snapshot)",
    scenarios=("processor_contract",),
    expect=("sender-contract",),
)
def processor_sees_live_request() -> Iterator[Patch]:
    def live(request: Request) -> Request:
        return request

    yield Patch(sender, "_snapshot", live)
