"""Settings: every table of kvtier.toml (`[tiers]`, `[scheduling]`, `[policy]`,
`[compression]`, `[server]`), read once from the file, `KVTIER_<TABLE>__<KEY>` variables and
flags, for every command (`load.load_settings`, `flags.from_args`); the same flag groups
everywhere (`flags`); `kvtier config show` (`command`, `show`); the reference page's key
tables (`reference`). The keys are defined on their typed models (`catalog` lists them)."""
