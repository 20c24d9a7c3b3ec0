"""`mlxq bench --metrics-port P`: the overhead scenario's fake worker serves its Prometheus metrics on
P (`mlxq worker --metrics-port`), and this thread scrapes them every `interval_s` while the scenario
runs, so a run with metrics on pays for the updates and for the scrapes (docs/bench/cpu/metrics-overhead)."""

from __future__ import annotations

import threading
import time
import urllib.request
from typing import Any

from mlxq.bench.stats import distribution


class MetricsScraper(threading.Thread):
    def __init__(self, port: int, interval_s: float = 1.0) -> None:
        super().__init__(name="metrics-scraper", daemon=True)
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.interval_s = interval_s
        self.durations: list[float] = []
        self.failures = 0  # no worker listening (between the scenario's workers)
        self._finished = threading.Event()

    def run(self) -> None:
        while not self._finished.wait(self.interval_s):
            started = time.perf_counter()
            try:
                with urllib.request.urlopen(self.url, timeout=5) as response:
                    response.read()
            except OSError:
                self.failures += 1
                continue
            self.durations.append(time.perf_counter() - started)

    def __enter__(self) -> "MetricsScraper":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._finished.set()
        self.join(timeout=10)

    def summary(self) -> dict[str, Any]:
        return {"url": self.url, "interval_s": self.interval_s, "scrapes": len(self.durations),
                "unanswered": self.failures, "scrape_ms": distribution([d * 1000 for d in self.durations])}
