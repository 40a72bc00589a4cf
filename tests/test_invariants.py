"""Every checker can fail: on a hand-made world, and in a real run of a mutant that declares it.

A checker that cannot fail proves nothing; these tests are what keeps one from slipping in."""

from __future__ import annotations

import logging
import os
import struct
import sysconfig

import pytest
import torch

import runtime
from invariants import INVARIANTS, Violation, check
from invariants.dataplane import RING_HEADER, ring_room
from invariants.observed import ObservedWorld, Stream, TraceEvent
from omnisim import registry
from omnisim.answers import Answers
from omnisim.explore import explore
from omnisim.ring_locks import RingLocks
from omnisim.sim_kernel import SimKernel
from omnisim.strategies.random import RandomStrategy
from runtime.connectors.base import CorruptChunk
from runtime.connectors.keys import InvalidKeyError
from runtime.connectors.shm import ShmConnector
from runtime.connectors.stores import ForeignName, MemoryStore, RingMemory, Segment, SegmentId
from runtime.connectors.wire import EncodedFrame

registry.load()
logging.getLogger("runtime").setLevel(logging.CRITICAL)

#: Invariants no mutant may declare: an exception in the runtime is what a broken mutant causes.
UNDECLARABLE = {"no-crash"}


def world_of(*events: tuple[str, dict[str, object]], crashes: tuple[tuple[str, str], ...] = ()) -> ObservedWorld:
    trace = [TraceEvent(i, 0, "main", name, attrs) for i, (name, attrs) in enumerate(events)]  # type: ignore[arg-type]
    return ObservedWorld(trace=trace, snapshots=[], streams={}, crashes=list(crashes))


def test_config_contract_compares_each_fact_with_the_spec() -> None:
    held = world_of(("config.fact", {"fact": "async_chunk of (True, False)", "got": "False", "want": "False"}))
    assert INVARIANTS["config-contract"].check(held) == []
    broken = world_of(("config.fact", {"fact": "async_chunk of (True, False)", "got": "True", "want": "False"}))
    assert INVARIANTS["config-contract"].check(broken) == ["async_chunk of (True, False): got True, spec §1 says False"]


def test_abort_stops_work_allows_the_step_in_flight_only() -> None:
    def sent(n: int) -> list[tuple[str, dict[str, object]]]:
        return [("adapter.save_async", {"ext": "L", "req": "L#0"})] * n

    for ended in ("orch.abort.begin", "orch.fail", "client.left"):  # (a client gone is an abort)
        assert INVARIANTS["abort-stops-work"].check(world_of((ended, {"req": "L"}), *sent(1))) == []
        assert INVARIANTS["abort-stops-work"].check(world_of((ended, {"req": "L"}), *sent(2))) == [
            "main kept working on L#0 after its request ended (a second chunk at event 2)"
        ]
    assert INVARIANTS["abort-stops-work"].check(world_of(*sent(3))) == []  # (a request that runs on)
    # A stage process is told by a message: what it sent before it was told is not held against it.
    told = ("sched.abort", {"stage": 0, "req": "L#0"})
    ended = ("orch.abort.begin", {"req": "L"})
    assert INVARIANTS["abort-stops-work"].check(world_of(ended, *sent(3), told, *sent(1))) == []
    assert INVARIANTS["abort-stops-work"].check(world_of(ended, *sent(3), told, *sent(2))) == [
        "main kept working on L#0 after its request ended (a second chunk at event 6)"
    ]


def test_restarts_back_off_in_a_new_namespace() -> None:
    def lives(*steps: tuple[str, int, str]) -> ObservedWorld:
        trace = [TraceEvent(i, us, "main", name, {"stage": 1, "ns": ns}) for i, (name, us, ns) in enumerate(steps)]
        return ObservedWorld(trace=trace, snapshots=[], streams={}, crashes=[])

    check = INVARIANTS["restarts-back-off"].check
    died_twice = [("stage.life", 0, "a"), ("stage.died", 1, "a"), ("stage.buried", 1, "a")]
    died_twice += [("stage.life", 100_001, "b"), ("stage.died", 200_000, "b"), ("stage.buried", 200_000, "b")]
    assert check(lives(*died_twice, ("stage.life", 400_000, "c"))) == []  # 0.1 s, then 0.2 s
    assert check(lives(*died_twice, ("stage.life", 300_000, "c"))) == [
        "stage 1 restarted 0.1s after its dead life's burial, not 0.2s"
    ]
    assert check(lives(*died_twice[:3], ("stage.life", 100_001, "a"))) == [
        "stage 1 started a new life in a, where an earlier life wrote"
    ]
    stable = [("stage.life", 0, "a"), ("stage.died", 10_000_000, "a"), ("stage.buried", 10_000_000, "a")]
    assert check(lives(*stable, ("stage.life", 10_100_000, "b"))) == []  # a life of 10 s: back to 0.1 s


def test_fault_isolation_gives_a_stage_up_only_once_its_process_died_or_stopped() -> None:
    life = ("stage.life", {"stage": 1, "ns": "ns2"})
    died = ("stage.died", {"stage": 1, "reason": "its process exited"})
    check = INVARIANTS["fault-isolation"].check
    for struck in ("process.killed", "process.paused"):
        assert check(world_of(life, (struck, {"process": "stage1.talker.0"}), died)) == []
    assert check(world_of(life, ("process.killed", {"process": "stage2.code2wav.0"}), died)) == [
        "stage 1 was given up on (its process exited) though its process neither died nor stopped"
    ]
    # (a kill of its earlier life explains none of the next life's deaths)
    again = ("stage.life", {"stage": 1, "ns": "ns4"})
    assert check(world_of(life, ("process.killed", {"process": "stage1.talker.0"}), died, again, died)) == [
        "stage 1 was given up on (its process exited) though its process neither died nor stopped"
    ]


def test_max_num_seqs_kept_counts_each_step() -> None:
    check = INVARIANTS["max-num-seqs-kept"].check
    assert check(world_of(("sched.batch", {"stage": 2, "size": 2, "max": 2}))) == []
    assert check(world_of(("sched.batch", {"stage": 2, "size": 3, "max": 2}))) == [
        "a step of stage 2 ran 3 requests; its max_num_seqs is 2"
    ]


def test_bad_input_refused_compares_each_case_with_what_it_must_give() -> None:
    held = world_of(
        ("input.case", {"what": "a put under the key 'a/b'", "got": "InvalidKeyError", "want": "InvalidKeyError"})
    )
    assert INVARIANTS["bad-input-refused"].check(held) == []
    broken = world_of(("input.case", {"what": "a put under the key 'a/b'", "got": "ok", "want": "InvalidKeyError"}))
    assert INVARIANTS["bad-input-refused"].check(broken) == [
        "a put under the key 'a/b': got ok, must give InvalidKeyError"
    ]


def test_full_store_clean_compares_each_case_with_what_it_must_give() -> None:
    held = world_of(("room.case", {"what": "the in-step put of F_1_3", "got": "round trip", "want": "round trip"}))
    assert INVARIANTS["full-store-clean"].check(held) == []
    broken = world_of(
        ("room.case", {"what": "the in-step put of F_1_3", "got": "/dev/shm is full", "want": "round trip"})
    )
    assert INVARIANTS["full-store-clean"].check(broken) == [
        "the in-step put of F_1_3: got /dev/shm is full, must give round trip"
    ]


def test_answers_true_compares_each_answer_with_what_the_connector_did() -> None:
    assert INVARIANTS["answers-true"].check(world_of()) == []  # only an answer that differs is noted
    answer = {"what": "the cleanup of R_0_1", "got": "removed: True", "want": "removed: False"}
    broken = world_of(("connector.answer", answer))
    assert INVARIANTS["answers-true"].check(broken) == [
        "the cleanup of R_0_1: answered removed: True, did removed: False"
    ]


def test_sweep_reports_true_compares_each_part_of_a_report_with_what_it_must_say() -> None:
    held = world_of(("sweep.case", {"what": "the sweep's live", "got": "['live']", "want": "['live']"}))
    assert INVARIANTS["sweep-reports-true"].check(held) == []
    broken = world_of(("sweep.case", {"what": "the sweep's foreign", "got": "[]", "want": "['omnisim-a-seg-x']"}))
    assert INVARIANTS["sweep-reports-true"].check(broken) == [
        "the sweep's foreign: [], where it must be ['omnisim-a-seg-x']"
    ]


def test_ring_writes_locked_flags_a_head_or_tail_moved_without_the_lock() -> None:
    assert INVARIANTS["ring-writes-locked"].check(world_of()) == []
    moved = {"edge": "edge_1_2", "when": "taken", "left": "(128, 64)", "found": "(192, 64)"}
    assert INVARIANTS["ring-writes-locked"].check(world_of(("ring.unlocked_write", moved))) == [
        "the edge_1_2 ring's head and tail were (192, 64) when its lock was taken, though its last holder left "
        "them at (128, 64)"
    ]


def test_ring_locks_see_a_head_moved_while_a_reader_held_the_lock() -> None:
    """A writer that goes on without the lock while a reader holds it moves the head inside the
    reader's hold: only the reader's let-go can tell, since a reader never reserves."""
    store = MemoryStore()
    locks = RingLocks()
    locks.watch(store)
    producer = store.create_ring("edge_1_2", 1024)
    reader = store.open_ring("edge_1_2")
    assert reader is not None

    def move(handle: RingMemory, head: int) -> None:
        struct.pack_into("<Q", handle.view, 16, head)

    async def main() -> None:
        assert reader.try_lock()
        reader.unlock()  # a reader's hold that leaves the head where it was: nothing to note
        assert reader.try_lock()
        assert not producer.try_lock()
        assert locks.held(producer)  # (what a put that found the lock held may say)
        move(producer, 128)  # the producer reserves without the lock, the reader holding it
        reader.unlock()
        assert not locks.held(producer)

    out = SimKernel(RandomStrategy(0)).run(main)
    notes = [dict(e.attrs) for e in out.trace if e.name == "ring.unlocked_write"]
    assert notes == [
        {
            "edge": "edge_1_2",
            "when": "let go by a reader (which never moves the head)",
            "left": "(0, 0)",
            "found": "(128, 0)",
        }
    ]
    producer.close()
    reader.close()


def test_answers_note_a_put_or_get_that_raises_what_its_contract_never_raises() -> None:
    """The adapter turns any exception out of a put into a failed request, so a slip that
    crashes mid-put would pass for a storage failure: the answer says it did not."""
    store = MemoryStore()
    connector = ShmConnector(store, stage_id=1)
    Answers(lambda s: s, lambda s, name: False, lambda s: iter(())).watch(connector)

    def crashes(key: str) -> Segment:
        raise IndexError("list index out of range")

    def not_ours(key: str) -> Segment:
        raise ForeignName(f"the segment of {key} is not ours")

    async def main() -> None:
        assert not (await connector.put("1", "2", "a/b", {"x": 1})).ok  # a bad key fails a put: not noted
        with pytest.raises(InvalidKeyError):  # what a get may raise: not noted
            await connector.get("1", "2", "a/b")
        with pytest.raises(CorruptChunk):  # what a get may raise: not noted
            store.open_lock("R_1_1", create=True)
            store.open_segment = not_ours  # type: ignore[method-assign]
            await connector.get("1", "2", "R_1_1")
        store.create_segment = crashes  # type: ignore[method-assign]
        with pytest.raises(IndexError):  # a slip: noted, and raised on
            await connector.put("1", "2", "R_1_0", {"x": torch.zeros(4)})

    out = SimKernel(RandomStrategy(0)).run(main)
    assert [dict(e.attrs) for e in out.trace if e.name == "connector.answer"] == [
        {
            "what": "the put of R_1_0",
            "got": "raised IndexError: list index out of range",
            "want": "an answer",
        }
    ]


def test_answers_note_a_put_that_says_ok_yet_placed_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slip that loses a chunk after its put decided it went well would otherwise show only as
    a reader that waits: the answer says so when nothing else could have taken the chunk."""
    store = MemoryStore()
    connector = ShmConnector(store, stage_id=1)
    Answers(lambda s: s, lambda s, name: False, lambda s: iter(())).watch(connector)
    write = ShmConnector._write_locked

    async def loses_it(self: ShmConnector, key: str, frame: EncodedFrame) -> SegmentId:
        identity = await write(self, key, frame)
        store.unlink_segment(key)
        return identity

    async def main() -> None:
        assert (await connector.put("1", "2", "R_1_0", {"x": torch.zeros(4)})).ok  # placed: not noted
        monkeypatch.setattr(ShmConnector, "_write_locked", loses_it)
        assert (await connector.put("1", "2", "R_1_1", {"x": torch.zeros(4)})).ok

    out = SimKernel(RandomStrategy(0)).run(main)
    assert [dict(e.attrs) for e in out.trace if e.name == "connector.answer"] == [
        {"what": "the put of R_1_1", "got": "ok", "want": "not place its chunk: its segment is gone"}
    ]


def test_os_errors_clean_compares_each_outcome_with_what_it_must_give() -> None:
    held = world_of(("os.case", {"what": "the put of O_1_0", "got": "ok", "want": "ok"}))
    assert INVARIANTS["os-errors-clean"].check(held) == []
    raw = {"what": "the get of O_1_0", "got": "raised a raw OSError: [Errno 5]", "want": "round trip"}
    assert INVARIANTS["os-errors-clean"].check(world_of(("os.case", raw))) == [
        "the get of O_1_0: got raised a raw OSError: [Errno 5], must give round trip"
    ]


def test_store_model_faithful_compares_the_model_with_the_real_store() -> None:
    held = world_of(("model.case", {"what": "retire segment b", "got": "True", "want": "True"}))
    assert INVARIANTS["store-model-faithful"].check(held) == []
    broken = world_of(("model.case", {"what": "h1 acquires again", "got": "False", "want": "True"}))
    assert INVARIANTS["store-model-faithful"].check(broken) == ["h1 acquires again: in memory False; on a tmpfs True"]


def test_aligner_complete_needs_the_whole_waveform_and_refuses_http_streaming() -> None:
    held = world_of(
        ("serving.timestamps_over_http", {"accepted": False}),
        ("client.timestamps", {"req": "A", "end_ms": 1999.5, "audio_ms": 2000.0}),
    )
    assert INVARIANTS["aligner-complete"].check(held) == []
    broken = world_of(
        ("serving.timestamps_over_http", {"accepted": True}),
        ("client.timestamps", {"req": "A", "end_ms": 320.0, "audio_ms": 2000.0}),
        ("client.timestamps", {"req": "B", "end_ms": None, "audio_ms": 2000.0}),
    )
    found = INVARIANTS["aligner-complete"].check(broken)
    assert len(found) == 3
    assert "accepted" in found[0] and "320 ms" in found[1] and "B: no timestamps" in found[2]


def test_no_crash_names_the_task_and_the_exception() -> None:
    assert INVARIANTS["no-crash"].check(world_of()) == []
    crashed = world_of(crashes=(("stage1.save", "Traceback (most recent call last):\nKeyError: 'R_1_0'"),))
    (message,) = INVARIANTS["no-crash"].check(crashed)
    assert "stage1.save" in message and "KeyError" in message


def test_no_stale_consume_wants_a_failed_request_out_of_the_receive_queue() -> None:
    registered = ("adapter.register", {"stage": 2, "req": "R", "entry": 1})
    failed = ("adapter.receive_failed", {"stage": 2, "req": "R"})
    poll = ("adapter.poll", {"stage": 2, "req": "R", "entry": 1, "key": "R_1_0"})
    assert INVARIANTS["no-stale-consume"].check(world_of(registered, poll, failed)) == []
    again = ("adapter.register", {"stage": 2, "req": "R", "entry": 2})
    assert INVARIANTS["no-stale-consume"].check(world_of(registered, failed, again, poll)) == []
    (message,) = INVARIANTS["no-stale-consume"].check(world_of(registered, failed, poll))
    assert "polled R_1_0" in message and "after its receive failed (event 1)" in message


def test_answered_leaves_nothing_unread_looks_at_answered_requests_only() -> None:
    answered = ("orch.released", {"req": "R", "answered": True, "reclaimed": 0})
    aborted = ("orch.released", {"req": "A", "answered": False, "reclaimed": 3})
    assert INVARIANTS["answered-leaves-nothing-unread"].check(world_of(answered, aborted)) == []
    orphans = ("orch.released", {"req": "T", "answered": True, "reclaimed": 46})
    assert INVARIANTS["answered-leaves-nothing-unread"].check(world_of(orphans)) == [
        "request T was answered whole, yet its release sweep reclaimed 46 unread chunk(s)"
    ]


def test_streamed_as_made_reports_each_held_chunk() -> None:
    assert INVARIANTS["streamed-as-made"].check(world_of(("orch.accepted", {"req": "A"}))) == []
    held = world_of(("orch.accepted", {"req": "A"}), ("stream.held", {"req": "A#2"}))
    assert INVARIANTS["streamed-as-made"].check(held) == [
        "an audio chunk of A#2 was held back from its client when Code2Wav handed it out (event 1): the client "
        "hears nothing until the whole answer is made"
    ]


def test_failures_claimed_reports_a_failure_read_after_its_request_was_released() -> None:
    assert INVARIANTS["failures-claimed"].check(world_of(("orch.fail", {"req": "F", "reason": "gave up"}))) == []
    late = ("orch.failure_unclaimed", {"stage": 0, "req": "F#0", "reason": "gave up sending: chunk F_0_2"})
    assert INVARIANTS["failures-claimed"].check(world_of(("orch.released", {"req": "F"}), late)) == [
        "stage 0 failed F#0 (gave up sending: chunk F_0_2), read after its request was released (event 1): no "
        "request heard of it"
    ]


def test_a_fault_licenses_a_failure_of_its_own_generation_of_an_id_only() -> None:
    world = world_of(
        ("orch.accepted", {"req": "F"}),
        ("fault", {"kind": "put_fail", "key": "F_0_2"}),
        ("orch.accepted", {"req": "F"}),
    )
    first = Stream("failing", "F", outcome="failed", terminals=1, accepted_at=0)
    again = Stream("failing.again", "F", outcome="failed", terminals=1, accepted_at=2)
    world.streams = {s.request_id: s for s in (first, again)}
    assert INVARIANTS["terminal-delivered"].check(world) == ["request failing.again ended failed; expected finished"]
    # A stream no engine accepted (an edge-level world) is licensed by any fault on its id.
    again.accepted_at = None
    assert INVARIANTS["terminal-delivered"].check(world) == []


def test_a_probe_finding_counts_for_its_own_invariant_only() -> None:
    world = world_of(("probe.failed", {"invariant": "samples-exactly-once", "message": "A: 10 samples, want 12"}))
    assert check(world, ["samples-exactly-once", "no-crash"]) == [
        Violation("samples-exactly-once", "A: 10 samples, want 12")
    ]


@pytest.mark.parametrize("invariant", sorted(set(INVARIANTS) - UNDECLARABLE))
def test_some_mutant_makes_the_checker_fail_in_a_real_run(invariant: str) -> None:
    declaring = sorted(name for name, m in registry.MUTANTS.items() if invariant in m.expect)
    assert declaring, f"no mutant declares {invariant}: nothing shows that it can fail"
    tried = []
    # A mutant's exploration ends at the first invariant it declares, which may be another one;
    # the second pass does not stop, so every configuration of the scenario gets its turn.
    for budget, stop in ((300, True), (40, False)):
        for name in declaring:
            m = registry.MUTANTS[name]
            for scenario in m.scenarios:
                for strategy in ("random", "pct"):
                    res = explore(
                        scenario,
                        strategy=strategy,
                        budget=budget,
                        mutant=name,
                        stop_on_violation=stop,
                        store=m.store or "memory",
                    )
                    if invariant in res.invariants():
                        return
                    tried.append(f"{name} on {scenario} [{strategy}]: {res.invariants()}")
    pytest.fail(f"{invariant} never failed: {'; '.join(tried)}")


def test_no_mutant_declares_a_crash() -> None:
    assert [name for name, m in registry.MUTANTS.items() if set(m.expect) & UNDECLARABLE] == []


def test_no_leaked_handle_names_the_handle_the_store_and_the_moment() -> None:
    from invariants.observed import Snapshot, StoreSnapshot

    def world(*handles: str) -> ObservedWorld:
        stores = {"memory ns0": StoreSnapshot([], [], open_handles=list(handles))}
        mid_run = Snapshot("after sweep", {"memory ns0": StoreSnapshot([], [], open_handles=["lock R_1_9"])}, {})
        return ObservedWorld(trace=[], snapshots=[mid_run, Snapshot("quiescence", stores, {})], streams={}, crashes=[])

    assert INVARIANTS["no-leaked-handle"].check(world()) == []  # open mid-run is fine
    assert INVARIANTS["no-leaked-handle"].check(world("segment R_1_0")) == [
        "segment R_1_0 of the memory ns0 store is still open at quiescence"
    ]


def test_foreign_names_untouched_compares_what_became_of_each_planted_name() -> None:
    kept = ("shm.planted", {"what": "a file where a FIFO belongs", "got": "left alone", "want": "left alone"})
    assert INVARIANTS["foreign-names-untouched"].check(world_of(kept)) == []
    written = ("shm.planted", {"what": "a file where a FIFO belongs", "got": "written to", "want": "left alone"})
    assert INVARIANTS["foreign-names-untouched"].check(world_of(kept, written)) == [
        "a file where a FIFO belongs: it was written to, it must be left alone"
    ]


def test_the_exit_sweep_must_leave_nothing_and_a_live_receivers_fifo_must_go_by_shutdown() -> None:
    from invariants.observed import Snapshot, StoreSnapshot

    def world(fifos: list[str], left: list[str]) -> ObservedWorld:
        shutdown = Snapshot("shutdown", {"posix ns0": StoreSnapshot([], [], wakeup_fifos=fifos)}, {})
        at_exit = Snapshot("at exit", {"posix ns0": StoreSnapshot([], [], names=left)}, {})
        return ObservedWorld(trace=[], snapshots=[shutdown, at_exit], streams={}, crashes=[])

    assert INVARIANTS["no-orphan-shm"].check(world([], [])) == []
    assert INVARIANTS["no-residue-after-sweep"].check(world([], [])) == []
    assert INVARIANTS["no-orphan-shm"].check(world(["the wakeup FIFO of stage 2"], [])) == [
        "the wakeup FIFO of stage 2 of the posix ns0 store still exists at shutdown"
    ]
    assert INVARIANTS["no-residue-after-sweep"].check(world([], ["omnisim-ab12-wake"])) == [
        "the exit sweep of posix ns0 by its owner left omnisim-ab12-wake"
    ]


def test_health_counts_true_compares_each_counter_with_what_happened() -> None:
    from invariants.observed import Snapshot

    def world(reported: int) -> ObservedWorld:
        shutdown = Snapshot("shutdown", {}, {}, health={"stage1": {"puts": (reported, 3), "gets": (0, 0)}})
        return ObservedWorld(trace=[], snapshots=[shutdown], streams={}, crashes=[])

    assert INVARIANTS["health-counts-true"].check(world(3)) == []
    assert INVARIANTS["health-counts-true"].check(world(4)) == ["stage1 reports puts = 4 at shutdown, but 3 happened"]


def test_failures_have_causes_wants_a_fault_or_a_kill_before_a_failure() -> None:
    corrupt = ("shm.get.corrupt", {"key": "R_1_0"})
    assert INVARIANTS["failures-have-causes"].check(world_of(("fault", {"kind": "corrupt_bytes"}), corrupt)) == []
    assert INVARIANTS["failures-have-causes"].check(world_of(("process.paused", {"process": "stage1"}), corrupt)) == []
    (message,) = INVARIANTS["failures-have-causes"].check(world_of(corrupt, ("fault", {"kind": "corrupt_bytes"})))
    assert "shm.get.corrupt (key=R_1_0)" in message and "no fault" in message


def test_merged_as_spec_names_the_request_and_the_first_difference() -> None:
    from scenarios.merge import AS_SPEC

    held = world_of(("merge.case", {"req": "R-code2wav", "ext": "R", "got": AS_SPEC, "want": AS_SPEC}))
    assert INVARIANTS["merged-as-spec"].check(held) == []
    missed = world_of(
        ("merge.case", {"req": "R-code2wav", "ext": "R", "got": "meta.finished: missing", "want": AS_SPEC})
    )
    assert INVARIANTS["merged-as-spec"].check(missed) == ["R-code2wav after a commit: meta.finished: missing"]


def test_sender_contract_names_the_broken_promise() -> None:
    from scenarios.processor_contract import AS_SPEC

    held = world_of(
        ("sender.answer", {"req": "S-talker", "got": "queued", "want": "queued"}),
        ("processor.view", {"req": "P-talker", "got": "output=[1]", "want": "output=[1]"}),
        ("processor.flags", {"req": "P", "chunk": 0, "got": AS_SPEC, "want": AS_SPEC}),
    )
    assert INVARIANTS["sender-contract"].check(held) == []
    broken = world_of(
        ("sender.answer", {"req": "S-talker", "got": "queued", "want": "refused"}),
        ("processor.view", {"req": "P-talker", "got": "output=[1, 9]", "want": "output=[1]"}),
        ("processor.flags", {"req": "P", "chunk": 4, "got": "chunk 4 flagged finished=False", "want": AS_SPEC}),
    )
    assert INVARIANTS["sender-contract"].check(broken) == [
        "save_async for S-talker answered queued; spec §3.3 says refused",
        "the processor of P-talker was handed output=[1, 9]; queued was output=[1]",
        "P: chunk 4 flagged finished=False",
    ]


def test_the_merge_model_reads_spec_3_8() -> None:
    from scenarios.merge import first_difference, spec_merge

    two_d, one_d = torch.zeros(16, 2), torch.zeros(3)
    info = spec_merge({"meta": {"a": 1}, "x": 0}, {"codes": {"audio": one_d}, "meta": {"finished": True, "b": 2}})
    assert info == {"meta": {"a": 1, "b": 2}, "x": 0, "codes": {}}  # 1-D codes and finished stay out
    fresh = spec_merge(info, {"codes": {"audio": two_d}, "meta": {"replace_runtime_additional_information": True}})
    assert set(fresh) == {"codes", "meta"} and fresh["codes"]["audio"] is two_d
    assert first_difference({"meta": {"a": 1}}, {"meta": {"a": 2}}) == "meta.a: 1, not 2"
    assert (
        first_difference({"codes": {"audio": one_d}}, {"codes": {"audio": one_d + 1}})
        == "codes.audio: a different tensor"
    )
    assert first_difference({}, {"meta": {}}) == "meta: missing"


def test_a_fault_may_fail_the_request_it_hit_and_no_other() -> None:
    from invariants.observed import Stream

    def world(fault_key: str) -> ObservedWorld:
        w = world_of(("fault", {"kind": "put_fail", "at": "shm.put.begin", "key": fault_key}))
        w.streams = {
            ext: Stream(f"{ext}-code2wav", ext, frames_sent=4, chunks=[(2, False)], outcome="failed")
            for ext in ("task_1", "task")
        }
        return w

    # A fault on a chunk of task_1 (``task_1_1_0``) may fail task_1, never its sibling task.
    (message,) = INVARIANTS["terminal-delivered"].check(world("task_1_1_0"))
    assert message == "request task-code2wav ended failed; expected finished"
    assert len(INVARIANTS["terminal-delivered"].check(world("other_1_0"))) == 2
    # A request the fault hit that still finishes must have had every frame.
    finished = world("task_1_1_0")
    finished.streams["task_1"].outcome = "finished"
    finished.streams["task_1"].chunks = [(2, True)]
    del finished.streams["task"]
    (gap,) = INVARIANTS["terminal-delivered"].check(finished)
    assert "received 2 codec frames of 4 sent" in gap


def test_no_lost_wakeup_flags_a_timeout_after_a_put_for_the_waiting_stage() -> None:
    def world(*events: tuple[str, str, dict[str, object]]) -> ObservedWorld:
        trace = [TraceEvent(i, 0, task, name, attrs) for i, (task, name, attrs) in enumerate(events)]  # type: ignore[arg-type]
        return ObservedWorld(trace=trace, snapshots=[], streams={}, crashes=[])

    wait = ("recv2", "kernel.wait", {"on": "signal:wakeup.2"})
    timeout = ("recv2", "kernel.timeout", {"on": "signal:wakeup.2"})
    put_for_2 = ("send", "shm.put.wake", {"key": "R_1_0", "to": "2"})
    put_for_1 = ("send", "shm.put.wake", {"key": "R_0_0", "to": "1"})
    woken = ("recv2", "shm.get.begin", {"key": "R_1_0"})
    check = INVARIANTS["no-lost-wakeup"].check
    assert check(world(wait, put_for_2, woken)) == []  # woken by the put
    assert check(world(put_for_2, wait, timeout)) == []  # the put came before the wait began
    assert check(world(wait, put_for_1, timeout)) == []  # a put for another stage
    (message,) = check(world(wait, put_for_2, timeout))
    assert "recv2" in message and "R_1_0" in message and "stage 2" in message


def test_no_lost_wakeup_flags_a_timeout_the_kernel_marked_missed() -> None:
    def world(*attrs: dict[str, object]) -> ObservedWorld:
        trace = [TraceEvent(i, 0, "save", "kernel.timeout", a) for i, a in enumerate(attrs)]  # type: ignore[arg-type]
        return ObservedWorld(trace=trace, snapshots=[], streams={}, crashes=[])

    check = INVARIANTS["no-lost-wakeup"].check
    assert check(world({"on": "signal:thinker.save"})) == []  # an idle timeout
    (message,) = check(world({"on": "signal:thinker.save", "missed": True}))
    assert "save sat out its wait on thinker.save" in message


def test_ring_before_segments_excuses_a_segment_only_for_a_reason() -> None:
    Event = tuple[str, dict[str, object]]

    def put(key: str, via: str, nbytes: int, *before: Event) -> list[Event]:
        return [
            ("shm.put.begin", {"key": key}),
            *before,
            ("shm.put.created", {"key": key, "via": via}),
            ("shm.put.reserved", {"key": key, "bytes": nbytes}),
        ]

    def found(*events: Event, max_payload: int | None = 4080) -> list[str]:
        world = world_of(*events)
        world.ring_max_payload = max_payload
        return INVARIANTS["ring-before-segments"].check(world)

    assert found(*put("R_1_0", "ring", 800), *put("R_1_1", "segment", 5000)) == []  # too large for the ring
    assert found(*put("R_1_0", "segment", 800, ("ring.full", {"key": "R_1_0", "held": False}))) == []
    assert found(*put("R_1_0", "segment", 800, ("ring.unavailable", {"edge": "edge_1_2"}))) == []
    assert found(*put("R_1_0", "segment", 800), max_payload=None) == []  # a world without rings
    # a key whose unread payload is in a segment is replaced there, until a cleanup removed it
    first = put("R_1_0", "segment", 800, ("ring.full", {"key": "R_1_0", "held": False}))
    assert found(*first, *put("R_1_0", "segment", 800)) == []
    (message,) = found(*first, ("shm.cleanup.begin", {"key": "R_1_0"}), *put("R_1_0", "segment", 800))
    assert message.startswith("main put R_1_0 (800 bytes; the ring carries up to 4080) in a segment")


def test_ring_room_releases_finished_frames_and_counts_the_remainder_at_the_end() -> None:
    capacity = 1024 + RING_HEADER  # 16 units of 64 bytes
    view = memoryview(bytearray(capacity))

    def frame(pos: int, state: int, span: int) -> None:
        struct.pack_into("<IIQQ", view, RING_HEADER + pos % 1024, state, 0, 0, span)

    def head_tail(head: int, tail: int) -> None:
        struct.pack_into("<QQ", view, 16, head, tail)

    # 1024 bytes: a frame of key "k" and 100 payload bytes takes 64 + 128 = 192
    head_tail(0, 0)
    assert ring_room(view, "k", 100) == (1024, 192)
    frame(0, 2, 512)  # READY: not reusable
    frame(512, 3, 384)  # DONE, but behind a READY frame: not released either
    head_tail(896, 0)
    assert ring_room(view, "k", 100) == (1024 - 896 - 128, 192)  # the 128 at the end are skipped
    frame(0, 3, 512)  # now DONE: both release
    assert ring_room(view, "k", 100) == (1024 - 128, 192)


def test_a_crash_outside_the_runtime_says_where_it_was_raised() -> None:
    """A scenario's own slip (found by a review: a user's scenario that raised read as a runtime
    bug) names where it was raised; one raised in the runtime, or in a library it called, does not."""
    from invariants.delivery import _not_the_runtimes

    runtime_dir = os.path.dirname(runtime.__file__)
    library = os.path.join(sysconfig.get_paths()["purelib"], "torch", "functional.py")

    def traceback(*paths: str) -> str:
        frames = "".join(f'  File "{p}", line {i + 1}, in f\n    x()\n' for i, p in enumerate(paths))
        return f"Traceback (most recent call last):\n{frames}RuntimeError: boom"

    assert (
        _not_the_runtimes(traceback("/home/me/test_mine.py"))
        == " (raised outside the runtime, at /home/me/test_mine.py:1)"
    )
    assert _not_the_runtimes(traceback("/home/me/test_mine.py", f"{runtime_dir}/stages.py")) == ""
    assert _not_the_runtimes(traceback(f"{runtime_dir}/stages.py", library)) == ""


def test_stream_window_kept_sees_a_window_overrun_a_queue_jumped_and_a_slot_let_go_early() -> None:
    def added(*reqs: str) -> list[tuple[str, dict[str, object]]]:
        return [("sched.add", {"stage": 1, "req": r}) for r in reqs]

    def admitted(req: str, window: int = 1) -> tuple[str, dict[str, object]]:
        return ("adapter.stream.admitted", {"stage": 1, "req": req, "window": window})

    ended = ("adapter.unregister", {"stage": 1, "req": "A", "why": "cleanup"})
    check = INVARIANTS["stream-window-kept"].check
    assert check(world_of(*added("A", "B"), admitted("A"), ended, admitted("B"))) == []
    assert check(world_of(*added("A", "B"), admitted("A"), admitted("B"))) == [
        "stage 1 took up 2 streams at once (A, B); its window is 1"
    ]
    assert check(world_of(*added("A", "B"), admitted("B", 2))) == [
        "stage 1 took up B's stream before A's, which came first"
    ]
    assert check(world_of(*added("A"), admitted("A"), admitted("A"))) == [
        "stage 1 took up A's stream again: it let it go before the request ended there"
    ]


def test_no_register_after_terminal_sees_a_poll_for_a_chunk_that_never_comes() -> None:
    def ev(name: str, **attrs: object) -> tuple[str, dict[str, object]]:
        return (name, {"stage": 1, "req": "R", **attrs})

    terminal = ev("adapter.commit", entry=1, chunk=3, finished=True)
    check = INVARIANTS["no-register-after-terminal"].check
    assert check(world_of(ev("adapter.register", entry=1), terminal)) == []
    # An id that starts again after its cleanup registers afresh.
    assert check(world_of(terminal, ev("adapter.unregister", why="cleanup"), ev("adapter.register", entry=2))) == []
    assert check(world_of(terminal, ev("adapter.register", entry=2))) == [
        "stage 1 registered R for another chunk (event 1) after committing its terminal (event 0): it polls for a "
        "chunk that never comes"
    ]
