"""Errors that the CLI turns into one clear line and exit code 2 (no traceback)."""


class KvtierError(Exception):
    """Bad input or configuration that the user can fix; the message says how."""
