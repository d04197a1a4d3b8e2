"""`kvtier eval`: long-context accuracy of KV compression on seeded RULER-style tasks.

Tasks are generated offline from the prose shipped in `kvtier/data/text/` (see docs/eval.md);
the runner scores every task x method x compression ratio on the real engine and records the
KV bytes each request really held.
"""
