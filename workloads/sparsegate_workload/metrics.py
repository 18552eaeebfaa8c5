"""Prometheus metrics of one model server, on its own CollectorRegistry (many servers may share
a process in tests). Names follow CONTRACTS.md: the ``sparsegate_*`` series the operator's
analysis reads, and vLLM's names (``vllm:*``, labelled ``model_name``) where the two overlap, so
tools built for vLLM (the Gateway API Inference Extension's endpoint picker, dashboards) read
this server too."""

from __future__ import annotations

from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .inference import InferenceResult
from .quality import NO_VERSION, QualityMetrics
from .tools import ToolMetrics

# Up to 120 s: the rollout's p99 SLA check (slaP99LatencyMs) can only show a p99 within the
# largest finite bucket (a p99 beyond it is a lower bound and never passes), and a generation
# request on the OpenAI routes can take tens of seconds. 0.8 s is the default SLA
# (slaP99LatencyMs 800, the design article's P99 <= 800 ms): on a bucket bound the p99 check
# decides it exactly, where interpolating inside a 0.5-1 s bucket misjudged it both ways.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.8, 1.0, 2.5, 5.0,
                   10.0, 15.0, 30.0, 60.0, 120.0)
# Per-request mean active experts per token (per layer): dynamic gating keeps 1..max experts.
EXPERTS_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 16.0)
# vLLM's own buckets for these two (vllm/v1/metrics/loggers.py), so dashboards aggregating
# vLLM and sparsegate pods by ``le`` agree. Their older sets stopped at 60 s and 10 s: a TTFT
# spent queued under load past 10 s (the default --request-timeout is 30 s), or a generation
# past 60 s with a longer --request-timeout, fell in +Inf, and a quantile read only the bound.
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# vLLM's buckets of vllm:inter_token_latency_seconds and vllm:request_time_per_output_token_seconds.
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)


# The codes an inference request ends with besides client errors: 200, and the 5xx the server
# answers (500 an internal error, 503 loading / overloaded / injected fault). See `serving`.
INITIALISED_CODES = ("200", "500", "503")

# Versions no longer held whose ``gate_version`` series are kept (the oldest dropped first
# beyond this): the operator's window still reads a version just promoted away or rolled back
# (a direct scrape's deltas, Prometheus's increase()), and its series stop growing once it is
# no longer served; beyond it a pod living through many rollouts would keep every version's.
RETIRED_VERSIONS_KEPT = 4


class ServerMetrics:
    def __init__(self, *, n_layers: int, num_experts: int, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        label = {"model_name": model_name}
        # vLLM-named series. Running: generations in the decode batch (batch_engine) plus
        # /v1/infer batches on the model thread; waiting: admitted, queued for either.
        self.running = Gauge("vllm:num_requests_running",
                             "Requests being computed now (in the decode batch or on the model "
                             "thread)", ["model_name"], registry=r).labels(**label)
        self.waiting = Gauge("vllm:num_requests_waiting",
                             "Requests admitted and queued for the decode batch or the model "
                             "thread", ["model_name"], registry=r).labels(**label)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "OpenAI API request latency, answered with 200",
                             ["model_name"], buckets=E2E_BUCKETS, registry=r).labels(**label)
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "OpenAI API: seconds from arrival to the first generated token",
                              ["model_name"], buckets=TTFT_BUCKETS, registry=r).labels(**label)
        # vLLM's names since 0.11 (its vllm:time_per_output_token_seconds, the same per-token
        # series, is deprecated and hidden): observed by the engine (batch_engine) as the model
        # makes the tokens, streamed or not.
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "OpenAI API: seconds between two consecutive generated tokens of a "
                             "request (each token after its first)", ["model_name"],
                             buckets=ITL_BUCKETS, registry=r).labels(**label)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "OpenAI API: per finished generation, seconds from its first to its "
                              "last token over its tokens after the first", ["model_name"],
                              buckets=ITL_BUCKETS, registry=r).labels(**label)
        # Counted as the engine processes them (batch_engine), whatever the request's outcome.
        self.prompt_tokens = Counter("vllm:prompt_tokens",
                                     "OpenAI API prefill tokens processed",
                                     ["model_name"], registry=r).labels(**label)
        self.generation_tokens = Counter("vllm:generation_tokens",
                                         "OpenAI API generation tokens processed",
                                         ["model_name"], registry=r).labels(**label)
        # Inference requests only: probes and scrapes would dilute the rollout's error rate.
        # gate_version: the version that served the request (with a request-level canary a pod
        # serves two, measured side by side); "" when none was chosen (e.g. still loading).
        self.requests = Counter("sparsegate_requests_total",
                                "Inference requests by HTTP status and serving gate version",
                                ["code", "gate_version"], registry=r)
        # Per-request access (request_guard): result is allowed | narrowed (a named group, callers
        # not checked) | unauthenticated | forbidden | unavailable | no_rules | bad_group;
        # expert_group: the group the request named ("" for none or an unknown one: bounded).
        self.access = Counter("sparsegate_request_access_total",
                              "Inference requests by per-request access result and named expert group",
                              ["result", "expert_group"], registry=r)
        self.duration = Histogram("sparsegate_request_duration_seconds",
                                  "Inference request latency by serving gate version",
                                  ["gate_version"], buckets=LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("sparsegate_tokens_total",
                              "Tokens processed (rate = tokens/s), by the gate version that routed them",
                              ["gate_version"], registry=r)
        self.expert_tokens = Counter("sparsegate_expert_tokens_total",
                                     "Tokens processed per expert", ["layer", "expert"],
                                     registry=r)
        self.assignments = Counter("sparsegate_expert_assignments_total",
                                   "Kept (token, expert) assignments summed over layers, by gate "
                                   "version; rate / (rate of tokens * layers) = mean active experts",
                                   ["gate_version"], registry=r)
        # One observation per request: its own mean active experts per token per layer. With the
        # squares counter the analysis has the per-request spread, so canary-vs-stable drift is
        # judged against its standard error (noise of a few requests is not a rollback).
        self.request_experts = Histogram(
            "sparsegate_request_experts_per_token",
            "Mean active experts per token per layer of each request, by gate version",
            ["gate_version"], buckets=EXPERTS_BUCKETS, registry=r)
        self.request_experts_squares = Counter(
            "sparsegate_request_experts_per_token_squares",
            "Sum of squares of each request's mean active experts per token per layer (with the "
            "histogram's _sum and _count: the per-request variance), by gate version",
            ["gate_version"], registry=r)
        # A constant, so a scrape can read the layer count without the per-expert series.
        self.moe_layers = Gauge("sparsegate_moe_layers",
                                "MoE layers of the served model: mean active experts per token = "
                                "rate(assignments) / (rate(tokens) * this)", registry=r)
        self.moe_layers.set(n_layers)
        self.dropped = Counter("sparsegate_dropped_assignments_total",
                               "Assignments dropped by the capacity cap", registry=r)
        self.active = Gauge("sparsegate_active_experts_per_token",
                            "Mean active experts per token per layer, last batch", registry=r)
        self.entropy = Gauge("sparsegate_gate_entropy",
                             "Mean gate entropy in nats, last batch", registry=r)
        self.tool_rate = Gauge("sparsegate_tool_gate_fire_rate",
                               "Fraction of tokens whose tool gate fired, last batch",
                               registry=r)
        self.tool_fired = Counter("sparsegate_tool_gate_fired_total",
                                  "Tokens whose tool gate fired", registry=r)
        self.gate_info = Gauge("sparsegate_gate_config_info", "Gate config version in effect",
                               ["version", "checksum"], registry=r)
        self.gate_applies = Counter("sparsegate_gate_config_applies_total",
                                    "Gate config PUTs by result (applied; unchanged: the set was already "
                                    "held; rejected)", ["result"], registry=r)
        self.expert_cost = Gauge(
            "sparsegate_expert_cost",
            "Normalised hardware cost per expert (EWMA of measured time per row x placement, "
            "divided by the layer's largest) that hardwareCostLambda weighs",
            ["layer", "expert"], registry=r)
        self.placement_factor = Gauge(
            "sparsegate_expert_placement_factor",
            "Per-expert placement factor of the cost: its (device, dtype) matmul time relative "
            "to the fastest in its layer, measured at load (1 when nothing is placed)",
            ["layer", "expert"], registry=r)
        self.controlled_threshold = Gauge(
            "sparsegate_gate_controlled_threshold",
            "Top-p threshold set by the PI controller of a gate version with "
            "targetExpertsPerToken, for the next batch", ["gate_version"], registry=r)
        self.quality = QualityMetrics(r)  # per gate version: live prompt NLL and probe set
        self.tools = ToolMetrics(r)  # calls the tool gate made, by tool and outcome (tools.py)
        for layer in range(n_layers):
            for expert in range(num_experts):
                self.expert_tokens.labels(layer=str(layer), expert=str(expert))
        self._held: set[str] = set()
        self._retired: list[str] = []  # versions no longer held, oldest first

    def _versioned(self) -> list[Any]:
        """Every family labelled ``gate_version``."""
        return [self.requests, self.duration, self.tokens, self.assignments, self.request_experts,
                self.request_experts_squares, self.controlled_threshold, self.quality.nll,
                self.quality.tokens]

    def hold(self, versions: Iterable[str]) -> None:
        """The versions served now (stable, and a request-level canary's). A version that stops
        being held keeps its series, unchanged from then on, until ``RETIRED_VERSIONS_KEPT``
        newer versions have also stopped being held; then its series are removed."""
        held = {v for v in versions if v}
        self._retired = [v for v in self._retired if v not in held]
        self._retired += sorted(self._held - held)
        self._held = held
        if len(self._retired) <= RETIRED_VERSIONS_KEPT:
            return
        self._retired = self._retired[-RETIRED_VERSIONS_KEPT:]
        # Every other version's series go, also one a request still running when its version was
        # dropped brought back on completion (it would otherwise stay for the pod's life).
        keep = held | set(self._retired) | {"", NO_VERSION}
        for family in self._versioned():
            index = family._labelnames.index("gate_version")
            with family._lock:
                stale = [lv for lv in family._metrics if lv[index] not in keep]
            for lv in stale:
                family.remove(*lv)

    def observe_request(self, *, code: int, gate_version: str | None, seconds: float) -> None:
        """One inference request (``/v1/infer`` or OpenAI), labelled by the version that served it."""
        version = gate_version or ""
        self.requests.labels(code=str(code), gate_version=version).inc()
        self.duration.labels(gate_version=version).observe(seconds)

    def set_expert_costs(self, costs: list[list[float]]) -> None:
        """Per-layer normalised expert costs (`expert_cost.ExpertCost.vector`), set at scrape."""
        for layer, row in enumerate(costs):
            for expert, cost in enumerate(row):
                self.expert_cost.labels(layer=str(layer), expert=str(expert)).set(cost)

    def set_placement_factors(self, factors: list[list[float]]) -> None:
        for layer, row in enumerate(factors):
            for expert, factor in enumerate(row):
                self.placement_factor.labels(layer=str(layer), expert=str(expert)).set(factor)

    def set_gate(self, *, version: str, checksum: str) -> None:
        self.gate_info.clear()
        self.gate_info.labels(version=version, checksum=checksum).set(1)
        self.serving(version)

    def serving(self, version: str) -> None:
        """Create ``version``'s request series at 0 as it starts serving (stable or canary).

        Prometheus's ``increase()`` over a window counts a series from its first sample: a series
        born inside the window (a canary's first errors) loses the requests its first sample
        already holds, and one sampled once counts nothing. Existing at 0 from the moment the
        version is served, its first requests, errors, tokens and scores are all counted, and
        every series of the version starts from the same value, so the window's extrapolation
        treats them alike.
        Client errors (4xx) are left to appear when they happen: they do not count as errors."""
        if version:
            self._held.add(version)  # until `hold` is told it no longer is
        for code in INITIALISED_CODES:
            self.requests.labels(code=code, gate_version=version)
        # The other per-version sums the analysis divides (experts per token, its spread, quality).
        for family in (self.duration, self.tokens, self.assignments, self.request_experts,
                       self.request_experts_squares, self.quality.nll, self.quality.tokens):
            family.labels(gate_version=version)

    def observe_batch(self, result: InferenceResult, *, gate_version: str | None) -> None:
        self.observe_routing(num_tokens=result.num_tokens, expert_counts=result.expert_counts,
                             active=result.active_experts_per_token,
                             dropped=result.dropped_assignments, entropy=result.gate_entropy,
                             gate_version=gate_version)
        self.tool_rate.set(result.tool_gate_fire_rate)
        self.tool_fired.inc(sum(len(c) for c in result.tool_calls))

    def observe_routing(self, *, num_tokens: int, expert_counts: list[list[int]],
                        active: float, dropped: int, entropy: float,
                        gate_version: str | None) -> None:
        """Routing of one batch or one generation (tokens processed, per-layer expert counts);
        tokens and assignments are labelled by the version that routed them (canary drift)."""
        self.tokens.labels(gate_version=gate_version or "").inc(num_tokens)
        for layer, counts in enumerate(expert_counts):
            for expert, n in enumerate(counts):
                if n:
                    self.expert_tokens.labels(layer=str(layer), expert=str(expert)).inc(n)
        version = gate_version or ""
        kept = sum(sum(c) for c in expert_counts)
        self.assignments.labels(gate_version=version).inc(kept)
        if num_tokens > 0 and expert_counts:
            mean = kept / (num_tokens * len(expert_counts))  # what the assignments/tokens ratio means
            self.request_experts.labels(gate_version=version).observe(mean)
            self.request_experts_squares.labels(gate_version=version).inc(mean * mean)
        self.dropped.inc(dropped)
        self.active.set(active)
        self.entropy.set(entropy)
