"""Stages that can die, and what supervises them.

:class:`Supervised` is the supervision every mortal stage handle shares: it runs one *life* of
its stage after another. When a life ends without having been asked to (the process exited, or
said nothing for :data:`DEAD_AFTER_S`), the orchestrator hears of it at once (every request bound
to the stage fails, once), the dead life's namespace is swept, and — unless the deploy says to
fail the engine (``restart: fail``: the orchestrator then shuts down) — a new life starts after a
back-off, in a *new* namespace, and the stage after it is told where its producer now writes.

A life is an OS process: see :class:`~runtime.process_stage.ProcessStage` (the simulator runs
the same class, its kernel starting each life as a simulated process).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from runtime.config.deploy import RESTART_POLICIES
from runtime.config.topology import StageSpec
from runtime.kernel import current_kernel
from runtime.stages import OnOutput

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
