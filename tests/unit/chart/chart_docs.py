"""Values table for charts/sparsegate/README.md, generated from values.yaml `# --` comments.

`python tests/unit/chart/chart_docs.py` rewrites the README's table; test_chart_readme.py fails
when the committed README is out of date (like helm-docs + `git diff --exit-code`).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import yaml

CHART = Path(__file__).resolve().parents[3] / "charts" / "sparsegate"
BEGIN, END = "<!-- values:begin -->", "<!-- values:end -->"


def documented_values(text: str) -> list[tuple[str, str, str]]:
    """(dotted key, default as JSON, description) for each `# --` documented value."""
    values = yaml.safe_load(text)
    rows, stack, comment = [], [], []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            comment = [stripped[4:].strip()]
            continue
        if stripped.startswith("#") and comment:
            comment.append(stripped[1:].strip())
            continue
        m = re.match(r"^(\s*)([A-Za-z][\w-]*):", line)
        if not m:
            continue
        indent = len(m.group(1))
        stack = [(i, k) for i, k in stack if i < indent] + [(indent, m.group(2))]
        if comment:
            keys = [k for _, k in stack]
            node = values
            for k in keys:
                node = node[k]
            rows.append((".".join(keys), json.dumps(node), " ".join(comment)))
            comment = []
    return rows


def table() -> str:
    lines = ["| Key | Default | Description |", "|-----|---------|-------------|"]
    for key, default, desc in documented_values((CHART / "values.yaml").read_text()):
        lines.append(f"| `{key}` | `{default}` | {desc} |")
    return "\n".join(lines)


def render_readme(readme: str) -> str:
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


if __name__ == "__main__":
    path = CHART / "README.md"
    path.write_text(render_readme(path.read_text()))
    sys.stdout.write(f"wrote {path}\n")
