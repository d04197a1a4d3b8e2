"""The simulator: the engine's scheduling, the policies, the restore planner and the store
index, in simulated time on a hardware profile instead of a model forward. See docs/simulate.md.

- `profile.py` (+ `data/hardware/*.toml`), `fit.py`: hardware profiles, and fitting one to
  measured steps
- `step_model.py`: step and transfer times from FLOPs and bytes (a roofline)
- `deployment.py`: model x hardware x replicas x tier budgets x scheduler knobs
- `events.py`, `channel.py`: the event heap, links shared by concurrent transfers
- `session.py`, `replica.py`, `simulator.py`: conversations, one replica, a whole run
- `sweep.py`: where each policy wins; `seeds.py`: how far one seed's verdict holds;
  `command.py`: `kvtier simulate`
"""
