"""The wire format of a stage-edge payload: msgpack with tensors and ndarrays carried out of band,
sealed by a commit trailer.

A frame is::

    b"OMW2" | u32 header length | msgpack header | zero padding | buffer region | trailer
    trailer = b"OMWC" | u32 generation | u64 checksum | u64 length of everything before the trailer

(little endian). The header is ordinary msgpack (maps, lists, str, int, float, bool, None,
bytes; a dict key may be a tuple). A tensor is the extension type 1, an ndarray 2 and a PIL image
4; each carries ``[dtype, shape, offset, nbytes]`` (an image: ``[mode, [width, height], offset,
nbytes]``) and its raw bytes live in the buffer region at ``offset`` (64-byte aligned).

The rest of what upstream's serializer (msgspec, spec §2.8) carries arrives as upstream's
receiver sees it: a dataclass and a ``msgspec.Struct`` as a map of their fields (a Struct's
defaults omitted where it says so, its renames and tag kept), a slice as ``[start, stop, step]``,
a ``msgspec.msgpack.Ext`` as itself (extension type 5 wraps it, so its code never collides with
ours), an ndarray read-only. Keeping the bytes out of the msgpack stream is what lets
a put copy each tensor exactly once (one ``pwrite`` from the tensor's memory into the segment)
and a get copy it exactly once (one ``preadv`` into the new tensor's memory), where upstream
copies the payload six times.

**The trailer is written last.** A segment is reserved (zero-filled) before its first byte is
written, so a writer that dies mid-frame leaves zeros where the trailer belongs: a reader finds
no commit and refuses the frame, instead of decoding a well-formed header over a zero tail. The
checksum (XXH3-64 over the prefix, the header and every buffer, in order) catches bytes that were
changed after the commit. It needs none of the segment's bytes, so a writer computes it beside the
copy; a reader computes it piece by piece as each piece lands, while the piece is in the cache.
The generation counts the frames the segment's file held before this one (a consumed segment is
kept as a spare and reused: its count goes on), so a put's handle names its own frame, never a
later put's in the same file. The checksum is seeded with the generation and the key the frame
was put under: it covers them too.

Frames are written to and read from a :class:`FrameIO`: positional writes and reads, which a
shared-memory segment (file descriptor) and a plain byte buffer both provide.

Decoding validates everything it reads *before it allocates*: every buffer reference must lie
inside the frame, match its dtype and shape, and overlap no other, so a hostile header can never
make the decoder allocate more than the frame's own size. Malformed input raises
:class:`WireDecodeError` and nothing else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import mmap
import struct
from typing import Any, NamedTuple, Protocol

import msgpack
import msgspec
import numpy as np
import torch
import xxhash
from PIL import Image

MAGIC = b"OMW2"
_PREFIX = struct.Struct("<4sI")
COMMIT_MAGIC = b"OMWC"
#: The commit trailer: magic, the file's generation, checksum of the body, length of the body
#: (all before it).
TRAILER = struct.Struct("<4sIQQ")
#: Generations wrap at the trailer field's width.
GENERATIONS = 1 << 32
#: A reader checksums buffers in pieces of this size as it reads them, each while it is in the
#: cache from its copy: one trip through memory instead of two.
PIECE = 256 << 10
#: From this size on a received buffer gets memory that huge pages may back (:func:`huge_page_memory`):
#: glibc's largest mmap threshold. Below it malloc serves a repeated allocation from memory it
#: already has (its threshold rises with every mapping freed), whose pages are faulted in once.
HUGE_PAGE_BYTES = 32 << 20


def new_digest(seed: int = 0) -> xxhash.xxh3_64:
    """The frame checksum: XXH3-64 (measured faster than CRC-32C on this machine's reads), seeded
    with :func:`frame_seed`."""
    return xxhash.xxh3_64(seed=seed)


def frame_seed(key: str | None, generation: int) -> int:
    """The seed of a frame's checksum, so that it covers what the frame's bytes do not say: the
    key it was put under (a frame a stray rename moved under another key fails its checksum
    there) and its generation in its file. A frame read without its key (:func:`decode`) was
    written without one."""
    return generation ^ (xxhash.xxh3_64_intdigest(key.encode()) if key is not None else 0)


ALIGN = 64
EXT_TENSOR = 1
EXT_NDARRAY = 2
EXT_LOST = 3
EXT_IMAGE = 4
EXT_USER = 5
#: The extension types whose bytes live in the buffer region.
_BUFFERED = frozenset({EXT_TENSOR, EXT_NDARRAY, EXT_IMAGE})
#: A palette does not travel with an image's bytes: such an image is refused, not sent without it.
_PALETTE_MODES = frozenset({"P", "PA"})


@dataclasses.dataclass(frozen=True)
class LostChunk:
    """What a producer puts under a key whose payload it lost: no payload decodes from it, and a
    reader that meets it learns why (:class:`WireDecodeError`)."""

    reason: str


#: Raw bytes.
Buffer = bytes | bytearray | memoryview | mmap.mmap | np.ndarray


class FrameIO(Protocol):
    """Positional I/O on a fixed-size byte region (a segment, or a buffer)."""

    @property
    def size(self) -> int: ...

    def write(self, offset: int, data: Buffer) -> None:
        """Write all of ``data`` at ``offset``."""
        ...

    def read(self, offset: int, nbytes: int) -> bytes:
        """The ``nbytes`` at ``offset``; raise if fewer are there."""
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

    def read(self, offset: int, nbytes: int) -> bytes:
        self._check_inside(offset, nbytes)
        return self._view[offset : offset + nbytes].tobytes()

    def read_into(self, offset: int, out: np.ndarray) -> None:
        self._check_inside(offset, out.nbytes)
        np.copyto(out, np.frombuffer(self._view, np.uint8, out.nbytes, offset))

    def _check_inside(self, offset: int, nbytes: int) -> None:
        if offset + nbytes > len(self._view):
            raise WireDecodeError(f"read of {nbytes} bytes at {offset} runs past a {len(self._view)}-byte frame")

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
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
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


#: The dtypes numpy has too: a plain CPU tensor of one of them is viewed as bytes through numpy,
#: whose view operations cost a fraction of torch's (a small chunk pays for them per tensor).
_NUMPY_DTYPES = frozenset(TORCH_DTYPES.values()) - {torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2}


def _as_bytes_array(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of the tensor's bytes: no copy for a CPU, contiguous tensor."""
    if t.is_cpu and t.dtype in _NUMPY_DTYPES and t.is_contiguous() and not t.is_conj() and not t.is_neg():
        return t.detach().numpy().reshape(-1).view(np.uint8)
    flat = t.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
    # A one-element slice may keep a stride the byte view rejects; a flat tensor's bytes are dense.
    flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8).numpy()


class EncodedFrame:
    """A payload planned for the wire: the header is packed, the tensor bytes are not yet copied.

    ``size`` is known before any byte is written, so a store can reserve exactly that much;
    :meth:`write_body` fills it with one copy per buffer and :meth:`commit` seals it with the
    :meth:`checksum`.
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
        except Exception as e:  # (a payload's own objects, as they are read: an unset field, a broken image)
            raise WireEncodeError(f"cannot encode payload: {type(e).__name__}: {e}") from e
        self._buffer_base = _align(_PREFIX.size + len(header))
        #: The prefix and the header, zero-padded to the buffer region.
        self._head = bytearray(self._buffer_base)
        _PREFIX.pack_into(self._head, 0, MAGIC, len(header))
        self._head[_PREFIX.size : _PREFIX.size + len(header)] = header
        self._header_end = _PREFIX.size + len(header)
        self.body_size = self._buffer_base + self._region
        self.size = self.body_size + TRAILER.size

    def _reserve(self, data: np.ndarray) -> int:
        offset = self._region
        self._buffers.append((offset, data))
        self._region = _align(offset + data.nbytes)
        return offset

    def _default(self, obj: Any) -> msgpack.ExtType:
        if isinstance(obj, LostChunk):
            return msgpack.ExtType(EXT_LOST, obj.reason.encode())
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
        if isinstance(obj, Image.Image):
            return self._image(obj)
        if isinstance(obj, msgspec.Struct):
            return _struct_fields(obj)
        if isinstance(obj, msgspec.msgpack.Ext):
            return msgpack.ExtType(EXT_USER, msgpack.packb([obj.code, obj.data]))
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return {field.name: getattr(obj, field.name) for field in dataclasses.fields(obj)}
        if isinstance(obj, slice):
            return [obj.start, obj.stop, obj.step]
        if isinstance(obj, int):  # (msgpack asks only for the integers it cannot carry)
            raise WireEncodeError(f"cannot encode an integer of {obj.bit_length()} bits: the wire carries 64")
        raise WireEncodeError(f"cannot encode object of type {type(obj).__name__}")

    def _image(self, image: Image.Image) -> msgpack.ExtType:
        if image.mode in _PALETTE_MODES:
            raise WireEncodeError(
                f"cannot encode a palette image (mode {image.mode!r}): its palette would be lost; "
                "convert it first, e.g. image.convert('RGBA')"
            )
        data = np.frombuffer(image.tobytes(), np.uint8)
        meta = [image.mode, list(image.size), self._reserve(data), data.nbytes]
        return msgpack.ExtType(EXT_IMAGE, msgpack.packb(meta))

    def write_body(self, io: FrameIO) -> None:
        """Write everything but the commit trailer, one write per buffer."""
        io.write(0, self._head)
        for offset, data in self._buffers:
            if data.nbytes:
                io.write(self._buffer_base + offset, data)

    def checksum(self, seed: int = 0) -> int:
        """The checksum the trailer commits (seeded with :func:`frame_seed`): of the prefix, the
        header and every buffer. It reads only the payload's own memory, so it may run while
        :meth:`write_body` copies."""
        digest = new_digest(seed)
        digest.update(memoryview(self._head)[: self._header_end])
        for _, data in self._buffers:
            if data.nbytes:
                digest.update(data)
        return digest.intdigest()

    def commit(self, io: FrameIO, checksum: int, generation: int = 0) -> None:
        """Write the commit trailer: from now on the frame reads as complete."""
        io.write(self.body_size, TRAILER.pack(COMMIT_MAGIC, generation, checksum, self.body_size))

    def write_to(self, io: FrameIO, key: str | None = None) -> None:
        """Write the whole frame (``size`` bytes) through ``io``, the commit trailer last, as a
        new file's frame of ``key``."""
        self.write_body(io)
        self.commit(io, self.checksum(frame_seed(key, 0)))

    def to_bytes(self, key: str | None = None) -> bytes:
        out = bytearray(self.size)
        self.write_to(BufferIO(out), key)
        return bytes(out)


#: The factories whose empty product msgspec takes for a field's default (it omits such a field).
_EMPTY_FACTORIES = (list, dict, set, bytearray)


def _struct_fields(struct: msgspec.Struct) -> dict[str, Any] | list[Any]:
    """What msgspec's own encoder writes for ``struct``, its values left to this encoder: its
    fields by their encoded names (an ``array_like`` Struct's values in order), its tag if it has
    one, and with ``omit_defaults`` no field whose value is its default (msgspec's test: the default
    object itself, or an empty product of the default factory)."""
    config = struct.__struct_config__
    fields = msgspec.structs.fields(struct)
    if config.array_like:
        values = [getattr(struct, field.name) for field in fields]
        return values if config.tag is None else [config.tag, *values]
    out: dict[str, Any] = {} if config.tag is None else {config.tag_field: config.tag}
    for field in fields:
        value = getattr(struct, field.name)
        if config.omit_defaults and _is_default(value, field):
            continue
        out[field.encode_name] = value
    return out


def _is_default(value: object, field: msgspec.structs.FieldInfo) -> bool:
    if value is field.default:
        return True
    factory = field.default_factory
    return factory in _EMPTY_FACTORIES and type(value) is factory and not value  # type: ignore[arg-type]


def read_trailer(frame: FrameIO) -> tuple[bytes, int, int, int] | None:
    """``frame``'s trailer (magic, generation, checksum, length), committed or not; None if the
    frame is shorter than a trailer. Reads only the trailer."""
    if frame.size < TRAILER.size:
        return None
    return TRAILER.unpack(frame.read(frame.size - TRAILER.size, TRAILER.size))


def committed_generation(frame: FrameIO) -> int | None:
    """The generation in ``frame``'s commit trailer; None if it has none (it is uncommitted, or
    no frame)."""
    trailer = read_trailer(frame)
    return trailer[1] if trailer is not None and trailer[0] == COMMIT_MAGIC else None


def encode(obj: object, key: str | None = None) -> bytes:
    """Encode ``obj`` to a standalone frame (put under ``key``, if it names one)."""
    return EncodedFrame(obj).to_bytes(key)


def _shape(raw: object) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(isinstance(d, int) and d >= 0 for d in raw):
        raise WireDecodeError(f"bad shape {raw!r}")
    return tuple(raw)


class _Ref(NamedTuple):
    """One buffer reference of a header, checked against the frame but not yet read."""

    code: int
    dtype: torch.dtype | np.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int
    #: An image's mode and size (its bytes are a flat uint8 buffer).
    image: tuple[str, tuple[int, int]] | None = None


def _dtype(code: int, name: object) -> torch.dtype | np.dtype:
    """The dtype of a tensor's (``code`` EXT_TENSOR) or an ndarray's reference."""
    if code == EXT_TENSOR:
        dtype = TORCH_DTYPES.get(name) if isinstance(name, str) else None
        if dtype is None:
            raise WireDecodeError(f"unknown tensor dtype {name!r}")
        return dtype
    try:
        np_dtype = np.dtype(name)  # type: ignore[call-overload]
    except TypeError as e:
        raise WireDecodeError(f"unknown ndarray dtype {name!r}") from e
    if np_dtype.kind in "OV":
        raise WireDecodeError(f"unsupported ndarray dtype {name!r}")
    return np_dtype


class _Refs:
    """The first pass over a header: every buffer reference, checked before anything is allocated."""

    def __init__(self, base: int, body_size: int) -> None:
        self._base = base
        self._body_size = body_size
        self.refs: list[_Ref] = []

    def ext_hook(self, code: int, data: bytes) -> object:
        if code == EXT_LOST:
            raise WireDecodeError(f"its producer lost it: {data.decode(errors='replace')}")
        if code not in _BUFFERED:
            return _inline_ext(code, data)
        meta = _unpack_meta(data, 4)
        dtype_name, raw_shape, offset, nbytes = meta
        image = None
        if code == EXT_IMAGE:
            image = _image_mode(dtype_name), _image_size(raw_shape)
            dtype, shape = np.dtype(np.uint8), (_image_nbytes(*image),)
        else:
            dtype, shape = _dtype(code, dtype_name), _shape(raw_shape)
        if not (isinstance(offset, int) and isinstance(nbytes, int)) or offset < 0 or nbytes < 0:
            raise WireDecodeError("bad buffer reference")
        expected = math.prod(shape) * dtype.itemsize
        if nbytes != expected:
            raise WireDecodeError(f"{dtype_name} of shape {shape} needs {expected} bytes, got {nbytes}")
        start = self._base + offset
        if nbytes and start + nbytes > self._body_size:
            raise WireDecodeError(f"buffer reference past end of frame ({start + nbytes} > {self._body_size})")
        self.refs.append(_Ref(code, dtype, shape, start, nbytes, image))
        return None

    def check_disjoint(self) -> None:
        """No two buffers share a byte: together they never claim more than the frame holds."""
        spans = sorted((r.start, r.start + r.nbytes) for r in self.refs if r.nbytes)
        for (_, end), (start, _) in itertools.pairwise(spans):
            if start < end:
                raise WireDecodeError(f"overlapping buffer references (one ends at {end}, the next starts at {start})")


def _unpack_meta(data: bytes, length: int) -> list[Any]:
    """An extension's metadata: a msgpack list of ``length`` items."""
    try:
        meta = msgpack.unpackb(data)
    except Exception as e:
        raise WireDecodeError(f"bad extension payload: {e}") from None
    if not isinstance(meta, list) or len(meta) != length:
        raise WireDecodeError("bad extension payload shape")
    return meta


def _inline_ext(code: int, data: bytes) -> object:
    """An extension that holds its own bytes: a user's ``msgspec.msgpack.Ext``, wrapped in
    :data:`EXT_USER` (an extension the user packed with msgpack itself is refused here: upstream's
    encoder refuses it at the put)."""
    if code != EXT_USER:
        raise WireDecodeError(f"unknown extension type {code}")
    user_code, user_data = _unpack_meta(data, 2)
    if not isinstance(user_code, int) or not -128 <= user_code <= 127 or not isinstance(user_data, bytes):
        raise WireDecodeError(f"bad user extension [{user_code!r}, {type(user_data).__name__}]")
    return msgspec.msgpack.Ext(user_code, user_data)


def _image_mode(mode: object) -> str:
    if not isinstance(mode, str) or mode in _PALETTE_MODES:
        raise WireDecodeError(f"bad image mode {mode!r}")
    return mode


def _image_size(raw: object) -> tuple[int, int]:
    size = _shape(raw)
    if len(size) != 2:
        raise WireDecodeError(f"bad image size {raw!r}")
    return size[0], size[1]


def _image_nbytes(mode: str, size: tuple[int, int]) -> int:
    """The bytes of an image of ``mode`` and ``size``, found without allocating the image."""
    try:
        pixel = len(Image.new(mode, (1, 1)).tobytes())
    except (ValueError, TypeError, KeyError) as e:
        raise WireDecodeError(f"unknown image mode {mode!r}: {e}") from None
    width, height = size
    row = (width + 7) // 8 if mode == "1" else width * pixel  # ("1" packs eight pixels to a byte)
    return row * height


def _restore(ref: _Ref, value: object, raw: np.ndarray | None) -> object:
    """The value handed out for ``ref`` once its bytes are read and checked: a tensor as it is,
    an ndarray read-only (as upstream's, which views the received bytes), an image made of them."""
    if ref.image is not None:
        mode, size = ref.image
        try:
            return Image.frombytes(mode, size, b"" if raw is None else raw)
        except (ValueError, TypeError, OverflowError, MemoryError) as e:  # a size Pillow refuses
            raise WireDecodeError(f"cannot make a {mode} image of size {size}: {e}") from None
    if isinstance(value, np.ndarray):
        value.flags.writeable = False
    return value


def huge_page_memory(nbytes: int) -> np.ndarray:
    """``nbytes`` of new memory of its own, which the kernel may back with transparent huge
    pages: a copy into new memory pays a page fault per page touched, and at 128 MiB those 4 KiB
    faults cost three times the copy itself (``omnisim bench pages``); 2 MiB pages take 512 times
    fewer. The memory lives as long as the array (or a tensor made from it) refers to it."""
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # a kernel without transparent huge pages: 4 KiB pages
        memory.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(memory, np.uint8)


def _fresh_bytes(nbytes: int) -> np.ndarray:
    """``nbytes`` to copy a received buffer into: from malloc, or for a buffer too large for
    malloc to keep, :func:`huge_page_memory`."""
    return np.empty(nbytes, np.uint8) if nbytes < HUGE_PAGE_BYTES else huge_page_memory(nbytes)


def _allocate(ref: _Ref) -> tuple[object, np.ndarray | None]:
    """The value of a reference and the bytes to read into (None when it holds no bytes). At most
    ``ref.nbytes`` are allocated, which the first pass bounded by the frame's size."""
    try:
        if ref.code == EXT_TENSOR:
            if ref.nbytes < HUGE_PAGE_BYTES:
                out = torch.empty(ref.shape, dtype=ref.dtype)  # type: ignore[arg-type]
            else:  # (its storage is then the mapping's: it cannot be resized in place)
                out = torch.from_numpy(huge_page_memory(ref.nbytes)).view(ref.dtype).reshape(ref.shape)  # type: ignore[arg-type]
            return out, _as_bytes_array(out) if ref.nbytes else None
        buf = _fresh_bytes(ref.nbytes)
        return buf.view(ref.dtype).reshape(ref.shape), buf if ref.nbytes else None
    except (TypeError, ValueError, OverflowError, RuntimeError, OSError) as e:  # a shape no allocator takes
        raise WireDecodeError(f"cannot allocate a buffer of shape {ref.shape}: {e}") from None


def _tuple_keys(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """Map keys that were tuples arrive as lists; make them tuples again (recursively)."""
    return {_hashable(k): v for k, v in pairs}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def _unpack(header: memoryview, ext_hook: Any, *, exact: bool = True) -> Any:
    """The header's object; ``exact`` False (a first pass that only visits the buffer references)
    keeps arrays as tuples and maps as msgpack builds them, which is several times faster."""
    try:
        if not exact:
            return msgpack.unpackb(header, ext_hook=ext_hook, raw=False, strict_map_key=False, use_list=False)
        return msgpack.unpackb(
            header, ext_hook=ext_hook, raw=False, strict_map_key=False, object_pairs_hook=_tuple_keys
        )
    except WireDecodeError:
        raise
    except Exception as e:
        raise WireDecodeError(f"corrupt header: {type(e).__name__}: {e}") from None


def decode(source: Buffer | FrameIO, key: str | None = None) -> Any:
    """Decode a frame from bytes or a :class:`FrameIO` (one put under ``key``, if it names one).
    Tensors and arrays are copied out."""
    if isinstance(source, Buffer):
        with memoryview(source) as raw, raw.cast("B") as view:
            return FrameDecoder(BufferIO(view), key).decode()
    return FrameDecoder(source, key).decode()


class FrameDecoder:
    """One frame being decoded. Making it checks the commit trailer and every buffer reference
    of the header, then allocates the buffers (never more than the frame holds); :meth:`decode`
    then reads the bytes piece by piece and checksums each piece as it landed, and :meth:`finish`
    accepts them only if the checksum is the committed one. The checksum is of the bytes handed
    out, never of a second read of the source: a stray write between two reads would pass."""

    def __init__(self, io: FrameIO, key: str | None = None) -> None:
        """``key``: the key the frame was put under (none for a frame encoded on its own)."""
        if io.size < _PREFIX.size + TRAILER.size:
            raise WireDecodeError(f"frame too short ({io.size} bytes): its writer never finished")
        self._io = io
        body_size = io.size - TRAILER.size
        magic, generation, self._committed, length = TRAILER.unpack(io.read(body_size, TRAILER.size))
        if magic != COMMIT_MAGIC:
            raise WireDecodeError("uncommitted frame: its writer never finished (no commit trailer)")
        self._seed = frame_seed(key, generation)
        if length != body_size:
            raise WireDecodeError(f"the commit trailer says {length} bytes, the frame holds {body_size}")
        magic, header_len = _PREFIX.unpack(io.read(0, _PREFIX.size))
        if magic != MAGIC:
            raise WireDecodeError(f"bad magic {bytes(magic)!r}")
        end = _PREFIX.size + header_len
        if end > body_size:
            raise WireDecodeError(f"header length {header_len} runs past the end of a {body_size}-byte frame")
        self._head = io.read(0, end)
        self._header = memoryview(self._head)[_PREFIX.size :]
        refs = _Refs(_align(end), body_size)
        _unpack(self._header, refs.ext_hook, exact=False)
        refs.check_disjoint()
        self._refs = refs.refs
        self._values = [_allocate(ref) for ref in self._refs]
        self.nbytes = sum(ref.nbytes for ref in self._refs)

    def _pieces(self) -> list[tuple[int, np.ndarray]]:
        """Where each piece of the buffers comes from, and the memory it goes to, in order."""
        return [
            (ref.start + start, raw[start : start + PIECE])
            for ref, (_, raw) in zip(self._refs, self._values, strict=True)
            if raw is not None
            for start in range(0, ref.nbytes, PIECE)
        ]

    def decode(self) -> Any:
        """Read every piece, and checksum it where it landed (while it is in the cache)."""
        digest = new_digest(self._seed)
        digest.update(self._head)
        for offset, piece in self._pieces():
            self._io.read_into(offset, piece)
            digest.update(piece)
        return self.finish(digest.intdigest())

    def finish(self, checksum: int) -> Any:
        """The decoded object, if ``checksum`` of the bytes read is the committed one."""
        if checksum != self._committed:
            raise WireDecodeError(
                f"checksum mismatch (XXH3 {checksum:#018x}, committed {self._committed:#018x}): corrupt bytes"
            )
        values = iter([_restore(ref, *value) for ref, value in zip(self._refs, self._values, strict=True)])
        return _unpack(self._header, lambda code, data: next(values) if code in _BUFFERED else _inline_ext(code, data))
