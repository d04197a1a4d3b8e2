"""Async streaming: deltas add up to the offline text; a cancelled stream frees its blocks."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvtier.engine import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=48)
CHAT = [{"role": "user", "content": "Describe a sunrise over the mountains."}]


@pytest.fixture
def engine(bf16_engine):
    yield bf16_engine
    bf16_engine.close()  # stop the background loop so later tests step by hand


async def _collect(engine, prompt, params):
    return [out async for out in engine.stream(prompt, params)]


def test_stream_deltas_concatenate_to_the_generated_text(engine):
    (offline,) = engine.generate([CHAT], GREEDY)
    outs = asyncio.run(_collect(engine, CHAT, GREEDY))
    assert "".join(o.delta_text for o in outs) == offline.text
    assert [t for o in outs for t in o.new_token_ids] == offline.token_ids
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert outs[-1].finish_reason == offline.finish_reason
    assert len(outs) == len(offline.token_ids)  # one output per token: really streamed


def test_concurrent_streams_all_finish(engine):
    async def main():
        prompts = [
            [{"role": "user", "content": f"Say a word about the number {i}."}] for i in range(4)
        ]
        return await asyncio.gather(*(_collect(engine, p, GREEDY) for p in prompts))

    results = asyncio.run(main())
    assert all(outs[-1].finished for outs in results)


def _wait_until_idle(engine, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests() or engine.stats().kv_blocks_used:
        assert time.monotonic() < deadline, "the aborted request still holds blocks"
        time.sleep(0.01)


def test_cancelling_the_consumer_aborts_and_frees_blocks(engine):
    long_run = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)

    async def main():
        received = []

        async def consume():
            async for out in engine.stream(CHAT, long_run):
                received.append(out)

        task = asyncio.create_task(consume())
        while len(received) < 3:
            await asyncio.sleep(0.01)
        assert engine.stats().kv_blocks_used > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return received

    received = asyncio.run(main())
    _wait_until_idle(engine)
    assert not received[-1].finished


def test_leaving_the_loop_early_aborts_too(engine):
    long_run = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)

    async def main():
        stream = engine.stream(CHAT, long_run)
        async for out in stream:
            if out.new_token_ids:
                break
        await stream.aclose()

    asyncio.run(main())
    _wait_until_idle(engine)
