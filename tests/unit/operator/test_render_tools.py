"""SparseModel spec.tools rendered into the model server's --tools-json flag, which the server's
own parser (sparsegate_workload.tools) accepts as the same tools."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from sparsegate.domain import render
from sparsegate_workload import gateparams, tools
from sparsegate_workload.server import build_parser

ROOT = Path(__file__).resolve().parents[3]
DOC = gateparams.make_document(gateparams.DEFAULT_PARAMS)


def _model(**spec):
    body = yaml.safe_load((ROOT / "examples" / "sparsemodel.yaml").read_text())
    body["metadata"].update(namespace="ml", uid="0b7c1f6e-1111-2222-3333-444455556666",
                            generation=1)
    body["spec"].update(spec)
    return body


def _args(model) -> list[str]:
    (container,) = render.render_deployment(model, DOC)["spec"]["template"]["spec"]["containers"]
    return container["args"]


def test_declared_tools_become_the_tools_json_flag_the_server_parses():
    declared = [{"name": "search", "url": "http://search.tools:8080/call", "timeoutMs": 500},
                {"name": "units", "url": "https://units.example/convert", "timeoutMs": 1000}]
    args = _args(_model(tools=declared))
    value = args[args.index("--tools-json") + 1]
    assert json.loads(value) == declared
    parsed = build_parser().parse_args(args[1:])  # past --host=$(POD_IP), which needs expansion
    registry = tools.ToolRegistry(http=tools.parse_tools(json.loads(parsed.tools_json)))
    assert registry.names == ("calculator", "search", "units")
    assert registry.http["search"] == tools.HttpTool("search", "http://search.tools:8080/call", 500)


def test_no_tools_no_flag():
    assert "--tools-json" not in _args(_model())
    assert "--tools-json" not in _args(_model(tools=[]))


def test_a_tool_url_with_dollar_signs_reaches_the_server_verbatim():
    """The kubelet expands $(VAR) in container args and turns $$ into $: the rendered flag
    escapes every $ so the server parses the URLs the user declared."""
    from localcluster.podplan import expand  # the pod runner's copy of the kubelet's rule

    declared = [{"name": "search", "url": "http://search.tools:8080/q?a=$(POD_IP)&b=$$c", "timeoutMs": 500}]
    argv = [expand(a, {"POD_IP": "10.1.2.3"}) for a in _args(_model(tools=declared))]
    assert json.loads(build_parser().parse_args(argv).tools_json) == declared
