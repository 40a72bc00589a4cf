"""Bad input at the protocol's two doors, next to the valid input closest to it.

A chunk key becomes a file name under /dev/shm and a request id the stem of every key of its
request, so both are held to a safe alphabet and a length; a payload must be something the wire
format can carry. Bad input gets a clear error and loses nothing: it is refused before anything
is made (``no-orphan-shm`` and ``no-orphan-lock`` see that at the end), and the valid input on
the boundary — the longest key, every allowed character, every dtype, empty and zero-dimensional
tensors, strided views, tuple dict keys, the extreme integers — goes through unchanged. A
connector's ring settings are input too: a ring too small, not in whole 64-byte lines, or with
frames of no size or of more than half of it is refused with an error that names the rule; and so
is a store's namespace (1 to 24 characters of [a-z0-9]; none gets a fresh one, this process's).
A bad key is refused by a put, a get and a cleanup alike; stage ids that make no valid name for
their edge's ring leave the edge without one, and its chunks still arrive. Every valid payload
also crosses the control plane's framing (a whole frame in memory,
:func:`runtime.connectors.wire.encode`) unchanged.

Each case is noted as an ``input.case`` event (what was tried, what happened, what must happen),
which ``bad-input-refused`` compares. Nothing here is drawn at random: the cases are the
boundary, and the schedule still interleaves them with the stages' own loops.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import itertools
import math
import re
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from contextlib import aclosing
from typing import Any

import msgspec
import numpy as np
import torch
from PIL import Image

from omnisim.faults import InjectedCrash
from omnisim.registry import DEFAULT_INVARIANTS, Patch, mutant
from omnisim.world import World
from runtime.client import ClientOutput, generate
from runtime.connectors import keys
from runtime.connectors import ring as rings
from runtime.connectors.base import CorruptChunk
from runtime.connectors.keys import MAX_KEY_LENGTH, MAX_REQUEST_ID_LENGTH
from runtime.connectors.posix_store import NAMESPACE_PATTERN, PosixStore
from runtime.connectors.ring import ALIGN, FRAME, MAGIC, Ring, RingSettings
from runtime.connectors.shm import ShmConnector
from runtime.connectors.wire import WireError, decode, encode
from runtime.kernel import current_kernel
from runtime.serving import MAX_INPUT_CHARS
from scenarios.edge import CODE2WAV, TALKER, edge_scenario
from scenarios.pipeline import ASYNC_CHUNK, SHORT, Client, engine_of, pipeline_scenario

#: Every character a key may hold.
ALPHABET = "ABCXYZabcxyz0189_.:-"
ROUND_TRIP = "round trip"
CLEAN_FAILURE = "a failed put, or a corrupt chunk"

#: Keys a store must refuse: empty, too long, a path, a space, a non-ASCII letter, not a str.
BAD_KEYS: tuple[object, ...] = ("", ".", "..", "a/b", "../x", "a b", "é", "k" * (MAX_KEY_LENGTH + 1), 7, None)
#: The longest key, made of every allowed character.
LONGEST_KEY = (ALPHABET * MAX_KEY_LENGTH)[:MAX_KEY_LENGTH]
#: Key lengths around where a ring frame's header (24 bytes and the key) crosses into another
#: 64-byte line: one byte short of it, exactly on it, one byte into the next.
LINE_KEY_LENGTHS = (39, 40, 41, 103, 104, 105)

#: Stage ids upstream's connector takes at its API edge that make no valid name for their edge's
#: ring (a path, a parent folder): the edge gets no ring, and its chunks go by segments all the same.
EDGELESS_STAGES = (("a/b", str(CODE2WAV)), (str(TALKER), "../x"))


#: Payloads the wire format cannot carry.
@dataclasses.dataclass
class _HalfMade:
    """A dataclass one of whose fields was never set (reading it raises AttributeError)."""

    made: int
    never_set: int = dataclasses.field(init=False)


def _truncated_png() -> Image.Image:
    """An image whose file ends early: it opens, and reading its pixels raises OSError."""
    whole = io.BytesIO()
    Image.new("RGB", (32, 32), (1, 2, 3)).save(whole, "PNG")
    return Image.open(io.BytesIO(whole.getvalue()[:-40]))


BAD_PAYLOADS: dict[str, object] = {
    "an arbitrary object": {"x": object()},
    "a set": {"x": {1, 2}},
    "an object ndarray": {"x": np.array([object()])},
    "a structured ndarray": {"x": np.zeros(2, dtype=[("a", "<i4")])},
    "an integer past 64 bits": {"x": 2**64},
    "a tensor of a dtype the wire does not carry": {"x": torch.empty(2, dtype=torch.bits8)},
    "an image whose palette would not travel": {"x": Image.new("P", (2, 2))},
    "lists nested past msgpack's recursion limit": {"x": functools.reduce(lambda inner, _: [inner], range(3000), [])},
    # (found by an outside audit: the put raised what reading them raised)
    "a dataclass with a field never set": {"x": _HalfMade(1)},
    "an image whose file ends early": {"x": _truncated_png()},
}

#: The smallest ring that carries a payload of two lines with the default frame fraction: the
#: header, and room for two frames of the longest key beside any remainder at its end.
LEAST_CAPACITY = 1344
#: Ring settings a connector is made with, next to what they must give: a ring must come in whole
#: 64-byte lines, carry a payload of two lines, take frames of at most half of it, and wait for room
#: a finite time; the refusal names the rule.
RING_SETTINGS_CASES: dict[str, tuple[dict[str, float], str]] = {
    "the least capacity": ({"capacity": LEAST_CAPACITY}, "ok"),
    "a line less than the least capacity": ({"capacity": LEAST_CAPACITY - ALIGN}, "ValueError: it is too small"),
    "a line less than the least header and frames": ({"capacity": 3 * ALIGN}, f"ValueError: at least {4 * ALIGN}"),
    "a capacity not in whole lines": ({"capacity": LEAST_CAPACITY + 1}, f"ValueError: a multiple of {ALIGN}"),
    "no wait for room": ({"full_wait_s": 0.0}, "ok"),
    "an endless wait for room": ({"full_wait_s": math.inf}, "ValueError: a finite number of seconds"),
    "a wait for room of nan seconds": ({"full_wait_s": math.nan}, "ValueError: a finite number of seconds"),
    "a negative wait for room": ({"full_wait_s": -1.0}, "ValueError: a finite number of seconds"),
    "frames of at most half the ring": ({"max_frame_fraction": 0.5}, "ok"),
    "frames of more than half the ring": ({"max_frame_fraction": 0.51}, "ValueError: (0, 0.5]"),
    "frames of no size": ({"max_frame_fraction": 0.0}, "ValueError: (0, 0.5]"),
}

#: Namespaces a POSIX store is made with (its names' stem in /dev/shm), next to what they must
#: give: 1 to 24 characters of [a-z0-9], refused otherwise with the rule; none: a fresh one.
NAMESPACE_CASES: dict[str, tuple[str | None, str]] = {
    "no namespace": (None, "ok"),
    "the longest namespace": ("a0" * 12, "ok"),
    "a namespace one character too long": ("a" * 25, "ValueError: 1-24 characters of [a-z0-9]"),
    "a namespace with a capital and a '!'": ("Bad!", "ValueError: 1-24 characters of [a-z0-9]"),
    "an empty namespace": ("", "ok"),  # (as none: a fresh one, this process's)
}

#: How a get names the key ``K`` that was put: by its own key next to metadata (what the put
#: returned, as upstream passes it on) in shapes that say nothing usable, or through metadata
#: that names ``K``, which wins over the get's own key.
METADATA_CASES: dict[str, Callable[[str], tuple[str, object]]] = {
    "not a mapping": lambda key: (key, ["shm", "name"]),
    "a handle that is not a mapping": lambda key: (key, {"shm": "name"}),
    "a handle whose name is not a str": lambda key: (key, {"shm": {"name": 5}}),
    "a handle naming no valid key": lambda key: (key, {"shm": {"name": "../x"}}),
    "a field named get_key (upstream keys metadata by the key itself)": lambda key: (key, {"get_key": "other_0_0"}),
    "nothing": lambda key: (key, {"shm": None}),
    "upstream's handle of the key": lambda key: ("elsewhere_0_0", {"shm": {"name": key, "size": 1}}),
    "the handle keyed by the key": lambda key: (key, {key: {"shm": {"name": key, "size": 1}}}),
    "keyed by the key, not a handle": lambda key: (key, {key: 5}),
}


#: Every dtype a tensor on the wire may have.
TENSOR_DTYPES = (
    *(torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64),
    *(torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128),
)


def good_payloads() -> dict[str, object]:
    """Payloads on the edge of what the wire carries, each of which must come back unchanged."""
    grid = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    waves = torch.complex(torch.arange(4.0), torch.arange(4.0) + 1)
    return {
        "every tensor dtype": {str(dtype): torch.arange(6).reshape(2, 3).to(dtype) for dtype in TENSOR_DTYPES},
        "empty and zero-dimensional tensors": {"empty": torch.zeros(0, 3), "scalar": torch.tensor(5)},
        "strided views": {"transposed": grid.t(), "every other column": grid[:, ::2]},
        # Views whose bytes are not their values: torch resolves a conjugate or negative bit lazily
        # (one element: a view that counts as contiguous too).
        "conjugate and negative views": {
            "conjugate": waves.conj(),
            "negative": waves.conj().imag,
            "one negative element": waves[1:2].conj().imag,
        },
        "ndarrays": {"f8": np.arange(6.0).reshape(2, 3), "u2": np.arange(4, dtype="<u2"), "empty": np.zeros(0)},
        "plain values": {
            (1, "tuple key"): [None, True, 1.5, "é✓", b"\x00\xff"],
            "extremes": [2**63 - 1, -(2**63), 2**64 - 1],
        },
        # The 8-byte prefix and a 56-byte header (msgpack's str8: 2 bytes, then 54 characters)
        # end exactly where the frame's body does: no padding, no buffer after them.
        "a header that ends where the body does": "h" * 54,
    }


@dataclasses.dataclass
class _Meta:
    finished: bool
    left_context_size: int


class _Codes(msgspec.Struct, omit_defaults=True, kw_only=True, forbid_unknown_fields=True):
    audio: object = None
    left_context_size: int | None = None


class _Ids(msgspec.Struct, omit_defaults=True):
    """Fields whose default is a factory's: omitted while empty, sent once they hold something."""

    ids: list[int] = msgspec.field(default_factory=list)
    extra: dict[str, int] = msgspec.field(default_factory=dict)
    n: int = 0


def image(mode: str, size: tuple[int, int] = (9, 3)) -> Image.Image:
    """An image of ``mode`` whose pixels differ."""
    nbytes = len(Image.new(mode, size).tobytes())
    return Image.frombytes(mode, size, (bytes(range(1, 252)) * (nbytes // 251 + 1))[:nbytes])


def translated_payloads() -> dict[str, tuple[object, object]]:
    """Payloads the wire hands over as upstream's receiver gets them (spec §2.8), next to what
    the receiver must get."""
    return {
        "a dataclass": ({"meta": _Meta(True, 25)}, {"meta": {"finished": True, "left_context_size": 25}}),
        "a struct that omits its defaults": (
            {"codes": _Codes(audio=torch.arange(4))},
            {"codes": {"audio": torch.arange(4)}},
        ),
        "a struct with factory defaults": (
            {"empty": _Ids(n=5), "held": _Ids(ids=[1, 2, 3], extra={"a": 1})},
            # (as msgspec itself writes them)
            {"empty": {"n": 5}, "held": {"ids": [1, 2, 3], "extra": {"a": 1}}},
        ),
        "a slice": ({"s": slice(1, 7, 2), "open": slice(None, 3)}, {"s": [1, 7, 2], "open": [None, 3, None]}),
        "an extension": ({"e": msgspec.msgpack.Ext(42, b"x" * 20)}, {"e": msgspec.msgpack.Ext(42, b"x" * 20)}),
        "images": ({m: image(m) for m in IMAGE_MODES}, {m: image(m) for m in IMAGE_MODES}),
    }


#: Image modes with one, several and a fraction of a byte per pixel.
IMAGE_MODES = ("1", "L", "RGB", "I;16", "F")


def same(a: object, b: object) -> bool:
    """Equal in value, type, dtype and shape (a tensor's strides need not survive); an ndarray
    arrives read-only (as upstream's receiver views the bytes), an image with its mode and size."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and np.array_equal(a, b)
            and not b.flags.writeable
        )
    if isinstance(a, Image.Image):
        return isinstance(b, Image.Image) and (a.mode, a.size, a.tobytes()) == (b.mode, b.size, b.tobytes())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


def shown(value: object) -> str:
    """A bad value, short enough for a trace line."""
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:20]}… ({len(text)} characters)"


def note_case(what: str, got: str, want: str) -> None:
    current_kernel().note("input.case", what=what, got=got, want=want)


def ring_settings_outcome(settings: dict[str, float], want: str) -> str:
    """``ok``, or the refusal and whether its message says what ``want`` quotes."""
    try:
        RingSettings(**settings)  # type: ignore[arg-type]
    except ValueError as e:
        quoted = want.split(": ", 1)[-1]
        return want if quoted in str(e) else f"ValueError: {e}"
    return "ok"


def namespace_outcome(namespace: str | None, want: str) -> str:
    """``ok`` if a store made with ``namespace`` has a namespace of the rule's, and records this
    process as its owner exactly when it made a fresh one (a named one is another process's);
    else the refusal and whether its message says what ``want`` quotes."""
    try:
        store = PosixStore(namespace)
    except ValueError as e:
        quoted = want.split(": ", 1)[-1]
        return want if quoted in str(e) else f"ValueError: {e}"
    made, claimed = store.namespace, store.owner() is not None
    if claimed:
        store.sweep()
    if not NAMESPACE_PATTERN.fullmatch(made) or made != (namespace or made):
        return f"namespace {made!r}"
    return "ok" if claimed == (not namespace) else f"{'an' if claimed else 'no'} owner record"


async def outcome(call: Callable[[], Awaitable[Any]]) -> tuple[str, Any]:
    """What ``call`` gave: the name of the error it raised, or ``ok`` and its result."""
    try:
        return "ok", await call()
    except (ValueError, TypeError, CorruptChunk, InjectedCrash) as e:
        return type(e).__name__, None


# Every failure here is one the scenario provoked, so failures-have-causes has nothing to say.
HOSTILE_INVARIANTS = (*(i for i in DEFAULT_INVARIANTS if i != "failures-have-causes"), "bad-input-refused")


@edge_scenario(
    "hostile_keys_and_payloads",
    summary="a peer puts and gets under invalid keys and puts payloads the wire cannot carry: each is refused with a "
    "clear error and leaves nothing behind; the longest valid key and every kind of valid payload round-trip exactly",
    issue="spec §2.1 (keys), §2.3 (the wire), data-plane hardening",
    invariants=HOSTILE_INVARIANTS,
)
async def hostile_keys_and_payloads(world: World) -> None:
    sender, receiver = world.stages[TALKER].connector, world.stages[CODE2WAV].connector
    edge = (str(TALKER), str(CODE2WAV))

    for name, (settings, want) in RING_SETTINGS_CASES.items():
        note_case(f"a connector's ring with {name}", ring_settings_outcome(settings, want), want)
    for name, (namespace, want) in NAMESPACE_CASES.items():
        note_case(f"a store made with {name}", namespace_outcome(namespace, want), want)

    for key in BAD_KEYS:
        # A put never raises (spec §2.1): it fails, saying why.
        got, result = await outcome(lambda key=key: sender.put(*edge, key, {"x": 1}))  # type: ignore[misc]
        if got == "ok" and not result.ok and "chunk key" in str((result.metadata or {}).get("error")):
            got = "refused, saying why"
        note_case(f"a put under the key {shown(key)}", got, "refused, saying why")
        got, _ = await outcome(lambda key=key: receiver.get(*edge, key))  # type: ignore[misc]
        note_case(f"a get under the key {shown(key)}", got, "InvalidKeyError")
        got, _ = await outcome(lambda key=key: sender.cleanup(key))  # type: ignore[misc]
        note_case(f"a cleanup of the key {shown(key)}", got, "InvalidKeyError")

    for i, (name, payload) in enumerate(BAD_PAYLOADS.items()):
        key = f"bad_{i}_0"
        result = await sender.put(*edge, key, payload)
        note_case(f"a put of {name}", "put failed" if not result.ok else "put accepted", "put failed")
        got, taken = await outcome(lambda key=key: receiver.get(*edge, key))  # type: ignore[misc]
        note_case(f"a get after the refused put of {name}", f"{got} {taken is not None}", "ok False")

    for i, (name, get_with) in enumerate(METADATA_CASES.items()):
        key, payload = f"meta_{i}_0", {"x": i}
        fired = len(world.fired_faults())
        await outcome(lambda key=key, payload=payload: sender.put(*edge, key, payload))  # type: ignore[misc]
        get_key, metadata = get_with(key)
        got, taken = await outcome(lambda get_key=get_key, metadata=metadata: receiver.get(*edge, get_key, metadata))  # type: ignore[misc]
        if len(world.fired_faults()) == fired:  # (an injected fault's clean failure is checked below)
            note_case(
                f"a get whose metadata is {name}", f"{got} {taken is not None and same(payload, taken[0])}", "ok True"
            )

    # A handle names one put's payload: once a later put of its key replaced that payload unread,
    # or, after it was read, reused its file (the consumed segment, kept as a spare) or its place
    # on the ring, the handle finds nothing (never the later payload); the later put's handle
    # finds it.
    for read_first, case in enumerate(("a replaced put", "a put that was read, after a later put of its key")):
        fired, key = len(world.fired_faults()), f"handle_{read_first}_0"
        _, first = await outcome(lambda key=key: sender.put(*edge, key, {"x": "first"}))  # type: ignore[misc]
        if read_first and first is not None and first.ok:
            await outcome(lambda key=key, first=first: receiver.get(*edge, key, first.metadata))  # type: ignore[misc]
        _, later = await outcome(lambda key=key: sender.put(*edge, key, {"x": "later"}))  # type: ignore[misc]
        if first is not None and later is not None and first.ok and later.ok:
            stale, by_first = await outcome(lambda key=key, first=first: receiver.get(*edge, key, first.metadata))  # type: ignore[misc]
            fresh, by_later = await outcome(lambda key=key, later=later: receiver.get(*edge, key, later.metadata))  # type: ignore[misc]
            if len(world.fired_faults()) == fired:
                found = by_later is not None and same({"x": "later"}, by_later[0])
                note_case(
                    f"a get by the handle of {case}, then by the later put's",
                    f"{stale} {by_first is None}, {fresh} {found}",
                    "ok True, ok True",
                )
        await outcome(lambda key=key: sender.cleanup(key))  # type: ignore[misc]  # (what an injected fault left unread)

    line_keys = {f"a key of {n} characters": (edge, "k" * (n - 4) + "_0_0", {"x": n}) for n in LINE_KEY_LENGTHS}
    cases = {"the longest key": (edge, LONGEST_KEY, {"x": 1}), **line_keys}
    cases |= {name: (edge, f"good_{i}_0", payload) for i, (name, payload) in enumerate(good_payloads().items(), 1)}
    cases |= {
        f"a chunk from stage {stages[0]!r} to stage {stages[1]!r}": (stages, f"edgeless_{i}_0", {"x": i})
        for i, stages in enumerate(EDGELESS_STAGES)
    }
    translated = translated_payloads()
    cases |= {name: (edge, f"carried_{i}_0", sent) for i, (name, (sent, _)) in enumerate(translated.items())}
    for name, (stages, key, payload) in cases.items():
        fired = len(world.fired_faults())
        put_got, put = await outcome(lambda s=stages, key=key, payload=payload: sender.put(*s, key, payload))  # type: ignore[misc]
        got, taken = await outcome(lambda s=stages, key=key: receiver.get(*s, key))  # type: ignore[misc]
        want = translated[name][1] if name in translated else payload
        came_back = got == "ok" and taken is not None and same(want, taken[0])
        seen = ROUND_TRIP if came_back else f"{got}: {taken!r}"[:200]
        if len(world.fired_faults()) > fired:
            # An injected fault struck the put or the get: it must fail cleanly, never hand back
            # a payload, and never lose one that was put without saying so.
            put_ok = put_got == "ok" and put.ok
            seen = CLEAN_FAILURE if taken is None and (got == "CorruptChunk" or not put_ok) else seen
            note_case(f"{name}, put and got back under an injected fault", seen, CLEAN_FAILURE)
        else:
            note_case(f"{name}, put and got back", seen, ROUND_TRIP)
    if sender.send_ring is not None:
        await a_ring_a_stray_write_broke(world, sender, receiver, edge)
    # The control plane between the head and a stage process frames its messages in the same
    # format, whole frames in memory (runtime.control): what the connector carries crosses there too.
    for name, payload in good_payloads().items():
        try:
            framed = decode(encode(payload))
            seen = ROUND_TRIP if same(payload, framed) else repr(framed)[:200]
        except WireError as e:
            seen = f"{type(e).__name__}: {e}"
        note_case(f"{name}, framed as a control message and read back", seen, ROUND_TRIP)


#: What a stray write of another process of ours leaves in a ring: a frame's span off a frame
#: boundary, a payload longer than its frame, a header whose magic is gone. (A head or tail moved
#: by anyone but their owner is what ``ring-writes-locked`` reports itself.)
STRAY_WRITES = ("span", "payload length", "header")


#: Who meets a broken ring first: its reader, or its producer in each of the walks it makes.
FOUND_BY = ("its reader's get", "its producer's put", "its producer's cleanup", "its producer's reap")


async def a_ring_a_stray_write_broke(
    world: World, sender: ShmConnector, receiver: ShmConnector, edge: tuple[str, str]
) -> None:
    """Bytes of a ring no producer of ours writes, met first by its reader or by its producer: no
    get, put, cleanup or reap raises out of them; the chunk on it is lost, never handed out, and
    a get of it says so (its request fails at once, not at its input deadline); the producer's
    next put goes on a new ring (or a segment), and the edge goes on."""
    for i, (where, found_by) in enumerate(itertools.product(STRAY_WRITES, FOUND_BY)):
        lost, kept = f"stray_{i}_0", f"stray_{i}_1"
        fired = len(world.fired_faults())
        cases = await break_the_ring(sender, receiver, edge, (where, found_by), lost, kept, {"x": i})
        # Under an injected fault (``--faults sampled``) a put may fail and a get find nothing:
        # what the main cases check then; these say only what a clean run must give.
        if len(world.fired_faults()) == fired:
            for case in cases:
                note_case(*case)
        await sender.cleanup(lost)
        await sender.cleanup(kept)


async def break_the_ring(
    sender: ShmConnector,
    receiver: ShmConnector,
    edge: tuple[str, str],
    how: tuple[str, str],
    lost: str,
    kept: str,
    payload: dict,
) -> list[tuple[str, str, str]]:
    """Put ``lost`` on the ring, break its frame as ``how`` says (where, and who meets it first),
    then get it, and put and get ``kept``: each case as (what, got, want)."""
    where, found_by = how
    await outcome(lambda: sender.put(*edge, lost, payload))
    memory = sender.store.open_ring(rings.edge_name(*edge))
    ring = Ring.attach(memory) if memory is not None else None
    if ring is None:
        return [(f"a ring a stray write broke ({where})", "the edge has no ring", "on the ring")]
    try:
        frame = ring.find(lost)
        if frame is None:
            return [(f"a ring a stray write broke ({where})", "its frame is not on the ring", "on the ring")]
        at = ring._at(frame.pos)
        # (made under the ring's lock, as a process of ours makes its writes: what is wrong is
        # the bytes, not who wrote them when)
        assert ring.memory.try_lock(), "nobody else runs: the ring is free"
        if where == "span":
            FRAME.pack_into(ring.view, at, frame.state, len(frame.key), frame.payload_len, frame.span + 3)
        elif where == "header":
            ring.view[: len(MAGIC)] = b"XXXX"
        else:
            FRAME.pack_into(ring.view, at, frame.state, len(frame.key), frame.span, frame.span)
        ring.memory.unlock()
    finally:
        ring.close()

    async def reap() -> None:
        sender.reap_consumed()

    first: dict[str, Callable[[], Awaitable[Any]]] = {
        "its reader's get": lambda: receiver.get(*edge, lost),
        "its producer's put": lambda: sender.put(*edge, kept, payload),
        "its producer's cleanup": lambda: sender.cleanup(lost),
        "its producer's reap": reap,
    }
    met, _ = await outcome(first[found_by])
    case = f"a ring a stray write broke ({where}), met first by {found_by}"
    cases = [(f"{case}: what it gave", met, "ok")]
    if found_by != "its producer's put":
        await outcome(lambda: sender.put(*edge, kept, payload))
    try:
        taken = await receiver.get(*edge, lost)
        seen = "nothing" if taken is None else "the chunk"
    except CorruptChunk as e:
        seen = "lost, and said so" if "its producer lost it" in e.cause else f"CorruptChunk: {e.cause}"
    # Its producer's next look at the broken ring marked it lost, unless it was cleaned up first
    # (nobody waits for it then).
    want = "nothing" if found_by == "its producer's cleanup" else "lost, and said so"
    cases.append((f"{case}: a get of the chunk it held", seen, want))
    got, taken = await outcome(lambda: receiver.get(*edge, kept))
    seen = ROUND_TRIP if got == "ok" and taken is not None and same(payload, taken[0]) else f"{got}"
    cases.append((f"{case}: a put and a get after it", seen, ROUND_TRIP))
    return cases


#: The edge the ring-filling connectors put on: none of the world's stages' (each edge has one
#: producer, and the producer's ring is its own).
FILL_EDGE = ("7", "8")
#: Stage ids a connector is made with at upstream's API edge, which takes any: wakeups go to a
#: non-negative int, and any other polls (by name: whether it has wakeups).
STAGE_IDS: dict[str, tuple[object, bool]] = {
    "stage 0": (0, True),
    "stage -1": (-1, False),
    "a stage id that is not an int": ("talker", False),
}
#: How long a wait for a wakeup lasts when nothing comes.
WAKEUP_WAIT_S = 0.05


@edge_scenario(
    "wakeup_stage_ids",
    summary="connectors are made with stage ids upstream's API accepts, valid for wakeups or not (0; -1; a name): "
    "one of a non-negative stage has a wakeup generation and waits for a change; any other has none and answers "
    "at once that nothing changed, without waiting; one made with no wakeups that fills its ring waits for room "
    "by sleeping, then puts the rest in segments",
    issue="spec §2.6 (wakeups), upstream's connector API (any stage id at its edge)",
    invariants=HOSTILE_INVARIANTS,
)
async def wakeup_stage_ids(world: World) -> None:
    k = current_kernel()
    for name, (stage_id, wakes) in STAGE_IDS.items():
        connector = ShmConnector(world.store, stage_id=stage_id, wakeups=world.wakeups)  # type: ignore[arg-type]
        world.watch_connector(connector)
        generation = connector.get_wakeup_generation()
        got = "a generation" if isinstance(generation, int) else repr(generation)
        note_case(f"the wakeup generation of a connector of {name}", got, "a generation" if wakes else "None")
        started = k.now()
        changed = await connector.wait_for_change(generation or 0, timeout=WAKEUP_WAIT_S)
        got = f"{'waited' if k.now() > started else 'answered at once'}, {'a change' if changed else 'no change'}"
        want = "waited, no change" if wakes else "answered at once, no change"
        note_case(f"a wait for a wakeup of {name}", got, want)
        await connector.close()
    # One made with no wakeups at all, as upstream's may be: it waits for room by sleeping.
    alone = ShmConnector(world.store, stage_id=-1, **world.transport())
    world.watch_connector(alone)
    await fill_the_ring(world, alone, "stage -1 with no wakeups")
    await alone.close()


#: Puts that fill a simulated edge ring (16 KiB) and one more: each of about 3 KiB, nobody reads them.
RING_FILLERS = 6


async def fill_the_ring(world: World, connector: ShmConnector, name: str) -> None:
    """Put more than the edge's ring holds, with nobody reading: the last puts wait for room,
    with no wakeup to wait for (they sleep), then go to segments; then clean them up."""
    keys = [f"fill_{i}_0" for i in range(RING_FILLERS)]
    for i, key in enumerate(keys):
        fired = len(world.fired_faults())
        put_got, put = await outcome(lambda key=key, i=i: connector.put(*FILL_EDGE, key, {"x": np.full(380, i)}))  # type: ignore[misc]
        if len(world.fired_faults()) == fired:
            got = "ok" if put_got == "ok" and put.ok else f"{put_got} {put}"[:120]
            note_case(f"put {i} of a ring-filling run by a connector of {name}", got, "ok")
    for key in keys:
        await connector.cleanup(key)


#: Request ids an engine must refuse at submission.
BAD_REQUEST_IDS: tuple[object, ...] = ("", "..", "a/b", "a b", "r" * (MAX_REQUEST_ID_LENGTH + 1), 3)
#: Input text an engine must refuse: none, blank, not a str, one character too long.
BAD_TEXTS: tuple[object, ...] = ("", " \n\t", 5, "a" * (MAX_INPUT_CHARS + 1))
#: The longest request id, made of every allowed character.
LONGEST_REQUEST_ID = (ALPHABET * MAX_REQUEST_ID_LENGTH)[:MAX_REQUEST_ID_LENGTH]
#: What a client may not ask of ``generate`` (a request no engine could answer as asked):
#: refused before anything is submitted.
BAD_ASKS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("no modality", {"modalities": ()}),
    ("a modality no stage makes", {"modalities": ("text", "video")}),
    ("audio at 0 Hz", {"sample_rate": 0}),
    ("audio at -16000 Hz", {"sample_rate": -16000}),
    ("word timestamps without audio", {"modalities": ("text",), "word_timestamps": True}),
)


async def first_output(answer: AsyncGenerator[ClientOutput, None]) -> ClientOutput:
    """The first item of a ``generate`` stream; the stream is closed after it."""
    async with aclosing(answer):
        return await anext(answer)


@pipeline_scenario(
    "hostile_request_ids",
    params=(ASYNC_CHUNK,),
    summary="clients submit request ids that cannot name a chunk key (empty, a path, too long, not a str) and empty "
    "text: each is refused at submission with a clear error and reaches no stage; the longest valid id finishes",
    issue="spec §2.1, #7544 (input validation at the door)",
    invariants=HOSTILE_INVARIANTS,
)
async def hostile_request_ids(world: World) -> None:
    engine = engine_of(world)
    for request_id in BAD_REQUEST_IDS:
        got, _ = await outcome(lambda rid=request_id: engine.submit(rid, SHORT))  # type: ignore[misc]
        note_case(f"a request with the id {shown(request_id)}", got, "InvalidKeyError")
    for text in BAD_TEXTS:
        got, _ = await outcome(lambda text=text: engine.submit("bad-text", text))  # type: ignore[misc]
        note_case(
            f"a request with the text {shown(text)}",
            got,
            "RequestRejected",
        )
    for what, asked in BAD_ASKS:
        got, _ = await outcome(lambda asked=asked: first_output(generate(engine, SHORT, **asked)))  # type: ignore[misc]
        note_case(f"a generate() call asking for {what}", got, "ValueError")
    longest = Client(world, "longest", SHORT, LONGEST_REQUEST_ID, modalities=("text",))
    await longest.run()
    note_case("the longest request id", longest.stream.outcome, "finished")


@mutant(
    "key_alphabet_admits_paths",
    summary="the chunk-key alphabet also admits '/' and ' ': a key (or a request id, the stem of its keys) can name "
    "a path outside the run's namespace, or a name the store cannot make",
    issue="data-plane hardening (invalid keys or names get a clear error)",
    scenarios=("hostile_keys_and_payloads", "hostile_request_ids"),
    expect=("bad-input-refused",),
)
def key_alphabet_admits_paths() -> Iterator[Patch]:
    yield Patch(keys, "KEY_PATTERN", re.compile(r"[A-Za-z0-9_.:/ -]+"))
