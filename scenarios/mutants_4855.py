"""Mutants of the silent-failure fixes of #4855 (R1.1 input-wait deadline, R1.2 send give-up)
and of the #3736 purge of requests the scheduler no longer tracks."""

from __future__ import annotations

from collections.abc import Iterator

from omnisim.registry import Patch, mutant
from runtime.kernel import current_kernel
from runtime.request import Request
from runtime.sched.base import StageScheduler as Scheduler
from runtime.transfer import rules
from runtime.transfer.generations import SenderGeneration
from runtime.transfer.sender import ChunkSender as Sender
from runtime.transfer.sender import SaveTask

DEADLINE = ("input_wait_deadline",)
#: The scenarios whose sender gives up: a put that reports failure, and one that raises.
GIVE_UP = ("abort_with_terminal_queued", "terminal_success_vs_failure", "pipeline_send_failure")


@mutant(
    "deadline_never_armed",
    summary="a parked request's _waiting_since is never set: a dead producer hangs its consumer forever",
    issue="#4855 R1.1 (#3833)",
    scenarios=DEADLINE,
    expect=("liveness",),
)
def deadline_never_armed() -> Iterator[Patch]:
    yield Patch(Scheduler, "_start_waiting", lambda self, request_id: None)


@mutant(
    "deadline_from_first_park",
    summary="the stall clock is not reset by an arrival: a long healthy stream times out",
    issue="#4855 R1.1",
    scenarios=DEADLINE,
    expect=("terminal-delivered",),
)
def deadline_from_first_park() -> Iterator[Patch]:
    yield Patch(Scheduler, "_input_arrived", lambda self, request_id: None)


@mutant(
    "deadline_zero_is_immediate",
    summary="an input-wait timeout of 0 expires every parked request at once instead of disabling the check",
    issue="#4855 R1.1, R1.4",
    scenarios=DEADLINE,
    expect=("terminal-delivered",),
)
def deadline_zero_is_immediate() -> Iterator[Patch]:
    def timed_out(self: Scheduler) -> list[str]:
        now = current_kernel().now()
        return [rid for rid, since in self.waiting_since.items() if now - since >= self.input_wait_timeout_s]

    yield Patch(Scheduler, "_timed_out_request_ids", timed_out)


@mutant(
    "send_failure_under_external_id",
    summary="a give-up is recorded under the external id: the scheduler cannot find the request it names",
    issue="#4855 R1.2",
    scenarios=GIVE_UP,
    expect=("liveness",),
)
def send_failure_under_external_id() -> Iterator[Patch]:
    def put_failed(self: Sender, task: SaveTask, key: str, cause: str) -> None:
        self.record_send_failure(task.request.external_req_id, f"could not send chunk {key}: {cause}")

    def send_raised(self: Sender, task: SaveTask, error: Exception) -> None:
        self.record_send_failure(task.request.external_req_id, f"{type(error).__name__}: {error}")

    yield Patch(Sender, "_put_failed", put_failed)
    yield Patch(Sender, "_send_raised", send_raised)


@mutant(
    "put_failure_not_recorded",
    summary="put returning False is only logged: the consumer waits for a chunk that will never come",
    issue="#4855 R1.2",
    scenarios=("abort_with_terminal_queued", "pipeline_send_failure"),
    expect=("liveness",),
)
def put_failure_not_recorded() -> Iterator[Patch]:
    yield Patch(Sender, "_put_failed", lambda self, task, key, cause: None)


@mutant(
    "send_after_failed_put",
    summary="a generation whose put failed goes on sending: the next chunk goes out under the failed key and "
    "the receiver takes a gapped stream for a whole one (found by PCT on pipeline_send_failure)",
    issue="#4855 R1.2, omnisim issue 7",
    scenarios=("pipeline_send_failure",),
    expect=("samples-exactly-once", "terminal-delivered"),
)
def send_after_failed_put() -> Iterator[Patch]:
    def may_send(token: SenderGeneration, is_terminal: bool) -> bool:
        return is_terminal or not token.cancelled

    yield Patch(rules, "may_send", may_send)


@mutant(
    "send_exception_not_recorded",
    summary="a send that raises is popped and forgotten: its request is never failed",
    issue="#4855 R1.2",
    scenarios=("terminal_success_vs_failure",),
    expect=("liveness",),
)
def send_exception_not_recorded() -> Iterator[Patch]:
    yield Patch(Sender, "_send_raised", lambda self, task, error: None)


@mutant(
    "no_untracked_purge",
    summary="requests freed in the middle of a step (the deadline) are re-queued and polled again",
    issue="#3736",
    scenarios=DEADLINE,
    expect=("no-tombstones",),
)
def no_untracked_purge() -> Iterator[Patch]:
    def is_tracked(self: Scheduler, request: Request) -> bool:
        return True

    yield Patch(Scheduler, "_is_tracked", is_tracked)
