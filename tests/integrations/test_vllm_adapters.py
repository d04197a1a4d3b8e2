"""The vLLM connector's parts that need no vLLM: its settings, the block port over paged
per-layer KV tensors, sessions reconstructed from prefix chains, and the scheduler side's
messages to the worker, and the worker's view of vLLM's block pool."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from kvtier.errors import KvtierError
from kvtier.integrations.vllm.block_view import VllmBlockView
from kvtier.integrations.vllm.kv_port import PagedKVPort
from kvtier.integrations.vllm.messages import DeviceState, WorkerReply
from kvtier.integrations.vllm.requests import RequestView, SessionChains, identity, load_limit
from kvtier.integrations.vllm.scheduler_side import SchedulerSide
from kvtier.integrations.vllm.settings import parse_settings
from kvtier.load_limit import LoadLimit

BLOCK = 16


def test_settings_from_a_kvtier_toml_with_inline_keys_winning(tmp_path):
    config = tmp_path / "kvtier.toml"
    config.write_text(
        '[tiers]\nhost_bytes = "64MiB"\nchunk_tokens = 256\n\n[policy]\nname = "ttl"\n'
        "interval_s = 3\n"
    )
    settings = parse_settings(
        {
            "config": str(config),
            "tiers": {"chunk_tokens": 128},
            "policy": {"ttl": {"seconds": {"host": 9}}},
        }
    )
    assert settings.tiers.host_bytes == 64 << 20
    assert settings.tiers.chunk_tokens == 128
    # vLLM shows a connector no evictions: finished requests are written through
    assert settings.tiers.write_through and settings.tiers.spill_on_evict
    assert settings.policy.name == "ttl"
    assert settings.policy.interval_s == 3
    assert settings.policy.ttl.seconds["host"] == 9


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tier": {}}, "unknown key 'tier'"),
        ({"tiers": {"host_bytes": 0}}, "every tier is off"),
        ({"tiers": {"chunk_tokens": 128, "colour": 1}}, "tiers.colour"),
        ({"tiers": "host"}, "a table"),
        ({"policy": {"name": "no-such-policy"}}, "no-such-policy"),
        ({"config": "/nonexistent/kvtier.toml"}, "does not exist"),
    ],
)
def test_bad_settings_are_refused_with_the_key_named(extra, message):
    with pytest.raises(KvtierError, match=message):
        parse_settings(extra)


@pytest.mark.parametrize("block_dim", [0, 1])
def test_port_moves_whole_blocks_of_every_layer_through_vllms_block_ids(block_dim):
    num_blocks, shape = 10, (2, 3, BLOCK, 8)  # (K/V, heads, tokens, head dim)
    layout = list(shape)
    layout.insert(block_dim, num_blocks)
    torch.manual_seed(0)
    layers = {f"layer.{i}": torch.randn(layout) for i in range(4)}
    port = PagedKVPort(layers, num_blocks)
    assert tuple(port.block_shape) == (4, *shape)
    blocks = port.read_blocks([7, 2])
    assert torch.equal(blocks[0, 3], layers["layer.3"].select(block_dim, 7))
    before = {name: t.clone() for name, t in layers.items()}
    port.write_blocks([5, 0], blocks)
    for name, tensor in layers.items():
        assert torch.equal(tensor.select(block_dim, 5), before[name].select(block_dim, 7))
        assert torch.equal(tensor.select(block_dim, 0), before[name].select(block_dim, 2))
        assert torch.equal(tensor.select(block_dim, 1), before[name].select(block_dim, 1))
    with pytest.raises(KvtierError, match="do not fit"):
        port.write_blocks([1], blocks[:, :2])


def test_port_refuses_a_layout_whose_block_axis_is_ambiguous():
    with pytest.raises(KvtierError, match="block axis"):
        PagedKVPort({"layer.0": torch.zeros(4, 4, BLOCK, 8)}, num_blocks=4)


@dataclass
class FakeVllmRequest:
    """The attributes RequestView reads from vllm.v1.request.Request."""

    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None
    kv_transfer_params: dict | None = None
    num_computed_tokens: int = 0
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.all_token_ids)


def view_of(request: FakeVllmRequest) -> RequestView:
    tenant, session = identity(request)
    return RequestView(request, "smollm2", tenant, session)


def test_identity_from_kv_transfer_params_else_cache_salt():
    sent = FakeVllmRequest("a", [1] * 40, "salt", {"tenant": "acme", "session_id": "s1"})
    assert identity(sent) == ("acme", "s1")
    assert identity(FakeVllmRequest("b", [1] * 40, "salt")) == ("salt", None)
    assert identity(FakeVllmRequest("c", [1] * 40, None, {"session_id": 7})) == (None, None)


@pytest.mark.parametrize(
    ("params", "expected", "warned"),
    [
        ({}, LoadLimit(), False),
        ({"kv_load_tiers": ["host"]}, LoadLimit(frozenset({"host"})), False),
        ({"kv_load_tiers": "disk"}, LoadLimit(frozenset({"disk"})), False),
        ({"kv_load_tiers": []}, LoadLimit(frozenset()), False),  # load nothing
        ({"kv_load_tiers": ["host", "gpu"]}, LoadLimit(frozenset({"host"})), True),
        ({"kv_load_tiers": ["cpu"]}, LoadLimit(), True),  # only unknown names: every tier
        ({"max_load_tokens": 256}, LoadLimit(max_tokens=256), False),
        ({"max_load_tokens": -1}, LoadLimit(), True),
        ({"max_load_tokens": True}, LoadLimit(), True),
    ],
)
def test_load_limit_follows_vllms_offloading_semantics(params, expected, warned, caplog):
    sent = FakeVllmRequest("r", [1] * 40, None, params)
    assert load_limit(sent, ("host", "disk")) == expected
    assert any("ignored" in r.getMessage() for r in caplog.records) == warned


def test_a_prompt_that_extends_an_earlier_turn_continues_its_session():
    chains = SessionChains()
    turn1 = view_of(FakeVllmRequest("r1", list(range(100, 150))))
    keys1 = turn1.keys_of_full_blocks(BLOCK)
    session = chains.session_of(keys1, "r1")
    chains.remember(session, [keys1[-1]])
    turn2 = view_of(FakeVllmRequest("r2", list(range(100, 150)) + list(range(7, 40))))
    assert chains.session_of(turn2.keys_of_full_blocks(BLOCK), "r2") == session
    stranger = view_of(FakeVllmRequest("r3", list(range(500, 580))))
    assert chains.session_of(stranger.keys_of_full_blocks(BLOCK), "r3") == "chain-r3"


def test_the_same_tokens_of_another_tenant_have_other_keys_and_no_session():
    chains = SessionChains()
    mine = view_of(FakeVllmRequest("r1", list(range(100, 150)), cache_salt="a"))
    keys = mine.keys_of_full_blocks(BLOCK)
    chains.remember("s-a", [keys[-1]])
    theirs = view_of(FakeVllmRequest("r2", list(range(100, 170)), cache_salt="b"))
    their_keys = theirs.keys_of_full_blocks(BLOCK)
    assert not set(keys) & set(their_keys)
    assert chains.session_of(their_keys, "r2") == "chain-r2"


def test_scheduler_side_asks_the_worker_then_answers_vllm_from_its_reply():
    side = SchedulerSide(block_size=BLOCK, chunk_tokens=2 * BLOCK)
    request = FakeVllmRequest("r1", list(range(100, 200)))
    side.on_new_request(request)
    assert side.matched_tokens(request, 0) is None  # vLLM schedules it once the answer is back
    assert side.matched_tokens(request, 0) is None  # asked once, not again
    messages = side.step({}, lambda rid: [])
    assert [(m.ask, m.num_computed_tokens) for m in messages.lookups] == [(False, 0), (True, 0)]
    side.on_reply(WorkerReply({"r1": (0, 64)}, may_hit=True))
    assert side.matched_tokens(request, 0) == 64
    side.allocated(request, [7, 8, 9, 10, 11, 12, 13], 64)
    (allocation,) = side.step({}, lambda rid: []).allocations
    assert allocation.block_ids == [7, 8, 9, 10]  # 64 tokens from vLLM's hit at 0
    request.num_computed_tokens = 90
    assert side.matched_tokens(request, 0) is None  # preempted, asked again from scratch
    (lookup,) = side.step({}, lambda rid: []).lookups
    assert lookup.readmitted


def allocated_with_sources(split: dict[str, int]) -> tuple[SchedulerSide, FakeVllmRequest]:
    """A request the worker promised 64 tokens from the tiers in `split`, and vLLM took them."""
    side = SchedulerSide(block_size=BLOCK, chunk_tokens=2 * BLOCK)
    request = FakeVllmRequest("r1", list(range(100, 200)))
    side.on_new_request(request)
    side.matched_tokens(request, 0)
    side.step({}, lambda rid: [])
    side.on_reply(WorkerReply({"r1": (0, 64)}, may_hit=True, sources={"r1": split}))
    assert side.matched_tokens(request, 0) == 64
    side.allocated(request, list(range(7)), 64)
    return side, request


def test_scheduler_side_names_the_tiers_the_promised_tokens_come_from_once():
    side, request = allocated_with_sources({"host": 32, "disk": 32})
    assert side.hit_sources(request, 32) == {}  # vLLM took other than promised: unknown
    side.on_reply(WorkerReply({}, may_hit=True))
    assert side.hit_sources(request, 64) == {}  # asked once per answer


def test_scheduler_side_hit_sources_add_up_to_what_vllm_took():
    side, request = allocated_with_sources({"host": 64})
    assert side.hit_sources(request, 64) == {"host": 64}


def test_scheduler_side_answers_zero_at_once_when_nothing_is_stored():
    side = SchedulerSide(block_size=BLOCK, chunk_tokens=2 * BLOCK)
    side.on_reply(WorkerReply({}, may_hit=False))
    request = FakeVllmRequest("r1", list(range(100, 200)))
    side.on_new_request(request)
    assert side.matched_tokens(request, 0) == 0


def test_scheduler_side_saves_each_chunk_once_in_the_step_that_fills_it():
    side = SchedulerSide(block_size=BLOCK, chunk_tokens=2 * BLOCK)
    request = FakeVllmRequest("r1", list(range(100, 180)))  # 80 tokens: 2 chunks and a tail
    side.on_new_request(request)
    side.step({}, lambda rid: [])
    blocks = list(range(20, 25))
    (save,) = side.step({"r1": 80}, lambda rid: blocks).saves
    assert (save.first_chunk, save.end_chunk, save.block_ids) == (0, 2, blocks[:4])
    assert save.tokens == []  # the worker has the prompt from the lookup
    request.num_computed_tokens = 80
    request.all_token_ids += list(range(16))  # decoding: 96 tokens, the third chunk fills
    assert side.step({"r1": 1}, lambda rid: blocks).saves == []
    (save,) = side.step({"r1": 16}, lambda rid: blocks).saves
    assert (save.first_chunk, save.end_chunk, save.tokens_from) == (2, 3, 80)
    assert save.tokens == list(range(16))
    side.finished(request)
    (finish,) = side.step({}, lambda rid: blocks).finishes
    assert (finish.request_id, finish.num_computed_tokens) == ("r1", 80)


def test_scheduler_side_reports_the_requests_vllm_has_not_admitted():
    side = SchedulerSide(block_size=BLOCK, chunk_tokens=2 * BLOCK)
    first, second = (
        FakeVllmRequest(f"r{i}", list(range(100, 100 + n))) for i, n in ((1, 40), (2, 70))
    )
    for request in (first, second):
        side.on_new_request(request)
    assert side.waiting_tokens() == (40, 70)  # head first
    side.allocated(first, [1, 2, 3], 0)
    assert side.waiting_tokens() == (70,)
    side.finished(first, [1, 2])
    (finish,) = side.step({}, lambda rid: []).finishes
    assert finish.cached_block_ids == [1, 2]


def test_block_view_shows_vllms_idle_cached_blocks_to_the_policy_only():
    view = VllmBlockView(num_blocks=10)
    keys = [b"k0", b"k1", b"k2"]
    view.idle(keys, [4, 5])  # a finished request's two cached blocks; the third was partial
    view.update(DeviceState(waiting_tokens=(64,), free_blocks=6))
    assert [view.resident(k) for k in keys] == [4, 5, None]
    assert view.lookup(b"k0") is None  # loads are planned from vLLM's own hits
    with view.acting():
        assert view.lookup(b"k0") == 4
    assert (view.ref_counts[4], view.ref_counts[7]) == (0, 1)
    assert view.num_free == 4  # vLLM's 6 free blocks, less the 2 holding a paused session
    assert view.drop_cached([4, 7]) == 1  # 7 is no idle block: vLLM's, left alone
    assert view.resident(b"k0") is None and view.num_free == 5
    view.update(DeviceState(free_blocks=6, gone=(5,)))  # vLLM handed block 5 to a request
    assert view.resident(b"k1") is None and view.num_free == 6
    assert view.take_orders() == ([4], []) and view.take_orders() == ([], [])
