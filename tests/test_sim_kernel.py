"""SimKernel on its own: small hand-written tasks, no adapter (DESIGN "The kernel seam",
"Determinism contract").

Every world here is an ``async def main()`` run with ``kernel.run(main)``; ``main`` and the tasks
it spawns use only the kernel interface (``current_kernel()``): points, sleep, locks, signals and
task groups.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio

from omnisim.faults import FAULT_KINDS, Fault, FaultPlan, InjectedStoreError, UnknownFaultError
from omnisim.sim_kernel import SimKernel, SimOutcome
from omnisim.strategies.ordered import ConstraintError, OrderedStrategy, parse_chain
from omnisim.strategies.random import RandomStrategy
from omnisim.strategies.replay import ReplayStrategy
from runtime.connectors.shm import ShmConnector
from runtime.connectors.stores import MemoryStore
from runtime.kernel import current_kernel

REPO_ROOT = Path(__file__).resolve().parent.parent

Job = Callable[[], Awaitable[object]]


def sim(seed: int = 0, **kw: object) -> SimKernel:
    return SimKernel(RandomStrategy(seed), **kw)  # type: ignore[arg-type]


def spawn(*jobs: tuple[str, Job]) -> Job:
    """A ``main`` that runs the named jobs as concurrent kernel tasks."""

    async def main() -> None:
        async with current_kernel().task_group() as tasks:
            for name, job in jobs:
                tasks.start_soon(job, name=name)

    return main


def events(out: SimOutcome, name: str | None = None) -> list[tuple[str, str, dict[str, object]]]:
    return [(e.task, e.name, dict(e.attrs)) for e in out.trace if name is None or e.name == name]


def index_of(out: SimOutcome, name: str) -> int:
    return next(e.index for e in out.trace if e.name == name)


# -- one logical task at a time ----------------------------------------------------------------


def sections_world(log: list[tuple[str, int, str]], sections: int = 4) -> Job:
    """Two workers; each section is bracketed by a point and contains trio checkpoints (which,
    under plain trio, would let the other worker run) but no kernel point."""

    def worker(name: str) -> Job:
        async def run() -> None:
            k = current_kernel()
            for i in range(sections):
                await k.point("w.section", who=name, i=i)
                log.append((name, i, "start"))
                await trio.sleep(0)  # a real trio checkpoint, not a scheduling decision
                await trio.lowlevel.checkpoint()
                log.append((name, i, "end"))

        return run

    return spawn(("A", worker("A")), ("B", worker("B")))


def test_one_logical_task_runs_between_points() -> None:
    interleaved = 0
    for seed in range(12):
        log: list[tuple[str, int, str]] = []
        out = sim(seed).run(sections_world(log))
        assert out.stop_reason is None and out.crashes == []
        assert len(log) == 16
        # Every section runs start..end without another task in between.
        for j in range(0, len(log), 2):
            (who, i, a), (who2, i2, b) = log[j], log[j + 1]
            assert (who, i, a, b) == (who2, i2, "start", "end"), log
        order = [who for who, _, phase in log if phase == "start"]
        interleaved += order != sorted(order)
    # The points really are scheduling decisions: some seed switches between the workers.
    assert interleaved > 0


def test_point_is_a_trace_event_with_its_attributes() -> None:
    async def main() -> None:
        k = current_kernel()
        await k.point("p.x", key="R_1_0", n=3, flag=True, none=None)
        k.note("n.y", req="R")

    out = sim().run(main)
    assert events(out) == [
        ("main", "p.x", {"key": "R_1_0", "n": 3, "flag": True, "none": None}),
        ("main", "n.y", {"req": "R"}),
    ]
    canonical = '{"a":{"flag":true,"key":"R_1_0","n":3,"none":null},"ev":"p.x","i":0,"t":0,"task":"main"}'
    assert out.trace_lines()[0] == canonical


# -- determinism -------------------------------------------------------------------------------


def busy_world() -> Job:
    def worker(name: str, n: int) -> Job:
        async def run() -> None:
            k = current_kernel()
            for i in range(n):
                await k.point("w.step", who=name, i=i)
                if i % 3 == 2:
                    await k.sleep(0.001 * (i + 1))

        return run

    return spawn(*[(f"w{j}", worker(f"w{j}", 6 + j)) for j in range(3)])


def test_a_fault_of_a_scenario_has_a_name_of_its_own() -> None:
    # "fault" events are the fault plan's, each replayed by the shrinker as a fault of the plan: a
    # scenario's own "fault" note among them made the shrinker's count disagree with the plan's.
    async def main() -> None:
        current_kernel().note("fault.os", at="unlink", errno="EIO")
        current_kernel().note("fault", kind="os_error")

    out = sim(0).run(main)
    assert ("main", "fault.os", {"at": "unlink", "errno": "EIO"}) in events(out)
    assert events(out, "fault") == []
    ((_, tb),) = out.crashes
    assert '"fault" is the fault plan' in tb


def test_same_seed_same_trace_and_choices() -> None:
    a = sim(7).run(busy_world())
    b = sim(7).run(busy_world())
    assert a.stop_reason is None and b.stop_reason is None
    assert a.choices, "the world must give the strategy real choices"
    assert a.trace_lines() == b.trace_lines()
    assert a.choices == b.choices
    assert a.steps == b.steps


def test_different_seeds_eventually_differ() -> None:
    traces = {tuple(sim(seed).run(busy_world()).trace_lines()) for seed in range(10)}
    assert len(traces) > 1


# -- virtual time ------------------------------------------------------------------------------


def test_sleep_is_virtual() -> None:
    seen: list[float] = []

    async def main() -> None:
        k = current_kernel()
        seen.append(k.now())
        await k.sleep(5)
        seen.append(k.now())

    start = time.perf_counter()
    out = sim().run(main)
    wall = time.perf_counter() - start
    assert seen == [0.0, 5.0]
    assert out.virtual_time_s == 5.0
    assert wall < 5.0  # a real 5 s sleep could not finish sooner


def test_sleepers_wake_in_virtual_time_order() -> None:
    woke: list[tuple[str, float]] = []

    def sleeper(name: str, seconds: float) -> Job:
        async def run() -> None:
            k = current_kernel()
            await k.sleep(seconds)
            woke.append((name, k.now()))

        return run

    out = sim(3).run(spawn(("late", sleeper("late", 5)), ("early", sleeper("early", 2)), ("mid", sleeper("mid", 3.5))))
    assert out.stop_reason is None
    assert woke == [("early", 2.0), ("mid", 3.5), ("late", 5.0)]


def test_signal_wait_times_out_in_virtual_time_and_notify_wakes() -> None:
    results: list[tuple[str, bool, float]] = []

    async def main() -> None:
        k = current_kernel()
        sig = k.signal("s")
        results.append(("timeout", await sig.wait(0.25), k.now()))

        async def waiter() -> None:
            results.append(("notified", await sig.wait(10), k.now()))

        async def notifier() -> None:
            await k.sleep(1)
            sig.notify()

        async with k.task_group() as tasks:
            tasks.start_soon(waiter, name="waiter")
            tasks.start_soon(notifier, name="notifier")

    out = sim().run(main)
    assert out.stop_reason is None
    assert results == [("timeout", False, 0.25), ("notified", True, 1.25)]


def test_a_wait_that_times_out_with_what_it_waits_for_there_is_marked_missed() -> None:
    async def main() -> None:
        k = current_kernel()
        sig = k.signal("s")
        work: list[int] = []
        await sig.wait(0.5, ready=lambda: bool(work))  # nothing came: an idle timeout
        work.append(1)  # the state changes and nobody notifies
        await sig.wait(0.5, ready=lambda: bool(work))

        async def notifier() -> None:
            work.append(2)
            sig.notify()

        async with k.task_group() as tasks:
            tasks.start_soon(notifier, name="notifier")
            await sig.wait(0.5, ready=lambda: True)  # notified: no timeout at all

    out = sim().run(main)
    assert out.stop_reason is None
    timeouts = [e.attrs for e in out.trace if e.name == "kernel.timeout"]
    assert timeouts == [{"on": "signal:s"}, {"on": "signal:s", "missed": True}]


def test_a_descriptor_wait_wakes_when_another_task_writes_and_times_out_otherwise() -> None:
    """The FIFO wakeups across processes wait on a descriptor: the simulator wakes the waiter at
    the first step its descriptor is readable, and a timeout while what it waits for is there is
    marked missed, as for a signal."""
    results: list[tuple[str, bool, float]] = []
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)

    async def main() -> None:
        k = current_kernel()
        results.append(("idle", await k.wait_readable(read_fd, 0.25, name="wakeup.2"), k.now()))
        results.append(("missed", await k.wait_readable(read_fd, 0.25, name="wakeup.2", ready=lambda: True), k.now()))

        async def writer() -> None:
            await k.sleep(1)
            os.write(write_fd, b"\0")

        async def waiter() -> None:
            results.append(("written", await k.wait_readable(read_fd, 10, name="wakeup.2"), k.now()))

        async with k.task_group() as tasks:
            tasks.start_soon(waiter, name="waiter")
            tasks.start_soon(writer, name="writer")
        results.append(("still readable", await k.wait_readable(read_fd, 10, name="wakeup.2"), k.now()))

    try:
        out = sim().run(main)
    finally:
        os.close(read_fd)
        os.close(write_fd)
    assert out.stop_reason is None
    assert results == [
        ("idle", False, 0.25),
        ("missed", False, 0.5),
        ("written", True, 1.5),
        ("still readable", True, 1.5),
    ]
    assert [e.attrs for e in out.trace if e.name == "kernel.timeout"] == [
        {"on": "readable:wakeup.2"},
        {"on": "readable:wakeup.2", "missed": True},
    ]


# -- stops: deadlock, horizon, crash -----------------------------------------------------------


def lock_order_world() -> Job:
    async def main() -> None:
        k = current_kernel()
        la, lb = k.lock("la"), k.lock("lb")

        def worker(name: str, first: object, second: object) -> Job:
            async def run() -> None:
                async with first:  # type: ignore[attr-defined]
                    await k.point(f"{name}.hold")
                    await k.point(f"{name}.next")
                    async with second:  # type: ignore[attr-defined]
                        await k.point(f"{name}.both")

            return run

        async with k.task_group() as tasks:
            tasks.start_soon(worker("A", la, lb), name="A")
            tasks.start_soon(worker("B", lb, la), name="B")

    return main


def test_lock_order_inversion_is_reported_as_deadlock() -> None:
    # Both hold their first lock before either asks for its second one.
    strategy = OrderedStrategy(0, ["A.hold < B.hold < A.next", "B.hold < B.next"])
    out = SimKernel(strategy).run(lock_order_world())
    assert out.stop_reason == "deadlock"
    stopped = {t.name: t for t in out.stopped_tasks}
    assert {"A", "B"} <= set(stopped)
    assert stopped["A"].state == "blocked" and "lock lb held by B" in stopped["A"].waiting_for
    assert stopped["B"].state == "blocked" and "lock la held by A" in stopped["B"].waiting_for
    assert out.crashes == []
    assert not [e for e in out.trace if e.name.endswith(".both")]


def test_lock_excludes_and_hands_over() -> None:
    inside: list[str] = []
    overlaps: list[str] = []

    async def main() -> None:
        k = current_kernel()
        lock = k.lock("l")

        def worker(name: str) -> Job:
            async def run() -> None:
                for _ in range(3):
                    await k.point("w.try", who=name)
                    async with lock:
                        if inside:
                            overlaps.append(name)
                        inside.append(name)
                        await k.point("w.inside", who=name)
                        inside.remove(name)

            return run

        async with k.task_group() as tasks:
            for name in ("A", "B", "C"):
                tasks.start_soon(worker(name), name=name)

    blocked = 0
    for seed in range(8):
        out = sim(seed).run(main)
        assert out.stop_reason is None, out.detail
        assert len([e for e in out.trace if e.name == "w.inside"]) == 9
        blocked += any(e.name == "kernel.block" for e in out.trace)
    assert overlaps == []
    assert blocked > 0  # the lock was contended in some schedule


def test_sleeping_past_the_horizon_is_reported() -> None:
    async def sleepy() -> None:
        await current_kernel().sleep(100)

    out = sim(horizon_s=10).run(spawn(("sleepy", sleepy)))
    assert out.stop_reason == "horizon"
    stopped = {t.name: t for t in out.stopped_tasks}
    assert stopped["sleepy"].state == "sleeping"
    assert out.virtual_time_s <= 10


def test_crashing_task_is_recorded_and_the_others_finish() -> None:
    done: list[str] = []

    async def crasher() -> None:
        await current_kernel().point("c.1")
        raise ValueError("boom")

    async def worker() -> None:
        k = current_kernel()
        for i in range(3):
            await k.point("w.step", i=i)
        done.append("worker")

    out = sim(1).run(spawn(("crasher", crasher), ("worker", worker)))
    assert out.stop_reason is None
    assert done == ["worker"]
    assert len(out.crashes) == 1
    name, tb = out.crashes[0]
    assert name == "crasher"
    assert "ValueError: boom" in tb
    assert ("crasher", "kernel.crash", {"error": "ValueError"}) in events(out)


def test_step_limit_stops_a_livelock() -> None:
    async def spinner() -> None:
        k = current_kernel()
        while True:
            await k.point("spin")

    out = sim(max_steps=50).run(spawn(("a", spinner), ("b", spinner)))
    assert out.stop_reason == "step-limit"
    assert {t.name for t in out.stopped_tasks} >= {"a", "b"}


_BODY_RAISES = """
from omnisim.sim_kernel import SimKernel
from omnisim.strategies.random import RandomStrategy
from runtime.kernel import current_kernel

async def child():
    await current_kernel().point("c.1")

async def main():
    k = current_kernel()
    async with k.task_group() as tasks:
        tasks.start_soon(child, name="child1")
        tasks.start_soon(child, name="child2")
        await k.point("m.1")
        raise ValueError("boom in body")

out = SimKernel(RandomStrategy(0)).run(main)
print("CRASHES", [name for name, _ in out.crashes])
"""


def test_exception_out_of_a_task_group_body_is_a_crash() -> None:
    # In a subprocess: the failure is a TrioInternalError that leaves trio's state in pieces.
    proc = subprocess.run(
        [sys.executable, "-c", _BODY_RAISES], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT
    )
    assert proc.returncode == 0, proc.stderr.strip().splitlines()[-1:]
    assert "CRASHES ['main']" in proc.stdout


# -- ordered strategy --------------------------------------------------------------------------


def order_world() -> Job:
    async def early() -> None:
        await current_kernel().point("p.b")

    async def late() -> None:
        k = current_kernel()
        await k.point("x.1")
        await k.point("x.2")
        await k.point("p.a")

    return spawn(("early", early), ("late", late))


def test_ordered_constraint_holds_back_the_later_event() -> None:
    for seed in range(10):
        out = SimKernel(OrderedStrategy(seed, ["p.a < p.b"])).run(order_world())
        assert out.stop_reason is None
        assert out.unsatisfied == []
        assert index_of(out, "p.a") < index_of(out, "p.b")
    # Without the constraint, some schedule lets p.b go first.
    assert any(
        index_of(out, "p.b") < index_of(out, "p.a") for out in (sim(seed).run(order_world()) for seed in range(10))
    )


def test_ordered_attribute_patterns() -> None:
    async def worker(name: str) -> None:
        k = current_kernel()
        for i in range(3):
            await k.point("w", who=name, i=i)

    constraint = "w[who=B,i=2] < w[who=A,i=0]"
    out = SimKernel(OrderedStrategy(5, [constraint])).run(spawn(("A", lambda: worker("A")), ("B", lambda: worker("B"))))
    assert out.unsatisfied == []
    seq = [(e.attrs["who"], e.attrs["i"]) for e in out.trace if e.name == "w"]
    assert seq.index(("B", 2)) < seq.index(("A", 0))


def test_order_that_cannot_start_is_unsatisfiable_not_a_hang() -> None:
    out = SimKernel(OrderedStrategy(0, ["never.happens < p.b"])).run(order_world())
    assert out.stop_reason == "unsatisfiable"
    assert out.unsatisfied and "never.happens" in out.unsatisfied[0]
    assert "p.b" not in [e.name for e in out.trace]
    assert "early" in {t.name for t in out.stopped_tasks}


def test_order_held_back_past_the_horizon_is_unsatisfiable() -> None:
    """A background loop keeps time moving; the held-back task is reported at the horizon."""

    async def poller() -> None:
        k = current_kernel()
        while True:
            await k.point("poll")
            await k.sleep(0.5)

    async def held() -> None:
        await current_kernel().point("p.b")

    out = SimKernel(OrderedStrategy(0, ["never.happens < p.b"]), horizon_s=5).run(
        spawn(("poller", poller), ("held", held))
    )
    assert out.stop_reason == "unsatisfiable"
    assert "held at p.b" in out.detail
    assert out.unsatisfied


def test_constraint_parse_errors() -> None:
    for bad in ("a", "", "a < ", "a b < c", "a[k] < b", "a[=v] < b", "a[k=v < b"):
        with pytest.raises(ConstraintError):
            OrderedStrategy(0, [bad])
    chain = parse_chain(" shm.put.created[key=R_1_0, via=ring] < orch.abort.end ")
    assert [str(p) for p in chain] == ["shm.put.created[key=R_1_0,via=ring]", "orch.abort.end"]
    assert chain[0].matches("shm.put.created", {"key": "R_1_0", "via": "ring"})
    assert not chain[0].matches("shm.put.created", {"key": "R_1_0"})
    with pytest.raises(ConstraintError, match="has no attribute 'n': it carries key"):
        parse_chain("shm.put.begin[key=R_1_0, n=2] < orch.abort.end")  # (it could never match)


# -- replay ------------------------------------------------------------------------------------


def test_replay_follows_a_recorded_choice_list() -> None:
    recorded = sim(11).run(busy_world())
    assert recorded.choices
    strategy = ReplayStrategy(list(recorded.choices), [(e.task, e.name) for e in recorded.trace])
    again = SimKernel(strategy).run(busy_world())
    assert again.trace_lines() == recorded.trace_lines()
    assert again.choices == recorded.choices
    assert strategy.diverged_at is None


def test_replay_reports_where_the_choices_stop_fitting() -> None:
    recorded = sim(11).run(busy_world())
    choices = list(recorded.choices)
    choices[2] = 10_000  # no such task
    strategy = ReplayStrategy(choices, [(e.task, e.name) for e in recorded.trace])
    out = SimKernel(strategy).run(busy_world())
    assert out.stop_reason is None
    assert strategy.diverged_at == 2


# -- faults ------------------------------------------------------------------------------------


def test_put_fail_fault_fires_on_the_first_matching_point_only() -> None:
    raised: list[tuple[str, str]] = []

    async def main() -> None:
        k = current_kernel()
        for key, point in [
            ("other", "shm.put.begin"),
            ("k", "shm.put.locked"),
            ("k", "shm.put.begin"),
            ("k", "shm.put.begin"),
        ]:
            try:
                await k.point(point, key=key)
            except InjectedStoreError:
                raised.append((point, key))

    plan = FaultPlan([Fault("put_fail", match={"key": "k"})])
    out = SimKernel(RandomStrategy(0), faults=plan).run(main)
    assert raised == [("shm.put.begin", "k")]
    assert events(out, "fault") == [("main", "fault", {"kind": "put_fail", "at": "shm.put.begin", "key": "k"})]
    assert plan.faults[0].hits == 2


def test_put_fail_fault_through_the_connector() -> None:
    store = MemoryStore()
    results: list[bool] = []

    async def main() -> None:
        conn = ShmConnector(store, stage_id=1)
        for key in ("other", "k", "k"):
            results.append((await conn.put("1", "2", key, {"x": 1})).ok)

    out = SimKernel(RandomStrategy(0), faults=FaultPlan([Fault("put_fail", match={"key": "k"})])).run(main)
    assert results == [True, False, True]
    assert out.crashes == []
    assert ("main", "shm.put.failed", {"key": "k", "error": "InjectedStoreError"}) in events(out)
    assert store.segments() == ["k", "other"]


def test_fault_nth_hit_and_point_table() -> None:
    plan = FaultPlan([Fault("decode_fail", nth=2)])
    assert plan.fire("shm.get.consumed", {"key": "a"}) is None
    fired = plan.fire("shm.get.consumed", {"key": "b"})
    assert fired is not None and fired.kind == "decode_fail"
    assert plan.fire("shm.get.consumed", {"key": "c"}) is None
    assert {kind: point for kind, (point, _) in FAULT_KINDS.items()} == {
        "put_fail": "shm.put.begin",
        "store_full": "shm.put.locked",
        "put_raise_after_create": "shm.put.written",
        "decode_fail": "shm.get.consumed",
        "get_raise": "shm.get.begin",
        "cleanup_raise": "shm.cleanup.begin",
        "enospc_inodes": "shm.put.begin",
        "reserve_full": "shm.put.created",
        "foreign_name": "shm.put.locked",
        "crash_writer": "shm.put.written",
        "crash_reader": "shm.get.locked",
        "stall": "shm.get.locked",
        "corrupt_bytes": "shm.put.committed",
        "forged_frame": "shm.put.committed",
        "crash_stage": "shm.put.begin",
        "pause_stage": "shm.put.written",
    }
    assert Fault("crash_writer", at="shm.put.created").point == "shm.put.created"


def test_unknown_fault_kind() -> None:
    with pytest.raises(UnknownFaultError, match="nope"):
        Fault("nope")


#: A self-contained world (it imports no torch, so a fresh interpreter runs it in a blink).
_DIGEST = """
import hashlib
from omnisim.sim_kernel import SimKernel
from omnisim.strategies.random import RandomStrategy
from runtime.kernel import current_kernel

async def main():
    k = current_kernel()

    async def worker(name, n):
        for i in range(n):
            await k.point("w.step", who=name, i=i)
            if i % 3 == 2:
                await k.sleep(0.001 * (i + 1))

    async with k.task_group() as tasks:
        for j in range(3):
            tasks.start_soon(lambda j=j: worker(f"w{j}", 6 + j), name=f"w{j}")

out = SimKernel(RandomStrategy(7)).run(main)
assert out.choices and out.stop_reason is None
DIGEST = hashlib.sha256("\\n".join(out.trace_lines()).encode()).hexdigest()
if __name__ == "__main__":
    print(DIGEST)
"""


def test_trace_is_identical_across_processes_and_hash_seeds() -> None:
    digests = set()
    for hash_seed in ("1", "2"):
        proc = subprocess.run(
            [sys.executable, "-c", _DIGEST],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
        )
        assert proc.returncode == 0, proc.stderr
        digests.add(proc.stdout.strip())
    here: dict[str, object] = {"__name__": "digest"}
    exec(_DIGEST, here)
    assert digests == {here["DIGEST"]}


# == processes: SIGKILL and SIGSTOP of a group of tasks =====================================================


def test_a_killed_process_stops_its_tasks_and_the_others_go_on() -> None:
    """Issue 10: the process is killed before one of its tasks ever ran; the group that started
    them must still end (a PCT schedule of ``stage_crash`` once hung here)."""
    ran: list[str] = []

    async def main() -> None:
        k = current_kernel()
        assert isinstance(k, SimKernel)

        async def worker(name: str) -> None:
            for _ in range(2):
                await k.point("work", who=name)
            ran.append(name)

        async with k.task_group() as tasks:
            with k.as_process("victim"):
                tasks.start_soon(lambda: worker("victim.a"), name="victim.a")
                tasks.start_soon(lambda: worker("victim.b"), name="victim.b")
            tasks.start_soon(lambda: worker("survivor"), name="survivor")
            await k.point("spawned")
            k.kill_process("victim")  # with some seeds, before a victim task ever ran
            with k.as_process("victim"):
                tasks.start_soon(lambda: worker("victim.c"), name="victim.c")  # a dead process starts nothing

    for seed in range(20):
        ran.clear()
        out = sim(seed).run(main)
        assert out.stop_reason is None, out.detail
        assert "survivor" in ran and "victim.c" not in ran
        assert [e[2] for e in events(out, "process.killed")] == [{"process": "victim"}]


def test_a_paused_process_runs_nothing_until_it_continues() -> None:
    times: dict[str, float] = {}

    async def main() -> None:
        k = current_kernel()
        assert isinstance(k, SimKernel)

        async def worker(name: str) -> None:
            await k.point("work", who=name)
            times[name] = k.now()

        async with k.task_group() as tasks:
            with k.as_process("sleeper"):
                tasks.start_soon(lambda: worker("sleeper"), name="sleeper")
            tasks.start_soon(lambda: worker("awake"), name="awake")
            k.pause_process("sleeper", 2.0)

    out = sim(0).run(main)
    assert out.stop_reason is None, out.detail
    assert times == {"awake": 0.0, "sleeper": 2.0}


def test_a_hypothesis_schedule_can_choose_every_runnable_task() -> None:
    """Issue 11: with choices drawn from 0..7, the 9th and later runnable tasks (scenarios have up
    to 13) could never be chosen."""
    from types import SimpleNamespace

    from hypothesis import find

    from omnisim.strategies.hypothesis import CHOICE, HypothesisStrategy

    tasks = [SimpleNamespace(tid=i) for i in range(13)]
    assert find(CHOICE, lambda c: c >= len(tasks) - 1) >= len(tasks) - 1
    chosen = {HypothesisStrategy([c]).choose(tasks).tid for c in range(32)}  # type: ignore[arg-type]
    assert chosen == set(range(13))
    # 0 is the default: the running task goes on; 1 is the first other task.
    running = HypothesisStrategy([0, 1])
    running.current = tasks[5]  # type: ignore[assignment]
    assert running.choose(tasks).tid == 5 and running.choose(tasks).tid == 0  # type: ignore[arg-type]


def test_a_process_paused_by_a_fault_stops_at_the_point_that_fired_it() -> None:
    """``pause_stage`` is a SIGSTOP where it fires: nothing after that point runs until the
    process is continued (it used to run on to its next point first)."""
    seen: list[tuple[float, bool]] = []
    committed = [False]
    kernel = sim(0, faults=FaultPlan([Fault("pause_stage")]))
    kernel.fault_action = lambda fault, task, attrs: kernel.pause_process(task.process, 3.0)

    async def writer() -> None:
        await kernel.point("shm.put.written", key="K")
        committed[0] = True
        await kernel.point("shm.put.committed", key="K")

    async def reader() -> None:
        await kernel.sleep(0.5)  # inside the pause
        seen.append((kernel.now(), committed[0]))

    async def main() -> None:
        async with kernel.task_group() as tasks:
            with kernel.as_process("stage"):
                tasks.start_soon(writer, name="writer")
            tasks.start_soon(reader, name="reader")

    out = kernel.run(main)
    assert out.stop_reason is None, out.detail
    assert seen == [(0.5, False)] and committed[0]


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_a_negative_or_nan_wait_is_the_callers_value_error_as_in_trio(bad: float) -> None:
    raised: list[str] = []

    async def main() -> None:
        k = current_kernel()
        for wait in (lambda: k.sleep(bad), lambda: k.signal("s").wait(bad)):
            try:
                await wait()
            except ValueError as e:
                raised.append(str(e))

    out = sim().run(main)
    assert out.stop_reason is None and len(raised) == 2, (out.detail, raised)


def test_an_infinite_wait_waits_for_good() -> None:
    woke: list[bool] = []
    signals: dict[str, object] = {}

    async def waiter() -> None:
        signal = signals.setdefault("s", current_kernel().signal("s"))
        woke.append(await signal.wait(float("inf")))  # type: ignore[attr-defined]

    async def notifier() -> None:
        await current_kernel().sleep(3600)
        signals["s"].notify()  # type: ignore[attr-defined]

    out = sim(horizon_s=7200).run(spawn(("waiter", waiter), ("notifier", notifier)))
    assert out.stop_reason is None, out.detail
    assert woke == [True]


def test_a_wait_for_a_task_groups_children_is_said_as_a_wait() -> None:
    async def main() -> None:
        k = current_kernel()
        async with k.task_group() as tasks:
            tasks.start_soon(lambda: k.sleep(1), name="child")

    out = sim().run(main)
    assert ("main", "kernel.block", {"on": "task group"}) in events(out, "kernel.block")


def test_sleep_0_yields_to_the_tasks_ready_now_not_to_everything() -> None:
    """As trio's ``sleep(0)``: the task goes behind the tasks that are ready at that moment — each
    of them runs a step before it does — and then it is a candidate like any other, so its next
    step may land between another task's points (a stage's loop sleeps 0 after every step)."""
    ran: list[str] = []

    async def yielder() -> None:
        ran.append("y.slept")
        await current_kernel().sleep(0)
        ran.append("y.woke")

    async def worker() -> None:
        for i in range(6):
            ran.append(f"w.{i}")
            await current_kernel().point("w")

    landed_between = False
    for seed in range(20):
        ran.clear()
        out = sim(seed).run(spawn(("yielder", yielder), ("worker", worker)))
        assert out.stop_reason is None, out.detail
        slept = ran.index("y.slept")
        if "w.5" not in ran[:slept]:
            assert ran[slept + 1].startswith("w."), ran  # the worker was ready: it goes first
        landed_between |= ran.index("y.woke") < ran.index("w.5")
    assert landed_between
