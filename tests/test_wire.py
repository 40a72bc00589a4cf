"""The wire format: exact round trips, clean encode errors, and a decoder that only ever raises
WireDecodeError on malformed input."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import re
import struct
from collections.abc import Callable
from typing import Any

import msgpack
import msgspec
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from omnisim.processes import FORGERIES, forged_frame, intact_forgery
from omnisim.sim_kernel import SimKernel
from omnisim.strategies.random import RandomStrategy
from runtime.connectors.shm import PARALLEL_CHECKSUM_BYTES, ShmConnector
from runtime.connectors.wire import (
    ALIGN,
    COMMIT_MAGIC,
    HUGE_PAGE_BYTES,
    MAGIC,
    PIECE,
    TORCH_DTYPES,
    TRAILER,
    BufferIO,
    EncodedFrame,
    WireDecodeError,
    WireEncodeError,
    decode,
    encode,
)

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def sample_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A deterministic tensor of ``dtype`` whose values are distinct where the dtype allows."""
    n = int(np.prod(shape, dtype=np.int64))
    base = torch.arange(n, dtype=torch.float64) - n // 3
    if dtype == torch.bool:
        t = base.remainder(2) == 0
    elif dtype.is_complex:
        t = torch.complex(base, -base / 2).to(dtype)
    elif dtype == torch.uint8:
        t = base.remainder(256).to(dtype)
    elif dtype == torch.int8:
        t = (base.remainder(256) - 128).to(dtype)
    elif dtype.is_floating_point:
        t = (base / 4).to(dtype)
    else:
        t = (base * 1000).to(dtype)
    return t.reshape(shape)


def raw_bytes(t: torch.Tensor) -> bytes:
    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t.resolve_conj().resolve_neg())
    return dense.reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same_tensor(got: object, want: torch.Tensor) -> None:
    assert isinstance(got, torch.Tensor)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert raw_bytes(got) == raw_bytes(want)


def assert_same(got: object, want: object) -> None:
    """Structural, bit-exact equality, where tuples come back as lists."""
    if isinstance(want, torch.Tensor):
        assert_same_tensor(got, want)
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray)
        assert got.dtype == want.dtype
        assert got.shape == want.shape
        assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()
    elif isinstance(want, dict):
        assert isinstance(got, dict)
        assert list(got) == list(want)
        for k in want:
            assert_same(got[k], want[k])
    elif isinstance(want, list | tuple):
        assert isinstance(got, list)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)
    else:
        assert type(got) is type(want)
        assert got == want


def round_trip(obj: object) -> Any:
    frame = EncodedFrame(obj)
    data = encode(obj)
    assert len(data) == frame.size
    assert data[:4] == MAGIC
    return decode(data)


# -- tensors ---------------------------------------------------------------------------------

DTYPE_NAMES = sorted(TORCH_DTYPES)


def test_dtype_table_is_consistent() -> None:
    for name, dtype in TORCH_DTYPES.items():
        assert str(dtype) == f"torch.{name}"
    assert {"bool", "bfloat16", "float16", "complex128", "int64", "uint64", "float8_e5m2"} <= set(TORCH_DTYPES)


@pytest.mark.parametrize("name", DTYPE_NAMES)
@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5), (2, 3, 4)], ids=str)
def test_tensor_round_trip_every_dtype(name: str, shape: tuple[int, ...]) -> None:
    t = sample_tensor(TORCH_DTYPES[name], shape)
    assert_same_tensor(round_trip(t), t)


@pytest.mark.parametrize("name", DTYPE_NAMES)
@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4, 2)], ids=str)
def test_empty_tensor_round_trip(name: str, shape: tuple[int, ...]) -> None:
    t = torch.empty(shape, dtype=TORCH_DTYPES[name])
    assert_same_tensor(round_trip(t), t)


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_zero_dim_tensor_keeps_its_shape(name: str) -> None:
    t = sample_tensor(TORCH_DTYPES[name], (4,))[1].clone()
    assert t.dim() == 0
    got = round_trip(t)
    assert_same_tensor(got, t)
    assert got.dim() == 0


NON_CONTIGUOUS = {
    "transpose": lambda t: t.T,
    "step_slice": lambda t: t[:, ::2],
    "narrow_rows": lambda t: t[1:3],
    "permute": lambda t: t.reshape(2, 3, 4).permute(2, 0, 1),
    "expand": lambda t: t[0:1, 0].expand(5, 3),
    "diagonal": lambda t: t[:4, :4].diagonal(),
}


@pytest.mark.parametrize("name", DTYPE_NAMES)
@pytest.mark.parametrize("view", sorted(NON_CONTIGUOUS))
def test_non_contiguous_tensor_round_trip(name: str, view: str) -> None:
    t = NON_CONTIGUOUS[view](sample_tensor(TORCH_DTYPES[name], (4, 6)))
    got = round_trip(t)
    assert_same_tensor(got, t)
    assert got.is_contiguous()


@pytest.mark.parametrize("name", ["complex64", "complex128"])
def test_conjugate_view_round_trip(name: str) -> None:
    t = sample_tensor(TORCH_DTYPES[name], (2, 3)).conj()
    assert t.is_conj()
    got = round_trip(t)
    assert not got.is_conj()
    assert_same_tensor(got, t.resolve_conj())
    neg = t.imag  # a negative-bit view
    assert_same_tensor(round_trip(neg), neg.resolve_neg())


@pytest.mark.parametrize(
    "view",
    [lambda: torch.arange(10.0)[::2][:1], lambda: torch.zeros(4, 3)[:1, 0], lambda: torch.ones(3, 4)[1, ::4]],
    ids=["step_then_one", "column_one_row", "row_big_step"],
)
def test_single_element_strided_view_round_trip(view: Any) -> None:
    t = view()
    assert t.numel() == 1
    assert_same_tensor(round_trip(t), t)


def test_tensor_is_detached_and_copied_out() -> None:
    src = torch.arange(6, dtype=torch.float32, requires_grad=True)
    data = bytearray(encode({"x": src * 2}))
    got = decode(data)["x"]
    assert not got.requires_grad
    data[:] = bytes(len(data))  # the decoded tensor does not alias the frame
    assert got.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_a_large_buffer_decodes_into_memory_of_its_own_that_outlives_the_frame(dtype: torch.dtype) -> None:
    """From ``HUGE_PAGE_BYTES`` on a buffer is copied into a mapping huge pages may back; the
    values are the same, the array and tensor own that memory, and neither aliases the frame."""
    t = sample_tensor(dtype, (3, HUGE_PAGE_BYTES // 3 // dtype.itemsize + 5))
    a = np.arange(HUGE_PAGE_BYTES // 8 + 1, dtype=np.float64).reshape(1, -1)
    data = bytearray(encode({"t": t, "a": a}))
    got = decode(data)
    data[:] = bytes(len(data))
    gc.collect()
    assert_same_tensor(got["t"], t)
    assert np.array_equal(got["a"], a) and got["a"].dtype == a.dtype
    got["t"].view(-1)[0] = 1  # writable
    assert got["t"].clone().shape == t.shape


def test_float_specials_are_bit_exact() -> None:
    t = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45], dtype=torch.float32)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        assert_same_tensor(round_trip(t.to(dtype)), t.to(dtype))


def test_buffers_are_aligned() -> None:
    a = torch.arange(3, dtype=torch.int8)
    b = torch.arange(5, dtype=torch.float64)
    frame = encode([a, b])
    (header_len,) = struct.unpack_from("<I", frame, 4)
    header = msgpack.unpackb(frame[8 : 8 + header_len], ext_hook=lambda code, data: msgpack.unpackb(data))
    base = (8 + header_len + ALIGN - 1) // ALIGN * ALIGN
    offsets = [meta[2] for meta in header]
    assert offsets == [0, ALIGN]
    assert (len(frame) - TRAILER.size) % ALIGN == 0
    assert len(frame) >= base + ALIGN + b.numel() * 8 + TRAILER.size
    assert frame[base + ALIGN : base + ALIGN + 40] == raw_bytes(b)
    assert_same(decode(frame), [a, b])


# -- ndarrays --------------------------------------------------------------------------------

NDARRAYS = {
    "f4_2d": np.arange(12, dtype=np.float32).reshape(3, 4) / 3,
    "f8": np.linspace(-1, 1, 9),
    "f2": np.arange(5, dtype=np.float16),
    "i1": np.arange(-4, 4, dtype=np.int8),
    "u2": np.arange(7, dtype=np.uint16),
    "i8_3d": np.arange(24, dtype=np.int64).reshape(2, 3, 4),
    "big_endian_i4": np.arange(6, dtype=">i4"),
    "big_endian_f8": np.arange(3, dtype=">f8"),
    "bool": np.array([True, False, True]),
    "c16": np.array([1 + 2j, -3j]),
    "zero_dim": np.array(3.5),
    "zero_dim_int": np.array(7, dtype=np.int32),
    "empty": np.empty((0, 3), dtype=np.float32),
    "empty_1d": np.empty(0, dtype=np.uint8),
    "fortran": np.asfortranarray(np.arange(6, dtype=np.int32).reshape(2, 3)),
    "strided": np.arange(20, dtype=np.float64)[::3],
    "transposed": np.arange(12, dtype=np.int16).reshape(3, 4).T,
    "unicode": np.array(["ab", "c", "déf"]),
    "bytes": np.array([b"x", b"yz"]),
    "datetime": np.array(["2020-01-01", "1999-12-31"], dtype="datetime64[D]"),
    "timedelta": np.array([1, -2], dtype="timedelta64[ms]"),
}


@pytest.mark.parametrize("name", sorted(NDARRAYS))
def test_ndarray_round_trip(name: str) -> None:
    arr = NDARRAYS[name]
    got = round_trip(arr)
    assert_same(got, arr)
    assert not got.flags.writeable  # as upstream's receiver, which views the bytes that arrived
    np.testing.assert_array_equal(got, arr)


# -- containers ------------------------------------------------------------------------------


def test_nested_payload_round_trip() -> None:
    payload = {
        "codes": {"audio": sample_tensor(torch.int64, (2, 16))},
        "meta": {
            "finished": torch.tensor(True),
            "is_segment_finished": torch.tensor(False),
            "left_context_size": 25,
            "codec_streaming": True,
            "note": None,
        },
        "embed": {"prefill": sample_tensor(torch.bfloat16, (3, 8)), "decode": [sample_tensor(torch.float16, (8,))]},
        "ids": {"all": [1, 2, 3], "prompt": [], "output": [[4], [5, 6]]},
        "arrays": [np.arange(4, dtype=np.float32), {"deep": [[np.array([[1, 2]], dtype=np.uint8)]]}],
        "speaker": "Ethan",
        "language": "日本語",
        "raw": b"\x00\xffbytes",
        "float": -1.5,
        "big": 2**63 - 1,
        "neg": -(2**63),
        7: "int key",
        "empty_dict": {},
        "tuple": (1, "two", 3.0),
    }
    assert_same(round_trip(payload), payload)


@pytest.mark.parametrize("obj", [0, {}, [], "", None, False, True, 0.0, b""], ids=repr)
def test_scalar_and_falsy_round_trip(obj: object) -> None:
    assert_same(round_trip(obj), obj)


def test_a_header_of_every_length_round_trips() -> None:
    """Wherever the header ends (a whole line with no padding after it, or one byte either side),
    with and without a buffer after it."""
    for n in range(200):
        for obj in ("h" * n, {"s": "h" * n, "t": torch.arange(3)}):
            assert_same(round_trip(obj), obj)


def test_same_tensor_twice_is_carried_twice() -> None:
    t = torch.arange(4)
    got = round_trip([t, t])
    assert_same(got, [t, t])
    assert got[0].data_ptr() != got[1].data_ptr()


def test_write_into_larger_buffer_and_decode_from_memoryview() -> None:
    obj = {"t": torch.arange(10, dtype=torch.int16), "a": np.ones(3)}
    frame = EncodedFrame(obj)
    buf = bytearray(frame.size)
    frame.write_to(BufferIO(memoryview(buf)))
    assert bytes(buf) == frame.to_bytes()
    assert_same(decode(memoryview(buf)), obj)


# -- what else upstream's serializer carries (spec §2.8) -------------------------------------


def test_a_slice_arrives_as_start_stop_step() -> None:
    assert round_trip({"s": slice(1, 7, 2), "open": slice(None, 3)}) == {"s": [1, 7, 2], "open": [None, 3, None]}


@dataclasses.dataclass
class _Meta:
    finished: torch.Tensor
    left_context_size: int
    inner: _Inner | None = None
    _private: str = "kept"


@dataclasses.dataclass
class _Inner:
    codes: list[int]


def test_a_dataclass_arrives_as_a_map_of_its_fields() -> None:
    meta = _Meta(torch.tensor(True), 25, _Inner([1, 2]))
    got = round_trip({"meta": meta})
    assert_same(
        got,
        {
            "meta": {
                "finished": torch.tensor(True),
                "left_context_size": 25,
                "inner": {"codes": [1, 2]},
                "_private": "kept",
            }
        },
    )


class _Codes(msgspec.Struct, omit_defaults=True, kw_only=True, forbid_unknown_fields=True):
    audio: object = None


class _Payload(msgspec.Struct, omit_defaults=True, kw_only=True, forbid_unknown_fields=True):
    codes: _Codes | None = None
    speaker: str | None = None
    left_context_size: int = 0
    ids: list[int] = msgspec.field(default_factory=list)
    extra: dict = msgspec.field(default_factory=dict)


class _Renamed(msgspec.Struct, rename="camel", tag=True):
    left_context: int
    some_flag: bool = False


class _Tagged(msgspec.Struct, tag_field="kind", tag="meta", omit_defaults=True):
    value: float = 0.5


class _Row(msgspec.Struct, array_like=True):
    a: int
    b: str = "x"


class _TaggedRow(msgspec.Struct, array_like=True, tag=7):
    a: int


#: Structs with nothing msgspec cannot encode itself: this wire must write what msgspec writes.
PLAIN_STRUCTS = {
    "all_defaults": _Payload(),
    "defaults_by_value": _Payload(left_context_size=int("0"), ids=[], extra={}, speaker=None),
    "set_fields": _Payload(codes=_Codes(audio=[1, 2]), speaker="Ethan", left_context_size=25, ids=[3]),
    "zero_float_is_not_the_default_object": _Tagged(value=float("0.5")),
    "default_object": _Tagged(),
    "renamed_and_tagged": _Renamed(left_context=3),
    "array_like": _Row(1),
    "array_like_tagged": _TaggedRow(2),
    "nested_in_containers": {"rows": [_Row(1, "y"), _Renamed(left_context=0, some_flag=True)]},
}


@pytest.mark.parametrize("name", sorted(PLAIN_STRUCTS))
def test_a_struct_arrives_as_msgspec_itself_would_send_it(name: str) -> None:
    struct = PLAIN_STRUCTS[name]
    assert round_trip(struct) == msgspec.msgpack.decode(msgspec.msgpack.encode(struct))


def test_a_struct_holding_tensors_arrives_as_a_map_without_its_defaults() -> None:
    """Upstream's payload types are Structs that omit their defaults: the receiver gets maps, the
    omitted fields absent, the tensors whole (spec §2.8, the struct-vs-dict asymmetry)."""
    payload = _Payload(codes=_Codes(audio=torch.arange(28).reshape(1, 28)), extra={"handle": b"\x00\xff"})
    got = round_trip(payload)
    assert set(got) == {"codes", "extra"}
    assert_same(got["codes"], {"audio": torch.arange(28).reshape(1, 28)})
    assert got["extra"] == {"handle": b"\x00\xff"}


#: One image of each mode Pillow makes that carries no palette, with pixels that differ.
IMAGE_MODES = ["1", "L", "LA", "I", "F", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr", "LAB", "HSV", "I;16", "La", "RGBa"]


def _image(mode: str, size: tuple[int, int] = (9, 3)) -> Image.Image:
    nbytes = len(Image.new(mode, size).tobytes())
    return Image.frombytes(mode, size, (bytes(range(1, 252)) * (nbytes // 251 + 1))[:nbytes])


@pytest.mark.parametrize("mode", IMAGE_MODES)
def test_an_image_arrives_as_an_image_with_its_mode_size_and_bytes(mode: str) -> None:
    image = _image(mode)
    got = round_trip({"image": image, "empty": Image.new(mode, (0, 4))})
    assert isinstance(got["image"], Image.Image)
    assert (got["image"].mode, got["image"].size, got["image"].tobytes()) == (mode, image.size, image.tobytes())
    assert got["empty"].size == (0, 4)


def test_a_received_image_is_a_copy_of_its_own() -> None:
    image = _image("RGB")
    got = round_trip(image)
    image.paste(0, (0, 0, 9, 3))
    assert any(got.tobytes())


def test_an_image_header_claiming_a_huge_image_allocates_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _allocations(monkeypatch)
    with pytest.raises(WireDecodeError):
        decode(_frame(_ext(4, ["RGBA", [1 << 20, 1 << 20], 0, 64]), bytes(128)))
    assert asked == []


def test_extensions_of_the_user_arrive_as_themselves() -> None:
    """A msgspec ``Ext`` comes back as one, whatever its code (ours included: it is wrapped)."""
    got = round_trip({"ext": [msgspec.msgpack.Ext(c, bytes([c % 256]) * 20) for c in (-128, 1, 2, 42, 127)]})
    assert [(e.code, e.data) for e in got["ext"]] == [(c, bytes([c % 256]) * 20) for c in (-128, 1, 2, 42, 127)]
    assert all(isinstance(e, msgspec.msgpack.Ext) for e in got["ext"])


# -- encode errors ---------------------------------------------------------------------------


class Opaque:
    pass


def _unsupported_dtypes() -> list[torch.dtype]:
    names = ["complex32", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "quint8"]
    found = [getattr(torch, n) for n in names if hasattr(torch, n)]
    return [d for d in found if d not in TORCH_DTYPES.values()]


UNSUPPORTED = {
    "object": lambda: Opaque(),
    "set": lambda: {1, 2},
    "complex_scalar": lambda: 1j,
    "int_too_big": lambda: 1 << 70,
    "int_too_small": lambda: -(1 << 64),
    "numpy_scalar": lambda: np.float32(1.0),
    "object_ndarray": lambda: np.array([1, "a"], dtype=object),
    "structured_ndarray": lambda: np.zeros(2, dtype=[("a", "<i4"), ("b", "<f4")]),
    "void_ndarray": lambda: np.zeros(2, dtype="V4"),
    "nested_object": lambda: {"ok": [1, 2, {"bad": Opaque()}]},
    "palette_image": lambda: Image.new("P", (2, 2)),
    "sparse_tensor": lambda: torch.eye(3).to_sparse(),
    "meta_tensor": lambda: torch.empty(3, device="meta"),
    "function": lambda: print,
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_objects_raise_wire_encode_error(name: str) -> None:
    obj = UNSUPPORTED[name]()
    with pytest.raises(WireEncodeError):
        EncodedFrame(obj)
    with pytest.raises(WireEncodeError):
        encode(obj)


@pytest.mark.parametrize(
    "number", [lambda: 1 << 64, lambda: -(1 << 63) - 1, lambda: 10**6000], ids=["2^64", "-2^63-1", "10^6000"]
)
def test_an_integer_past_64_bits_is_refused_saying_so(number: Callable[[], int]) -> None:
    """Said so, with its size (an integer too long for ``str`` is one too: 10^6000)."""
    value = number()
    with pytest.raises(WireEncodeError, match=f"an integer of {value.bit_length()} bits: the wire carries 64"):
        encode({"meta": [value]})


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("dtype", _unsupported_dtypes(), ids=str)
def test_unsupported_tensor_dtype_raises_wire_encode_error(dtype: torch.dtype) -> None:
    t = torch.zeros(2, dtype=torch.float32)
    try:
        t = t.to(dtype) if dtype != torch.quint8 else torch.quantize_per_tensor(t, 0.1, 0, dtype)
    except (RuntimeError, TypeError) as e:  # pragma: no cover - depends on the torch build
        pytest.skip(f"cannot make a {dtype} tensor here: {e}")
    with pytest.raises(WireEncodeError):
        encode({"x": t})


def test_tuple_dict_keys_round_trip() -> None:
    payload = {(1, 2): "x", ((3, "a"), 4): [5, (6, 7)], "t": {(0,): torch.arange(2)}}
    got = decode(encode(payload))
    assert got[(1, 2)] == "x" and got[((3, "a"), 4)] == [5, [6, 7]]
    assert torch.equal(got["t"][(0,)], torch.arange(2))


# -- decode errors and fuzzing ---------------------------------------------------------------


def _frame(header: bytes, tail: bytes = b"", *, body: bytes | None = None) -> bytes:
    """A frame with a valid commit trailer around ``header`` (or a whole ``body``): what a writer
    that finished would leave, whatever it wrote."""
    body = struct.pack("<4sI", MAGIC, len(header)) + header + tail if body is None else body
    return body + TRAILER.pack(COMMIT_MAGIC, 0, xxhash.xxh3_64_intdigest(body[: 8 + len(header)]), len(body))


def _ext(code: int, meta: object) -> bytes:
    return msgpack.packb(_ext_obj(code, meta))


def _ext_obj(code: int, meta: object) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(meta))


def _flip(frame: bytes, pos: int) -> bytes:
    data = bytearray(frame)
    data[pos] ^= 0xFF
    return bytes(data)


MALFORMED = {
    "empty": b"",
    "short": b"OMW",
    "prefix_only_bad_magic": b"XXXX\x00\x00\x00\x00",
    "bad_magic": b"OMW2" + bytes(60),
    "header_past_end": _frame(b"", body=struct.pack("<4sI", MAGIC, 100) + b"\x80"),
    "header_garbage": _frame(b"\xc1"),
    "header_truncated": _frame(msgpack.packb([1, 2, 3])[:-1]),
    "unknown_ext": _frame(_ext(9, ["int64", [1], 0, 8]), bytes(64)),
    "image_mode_unknown": _frame(_ext(4, ["XYZ", [1, 1], 0, 1]), bytes(64)),
    "image_mode_palette": _frame(_ext(4, ["P", [1, 1], 0, 1]), bytes(64)),
    "image_size_not_two": _frame(_ext(4, ["L", [1, 1, 1], 0, 1]), bytes(64)),
    "image_wrong_nbytes": _frame(_ext(4, ["RGB", [2, 2], 0, 4]), bytes(64)),
    "user_ext_not_pair": _frame(_ext(5, [42])),
    "user_ext_code_too_big": _frame(_ext(5, [300, b""])),
    "user_ext_data_not_bytes": _frame(_ext(5, [1, "text"])),
    "ext_not_list": _frame(_ext(1, {"a": 1})),
    "ext_wrong_arity": _frame(_ext(1, ["int64", [1], 0])),
    "ext_garbage": _frame(msgpack.packb(msgpack.ExtType(1, b"\xc1\xc1"))),
    "unknown_tensor_dtype": _frame(_ext(1, ["float128", [1], 0, 16]), bytes(64)),
    "tensor_dtype_not_str": _frame(_ext(1, [5, [1], 0, 8]), bytes(64)),
    "negative_dim": _frame(_ext(1, ["int64", [-1], 0, 8]), bytes(64)),
    "shape_not_list": _frame(_ext(1, ["int64", 3, 0, 8]), bytes(64)),
    "wrong_nbytes": _frame(_ext(1, ["int64", [2], 0, 8]), bytes(64)),
    "buffer_past_end": _frame(_ext(1, ["int64", [4], 0, 32])),
    "negative_offset": _frame(_ext(1, ["int64", [1], -8, 8]), bytes(64)),
    "offset_not_int": _frame(_ext(1, ["int64", [1], "0", 8]), bytes(64)),
    "huge_shape": _frame(_ext(1, ["int8", [2**62, 2**62], 0, 0])),
    "object_ndarray": _frame(_ext(2, ["|O", [1], 0, 8]), bytes(64)),
    "void_ndarray": _frame(_ext(2, ["|V4", [1], 0, 4]), bytes(64)),
    "bad_ndarray_dtype": _frame(_ext(2, ["not-a-dtype", [1], 0, 4]), bytes(64)),
    "ndarray_dtype_not_str": _frame(_ext(2, [[1, 2], [1], 0, 4]), bytes(64)),
    "ndarray_past_end": _frame(_ext(2, ["<f8", [100], 0, 800]), bytes(64)),
    "uncommitted": encode({"a": torch.arange(8)})[: -TRAILER.size] + bytes(TRAILER.size),
    "zero_filled": bytes(256),
    "trailer_cut_off": encode({"a": torch.arange(8)})[:-1],
    "trailer_length_mismatch": encode([1])[: -TRAILER.size]
    + TRAILER.pack(COMMIT_MAGIC, 0, 0, len(encode([1])) - TRAILER.size + 64),
    "checksum_mismatch": _flip(encode({"a": torch.arange(64)}), -TRAILER.size - 8),
    "overlapping_buffers": _frame(
        msgpack.packb([_ext_obj(1, ["int64", [8], 0, 64]), _ext_obj(1, ["int64", [8], 32, 64])]), bytes(128)
    ),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_frames_raise_wire_decode_error(name: str) -> None:
    with pytest.raises(WireDecodeError):
        decode(MALFORMED[name])


def _decode_or_decode_error(data: bytes | bytearray) -> None:
    with contextlib.suppress(WireDecodeError):
        decode(data)


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    _decode_or_decode_error(data)


@FUZZ
@given(st.binary(max_size=512), st.integers(min_value=0, max_value=2**32 - 1) | st.integers(0, 600))
def test_fuzz_magic_then_arbitrary_bytes(body: bytes, header_len: int) -> None:
    _decode_or_decode_error(struct.pack("<4sI", MAGIC, header_len) + body)


SEED_PAYLOADS: list[object] = [
    {"codes": {"audio": torch.arange(12, dtype=torch.int64).reshape(3, 4)}, "meta": {"finished": torch.tensor(True)}},
    [np.arange(5, dtype="<f4"), np.array(2.5), "s", 1, None, b"b"],
    {"e": torch.ones(2, 3, dtype=torch.bfloat16), "c": torch.zeros(0, dtype=torch.complex64), 3: [True]},
    {"nested": [[{"a": np.zeros((2, 0), dtype=np.int16)}]], "t": torch.tensor(1.5, dtype=torch.float16)},
]
SEED_FRAMES = [encode(p) for p in SEED_PAYLOADS]


@FUZZ
@given(
    st.sampled_from(SEED_FRAMES),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=6),
)
def test_fuzz_valid_frames_with_byte_flips(frame: bytes, flips: list[tuple[int, int]]) -> None:
    data = bytearray(frame)
    for pos, xor in flips:
        data[pos % len(data)] ^= xor
    _decode_or_decode_error(data)


@FUZZ
@given(st.sampled_from(SEED_FRAMES), st.data())
def test_fuzz_valid_frames_truncated(frame: bytes, data: st.DataObject) -> None:
    cut = data.draw(st.integers(0, len(frame) - 1))
    _decode_or_decode_error(frame[:cut])
    _decode_or_decode_error(frame[:cut] + data.draw(st.binary(max_size=64)))


@FUZZ
@given(st.sampled_from(SEED_FRAMES), st.integers(0, 10**6), st.binary(min_size=1, max_size=16))
def test_fuzz_valid_frames_with_overwritten_span(frame: bytes, pos: int, junk: bytes) -> None:
    data = bytearray(frame)
    start = pos % len(data)
    data[start : start + len(junk)] = junk
    _decode_or_decode_error(data)


_DTYPE_NAMES = st.sampled_from([*TORCH_DTYPES, "<f4", ">i8", "|b1", "<U3", "|O", "|V2", "float128", "x"])
_META = st.tuples(
    _DTYPE_NAMES | st.text(max_size=6) | st.integers(-3, 3),
    st.lists(st.integers(-2, 2**40), max_size=3) | st.integers(0, 3),
    st.integers(-4, 200) | st.integers(0, 2**63 - 1),
    st.integers(-4, 400) | st.integers(0, 2**63 - 1),
)


@FUZZ
@given(st.integers(0, 255), _META, st.binary(max_size=200))
def test_fuzz_extension_metadata(code: int, meta: tuple[object, ...], tail: bytes) -> None:
    """Well-formed msgpack whose extension metadata is arbitrary: only WireDecodeError."""
    header = msgpack.packb({"x": msgpack.ExtType(code % 6, msgpack.packb(list(meta)))})
    _decode_or_decode_error(_frame(header, tail))


def test_seed_frames_decode() -> None:
    for payload, frame in zip(SEED_PAYLOADS, SEED_FRAMES, strict=True):
        assert_same(decode(frame), payload)


# -- the commit trailer and decode safety ------------------------------------------------------


def test_a_writer_that_died_before_the_commit_leaves_an_undecodable_frame() -> None:
    frame = EncodedFrame({"codes": {"audio": torch.arange(1000)}, "meta": {"finished": torch.tensor(True)}})
    segment = bytearray(frame.size)  # what posix_fallocate reserves: zeros
    frame.write_body(BufferIO(segment))
    with pytest.raises(WireDecodeError, match="uncommitted"):
        decode(segment)
    frame.commit(BufferIO(segment), frame.checksum())
    assert torch.equal(decode(segment)["codes"]["audio"], torch.arange(1000))


@pytest.mark.parametrize("seed", range(4))
def test_bytes_a_stray_write_changes_while_a_large_frame_is_read_are_never_handed_out(seed: int) -> None:
    """A process outside the protocol takes no lock: it may write into a segment while a reader
    copies it out. Here it zeroes every buffer byte once as many pieces were read as the frame
    has (a whole pass: a checksum of a second read beside the copy would be done, the copy not),
    under the simulator, whatever order the reader's work takes. The payload handed out is the
    one put, or a WireDecodeError — never other bytes (found by an outside audit, 32 MiB chunks
    handed out wrong when the checksum was of a second read of the segment)."""
    sent = torch.arange(PARALLEL_CHECKSUM_BYTES // 4 + (1 << 18), dtype=torch.int32)  # (the connector's large path)
    raw = bytearray(encode({"x": sent}))
    (header_len,) = struct.unpack_from("<I", raw, 4)
    base = (8 + header_len + ALIGN - 1) // ALIGN * ALIGN
    pieces = -(-sent.numel() * 4 // PIECE)

    class StrayWrite(BufferIO):
        reads = 0

        def read_into(self, offset: int, out: np.ndarray) -> None:
            super().read_into(offset, out)
            StrayWrite.reads += 1
            if StrayWrite.reads == pieces:
                raw[base : -TRAILER.size] = bytes(len(raw) - base - TRAILER.size)

    got: list[object] = []

    async def main() -> None:
        try:
            got.append(await ShmConnector._decode(StrayWrite(raw), None))
        except WireDecodeError as e:
            got.append(e)

    SimKernel(RandomStrategy(seed)).run(main)
    assert isinstance(got[0], WireDecodeError) or torch.equal(got[0]["x"], sent)  # type: ignore[index]


def test_every_byte_of_a_frame_is_covered() -> None:
    """Flipping any byte of a committed frame — header, padding aside, buffers, trailer — is
    caught (the padding between header and buffers carries nothing and is not read)."""
    frame = encode({"a": torch.arange(16, dtype=torch.int32), "b": "text"})
    (header_len,) = struct.unpack_from("<I", frame, 4)
    padding = range(8 + header_len, (8 + header_len + ALIGN - 1) // ALIGN * ALIGN)
    for pos in range(len(frame)):
        if pos in padding:
            continue
        with pytest.raises(WireDecodeError):
            decode(_flip(frame, pos))


def _allocations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes the decoder asks an allocator for, recorded as it asks."""
    from runtime.connectors import wire

    asked: list[int] = []
    original = wire._allocate

    def allocate(ref: Any) -> Any:
        asked.append(ref.nbytes)
        return original(ref)

    monkeypatch.setattr(wire, "_allocate", allocate)
    return asked


def test_many_references_to_the_same_bytes_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1 MiB frame with 1,000 references to its bytes once decoded into +1 GiB; now nothing is
    allocated before the overlap is found."""
    asked = _allocations(monkeypatch)
    refs = [_ext_obj(1, ["uint8", [1 << 20], 0, 1 << 20]) for _ in range(1000)]
    with pytest.raises(WireDecodeError, match="overlapping"):
        decode(_frame(msgpack.packb(refs), bytes((1 << 20) + ALIGN)))
    assert asked == []


def test_a_header_claiming_a_huge_tensor_allocates_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _allocations(monkeypatch)
    for shape in ([1 << 31, 4], [1 << 33]):  # 8 and 16 GiB
        with pytest.raises(WireDecodeError):
            decode(_frame(_ext(1, ["float32", shape, 0, 4 * math.prod(shape)]), bytes(64)))
    assert asked == []


@FUZZ
@given(
    st.lists(
        st.tuples(st.sampled_from(["uint8", "int64", "float32"]), st.integers(0, 300), st.integers(0, 400)),
        min_size=1,
        max_size=12,
    ),
    st.integers(0, 1024),
)
def test_fuzz_decode_never_allocates_more_than_the_frame(refs: list[tuple[str, int, int]], tail: int) -> None:
    """Headers with arbitrary buffer references: whatever decodes, the decoder never asks for more
    bytes than the frame holds."""
    from runtime.connectors import wire

    asked: list[int] = []
    original = wire._allocate

    def allocate(ref: Any) -> Any:
        asked.append(ref.nbytes)
        return original(ref)

    items = [
        _ext_obj(1, [dt, [n], off, n * torch.empty(0, dtype=wire.TORCH_DTYPES[dt]).element_size()])
        for dt, n, off in refs
    ]
    frame = _frame(msgpack.packb(items), bytes(tail))
    wire._allocate = allocate  # type: ignore[assignment]
    try:
        _decode_or_decode_error(frame)
    finally:
        wire._allocate = original  # type: ignore[assignment]
    assert sum(asked) <= len(frame)


@pytest.mark.parametrize("lie", sorted(lie for lie in FORGERIES if intact_forgery(lie) is None))
def test_a_forged_frame_is_refused_naming_its_lie(lie: str) -> None:
    """A frame with a valid trailer and checksum whose header lies (the harness's forgeries): the
    decoder refuses it and says what is wrong, not which of its own lines tripped."""
    with pytest.raises(WireDecodeError, match=re.escape(FORGERIES[lie])):
        decode(forged_frame(lie))


@pytest.mark.parametrize("lie", sorted(lie for lie in FORGERIES if intact_forgery(lie) is not None))
def test_a_forgery_that_tells_no_lie_about_its_bytes_decodes(lie: str) -> None:
    """What no decoder can refuse (its taker must: ``corrupt_chunk``)."""
    assert decode(forged_frame(lie)) == intact_forgery(lie)


def test_the_forgeries_tell_the_truth_otherwise() -> None:
    """Without a lie the forger's frame decodes: each forgery differs from a valid frame in its lie."""
    assert decode(forged_frame("none"))["codes"]["audio"].shape == (16, 25)
