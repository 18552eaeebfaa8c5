"""The operator's door to OPA: opa-python-client 3.0 (`OpaClient`), made async and typed.

The sync client (requests, keep-alive session, its own small retry) runs on one worker thread: Kopf
handlers stay non-blocking and the session is never used from two threads at once. Every transport
failure or 5xx becomes `OpaUnavailable`, which callers treat as "fail closed and retry"; a policy
OPA refuses to compile (a 4xx) becomes `OpaRejected` (retrying would not help).

With a token (the chart's OPA sidecar runs `--authentication=token --authorization=basic`), every
request carries `Authorization: Bearer <token>`. OPA answers a missing or wrong token with 401: that
is `OpaUnavailable` too (fail closed, retry), not `OpaRejected` — the policy is fine, and the token
comes right again once both containers read the same Secret (e.g. after a restart).

Every call is counted by operation and result (`sparsegate_opa_requests_total`), timed
(`sparsegate_opa_request_duration_seconds`), and `sparsegate_opa_available` says whether the latest
one reached OPA (0 after `OpaUnavailable`): the series the chart's `SparsegateOpaUnavailable` alert reads,
since the operator fails closed without anything else to show for it but conditions and log lines.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import prometheus_client
import requests
from opa_client import OpaClient
from opa_client.errors import (
    ConnectionsError,
    PolicyNotFoundError,
    RegoParseError,
)

from sparsegate_contracts.rego import (
    DATA_PATH as OPA_DATA_PATH,
    PACKAGE as OPA_PACKAGE,
    POLICY_ID as OPA_POLICY_ID,
)

from sparsegate.gc_pause import gc_paused

T = TypeVar("T")
DEFAULT_URL = "http://127.0.0.1:8181"
# Inputs per batch query: amortises the HTTP round trip; OPA's per-decision eval time grows with
# larger batches (measured: 10 → 117 µs, 100 → 283 µs per decision), so keep it modest.
BATCH = 25


class OpaUnavailable(Exception):
    """OPA could not be reached, or answered with a server error."""


class OpaRejected(Exception):
    """OPA refused what we sent (a Rego compile error, a malformed document)."""


REQUESTS = prometheus_client.Counter(
    "sparsegate_opa_requests_total",
    "The operator's calls to OPA by operation and result: ok; not_found (no such policy); "
    "rejected (a 4xx: OPA refused what was sent); unavailable (unreachable, a 5xx, the token "
    "refused, an undefined or malformed answer: the operator fails closed); error (anything else)",
    ["operation", "result"])
SECONDS = prometheus_client.Histogram(
    "sparsegate_opa_request_duration_seconds", "Duration of the operator's calls to OPA, by operation",
    ["operation"], buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0))
AVAILABLE = prometheus_client.Gauge(
    "sparsegate_opa_available",
    "1 if the operator's latest call to OPA reached it (whatever OPA answered), 0 if it was "
    "OpaUnavailable (the operator fails closed); absent before the first call")

_RESULTS = ((OpaUnavailable, "unavailable"), (OpaRejected, "rejected"), (PolicyNotFoundError, "not_found"))
A = TypeVar("A", bound=Callable[..., Awaitable[Any]])


def _observed(operation: str) -> Callable[[A], A]:
    """Count, time and mark availability for one public call of `RoutingOpa` (its result as the
    caller sees it: an undefined answer raised after the HTTP call counts as unavailable too)."""
    def wrap(fn: A) -> A:
        @functools.wraps(fn)
        async def observed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            result = "error"
            try:
                value = await fn(*args, **kwargs)
                result = "ok"
                return value
            except Exception as e:
                result = next((r for kind, r in _RESULTS if isinstance(e, kind)), "error")
                raise
            finally:
                SECONDS.labels(operation).observe(time.perf_counter() - start)
                REQUESTS.labels(operation, result).inc()
                if result != "error":  # a bug of ours says nothing about OPA
                    AVAILABLE.set(0 if result == "unavailable" else 1)
        return observed  # type: ignore[return-value]
    return wrap


# OPA's error `code` when its authorization policy (system.authz) denies a request.
_UNAUTHORIZED = "unauthorized"


def _unauthorized(e: Exception) -> bool:
    """opa-python-client turns some non-2xx answers into its own errors carrying OPA's `code`."""
    return getattr(e, "expression", None) == _UNAUTHORIZED


def address(url: str) -> tuple[str, int, bool]:
    """host, port, tls from `SPARSEGATE_OPA_URL` (e.g. http://127.0.0.1:8181)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    tls = parts.scheme == "https"
    return parts.hostname or "127.0.0.1", parts.port or (443 if tls else 8181), tls


class RoutingOpa:
    """Push routing policy + data to OPA, read back what is loaded, ask for decisions."""

    def __init__(self, *, url: str = DEFAULT_URL, token: str | None = None, timeout: float = 1.5,
                 retries: int = 1, build_timeout: float = 30.0) -> None:
        host, port, tls = address(url)
        self.url = url
        # The whole allow-list is one evaluation whose time grows with the rules and pods (0.1-0.5 s
        # at 10,000 rules measured in tests/bench/bench_opa.py); the per-call timeout, sized for a
        # single decision, would turn a slow machine into "OPA unavailable" and fail closed forever.
        self.build_timeout = build_timeout
        # The client sets `Authorization: Bearer <token>` on its session: every call carries it.
        self._client = OpaClient(host=host, port=port, ssl=tls, timeout=timeout, retries=retries,
                                 token=token or None)
        # OPA gzips a large response when asked, and requests asks by default: for the sidecar on
        # loopback, compressing the 0.6 MB allow-list answer at 10,000 rules took longer than OPA's
        # evaluation (round trip 0.24 s -> 0.16 s without it, tests/bench/bench_opa.py scenario).
        self._client._session.headers["Accept-Encoding"] = "identity"
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="opa")

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._thread, lambda: fn(*args, **kwargs))
        except (RegoParseError, PolicyNotFoundError) as e:
            if _unauthorized(e):
                raise OpaUnavailable(f"OPA at {self.url} refused the operator's token (401 {e.message})") from e
            if isinstance(e, PolicyNotFoundError):
                raise  # the readers below handle "not there"
            raise OpaRejected(f"OPA at {self.url} refused it: {e}") from e
        except requests.exceptions.HTTPError as e:
            status = e.response.status_code if e.response is not None else 0
            if status in (401, 403):
                raise OpaUnavailable(f"OPA at {self.url} refused the operator's token (HTTP {status})") from e
            if 400 <= status < 500:
                raise OpaRejected(f"OPA at {self.url}: HTTP {status}: {e.response.text[:500]}") from e
            raise OpaUnavailable(f"OPA at {self.url}: HTTP {status}") from e
        except (ConnectionsError, requests.exceptions.RequestException) as e:
            cause = e.__cause__  # check_connection wraps the HTTPError of a refused token
            if isinstance(cause, requests.exceptions.HTTPError) and cause.response is not None \
                    and cause.response.status_code in (401, 403):
                raise OpaUnavailable(
                    f"OPA at {self.url} refused the operator's token (HTTP {cause.response.status_code})") from e
            raise OpaUnavailable(f"OPA at {self.url}: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        self._client.close_connection()
        self._thread.shutdown(wait=False, cancel_futures=True)

    @_observed("check")
    async def check(self) -> None:
        await self._call(self._client.check_connection)

    def _read(self, path: str) -> Any:
        """`result` of GET /v1/data/<path>, None when OPA answers it undefined (200 without one).
        Raw, not `get_data`: that one reads every non-200 answer (a 500 too) as "not found", and a
        server error must never pass for "nothing loaded". Non-2xx: HTTPError, for `_call`."""
        response = self._client._session.get(f"{self._client.root_url}/data/{path}", timeout=self._client.timeout)
        response.raise_for_status()
        body = response.json()
        if not isinstance(body, dict):
            raise OpaUnavailable(f"OPA at {self.url}: malformed answer for {path}: {repr(body)[:80]}")
        return body.get("result")

    @_observed("revision")
    async def revision(self) -> str | None:
        """The data revision, as seen through the policy: None when either is missing (fresh OPA)."""
        return await self._call(self._read, f"{OPA_PACKAGE.replace('.', '/')}/data_revision")

    @_observed("push")
    async def push(self, *, rego: str, data: Mapping[str, Any]) -> None:
        """Policy first, then data (whose `revision` thereby marks a complete push). PUTs: idempotent.
        Raw, not `update_policy_from_string`: that one reads every non-200 answer (a 500 too) as a
        Rego parse error; here a 4xx is `OpaRejected`, a 5xx `OpaUnavailable` (`_call`)."""

        def put() -> None:
            session, root, timeout = self._client._session, self._client.root_url, self._client.timeout
            session.put(f"{root}/policies/{OPA_POLICY_ID}", data=rego.encode(),
                        headers={"Content-Type": "text/plain"}, timeout=timeout).raise_for_status()
            session.put(f"{root}/data/{OPA_DATA_PATH}", json=dict(data), timeout=timeout).raise_for_status()

        await self._call(put)

    @_observed("loaded_policies")
    async def loaded_policies(self) -> dict[str, dict[str, Any]]:
        """`data.sparsegate.policies.policies`: {"<ns>/<name>": {"generation", "rules"}} as OPA has it."""
        result = await self._call(self._read, f"{OPA_DATA_PATH}/policies")
        if result is not None and not isinstance(result, dict):
            raise OpaUnavailable(f"OPA at {self.url}: malformed answer for the loaded policies: {repr(result)[:80]}")
        return result or {}

    @_observed("decide")
    async def decide(self, opa_input: Mapping[str, Any]) -> dict[str, Any]:
        """One decision (`data.sparsegate.routing.decision`)."""
        body = await self._call(self._client.query_rule, dict(opa_input), OPA_PACKAGE, "decision")
        return body.get("result") or {}

    @_observed("flow_decisions")
    async def flow_decisions(self, flow_input: Mapping[str, Any]) -> dict[str, list[Any]]:
        """Every decision of the allow-list in one evaluation (`data.sparsegate.routing.flow_decisions`,
        input from `domain.policy_compile.flow_question`): one POST instead of one per `BATCH` questions.
        Returns `{"one": [...], "many": [...]}` (`FlowQuestion.decisions` reads it)."""

        def post() -> dict[str, Any]:
            # query_rule would apply the single-decision timeout; same keep-alive session (and token).
            response = self._client._session.post(
                f"{self._client.root_url}/data/{OPA_PACKAGE.replace('.', '/')}/flow_decisions",
                json={"input": dict(flow_input)}, timeout=self.build_timeout)
            response.raise_for_status()
            # ~10^5 small containers at 10,000 rules: no cycle search mid-parse (process-wide for the
            # parse's ~10 ms, the event loop included; see gc_pause).
            with gc_paused():
                return response.json()

        body = await self._call(post)
        answers = body.get("result") if isinstance(body, dict) else None
        if answers is None:
            # undefined: the policy is gone (OPA restarted between push and query)
            raise OpaUnavailable(f"OPA at {self.url}: flow_decisions undefined")
        if not (isinstance(answers, dict) and isinstance(answers.get("one"), list)
                and isinstance(answers.get("many"), list)):
            # Only a broken Rego answers so: not used, failed closed as when OPA is down.
            shown = repr(answers)
            raise OpaUnavailable(f"OPA at {self.url}: malformed flow_decisions answer: expected "
                                 f"{{'one': [...], 'many': [...]}}, got {shown[:80]}")
        return answers

    async def decide_many(self, inputs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Decisions for many inputs, in input order, `BATCH` per round trip through the policy's
        `batch_decisions` rule (compiled once, unlike `bulk_query_rule`'s ad-hoc query that inlines
        every input: measured ~10x slower here). No inputs: no call (nothing counted)."""
        return await self._decide_batches(inputs) if inputs else []

    @_observed("decide_many")
    async def _decide_batches(self, inputs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        results: list[dict[str, Any]] = []
        for start in range(0, len(inputs), BATCH):
            chunk = [dict(i) for i in inputs[start : start + BATCH]]
            body = await self._call(self._client.query_rule, {"batch": chunk}, OPA_PACKAGE, "batch_decisions")
            answers = body.get("result")
            if not isinstance(answers, list) or len(answers) != len(chunk):
                # undefined: the policy is gone (OPA restarted between push and query)
                raise OpaUnavailable(f"OPA at {self.url}: batch_decisions undefined")
            results.extend(answers)
        return results
