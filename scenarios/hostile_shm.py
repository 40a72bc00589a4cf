"""What a hostile or careless user leaves in /dev/shm where the runtime's names go.

/dev/shm is shared by every user of the machine, so what sits at a name the runtime means to
use may be anything. Two places are planted here, before anything of the world runs:

* ``hostile_wakeup_names`` — the folder of the cross-process wakeups
  (``omnisim-{namespace}-wake/``, spec §2.9, :class:`runtime.connectors.wakeup.FifoWakeups`): a
  file, a symlink or another user's FIFO where a receiver's FIFO belongs, a folder that is not
  ours, or a symlink in its place. None of it is written to, followed or removed (wakeups there
  are then unavailable and receivers keep polling); only a FIFO of ours with no reader (a dead
  receiver's) goes.
* ``hostile_edge_names`` — the name of an edge's ring: a file others may read, a symlink (both left
  alone: the edge goes over segments), or a file of ours that holds no ring (replaced; no reader
  takes a frame from it); or a chunk's segment name, taken by a file others may read holding a
  committed frame (left alone; the chunk's put fails, and no reader takes that frame); or a
  chunk's lock file name, taken by a file others may read (left alone: no put locks it, no reader
  or cleanup removes it).

Requests still finish with every frame. At the end the scenario notes, for each planted name,
what became of it (``shm.planted``), which ``foreign-names-untouched`` compares with what must.
Another user's FIFOs can only be made by root; elsewhere those two cases are left out. On the
memory store there is no /dev/shm to plant in: the requests run alone.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from omnisim import devshm
from omnisim.registry import Param, Params, Patch, ScenarioBody, mutant
from omnisim.sim_kernel import MAIN_PROCESS, SimKernel
from omnisim.world import World
from runtime.connectors import ring as rings
from runtime.connectors import wakeup
from runtime.connectors.posix_store import PosixStore
from runtime.connectors.wire import encode
from runtime.kernel import current_kernel
from scenarios.crash import CHUNKS, DATA_PLANE, crash_scenario, in_process, receive, send
from scenarios.edge import CODE2WAV, NUM_CODEBOOKS, TALKER, EdgeRequest

PLANT = Param(
    "plant",
    ("names_in_folder", "foreign_folder", "symlinked_folder"),
    "what sits where the wakeups live: strange names in the wakeup folder, a folder that is not ours, a symlink",
)
#: Another user, for what a hostile user owns (only root can give a file away).
STRANGER = 65534
LEFT_ALONE = "left alone"
GONE = "gone"
#: A planted file's size at a ring's name: as large as a small ring, all of it no ring's header.
RING_GARBAGE_BYTES = 4096
#: How long R's Talker computes before each chunk: longer than a receiver waits for its wakeup
#: (50 ms), so only S's registration can end Code2Wav's wait early; S's Talker puts all its
#: chunks at once, and S registers for the first a while later.
SLOW_PRODUCER_S = 0.12
QUICK_CONSUMER_DELAY_S = 0.03


@dataclass
class Planted:
    """One name planted in /dev/shm, what it was when planted, and what must become of it."""

    what: str
    path: str
    want: str
    before: str
    #: A descriptor on its read end the scenario holds (a FIFO with a reader): must stay empty.
    reader: int | None = None

    def now(self) -> str:
        state = _state(self.path)
        if self.want == GONE:
            return GONE if state == GONE else f"still there ({state})"
        if state != self.before:
            return f"changed from {self.before} to {state}"
        if self.reader is not None and _has_bytes(self.reader):
            return "written to"
        return LEFT_ALONE


def _state(path: str) -> str:
    """What is at ``path``, as far as anyone could tell it was changed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return GONE
    kind, mode = stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        inside = os.readlink(path)
    elif stat.S_ISREG(st.st_mode):
        with open(path, "rb") as f:
            inside = repr(f.read())
    elif stat.S_ISDIR(st.st_mode):
        inside = repr(sorted(os.listdir(path)))
    else:
        inside = ""
    return f"type {kind:o} mode {mode:o} uid {st.st_uid} {inside}".rstrip()


def _has_bytes(fd: int) -> bool:
    try:
        return bool(os.read(fd, 1))
    except BlockingIOError:
        return False


def _regular_file(path: str, content: bytes, mode: int = 0o600) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    os.write(fd, content)
    os.close(fd)
    os.chmod(path, mode)  # whatever the umask left
    return path


def hostile_scenario(
    name: str, *, prepare: Callable[[World, Params], None], fails_puts: bool = False, **kwargs: Any
) -> Callable[[ScenarioBody], ScenarioBody]:
    """Register a scenario of this module: ``prepare`` plants the names before anything of the
    world runs, nothing is injected, and what became of the names is checked. ``fails_puts``: a
    planted name fails a put, a failure the scenario provoked (``failures-have-causes`` cannot
    see a cause planted before the run)."""
    checked = (i for i in DATA_PLANE if not (fails_puts and i == "failures-have-causes"))
    invariants = (*checked, "foreign-names-untouched")
    return crash_scenario(name, faults=lambda p: None, prepare=prepare, invariants=invariants, **kwargs)


def record(what: str, path: str, want: str = LEFT_ALONE, reader: int | None = None) -> Planted:
    """``path``, planted just now: what it is, to compare with what it is at the end."""
    return Planted(what, path, want, _state(path), reader)


def plant_names(world: World, params: Params) -> None:
    """Plant what ``params["plant"]`` says, before any stage made its wakeup folder."""
    if not isinstance(world.store, PosixStore):
        return
    planted: list[Planted] = []
    folder = world.plant("wake")
    if params["plant"] == "names_in_folder":
        os.mkdir(folder, 0o700)  # the folder itself is a good one: the names in it are not
        bait = _regular_file(world.plant("bait"), b"what a symlink points at")
        inside = f"{folder}/{CODE2WAV}_"
        planted.append(record("a file where a receiver's FIFO belongs", _regular_file(f"{inside}file", b"not a FIFO")))
        os.symlink(bait, f"{inside}link")
        planted.append(record("a symlink where a receiver's FIFO belongs", f"{inside}link"))
        planted.append(record("the file that symlink points at", bait))
        dead = world.plant(f"wake/{CODE2WAV}_dead")  # (not a live receiver's FIFO while it stays)
        os.mkfifo(dead, 0o600)
        planted.append(record("a FIFO of ours with no reader (a dead receiver's)", dead, want=GONE))
        if os.geteuid() == 0:
            os.mkfifo(f"{inside}stranger", 0o600)
            os.chown(f"{inside}stranger", STRANGER, STRANGER)
            planted.append(record("another user's FIFO with no reader", f"{inside}stranger"))
            os.mkfifo(f"{inside}listening", 0o600)
            os.chown(f"{inside}listening", STRANGER, STRANGER)
            reader = devshm.hold(os.open(f"{inside}listening", os.O_RDONLY | os.O_NONBLOCK))
            planted.append(record("another user's FIFO with a reader", f"{inside}listening", reader=reader))
    elif params["plant"] == "foreign_folder":
        os.mkdir(folder, 0o755)
        os.chmod(folder, 0o755)  # whatever the umask left
        planted.append(record("a wakeup folder others may look into (mode 755)", folder))
    else:
        target = world.plant("bait-folder")
        os.mkdir(target, 0o700)
        os.symlink(target, folder)
        planted.append(record("a symlink where the wakeup folder belongs", folder))
        planted.append(record("the folder that symlink points at", target))
    world.observers["planted"] = planted


@hostile_scenario(
    "hostile_wakeup_names",
    summary="the wakeup folder of a run of stage processes holds a file, a symlink and another user's FIFOs where "
    "receivers' FIFOs belong, or is not ours (mode 755, a symlink): none of it is written to, followed or "
    "removed (a dead receiver's FIFO of ours is), and both requests finish with every frame, polling if they must "
    "(one registers while Code2Wav waits on its FIFO for the other's chunk: the registration wakes it)",
    issue="omnisim issue 9 (a hostile /dev/shm), issue 11 (a blind spot of the mutation score: FIFO wakeups)",
    own=TALKER,
    params=(PLANT,),
    prepare=plant_names,
)
async def hostile_wakeup_names(world: World) -> None:
    # Code2Wav waits on its FIFO for R's next chunk when S registers for a chunk already there:
    # the registration must wake that wait, as a put would (spec §2.9).
    slow, quick = EdgeRequest(world, "R"), EdgeRequest(world, "S")
    for req in (slow, quick):
        req.stream.allowed_outcomes = frozenset({"finished"})

    async def quick_consumer() -> None:
        await current_kernel().sleep(QUICK_CONSUMER_DELAY_S)
        await receive(quick)

    await in_process(
        [
            (MAIN_PROCESS, "R.consume", lambda: receive(slow)),
            ("stage1", "R.produce", lambda: send(slow, CHUNKS, pause_s=SLOW_PRODUCER_S)),
            (MAIN_PROCESS, "S.consume", quick_consumer),
            ("stage1", "S.produce", lambda: send(quick, CHUNKS)),
        ]
    )
    for req in (slow, quick):
        await req.talker.adapter.release_shm_resources(req.ext)
    note_planted(world)


def note_planted(world: World) -> None:
    """Note what became of each planted name, for ``foreign-names-untouched``. A dead receiver's
    FIFO goes at the next put's wakeup: if every put failed (sampled faults), none came."""
    k = current_kernel()
    assert isinstance(k, SimKernel)
    woken = any(e.name == "shm.put.wake" and e.attrs.get("to") == str(CODE2WAV) for e in k.trace)
    for planted in world.observers.get("planted", []):
        if planted.want == GONE and not woken:
            planted = dataclasses.replace(planted, want=LEFT_ALONE)
        k.note("shm.planted", what=planted.what, got=planted.now(), want=planted.want)


EDGE_PLANT = Param(
    "plant",
    (
        "ring_foreign_mode",
        "ring_symlink",
        "ring_garbage_of_ours",
        "segment_foreign_mode",
        "segment_sparse",
        "lock_foreign_mode",
    ),
    "what sits at a name of the edge before the Talker makes it: at its ring's, a file others may read (mode 644), "
    "a symlink, or a file of ours holding no ring; at a chunk's segment's, a file others may read holding a "
    "committed frame of codes never sent, or a file of ours holding such a frame with a hole where its zeros are "
    "(never reserved: a put of ours reserves every byte first); at a chunk's lock file's, a file others may read",
)
#: The plants that take a name a chunk's put needs: its put fails (unless the chunk went on a ring).
TAKEN_NAMES = ("segment_foreign_mode", "lock_foreign_mode")
#: The plants that fail the request of a reader that finds them before the chunk's put replaced
#: them (a segment of ours that is not an intact chunk is a corrupt one).
CORRUPT_NAMES = ("segment_sparse",)
#: The chunk whose segment name ``segment_foreign_mode`` (or lock file name, ``lock_foreign_mode``) takes.
PLANTED_KEY = "R_1_1"


def plant_edge_names(world: World, params: Params) -> None:
    """Plant what ``params["plant"]`` says at a name of the Talker → Code2Wav edge, in the
    Talker's namespace (the world's own: the Talker runs in the world's process here)."""
    if not isinstance(world.store, PosixStore):
        return
    planted: list[Planted] = []
    ring = world.plant(f"ring-{rings.edge_name(str(TALKER), str(CODE2WAV))}")
    garbage = b"\xff" * RING_GARBAGE_BYTES
    if params["plant"] == "ring_foreign_mode":
        planted.append(record("a file others may read at the ring's name", _regular_file(ring, garbage, mode=0o644)))
    elif params["plant"] == "ring_symlink":
        bait = _regular_file(world.plant("bait"), garbage)
        os.symlink(bait, ring)
        planted += [record("a symlink at the ring's name", ring), record("the file that symlink points at", bait)]
    elif params["plant"] == "ring_garbage_of_ours":
        _regular_file(ring, garbage)  # ours to replace: a ring, or no ring, never frames read from it
    elif params["plant"] == "lock_foreign_mode":
        lock = _regular_file(world.plant(f"lock-{PLANTED_KEY}"), b"", mode=0o644)
        planted.append(record(f"a file others may read at the lock file name of {PLANTED_KEY}", lock))
    elif params["plant"] == "segment_sparse":
        codes = torch.zeros((NUM_CODEBOOKS, SPARSE_FRAMES), dtype=torch.int64)
        codes[0, 0] = 2047
        _sparse_file(world.plant(f"seg-{PLANTED_KEY}"), encode({"codes": {"audio": codes}}))
        _regular_file(world.plant(f"lock-{PLANTED_KEY}"), b"")  # as a put leaves one
    else:
        never_sent = {"codes": {"audio": torch.full((NUM_CODEBOOKS, 4), 2047)}}
        segment = _regular_file(world.plant(f"seg-{PLANTED_KEY}"), encode(never_sent), mode=0o644)
        # Beside it, a lock file as a put leaves one: a reader goes on to the segment.
        _regular_file(world.plant(f"lock-{PLANTED_KEY}"), b"")
        planted.append(record(f"a file others may read at the segment name of {PLANTED_KEY}, holding a frame", segment))
    world.observers["planted"] = planted


#: Codec frames of the sparse plant's chunk: 128 KiB of codes, nearly all zeros.
SPARSE_FRAMES = 1024


def _sparse_file(path: str, content: bytes) -> str:
    """``content`` in a file of ours, with a hole over the whole pages of its longest run of zeros:
    a reader sees the same bytes, but they were never reserved."""
    page = os.sysconf("SC_PAGE_SIZE")
    zeros = max(re.finditer(rb"\x00+", content), key=lambda m: m.end() - m.start())
    start, end = -(-zeros.start() // page) * page, zeros.end() // page * page
    assert end > start, "no whole page of zeros to leave out"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.pwrite(fd, content[:start], 0)
        os.pwrite(fd, content[end:], end)
    finally:
        os.close(fd)
    return path


@hostile_scenario(
    "hostile_edge_names",
    summary="a name of the Talker → Code2Wav edge is taken before the Talker makes it: its ring's, by a file others "
    "may read, a symlink or a file of ours holding no ring; a chunk's segment's, by a file others may read holding a "
    "frame of codes never sent, or by a file of ours holding such a frame with a hole (never reserved); a chunk's "
    "lock file's, by a file others may read: the foreign names are left alone (the edge goes over segments, or the "
    "chunk's put fails), ours are replaced, and no reader takes a frame from a name that is not ours, not a ring "
    "or not reserved",
    issue="omnisim issue 9 (a hostile /dev/shm), issue 13 (the ring's attach checks)",
    own=CODE2WAV,
    params=(EDGE_PLANT,),
    prepare=plant_edge_names,
    fails_puts=True,
)
async def hostile_edge_names(world: World) -> None:
    req = EdgeRequest(world, "R")
    # A put that meets a foreign name fails its request; one that goes on the ring does not.
    taken = world.params.get("plant") in TAKEN_NAMES + CORRUPT_NAMES and isinstance(world.store, PosixStore)
    req.stream.allowed_outcomes = frozenset({"finished", "failed"} if taken else {"finished"})
    await in_process(
        [("stage2", "R.consume", lambda: receive(req)), (MAIN_PROCESS, "R.produce", lambda: send(req, CHUNKS))]
    )
    await req.talker.adapter.release_shm_resources(req.ext)
    note_planted(world)


@mutant(
    "wakeup_writes_to_any_name",
    summary="a put's wakeup takes whatever it finds in the wakeup folder for a receiver's FIFO: it writes into a "
    "file there and into another user's FIFO, and removes another user's FIFO that has no reader",
    issue="omnisim issue 9 (a hostile /dev/shm)",
    scenarios=("hostile_wakeup_names",),
    expect=("foreign-names-untouched",),
    store="posix",
)
def wakeup_writes_to_any_name() -> Iterator[Patch]:
    anything: Callable[[os.stat_result], bool] = lambda st: True  # noqa: E731
    yield Patch(wakeup, "_our_fifo", anything)
