"""A tiny random Qwen3 (q/k norms, grouped-query attention, head_dim 16) for tests that need the
Qwen3 architecture itself rather than the demo's tiny Qwen2."""

from __future__ import annotations

from typing import Any


def tiny_qwen3(vocab_size: int, *, hidden: int = 32, layers: int = 1, seed: int = 0, **config: Any) -> Any:
    """``hidden // 16`` heads of 16, half as many key/value heads, tied embeddings, float32;
    ``config``: more Qwen3Config fields (eos/pad ids, max_position_embeddings)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    heads = hidden // 16
    return Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2),
            head_dim=16,
            tie_word_embeddings=True,
            **config,
        )
    ).float()
