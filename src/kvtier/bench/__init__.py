"""`kvtier bench`: replay a multi-turn workload through the real engine, once per policy.

- `replay.py`: the driver: trace-time arrivals, idle time skipped by a `ReplayClock`,
  per-request records in the shared `kvtier.results` schema
- `engines.py`: one fresh engine per policy (same model, pool, tiers, concurrency)
- `auto_compression.py`: `[compression] preset = "auto"`: a preset picked from the
  observed workload (a decision of the command, so above `kvtier.compress`)
- `command.py`: the CLI (`add_arguments`, `run`)
"""
