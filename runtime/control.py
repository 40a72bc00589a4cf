"""The control plane between the head and a stage process: framed messages over a Unix socket.

A message is a dict; on the wire it is an 8-byte length (little endian) and one frame of the
data plane's format (:mod:`runtime.connectors.wire`: msgpack, tensors carried out of band, a
commit trailer and a checksum), so stage outputs — text, codec frames, audio — cross as they are.
The chunks themselves never come this way: they go through the shared-memory connector.
"""

from __future__ import annotations

import contextlib
import struct
from typing import Any

from runtime.connectors.wire import WireDecodeError, decode, encode
from runtime.kernel import KStream, current_kernel

_LENGTH = struct.Struct("<Q")
#: The largest message either side accepts (a stage's whole forwarded payload fits many times).
MAX_MESSAGE = 1 << 30
_READ = 1 << 16


class ChannelClosed(Exception):
    """The other end is gone (it closed the socket, or its process died)."""


class Channel:
    """One end of the control connection; several tasks may send on it."""

    def __init__(self, stream: KStream, name: str) -> None:
        self._stream = stream
        self._buffer = bytearray()
        self._sending = current_kernel().lock(f"{name}.send")

    async def send(self, message: dict[str, Any]) -> None:
        data = encode(message)
        async with self._sending:  # one message at a time: frames never interleave
            try:
                await self._stream.send_all(_LENGTH.pack(len(data)) + data)
            except OSError as e:
                raise ChannelClosed(str(e)) from None

    async def receive(self) -> dict[str, Any]:
        """The next message; :class:`ChannelClosed` at the end of the stream."""
        (length,) = _LENGTH.unpack(await self._exactly(_LENGTH.size))
        if length > MAX_MESSAGE:
            raise ChannelClosed(f"a message of {length} bytes is larger than the {MAX_MESSAGE} allowed")
        try:
            message = decode(await self._exactly(length))
        except WireDecodeError as e:
            raise ChannelClosed(f"a corrupt message: {e}") from None
        if not isinstance(message, dict):
            raise ChannelClosed(f"a message that is not a dict: {type(message).__name__}")
        return message

    async def _exactly(self, n: int) -> bytes:
        while len(self._buffer) < n:
            try:
                more = await self._stream.receive_some(max(_READ, n - len(self._buffer)))
            except OSError as e:
                raise ChannelClosed(str(e)) from None
            if not more:
                raise ChannelClosed("the other end closed the connection")
            self._buffer += more
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        return out

    async def aclose(self) -> None:
        with contextlib.suppress(OSError):
            await self._stream.aclose()
