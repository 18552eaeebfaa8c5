"""Tiny random checkpoints of each supported family, built in code (nothing downloaded).

`build_tiny_checkpoint` writes what a real Hugging Face MoE checkpoint holds: ``config.json``,
safetensors weights (sharded with an index when ``max_shard_size`` is given) and a byte-level
BPE tokenizer trained here on a few sentences with the ``tokenizers`` library. Weights are random
(seeded); routers are drawn wider than transformers' init so their confidences spread like a
trained gate's (an untrained near-uniform router would make top-p pick almost every expert).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .families import SUPPORTED_FAMILIES

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
_CORPUS = (
    "sparse mixture of experts models route each token to a few experts.",
    "the gate keeps the fewest experts whose probability mass reaches the threshold.",
    "a capacity factor bounds how many tokens one expert may take in a batch.",
    "kubernetes rolls the new gate out to five, then twenty, then all instances.",
    "hello world, this is a tiny tokenizer built in code for tests and demos.",
)


def build_tiny_tokenizer(*, vocab_size: int = 384) -> Any:
    """A byte-level BPE tokenizer (every byte is a token, so any text encodes), as a
    transformers fast tokenizer with <pad>=0, <s>=1, </s>=2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS,
                                   eos_token=EOS)


def _config(family: str, *, vocab_size: int, hidden_size: int, layers: int, heads: int,
            experts: int, top_k: int, expert_ffn: int, max_positions: int) -> Any:
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=max_positions, num_experts_per_tok=top_k,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if family == "mixtral":
        return MixtralConfig(**common, intermediate_size=expert_ffn, num_local_experts=experts)
    if family == "qwen2_moe":
        # Shared expert and the dense MLP width as in Qwen1.5-MoE: 4x an expert's width.
        return Qwen2MoeConfig(**common, num_experts=experts, moe_intermediate_size=expert_ffn,
                              intermediate_size=4 * expert_ffn,
                              shared_expert_intermediate_size=4 * expert_ffn)
    if family == "qwen3_moe":
        # Released Qwen3-MoE checkpoints renormalise their top-k (norm_topk_prob: true).
        return Qwen3MoeConfig(**common, num_experts=experts, moe_intermediate_size=expert_ffn,
                              intermediate_size=4 * expert_ffn, norm_topk_prob=True,
                              head_dim=hidden_size // heads)
    if family == "olmoe":
        return OlmoeConfig(**common, num_experts=experts, intermediate_size=expert_ffn)
    raise ValueError(f"unknown family {family!r} (one of {', '.join(SUPPORTED_FAMILIES)})")


def build_tiny_checkpoint(path: str | Path, *, family: str, seed: int = 0,
                          hidden_size: int = 64, layers: int = 2, heads: int = 4,
                          experts: int = 8, top_k: int = 2, expert_ffn: int = 64,
                          vocab_size: int = 384, max_positions: int = 256,
                          router_scale: float = 3.0, dtype: torch.dtype = torch.float32,
                          max_shard_size: str | None = None, tokenizer: bool = True) -> Path:
    """Write a random checkpoint of `family` into `path` (created) and return the path."""
    from transformers import AutoModelForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = _config(family, vocab_size=vocab_size, hidden_size=hidden_size, layers=layers,
                     heads=heads, experts=experts, top_k=top_k, expert_ffn=expert_ffn,
                     max_positions=max_positions)
    block_type = SUPPORTED_FAMILIES[family].block_type()
    with torch.random.fork_rng(devices=[]):  # seeded without disturbing the caller's RNG
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, block_type):
                    module.gate.weight.normal_(0.0, router_scale * hidden_size ** -0.5)
    model.to(dtype).save_pretrained(out, **({"max_shard_size": max_shard_size}
                                            if max_shard_size else {}))
    if tokenizer:
        build_tiny_tokenizer(vocab_size=min(vocab_size, 384)).save_pretrained(out)
    return out
