"""Prometheus metrics of one model server, on its own CollectorRegistry (many servers may share
a process in tests). Names follow CONTRACTS.md."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .inference import InferenceResult

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServerMetrics:
    def __init__(self, *, n_layers: int, num_experts: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # Inference requests only: probes and scrapes would dilute the rollout's error rate.
        self.requests = Counter("sparsegate_requests_total", "Inference requests by HTTP status",
                                ["code"], registry=r)
        self.duration = Histogram("sparsegate_request_duration_seconds",
                                  "Inference request latency", buckets=LATENCY_BUCKETS,
                                  registry=r)
        self.tokens = Counter("sparsegate_tokens_total", "Tokens processed (rate = tokens/s)",
                              registry=r)
        self.expert_tokens = Counter("sparsegate_expert_tokens_total",
                                     "Tokens processed per expert", ["layer", "expert"],
                                     registry=r)
        self.assignments = Counter("sparsegate_expert_assignments_total",
                                   "Kept (token, expert) assignments summed over layers; "
                                   "rate / (rate of tokens * layers) = mean active experts",
                                   registry=r)
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
                                    "Gate config PUTs by result", ["result"], registry=r)
        for layer in range(n_layers):
            for expert in range(num_experts):
                self.expert_tokens.labels(layer=str(layer), expert=str(expert))

    def set_gate(self, *, version: str, checksum: str) -> None:
        self.gate_info.clear()
        self.gate_info.labels(version=version, checksum=checksum).set(1)

    def observe_batch(self, result: InferenceResult) -> None:
        self.tokens.inc(result.num_tokens)
        for layer, counts in enumerate(result.expert_counts):
            for expert, n in enumerate(counts):
                if n:
                    self.expert_tokens.labels(layer=str(layer), expert=str(expert)).inc(n)
        self.assignments.inc(sum(sum(c) for c in result.expert_counts))
        self.dropped.inc(result.dropped_assignments)
        self.active.set(result.active_experts_per_token)
        self.entropy.set(result.gate_entropy)
        self.tool_rate.set(result.tool_gate_fire_rate)
        self.tool_fired.inc(sum(len(c) for c in result.tool_calls))
