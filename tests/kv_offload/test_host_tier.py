"""The host tier's LRU: slots reused least recently used first, pinned slots kept, tokens checked."""

import numpy as np
import pytest

from jaxpaged.kv_offload import HostTier

SHAPE = (2, 2, 4, 1, 3)  # L, K/V, block_size, KH, D


def test_put_get_and_lru_order():
    t = HostTier(2, SHAPE, np.float32)
    a, b = t.put(10, (1, 2)), t.put(20, (3, 4))
    assert {a, b} == {0, 1}
    assert t.get(10, (1, 2)) == a  # 10 is now the most recently used
    c = t.put(30, (5, 6))
    assert c == b and 20 not in t and t.key_of(c) == (30, (5, 6))
    assert t.get(10, (1, 2)) == a


def test_tokens_must_match_and_repeated_put_only_touches():
    t = HostTier(2, SHAPE, np.float32)
    s = t.put(10, (1, 2))
    assert t.get(10, (1, 3)) is None  # a hash collision is a miss
    assert t.put(10, (1, 2)) is None and t.get(10, (1, 2)) == s and len(t) == 1


def test_pinned_slots_are_not_reused_until_unpinned():
    t = HostTier(2, SHAPE, np.float32)
    a, b = t.put(1, ()), t.put(2, ())
    t.pin(a)
    assert t.put(3, ()) == b  # the unpinned one goes, although 1 is older
    t.pin(b)
    assert t.put(4, ()) is None  # everything pinned: no slot
    t.unpin_all()
    assert t.put(4, ()) == a


def test_data_is_allocated_lazily_with_the_block_shape_and_dtype():
    t = HostTier(3, SHAPE, np.float16)
    assert t._data is None
    assert t.data.shape == (3, 2, 2, 4, 1, 3) and t.data.dtype == np.float16
    assert t.block_bytes == 2 * 2 * 4 * 1 * 3 * 2


def test_needs_a_slot():
    with pytest.raises(ValueError, match="at least one"):
        HostTier(0, SHAPE, np.float32)
