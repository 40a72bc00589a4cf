"""Mutants of the orchestrator, the AR scheduler and the serving layer, found by the pipeline scenarios."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import torch

from omnisim.registry import Patch, mutant
from runtime import serving
from runtime.config.topology import OutputType
from runtime.orchestrator import EngineOutput, Orchestrator, RequestState
from runtime.request import Request
from runtime.sched.ar import ARScheduler
from runtime.sched.base import StageOutput
from runtime.sched.generation import GenerationScheduler
from runtime.serving import EmittedSamplesTrim
from runtime.stages import Stage


@mutant(
    "abort_terminal_from_stage0",
    summary="the synthetic abort terminal says stage 0 / text: an audio client drops it and ends with no output",
    issue="#7006",
    scenarios=("pipeline_abort_before_output",),
    expect=("terminal-delivered",),
)
def abort_terminal_from_stage0() -> Iterator[Patch]:
    def terminal(self: Orchestrator, state: RequestState, error: str) -> EngineOutput:
        return EngineOutput(
            state.request_id, 0, OutputType.TEXT, None, finished=True, request_finished=True, error=error
        )

    yield Patch(Orchestrator, "_terminal", terminal)


@mutant(
    "final_output_held_whole",
    summary="every output of the request's final stage is held until all stages finished, not only its finished "
    "one: the text comes as it is made, and the whole audio at the end (a streamed answer plays as a buffered one)",
    issue="omnisim issue 11 (a survivor of the mutation score of runtime/orchestrator.py)",
    scenarios=("pipeline_requests",),
    expect=("streamed-as-made",),
)
def final_output_held_whole() -> Iterator[Patch]:
    def publish(
        self: Orchestrator, state: RequestState, stage_id: int, kind: OutputType, data: Any, finished: bool
    ) -> None:
        item = EngineOutput(state.request_id, stage_id, kind, data, finished)
        if stage_id == state.final_stage_id:
            state.pending_final.append(item)
        else:
            state.stream.put(item)

    yield Patch(Orchestrator, "_publish", publish)


@mutant(
    "give_up_read_after_free",
    summary="a request's id is freed without reading the give-ups its stages recorded since it ended: a fenced "
    "terminal that failed after the client left is read later, when no request knows it (or the id's next "
    "generation has its stage request ids, and fails of it)",
    issue="#4855 R1.2, spec §2.11 (found missed by an outside audit that planted it)",
    scenarios=("pipeline_send_failure_reused",),
    expect=("failures-claimed", "terminal-delivered"),
)
def give_up_read_after_free() -> Iterator[Patch]:
    forget = Orchestrator._forget

    def forget_unread(self: Orchestrator, state: RequestState) -> None:
        self._check_failures = lambda: None  # type: ignore[method-assign]  # (for this call only: it never awaits)
        try:
            forget(self, state)
        finally:
            del self._check_failures

    yield Patch(Orchestrator, "_forget", forget_unread)


@mutant(
    "doorbell_cleared_after_step",
    summary="a stage clears its doorbell after a step instead of before it: an abort (or a request, or the stop) "
    "that rang while the step ran is forgotten, and the stage sleeps out its idle wait before it sees it",
    issue="omnisim issue 11 (planted by an outside audit, missed until waits were judged by the true state)",
    scenarios=("pipeline_abort_before_output",),
    expect=("no-lost-wakeup",),
)
def doorbell_cleared_after_step() -> Iterator[Patch]:
    def cleared_after(
        step: Callable[[Any], Awaitable[list[StageOutput]]],
    ) -> Callable[[Any], Awaitable[list[StageOutput]]]:
        async def stepped(self: ARScheduler | GenerationScheduler) -> list[StageOutput]:
            outputs = await step(self)
            self._new_work = False
            return outputs

        return stepped

    for scheduler in (ARScheduler, GenerationScheduler):
        yield Patch(scheduler, "step", cleared_after(scheduler.step))


@mutant(
    "final_stage_sends_chunks",
    summary="every stage a request runs on sends chunks, its final-output stage too: a text-only answer's Thinker "
    "puts a chunk per token for a Talker that never asks for them, and only the release sweep removes them",
    issue="#7245 (chunks nobody reads), found by an outside bug hunt",
    scenarios=("pipeline_requests",),
    expect=("answered-leaves-nothing-unread",),
)
def final_stage_sends_chunks() -> Iterator[Patch]:
    submit = Stage.submit

    def submit_sending(self: Stage, request: Request, payload: dict[str, Any] | None, *, sends: bool) -> None:
        submit(self, request, payload, sends=True)

    yield Patch(Stage, "submit", submit_sending)


@mutant(
    "terminal_stop_is_segment_boundary",
    summary="a terminal stop is also flagged is_segment_finished: an empty terminal becomes a one-token prompt",
    issue="#5383",
    scenarios=("pipeline_requests",),
    expect=("samples-exactly-once",),
)
def terminal_stop_is_segment_boundary() -> Iterator[Patch]:
    yield Patch(ARScheduler, "_is_segment_boundary", staticmethod(lambda finished: True))


@mutant(
    "http_streaming_timestamps_accepted",
    summary="the HTTP speech endpoint accepts stream=true with word_timestamps instead of pointing to the WebSocket",
    issue="#7544",
    scenarios=("streaming_word_timestamps",),
    expect=("aligner-complete",),
)
def http_streaming_timestamps_accepted() -> Iterator[Patch]:
    def check(*, stream: bool, word_timestamps: bool, has_aligner: bool) -> None:
        if word_timestamps and not has_aligner:
            raise serving.RequestRejected("word_timestamps needs a server started with --forced-aligner")

    yield Patch(serving, "check_http_speech_request", check)


@mutant(
    "empty_tail_not_skipped",
    summary="a cumulative update with no new samples still reaches the client, as an empty audio chunk",
    issue="#7544",
    scenarios=("pipeline_word_timestamps",),
    expect=("samples-exactly-once",),
)
def empty_tail_not_skipped() -> Iterator[Patch]:
    def trim(self: EmittedSamplesTrim, cumulative: torch.Tensor) -> torch.Tensor | None:
        new = cumulative[..., self.emitted_samples :]
        self.emitted_samples = cumulative.shape[-1]
        return new

    yield Patch(EmittedSamplesTrim, "__call__", trim)


@mutant(
    "trim_after_resampling",
    summary="the cumulative output is resampled before the trim, which still counts model samples: "
    "the client loses (or repeats) audio by the resampling ratio",
    issue="#7544",
    scenarios=("pipeline_word_timestamps",),
    expect=("samples-exactly-once",),
)
def trim_after_resampling() -> Iterator[Patch]:
    def client_audio(
        chunk: torch.Tensor, trim: EmittedSamplesTrim | None, *, from_rate: int, to_rate: int
    ) -> torch.Tensor | None:
        resampled = serving.resample(chunk, from_rate, to_rate)
        if trim is None:
            return resampled
        new = resampled[..., trim.emitted_samples :]
        trim.emitted_samples = chunk.shape[-1]
        return new if new.numel() else None

    yield Patch(serving, "client_audio", client_audio)
