"""Which rank holds which part of which table.

A table is cut into shards; a shard is a block of rows x columns on one rank:

    table_wise      column_wise (3 ranks)     row_wise (3 ranks)     data_parallel
    ┌────────┐      ┌──┬──┬──┐                ┌────────┐ rank 0      ┌────────┐ every
    │ rank 2 │      │r0│r1│r2│                ├────────┤ rank 1      │  all   │ rank,
    │        │      │  │  │  │                ├────────┤ rank 2      │        │ a full
    └────────┘      └──┴──┴──┘                └────────┘             └────────┘ copy

Model-parallel shards (the first three) receive ids by all-to-all and send pooled
vectors back; replicated tables look up locally and exchange KV gradients. What
each strategy does lives in its own file under embeddings/sharding/.

    types.py      ShardingType, Shard, TablePlan, ShardingPlan (and its JSON), PlanError
    sizes.py      parse_size ("16GB"), format_bytes ("3.2 GiB")
    estimate.py   RankMemory, plan_memory (bytes per rank), rank_costs (the balance)
    planner.py    auto_plan (strategy and ranks for every table), pins, fixed_plan
    describe.py   describe_plan: the plan and each rank's memory as text

Import names from the module that holds them.
"""
