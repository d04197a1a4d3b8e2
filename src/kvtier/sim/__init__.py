"""The simulator: the engine's scheduling, the policies, the restore planner and the store
index, in simulated time on a hardware profile instead of a model forward. See docs/simulate.md.

- `profile.py` (+ `data/hardware/*.toml`), `fit.py`: hardware profiles, and fitting one to
  measured steps
- `step_model.py`: step and transfer times from FLOPs and bytes (a roofline)
- `deployment.py`: model x hardware x replicas x tier budgets x scheduler knobs
- `events.py`, `channel.py`: the event heap, links shared by concurrent transfers
- `session.py`, `replica.py`, `simulator.py`: conversations, one replica, a whole run
- a replica's parts, named as the engine's connector names its own (cache/): `chunks.py`
  (where each chunk is), `restore.py`, `spill.py`, `chunk_actions.py` (the policy
  executor's target), `policy_runner.py`; and `pool.py` (device pages, kept ones too),
  `links.py`, `prefixes.py`, `requests.py`
- `sweep.py`: where each policy wins; `seeds.py`: how far one seed's verdict holds;
  `command.py`: `kvtier simulate`
"""
