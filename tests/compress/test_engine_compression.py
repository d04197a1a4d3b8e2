"""Presses inside the engine: outputs, budgets, positions and pool memory, on the real model."""

from __future__ import annotations

import pytest
import torch

from kvtier.compress import CompressionConfig, PressSpec, parse_method
from kvtier.compress.config import EVICTION_PRESSES
from kvtier.engine import Engine, EngineConfig, SamplingParams
from kvtier.engine.compressor import Compressor
from kvtier.errors import KvtierError
from tests.host_dtype import BLOCK_BYTES

from .conftest import MIB, prose_prompt, random_prompt

# every test here runs the model through the engine (fp32, often beside transformers)
pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def generate(engine: Engine, prompt: list[int], params: SamplingParams = GREEDY):
    engine.reset_prefix_cache()
    return engine.generate([prompt], params)[0]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def test_ratio_zero_reproduces_the_uncompressed_output(engine):
    prompt = prose_prompt(engine.tokenizer, 120)
    full = generate(engine, prompt)
    for name in EVICTION_PRESSES:
        engine.set_compression(parse_method(f"{name}:0"))
        assert engine.compressor is None  # nothing to do, nothing installed
        assert generate(engine, prompt).token_ids == full.token_ids, name


def test_a_budget_covering_the_prompt_changes_nothing(engine):
    prompt = prose_prompt(engine.tokenizer, 150)
    full = generate(engine, prompt)
    engine.set_compression(parse_method("streaming_llm@200"))
    assert engine.compressor is not None
    out = generate(engine, prompt)
    assert out.token_ids == full.token_ids
    assert out.kv_tokens_held == 150


def run_with_compaction(engine: Engine, prompt: list[int], kept_of) -> list[int]:
    """Greedy generation where, right after prefill, the request's KV is compacted to
    `kept_of(num_slots)` [layers, kv_heads, n] slots by the engine's own compaction."""
    compressor = Compressor(
        parse_method("knorm:0.5"), engine.kv_pool, engine.kv_manager, engine.model_config.num_heads
    )
    engine.reset_prefix_cache()
    request_id = engine.add_request(prompt, GREEDY)
    request = engine.scheduler.requests[request_id]
    tokens: list[int] = []
    try:
        while True:
            outs = [o for o in engine.step() if o.request_id == request_id]
            tokens += [t for o in outs for t in o.new_token_ids]
            if outs and outs[-1].finished:
                return tokens
            if len(tokens) == 1:  # the prompt is prefilled and its first token sampled
                old_table = list(engine.kv_manager.block_table(request_id))
                compressor.compact(request, kept_of(engine.kv_manager.num_slots(request)))
                assert not set(old_table) & set(engine.kv_manager.block_table(request_id))
    finally:
        engine.abort(request_id)


def test_compaction_keeping_every_token_is_exact(engine):
    prompt = prose_prompt(engine.tokenizer, 100)
    full = generate(engine, prompt).token_ids
    layers, heads = engine.model_config.num_layers, engine.model_config.num_kv_heads
    assert (
        run_with_compaction(engine, prompt, lambda n: torch.arange(n).expand(layers, heads, n))
        == full
    )
    # Slots in another order: attention does not care where a key sits, only its rotation.
    shuffled = run_with_compaction(
        engine, prompt, lambda n: torch.arange(n).flip(0).expand(layers, heads, n)
    )
    assert shuffled == full


def reference_after_eviction(hf_model, prompt: list[int], kept: torch.Tensor, steps: int):
    """transformers' model: full prefill, then keep only slots `kept` of every layer's
    cache, then greedy decoding at the true positions len(prompt), len(prompt) + 1, ..."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        token = int(out.logits[0, -1].argmax())
        for layer in cache.layers:
            layer.keys = layer.keys[:, :, kept].contiguous()
            layer.values = layer.values[:, :, kept].contiguous()
        tokens = [token]
        for i in range(steps - 1):
            position = len(prompt) + i
            out = hf_model(
                torch.tensor([[token]]),
                past_key_values=cache,
                position_ids=torch.tensor([[position]]),
                cache_position=torch.tensor([len(kept) + i]),
                use_cache=True,
            )
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
    return tokens


def test_positions_after_eviction_match_transformers(engine, hf_model_fp32):
    prompt = prose_prompt(engine.tokenizer, 200)
    engine.set_compression(
        CompressionConfig(
            presses=[PressSpec(name="streaming_llm", keep_tokens=80, options={"num_sinks": 4})]
        )
    )
    out = generate(engine, prompt)
    assert out.kv_tokens_held == 80
    kept = torch.cat((torch.arange(4), torch.arange(200 - 76, 200)))
    reference = reference_after_eviction(hf_model_fp32, prompt, kept, len(out.token_ids))
    assert out.token_ids == reference


@pytest.mark.parametrize("name", EVICTION_PRESSES)
def test_each_press_keeps_exactly_its_budget_and_releases_blocks(engine, name):
    prompt = prose_prompt(engine.tokenizer, 203)
    bytes_per_block, bs = engine.kv_pool.bytes_per_block, engine.config.block_size
    engine.set_compression(parse_method(f"{name}:0.5"))
    out = generate(engine, prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert out.kv_tokens_held == int(203 * 0.5)
    assert out.kv_bytes_held == cdiv(101, bs) * bytes_per_block
    assert engine.block_pool.num_used == 0  # nothing leaked


def test_pool_blocks_really_return_to_the_free_list():
    engine = Engine(
        EngineConfig(dtype="bfloat16", kv_cache_bytes=8 * MIB, enable_prefix_caching=False)
    )
    prompt = prose_prompt(engine.tokenizer, 300)
    free_after_prefill = {}
    for method in ("full", "snapkv:0.75"):
        engine.set_compression(parse_method(method))
        request_id = engine.add_request(prompt, GREEDY)
        while not engine.step():
            pass  # until the prompt is prefilled and the first token out
        free_after_prefill[method] = len(engine.block_pool.free_block_ids)
        engine.abort(request_id)
    bs = engine.config.block_size
    assert engine.kv_pool.num_blocks - free_after_prefill["full"] == cdiv(300, bs)
    assert engine.kv_pool.num_blocks - free_after_prefill["snapkv:0.75"] == cdiv(75, bs)


def test_compressed_blocks_do_not_corrupt_or_enter_the_prefix_cache(engine):
    prompt = prose_prompt(engine.tokenizer, 170)
    full = generate(engine, prompt)
    # A full run registers every full block it computed: prompt and decode (177 // 16).
    assert len(engine.block_pool.cached_block_ids) == 11
    engine.reset_prefix_cache()
    engine.set_compression(parse_method("snapkv:0.5"))
    compressed = engine.generate([prompt], GREEDY)[0]
    assert compressed.kv_tokens_held == 85
    # Only the prompt's full blocks, registered before compression, are cached; the
    # compacted blocks (holding a subset of the prefix) never get a key.
    assert len(engine.block_pool.cached_block_ids) == 170 // 16
    engine.set_compression(None)
    # ... and those blocks still hold the full prefix: a hit gives the uncompressed output.
    again = engine.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == 160
    assert again.token_ids == full.token_ids


def test_streaming_llm_bounds_the_cache_while_decoding(engine):
    prompt = prose_prompt(engine.tokenizer, 40)
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    full = generate(engine, prompt, params).token_ids
    engine.set_compression(parse_method("streaming_llm@64"))
    engine.reset_prefix_cache()
    request_id = engine.add_request(prompt, params)
    request = engine.scheduler.requests[request_id]
    tokens, max_slots, max_blocks = [], 0, 0
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
        if not request.is_finished:
            max_slots = max(max_slots, engine.kv_manager.num_slots(request))
            max_blocks = max(max_blocks, engine.block_pool.num_used)
    bs = engine.config.block_size
    assert len(tokens) == 80  # 120 positions, far past the 64-token budget
    assert max_slots == 64 + bs - 1  # compacted back to 64 once a block's worth piled up
    assert max_blocks <= cdiv(64 + bs, bs) + 40 // bs  # the prompt's cached blocks + a bound
    # Until the cache first exceeds its budget nothing is evicted: identical to full KV.
    assert tokens[: 64 + bs - 40] == full[: 64 + bs - 40]


def test_set_compression_is_refused_mid_request(engine):
    request_id = engine.add_request(prose_prompt(engine.tokenizer, 20), GREEDY)
    try:
        with pytest.raises(KvtierError, match="no request is in flight"):
            engine.set_compression(parse_method("tova:0.5"))
    finally:
        engine.abort(request_id)


def test_engine_config_takes_a_pipeline():
    engine = Engine(
        EngineConfig(kv_cache_bytes=4 * MIB, compression=parse_method("snapkv:0.5+knorm:0.5"))
    )
    prompt = prose_prompt(engine.tokenizer, 64)
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=2))[0]
    assert out.kv_tokens_held == 16  # 64 -> 32 -> 16: presses applied in order


def test_kivi_quantizes_the_kept_kv_but_not_the_recent_window(engine):
    prompt = prose_prompt(engine.tokenizer, 160)
    full = generate(engine, prompt)

    def kivi(bits: int) -> CompressionConfig:
        options = {"bits": bits, "group_size": 32, "residual": 32}
        return CompressionConfig(presses=[PressSpec(name="kivi", options=options)])

    engine.set_compression(kivi(8))
    int8 = generate(engine, prompt)
    engine.set_compression(kivi(2))
    int2 = generate(engine, prompt)
    assert int8.kv_tokens_held == int2.kv_tokens_held == 160  # no token evicted
    assert int8.token_ids[:4] == full.token_ids[:4]  # 8 bits: the same first tokens
    assert int2.token_ids != full.token_ids  # 2 bits over 128 of 160 tokens: it shows
    assert engine.block_pool.num_used == 0


def test_a_preempted_compressed_request_recomputes_and_compresses_again():
    # 10 blocks of 16 tokens for three 60-token prompts growing to 100: someone is preempted.
    engine = Engine(
        EngineConfig(kv_cache_bytes=10 * BLOCK_BYTES, compression=parse_method("snapkv:0.5"))
    )
    assert engine.kv_pool.num_blocks == 10
    prompts = [random_prompt(60, seed) for seed in (1, 2, 3)]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert engine.stats().num_preemptions >= 1
    assert all(len(o.token_ids) == 40 and o.finish_reason == "length" for o in outs)
    held = sorted(o.kv_tokens_held for o in outs)
    assert held[0] == 30  # compressed once, after its 60-token prompt
    assert held[-1] > 30  # recomputed with its first outputs, then compressed again
    assert engine.block_pool.num_used == 0
