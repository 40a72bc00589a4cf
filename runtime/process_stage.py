"""A stage in an OS process of its own, seen from the head: a :class:`~runtime.stages.StageHandle`.

:class:`ProcessStage` spawns ``python -m runtime.stage_process`` (never a fork of the loaded head)
with a control connection (one end of a socket pair), and from then on talks to it only through
the control plane. It supervises its process: a process that exits, or that has said nothing (not even a heartbeat)
for :data:`DEAD_AFTER_S`, is dead. Then the handle tells the orchestrator (every request bound to
the stage fails, once, naming it), sweeps the dead process's namespace, and — unless the deploy
says to fail the engine — starts a new process after a back-off, in a new namespace, and tells
the stage after it where its producer now writes.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.config.topology import StageSpec
from runtime.connectors import posix_store
from runtime.connectors.posix_store import PosixStore
from runtime.control import Channel, ChannelClosed
from runtime.kernel import KProcess, current_kernel
from runtime.request import Request
from runtime.sched.base import StageOutput
from runtime.stage_process import decode_output
from runtime.stages import OnOutput, StageTransport
from runtime.supervisor import DEAD_AFTER_S, Supervised

#: How long a new stage process may take to load its model and say it is ready.
START_TIMEOUT_S = 60.0
#: How long a stage process may take to stop after ``shutdown`` before it is killed.
STOP_GRACE_S = 5.0


@dataclass(frozen=True)
class StageLaunch:
    """What every stage process of one engine is started with."""

    #: The pipeline's parsed YAML and where it came from (see :attr:`PipelineConfig.raw`).
    pipeline: Any
    source: str
    async_chunk: bool
    wake_namespace: str
    device: str = "cpu"
    input_wait_timeout_s: float = 600.0
    #: ``"restart"``: a dead stage comes back (with back-off); ``"fail"``: it stays down.
    restart: str = "restart"
    #: How the stage's connector hands chunks over (set per stage).
    transport: StageTransport = field(default_factory=StageTransport)


def _sweep_posix(namespace: str) -> None:
    PosixStore(namespace).sweep()


class ProcessStage(Supervised):
    """The head's handle on one stage process (see the module docstring)."""

    def __init__(
        self,
        spec: StageSpec,
        launch: StageLaunch,
        *,
        upstream: ProcessStage | None,
        on_death: Callable[[int, str, bool], None],
        new_namespace: Callable[[], str] = posix_store.new_namespace,
        sweep: Callable[[str], None] = _sweep_posix,
    ) -> None:
        """``new_namespace`` names each life's namespace and ``sweep`` empties a namespace a life
        left: /dev/shm's by default (a simulated world has namespaces of its own)."""
        self._fresh = new_namespace
        self._sweep = sweep
        super().__init__(spec, restart=launch.restart, upstream=upstream, on_death=on_death)
        self.launch = launch
        k = current_kernel()
        self.pid: int | None = None
        self.compute_s = 0.0
        self._compute_before = 0.0  # model time of the processes that came before this one
        self._process: KProcess | None = None
        self._channel: Channel | None = None
        self._outbox: deque[dict[str, Any]] = deque()
        self._mail = k.signal(f"{spec.name}.outbox")
        self._failures: list[tuple[str, str]] = []
        self._residue: dict[str, list[str]] = {}
        self._releases: dict[int, int | None] = {}
        self._released = k.signal(f"{spec.name}.released")
        self._tokens = 0
        self._heard = 0.0
        self._stop_asked = 0.0
        self._changed = k.signal(f"{spec.name}.state")
        #: Why the current process died ("" while it lives or stopped as asked).
        self._death = ""

    # -- the handle -------------------------------------------------------------------------------

    def submit(self, request: Request, payload: dict[str, Any] | None, *, sends: bool) -> None:
        assert self.alive, "the orchestrator submits only to a live stage"
        self._post(
            {
                "op": "submit",
                "request_id": request.request_id,
                "ext": request.external_req_id,
                "prompt_ids": request.prompt_token_ids,
                "payload": payload,
                "sends": sends,
            }
        )

    def abort(self, request_id: str) -> None:
        if self.alive:
            self._post({"op": "abort", "request_id": request_id})

    async def release(self, ext: str) -> int:
        """Ask the process for the request-level sweep; 0 if it is down (its namespace goes whole)."""
        if not self.alive:
            return 0
        return await self._ask({"op": "release", "ext": ext}) or 0

    def collect_failures(self) -> list[tuple[str, str]]:
        failed, self._failures = self._failures, []
        return failed

    def shutdown(self) -> None:
        if not self._stopping:
            self._stop_asked = current_kernel().now()
        super().shutdown()
        self._post({"op": "shutdown"})
        self._changed.notify()

    def residue(self) -> dict[str, list[str]]:
        """What the process last reported holding (with its last heartbeat)."""
        return dict(self._residue)

    async def residue_now(self) -> dict[str, list[str]]:
        """What the process holds now: asked, and answered after everything sent before."""
        if self.alive:
            await self._ask({"op": "residue"})
        return self.residue()

    def health(self) -> dict[str, Any]:
        return super().health() | {"pid": self.pid}

    def ended(self) -> bool:
        return self._process is not None and self._process.returncode is not None

    async def _ask(self, message: dict[str, Any]) -> int | None:
        """Post ``message`` under a fresh token and wait for the process's answer to it; None if
        the process died first."""
        self._tokens += 1
        token = self._tokens
        self._releases[token] = None
        self._post(message | {"token": token})

        def answered() -> bool:
            return not self.alive or self._releases.get(token) is not None

        while not answered():
            await self._released.wait(DEAD_AFTER_S, ready=answered)
        return self._releases.pop(token, None)

    def _post(self, message: dict[str, Any]) -> None:
        self._outbox.append(message)
        self._mail.notify()

    # -- the process ------------------------------------------------------------------------------

    def new_namespace(self) -> str:
        return self._fresh()

    def sweep(self, namespace: str) -> None:
        self._sweep(namespace)

    def upstream_moved(self, namespace: str) -> None:
        self._post({"op": "upstream", "namespace": namespace})

    async def live(self, on_output: OnOutput) -> str:
        """Run one stage process until it stops (``""``: as asked) or dies (why)."""
        k = current_kernel()
        self._residue = {}
        spec = {
            "pipeline": self.launch.pipeline,
            "source": self.launch.source,
            "async_chunk": self.launch.async_chunk,
            "stage_id": self.spec.stage_id,
            "namespace": self.namespace,
            "upstream": self.upstream.namespace if self.upstream is not None else None,
            "wake": self.launch.wake_namespace,
            "device": self.launch.device,
            "input_wait_timeout_s": self.launch.input_wait_timeout_s,
            "transport": dataclasses.asdict(self.launch.transport),
        }
        argv = [sys.executable, "-m", "runtime.stage_process", json.dumps(spec)]
        self._process, stream = await k.start_process(argv)
        self._channel = Channel(stream, f"{self.spec.name}.head")
        self.pid = self._process.pid
        self._heard = k.now()
        self._death = ""
        try:
            ready = await self._receive_ready()
            if ready is None:
                if not self._death:  # the engine stopped while the process was starting
                    await self._reap(kill=True)
                    self.sweep(self.namespace)
                return self._death
            self._heard = k.now()  # loading the model said nothing: silence counts from here
            self.alive = True
            self._changed.notify()
            if ready.get("namespace") != self.namespace:
                return f"it came up in namespace {ready.get('namespace')!r}, not {self.namespace!r}"
            async with k.task_group() as tasks:
                tasks.start_soon(self._send_loop, name=f"{self.spec.name}.send")
                tasks.start_soon(self._watch, name=f"{self.spec.name}.watch")
                await self._receive_loop(on_output)
                self.alive = False
                self._mail.notify()
                self._changed.notify()
        except BaseException:
            # Cancelled (the head is going down hard): nothing of this life may outlive it.
            self.alive = False
            self._kill()
            if self._process is None or k.wait_gone(self._process, STOP_GRACE_S):
                self.sweep(self.namespace)
            raise
        self._released.notify()
        if self._death:
            self._outbox.clear()  # meant for the dead process; a new one starts from the spec
            self._residue = {}  # (its memory is gone with it)
        else:
            await self._reap(kill=False)
            self.sweep(self.namespace)  # the process sweeps itself, unless it had to be killed
        return self._death

    async def bury(self) -> None:
        await self._reap(kill=True)

    async def _receive_ready(self) -> dict[str, Any] | None:
        """The process's ``ready``; None (and why, in ``_death``) if it never came: a process
        not ready within :data:`START_TIMEOUT_S` is killed."""
        k = current_kernel()
        assert self._channel is not None
        ready: list[dict[str, Any]] = []

        async def deadline() -> None:
            ends = k.now() + START_TIMEOUT_S
            while not ready and not self._death and not self._stopping and k.now() < ends:
                await self._changed.wait(0.25)
            if not ready and not self._death:
                if not self._stopping:
                    self._death = f"it was not ready after {START_TIMEOUT_S:g}s"
                self._kill()

        async with k.task_group() as tasks:
            tasks.start_soon(deadline, name=f"{self.spec.name}.start")
            while not ready:
                try:
                    message = await self._channel.receive()
                except ChannelClosed as e:
                    if not self._stopping:
                        self._death = self._death or f"it exited while starting ({e})"
                    break
                if message.get("ev") == "ready":
                    ready.append(message)
            self._changed.notify()
        return ready[0] if ready else None

    async def _receive_loop(self, on_output: OnOutput) -> None:
        """Every message the process sends, until it says goodbye or dies."""
        k = current_kernel()
        assert self._channel is not None
        while True:
            try:
                message = await self._channel.receive()
            except ChannelClosed as e:
                if not self._stopping:
                    self._death = self._death or f"its process exited ({e})"
                return
            self._heard = k.now()
            try:
                said_bye, output = self._take(message)
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                # Not what a stage process sends (a bug, or a process that is not ours any more):
                # it is dead to the head, which goes on, rather than the head dying of it.
                self._death = f"it sent a malformed message ({type(e).__name__}: {e})"
                self._kill()
                return
            if output is not None:
                on_output(output)
            if said_bye:
                if not self._stopping:
                    self._death = "it stopped unasked"
                return

    def _take(self, message: dict[str, Any]) -> tuple[bool, StageOutput | None]:
        """What one message says: whether the process said goodbye, and the output it carries,
        if any. Fields that are not what a stage process sends raise (see the caller)."""
        event = message.get("ev")
        if event == "output":
            self.compute_s = self._compute_before + float(message["compute_s"])
            return False, decode_output(message)
        if event == "failure":
            self._failures.append((_text(message["request_id"]), _text(message["reason"])))
        elif event == "released":
            self._releases[_whole(message["token"])] = _whole(message["removed"])
            self._released.notify()
        elif event == "residue":
            self._residue = _residue(message["residue"])
            self._releases[_whole(message["token"])] = 0
            self._released.notify()
        elif event == "heartbeat":
            self.compute_s = self._compute_before + float(message["compute_s"])
            self._residue = _residue(message["residue"])
        elif event == "bye":
            self._residue = _residue(message["residue"])
            return True, None
        return False, None

    async def _send_loop(self) -> None:
        assert self._channel is not None
        while self.alive:
            while self._outbox and self.alive:
                message = self._outbox.popleft()
                try:
                    await self._channel.send(message)
                except ChannelClosed:
                    return  # the receive loop finds out why
            await self._mail.wait(DEAD_AFTER_S, ready=lambda: bool(self._outbox) or not self.alive)

    async def _watch(self) -> None:
        """A process that has said nothing for :data:`DEAD_AFTER_S` is dead (hung, or stopped):
        it is killed, which ends the receive loop."""
        k = current_kernel()
        while self.alive:
            asked = k.now()
            await self._changed.wait(DEAD_AFTER_S / 4)
            if k.now() - asked > DEAD_AFTER_S / 2:
                # The head itself stalled (a GC pause, a stopped terminal): the silence may be its
                # own, with heartbeats unread in the socket. Its receive loop reads them first.
                continue
            silent = k.now() - self._heard
            if self.alive and self._stopping and k.now() - self._stop_asked > STOP_GRACE_S:
                # Asked to stop and still not gone (stopped, or hung): the stop ends here.
                self._kill()
                return
            if self.alive and not self._stopping and silent > DEAD_AFTER_S:
                self._death = f"it said nothing for {silent:.1f}s"
                self._kill()
                return

    def _kill(self) -> None:
        if self._process is not None and self._process.returncode is None:
            self._process.send_signal(signal.SIGKILL)

    async def _reap(self, *, kill: bool) -> None:
        """Wait for the process to end (killing it if it must, or if it overstays its stop)."""
        k = current_kernel()
        process = self._process
        if process is None:
            return
        if kill:
            self._kill()
        deadline = k.now() + STOP_GRACE_S
        while process.returncode is None and k.now() < deadline:
            await k.sleep(0.05)
        if process.returncode is None:
            self._kill()
            await process.wait()
        if self._channel is not None:
            await self._channel.aclose()
        self._compute_before = self.compute_s


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _whole(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"expected an integer, got {type(value).__name__}")
    return value


def _residue(value: object) -> dict[str, list[str]]:
    if not (isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, list) for k, v in value.items())):
        raise TypeError("expected a residue: names to lists")
    return value
