"""Block keys are content addresses: stable across processes, salted, chained."""

from __future__ import annotations

import subprocess
import sys

from kvtier.engine.hashing import block_key, extend_block_keys, namespace_bytes

TOKENS = list(range(1000, 1016))
NS = namespace_bytes("smollm2:bfloat16", None)


def test_keys_are_stable_across_processes():
    code = (
        "from kvtier.engine.hashing import block_key, namespace_bytes;"
        "ns = namespace_bytes('smollm2:bfloat16', None);"
        "k = block_key(None, list(range(1000, 1016)), ns);"
        "print(block_key(k, [1, 2, 3], ns).hex())"
    )
    # A different PYTHONHASHSEED would change Python's hash(); keys must not care.
    child = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
    )
    here = block_key(block_key(None, TOKENS, NS), [1, 2, 3], NS).hex()
    assert child.stdout.strip() == here


def test_known_value_pins_the_encoding():
    # If this changes, every stored key (disk, remote tier) silently stops hitting.
    key = block_key(None, [1, 2, 3], namespace_bytes("m", "t"))
    assert key.hex() == "f2d40b852b95567fabd9566a34b981284c5e0368131e1bdda69685becec80404"


def test_namespaces_and_tenant_salts_separate_keys():
    keys = {
        block_key(None, TOKENS, namespace_bytes("model-a", None)),
        block_key(None, TOKENS, namespace_bytes("model-b", None)),
        block_key(None, TOKENS, namespace_bytes("model-a", "tenant-1")),
        block_key(None, TOKENS, namespace_bytes("model-a", "tenant-2")),
        # Length prefixes: moving a byte between model id and salt is a different namespace.
        block_key(None, TOKENS, namespace_bytes("model-at", "enant-1")),
    }
    assert len(keys) == 5


def test_keys_chain_over_parents():
    parent_a = block_key(None, [1] * 16, NS)
    parent_b = block_key(None, [2] * 16, NS)
    assert block_key(parent_a, TOKENS, NS) != block_key(parent_b, TOKENS, NS)
    assert block_key(None, TOKENS, NS) != block_key(parent_a, TOKENS, NS)
    assert block_key(parent_a, TOKENS, NS) == block_key(parent_a, list(TOKENS), NS)


def test_extend_hashes_only_full_blocks_and_is_incremental():
    tokens = list(range(40))
    keys = extend_block_keys([], tokens, 16, NS)
    assert len(keys) == 2  # 40 tokens: two full blocks, the partial third is not keyed
    assert keys[1] == block_key(keys[0], tokens[16:32], NS)
    more = extend_block_keys(list(keys), [*tokens, *range(40, 48)], 16, NS)
    assert more[:2] == keys and len(more) == 3
