"""Mutants of the sender's word to its scheduler and processor (spec §3.3–§3.4): each breaks one
promise the ``processor_contract`` and ``streaming_segments`` scenarios check."""

from __future__ import annotations

from collections.abc import Iterator

from omnisim.registry import Patch, mutant
from runtime.request import Request
from runtime.transfer import rules, sender


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


@mutant(
    "segment_generation_always_advances",
    summary="a segment end moves the expected segment generation on even for a producer that keeps none: every "
    "later save of the session is generation 0, below it, and is dropped as late — no audio, and a hang",
    issue="#6816 (fixed by #6834)",
    scenarios=("streaming_segments",),
    expect=("sender-contract", "liveness"),
)
def segment_generation_always_advances() -> Iterator[Patch]:
    yield Patch(rules, "segment_generation_after_end", lambda kept, generation: generation + 1)
