"""Eviction presses: one method per file, each scoring tokens for `EvictionPress.select`."""
