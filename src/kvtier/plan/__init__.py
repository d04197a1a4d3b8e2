"""Capacity planning: KV bytes for a model geometry, what fits where, reload vs recompute."""
