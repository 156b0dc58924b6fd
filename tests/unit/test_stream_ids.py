"""Entry ids in Redis's order: a resuming reader compares them to skip what it has."""

from __future__ import annotations

import pytest

from trtllm_worker.contract.stream import entry_order


def test_entry_ids_sort_by_number_not_by_text() -> None:
    ids = ["1-10", "10-0", "0-2", "1-9", "2"]
    assert sorted(ids, key=lambda i: entry_order(i) or (-1, -1)) == [
        "0-2",
        "1-9",
        "1-10",
        "2",
        "10-0",
    ]
    assert entry_order("2") == entry_order("2-0")


@pytest.mark.parametrize("raw", ["", "-", "1-", "a-1", "1-b", "1-2-3", "+1", "-1", "\u00b2", "1 "])
def test_what_is_not_an_entry_id_has_no_order(raw: str) -> None:
    assert entry_order(raw) is None
