"""Stages that can die, and what supervises them.

:class:`Supervised` is the supervision every mortal stage handle shares: it runs one *life* of
its stage after another. When a life ends without having been asked to (the process exited, or
said nothing for :data:`DEAD_AFTER_S`), the orchestrator hears of it at once (every request bound
to the stage fails, once), the dead life's namespace is swept, and — unless the deploy says to
fail the engine (``restart: fail``: the orchestrator then shuts down) — a new life starts after a
back-off, in a *new* namespace, and the stage after it is told where its producer now writes.

Two kinds of lives exist: an OS process (:class:`~runtime.process_stage.ProcessStage`), and a
:class:`LocalStage`: a stage of this process run as a group of tasks with a namespace of its own
and a heartbeat — how the simulator models a stage process, whose death it can then inject.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from runtime.config.deploy import RESTART_POLICIES
from runtime.config.topology import StageSpec
from runtime.kernel import KTaskGroup, current_kernel
from runtime.request import Request
from runtime.stages import OnOutput, Stage

#: A life that said nothing for this long is dead (its heartbeat comes every 0.2 s).
DEAD_AFTER_S = 1.0
HEARTBEAT_S = 0.2
#: Restarts back off: 0.1 s, doubling, at most this long; a life that lasted STABLE_AFTER_S
#: resets the back-off (it did not die of starting).
FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0
STABLE_AFTER_S = 10.0


class Supervised:
    """The restart loop of a mortal stage handle (see the module docstring)."""

    def __init__(
        self,
        spec: StageSpec,
        *,
        restart: str,
        upstream: Supervised | None,
        on_death: Callable[[int, str, bool], None],
    ) -> None:
        if restart not in RESTART_POLICIES:
            raise ValueError(f"restart policy must be one of {', '.join(RESTART_POLICIES)}, got {restart!r}")
        self.spec = spec
        self.restart = restart
        self.upstream = upstream
        self.downstream: Supervised | None = None
        if upstream is not None:
            upstream.downstream = self
        self._on_death = on_death
        #: Where the current (or next) life writes; known before it starts, so the stage after
        #: it can be told at once.
        self.namespace = self.new_namespace()
        self.alive = False
        self.restarts = 0
        self._stopping = False
        #: Rung when a life ends, so nothing waits out a timeout for an answer from a dead life.
        self._life_news = current_kernel().signal(f"{spec.name}.life")

    async def run(self, on_output: OnOutput) -> None:
        """Live one life after another until :meth:`shutdown` (or a death, with ``fail``)."""
        k = current_kernel()
        backoff = FIRST_BACKOFF_S
        while not self._stopping:
            k.note("stage.life", stage=self.spec.stage_id, ns=self.namespace)
            born = k.now()
            reason = await self.live(on_output)
            self.alive = False
            self._life_news.notify()
            if not reason:
                return  # stopped as asked
            k.note("stage.died", stage=self.spec.stage_id, reason=reason)
            self._on_death(self.spec.stage_id, reason, not self._stopping and self.restart == "restart")
            # A life that went silent may only be paused (SIGSTOP, swapped out): were its
            # namespace swept now, it could wake up and write into it again.
            try:
                await self.bury()
            finally:  # (a head stopped meanwhile still removes what the dead life left)
                self.sweep(self.namespace)
            k.note("stage.buried", stage=self.spec.stage_id, ns=self.namespace)
            if self._stopping or self.restart != "restart":
                return
            if k.now() - born >= STABLE_AFTER_S:
                backoff = FIRST_BACKOFF_S
            await k.sleep(backoff)
            if self._stopping:
                return
            backoff = min(backoff * 2, MAX_BACKOFF_S)
            self.restarts += 1
            # A new life never writes into a dead one's namespace.
            self.namespace = self.new_namespace()
            if self.downstream is not None:
                self.downstream.upstream_moved(self.namespace)

    def shutdown(self) -> None:
        self._stopping = True

    def health(self) -> dict[str, Any]:
        # A life whose process ended is not alive, whether or not its watch has seen it yet: a
        # request that another stage fails meanwhile (the chunks it waited for stopped coming)
        # fails of this death, and a new one is not handed to the dead life.
        return {"alive": self.alive and not self.ended(), "namespace": self.namespace, "restarts": self.restarts}

    # -- what a kind of life provides ---------------------------------------------------------------

    async def live(self, on_output: OnOutput) -> str:
        """One life: until it stops as asked (``""``) or is found dead (why)."""
        raise NotImplementedError

    async def bury(self) -> None:
        """Make sure the life found dead is dead: SIGKILL it, and wait until it is gone."""
        raise NotImplementedError

    def ended(self) -> bool:
        """Whether the current life's process is gone (as ``waitpid`` tells a parent)."""
        raise NotImplementedError

    def new_namespace(self) -> str:
        raise NotImplementedError

    def sweep(self, namespace: str) -> None:
        """Remove everything a dead life left in ``namespace``."""
        raise NotImplementedError

    def upstream_moved(self, namespace: str) -> None:
        """The stage before this one now writes into ``namespace``."""
        raise NotImplementedError


@dataclass(eq=False)
class Life:
    """One life of a :class:`LocalStage`, as whoever models its process builds it."""

    stage: Stage
    #: The context its tasks are started in: their process.
    process: Callable[[], AbstractContextManager[object]]
    #: SIGKILL: its tasks stop where they are, for good.
    kill: Callable[[], None]
    #: Whether its process is gone (as ``waitpid`` tells a parent).
    exited: Callable[[], bool]
    #: Point it at the namespace its producer now writes into.
    point_upstream: Callable[[str], None]
    #: When its heartbeat last beat.
    beat: float = 0.0


class LocalStage(Supervised):
    """A stage of this process whose tasks form a process of their own, with a namespace of its
    own and a heartbeat: see the module docstring. ``make_life(namespace, upstream_namespace)``
    builds each life; ``new_namespace()`` names the next one's namespace and
    ``sweep_namespace(ns)`` removes what a dead one left in its own."""

    def __init__(
        self,
        spec: StageSpec,
        make_life: Callable[[str, str | None], Life],
        new_namespace: Callable[[], str],
        sweep_namespace: Callable[[str], None],
        *,
        restart: str,
        upstream: LocalStage | None,
        on_death: Callable[[int, str, bool], None],
    ) -> None:
        self._make_life = make_life
        self._fresh = new_namespace
        self._sweep = sweep_namespace
        self.life: Life | None = None
        self._compute_before = 0.0
        #: Where every life's tasks run: a life found dead must not hold up the next one.
        self._lives: KTaskGroup | None = None
        super().__init__(spec, restart=restart, upstream=upstream, on_death=on_death)

    @property
    def compute_s(self) -> float:
        return self._compute_before + (self.life.stage.compute_s if self.life is not None else 0.0)

    # -- lives --------------------------------------------------------------------------------------

    async def run(self, on_output: OnOutput) -> None:
        async with current_kernel().task_group() as lives:
            self._lives = lives
            await super().run(on_output)

    async def live(self, on_output: OnOutput) -> str:
        k = current_kernel()
        assert self._lives is not None, "a life starts from run()"
        if self.life is not None:
            self._compute_before += self.life.stage.compute_s
        life = self.life = self._make_life(self.namespace, self.upstream.namespace if self.upstream else None)
        life.beat = k.now()
        with life.process():
            self._lives.start_soon(lambda: life.stage.run(on_output), name=self.spec.name)
            self._lives.start_soon(lambda: self._heartbeat(life), name=f"{self.spec.name}.heartbeat")
        self.alive = True
        death = await self._watch(life)
        if not death:
            life.stage.shutdown()
        return death

    async def bury(self) -> None:
        if self.life is not None:
            self.life.kill()

    def ended(self) -> bool:
        return self.life is not None and self.life.exited()

    def new_namespace(self) -> str:
        return self._fresh()

    def sweep(self, namespace: str) -> None:
        self._sweep(namespace)

    def upstream_moved(self, namespace: str) -> None:
        if self.life is not None:
            self.life.point_upstream(namespace)

    async def _heartbeat(self, life: Life) -> None:
        """Runs in the life's own process: it stops when that process dies (or stops)."""
        k = current_kernel()
        while not self._stopping:
            life.beat = k.now()
            await k.sleep(HEARTBEAT_S)

    async def _watch(self, life: Life) -> str:
        """Runs in the supervisor's process: a life whose process exited is dead, and so is one
        silent for :data:`DEAD_AFTER_S` (hung, or stopped)."""
        k = current_kernel()
        while not self._stopping:
            await k.sleep(HEARTBEAT_S)
            if life.exited():
                return "its process exited"
            silent = k.now() - life.beat
            if silent > DEAD_AFTER_S:
                return f"its process said nothing for {silent:.1f}s"
        return ""

    # -- the handle ---------------------------------------------------------------------------------

    def submit(self, request: Request, payload: dict[str, Any] | None, *, sends: bool) -> None:
        assert self.alive and self.life is not None, "the orchestrator submits only to a live stage"
        self.life.stage.submit(request, payload, sends=sends)

    def abort(self, request_id: str) -> None:
        if self.alive and self.life is not None:
            self.life.stage.abort(request_id)

    async def release(self, ext: str) -> int:
        """The sweep runs in the life's process, as a message to a stage process would; it is
        waited for only while that life lives (a dead one's namespace goes whole)."""
        life = self.life
        if not self.alive or life is None or self._lives is None:
            return 0
        removed: list[int] = []

        async def sweep() -> None:
            removed.append(await life.stage.release(ext))
            self._life_news.notify()

        def answered() -> bool:
            return bool(removed) or not self.alive or self.life is not life

        with life.process():
            self._lives.start_soon(sweep, name=f"{self.spec.name}.release.{ext}")
        while not answered():
            await self._life_news.wait(HEARTBEAT_S, ready=answered)
        return removed[0] if removed else 0

    def collect_failures(self) -> list[tuple[str, str]]:
        if self.alive and self.life is not None:
            return self.life.stage.collect_failures()
        return []

    def shutdown(self) -> None:
        super().shutdown()
        if self.life is not None:
            self.life.stage.shutdown()

    def residue(self) -> dict[str, list[str]]:
        """What the live process holds (a dead one holds nothing: its memory is gone)."""
        if not self.alive or self.life is None:
            return {}
        return self.life.stage.residue()

    async def residue_now(self) -> dict[str, list[str]]:
        return self.residue()
