"""Who owns a namespace in /dev/shm, and the sweep that reclaims what dead owners left.

Every name the runtime creates in /dev/shm is ``omnisim-{namespace}-…``. A namespace records its
owner first of all, in ``omnisim-{namespace}-owner``: the owning process's pid, its start time
(clock ticks since boot, from ``/proc/PID/stat``) and its pid namespace. A pid alone would not do:
pids are reused, and a new process that happens to get a dead owner's pid must not keep the dead
owner's names alive (the check upstream's shm ring makes: "producer was replaced").

:func:`sweep` removes every namespace whose owner is dead — segments, lock files, the wakeup
folder and the owner record — like PostgreSQL removing the dynamic shared memory a dead
postmaster left. It never touches a namespace whose owner lives, whose owner it cannot judge
(another pid namespace, or a record a stray write damaged: records are written whole), or a
name that is not ours (another user's, or a symlink); a namespace without an owner record is only
removed once all its names are older than a grace period (its owner may be writing the record
right now).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Protocol

from runtime.kernel import current_kernel

SHM_DIR = "/dev/shm"
#: ``omnisim-{namespace}-{rest}``; a namespace is 1–24 characters of [a-z0-9].
NAME = re.compile(r"omnisim-([a-z0-9]{1,24})-(.+)")
OWNER_SUFFIX = "owner"
#: The largest owner record (one is a few dozen bytes).
RECORD_MAX_BYTES = 4096
#: Names of a namespace without an owner record are left alone until they are this old.
ORPHAN_GRACE_S = 60.0
#: The most spare segments (consumed segments kept for the producer's next puts, see
#: :mod:`runtime.connectors.stores`) a namespace keeps.
SPARES_KEPT = 4
#: What the runtime creates under ``omnisim-{namespace}-{kind}…``: the file type and the only mode
#: it ever creates it with.
_KINDS = {
    "seg": (stat.S_IFREG, 0o600),
    "lock": (stat.S_IFREG, 0o600),
    "ring": (stat.S_IFREG, 0o600),
    "spare": (stat.S_IFREG, 0o600),
    OWNER_SUFFIX: (stat.S_IFREG, 0o600),
    "wake": (stat.S_IFDIR, 0o700),
}


@dataclass(frozen=True)
class Owner:
    """A process, identified so that a reused pid is not mistaken for it."""

    pid: int
    start_ticks: int
    pid_namespace: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Owner | None:
        try:
            data = json.loads(text)
            owner = cls(int(data["pid"]), int(data["start_ticks"]), str(data["pid_namespace"]))
        except (ValueError, TypeError, KeyError):
            return None
        return owner if owner.pid > 0 else None


@dataclass(frozen=True)
class DamagedRecord:
    """An owner record that is there, and ours, but does not say who owns the namespace. Records
    are written whole (:func:`write_owner`), so only a stray write makes one: whether the owner
    lives cannot be told, and its namespace is never swept."""


class ProcessTable(Protocol):
    """Who is alive: the identity of a live pid, or None."""

    def identity(self, pid: int) -> Owner | None: ...

    def pid_namespace(self) -> str:
        """This process's pid namespace: owners in another one cannot be judged."""
        ...


class ProcTable:
    """The real process table, read from /proc."""

    def identity(self, pid: int) -> Owner | None:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                raw = f.read().decode("ascii", "replace")
        except OSError:
            return None
        # The command name (field 2) may hold spaces and parentheses: split after the last ")".
        fields = raw.rsplit(")", 1)[-1].split()
        try:
            state, start_ticks = fields[0], int(fields[19])  # fields 3 and 22 of stat(5)
        except (IndexError, ValueError):
            return None
        if state in ("Z", "X"):
            return None  # dead, and not yet waited for: it holds nothing any more
        return Owner(pid, start_ticks, self.pid_namespace())

    def pid_namespace(self) -> str:
        try:
            return os.readlink("/proc/self/ns/pid")
        except OSError:
            return "unknown"


def current_owner(processes: ProcessTable | None = None) -> Owner:
    """This process, as an owner record names it."""
    me = (processes or ProcTable()).identity(os.getpid())
    if me is None:
        raise RuntimeError("cannot read this process's own identity from /proc")
    return me


def owner_state(owner: Owner, processes: ProcessTable) -> str:
    """``"alive"``, ``"dead"`` or ``"unknown"`` (another pid namespace: not ours to judge)."""
    if owner.pid_namespace != processes.pid_namespace():
        return "unknown"
    live = processes.identity(owner.pid)
    return "alive" if live is not None and live.start_ticks == owner.start_ticks else "dead"


@dataclass(frozen=True)
class Entry:
    """One name in the shared-memory folder, as :func:`sweep` sees it."""

    name: str
    namespace: str
    ours: bool  # what its name says it is (a 0600 file, a 0700 folder), of this user; never a symlink
    age_s: float


class Directory(Protocol):
    """The shared-memory folder the sweep works on (real /dev/shm, or a simulated one)."""

    def entries(self) -> list[Entry]: ...

    def read_owner(self, namespace: str) -> Owner | DamagedRecord | None:
        """The namespace's owner; None if it has no owner record of ours."""
        ...

    def remove(self, name: str) -> None:
        """Remove one name (a folder with everything in it); never follows a symlink."""
        ...


class ShmDirectory:
    """/dev/shm itself."""

    def __init__(self, wall_clock: Callable[[], float] | None = None, path: str = SHM_DIR) -> None:
        """``wall_clock``: seconds since the epoch, to tell a name's age by its mtime (without
        one every name counts as old: only a sweep of ownerless names needs ages)."""
        self.path = path
        self._clock = wall_clock

    def entries(self) -> list[Entry]:
        out = []
        now = self._clock() if self._clock is not None else math.inf
        uid = os.geteuid()
        for name in sorted(os.listdir(self.path)):
            match = NAME.fullmatch(name)
            if match is None:
                continue
            try:
                st = os.lstat(os.path.join(self.path, name))
            except FileNotFoundError:
                continue
            kind = _KINDS.get(match.group(2).split("-", 1)[0].split(".", 1)[0])
            ours = st.st_uid == uid and kind == (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode))
            out.append(Entry(name, match.group(1), ours, max(0.0, now - st.st_mtime)))
        return out

    def read_owner(self, namespace: str) -> Owner | DamagedRecord | None:
        path = os.path.join(self.path, f"omnisim-{namespace}-{OWNER_SUFFIX}")
        try:
            # (O_NONBLOCK: a FIFO someone made at the name would block an open for reading)
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                return None
            if st.st_size > RECORD_MAX_BYTES:
                return DamagedRecord()
            return Owner.from_json(os.read(fd, RECORD_MAX_BYTES).decode("utf-8", "replace")) or DamagedRecord()
        finally:
            os.close(fd)

    def remove(self, name: str) -> None:
        path = os.path.join(self.path, name)
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            uid = os.geteuid()
            for inner in os.listdir(path):
                inner_path = os.path.join(path, inner)
                with contextlib.suppress(FileNotFoundError):
                    if os.lstat(inner_path).st_uid == uid:
                        os.unlink(inner_path)
            os.rmdir(path)
        else:
            os.unlink(path)


def write_owner(path: str, owner: Owner) -> None:
    """Write an owner record atomically (a reader sees no record or a whole one), mode 0600,
    refusing to follow or replace anything already at ``path``."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            record = memoryview(owner.to_json().encode())
            while record:
                record = record[os.write(fd, record) :]
        finally:
            os.close(fd)
        os.link(tmp, path)  # unlike rename, never replaces an existing name
    finally:
        os.unlink(tmp)  # (also when the write failed: nothing of a record that was never made stays)


@dataclass
class SweepReport:
    """What a sweep did: names removed (or that would be, with ``dry_run``), namespaces kept
    because their owner lives or cannot be judged, names skipped because they are not ours."""

    removed: list[str] = field(default_factory=list)
    live: list[str] = field(default_factory=list)
    unjudged: list[str] = field(default_factory=list)
    young_orphans: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, list[str]]:
        return asdict(self)


async def sweep(
    directory: Directory,
    processes: ProcessTable,
    *,
    dry_run: bool = False,
    keep: Iterable[str] = (),
    grace_s: float = ORPHAN_GRACE_S,
) -> SweepReport:
    """Remove every namespace whose owner is dead (see the module docstring); ``keep``: namespaces
    never to touch (the caller's own). Each namespace is judged right before its names go, and
    a live owner's namespace is never touched, whatever runs meanwhile."""
    k = current_kernel()
    report = SweepReport()
    by_namespace: dict[str, list[Entry]] = {}
    for entry in directory.entries():
        if entry.ours:
            by_namespace.setdefault(entry.namespace, []).append(entry)
        else:
            report.foreign.append(entry.name)
    kept = set(keep)
    for namespace, entries in sorted(by_namespace.items()):
        if namespace in kept:
            continue
        await k.point("sweep.judge", ns=namespace)
        verdict = _verdict(directory, processes, namespace, entries, grace_s)
        if verdict is not None:
            getattr(report, verdict).append(namespace)
            continue
        # The owner record goes last: a sweep stopped half-way is finished by the next one.
        doomed = sorted(entries, key=_is_owner)
        if dry_run:
            report.removed.extend(entry.name for entry in doomed)
            continue
        failed = _remove_all(directory, namespace, doomed, report)
        # (what could not be removed is reported once: the second look is for names made meanwhile)
        again = [e for e in _made_meanwhile(directory, namespace) if e.name not in failed]
        _remove_all(directory, namespace, again, report)
    return report


def _made_meanwhile(directory: Directory, namespace: str) -> list[Entry]:
    """What a sweep that removed ``namespace`` finds of it on a second look. A live consumer may
    hand back a segment it was reading as a spare, a name made after the sweep's first look, but
    only while that segment still had its name, which the sweep then removed: this look finds
    every such spare."""
    return [e for e in directory.entries() if e.namespace == namespace and e.ours and not _is_owner(e)]


def _is_owner(entry: Entry) -> bool:
    return entry.name.endswith(f"-{OWNER_SUFFIX}")


def _remove_all(directory: Directory, namespace: str, entries: list[Entry], report: SweepReport) -> set[str]:
    """Remove ``entries``, reporting each; the names that could not be removed."""
    k = current_kernel()
    failed = set()
    for entry in entries:
        try:
            directory.remove(entry.name)
        except FileNotFoundError:
            continue
        except OSError as e:
            report.errors.append(f"{entry.name}: {e.strerror or e}")
            failed.add(entry.name)
            continue
        k.note("sweep.removed", ns=namespace, name=entry.name)
        report.removed.append(entry.name)
    return failed


def _verdict(
    directory: Directory, processes: ProcessTable, namespace: str, entries: list[Entry], grace_s: float
) -> str | None:
    """Why a namespace must be kept (a :class:`SweepReport` field), or None: it is a dead owner's."""
    owner = directory.read_owner(namespace)
    if owner is None:
        return "young_orphans" if any(e.age_s < grace_s for e in entries) else None
    if isinstance(owner, DamagedRecord):
        return "unjudged"
    state = owner_state(owner, processes)
    return {"alive": "live", "unknown": "unjudged"}.get(state)
