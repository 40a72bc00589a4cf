"""The wire format of a stage-edge payload: msgpack with tensors and ndarrays carried out of band.

A frame is::

    b"OMW1" | u32 header length (little endian) | msgpack header | zero padding | buffer region

The header is ordinary msgpack (maps, lists, str, int, float, bool, None, bytes). A tensor is the
extension type 1 and an ndarray the extension type 2; each carries ``[dtype, shape, offset,
nbytes]`` and its raw bytes live in the buffer region at ``offset`` (64-byte aligned). Keeping
the bytes out of the msgpack stream is what lets a put copy each tensor exactly once (straight
into the shared-memory segment) and a get copy it exactly once (straight out of the mapping),
where upstream copies the payload six times.

Decoding validates everything it reads; malformed input raises :class:`WireDecodeError` and
nothing else.
"""

from __future__ import annotations

import mmap
import struct
from typing import Any

import msgpack
import numpy as np
import torch

MAGIC = b"OMW1"
_PREFIX = struct.Struct("<4sI")
ALIGN = 64
EXT_TENSOR = 1
EXT_NDARRAY = 2

#: Anything a frame can be written into or read from.
Buffer = bytes | bytearray | memoryview | mmap.mmap

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

    def write_into(self, buf: Buffer) -> None:
        """Write the whole frame into ``buf`` (writable, at least ``size`` bytes)."""
        view = memoryview(buf).cast("B")
        _PREFIX.pack_into(view, 0, MAGIC, len(self._header))
        end = _PREFIX.size + len(self._header)
        view[_PREFIX.size : end] = self._header
        view[end : self._buffer_base] = bytes(self._buffer_base - end)
        for offset, data in self._buffers:
            if data.nbytes:
                start = self._buffer_base + offset
                np.copyto(np.frombuffer(view, np.uint8, data.nbytes, start), data)

    def to_bytes(self) -> bytes:
        out = bytearray(self.size)
        self.write_into(out)
        return bytes(out)


def encode(obj: object) -> bytes:
    """Encode ``obj`` to a standalone frame."""
    return EncodedFrame(obj).to_bytes()


def _shape(raw: object) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(isinstance(d, int) and d >= 0 for d in raw):
        raise WireDecodeError(f"bad shape {raw!r}")
    return tuple(raw)


class _Decoder:
    def __init__(self, view: memoryview, base: int) -> None:
        self._view = view
        self._base = base

    def _region(self, offset: object, nbytes: object) -> np.ndarray:
        if not (isinstance(offset, int) and isinstance(nbytes, int)) or offset < 0 or nbytes < 0:
            raise WireDecodeError("bad buffer reference")
        start = self._base + offset
        if start + nbytes > len(self._view):
            raise WireDecodeError(f"buffer reference past end of frame ({start + nbytes} > {len(self._view)})")
        return np.frombuffer(self._view, np.uint8, nbytes, start)

    def ext_hook(self, code: int, data: bytes) -> object:
        try:
            meta = msgpack.unpackb(data)
        except Exception as e:
            raise WireDecodeError(f"bad extension payload: {e}") from e
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
                np.copyto(out.reshape(-1).view(torch.uint8).numpy(), self._region(offset, nbytes))
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
            return self._region(offset, nbytes).view(dtype).reshape(shape).copy()
        raise WireDecodeError(f"unknown extension type {code}")


def decode(buf: Buffer) -> Any:
    """Decode a frame. Tensors and arrays are copied out, so ``buf`` may be released afterwards."""
    with memoryview(buf) as raw, raw.cast("B") as view:
        return _decode_view(view)


def _decode_view(view: memoryview) -> Any:
    if len(view) < _PREFIX.size:
        raise WireDecodeError(f"frame too short ({len(view)} bytes)")
    magic, header_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise WireDecodeError(f"bad magic {bytes(magic)!r}")
    end = _PREFIX.size + header_len
    if end > len(view):
        raise WireDecodeError(f"header length {header_len} runs past the end of a {len(view)}-byte frame")
    decoder = _Decoder(view, _align(end))
    try:
        return msgpack.unpackb(view[_PREFIX.size : end], ext_hook=decoder.ext_hook, raw=False, strict_map_key=False)
    except WireDecodeError:
        raise
    except Exception as e:
        raise WireDecodeError(f"corrupt header: {type(e).__name__}: {e}") from None
