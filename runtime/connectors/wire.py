"""The wire format of a stage-edge payload: msgpack with tensors and ndarrays carried out of band.

A frame is::

    b"OMW1" | u32 header length (little endian) | msgpack header | zero padding | buffer region

The header is ordinary msgpack (maps, lists, str, int, float, bool, None, bytes). A tensor is the
extension type 1 and an ndarray the extension type 2; each carries ``[dtype, shape, offset,
nbytes]`` and its raw bytes live in the buffer region at ``offset`` (64-byte aligned). Keeping
the bytes out of the msgpack stream is what lets a put copy each tensor exactly once (one
``pwrite`` from the tensor's memory into the segment) and a get copy it exactly once (one
``preadv`` into the new tensor's memory), where upstream copies the payload six times.

Frames are written to and read from a :class:`FrameIO`: positional writes and reads, which a
shared-memory segment (file descriptor) and a plain byte buffer both provide.

Decoding validates everything it reads; malformed input raises :class:`WireDecodeError` and
nothing else.
"""

from __future__ import annotations

import mmap
import struct
from typing import Any, Protocol

import msgpack
import numpy as np
import torch

MAGIC = b"OMW1"
_PREFIX = struct.Struct("<4sI")
ALIGN = 64
EXT_TENSOR = 1
EXT_NDARRAY = 2

#: Raw bytes.
Buffer = bytes | bytearray | memoryview | mmap.mmap | np.ndarray


class FrameIO(Protocol):
    """Positional I/O on a fixed-size byte region (a segment, or a buffer)."""

    @property
    def size(self) -> int: ...

    def write(self, offset: int, data: Buffer) -> None:
        """Write all of ``data`` at ``offset``."""
        ...

    def read_into(self, offset: int, out: np.ndarray) -> None:
        """Fill ``out`` (uint8) with the bytes at ``offset``; raise if fewer are there."""
        ...


class BufferIO:
    """FrameIO over a byte buffer in memory."""

    def __init__(self, data: Buffer) -> None:
        self._view = memoryview(data).cast("B")

    @property
    def size(self) -> int:
        return len(self._view)

    def write(self, offset: int, data: Buffer) -> None:
        chunk = memoryview(data).cast("B")
        self._view[offset : offset + len(chunk)] = chunk

    def read_into(self, offset: int, out: np.ndarray) -> None:
        if offset + out.nbytes > len(self._view):
            raise WireDecodeError(f"read of {out.nbytes} bytes at {offset} runs past a {len(self._view)}-byte frame")
        np.copyto(out, np.frombuffer(self._view, np.uint8, out.nbytes, offset))

    def close(self) -> None:
        self._view.release()


#: Every torch dtype a stage payload may carry, by its wire name.
TORCH_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    )
}


class WireError(Exception):
    """Base class of wire-format errors."""


class WireEncodeError(WireError):
    """The object holds something the wire format cannot carry."""


class WireDecodeError(WireError):
    """The bytes are not a valid frame (truncated, corrupt, or inconsistent)."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _as_bytes_array(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a CPU, contiguous tensor's bytes (no copy)."""
    flat = t.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
    # A one-element slice may keep a stride the byte view rejects; a flat tensor's bytes are dense.
    flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8).numpy()


class EncodedFrame:
    """A payload planned for the wire: the header is packed, the tensor bytes are not yet copied.

    ``size`` is known before any byte is written, so a store can reserve exactly that much and
    :meth:`write_into` can fill it with one copy per buffer.
    """

    def __init__(self, obj: object) -> None:
        self._buffers: list[tuple[int, np.ndarray]] = []
        self._region = 0
        try:
            header = msgpack.packb(obj, default=self._default, use_bin_type=True, strict_types=False)
        except WireEncodeError:
            raise
        except (TypeError, ValueError, OverflowError, RuntimeError, NotImplementedError) as e:
            raise WireEncodeError(f"cannot encode payload: {e}") from e
        self._header = header
        self._buffer_base = _align(_PREFIX.size + len(header))
        self.size = self._buffer_base + self._region

    def _reserve(self, data: np.ndarray) -> int:
        offset = self._region
        self._buffers.append((offset, data))
        self._region = _align(offset + data.nbytes)
        return offset

    def _default(self, obj: Any) -> msgpack.ExtType:
        if isinstance(obj, torch.Tensor):
            name = str(obj.dtype).removeprefix("torch.")
            if name not in TORCH_DTYPES:
                raise WireEncodeError(f"unsupported tensor dtype {obj.dtype}")
            data = _as_bytes_array(obj)
            meta = [name, list(obj.shape), self._reserve(data), data.nbytes]
            return msgpack.ExtType(EXT_TENSOR, msgpack.packb(meta))
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind in "OV":
                raise WireEncodeError(f"unsupported ndarray dtype {obj.dtype}")
            data = np.ascontiguousarray(obj).reshape(-1).view(np.uint8)
            meta = [obj.dtype.str, list(obj.shape), self._reserve(data), data.nbytes]
            return msgpack.ExtType(EXT_NDARRAY, msgpack.packb(meta))
        raise WireEncodeError(f"cannot encode object of type {type(obj).__name__}")

    def write_to(self, io: FrameIO) -> None:
        """Write the whole frame (``size`` bytes) through ``io``: one write per buffer."""
        head = bytearray(self._buffer_base)
        _PREFIX.pack_into(head, 0, MAGIC, len(self._header))
        head[_PREFIX.size : _PREFIX.size + len(self._header)] = self._header
        io.write(0, head)
        for offset, data in self._buffers:
            if data.nbytes:
                io.write(self._buffer_base + offset, data)

    def to_bytes(self) -> bytes:
        out = bytearray(self.size)
        self.write_to(BufferIO(out))
        return bytes(out)


def encode(obj: object) -> bytes:
    """Encode ``obj`` to a standalone frame."""
    return EncodedFrame(obj).to_bytes()


def _shape(raw: object) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(isinstance(d, int) and d >= 0 for d in raw):
        raise WireDecodeError(f"bad shape {raw!r}")
    return tuple(raw)


class _Decoder:
    def __init__(self, io: FrameIO, base: int) -> None:
        self._io = io
        self._base = base

    def _read_into(self, out: np.ndarray, offset: object, nbytes: object) -> None:
        if not (isinstance(offset, int) and isinstance(nbytes, int)) or offset < 0 or nbytes < 0:
            raise WireDecodeError("bad buffer reference")
        start = self._base + offset
        if start + nbytes > self._io.size:
            raise WireDecodeError(f"buffer reference past end of frame ({start + nbytes} > {self._io.size})")
        self._io.read_into(start, out)

    def ext_hook(self, code: int, data: bytes) -> object:
        try:
            meta = msgpack.unpackb(data)
        except Exception as e:
            raise WireDecodeError(f"bad extension payload: {e}") from None
        if not isinstance(meta, list) or len(meta) != 4:
            raise WireDecodeError("bad extension payload shape")
        dtype_name, raw_shape, offset, nbytes = meta
        shape = _shape(raw_shape)
        if code == EXT_TENSOR:
            dtype = TORCH_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
            if dtype is None:
                raise WireDecodeError(f"unknown tensor dtype {dtype_name!r}")
            out = torch.empty(shape, dtype=dtype)
            expected = out.numel() * out.element_size()
            if nbytes != expected:
                raise WireDecodeError(f"tensor of shape {shape} {dtype_name} needs {expected} bytes, got {nbytes}")
            if expected:
                self._read_into(out.reshape(-1).view(torch.uint8).numpy(), offset, nbytes)
            return out
        if code == EXT_NDARRAY:
            try:
                dtype = np.dtype(dtype_name)
            except TypeError as e:
                raise WireDecodeError(f"unknown ndarray dtype {dtype_name!r}") from e
            if dtype.kind in "OV":
                raise WireDecodeError(f"unsupported ndarray dtype {dtype_name!r}")
            expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if nbytes != expected:
                raise WireDecodeError(f"ndarray of shape {shape} {dtype_name} needs {expected} bytes, got {nbytes}")
            out = np.empty(expected, np.uint8)
            if expected:
                self._read_into(out, offset, nbytes)
            return out.view(dtype).reshape(shape)
        raise WireDecodeError(f"unknown extension type {code}")


def decode(source: Buffer | FrameIO) -> Any:
    """Decode a frame from bytes or a :class:`FrameIO`. Tensors and arrays are copied out."""
    if isinstance(source, Buffer):
        with memoryview(source) as raw, raw.cast("B") as view:
            return _decode_io(BufferIO(view))
    return _decode_io(source)


def _decode_io(io: FrameIO) -> Any:
    if io.size < _PREFIX.size:
        raise WireDecodeError(f"frame too short ({io.size} bytes)")
    prefix = np.empty(_PREFIX.size, np.uint8)
    io.read_into(0, prefix)
    magic, header_len = _PREFIX.unpack(prefix.tobytes())
    if magic != MAGIC:
        raise WireDecodeError(f"bad magic {bytes(magic)!r}")
    end = _PREFIX.size + header_len
    if end > io.size:
        raise WireDecodeError(f"header length {header_len} runs past the end of a {io.size}-byte frame")
    header = np.empty(header_len, np.uint8)
    io.read_into(_PREFIX.size, header)
    decoder = _Decoder(io, _align(end))
    try:
        return msgpack.unpackb(header.data, ext_hook=decoder.ext_hook, raw=False, strict_map_key=False)
    except WireDecodeError:
        raise
    except Exception as e:
        raise WireDecodeError(f"corrupt header: {type(e).__name__}: {e}") from None
