"""The payload watch: every payload a get hands out must be one a put was asked to send under the
same key, type for type and byte for byte (``no-corrupt-accept``, checked from outside)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np
import pytest
import torch

from omnisim.payloads import as_carried, fingerprint, watch_payloads
from runtime.connectors.shm import ShmConnector
from runtime.connectors.stores import MemoryStore
from runtime.connectors.wire import decode, encode

PAYLOAD = {
    "codes": {"audio": torch.arange(32).reshape(2, 16)},
    "meta": {"finished": torch.tensor(True), "ids": [1, 2, 3], "span": (0, 4), ("a", 1): 0.5},
    "array": np.arange(6, dtype="<u2"),
    "raw": b"\x00\x01",
    "nan": float("nan"),
}


def test_a_payload_as_carried_and_its_round_trip_have_one_fingerprint() -> None:
    assert fingerprint(decode(encode(PAYLOAD))) == fingerprint(as_carried(PAYLOAD))


def test_a_tuple_is_carried_as_a_list_except_as_a_key() -> None:
    carried = as_carried(PAYLOAD)
    assert isinstance(carried, dict)
    assert carried["meta"]["span"] == [0, 4] and ("a", 1) in carried["meta"]
    assert fingerprint(carried) != fingerprint(PAYLOAD)


@pytest.mark.parametrize(
    "changed",
    [
        {**PAYLOAD, "meta": {**PAYLOAD["meta"], "ids": (1, 2, 3)}},  # a list become a tuple
        {**PAYLOAD, "meta": {**PAYLOAD["meta"], "ids": [1, 2]}},
        {**PAYLOAD, "codes": {"audio": torch.arange(32).reshape(2, 16).to(torch.int32)}},  # another dtype
        {**PAYLOAD, "codes": {"audio": torch.arange(32).reshape(4, 8)}},  # another shape
        {**PAYLOAD, "codes": {"audio": torch.arange(1, 33).reshape(2, 16)}},  # other values
        {**PAYLOAD, "array": np.arange(6, dtype="<u4")},
        {**PAYLOAD, "raw": b"\x00\x02"},
        {k: v for k, v in PAYLOAD.items() if k != "nan"},  # a key dropped
        {**PAYLOAD, "meta": {**PAYLOAD["meta"], ("a", 1): 0.25}},
    ],
)
def test_any_change_changes_the_fingerprint(changed: dict[str, Any]) -> None:
    assert fingerprint(changed) != fingerprint(PAYLOAD)


def test_a_payload_that_nests_without_end_has_a_fingerprint() -> None:
    deep: list[object] = []
    deep.append(deep)
    assert fingerprint(deep) == fingerprint(deep)


async def test_a_get_that_hands_out_what_no_put_sent_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore()
    writer, reader = ShmConnector(store, stage_id=1), ShmConnector(store, stage_id=2)
    offered: dict[str, set[Hashable]] = {}
    reports: list[str] = []
    for connector in (writer, reader):
        watch_payloads(connector, offered, reports.append)
    assert (await writer.put("1", "2", "R_1_0", PAYLOAD)).ok
    assert await reader.get("1", "2", "R_1_0") is not None
    assert reports == []

    # A wire format that hands a list out as a tuple.
    tuples = staticmethod(lambda _source, _key: _with_tuples(decode(encode(PAYLOAD))))
    monkeypatch.setattr(ShmConnector, "_decode", tuples)
    assert (await writer.put("1", "2", "R_1_1", PAYLOAD)).ok
    assert await reader.get("1", "2", "R_1_1") is not None
    assert reports == ["the get of R_1_1 handed out a payload no put of R_1_1 was asked to send"]


async def _with_tuples(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "meta": {**payload["meta"], "ids": tuple(payload["meta"]["ids"])}}


def test_views_whose_bytes_are_not_their_values_have_the_fingerprint_of_their_values() -> None:
    """A conjugate or negative view (torch resolves the bit lazily) and a one-element view with an
    odd stride: the watch once raised on each, which looked like the put raising."""
    waves = torch.complex(torch.arange(4.0), torch.arange(4.0) + 1)
    for view in (waves.conj(), waves.conj().imag, waves[1:2].conj().imag, waves.imag[1:2]):
        assert fingerprint(view) == fingerprint(view.resolve_conj().resolve_neg().clone())
        assert fingerprint(view) == fingerprint(decode(encode(view)))
