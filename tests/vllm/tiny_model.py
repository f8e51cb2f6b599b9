"""A tiny Llama-style model written to disk: ``config.json`` plus seeded
random weights in ``model.safetensors``.  vLLM loads it as a real model; the
weights are normal with a std large enough that the output depends on every
cached token (vLLM's ``load_format="dummy"`` init is near zero, so a wrong
KV transfer could go unseen)."""

from __future__ import annotations

import json
from pathlib import Path

LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB, FFN = 2, 256, 4, 2, 512, 512


def write_model(path: Path, *, seed: int = 0, std: float = 0.15) -> Path:
    """Write the model into ``path`` (created) and return it."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    head = HIDDEN // HEADS
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": head,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, scale: float = std) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    weights = {"model.embed_tokens.weight": w(VOCAB, HIDDEN, scale=1.0), "model.norm.weight": torch.ones(HIDDEN),
               "lm_head.weight": w(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights.update({
            p + "self_attn.q_proj.weight": w(HEADS * head, HIDDEN), p + "self_attn.k_proj.weight": w(KV_HEADS * head, HIDDEN),
            p + "self_attn.v_proj.weight": w(KV_HEADS * head, HIDDEN), p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * head),
            p + "mlp.gate_proj.weight": w(FFN, HIDDEN), p + "mlp.up_proj.weight": w(FFN, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, FFN),
            p + "input_layernorm.weight": torch.ones(HIDDEN), p + "post_attention_layernorm.weight": torch.ones(HIDDEN)})
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    return path
