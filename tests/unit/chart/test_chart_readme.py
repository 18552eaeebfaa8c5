"""The chart README's values table is generated from values.yaml and kept current."""

from __future__ import annotations

from chart_docs import CHART, documented_values, render_readme


def test_readme_values_table_is_current():
    readme = (CHART / "README.md").read_text()
    assert render_readme(readme) == readme, "run: python tests/unit/chart/chart_docs.py"


def test_table_covers_values():
    keys = {k for k, _, _ in documented_values((CHART / "values.yaml").read_text())}
    assert {"operator.replicas", "operator.leaderElection.enabled", "agent.enabled",
            "operator.watchNamespaces", "agent.xdpMode"} <= keys
