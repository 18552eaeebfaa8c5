"""Canonical JSON and content hashes shared by every document sparsegate exchanges.

Canonical JSON = ``json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)``;
``sha256_of(value)`` = ``sha256:`` + the hex digest of its UTF-8 encoding. Gate checksums, the OPA
data revision and flow-policy versions are all computed here, so the producer and the consumer of
a document can never disagree on how it is hashed.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

SHA256_PREFIX = "sha256:"


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def sha256_hex(value: Any) -> str:
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()


def sha256_of(value: Any) -> str:
    return SHA256_PREFIX + sha256_hex(value)
