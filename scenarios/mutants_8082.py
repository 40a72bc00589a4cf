"""Mutants for #8082: each re-creates one historic bug of the reclaim protocol (spec §8 #8082)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from omnisim.registry import Patch, mutant
from runtime.connectors import wire
from runtime.connectors.shm import REAP_BUDGET, ShmConnector
from runtime.connectors.stores import LockFile, Segment, Store
from runtime.connectors.wire import WireDecodeError
from runtime.kernel import KTaskGroup, current_kernel
from runtime.transfer import rules
from runtime.transfer.generations import SenderGeneration, SenderTables
from runtime.transfer.receiver import ChunkReceiver as Receiver
from runtime.transfer.receiver import LoadEntry
from runtime.transfer.sender import ChunkSender as Sender
from runtime.transfer.sender import CleanupTask

_original_sender = {name: vars(Sender)[name] for name in vars(Sender)}
_original_receiver = {name: vars(Receiver)[name] for name in vars(Receiver)}


def _lend_a_task_group() -> Iterator[Patch]:
    """The sender has no task group for a mutant that starts tasks of its own: this patch opens
    one around the save loop, which :func:`_lent_task_group` finds while the loop runs."""
    save_loop = _original_sender["save_loop"]

    async def save_loop_with_a_task_group(self: Sender) -> None:
        async with current_kernel().task_group() as tasks:
            self.__dict__["_lent_tasks"] = tasks
            try:
                await save_loop(self)
            finally:
                del self.__dict__["_lent_tasks"]

    yield Patch(Sender, "save_loop", save_loop_with_a_task_group)


def _lent_task_group(sender: Sender) -> KTaskGroup | None:
    return sender.__dict__.get("_lent_tasks")


@mutant(
    "num_puts_after_success",
    summary="record the key range only after a successful put: the raced or raised key escapes the reclaim",
    issue="#8082 (a)",
    # Not abort_during_put: an abort leaves a generation whose put is in flight to that put,
    # which retires it once the put returned, and by then either order has recorded the key.
    # Only a put that raises after making its key (that scenario's fault) lets it escape.
    scenarios=("terminal_success_vs_failure",),
    expect=("no-orphan-shm",),
)
def num_puts_after_success() -> Iterator[Patch]:
    async def _put_chunk(
        self: Sender, token: SenderGeneration, key: str, chunk_id: int, payload: Any
    ) -> tuple[bool, str]:
        ok, _, metadata = await self.connector.put(str(self.stage_id), str(self.stage_id + 1), key, payload)
        if ok:
            token.num_puts = chunk_id + 1
        return ok, str(metadata.get("error", "connector.put reported failure"))

    yield Patch(Sender, "_put_chunk", _put_chunk)


@mutant(
    "cleanup_waits_for_io",
    summary="the abort waits for the in-flight put to finish before it returns",
    issue="#8082 (a)",
    scenarios=("abort_during_put",),
    expect=("abort-non-blocking",),
)
def cleanup_waits_for_io() -> Iterator[Patch]:
    original = _original_sender["cleanup_sender"]

    async def cleanup_sender(self: Sender, ext: str) -> None:
        token = self.tables.sender_tokens.get(ext)
        # (Not for a fenced terminal's own deferred cleanup, which runs on the save task itself.)
        while token is not None and token.in_flight and not (token.terminal_pending or token.terminal_sent):
            await current_kernel().sleep(0.001)
        await original(self, ext)

    yield Patch(Sender, "cleanup_sender", cleanup_sender)


@mutant(
    "cleanup_on_scheduler_thread",
    summary="the abort reclaims the keys itself on the caller's task instead of queueing the reclaim",
    issue="#8082 (a)",
    scenarios=("id_reuse_after_cancel", "abort_during_put"),
    expect=("abort-non-blocking",),
)
def cleanup_on_scheduler_thread() -> Iterator[Patch]:
    def _queue_shm_cleanup_locked(self: Sender, ext: str, token: SenderGeneration) -> None:
        if rules.needs_reclaim(token):
            self.__dict__.setdefault("_direct_cleanups", []).append(
                CleanupTask(ext, f"{ext}_{self.stage_id}", token.num_puts, token.serial)
            )

    async def run_direct(self: Sender) -> None:
        direct = self.__dict__.get("_direct_cleanups", [])
        while direct:
            await self._run_cleanup_task(direct.pop(0))

    original_cleanup, original_send = _original_sender["cleanup_sender"], _original_sender["_send_single_request"]

    async def cleanup_sender(self: Sender, ext: str) -> None:
        await original_cleanup(self, ext)
        await run_direct(self)

    async def _send_single_request(self: Sender, task: Any) -> None:
        await original_send(self, task)
        await run_direct(self)

    yield Patch(Sender, "_queue_shm_cleanup_locked", _queue_shm_cleanup_locked)
    yield Patch(Sender, "cleanup_sender", cleanup_sender)
    yield Patch(Sender, "_send_single_request", _send_single_request)


@mutant(
    "cleanup_on_separate_queue",
    summary="the reclaim runs on its own task instead of the save FIFO, so it can overtake a reusing generation",
    issue="#8082 (b)",
    scenarios=("id_reuse_after_cancel",),
    expect=("exact-key-ownership", "liveness"),
)
def cleanup_on_separate_queue() -> Iterator[Patch]:
    def _queue_shm_cleanup_locked(self: Sender, ext: str, token: SenderGeneration) -> None:
        tasks = _lent_task_group(self)
        if rules.needs_reclaim(token) and tasks is not None:
            task = CleanupTask(ext, f"{ext}_{self.stage_id}", token.num_puts, token.serial)

            async def reclaim() -> None:
                await current_kernel().point("mutant.window", ext=ext)
                await self._run_cleanup_task(task)

            tasks.start_soon(reclaim, name=f"stage{self.stage_id}.reclaim")

    yield from _lend_a_task_group()
    yield Patch(Sender, "_queue_shm_cleanup_locked", _queue_shm_cleanup_locked)


@mutant(
    "pop_token_before_enqueue",
    summary="the token is popped before the reclaim is queued: new work for the id jumps ahead of it",
    issue="#8082 (b)",
    scenarios=("id_reuse_after_cancel",),
    expect=("exact-key-ownership", "liveness"),
)
def pop_token_before_enqueue() -> Iterator[Patch]:
    def _retire_generation_locked(self: Sender, ext: str, token: SenderGeneration) -> None:
        self.tables.sender_tokens.pop(ext, None)
        self.tables.clear(ext)
        tasks = _lent_task_group(self)
        if tasks is None or not rules.needs_reclaim(token):
            return

        async def enqueue_later() -> None:
            await current_kernel().point("mutant.window", ext=ext)
            self._pending_save_reqs.append(CleanupTask(ext, f"{ext}_{self.stage_id}", token.num_puts, token.serial))
            self._save_cond.notify()

        tasks.start_soon(enqueue_later, name=f"stage{self.stage_id}.enqueue")

    yield from _lend_a_task_group()
    yield Patch(Sender, "_retire_generation_locked", _retire_generation_locked)


@mutant(
    "accept_while_draining",
    summary="save_async accepts work for an id whose previous generation is still draining (generations mix)",
    issue="#8082 (b)",
    scenarios=("id_reuse_after_cancel",),
    expect=("exact-key-ownership", "terminal-delivered"),
)
def accept_while_draining() -> Iterator[Patch]:
    admit_save = rules.admit_save

    def admit_ignoring_the_drain(token: SenderGeneration | None, **kwargs: Any) -> rules.Admission:
        admission = admit_save(token, **kwargs)
        return rules.Admission.ACCEPT if admission is rules.Admission.DRAINING else admission

    yield Patch(rules, "admit_save", admit_ignoring_the_drain)


@mutant(
    "retired_with_a_put_in_flight",
    summary="an abort retires the sender generation at once even while one of its puts is in flight: the id stops "
    "draining before its last put ends, and work for a reuse of the id is accepted beside it",
    issue="#8082 (b), spec §3.5 (a bug the harness was not told about: nothing checked that the id drains while "
    "a put is in flight)",
    scenarios=("id_reuse_after_cancel",),
    expect=("exact-key-ownership",),
)
def retired_with_a_put_in_flight() -> Iterator[Patch]:
    yield Patch(rules, "cleanup_defers_retire", lambda token: token.terminal_pending)


@mutant(
    "sender_state_not_cleared",
    summary="retiring a generation leaves put_req_chunk behind: a reusing generation continues from the old chunk id",
    issue="#8082 (b)",
    scenarios=("id_reuse_after_cancel",),
    expect=("no-tombstones",),
)
def sender_state_not_cleared() -> Iterator[Patch]:
    clear = vars(SenderTables)["clear"]

    def clear_but_put_req_chunk(self: SenderTables, ext: str) -> None:
        kept = self.put_req_chunk.get(ext)
        clear(self, ext)
        if kept is not None:
            self.put_req_chunk[ext] = kept

    yield Patch(SenderTables, "clear", clear_but_put_req_chunk)


@mutant(
    "prefix_cleanup",
    summary="the reclaim deletes every tracked key starting with the request id: siblings like task_1_2 lose chunks",
    issue="#8082 (c)",
    scenarios=("similar_ids",),
    expect=("exact-key-ownership",),
)
def prefix_cleanup() -> Iterator[Patch]:
    async def _run_cleanup_task(self: Sender, task: CleanupTask) -> None:
        k = current_kernel()
        await k.point("adapter.cleanup_shm.begin", prefix=task.prefix, n=task.num_puts, gen=task.generation)
        ext = task.prefix.rsplit("_", 1)[0]
        for key in list(self.connector.residue()["pending_keys"]):
            if key.startswith(f"{ext}_"):
                await self.connector.cleanup(key)
        k.note("adapter.cleanup_shm.end", prefix=task.prefix, gen=task.generation)

    yield Patch(Sender, "_run_cleanup_task", _run_cleanup_task)


@mutant(
    "delete_sent_terminal",
    summary="the reclaim deletes all num_puts keys even after the terminal was sent: downstream loses it",
    issue="#8082 (d)",
    scenarios=("terminal_success_vs_failure", "abort_with_terminal_queued"),
    expect=("liveness",),
)
def delete_sent_terminal() -> Iterator[Patch]:
    yield Patch(rules, "needs_reclaim", lambda token: token.num_puts > 0)


@mutant(
    "skip_cleanup_for_terminal",
    summary="a generation whose terminal was attempted is treated as delivered: a failed terminal is never reclaimed",
    issue="#8082 (d)",
    scenarios=("terminal_success_vs_failure",),
    expect=("no-orphan-shm", "no-orphan-lock"),
)
def skip_cleanup_for_terminal() -> Iterator[Patch]:
    original = _original_sender["_put_chunk"]

    async def _put_chunk(
        self: Sender, token: SenderGeneration, key: str, chunk_id: int, payload: Any
    ) -> tuple[bool, str]:
        if bool(payload["meta"]["finished"]):
            token.terminal_sent = True
        return await original(self, token, key, chunk_id, payload)

    yield Patch(Sender, "_put_chunk", _put_chunk)


@mutant(
    "no_post_get_identity_check",
    summary="the receiver does not re-check its registration after get: a cleaned-up request gets its chunk",
    issue="#8082 (e)",
    scenarios=("stale_receiver_entry",),
    expect=("no-stale-commit",),
)
def no_post_get_identity_check() -> Iterator[Patch]:
    yield Patch(rules, "may_commit", lambda registered, entry: True)


@mutant(
    "mapping_outside_lock",
    summary="the receive loop publishes request_ids_mapping outside the lock, after the poll: cleanup is undone",
    issue="#8082 (e)",
    scenarios=("stale_receiver_entry",),
    expect=("no-tombstones",),
)
def mapping_outside_lock() -> Iterator[Patch]:
    original = _original_receiver["_poll_single_request"]

    async def _poll_single_request(self: Receiver, entry: LoadEntry) -> bool:
        drop = await original(self, entry)
        self.request_ids_mapping[entry.request_id] = entry.external_req_id
        return drop

    yield Patch(Receiver, "_poll_single_request", _poll_single_request)


@mutant(
    "membership_not_identity",
    summary="the receiver checks 'id in registered' instead of identity: an old get commits into a re-registration",
    issue="#8082 (e)",
    scenarios=("stale_receiver_entry",),
    expect=("no-stale-commit",),
)
def membership_not_identity() -> Iterator[Patch]:
    def by_membership(registered: Mapping[str, LoadEntry], entry: LoadEntry) -> bool:
        return entry.request_id in registered

    yield Patch(rules, "entry_is_current", by_membership)


@mutant(
    "cancelled_tombstones",
    summary="receiver cleanup records the id in a _cancelled_load_reqs set that grows with every cleanup",
    issue="#8082 (f)",
    scenarios=("repeated_receiver_cleanups",),
    expect=("no-tombstones",),
)
def cancelled_tombstones() -> Iterator[Patch]:
    original = _original_receiver["cleanup_receiver"]

    async def cleanup_receiver(self: Receiver, request_id: str) -> None:
        self.__dict__.setdefault("_cancelled_load_reqs", set()).add(request_id)
        await original(self, request_id)

    yield Patch(Receiver, "cleanup_receiver", cleanup_receiver)


@mutant(
    "no_idle_reap",
    summary="reap_consumed runs only inside put: after the last send the consumed keys stay tracked forever",
    issue="#8082 (g)",
    scenarios=("idle_reap",),
    expect=("no-tombstones",),
)
def no_idle_reap() -> Iterator[Patch]:
    reap_consumed = vars(ShmConnector)["reap_consumed"]

    def reap_only_inside_put(self: ShmConnector, *, max_keys: int = REAP_BUDGET) -> None:
        if max_keys != REAP_BUDGET:  # put's own small sweep; the save loop's idle reap asks the default
            reap_consumed(self, max_keys=max_keys)

    yield Patch(ShmConnector, "reap_consumed", reap_only_inside_put)


@mutant(
    "reap_no_rotate",
    summary="the reap scans the first 64 keys without rotating: unread keys at the head starve the rest",
    issue="#8082 (h)",
    scenarios=("unread_head_rotation",),
    expect=("no-tombstones",),
)
def reap_no_rotate() -> Iterator[Patch]:
    def reap_consumed(self: ShmConnector, *, max_keys: int = 64) -> None:
        for key in list(self._pending_keys)[:max_keys]:
            if not self.store.segment_exists(key):
                del self._pending_keys[key]

    yield Patch(ShmConnector, "reap_consumed", reap_consumed)


@mutant(
    "lock_removed_only_if_decoded",
    summary="the reader removes the lock file only when the payload decoded: a bad payload leaks it",
    issue="#8082 (i)",
    scenarios=("deserialize_failure",),
    expect=("no-orphan-lock",),
)
def lock_removed_only_if_decoded() -> Iterator[Patch]:
    async def _consume(
        self: ShmConnector, store: Store, key: str, segment: Segment, lock: LockFile
    ) -> tuple[Any, int, Any]:
        k = current_kernel()
        size = segment.size
        obj: Any = None
        error: Exception | None = None
        try:
            await k.point("shm.get.locked", key=key)
            try:
                obj = await k.run_blocking(lambda: wire.decode(segment), cost=size)
            except WireDecodeError as e:
                error = e
        finally:
            segment.close()
        store.unlink_segment(key)
        try:
            await k.point("shm.get.consumed", key=key)
        except WireDecodeError as e:
            error = e
        if error is None:  # the bug: a payload that did not decode keeps its lock file
            self._remove_lock_after_read(store, key, lock)
        return obj, size, error

    yield Patch(ShmConnector, "_consume", _consume)


@mutant(
    "consume_without_claim",
    summary="the connector consumes without asking the reader's claim under the key's lock: a get that outlived "
    "its registration eats the chunk a reused id's new generation wrote (a hang)",
    issue="#8082 (b), omnisim issue 7",
    scenarios=("id_reuse_after_cancel",),
    expect=("no-stale-consume", "liveness"),
)
def consume_without_claim() -> Iterator[Patch]:
    original = vars(ShmConnector)["get"]

    async def get(self: ShmConnector, *args: Any, claim: Any = None, **kwargs: Any) -> Any:
        return await original(self, *args, **kwargs)

    yield Patch(ShmConnector, "get", get)
