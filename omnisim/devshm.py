"""What simulated runs leave in /dev/shm and in this process's descriptor table, read and
removed with the harness's own code.

Every oracle here restates what it checks instead of asking the runtime (whose code may be a
mutant's): which descriptors a run opened and left open, which FIFOs a wakeup folder holds, who
this process is as an owner record names it. And whatever a run made — its namespaces, the FIFO
wakeup buses of its simulated processes, what a scenario planted — is closed and removed at its
end by :func:`sweep_made_stores`, even when the run was stopped halfway.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat

from omnisim import tmpfs
from runtime.connectors.namespaces import SHM_DIR, Owner
from runtime.connectors.wakeup import FifoWakeups

#: The namespace of every POSIX store made for a simulated world and not yet swept, with the
#: folder it is in: chosen before the store is made, so a run interrupted while its world was
#: being built still has everything of it removed, by name.
_made: list[tuple[str, str]] = []
#: The private tmpfs mounts of the worlds (see :mod:`omnisim.tmpfs`), unmounted last.
_mounts: list[str] = []
#: The FIFO wakeup buses of the simulated processes whose descriptors may still be open.
_buses: list[FifoWakeups] = []
#: The descriptors scenarios hold on what they planted in /dev/shm.
_held: list[int] = []


def made(namespace: str, directory: str = SHM_DIR) -> None:
    """Remove every name of ``namespace`` in ``directory`` at the end of the run."""
    _made.append((namespace, directory))


def mounted(path: str) -> str:
    """Unmount the tmpfs at ``path`` at the end of the run; ``path``."""
    _mounts.append(path)
    return path


def opened(bus: FifoWakeups) -> None:
    """Close ``bus``'s descriptors at the end of the run, if the runtime has not."""
    _buses.append(bus)


def hold(fd: int) -> int:
    """Keep ``fd`` (on something a scenario planted) open until the end of the run."""
    _held.append(fd)
    return fd


def sweep_made_stores() -> None:
    """Close every descriptor the runs left open on /dev/shm and remove every name of every
    namespace they made, what scenarios planted there included. With code of its own, not the
    runtime's sweep: under a mutant, that sweep is the mutant's."""
    while _buses:
        lose_descriptors(_buses[-1])
    while _held:
        os.close(_held.pop())
    while _made:
        namespace, directory = _made.pop()
        for name in os.listdir(directory):
            if name.startswith(f"omnisim-{namespace}-"):
                remove(os.path.join(directory, name))
    while _mounts:
        tmpfs.unmount(_mounts.pop())


def remove(path: str) -> None:
    """Remove ``path``, a folder with what it holds (whoever's the names inside are: a run's own,
    or what its scenario planted there)."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(os.lstat(path).st_mode):
            for name in os.listdir(path):
                os.unlink(os.path.join(path, name))
            os.rmdir(path)
        else:
            os.unlink(path)


def lose_descriptors(bus: FifoWakeups) -> set[str]:
    """What the OS does to a dead process's FIFO wakeups: it closes their descriptors, and
    nothing else (the FIFOs stay, with no reader: the next notifier removes them). Their paths."""
    paths = set()
    for receiver in bus._receivers.values():
        os.close(receiver.read_fd)
        os.close(receiver.hold_fd)
        paths.add(receiver.path)
    bus._receivers.clear()
    _buses.remove(bus)
    return paths


def this_process() -> Owner:
    """This process as an owner record names it: pid, start time (field 22 of stat(5)), pid
    namespace."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().decode("ascii", "replace").rsplit(")", 1)[-1].split()
    return Owner(os.getpid(), int(fields[19]), os.readlink("/proc/self/ns/pid"))


def descriptors() -> dict[int, str]:
    """This process's open descriptors, and what each points at (a name of the run without its
    random parts, so that a report reads the same in every run)."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (the listing's own descriptor, closed by now)
            target = os.readlink(f"/proc/self/fd/{name}")
            out[int(name)] = re.sub(r"_[0-9a-f]{32}\b", "", re.sub(r"omnisim-[a-z0-9]+-", "omnisim-NS-", target))
    return out


def opened_since(before: dict[int, str]) -> list[str]:
    """What each descriptor opened since ``before`` (a :func:`descriptors`) and still open points
    at, but the ones a scenario holds."""
    return [what for fd, what in sorted(descriptors().items() - before.items()) if fd not in _held]


def not_ours(path: str) -> bool:
    """Whether ``path`` exists and is not something the runtime makes: a regular file or FIFO of
    this user with mode 0600, or a folder of this user with mode 0700."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    mode = 0o700 if stat.S_ISDIR(st.st_mode) else 0o600
    kind = stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode) or stat.S_ISDIR(st.st_mode)
    return not (kind and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == mode)


def receivers_fifos(folder: str, leave_out: set[str]) -> list[str]:
    """The receivers' FIFOs in a wakeup folder, by stage (``2`` for ``2_<random>``): FIFOs of
    this user with mode 0600, what a receiver makes, but the paths in ``leave_out``; and the
    folder itself, once it holds nothing (the last bus to close removes it)."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    if not names and folder not in leave_out:
        return ["the empty wakeup folder"]
    out = []
    for name in names:
        path = os.path.join(folder, name)
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(path)
            ours = stat.S_ISFIFO(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600
            if ours and path not in leave_out:
                out.append(f"the wakeup FIFO of stage {name.rsplit('_', 1)[0]}")
    return out
