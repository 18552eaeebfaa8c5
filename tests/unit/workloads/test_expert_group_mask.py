"""A request scoped to an expert group activates only that group's experts in every layer of the
built-in model (the gate masks the others before selection), whatever min/max experts ask."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sparsegate_workload.gateparams import GateParams
from sparsegate_workload.inference import run_batch
from sparsegate_workload.model import build_model

FP32 = ("fp32", "fp32")


@pytest.fixture(scope="module")
def model():
    return build_model()


def _used(result) -> set[int]:
    return {e for layer in result.expert_counts for e, n in enumerate(layer) if n > 0}


def test_unscoped_requests_use_many_experts(model):
    tokens = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(1)).tolist()
    assert len(_used(run_batch(model, tokens, gate=GateParams(), precisions=FP32))) > 4


@pytest.mark.parametrize("group", [[2, 3], [5], [0, 4, 7]])
@pytest.mark.parametrize("min_experts", [1, 3])
def test_scoped_requests_use_only_their_group(model, group, min_experts):
    tokens = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(2)).tolist()
    # No capacity cap here: with one, a group of few experts overflows and drops assignments.
    gate = dataclasses.replace(GateParams(), min_experts_per_token=min_experts, capacity_factor=None)
    result = run_batch(model, tokens, gate=gate, precisions=FP32, allowed_experts=group)
    assert _used(result) and _used(result) <= set(group)
    # every token still reaches at least one of its group's experts, in every layer
    assert all(sum(layer) >= len(tokens) * 32 for layer in result.expert_counts)
    assert result.selected_experts_per_token <= len(group)
    assert all(isinstance(t, int) for t in result.next_tokens)
