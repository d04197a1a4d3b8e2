"""Run results shared by `kvtier simulate` and `kvtier bench`, so their outputs diff field by field.

- `records.py`: what one run produced: a record per request, plus per-run tier traffic, policy
  decisions, tier occupancy over time and pooled inter-token latencies
- `summary.py`: `summarize(records)`: vLLM `bench serve` figures plus kvtier's own
- `compare.py`: relative error of one result file against another (simulated vs measured)
- `report.py`, `plots.py`: Markdown for the terminal, JSON files, an HTML report with PNG plots
"""
