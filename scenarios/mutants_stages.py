"""Mutants of fault isolation (issue 10): the supervisor and the orchestrator's handling of a stage
process that dies or stops, each found by ``stage_crash`` through the invariant it declares.

"Restart re-using the dead namespace" (issue 10) harms no request here: the supervisor kills and
sweeps the dead life's namespace *before* it starts the next life, a life claims its namespace
under the owner lock before it writes, and a consumer claims a chunk under that same lock. A fresh
namespace per life is the design's rule all the same (it makes leftovers attributable to exactly
one dead process when a sweep itself is interrupted), so ``restarts-back-off`` checks the rule
itself, and ``restart_reuses_namespace`` breaks it.
"""

from __future__ import annotations

from collections.abc import Iterator

from omnisim.registry import Patch, mutant
from runtime import supervisor
from runtime.orchestrator import RESTART_WAIT_S, Orchestrator, RequestState
from runtime.process_stage import ProcessStage
from runtime.sched.base import IDLE_WAIT_S
from runtime.sched.generation import GenerationScheduler
from runtime.supervisor import DEAD_AFTER_S


@mutant(
    "failure_spreads",
    summary="a stage's death fails every request in flight, not only those bound to the dead stage",
    issue="issue 10 (upstream: only the requests bound to a dead replica fail)",
    scenarios=("stage_crash",),
    expect=("fault-isolation",),
)
def failure_spreads() -> Iterator[Patch]:
    def stage_died(self: Orchestrator, stage_id: int, reason: str, restarting: bool) -> None:
        for state in list(self.requests.values()):
            if stage_id in state.stage_requests:
                state.finished_stages.add(stage_id)
            self._fail(state, f"stage {self.stages[stage_id].spec.name} died: {reason}")
            self._maybe_complete(state)

    yield Patch(Orchestrator, "stage_died", stage_died)


@mutant(
    "survivors_not_aborted",
    summary="a request that failed (or was aborted) is not dropped by the other stages: they keep computing "
    "and sending its chunks",
    issue="issue 10, #4855 R1.2",
    scenarios=("stage_crash",),
    expect=("abort-stops-work", "liveness"),
)
def survivors_not_aborted() -> Iterator[Patch]:
    def abort_stages(self: Orchestrator, state: RequestState) -> None:
        return None

    yield Patch(Orchestrator, "_abort_stages", abort_stages)


@mutant(
    "sweep_before_dead",
    summary="the supervisor never kills a stage process it finds dead (neither when its silence is noticed nor when "
    "it is buried): a stopped one is swept while it lives, and goes on when it continues",
    issue="issue 10",
    scenarios=("stage_crash",),
    expect=("no-residue-after-sweep",),
)
def sweep_before_dead() -> Iterator[Patch]:
    async def bury(self: ProcessStage) -> None:
        return None

    def never_kill(self: ProcessStage) -> None:
        return None

    yield Patch(ProcessStage, "bury", bury)
    yield Patch(ProcessStage, "_kill", never_kill)


@mutant(
    "heartbeat_never_checked",
    summary="the supervisor notices a stage process that exits, but never one that stops answering: a stopped "
    "stage holds its requests for as long as it is stopped",
    issue="issue 10 (upstream: a coordinator with heartbeats)",
    scenarios=("stage_crash",),
    expect=("death-noticed",),
)
def heartbeat_never_checked() -> Iterator[Patch]:
    async def watch(self: ProcessStage) -> None:
        while self.alive:
            await self._changed.wait(DEAD_AFTER_S / 4)

    yield Patch(ProcessStage, "_watch", watch)


@mutant(
    "restart_hot_loop",
    summary="the supervisor restarts a dead stage at once, with no back-off: a stage that dies as it starts is "
    "restarted in a hot loop",
    issue="issue 10 (restarts back off)",
    scenarios=("stage_crash",),
    expect=("restarts-back-off",),
)
def restart_hot_loop() -> Iterator[Patch]:
    yield Patch(supervisor, "FIRST_BACKOFF_S", 0.0)


@mutant(
    "restart_reuses_namespace",
    summary="a restarted stage's new life writes into the dead life's namespace instead of a fresh one",
    issue="issue 10 (restart re-using the dead namespace)",
    scenarios=("stage_crash",),
    expect=("restarts-back-off",),
)
def restart_reuses_namespace() -> Iterator[Patch]:
    fresh = ProcessStage.new_namespace

    def the_old_one(self: ProcessStage) -> str:
        return getattr(self, "namespace", None) or fresh(self)

    yield Patch(ProcessStage, "new_namespace", the_old_one)


@mutant(
    "registers_after_terminal",
    summary="Code2Wav takes a request's input as complete only when it was forwarded whole: one whose upstream "
    "sent its terminal is registered for a chunk that never comes, parked instead of finished",
    issue="spec §5.2 step 2 (is_done_receiving_chunks: keep it, do not load); planted by an outside audit",
    scenarios=("code2wav_stream",),
    expect=("no-register-after-terminal",),
)
def registers_after_terminal() -> Iterator[Patch]:
    yield Patch(GenerationScheduler, "_input_complete", lambda self, request_id: request_id in self.forwarded)


@mutant(
    "id_taken_before_stages_up",
    summary="submit checks that the id is free, then waits for the stages it needs, and takes the id without "
    "looking again: two submits of one id while a stage restarts both take it, and overwrite each other",
    issue="omnisim issue 11 (planted by an outside audit, missed until a scenario submitted one id twice while a "
    "stage was down)",
    scenarios=("stage_crash",),
    expect=("one-generation-per-id",),
)
def id_taken_before_stages_up() -> Iterator[Patch]:
    async def free_then_up(self: Orchestrator, request_id: str, stages: range) -> None:
        while request_id in self.requests:
            await self._released.wait(IDLE_WAIT_S, ready=lambda: request_id not in self.requests)
        await self.wait_ready(RESTART_WAIT_S, stages=stages)

    yield Patch(Orchestrator, "_wait_until_free_and_up", free_then_up)
