"""BlockTable: a growing int32 array that behaves like the list of block ids it replaces."""

import numpy as np
import pytest

from kimik3.engine.core.block_pool import BlockTable
from kimik3.model.cuda_graphs import pack_decode_inputs


def test_block_table_grows_like_a_list():
    ids: list[int] = []
    table = BlockTable()
    rng = np.random.default_rng(0)
    for _ in range(40):                      # many growths past the initial capacity of 16
        new = rng.integers(1, 10_000, size=int(rng.integers(0, 9))).tolist()
        ids.extend(new)
        table.extend(iter(new))
        assert len(table) == len(ids) and list(table) == ids and table == ids and list(reversed(table)) == ids[::-1]
        assert np.asarray(table).dtype == np.int32 and np.asarray(table).tolist() == ids
    assert [table[i] for i in range(-len(ids), len(ids))] == ids[-len(ids):] + ids
    with pytest.raises(IndexError):
        table[len(ids)]
    assert not BlockTable() and list(BlockTable([3, 4])) == [3, 4]


def test_decode_inputs_from_tables_equal_those_from_lists():
    lists = [list(range(5, 5 + 70)), [9, 8, 7]]
    tables = [BlockTable(t) for t in lists]
    for got, want in zip(pack_decode_inputs([1, 2], [70 * 16 - 1, 40], [1, 2], tables, 16, 4),
                         pack_decode_inputs([1, 2], [70 * 16 - 1, 40], [1, 2], lists, 16, 4)):
        assert got.tolist() == want.tolist()
    want_slot = lists[0][69] * 16 + 15
    assert pack_decode_inputs([1], [70 * 16 - 1], [1], tables[:1], 16, 1)[0][3, 0].item() == want_slot
