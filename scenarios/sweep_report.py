"""What a sweep of /dev/shm reports, next to what it did (spec §2.7, issue 9).

``omnisim sweep`` prints the sweep's report, and an operator acts on it: what it removed (or, in a
dry run, would remove), the namespaces it kept because their owner lives or their names are too
young to judge, the names it skipped because they are not ours, the names it could not remove.
Here a private tmpfs holds what a machine's /dev/shm may hold, made by hand so the truth is
known: a dead owner's namespace with every kind of name and a folder of FIFOs holding another
user's file; a live owner's, and an old one of a live owner with pid 1 (a container's first
process); an ownerless one too young to judge, one old enough to sweep, and one with an old name
beside a young one (kept: someone may be writing it); two young ones whose
dead owner's record is padded to 4 KiB (read: the largest a record may be) and past it (no record
the runtime writes: its owner cannot be judged, and the namespace is kept), and a young one whose
record names pid 0 (no process: a record no owner wrote, kept as well); a name of the dead
namespace others may read, a symlink, and a name that is not omnisim's. While the sweep removes
the dead namespace's segment, a consumer that was reading it hands it back as a spare (a name the
sweep's first look did not see, which its second must find). A dry run, then a sweep, each
through the runtime's own :func:`~runtime.connectors.namespaces.sweep` on the real folder; each
part of each report is noted beside what it must say (``sweep-reports-true``), and so is what the
folder holds afterwards.
"""

from __future__ import annotations

import errno
import os
import re
import time

from omnisim.registry import DEFAULT_INVARIANTS, scenario
from omnisim.sim_kernel import MAIN_PROCESS
from omnisim.tmpfs import why_unavailable
from omnisim.world import Room, World
from runtime.connectors.namespaces import (
    OWNER_SUFFIX,
    RECORD_MAX_BYTES,
    Owner,
    ShmDirectory,
    SweepReport,
    sweep,
    write_owner,
)
from runtime.kernel import current_kernel

#: The folder's room: a few namespaces' worth of empty names.
ROOM = Room(bytes=64 << 10, names=64)
#: Another user, who owns what the scenario leaves in the dead namespace's FIFO folder.
STRANGER_UID = 54321
#: How old the old ownerless namespace's names are: past the sweep's grace period.
OLD_S = 3600.0

#: The names the scenario makes (the world's own store, if it has one here, is none of them).
MADE = re.compile(r"omnisim-(dead|live|init|young|mixed|old|full|over|zero)-.*|not-omnisim")
#: The largest owner record a sweep reads.
RECORD_MAX = RECORD_MAX_BYTES
#: The names of each namespace of ours, besides its owner record.
OURS = {
    "dead": ("lock-k", "ring-edge_1_2", "seg-k", "spare-s"),
    "live": ("seg-k",),
    "init": ("seg-k",),
    "young": ("seg-k",),
    # (its lock file old, its segment young: someone may be writing it, so the namespace stays)
    "mixed": ("lock-k", "seg-k"),
    "old": ("lock-k", "seg-k"),
    "full": ("seg-k",),
    "over": ("seg-k",),
    "zero": ("seg-k",),
}
#: The spare a consumer hands back while the sweep removes the dead namespace's segment.
HANDED_BACK = "omnisim-dead-spare-k"


def sweep_world(store_kind: str) -> World:
    return World(store_kind, room=ROOM)


def unavailable(store: str) -> str | None:
    """The folder is a private tmpfs, whichever store the world runs on."""
    return why_unavailable()


def note_case(what: str, got: object, want: object) -> None:
    current_kernel().note("sweep.case", what=what, got=str(got), want=str(want))


def make_folder(world: World, path: str) -> dict[str, list[str]]:
    """Fill ``path`` as the module docstring says; what the sweep must report of it."""

    def name(namespace: str, rest: str) -> str:
        return f"omnisim-{namespace}-{rest}"

    def file(full: str, mode: int = 0o600) -> str:
        fd = os.open(os.path.join(path, full), os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
        os.close(fd)
        os.chmod(os.path.join(path, full), mode)  # (the umask may have taken bits off)
        return full

    for namespace, rests in OURS.items():
        for rest in rests:
            file(name(namespace, rest))
    dead = world.processes.spawn()
    write_owner(os.path.join(path, name("dead", OWNER_SUFFIX)), dead)
    world.processes.kill(dead)
    write_owner(os.path.join(path, name("live", OWNER_SUFFIX)), world.owners[MAIN_PROCESS])
    write_owner(os.path.join(path, name("init", OWNER_SUFFIX)), world.processes.spawn(pid=1))
    for namespace, size in (("full", RECORD_MAX), ("over", RECORD_MAX + 1)):
        record = dead.to_json().encode()
        with open(os.path.join(path, name(namespace, OWNER_SUFFIX)), "wb") as f:
            f.write(record + b" " * (size - len(record)))  # (JSON padded with blanks: still the record)
        os.chmod(os.path.join(path, name(namespace, OWNER_SUFFIX)), 0o600)
    write_owner(os.path.join(path, name("zero", OWNER_SUFFIX)), Owner(0, 1, dead.pid_namespace))
    wake = os.path.join(path, name("dead", "wake"))
    os.mkdir(wake, 0o700)
    os.mkfifo(os.path.join(wake, "2"), 0o600)
    stranger = os.path.join(wake, "theirs")
    os.close(os.open(stranger, os.O_CREAT | os.O_WRONLY, 0o600))
    os.chown(stranger, STRANGER_UID, STRANGER_UID)
    # (init's: old enough to sweep, were its live owner not seen; mixed's lock file only)
    for old in [name("old", rest) for rest in OURS["old"]] + [name("init", "seg-k"), name("mixed", "lock-k")]:
        os.utime(os.path.join(path, old), (time.time() - OLD_S, time.time() - OLD_S))
    foreign = [file(name("dead", "seg-readable"), 0o644), name("dead", "ring-link")]
    os.symlink(os.path.join(path, name("dead", "seg-k")), os.path.join(path, foreign[1]))
    file("not-omnisim")

    def doomed(namespace: str, owner: bool) -> list[str]:
        rests = sorted([*OURS[namespace], *(["wake"] if namespace == "dead" else [])])
        return [name(namespace, rest) for rest in rests] + ([name(namespace, OWNER_SUFFIX)] if owner else [])

    return {
        "dry run, removed": doomed("dead", True) + doomed("full", True) + doomed("old", False),
        # The FIFO folder holds another user's file: it stays, and the sweep says so.
        "removed": [n for n in doomed("dead", True) if not n.endswith("-wake")]
        + [HANDED_BACK]
        + doomed("full", True)
        + doomed("old", False),
        "live": ["init", "live"],
        "unjudged": ["over", "zero"],
        "young_orphans": ["mixed", "young"],
        "foreign": sorted(foreign),
        "errors": [f"{name('dead', 'wake')}: {os.strerror(errno.ENOTEMPTY)}"],
    }


def said(report: SweepReport, part: str) -> list[str]:
    return getattr(report, part.removeprefix("dry run, "))


@scenario(
    "sweep_reports",
    summary="a sweep of a /dev/shm holding a dead owner's namespace (with a FIFO folder holding another user's file), "
    "a live owner's, ownerless ones young, old and of both ages, and names that are not ours: a dry run lists "
    "what the sweep then removes and removes nothing; the sweep's report lists exactly what it removed, kept, "
    "skipped and could not remove, and leaves what is not ours",
    issue="spec §2.7 and omnisim issue 9 (the sweep an operator runs, and the report it reads)",
    build=sweep_world,
    invariants=(*DEFAULT_INVARIANTS, "sweep-reports-true"),
    # One run is the whole check: the sweeps have no other task to interleave with.
    budget_share=0.05,
    unavailable=unavailable,
)
async def sweep_reports(world: World) -> None:
    path = world.private_shm_dir()
    want = make_folder(world, path)
    folder = HandingBack(wall_clock=time.time, path=path)
    before = made_in(path)
    own = (world.store.namespace,)  # (the world's store, here when it is a POSIX one: not the scenario's)
    dry = await sweep(folder, world.processes, dry_run=True, keep=own)
    note_case("what the dry run removed", made_in(path), before)
    for part, names in want.items():
        report = dry if part.startswith("dry run") else None
        if report is not None:
            note_case(f"the {part} part of the report", said(report, part), names)
    folder.hand_back = True
    done = await sweep(folder, world.processes, keep=own)
    for part, names in want.items():
        if not part.startswith("dry run"):
            note_case(f"the sweep's {part}", said(done, part), names)
    left = sorted(set(before) - set(want["removed"]))
    note_case("what the sweep left", made_in(path), left)


class HandingBack(ShmDirectory):
    """The folder, where a consumer still reading the dead namespace's segment hands it back as
    a spare (a link to a name of its own) right before the sweep removes it, once ``hand_back``."""

    hand_back = False

    def remove(self, name: str) -> None:
        if self.hand_back and name == "omnisim-dead-seg-k":
            os.link(os.path.join(self.path, name), os.path.join(self.path, HANDED_BACK))
        super().remove(name)


def made_in(path: str) -> list[str]:
    return sorted(name for name in os.listdir(path) if MADE.fullmatch(name))
