"""`mlxq --help` and `mlxq worker` import nothing of the bench harness (its arms, workloads, report,
plots): only the verb's argument definitions (mlxq/bench/cli.py, config.py) load with the CLI."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
from mlxq import cli
try:
    cli.main({argv})
except SystemExit:
    pass
print(sorted(m for m in sys.modules if m.startswith(("mlxq.bench", "matplotlib", "psutil"))))
"""
ARGUMENTS_ONLY = "['mlxq.bench', 'mlxq.bench.cli', 'mlxq.bench.config']"


def modules_after(argv: list[str]) -> str:
    done = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True, timeout=120)
    return done.stdout.strip().splitlines()[-1]


def test_the_harness_loads_only_when_mlxq_bench_runs():
    assert modules_after(["--help"]) == ARGUMENTS_ONLY
    assert modules_after(["worker", "--help"]) == ARGUMENTS_ONLY
    assert modules_after(["bench", "--help"]) == ARGUMENTS_ONLY
