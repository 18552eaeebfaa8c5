"""The MoE families this loader patches, and each family's routing conventions.

Read from transformers 5.x's modeling files (``transformers/models/<family>/modeling_<family>.py``):
every family's sparse block has ``gate`` (a top-k router holding ``weight`` [E, d]; softmax in
fp32, then top-k) and ``experts`` (3-D fused parameters ``gate_up_proj`` [E, 2f, d], gate rows
first, and ``down_proj`` [E, d, f], used as ``F.linear`` weights). They differ in:

- renormalising the kept top-k probabilities: Mixtral always does; Qwen2-MoE, Qwen3-MoE and
  OLMoE only when ``config.norm_topk_prob`` is true;
- Qwen2-MoE's always-on shared expert, scaled per token by ``sigmoid(shared_expert_gate(x))``;
- which layers are sparse: Qwen2/3-MoE keep dense MLPs in ``mlp_only_layers`` and off the
  ``decoder_sparse_step``; only instances of the sparse block class are patched.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class MoEFamily:
    model_type: str                 # config.json "model_type"
    block_class: str                # sparse MoE block in modeling_<model_type>.py
    experts_fields: tuple[str, ...]  # config.json fields for the routed expert count, first
                                     # present wins (5.x writes Qwen3-MoE's as num_local_experts,
                                     # released checkpoints say num_experts)
    expert_ffn_field: str           # config field holding each expert's hidden width
    always_renormalize: bool        # True: renormalise kept probs whatever norm_topk_prob says
    shared_expert: bool             # block has shared_expert + shared_expert_gate (sigmoid)

    def block_type(self) -> type:
        module = importlib.import_module(
            f"transformers.models.{self.model_type}.modeling_{self.model_type}")
        return getattr(module, self.block_class)

    def renormalize(self, config: Any) -> bool:
        return self.always_renormalize or bool(getattr(config, "norm_topk_prob", False))


SUPPORTED_FAMILIES: Mapping[str, MoEFamily] = {f.model_type: f for f in (
    MoEFamily("mixtral", "MixtralSparseMoeBlock", ("num_local_experts",), "intermediate_size",
              always_renormalize=True, shared_expert=False),
    MoEFamily("qwen2_moe", "Qwen2MoeSparseMoeBlock", ("num_experts",), "moe_intermediate_size",
              always_renormalize=False, shared_expert=True),
    MoEFamily("qwen3_moe", "Qwen3MoeSparseMoeBlock",
              ("num_experts", "num_local_experts"), "moe_intermediate_size",
              always_renormalize=False, shared_expert=False),
    MoEFamily("olmoe", "OlmoeSparseMoeBlock", ("num_experts", "num_local_experts"), "intermediate_size",
              always_renormalize=False, shared_expert=False),
)}
