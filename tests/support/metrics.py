"""Reading kvtier's Prometheus endpoint in tests."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from support.runtime import WAIT_S


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=WAIT_S) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}
