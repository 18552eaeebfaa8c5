"""The harm the quality e2e relies on, measured on the trained demo checkpoint (dev/trained_model.py,
trained once per machine): under the served gate (capacity factor 1.25), a benign threshold move
leaves the probe perplexity within 1 % of the trained gate's, while top-1 routing
(confidenceThreshold 0.05, maxExpertsPerToken 1) raises it by more than 5 %, well over the
default maxQualityDrop of 2 %."""

from __future__ import annotations

import pytest

from sparsegate_workload import quality
from sparsegate_workload.gateparams import make_document
from sparsegate_workload.hf import load_moe_checkpoint
from trained_model import trained_checkpoint

pytestmark = pytest.mark.slow

BASE = {"toolGateThreshold": 0.85, "entropyBeta": 0.1, "confidenceThreshold": 0.6, "capacityFactor": 1.25,
        "minExpertsPerToken": 1, "maxExpertsPerToken": 4, "precisionPolicy": "auto"}
BENIGN = {"confidenceThreshold": 0.8}
HARMFUL = {"confidenceThreshold": 0.05, "maxExpertsPerToken": 1}


def test_harmful_gate_lowers_probe_logprob_by_a_clear_margin() -> None:
    path = trained_checkpoint()
    lm = load_moe_checkpoint(path)
    probe = quality.checkpoint_probe(path, lm.tokenizer, vocab_size=lm.model.config.vocab_size,
                                     context_length=lm.model.config.max_position_embeddings)

    def ppl(changes: dict) -> float:
        lm.set_gate(make_document({**BASE, **changes}))
        return quality.score_checkpoint_probe(lm, probe).perplexity

    base, benign, harmful = ppl({}), ppl(BENIGN), ppl(HARMFUL)
    print(f"probe perplexity: trained gate {base:.4f}, benign {benign:.4f}, harmful {harmful:.4f}")
    assert base < 6.0  # trained: a random model of this vocabulary sits near 320
    assert abs(benign / base - 1) < 0.01
    assert harmful / base - 1 > 0.05
