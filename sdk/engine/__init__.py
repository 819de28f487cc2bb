"""The execution plane: the engine loop (`engine`), the physical memory behind the scheduler's
logical blocks (`kv_pool`), the per-step batch context (`context`) and the scheduler's cache
groups from a model's geometry (`geometry`)."""
