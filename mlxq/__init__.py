"""mlxq: Redis/RQ-queued batch inference on MLX. CLI, demo and benchmark glue live here."""
