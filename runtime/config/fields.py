"""Typed reading of one parsed YAML mapping, with errors that name the field path.

Every configuration error is a :class:`ConfigError` whose message starts with the path of the
offending field (``deploy.stages[2].async_chunk: expected bool, got 'yes'``) or names the
offending edge, so a bad file fails at start-up with a message that says where to look.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable
from enum import StrEnum
from typing import TypeVar

E = TypeVar("E", bound=StrEnum)


class ConfigError(ValueError):
    """An invalid pipeline or deploy configuration, found at start-up."""


class Fields:
    """One YAML mapping at ``path``, read field by field.

    An explicit ``null`` reads as an absent key, so ``async_chunk: null`` means "inherit".
    Unknown keys are rejected up front: a typo such as ``asyn_chunk`` would otherwise silently
    mean "inherit the pipeline-wide value", which is exactly the #7505 hang.
    """

    def __init__(self, raw: object, path: str, known: Iterable[str]) -> None:
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping, got {_shown(raw)}")
        known = tuple(known)
        for key in raw:
            if key not in known:
                raise ConfigError(f"{path}.{key}: unknown key (known keys: {', '.join(known)})")
        self._raw = raw
        self.path = path

    def at(self, key: str) -> str:
        """The path of ``key`` inside this mapping, for error messages."""
        return f"{self.path}.{key}"

    def get(self, key: str) -> object:
        """The raw value, None when absent; for a nested section that has its own reader."""
        return self._raw.get(key)

    def get_required(self, key: str) -> object:
        value = self._raw.get(key)
        if value is None:
            raise ConfigError(f"{self.at(key)}: required")
        return value

    def get_optional_bool(self, key: str) -> bool | None:
        value = self._raw.get(key)
        # bool only: 'yes' or 1 would otherwise pass a truthiness test and mean something else.
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"{self.at(key)}: expected bool, got {_shown(value)}")
        return value

    def get_bool(self, key: str, default: bool) -> bool:
        value = self.get_optional_bool(key)
        return default if value is None else value

    def get_int(self, key: str, default: int | None = None, *, minimum: int) -> int:
        value = self._raw.get(key)
        if value is None:
            if default is None:
                raise ConfigError(f"{self.at(key)}: required")
            return default
        # bool is an int subclass in Python; `true` is never a frame count or a stage id.
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ConfigError(f"{self.at(key)}: expected an integer >= {minimum}, got {_shown(value)}")
        return value

    def get_int_list(self, key: str, *, minimum: int) -> tuple[int, ...]:
        values = self._raw.get(key, [])
        values = [] if values is None else values
        if not isinstance(values, list):
            raise ConfigError(f"{self.at(key)}: expected a list of integers, got {_shown(values)}")
        for i, value in enumerate(values):
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ConfigError(f"{self.at(key)}[{i}]: expected an integer >= {minimum}, got {_shown(value)}")
        return tuple(values)

    def get_optional_str(self, key: str) -> str | None:
        value = self._raw.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(f"{self.at(key)}: expected a non-empty string, got {_shown(value)}")
        return value

    def get_str(self, key: str, default: str | None = None) -> str:
        value = self.get_optional_str(key)
        if value is not None:
            return value
        if default is None:
            raise ConfigError(f"{self.at(key)}: required")
        return default

    def get_optional_enum(self, key: str, enum: type[E]) -> E | None:
        value = self._raw.get(key)
        if value is None:
            return None
        choices = [member.value for member in enum]
        if value not in choices:
            raise ConfigError(f"{self.at(key)}: expected one of {', '.join(choices)}, got {_shown(value)}")
        return enum(value)

    def get_enum(self, key: str, enum: type[E]) -> E:
        member = self.get_optional_enum(key, enum)
        if member is None:
            raise ConfigError(f"{self.at(key)}: required")
        return member

    def get_list(self, key: str) -> list[object]:
        values = self._raw.get(key, [])
        values = [] if values is None else values
        if not isinstance(values, list):
            raise ConfigError(f"{self.at(key)}: expected a list, got {_shown(values)}")
        return values


def _shown(value: object) -> str:
    """``value`` as an error quotes it, cut short (YAML aliases can make a tiny file hold a value
    whose full repr runs to gigabytes)."""
    return reprlib.repr(value)
