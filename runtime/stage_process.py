"""A stage in an OS process of its own: ``python -m runtime.stage_process '<json>'``.

The head (:class:`runtime.process_stage.ProcessStage`) starts it with one end of a socketpair and
a description of its stage. It builds that stage — its model alone, its adapter and scheduler,
its connector writing into a namespace it owns and reading from its producer's — and serves the
control plane (:mod:`runtime.control`): ``submit``, ``abort``, ``release``, ``upstream`` (the
producer restarted elsewhere) and ``shutdown`` come in; ``ready``, ``output``, ``failure``,
``released`` and a ``heartbeat`` every :data:`HEARTBEAT_S` (with its residue and model time) go
out. The chunks themselves go through /dev/shm, with cross-process FIFO wakeups.

It ignores SIGINT (the head stops it, in order, with ``shutdown``) and stops cleanly when the
head's end of the socket closes: its stage shuts down and it removes its namespace.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import socket
import sys
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from runtime.config.pipeline import PipelineConfig, build_pipeline
from runtime.config.topology import StageSpec
from runtime.connectors.namespaces import ProcTable, owner_state
from runtime.connectors.posix_store import PosixStore
from runtime.connectors.shm import ShmConnector
from runtime.connectors.wakeup import FifoWakeups
from runtime.control import Channel, ChannelClosed
from runtime.kernel import current_kernel
from runtime.models.code2wav import Code2Wav
from runtime.models.talker import Talker
from runtime.models.thinker import Thinker
from runtime.real_kernel import run
from runtime.request import Request
from runtime.sched.base import StageOutput
from runtime.stages import ComputeMeter, Stage, StageTransport, TalkerFrame, TextFinish, ThinkerDelta, build_stage
from runtime.supervisor import HEARTBEAT_S

#: How often it looks for send and receive failures to report.
FAILURES_S = 0.05

_MODELS = {"thinker": Thinker, "talker": Talker, "code2wav": Code2Wav}


def pipeline_config(raw: object, source: str, async_chunk: bool) -> PipelineConfig:
    """The head's config, rebuilt from the YAML it read (checked again: the same checks)."""
    config = build_pipeline(raw, source)
    if not async_chunk:
        config = dataclasses.replace(config, deploy=dataclasses.replace(config.deploy, async_chunk=False))
    return config


def encode_output(out: StageOutput) -> dict[str, Any]:
    """A stage output as a control message (tensors travel out of band)."""
    data = out.data
    if isinstance(data, ThinkerDelta):
        finish = None if data.finish is None else dataclasses.astuple(data.finish)
        body: Any = {"thinker": data.text, "full_payload": data.full_payload, "finish": finish}
    elif isinstance(data, TalkerFrame):
        body = {"talker": data.frame, "full_payload": data.full_payload}
    elif isinstance(data, torch.Tensor):
        body = {"audio": data}
    else:
        body = None
    return {"ev": "output", "request_id": out.request_id, "finished": out.finished, "error": out.error, "data": body}


def decode_output(message: dict[str, Any]) -> StageOutput:
    """The stage output a message carries; a field of the wrong type is a ``TypeError``."""
    request_id, error = message["request_id"], message["error"]
    if not isinstance(request_id, str) or not (error is None or isinstance(error, str)):
        raise TypeError("an output's request_id must be a string and its error a string or null")
    body = message["data"]
    data: Any = None
    if isinstance(body, dict):
        if "thinker" in body:
            data = ThinkerDelta(body["thinker"], body["full_payload"], _text_finish(body["finish"]))
        elif "talker" in body:
            data = TalkerFrame(body["talker"], body["full_payload"])
        else:
            data = body["audio"]
    return StageOutput(request_id, data, bool(message["finished"]), error)


def _text_finish(value: Any) -> TextFinish | None:
    """A Thinker output's ``[reason, prompt tokens, completion tokens]``, or None."""
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 3 and isinstance(value[0], str)) or any(
        type(n) is not int for n in value[1:]
    ):
        raise TypeError("a Thinker output's finish must be [reason, prompt tokens, completion tokens]")
    return TextFinish(*value)


class StageServer:
    """The stage process's side of the control plane."""

    def __init__(
        self,
        stage: Stage,
        namespace: str,
        channel: Channel,
        meter: ComputeMeter,
        point_upstream: Callable[[str], None],
    ) -> None:
        """``namespace``: the one the stage writes into; ``point_upstream(ns)``: point its
        connector at the namespace its producer writes into now (the producer restarted)."""
        self.stage = stage
        self.namespace = namespace
        self.channel = channel
        self.point_upstream = point_upstream
        self.meter = meter
        self._outbox: deque[dict[str, Any]] = deque()
        k = current_kernel()
        self._mail = k.signal(f"{stage.spec.name}.stage_outbox")
        self._stopped = False
        #: The stage's run ended: what it holds now is what it leaves (said in ``bye``).
        self._stage_done = False

    def _post(self, message: dict[str, Any]) -> None:
        self._outbox.append(message)
        self._mail.notify()

    async def serve(self) -> None:
        k = current_kernel()
        await k.point("stage.ready", stage=self.stage.spec.stage_id)
        await self.channel.send({"ev": "ready", "namespace": self.namespace})
        name = self.stage.spec.name
        async with k.task_group() as tasks:
            tasks.start_soon(self._run_stage, name=f"{name}.serve")
            tasks.start_soon(self._send_loop, name=f"{name}.outbox")
            tasks.start_soon(self._report_loop, name=f"{name}.report")
            tasks.start_soon(self._control_loop, name=f"{name}.control")

    async def _run_stage(self) -> None:
        await self.stage.run(self._output)
        self._stage_done = True
        self._mail.notify()

    def _output(self, out: StageOutput) -> None:
        self._post(encode_output(out) | {"compute_s": self.meter.total_s})

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            self.stage.shutdown()
            self._mail.notify()

    async def _control_loop(self) -> None:
        k = current_kernel()
        async with k.task_group() as releases:
            while not self._stopped:
                try:
                    message = await self.channel.receive()
                except ChannelClosed:
                    self.stop()  # the head is gone: nobody to work for
                    return
                op = message.get("op")
                if op == "submit":
                    request = Request(message["request_id"], message["ext"])
                    request.prompt_token_ids = list(message["prompt_ids"])
                    self.stage.submit(request, message["payload"], sends=bool(message["sends"]))
                elif op == "abort":
                    self.stage.abort(message["request_id"])
                elif op == "release":
                    releases.start_soon(lambda m=message: self._release(m), name=f"{self.stage.spec.name}.release")
                elif op == "residue":
                    self._post({"ev": "residue", "token": message["token"], "residue": self.stage.residue()})
                elif op == "upstream":
                    self.point_upstream(message["namespace"])
                elif op == "shutdown":
                    self.stop()
                    return

    async def _release(self, message: dict[str, Any]) -> None:
        removed = await self.stage.release(message["ext"])
        # The head collects a generation's failures right after its release sweep: they go first.
        self._post_failures()
        self._post({"ev": "released", "token": message["token"], "removed": removed})

    def _post_failures(self) -> None:
        for request_id, reason in self.stage.collect_failures():
            self._post({"ev": "failure", "request_id": request_id, "reason": reason})

    async def _report_loop(self) -> None:
        k = current_kernel()
        beat = k.now()
        while not self._stopped:
            self._post_failures()
            if k.now() - beat >= HEARTBEAT_S:
                beat = k.now()
                self._post({"ev": "heartbeat", "compute_s": self.meter.total_s, "residue": self.stage.residue()})
            await k.sleep(FAILURES_S)

    async def _send_loop(self) -> None:
        try:
            while not (self._stage_done and not self._outbox):
                while self._outbox:
                    await self.channel.send(self._outbox.popleft())
                if not self._stage_done:
                    await self._mail.wait(HEARTBEAT_S, ready=lambda: bool(self._outbox) or self._stage_done)
            await self.channel.send({"ev": "bye", "residue": self.stage.residue()})
        except ChannelClosed:
            self.stop()  # the head is gone: nobody to tell


async def serve(spec: dict[str, Any], fd: int) -> None:
    """Build the stage ``spec`` describes and serve the head, whose end of the control connection
    is at the other end of descriptor ``fd``, until it says stop or goes away; whatever happens,
    this process's namespace is swept before it exits."""
    config = pipeline_config(spec["pipeline"], spec["source"], spec["async_chunk"])
    stage_spec = config.stage(spec["stage_id"])
    model = _MODELS[stage_spec.model](device=spec.get("device", "cpu"))
    store = PosixStore(spec["namespace"], claim=True)
    try:
        await _serve_on(spec, fd, config, stage_spec, model, store)
    except ChannelClosed:
        pass  # the head went away (before this process was ready, say): nobody to work for
    finally:
        store.sweep()


async def _serve_on(
    spec: dict[str, Any],
    fd: int,
    config: PipelineConfig,
    stage_spec: StageSpec,
    model: torch.nn.Module,
    store: PosixStore,
) -> None:
    k = current_kernel()
    upstream = PosixStore(spec["upstream"]) if spec.get("upstream") else None
    processes = ProcTable()

    def upstream_alive() -> bool:
        current = connector.upstream
        owner = current.owner() if isinstance(current, PosixStore) else None
        return owner is None or owner_state(owner, processes) != "dead"

    connector = ShmConnector(
        store,
        stage_id=stage_spec.stage_id,
        wakeups=FifoWakeups(spec["wake"]),
        **StageTransport(**spec["transport"]).connector_options(),
        upstream=upstream,
        upstream_alive=upstream_alive if upstream is not None else None,
    )
    meter = ComputeMeter()
    stage = build_stage(config, stage_spec, model, connector, meter, input_wait_timeout_s=spec["input_wait_timeout_s"])

    def point_upstream(namespace: str) -> None:
        connector.upstream = PosixStore(namespace)
        stage.adapter.producer_moved()

    sock = socket.socket(fileno=fd)
    sock.set_inheritable(False)  # a child of this process must not keep the head's view of it alive
    channel = Channel(k.stream(sock), f"stage{stage_spec.stage_id}")
    await StageServer(stage, store.namespace, channel, meter, point_upstream).serve()


def main(argv: list[str] | None = None) -> None:
    """``argv``: the stage's description (JSON), then the descriptor of the control connection
    (as :meth:`runtime.kernel.Kernel.start_process` appends it)."""
    # The head stops its stages, in order; a signal to a stage alone is its death (SIGKILL, or
    # SIGTERM's default), which the head sees, sweeps up after and restarts from.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    description, fd = argv if argv is not None else sys.argv[1:]
    # Compute in a worker thread: the control plane must answer (heartbeats) while the model runs.
    run(serve, json.loads(description), int(fd), compute_in_threads=True)


if __name__ == "__main__":
    main()
