"""What the operator keeps of watched objects holds each repeated string once (``domain.interned``)."""

from __future__ import annotations

import json

from sparsegate.domain import fleet_view, interned
from sparsegate.domain.policy_compile import pod_info

POD = {
    "metadata": {"name": "m-1-abc-0", "namespace": "team-a", "uid": "u-pod",
                 "labels": {"sparsegate.dev/model": "m-1", "pod-template-hash": "abc"},
                 "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "m-1-abc",
                                      "uid": "u-rs", "controller": True}]},
    "spec": {"containers": [{"name": "model-server", "ports": [{"name": "admin", "containerPort": 8443},
                                                                  {"name": "http", "containerPort": 8080}]}]},
    "status": {"phase": "Running", "podIP": "10.0.0.7"},
}


def _decoded() -> dict:
    return json.loads(json.dumps(POD))  # each watch event is decoded on its own


def test_deep_copies_the_shape_and_interns_every_string() -> None:
    a, b = _decoded(), _decoded()
    assert a["metadata"]["namespace"] is not b["metadata"]["namespace"]
    ka, kb = interned.deep(a), interned.deep(b)
    assert ka == a and ka is not a and ka["metadata"] is not a["metadata"]
    assert ka["metadata"]["namespace"] is kb["metadata"]["namespace"]
    assert next(iter(ka["metadata"]["labels"])) is next(iter(kb["metadata"]["labels"]))
    assert interned.deep((1, ["x", None, 2.5], True)) == (1, ["x", None, 2.5], True)
    assert interned.text(7) == 7 and interned.text("team-a") is ka["metadata"]["namespace"]


def test_projections_of_separately_decoded_objects_share_their_strings() -> None:
    one, two = fleet_view.pod_view(_decoded()), fleet_view.pod_view(_decoded())
    assert one == two
    ref_one, ref_two = one["metadata"]["ownerReferences"][0], two["metadata"]["ownerReferences"][0]
    assert ref_one["kind"] is ref_two["kind"] and ref_one["uid"] is ref_two["uid"]
    assert one["metadata"]["namespace"] is two["metadata"]["namespace"]
    # The ReplicaSet's own projection and the pod's reference to it hold one uid string.
    rs = fleet_view.owner_view(json.loads(json.dumps({"metadata": {"name": "m-1-abc", "namespace": "team-a",
                                                                    "uid": "u-rs"}})))
    assert rs["metadata"]["uid"] is ref_one["uid"]


def test_pod_info_interns_its_strings_and_shares_its_ports() -> None:
    one, two = pod_info(_decoded()), pod_info(_decoded())
    assert one == two and one is not None and two is not None
    assert one.namespace is two.namespace and one.labels[0][0] is two.labels[0][0]
    assert all(p is q for p, q in zip(one.ports, two.ports, strict=True))
    assert [(p.port, p.protocol) for p in one.ports] == [(8080, "tcp"), (8443, "tcp")]
