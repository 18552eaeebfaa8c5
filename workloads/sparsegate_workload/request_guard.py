"""Per-request access on the inference port: verify the caller, apply the model's access rules.

Every POST (the inference routes) goes through :func:`access_guard`; GETs (health, readiness,
metrics, model info) do not, since probes and the operator's scrapes carry no caller identity.
Without caller verification (no ``--request-auth``), a request naming an expert group in header
``x-sparsegate-expert-group`` is only narrowed to that group's experts. With it (a
:class:`~.caller_auth.CachedReviewer` in the state):

- No access document yet (``PUT /admin/access`` on the admin listener, the operator's
  ``sparsegate.domain.request_access``): 503, never served (the rules are unknown).
- Document with ``enforced`` false (no RoutingPolicy targets the model): served as before, no token.
- Enforced: no Bearer token or a token the TokenReview refuses → 401; the review cannot be made →
  503; the rules refuse → 403 with the deciding rule and reason; allowed → the request runs with
  the experts the rules leave it (its named group's, or the whole model less denied groups).

A request scoped to fewer than all experts is served only where the gate masks experts per request:
``/v1/infer`` (built-in model and checkpoints) and the OpenAI routes (checkpoints), whose shared
decode batches carry a mask per sequence (`batch_decode`). Any other POST route answers a named
group with 400, and a scope narrower than the model with 403, rather than serve more experts than
the request may use.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from sparsegate_contracts.request_access import (EXPERT_GROUP_HEADER, AccessDocumentError, Decision, Scope,
                                                 parse_access_document)

from .caller_auth import ReviewUnavailable, bearer_token
from .server_state import OPENAI_ROUTES, STATE, ApiError, ServerState, openai_error, read_json

SCOPE = web.RequestKey("sparsegate_scope", Scope)  # the Scope a guarded request runs under
MASKABLE_ROUTES = frozenset({"/v1/infer", *OPENAI_ROUTES})
_MASKABLE_TEXT = ", ".join(sorted(MASKABLE_ROUTES))


def _deny(request: web.Request, status: int, message: str, **extra: Any) -> web.Response:
    """The refusal in the route's own error shape: OpenAI's on the OpenAI routes (the details
    inside its error object), the server's ``{"error", "status"}`` elsewhere."""
    if request.path in OPENAI_ROUTES:
        return openai_error(status, message, **extra)
    return web.json_response({"error": message, "status": status, **extra}, status=status)


def _num_experts(state: ServerState) -> int:
    return state.hf.num_experts if state.hf is not None else state.model_config.num_experts


def _group(request: web.Request, state: ServerState) -> str | None:
    group = request.headers.get(EXPERT_GROUP_HEADER)
    if group is None:
        return None
    if group not in state.expert_groups:
        known = ", ".join(sorted(state.expert_groups)) or "none"
        raise ApiError(400, f"header {EXPERT_GROUP_HEADER}: unknown expert group {group!r} (this model's: {known})")
    return group


def _count(state: ServerState, result: str, group: str | None) -> None:
    if state.metrics is not None:  # None while the model loads
        state.metrics.access.labels(result=result, expert_group=group or "").inc()


def _maskable(request: web.Request) -> bool:
    return request.path in MASKABLE_ROUTES


@web.middleware
async def access_guard(request: web.Request,
                       handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    state = request.app[STATE]
    if request.method != "POST":
        return await handler(request)
    table = state.access
    if state.reviewer is not None and table is None:
        _count(state, "no_rules", None)
        return _deny(request, 503, "no access rules received yet: requests are refused until the operator sends them")
    try:
        group = _group(request, state)
    except ApiError as e:
        _count(state, "bad_group", None)
        return _deny(request, e.status, e.message)
    if state.reviewer is None or table is None or not table.enforced:
        # Nobody to check: a named group still narrows the request to its experts.
        if group is not None:
            if not _maskable(request):
                _count(state, "bad_group", group)
                return _deny(request, 400, f"header {EXPERT_GROUP_HEADER}: only {_MASKABLE_TEXT} can restrict experts")
            request[SCOPE] = Scope(Decision(True, "", "callers not checked"), group, state.expert_groups[group])
            _count(state, "narrowed", group)
        return await handler(request)
    token = bearer_token(request.headers.get("Authorization", ""))
    if token is None:
        _count(state, "unauthenticated", group)
        return _deny(request, 401, "missing Bearer token: send a ServiceAccount token for audience sparsegate")
    try:
        caller = await state.reviewer.review(token)
    except ReviewUnavailable as e:
        _count(state, "unavailable", group)
        return _deny(request, 503, f"cannot verify the caller now ({e}); refusing rather than serving unverified")
    if caller is None:
        _count(state, "unauthenticated", group)
        return _deny(request, 401, "invalid token: not a ServiceAccount token for audience sparsegate")
    scope = table.scope(namespace=caller.namespace, service_account=caller.service_account, route=request.path,
                        group=group, groups=state.expert_groups, num_experts=_num_experts(state))
    who = f"{caller.namespace}/{caller.service_account}"
    if not scope.decision.allow:
        _count(state, "forbidden", group)
        return _deny(request, 403, scope.decision.reason, rule=scope.decision.rule, caller=who, expertGroup=group)
    if scope.experts is not None and len(scope.experts) < _num_experts(state) and not _maskable(request):
        _count(state, "forbidden", group)
        return _deny(request, 403, f"this request may use only experts {list(scope.experts)}, and only "
                          f"{_MASKABLE_TEXT} can restrict experts", rule=scope.decision.rule, caller=who)
    request[SCOPE] = scope
    _count(state, "allowed", group)
    return await handler(request)


def allowed_experts(request: web.Request) -> tuple[int, ...] | None:
    """The experts a guarded request may activate (None: all)."""
    scope = request.get(SCOPE)
    return None if scope is None else scope.experts


def scope_json(request: web.Request) -> dict[str, Any]:
    """What the response says about the request's access (empty when unguarded)."""
    scope: Scope | None = request.get(SCOPE)
    if scope is None:
        return {}
    return {"access": {"expertGroup": scope.group, "rule": scope.decision.rule,
                       "allowedExperts": None if scope.experts is None else list(scope.experts)}}


async def get_access(request: web.Request) -> web.Response:
    state = request.app[STATE]
    table = state.access
    return web.json_response({"verifying": state.reviewer is not None,
                              "revision": None if table is None else table.revision,
                              "enforced": None if table is None else table.enforced,
                              "rules": None if table is None else len(table.rules),
                              "sequence": state.access_sequence})


async def put_access(request: web.Request) -> web.Response:
    """Replace the access document (422 naming the field when it is malformed; the old one stays)."""
    state = request.app[STATE]
    try:
        doc = await read_json(request)
        table = parse_access_document(doc)
    except AccessDocumentError as e:
        raise ApiError(422, f"access document: {e}") from None
    expected = doc.get("ifSequence") if isinstance(doc, dict) else None
    if expected is not None and (isinstance(expected, bool) or not isinstance(expected, int)):
        raise ApiError(422, "access document: ifSequence must be an integer")
    if expected is not None and expected != state.access_sequence:
        # Compiled against what the pod held before a newer push replaced it (a PUT that arrived
        # late, after its sender gave up): never let it overwrite the newer rules.
        raise ApiError(409, f"access document: ifSequence {expected!r} is stale, this pod is at sequence "
                            f"{state.access_sequence}; nothing applied")
    previous = state.access
    state.access = table  # one reference assignment: a request reads the old or the new table
    state.access_sequence += 1
    return web.json_response({"revision": table.revision, "enforced": table.enforced, "rules": len(table.rules),
                              "applied": previous is None or previous.revision != table.revision,
                              "sequence": state.access_sequence})
