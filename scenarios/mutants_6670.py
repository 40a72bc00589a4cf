"""Mutants for #6670: the terminal chunk never reaches Code2Wav (spec §8 #6670)."""

from __future__ import annotations

from collections.abc import Iterator

from omnisim.registry import Patch, mutant
from runtime.request import Request
from runtime.transfer import rules
from runtime.transfer.adapter import ChunkTransferAdapter as Adapter
from runtime.transfer.generations import SenderGeneration
from runtime.transfer.sender import ChunkSender as Sender


@mutant(
    "no_terminal_fence",
    summary="cleanup pops the generation while its terminal is queued: the terminal is discarded as stale",
    issue="#6670 (a)",
    scenarios=("abort_with_terminal_queued",),
    expect=("liveness",),
)
def no_terminal_fence() -> Iterator[Patch]:
    yield Patch(rules, "cleanup_defers_retire", lambda token: token.in_flight)


@mutant(
    "deferred_cleanup_only_on_success",
    summary="the fence is lowered, and its deferred cleanup run, only after a successful terminal put: a failed "
    "terminal leaks the sender generation and its id stays 'draining' forever",
    issue="#6670 (a)",
    scenarios=("abort_with_terminal_queued",),
    expect=("no-tombstones",),
)
def deferred_cleanup_only_on_success() -> Iterator[Patch]:
    original = vars(Sender)["_release_terminal_fence"]

    async def _release_terminal_fence(self: Sender, token: SenderGeneration) -> None:
        if token.terminal_sent:
            await original(self, token)

    yield Patch(Sender, "_release_terminal_fence", _release_terminal_fence)


@mutant(
    "cancel_vetoes_terminal",
    summary="a cancelled generation's terminal is vetoed like any chunk: downstream never learns the stream ended",
    issue="#6670 (a)",
    scenarios=("abort_with_terminal_queued",),
    expect=("liveness",),
)
def cancel_vetoes_terminal() -> Iterator[Patch]:
    yield Patch(rules, "may_send", lambda token, is_terminal: not token.cancelled)


@mutant(
    "ownership_by_put_req_chunk",
    summary="has_active_sender looks at put_req_chunk: chunks queued but not sent do not count, no terminal is sent",
    issue="#6670 (b)",
    scenarios=("parked_sender_terminal",),
    expect=("liveness",),
)
def ownership_by_put_req_chunk() -> Iterator[Patch]:
    yield Patch(Sender, "has_active_sender", lambda self, ext: ext in self.tables.put_req_chunk)


@mutant(
    "finish_before_force_terminal",
    summary="the parked session is finished before its forced terminal is queued",
    issue="#6670 (b)",
    scenarios=("parked_sender_terminal",),
    expect=("terminal-delivered", "liveness"),
)
def finish_before_force_terminal() -> Iterator[Patch]:
    async def finish_parked_streaming_session(self: Adapter, request: Request) -> None:
        active = self.has_active_sender(request.external_req_id)
        await self.finish_requests([request])
        if active:
            await self.save_async({}, request, force_request_finished=True)

    yield Patch(Adapter, "finish_parked_streaming_session", finish_parked_streaming_session)
