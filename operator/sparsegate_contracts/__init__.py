"""What the operator, the model server and the node agent agree on: one definition each.

Pure standard library (an import-linter contract and a unit test keep it so), so every
component can import it: the operator image, the torch model server and the BCC agent.

- ``canonical``: canonical JSON and ``sha256:<hex>`` of a JSON value (gate, OPA data, flow policy).
- ``gate``: the gate document (params, validation, checksum, ``g-<12 hex>`` version).
- ``canary``: the request-level canary (two-version PUT body, deterministic request selection).
- ``flowpolicy``: the flow allow-list document the operator publishes and the agent enforces.
- ``probes``: per-node XDP attachment configuration (from TelemetryProbes) and the agents' reports.
- ``names``: API group/version/plurals, label and annotation names.
- ``request_access``: SparseModel expert groups and the per-model request access document.
- ``rego``: the routing policy (Rego) shipped as package data, and its OPA identifiers.
- ``version``: the installed distribution's version (``--version`` of every entry point).

Submodules are imported explicitly (``from sparsegate_contracts import gate``); this file
imports nothing.
"""
