"""`kvtier analyze`: what a multi-turn workload implies for the KV cache.

- `metrics.py`: turn kinds, idle gaps, sessions, history growth, prefix sharing, KV bytes
- `report.py`: rich tables and JSON (`kvtier.analyze/1`)
- `plots.py`: PNG figures (matplotlib, imported only when plotting)
- `command.py`: the command's flags
"""
