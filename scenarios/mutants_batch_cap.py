"""Mutants of ``max_num_seqs`` (spec §5.2 step 4), found by ``max_num_seqs`` through
``max-num-seqs-kept``."""

from __future__ import annotations

from collections.abc import Iterator

from omnisim.registry import Patch, mutant
from runtime.request import Request
from runtime.sched.ar import ARScheduler
from runtime.sched.generation import GenerationScheduler


@mutant(
    "code2wav_batch_over_max_num_seqs",
    summary="Code2Wav moves every waiting request to running, whatever max_num_seqs says: a step runs the chunks "
    "of more requests than it may",
    issue="spec §5.2 step 4",
    scenarios=("max_num_seqs",),
    expect=("max-num-seqs-kept",),
)
def code2wav_batch_over_max_num_seqs() -> Iterator[Patch]:
    yield Patch(GenerationScheduler, "_has_room", lambda self: True)


@mutant(
    "ar_batch_over_max_num_seqs",
    summary="an AR stage decodes every request that can step, whatever max_num_seqs says",
    issue="spec §5.2 step 4 (vLLM's max_num_seqs)",
    scenarios=("max_num_seqs",),
    expect=("max-num-seqs-kept",),
)
def ar_batch_over_max_num_seqs() -> Iterator[Patch]:
    def batch(self: ARScheduler) -> list[Request]:
        every = [r for r in self.requests.values() if self._can_decode(r)]
        if every:
            self._note_batch(len(every))
        return every

    yield Patch(ARScheduler, "_batch", batch)
