"""The data plane as an operator meets it: real processes, real /dev/shm, real SIGKILL.

* A producer killed at a random moment of a put never hands a consumer wrong bytes: every chunk
  a consumer accepts is exactly what was put; an unfinished one is a corrupt chunk.
* ``sweep`` reclaims everything a killed process left, and nothing of a live one.
* A tiny /dev/shm (a private mount namespace, as root): a full store, by bytes or by inodes, is a
  clean failure that names its cause and leaves nothing; ``omnisim pipeline run`` says so in one
  line.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import trio
from conftest import OneNamespace

from runtime.connectors import posix_store
from runtime.connectors.base import CorruptChunk
from runtime.connectors.namespaces import ProcTable, ShmDirectory, sweep
from runtime.connectors.posix_store import SHM_DIR, PosixStore
from runtime.connectors.shm import ShmConnector

REPO_ROOT = Path(__file__).resolve().parent.parent
#: Elements of each payload (int32): 16 MiB, so a put takes long enough to be killed inside.
ELEMENTS = 4 << 20
TRIALS = 30


def _names(namespace: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"omnisim-{namespace}-"))


def _produce_until_killed(namespace: str, write_fd: int) -> None:
    """The child: a namespace of its own, then puts of key-derived payloads until killed."""

    async def main() -> None:
        store = PosixStore(namespace, claim=True)
        os.write(write_fd, b"started\n")
        conn = ShmConnector(store, stage_id=1)
        i = 0
        while True:
            await conn.put("1", "2", f"K_1_{i}", {"i": i, "data": np.full(ELEMENTS, i, dtype=np.int32)})
            i += 1

    try:
        trio.run(main)
    finally:
        os._exit(1)


def _killed_producer(delay_s: float) -> str:
    """Fork a producer, let it run ``delay_s``, SIGKILL it; the namespace it left."""
    namespace = posix_store.new_namespace()  # this test's (see conftest)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read_fd)
        _produce_until_killed(namespace, write_fd)
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        started = pipe.readline().strip()
        time.sleep(delay_s)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert started, "the producer never started"
    return namespace


async def _consume_all(namespace: str) -> Counter[str]:
    """Read every key the dead producer may have written; check what is accepted, by content."""
    upstream = PosixStore(namespace)  # attach, as the next stage does
    consumer = ShmConnector(PosixStore(), stage_id=2, upstream=upstream)
    seen: Counter[str] = Counter()
    misses = 0
    i = 0
    while misses < 3:
        try:
            got = await consumer.get("1", "2", f"K_1_{i}")
        except CorruptChunk:
            seen["corrupt"] += 1
        else:
            if got is None:
                misses += 1
            else:
                payload = got[0]
                assert payload["i"] == i, f"chunk {i} came back as chunk {payload['i']}"
                assert payload["data"].shape == (ELEMENTS,) and bool((payload["data"] == i).all()), (
                    f"chunk {i} was accepted with wrong bytes"
                )
                seen["accepted"] += 1
        i += 1
    consumer.store.sweep()
    return seen


def test_a_killed_producer_never_hands_a_consumer_wrong_bytes() -> None:
    rng = random.Random(9)
    totals: Counter[str] = Counter()
    for _ in range(TRIALS):
        namespace = _killed_producer(rng.uniform(0.02, 0.25))
        totals += trio.run(_consume_all, namespace)
        report = trio.run(lambda: sweep(ShmDirectory(time.time), ProcTable()))
        assert namespace not in report.live
        assert _names(namespace) == [], f"the sweep left {_names(namespace)}"
    print(f"\n{TRIALS} producers killed mid-stream: {dict(totals)}")
    assert totals["accepted"] > 0


class _AllDead(ProcTable):
    """A process table in which no process lives (so every namespace is a dead owner's)."""

    def identity(self, pid: int) -> None:
        return None


@pytest.mark.parametrize("how", ["operator sweep", "store sweep"])
def test_a_sweep_removes_the_spare_a_live_consumer_hands_back_while_it_runs(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consumer still reading a dead producer's segment hands it back as a spare, a name made
    after the sweep listed the namespace: its second look removes it."""
    store = PosixStore(spare_min_bytes=64)
    segment = store.create_segment("K_1_0")
    segment.reserve(100)
    segment.close()
    real_remove = ShmDirectory.remove

    def remove(self: ShmDirectory, name: str) -> None:
        if name.endswith("-seg-K_1_0"):
            store.retire_segment("K_1_0")  # the consumer, between the sweep's look and this removal
        real_remove(self, name)

    monkeypatch.setattr(ShmDirectory, "remove", remove)
    if how == "operator sweep":
        trio.run(lambda: sweep(OneNamespace(store.namespace), _AllDead()))
    else:
        store.sweep()
    assert _names(store.namespace) == []


def test_sweep_reclaims_a_killed_process_and_spares_a_live_one() -> None:
    live = PosixStore()
    try:
        dead = _killed_producer(0.05)
        assert _names(dead), "the killed producer left nothing to sweep"
        dry = trio.run(lambda: sweep(ShmDirectory(time.time), ProcTable(), dry_run=True))
        # (What other runs left on this machine, dead too, may be in the removal list as well.)
        assert set(_names(dead)) <= set(dry.removed) and live.namespace in dry.live
        assert not [name for name in dry.removed if name.startswith(f"omnisim-{live.namespace}-")]
        assert _names(dead), "a dry run removed something"
        report = trio.run(lambda: sweep(ShmDirectory(time.time), ProcTable()))
        assert live.namespace in report.live
        assert _names(dead) == []
        assert _names(live.namespace) == [f"omnisim-{live.namespace}-owner"]
    finally:
        live.sweep()


@pytest.mark.parametrize("record", [b"", b'{"pid": 0}', b"\xff not json"])
def test_a_sweep_keeps_a_namespace_whose_owner_record_a_stray_write_damaged(record: bytes) -> None:
    """Owner records are written whole, so one that does not parse was damaged by a stray write:
    whether its owner lives cannot be told, and the namespace is kept, however old (found by an
    outside audit: it was swept as ownerless once past the grace period, under a live owner)."""
    live = PosixStore()
    try:
        with open(os.path.join(SHM_DIR, f"omnisim-{live.namespace}-owner"), "wb") as f:
            f.write(record)
        report = trio.run(lambda: sweep(ShmDirectory(lambda: time.time() + 3600), ProcTable()))
        assert live.namespace in report.unjudged
        assert _names(live.namespace) == [f"omnisim-{live.namespace}-owner"]
    finally:
        live.sweep()


def test_a_zombie_owner_is_dead() -> None:
    """A process that died and was not yet waited for holds nothing any more: its namespace is
    a dead owner's (found by an outside audit: the sweep kept it until its parent waited)."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert ProcTable().identity(child.pid) is not None
        child.kill()
        deadline = time.monotonic() + 10
        while ProcTable().identity(child.pid) is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        with open(f"/proc/{child.pid}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] == "Z"  # (still there: not waited for)
        assert ProcTable().identity(child.pid) is None
    finally:
        child.wait()


def test_omnisim_sweep_command(tmp_path: Path) -> None:
    dead = _killed_producer(0.05)
    proc = subprocess.run(
        [sys.executable, "-m", "omnisim.cli", "sweep", "--json"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert any(dead in name for name in proc.stdout.splitlines()[-1].split('"'))
    assert _names(dead) == []


# -- a tiny /dev/shm, in a private mount namespace ----------------------------------------------

TINY_SHM = r"""
import sys, trio, numpy as np
from runtime.connectors.posix_store import PosixStore
from runtime.connectors.shm import ShmConnector

async def main():
    store = PosixStore()
    conn = ShmConnector(store, stage_id=1)
    big = await conn.put("1", "2", "B_1_0", {"data": np.zeros(1 << 20, dtype=np.float32)})  # 4 MiB > 1 MiB
    assert not big.ok and "/dev/shm is full" in big.metadata["error"], big
    assert store.segments() == [] and store.lock_files() == [], (store.segments(), store.lock_files())
    results = [await conn.put("1", "2", f"S_1_{i}", {"i": i}) for i in range(64)]
    failed = [r for r in results if not r.ok]
    assert failed and "no inodes left" in failed[0].metadata["error"], results[-1]
    # what a failed put leaves: nothing; what succeeded is all readable
    ok = sum(r.ok for r in results)
    assert len(store.segments()) == ok and len(store.lock_files()) == ok
    await conn.close()
    store.sweep()
    print("ok", ok, "puts fitted")

trio.run(main)
"""


def _in_tiny_shm(script: str, size: str = "1m", inodes: int = 40) -> subprocess.CompletedProcess[str]:
    mount = f"mount -t tmpfs -o size={size},nr_inodes={inodes},mode=1777 tmpfs /dev/shm"
    return subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", f'{mount} && exec "$0" "$@"', *script.split("\0")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
    )


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="a private tmpfs for /dev/shm needs root and unshare"
)


@needs_root
def test_a_full_dev_shm_is_a_clean_failure() -> None:
    proc = _in_tiny_shm("\0".join([sys.executable, "-c", TINY_SHM]))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok")


@needs_root
def test_pipeline_run_on_a_full_dev_shm_says_so_in_one_line(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "omnisim.cli", "pipeline", "run", "--text", "hello there, a full store"]
    proc = _in_tiny_shm("\0".join([*argv, "--out", str(tmp_path / "out.wav")]), size="8k", inodes=400)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "/dev/shm is full" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
