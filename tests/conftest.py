"""Shared test fixtures.

Every test must leave /dev/shm as it found it. The autouse fixture below gives every
``PosixStore()`` made during a test a namespace that names this pytest process, then checks
that nothing with that prefix is left behind afterwards (and removes whatever was, so one
failure does not cascade). Entries of other namespaces are left alone: another test run on the
same machine may own them.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from runtime.connectors import namespaces, posix_store  # noqa: E402

SHM_DIR = "/dev/shm"
#: Namespaces made by this process: "t<pid hex>n<counter>" ("n" is not a hex digit, so the
#: prefix of one process is never a prefix of another's).
NAMESPACE_PREFIX = f"t{os.getpid():x}n"
_counter = itertools.count()


class OneNamespace(namespaces.ShmDirectory):
    """/dev/shm as a sweep of one namespace sees it: what other runs on this machine made (a
    simulated run's live namespace, say) is not this test's to judge or remove."""

    def __init__(self, namespace: str) -> None:
        super().__init__()
        self.namespace = namespace

    def entries(self) -> list[namespaces.Entry]:
        return [entry for entry in super().entries() if entry.namespace == self.namespace]


def fresh_namespace() -> str:
    """A namespace owned by this test process, valid for PosixStore and FifoWakeups."""
    ns = f"{NAMESPACE_PREFIX}{next(_counter)}"
    assert posix_store.NAMESPACE_PATTERN.fullmatch(ns), ns
    return ns


def _ours() -> set[str]:
    stem = f"omnisim-{NAMESPACE_PREFIX}"
    return {name for name in os.listdir(SHM_DIR) if name.startswith(stem)}


def _remove(name: str) -> None:
    path = os.path.join(SHM_DIR, name)
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def left_behind(before: set[str]) -> list[str]:
    """``omnisim-`` names in /dev/shm new since ``before`` that no live process owns: what some
    process (a server, a mutant's child) failed to remove. Another run's live names are not ours."""
    from runtime.connectors.namespaces import NAME, ProcTable, ShmDirectory, owner_state

    directory, processes = ShmDirectory(), ProcTable()
    left = []
    for name in sorted(shm_names() - before):
        match = NAME.fullmatch(name)
        owner = directory.read_owner(match.group(1)) if match else None
        # (a name gone by now was another run's, removed as it closed: its owner record goes last)
        if (owner is None or owner_state(owner, processes) != "alive") and os.path.lexists(os.path.join(SHM_DIR, name)):
            left.append(name)
    return left


def shm_names() -> set[str]:
    return {name for name in os.listdir(SHM_DIR) if name.startswith("omnisim-")}


def make_sparse(path: str) -> None:
    """Extend the file at ``path`` to 1 GiB without reserving a byte: a hole no put of ours leaves."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.ftruncate(fd, 1 << 30)
    finally:
        os.close(fd)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", help="also run the long campaigns (marked `long`)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--long") or "long" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="a long campaign: run with --long (or -m long)")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def shm_leak_check(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail a test that leaves any of this process's names in /dev/shm."""
    monkeypatch.setattr(posix_store, "new_namespace", fresh_namespace)
    before = _ours()
    yield
    leaked = sorted(_ours() - before)
    for name in leaked:
        _remove(name)
    assert not leaked, f"test left entries in {SHM_DIR}: {leaked}"
