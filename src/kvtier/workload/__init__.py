"""Multi-turn workloads: one in-memory shape for generated sessions and imported traces.

- `model.py`: `Workload` -> `Session` -> `Turn`, and `flatten()` to time-ordered `Request`s
- `generator.py` (+ `config.py`, `presets.py`, `text.py`): seeded synthetic conversations
- `traces.py`: load a trace file (`mooncake.py`, `bailian.py`, `sharegpt.py`; shared parts in
  `jsonl.py` and `records.py`); `scale.py` shrinks lengths to fit a context
- `blocks.py`: prefix block ids, so prefix sharing is known for text workloads too
- `clock.py`: virtual, real and idle-compressing replay clocks
"""
