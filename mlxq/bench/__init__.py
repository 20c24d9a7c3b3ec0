"""`mlxq bench`: one machine, one model, the same requests through every arm (one job at a time,
the engine bound, mlxq end to end, mlx_lm.server, vllm-mlx), plus the queue's own scenarios
(overhead, late joiner, RL rollouts, soak); writes report.json, table.md and plot.png.

Modules: cli (the verb), config, workloads (prompts, arrivals, records), stats, arms and arm_* (one
per arm), scenarios and soak, report, runner (the order of a run), procs (processes, machine facts).
"""
