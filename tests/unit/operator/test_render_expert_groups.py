"""SparseModel spec.expertGroups rendered into the model server's --expert-groups-json flag, which
the server's own parser accepts as the same groups and refuses when an index is out of range."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sparsegate.domain import render
from sparsegate_contracts.request_access import AccessDocumentError, parse_expert_groups
from sparsegate_workload import gateparams
from sparsegate_workload.server import build_parser, main

ROOT = Path(__file__).resolve().parents[3]
DOC = gateparams.make_document(gateparams.DEFAULT_PARAMS)


def _model(**spec):
    body = yaml.safe_load((ROOT / "examples" / "sparsemodel.yaml").read_text())
    body["metadata"].update(namespace="ml", uid="0b7c1f6e-1111-2222-3333-444455556666", generation=1)
    body["spec"].update(spec)
    return body


def _args(model) -> list[str]:
    (container,) = render.render_deployment(model, DOC)["spec"]["template"]["spec"]["containers"]
    return container["args"]


def test_declared_groups_become_the_flag_the_server_parses():
    declared = [{"name": "math", "experts": [3, 1]}, {"name": "code", "experts": [7]}]
    args = _args(_model(expertGroups=declared))
    assert json.loads(args[args.index("--expert-groups-json") + 1]) == declared
    parsed = build_parser().parse_args(args[1:])  # past --host=$(POD_IP), which needs expansion
    groups = parse_expert_groups(json.loads(parsed.expert_groups_json), num_experts=8)
    assert groups == {"math": (1, 3), "code": (7,)}


def test_no_groups_no_flag():
    assert "--expert-groups-json" not in _args(_model())
    assert "--expert-groups-json" not in _args(_model(expertGroups=[]))


@pytest.mark.parametrize("groups, field", [
    ([{"name": "a", "experts": [8]}], "expertGroups[0].experts"),
    ([{"name": "a", "experts": [1]}, {"name": "a", "experts": [2]}], "expertGroups[1].name"),
    ([{"name": "A", "experts": [1]}], "expertGroups[0].name"),
    ([{"name": "a", "experts": [1, 1]}], "expertGroups[0].experts"),
    ([{"name": "a", "experts": []}], "expertGroups[0].experts"),
    ([{"name": "a", "experts": [True]}], "expertGroups[0].experts"),
    ({"name": "a"}, "expertGroups"),
])
def test_bad_groups_are_refused_naming_the_field(groups, field):
    with pytest.raises(AccessDocumentError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse_expert_groups(groups, num_experts=8)


def test_the_server_refuses_to_start_with_an_expert_it_lacks(capsys):
    with pytest.raises(SystemExit):
        main(["--experts", "4", "--expert-groups-json", '[{"name": "a", "experts": [4]}]'])
    assert "--expert-groups-json: expertGroups[0].experts: 4 is not an expert index below 4" in capsys.readouterr().err
