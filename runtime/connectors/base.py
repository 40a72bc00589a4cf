"""The connector contract (spec §2.1): how one stage hands a payload to the next."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol


class PutResult(NamedTuple):
    ok: bool
    size: int
    metadata: dict[str, Any] | None


class CorruptChunk(Exception):
    """A chunk whose bytes were taken (segment and lock file removed) but were not a committed,
    intact frame — or that cannot be read because its names are not ours. Not "not arrived":
    the request that waits for it must fail, naming the key and the cause."""

    def __init__(self, key: str, cause: str) -> None:
        super().__init__(f"corrupt chunk {key}: {cause}")
        self.key = key
        self.cause = cause


class Connector(Protocol):
    """A stage-edge transport. ``put`` never raises; ``get`` never raises for storage or payload
    problems (a corrupt chunk is :class:`CorruptChunk`)."""

    stage_id: int

    async def put(self, from_stage: str, to_stage: str, put_key: str, data: object) -> PutResult:
        """Serialize and store ``data`` under ``put_key``. A failure returns ``ok`` False with its
        cause in the metadata (``{"error": ...}``; upstream returns None there)."""
        ...

    async def get(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
        *,
        claim: Callable[[], bool] | None = None,
    ) -> tuple[Any, int] | None:
        """Take the payload under ``get_key`` if it is there now; None means "not available now".
        A payload that was taken but is not intact raises :class:`CorruptChunk`.

        ``claim``, asked while the key is held exclusively and before anything is consumed,
        may refuse the payload (it then stays where it is)."""
        ...

    async def get_with_deadline(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
        *,
        deadline: float,
    ) -> tuple[Any, int] | None:
        """:meth:`get`, or None once the clock has reached ``deadline``."""
        ...

    async def cleanup(self, key: str) -> bool:
        """Release what is stored under exactly ``key``; True if a segment was removed."""
        ...

    async def cleanup_prefix(self, key_prefix: str) -> int:
        """Clean up tracked keys ``key_prefix + <integer>``; the number of segments removed."""
        ...

    def reap_consumed(self, *, max_keys: int = 64) -> None:
        """Forget at most ``max_keys`` tracked keys that a consumer has already taken."""
        ...

    def producer_alive(self) -> bool:
        """Whether the stage this one receives from still lives."""
        ...

    def get_wakeup_generation(self) -> int | None: ...

    def poke(self) -> None:
        """Wake this stage's own :meth:`wait_for_change`, as a put to it would (a new
        registration wants a poll now)."""
        ...

    async def wait_for_change(
        self, generation: int, *, timeout: float, ready: Callable[[], bool] | None = None
    ) -> bool:
        """Wait up to ``timeout`` for a put to this stage after ``generation``; True if one came.
        ``ready``: what else the caller waits for (see :meth:`runtime.kernel.KSignal.wait`)."""
        ...

    def health(self) -> dict[str, Any]: ...

    def residue(self) -> dict[str, list[str]]:
        """What this connector still holds, by structure name."""
        ...

    async def close(self) -> None: ...
