"""SimKernel: the runtime's kernel under a controllable, deterministic scheduler on trio.

Exactly one *logical task* runs between two points. Every other task is parked on a trio
low-level park, and the only way it runs again is that the running task, on reaching a point or
blocking, asks the strategy which task goes next and hands control to it. Because trio itself
only ever has one runnable task of ours, the interleaving is fully decided by the strategy, and
the same strategy choices give the same trace byte for byte.

Time is virtual: it advances only when no task may run, straight to the earliest wake-up. A run
ends when every task has finished, or is stopped with a reason:

* ``deadlock`` — tasks remain but none is runnable and none will wake (a hang);
* ``horizon`` — the next wake-up is past the time horizon (a hang through time);
* ``unsatisfiable`` — the strategy's ordering constraints forbid every runnable task;
* ``step-limit`` — too many scheduling decisions (a livelock).

Tasks belong to *processes* (a task is in its parent's process unless started with
:meth:`SimKernel.as_process`). :meth:`SimKernel.kill_process` is SIGKILL: every task of the
process stops where it is, for good — it is never scheduled again, its groups stop waiting for
it, and whatever it raises while the world is unwound at the end is not the runtime's doing.
"""

from __future__ import annotations

import contextvars
import math
import select
import traceback
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

import trio

from invariants.observed import TaskState, TraceEvent
from omnisim.base import stop_requested
from omnisim.sim_spawn import Program, SimChild, connection, program_name
from omnisim.strategies.base import Strategy
from runtime.kernel import Attr, KProcess, KStream, current_kernel, use_kernel

if TYPE_CHECKING:
    from omnisim.faults import Fault, FaultPlan

#: Carries out a fault that is an action on the world rather than an exception (a crash, bytes
#: flipped); called on the task that reached the point.
FaultAction = Callable[["Fault", "SimTask", dict[str, Attr]], None]

T = TypeVar("T")

READY = "ready"
BLOCKED = "blocked"
SLEEPING = "sleeping"
DONE = "done"
KILLED = "killed"
MAIN_PROCESS = "main"


def _us(seconds: float) -> int:
    return max(0, round(seconds * 1_000_000))


def _wake_at(now_us: int, seconds: float) -> int | None:
    """When a wait of ``seconds`` from ``now_us`` ends; None for never (an infinite wait). As
    trio does, a negative or NaN duration is a ``ValueError`` of the caller's."""
    if not seconds >= 0:
        raise ValueError(f"a wait must be a non-negative number of seconds, got {seconds!r}")
    return None if math.isinf(seconds) else now_us + _us(seconds)


#: The simulated task a trio task runs (each trio task has its own context).
_running: contextvars.ContextVar[SimTask] = contextvars.ContextVar("omnisim_sim_task")


class _Killed(BaseException):
    """Raised to a killed task that is being unwound, at its next kernel call."""


def _interrupt_in(e: BaseException) -> BaseException | None:
    """The KeyboardInterrupt or SystemExit in ``e`` (alone, or within a group), if any."""
    if isinstance(e, BaseExceptionGroup):
        return e.split((KeyboardInterrupt, SystemExit))[0]
    return e if isinstance(e, (KeyboardInterrupt, SystemExit)) else None


#: What a task of the code under test dies of: an exception, or an exit it asked for (in a real
#: process, ``sys.exit`` in a task ends the process: a crash all the same).
_CRASHES = (Exception, SystemExit)


def _split_crash(e: BaseException) -> tuple[BaseException | None, BaseException | None]:
    if isinstance(e, BaseExceptionGroup):
        return e.split(_CRASHES)
    return (e, None) if isinstance(e, _CRASHES) else (None, e)


def _only_cancelled(e: BaseException) -> bool:
    if isinstance(e, BaseExceptionGroup):
        return all(_only_cancelled(inner) for inner in e.exceptions)
    return isinstance(e, trio.Cancelled)


def _readable(fd: int) -> bool:
    """Whether ``fd`` has something to read now; a descriptor closed meanwhile never does (as
    epoll forgets a closed one: its waiter sits out its timeout)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return any(events & select.POLLIN for _, events in poller.poll(0))


@dataclass(eq=False)
class SimTask:
    """A logical task. ``pending`` is the point it waits at, which the strategy may inspect."""

    tid: int
    name: str
    fn: Callable[[], Awaitable[object]]
    group: _SimGroup | None
    process: str = MAIN_PROCESS
    state: str = READY
    trio_task: trio.lowlevel.Task | None = None
    go: bool = False
    pending: tuple[str, dict[str, Attr]] = ("task.start", {})
    waiting_for: str = ""
    wake_at: int | None = None
    notified: bool = False
    #: The descriptor it waits to become readable (see ``SimKernel.wait_readable``).
    readable_fd: int | None = None
    #: Cancelled to unwind the task once it was killed and its group moves on.
    scope: trio.CancelScope | None = None
    #: A killed task's trio task was let go (see ``SimKernel._unwind``).
    unwound: bool = False
    #: After a ``sleep(0)``: the ids of the tasks that were ready then and have not run since;
    #: it runs again only after them (see ``SimKernel.sleep``).
    behind: set[int] = field(default_factory=set)

    def describe(self) -> TaskState:
        if self.state == READY:
            what = f"at point {self.pending[0]} {self.pending[1] or ''}".rstrip()
        else:
            what = self.waiting_for
        return TaskState(self.name, self.state, what)


class _SimGroup:
    """A task group: a trio nursery whose tasks the kernel schedules, and its own async context
    manager (written out, not ``@asynccontextmanager``: the runtime opens several per run, and a
    generator-based manager costs about as much again as the nursery it wraps)."""

    def __init__(self, kernel: SimKernel) -> None:
        self.kernel = kernel
        self.live = 0
        self.waiter: SimTask | None = None

    async def __aenter__(self) -> _SimGroup:
        self.owner = self.kernel._me()
        self._manager = trio.open_nursery()
        self.nursery = await self._manager.__aenter__()
        return self

    async def __aexit__(
        self, etype: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if exc is not None:
            # Trio will cancel the children; they must not be rescheduled by the sim while it
            # does, so the world stops here.
            self.kernel._stop(
                "crash", f"{self.owner.name} raised {type(exc).__name__}: {exc} with {self.live} child task(s) live"
            )
            return await self._manager.__aexit__(etype, exc, tb)
        try:
            await self._join()
        except BaseException as e:
            if not await self._manager.__aexit__(type(e), e, e.__traceback__):
                raise
            return False
        return await self._manager.__aexit__(None, None, None)

    async def _join(self) -> None:
        """Wait until every task of the group finished or was killed, then let the killed go."""
        k, me = self.kernel, self.owner
        if self.live:
            me.state = BLOCKED
            me.waiting_for = f"{self.live} child task(s) to finish"
            self.waiter = me
            # Said, as a lock's wait is: a wait for children is a wait (abort-non-blocking).
            k._emit(me, "kernel.block", {"on": "task group"})
            await k._yield(me)
        # Killed children are parked for good; trio's nursery still waits for them.
        for task in k.killed:
            if task.group is self:
                k._unwind(task)

    def start_soon(self, fn: Callable[[], Awaitable[object]], *, name: str) -> None:
        if self.kernel.process_for(self) in self.kernel.dead_processes:
            return  # a dead process starts nothing (what was sent to it is lost)
        task = self.kernel._register(fn, name, self)
        self.live += 1
        self.nursery.start_soon(self.kernel._run_task, task, name=name)

    def lost(self) -> None:
        """One of the group's tasks finished, or its process was killed."""
        self.live -= 1
        if self.live == 0 and self.waiter is not None and self.waiter.state != KILLED:
            self.waiter.state = READY


class _SimLock:
    def __init__(self, kernel: SimKernel, name: str) -> None:
        self.kernel = kernel
        self.name = name
        self.owner: SimTask | None = None
        self.waiters: deque[SimTask] = deque()

    async def __aenter__(self) -> None:
        k = self.kernel
        me = k._me()
        if self.owner is None:
            self.owner = me
            return
        assert self.owner is not me, f"lock {self.name} is not reentrant"
        me.state = BLOCKED
        me.waiting_for = f"lock {self.name} held by {self.owner.name}"
        self.waiters.append(me)
        k._emit(me, "kernel.block", {"on": f"lock:{self.name}"})
        await k._yield(me)  # ownership is handed over by the releasing task

    async def __aexit__(self, *exc: object) -> None:
        running = _running.get(None)
        if running is not None and running.state == KILLED:
            return  # a dead process's lock: nobody alive waits for it
        while self.waiters and self.waiters[0].state == KILLED:
            self.waiters.popleft()
        if self.waiters:
            nxt = self.waiters.popleft()
            self.owner = nxt
            nxt.state = READY
        else:
            self.owner = None


class _SimSignal:
    def __init__(self, kernel: SimKernel, name: str) -> None:
        self.kernel = kernel
        self.name = name
        self.waiters: list[SimTask] = []

    def notify(self) -> None:
        for task in self.waiters:
            if task.state not in (DONE, KILLED):
                task.state = READY
                task.wake_at = None
                task.notified = True
        self.waiters.clear()

    async def wait(self, timeout: float, *, ready: Callable[[], bool] | None = None) -> bool:
        k = self.kernel
        me = k._me()
        wake_at = _wake_at(k.clock_us, timeout)  # (a bad timeout raises before anything changed)
        me.notified = False
        me.state = SLEEPING
        me.wake_at = wake_at
        me.waiting_for = f"signal {self.name} (timeout {timeout}s)"
        self.waiters.append(me)
        k._emit(me, "kernel.wait", {"on": f"signal:{self.name}"})
        await k._yield(me)
        if not me.notified:
            if me in self.waiters:
                self.waiters.remove(me)
            timed_out: dict[str, Attr] = {"on": f"signal:{self.name}"}
            if ready is not None and ready():
                timed_out["missed"] = True
            k._emit(me, "kernel.timeout", timed_out)
        return me.notified


@dataclass
class SimOutcome:
    """What a simulated run did: how it ended, its trace and the choices that produced it."""

    stop_reason: str | None
    stopped_tasks: list[TaskState]
    crashes: list[tuple[str, str]]
    trace: list[TraceEvent]
    choices: list[int]
    steps: int
    virtual_time_s: float
    detail: str = ""
    unsatisfied: list[str] = field(default_factory=list)

    def trace_lines(self) -> list[str]:
        return [event.canonical() for event in self.trace]


class SimKernel:
    """The kernel that runs the runtime under a :class:`~omnisim.strategies.base.Strategy`."""

    def __init__(
        self,
        strategy: Strategy,
        *,
        faults: FaultPlan | None = None,
        horizon_s: float = 30.0,
        max_steps: int = 200_000,
        fault_action: FaultAction | None = None,
    ) -> None:
        self.strategy = strategy
        #: The strategy's event hook; None where it keeps the no-op of the base class, so the
        #: one event made at every point costs no call.
        self._on_event = strategy.on_event if type(strategy).on_event is not Strategy.on_event else None
        #: The harness's watchers of notes, by name (see :meth:`watch`).
        self._watchers: dict[str, Callable[[SimTask, dict[str, Attr]], None]] = {}
        self.faults = faults
        self.fault_action = fault_action
        self.horizon_us = _us(horizon_s)
        self.max_steps = max_steps
        self.clock_us = 0
        self.steps = 0
        self.tasks: list[SimTask] = []
        self.current: SimTask | None = None
        self.trace: list[TraceEvent] = []
        self.choices: list[int] = []
        self.crashes: list[tuple[str, str]] = []
        self._next_tid = 0
        self._stopping = False
        self._stop_reason: str | None = None
        self._stopped_tasks: list[TaskState] = []
        self._stop_detail = ""
        self._root_scope: trio.CancelScope | None = None
        #: The process new tasks are started in (see :meth:`as_process`); None: their parent's.
        self._spawning: str | None = None
        self.killed: list[SimTask] = []
        #: Processes that were killed: nothing of theirs runs again.
        self.dead_processes: set[str] = set()
        #: Stopped processes (SIGSTOP): process -> when it continues (virtual microseconds).
        self._paused: dict[str, int] = {}
        #: Tasks waiting for a descriptor to become readable, in the order they began to wait.
        self._fd_waiters: list[SimTask] = []
        #: Tasks that slept 0 and still wait behind some of the tasks ready then.
        self._yielded: list[SimTask] = []
        #: Virtual seconds one model computation takes (0: computing takes no time).
        self.compute_cost_s = 0.0
        #: What :meth:`start_process` can start, by module (see :mod:`omnisim.sim_spawn`).
        self.programs: dict[str, Program] = {}
        #: The children it started, by process name.
        self._children: dict[str, SimChild] = {}
        self._nursery: trio.Nursery | None = None

    # == running a world =========================================================================

    def run(self, main: Callable[[], Awaitable[object]], *, name: str = "main") -> SimOutcome:
        """Run ``main`` (and every task it spawns) to completion or to a stop, in a fresh trio loop."""
        return trio.run(self.run_async, main, name)

    async def run_async(self, main: Callable[[], Awaitable[object]], name: str = "main") -> SimOutcome:
        """The same inside a trio loop that is already running (many schedules share one loop,
        which saves trio's start-up cost per schedule). Nothing else may run in that loop."""
        with use_kernel(self), trio.CancelScope() as scope:
            self._root_scope = scope
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task = self._register(main, name, None)
                nursery.start_soon(self._run_task, task, name=name)
                self._switch_to(task)
        return SimOutcome(
            stop_reason=self._stop_reason,
            stopped_tasks=self._stopped_tasks,
            crashes=self.crashes,
            trace=self.trace,
            choices=self.choices,
            steps=self.steps,
            virtual_time_s=self.clock_us / 1e6,
            detail=self._stop_detail,
            unsatisfied=self.strategy.unsatisfied(),
        )

    def process_for(self, group: _SimGroup | None) -> str:
        """The process a task started now in ``group`` belongs to."""
        return self._spawning or (group.owner.process if group is not None else MAIN_PROCESS)

    def _register(self, fn: Callable[[], Awaitable[object]], name: str, group: _SimGroup | None) -> SimTask:
        self._next_tid += 1
        task = SimTask(self._next_tid, name, fn, group, self.process_for(group))
        self.tasks.append(task)
        return task

    # == processes ===============================================================================

    @contextmanager
    def as_process(self, process: str) -> Iterator[None]:
        """Tasks started inside the block belong to ``process`` (and so do their children)."""
        outer, self._spawning = self._spawning, process
        try:
            yield
        finally:
            self._spawning = outer

    def freeze(self, task: SimTask) -> None:
        """``task`` hangs for good (a stopped thread): it keeps whatever it holds, and its
        process lives on. Killing its process later takes it along."""
        self._emit(task, "kernel.killed", {"process": task.process})
        task.state = KILLED
        task.wake_at = None
        task.waiting_for = "nothing: it hangs for good"
        self.tasks.remove(task)
        self.killed.append(task)

    def pause_process(self, process: str, seconds: float) -> None:
        """SIGSTOP, then SIGCONT ``seconds`` later: none of ``process``'s tasks runs meanwhile
        (they keep what they hold), then they go on as if nothing happened."""
        self._emit(self._me(), "process.paused", {"process": process, "for_us": _us(seconds)})
        self._paused[process] = self.clock_us + _us(seconds)

    def kill_process(self, process: str) -> None:
        """SIGKILL: every task of ``process`` stops where it is and is never scheduled again. The
        caller may be one of them (it then never returns from its next kernel call)."""
        self._emit(self._me(), "process.killed", {"process": process})
        self.dead_processes.add(process)
        child = self._children.get(process)
        if child is not None:
            child.ended(-9)  # (what waitpid reports for SIGKILL)
        for task in [t for t in self.tasks if t.process == process]:
            self._emit(task, "kernel.killed", {"process": process})
            task.state = KILLED
            task.wake_at = None
            task.waiting_for = f"nothing: process {process} was killed"
            self.tasks.remove(task)
            self.killed.append(task)
            if task.group is not None:
                task.group.lost()

    async def _run_task(self, task: SimTask) -> None:
        task.trio_task = trio.lowlevel.current_task()
        _running.set(task)
        if not task.go and task.state != KILLED:
            await self._park()
        if task.state == KILLED:
            task.unwound = True
            return  # its process was killed before it ever ran (see _unwind)
        try:
            with trio.CancelScope() as task.scope:
                await task.fn()
        except BaseException as e:
            if task.state == KILLED:
                # A killed process being unwound: nothing of it runs any more, and what it
                # raises now is not the runtime's doing — but a Ctrl-C is still a Ctrl-C.
                interrupt = _interrupt_in(e)
                if interrupt is not None:
                    self._stop("interrupted", f"{task.name} was interrupted while it was unwound")
                    raise interrupt from None
                return
            # An exception of the code under test (or its SystemExit) is a crash: it is recorded
            # and the world goes on (as a dying thread would leave the rest running). Anything
            # else — the world's own cancellation, a KeyboardInterrupt — is not the runtime's
            # doing: it stops the world and goes on up to whoever runs it.
            crash, rest = _split_crash(e)
            if crash is not None:
                self.crashes.append((task.name, "".join(traceback.format_exception(crash)).strip()))
                self._emit(task, "kernel.crash", {"error": type(crash).__name__})
            if rest is not None:
                if not _only_cancelled(rest):
                    self._stop("interrupted", f"{task.name} raised {type(rest).__name__}")
                raise rest from None
        finally:
            # A killed task being unwound takes no decision: the task whose group let it go
            # holds the baton, and trio hands it back once this one is gone.
            if task.state != KILLED:
                task.state = DONE
                self.tasks.remove(task)
                if task.group is not None:
                    task.group.lost()
                if not self._stopping:
                    nxt = self._decide()
                    if nxt is not None:
                        self._switch_to(nxt)
                    elif not self.tasks and self.killed:
                        self._unwind_killed()

    # == the scheduling core =====================================================================

    def _me(self) -> SimTask:
        running = _running.get(None)
        if running is not None and running.state == KILLED:
            raise _Killed  # a killed task being unwound: nothing it does reaches the world
        assert self.current is not None, "kernel primitive used outside a simulated task"
        return self.current

    async def _park(self) -> None:
        await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.SUCCEEDED)

    def _switch_to(self, task: SimTask) -> None:
        self.current = task
        if task.trio_task is None:
            task.go = True
        else:
            trio.lowlevel.reschedule(task.trio_task)

    async def _yield(self, me: SimTask) -> None:
        """Let the strategy pick who runs next (possibly ``me``) and wait until it is ``me``."""
        if self._stopping:
            await trio.lowlevel.checkpoint()
        nxt = self._decide()
        if nxt is me:
            return
        if nxt is not None:
            self._switch_to(nxt)
        elif me.state == KILLED and not self._stopping:
            self._unwind_killed()  # it was the last live task
        await self._park()

    def _decide(self) -> SimTask | None:
        while True:
            if not self.tasks:
                return None
            if stop_requested:
                return self._stop("interrupted", f"stopped by {stop_requested[0]}")
            self.steps += 1
            if self.steps > self.max_steps:
                return self._stop("step-limit", f"more than {self.max_steps} scheduling steps")
            if self._fd_waiters:
                self._wake_readable()
            ready = [t for t in self.tasks if t.state == READY]
            if self._paused:
                ready = [t for t in ready if self._paused.get(t.process, 0) <= self.clock_us]
            allowed = self._allowed(ready)
            if len(allowed) == 1:
                return self._picked(allowed[0])
            if allowed:
                self.strategy.current = self.current
                pick = self.strategy.choose(allowed)
                self.choices.append(pick.tid)
                return self._picked(pick)
            timed = [t.wake_at for t in self.tasks if t.wake_at is not None]
            if self._paused:
                self._paused = {p: until for p, until in self._paused.items() if until > self.clock_us}
                timed += [self._paused[t.process] for t in self.tasks if t.process in self._paused]
            if not timed:
                if ready:
                    return self._stop("unsatisfiable", "the ordering constraints forbid every runnable task")
                return self._stop("deadlock", "no task can run and none will wake")
            wake = min(timed)
            if wake > self.horizon_us:
                if ready:  # runnable tasks were held back by the ordering until time ran out
                    held = "; ".join(f"{t.name} at {t.pending[0]}" for t in ready)
                    return self._stop("unsatisfiable", f"held back by the ordering until the horizon: {held}")
                return self._stop("horizon", f"nothing left to do before the {self.horizon_us / 1e6:g}s horizon")
            self.clock_us = max(self.clock_us, wake)
            for t in self.tasks:
                if t.wake_at is not None and t.wake_at <= self.clock_us:
                    t.wake_at = None
                    t.state = READY

    def _allowed(self, ready: list[SimTask]) -> list[SimTask]:
        """The ready tasks the strategy may pick from: those that slept 0 sit out while a task
        they yielded to is still waiting to run — unless nothing else may run."""
        if not ready:
            return ready
        if self._yielded:
            ids = {t.tid for t in ready}
            fresh = [t for t in ready if not t.behind & ids]
            allowed = self.strategy.allowed(fresh)
            if allowed:
                return allowed
        return self.strategy.allowed(ready)

    def _picked(self, task: SimTask) -> SimTask:
        """Note that ``task`` runs next: those that yielded to it need wait for it no longer."""
        if self._yielded:
            task.behind.clear()
            for waiting in self._yielded:
                waiting.behind.discard(task.tid)
            self._yielded = [t for t in self._yielded if t.behind and t.state == READY]
        return task

    def _wake_readable(self) -> None:
        """Make runnable every task whose descriptor became readable. Only the world's own tasks
        write to those descriptors (a FIFO of the wakeup bus), so what is readable at a step is
        fixed by the schedule so far: the same choices give the same wakes."""
        self._fd_waiters = [t for t in self._fd_waiters if t.state == SLEEPING]
        for task in self._fd_waiters:
            if task.readable_fd is not None and _readable(task.readable_fd):
                task.state = READY
                task.wake_at = None
                task.notified = True

    def _unwind(self, task: SimTask) -> None:
        """Let the trio task of killed ``task`` end. Nothing it does reaches the world any more
        (``_me`` refuses it); one killed before it ever ran is parked outside its scope."""
        if task.scope is not None:
            task.scope.cancel()
        elif task.trio_task is not None and not task.unwound:
            trio.lowlevel.reschedule(task.trio_task)
        task.unwound = True

    def _unwind_killed(self) -> None:
        """Every live task is done: unwind the killed ones (parked for good) so trio can end."""
        self._stopping = True
        assert self._root_scope is not None
        self._root_scope.cancel()

    def _stop(self, reason: str, detail: str) -> None:  # returns None so _decide can return it
        if not self._stopping:
            self._stopping = True
            self._stop_reason = reason
            self._stop_detail = detail
            self._stopped_tasks = [t.describe() for t in self.tasks]
            assert self._root_scope is not None
            self._root_scope.cancel()
        return None

    def _emit(self, task: SimTask, name: str, attrs: dict[str, Attr]) -> None:
        event = TraceEvent(len(self.trace), self.clock_us, task.name, name, attrs)
        self.trace.append(event)
        if self._on_event is not None:
            self._on_event(event)

    # == the Kernel interface ====================================================================

    async def point(self, name: str, /, **attrs: Attr) -> None:
        me = self._me()
        me.pending = (name, attrs)
        await self._yield(me)
        self._emit_watched(me, name, attrs)
        if self.faults is not None:
            fault = self.faults.fire(name, attrs)
            if fault is not None:
                where = {"key": attrs["key"]} if "key" in attrs else {}
                self._emit(me, "fault", {"kind": fault.kind, "at": name, **where})
                error = fault.exception(name, attrs)
                if error is not None:
                    raise error
                assert self.fault_action is not None, f"fault {fault.kind} needs a world to act it out"
                self.fault_action(fault, me, attrs)
                if me.state == KILLED or me.process in self._paused:
                    # Killed, it never returns: the process is gone. Paused (SIGSTOP), it goes
                    # on from here only once its process is continued.
                    await self._yield(me)

    def note(self, name: str, /, **attrs: Attr) -> None:
        if name == "fault":
            # The fault plan's own event: a shrinker replays each one as a fault of the plan.
            raise ValueError('"fault" is the fault plan\'s event; note a fault a scenario makes as "fault.<kind>"')
        running = _running.get(None)
        if running is None or running.state != KILLED:
            self._emit_watched(self._me(), name, attrs)

    def _emit_watched(self, task: SimTask, name: str, attrs: dict[str, Attr]) -> None:
        self._emit(task, name, attrs)
        watcher = self._watchers.get(name)
        if watcher is not None:
            watcher(task, attrs)

    def watch(self, name: str, watcher: Callable[[SimTask, dict[str, Attr]], None]) -> None:
        """Call ``watcher`` with the task and attributes of every ``name`` note, right when it is
        made, and of every ``name`` point, right when the task goes on from it: the harness looks
        at shared state at the moment the runtime reports a decision about it, or is about to
        make one (nothing can run in between, on the kernel's one thread)."""
        self._watchers[name] = watcher

    def now(self) -> float:
        return self.clock_us / 1e6

    async def sleep(self, seconds: float) -> None:
        me = self._me()
        wake_at = _wake_at(self.clock_us, seconds)
        if wake_at == self.clock_us:
            # trio's sleep(0): the task stays runnable, behind the tasks that are ready now —
            # not behind everything that becomes ready before nothing else can run. Once each of
            # those has run a step, it is a candidate like any other.
            me.behind = {t.tid for t in self.tasks if t.state == READY and t is not me}
            if me.behind:
                self._yielded.append(me)
            self._emit(me, "kernel.wait", {"on": "sleep"})
            await self._yield(me)
            return
        me.wake_at = wake_at
        me.state = SLEEPING
        me.waiting_for = "sleep for good" if me.wake_at is None else f"sleep until {me.wake_at / 1e6:g}s"
        self._emit(me, "kernel.wait", {"on": "sleep"})
        await self._yield(me)

    def lock(self, name: str) -> _SimLock:
        return _SimLock(self, name)

    def signal(self, name: str) -> _SimSignal:
        return _SimSignal(self, name)

    def task_group(self) -> _SimGroup:
        return _SimGroup(self)

    async def run_blocking(self, fn: Callable[[], T], *, cost: int = 0) -> T:
        return fn()

    async def compute(self, fn: Callable[[], T]) -> T:
        result = fn()  # one logical thread: never a pool
        if self.compute_cost_s:
            # Meanwhile the other stages run, as they do while a real one computes.
            await self.sleep(self.compute_cost_s)
        return result

    async def wait_readable(
        self, fd: int, timeout: float, *, name: str = "", ready: Callable[[], bool] | None = None
    ) -> bool:
        if not math.isfinite(timeout) or timeout <= 0:
            return False  # as the real kernel: no wait at all
        me = self._me()
        me.notified = False
        me.state = SLEEPING
        me.wake_at = self.clock_us + _us(timeout)
        me.readable_fd = fd
        # Named by what it stands for, not its number: descriptors differ from run to run.
        on = f"readable:{name}"
        me.waiting_for = f"{on} (timeout {timeout}s)"
        self._fd_waiters.append(me)
        self._emit(me, "kernel.wait", {"on": on})
        await self._yield(me)
        me.readable_fd = None
        # Readable by the time it runs again: its timeout and a write came at the same instant,
        # and the write counts (as a signal's notify does until its waiter runs).
        me.notified = me.notified or _readable(fd)
        if not me.notified:
            timed_out: dict[str, Attr] = {"on": on}
            if ready is not None and ready():
                timed_out["missed"] = True
            self._emit(me, "kernel.timeout", timed_out)
        return me.notified

    def stream(self, sock: object) -> KStream:
        raise NotImplementedError("a simulated process gets its control connection from start_process, not a socket")

    def wait_gone(self, process: KProcess, timeout: float) -> bool:
        return process.returncode is not None  # (a simulated SIGKILL takes effect at once)

    async def start_process(self, argv: list[str]) -> tuple[KProcess, KStream]:
        """Run the world's program for ``argv`` as a new simulated process (see
        :mod:`omnisim.sim_spawn`); it exits when its main returns (code 0, or 1 if it raised)."""
        module = program_name(argv)
        program = self.programs.get(module)
        if program is None:
            raise FileNotFoundError(f"no program {module!r} in this simulated world")
        spawned = program(argv)
        ours, theirs = connection(self, f"{spawned.process}.control")
        child = self._children[spawned.process] = SimChild(self, spawned, theirs)
        self._emit(self._me(), "process.started", {"process": spawned.process})

        async def run() -> None:
            code = 1
            try:
                await spawned.main(theirs)
                code = 0
            finally:
                if not self._stopping and spawned.process not in self.dead_processes:
                    self._emit(self._me(), "process.exited", {"process": spawned.process, "code": code})
                    spawned.exited()
                    child.ended(code)

        with self.as_process(spawned.process):
            task = self._register(run, spawned.process, None)
        assert self._nursery is not None
        self._nursery.start_soon(self._run_task, task, name=spawned.process)
        return child, ours


def current_task_name() -> str:
    """The name of the simulated task that is running (its events' ``task``)."""
    kernel = current_kernel()
    assert isinstance(kernel, SimKernel), "only a simulated run has tasks of its own"
    return kernel._me().name


def current_trace() -> list[TraceEvent]:
    """The running simulation's trace so far (for the harness's checks made as it runs)."""
    kernel = current_kernel()
    assert isinstance(kernel, SimKernel), "only a simulated run has a trace"
    return kernel.trace
