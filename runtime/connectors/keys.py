"""Chunk keys and the names a store may derive from them."""

from __future__ import annotations

import re

#: A key becomes part of a file name under /dev/shm, so it is kept to a safe alphabet, no "/".
KEY_PATTERN = re.compile(r"[A-Za-z0-9_.:-]+")
#: NAME_MAX is 255; a store adds a prefix of at most 40 characters.
MAX_KEY_LENGTH = 200


class InvalidKeyError(ValueError):
    """A chunk key that cannot name a shared-memory object."""


def validate_key(key: str) -> str:
    """Return ``key`` unchanged if it is a valid chunk key, else raise :class:`InvalidKeyError`."""
    if not isinstance(key, str):
        raise InvalidKeyError(f"chunk key must be a str, got {type(key).__name__}")
    if not key or len(key) > MAX_KEY_LENGTH:
        raise InvalidKeyError(f"chunk key must be 1..{MAX_KEY_LENGTH} characters, got {len(key)}: {key[:40]!r}")
    if not KEY_PATTERN.fullmatch(key) or key in (".", ".."):
        raise InvalidKeyError(f"chunk key {key!r} may only contain letters, digits and _ . : -")
    return key


def validate_stage(stage: object, what: str) -> str:
    """A put's or get's ``from_stage`` or ``to_stage`` as a string (``"1"``), as upstream's connector
    takes them (an ``int`` is taken as its digits); it names the edge's ring and wakeups. Else
    :class:`TypeError`, before anything is stored."""
    if isinstance(stage, int) and not isinstance(stage, bool):
        return str(stage)
    if not isinstance(stage, str):
        raise TypeError(f"{what} must be a str (or an int), got {type(stage).__name__}: {stage!r:.40}")
    return stage


#: Room a request id leaves in a key for ``_{stage}_{chunk}``.
MAX_REQUEST_ID_LENGTH = MAX_KEY_LENGTH - 40


def validate_request_id(request_id: object) -> str:
    """A request id becomes the stem of every chunk key of its request, so it must be a valid key
    with room for the stage and chunk numbers; else :class:`InvalidKeyError` naming the rule."""
    if not isinstance(request_id, str):
        raise InvalidKeyError(f"request id must be a str, got {type(request_id).__name__}")
    if not request_id or len(request_id) > MAX_REQUEST_ID_LENGTH:
        raise InvalidKeyError(
            f"request id must be 1..{MAX_REQUEST_ID_LENGTH} characters, got {len(request_id)}: {request_id[:40]!r}"
        )
    if not KEY_PATTERN.fullmatch(request_id) or request_id in (".", ".."):
        raise InvalidKeyError(f"request id {request_id!r} may only contain letters, digits and _ . : -")
    return request_id


def chunk_key(external_req_id: str, stage_id: int, chunk_id: int) -> str:
    """The adapter's key for chunk ``chunk_id`` that stage ``stage_id`` sends for a request."""
    return f"{external_req_id}_{stage_id}_{chunk_id}"


def external_id_of(key: str) -> str:
    """The external request id a :func:`chunk_key` was made for (the id may hold ``_`` too)."""
    return key.rsplit("_", 2)[0]
