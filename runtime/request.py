"""The per-stage request a scheduler owns (the fields of a vLLM request the stage edge uses)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_CHUNK = "waiting_for_chunk"
    RUNNING = "running"
    #: Sent back to the waiting queue: more requests ran than ``max_num_seqs`` (spec §5.2 step 4).
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


@dataclass(eq=False)
class Request:
    """One stage's view of a request. ``request_id`` is the stage-internal id;
    ``external_req_id`` is the id shared by every stage (and the one SHM keys are built from)."""

    request_id: str
    external_req_id: str
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    additional_information: dict[str, Any] | None = None
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    num_prompt_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    resumable: bool = False
    #: upstream's ``_omni_segment_generation``: None when the producer does not maintain it.
    segment_generation: int | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.prompt_token_ids, *self.output_token_ids]

    def is_finished(self) -> bool:
        return self.status.finished
