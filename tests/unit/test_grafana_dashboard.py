"""deploy/grafana/cursus-dashboard.json: valid JSON, and every metric it queries is one the broker exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dashboard_queries_only_exported_metrics() -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "cursus-dashboard.json").read_text())
    exported = (ROOT / "cursus" / "broker" / "metrics.py").read_text()
    names = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names |= set(re.findall(r"\b((?:cursus|cluster|process)_[a-z_]+)", target["expr"]))
    assert names
    for name in sorted(names):
        base = name.removesuffix("_bucket")
        assert base.startswith("process_") or f'"{base}"' in exported or f'"{base.removesuffix("_total")}"' in exported, name
