"""``omnisim serve``: the OpenAI-compatible server over one engine, on one trio loop.

Hypercorn's trio worker serves the ASGI application (:mod:`runtime.serving.http`) in the same
loop as the engine, so requests and stages meet through the kernel seam with no thread or queue
between them. Ctrl-C or SIGTERM stops it gracefully: requests in flight end with an error
terminal (a stream's last event says so), the listener closes, the stages stop, and the store is
swept.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from typing import Any

from omnisim.base import CommandFailed, UsageError

EXIT_BY_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, made here so that port 0 picks a free port the banner can name."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UsageError(f"cannot resolve --host {host!r}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def _survive_a_close_during_a_send() -> None:
    """Hypercorn's trio worker sends the end of a connection (``send_eof``, when the client
    closes) outside the lock its other sends take; a frame the application sends at that moment
    then raises ``trio.BusyResourceError``, which nothing catches and which ends the whole server
    (every connection, and the engine with it). Treat it as what it is: that connection closed."""
    import trio
    from hypercorn.events import Closed
    from hypercorn.trio.tcp_server import TCPServer

    send = TCPServer.protocol_send
    if getattr(send, "survives_busy", False):
        return

    async def protocol_send(self: TCPServer, event: Any) -> None:
        try:
            await send(self, event)
        except trio.BusyResourceError:
            await self.protocol.handle(Closed())

    protocol_send.survives_busy = True  # type: ignore[attr-defined]
    TCPServer.protocol_send = protocol_send  # type: ignore[method-assign]


def serve(args: argparse.Namespace) -> int:
    import trio
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve

    from omnisim.pipeline_cli import engine_parts
    from runtime.orchestrator import EngineStopped, StagesDown
    from runtime.pipeline import Models, build_engine
    from runtime.real_kernel import run
    from runtime.serving.http import Server

    _survive_a_close_during_a_send()
    sock = listen(args.host, args.port)
    config, store = engine_parts(args)
    try:
        engine = build_engine(config, Models.build(args.device), store, processes=args.processes or None)
    except BaseException:
        store.sweep()  # (its owner record is already in /dev/shm)
        raise
    server = Server(engine, store, model_name=args.served_model_name or config.name)
    hypercorn = Config()
    host, port = sock.getsockname()[:2]
    hypercorn.bind = [f"fd://{sock.detach()}"]  # hypercorn's from here on: it closes it
    hypercorn.accesslog = "-" if args.access_log else None
    hypercorn.errorlog = "-" if args.access_log else None  # the banner says where it listens
    hypercorn.graceful_timeout = 5.0
    received: list[int] = []
    not_up: list[str] = []

    async def main() -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            stop = trio.Event()

            listening = trio.CancelScope()

            async def on_signal() -> None:
                with listening:
                    async for signum in signals:
                        received.append(signum)
                        # The engine first: every request in flight ends now with an error terminal
                        # its client is sent, so the server's graceful wait for them is short.
                        engine.shutdown(f"the server was stopped ({signal.Signals(signum).name})")
                        server.stop()  # (its WebSocket sessions close: going away)
                        stop.set()
                        return

            async with trio.open_nursery() as nursery:

                def never_up(why: str | None) -> None:
                    """Stop the stages that were starting, in order (``why``, said once they stopped:
                    raised in here it would come out in a group; None: a signal stopped them)."""
                    if why is not None:
                        not_up.append(why)
                    engine.shutdown(why)
                    listening.cancel()
                    nursery.cancel_scope.deadline = trio.current_time() + 10.0  # the stages' grace, bounded

                nursery.start_soon(on_signal)
                nursery.start_soon(engine.run)
                with trio.move_on_after(args.ready_timeout) as waiting:
                    try:
                        await engine.wait_ready(args.ready_timeout)
                    except (EngineStopped, StagesDown) as e:  # a signal while they started, or a stage that could not
                        never_up(None if received else str(e))
                        return
                if waiting.cancelled_caught:
                    never_up(f"the stages were not up after {args.ready_timeout:g} s")
                    return
                where = "as processes" if engine_in_processes(engine) else "in process"
                print(
                    f"serving {server.model_name} on http://{host}:{port} (stages {where}, "
                    f"ready {seconds_since_launch():.2f} s after launch); Ctrl-C stops",
                    flush=True,
                )
                await hypercorn_serve(server.app(), hypercorn, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
                engine.shutdown()
                nursery.cancel_scope.deadline = trio.current_time() + 10.0  # the stages' grace, bounded

    try:
        run(main, compute_in_threads=True)
    finally:
        store.sweep()
    if not_up:
        raise CommandFailed(not_up[0])
    if received:
        print(f"stopped by {signal.Signals(received[0]).name}", file=sys.stderr)
        return EXIT_BY_SIGNAL[signal.Signals(received[0])]
    return 0


def seconds_since_launch() -> float:
    """How long ago this process started (Linux: its start tick against the uptime)."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def engine_in_processes(engine: Any) -> bool:
    from runtime.process_stage import ProcessStage

    return any(isinstance(stage, ProcessStage) for stage in engine.stages.values())
