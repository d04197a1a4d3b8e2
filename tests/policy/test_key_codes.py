"""The two ways to group sessions by key agree: from kept codes (the session table's) and from
the keys themselves (`cdf_table` called without groups)."""

from __future__ import annotations

import random

import numpy as np

from kvtier.policy.key_codes import KeyCodes, group_keys


def test_grouping_by_codes_equals_grouping_by_keys():
    rng = random.Random(4)
    codes = KeyCodes()
    for _ in range(5):  # codes handed out in an order unlike the sessions'
        codes.code(("t", f"app{rng.randrange(30)}"))
    for n in (0, 1, 7, 200):
        keys = [("t", f"app{rng.randrange(30)}") for _ in range(n)]
        by_codes = codes.groups(np.array([codes.code(k) for k in keys], dtype=np.int64))
        by_keys = group_keys(keys)
        assert by_codes.distinct == by_keys.distinct == list(dict.fromkeys(keys))
        assert by_codes.at.tolist() == by_keys.at.tolist()
        assert [by_keys.distinct[i] for i in by_keys.at] == keys
