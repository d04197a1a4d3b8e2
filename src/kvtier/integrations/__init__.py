"""kvtier inside other serving engines: adapters over their objects, nothing of their own.

Each integration imports its engine (vLLM, ...) and only it does: `import kvtier` never
needs one installed. The tiers, the retention policy and the restore planner stay in
`kvtier.cache`, `kvtier.tiers` and `kvtier.policy`; an integration maps the engine's requests,
blocks and KV tensors onto their contracts.
"""
