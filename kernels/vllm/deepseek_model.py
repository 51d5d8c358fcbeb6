"""A DeepSeek-V2-Lite-shaped model with random weights, written as a Hugging Face folder that vLLM
(and transformers) load as ``DeepseekV3ForCausalLM``: MLA attention (no q LoRA, latent 512,
rope 64, nope 128, values 128), DeepSeek-V3 routing (sigmoid scores plus a correction bias,
group-limited top-k) over 64 routed experts in 8 groups, 4 kept, top-6, 2 shared experts, the
first layer dense.  Built on the box from a seed (no hub).

:data:`V2_LITE` is the shape; :func:`spec` gives a smaller one with the same structure (the
CPU test builds a tiny one); :func:`build` returns an object with ``save_pretrained(folder)``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

__all__ = ["DeepSeekShape", "V2_LITE", "spec", "build"]


@dataclass(frozen=True)
class DeepSeekShape:
    vocab_size: int = 102400
    hidden_size: int = 2048
    intermediate_size: int = 10944
    moe_intermediate_size: int = 1408
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    n_routed_experts: int = 64
    n_shared_experts: int = 2
    num_experts_per_tok: int = 6
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 1
    max_position_embeddings: int = 4096
    seed: int = 0

    def hf_config(self) -> dict:
        """The ``config.json`` of the folder (``DeepseekV3Config`` keys)."""
        c = {k: v for k, v in asdict(self).items() if k != "seed"}
        c.update({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                  "num_key_value_heads": self.num_attention_heads, "q_lora_rank": None,
                  "head_dim": self.qk_rope_head_dim, "hidden_act": "silu", "norm_topk_prob": True,
                  "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None, "tie_word_embeddings": False,
                  "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1, "kit_seed": self.seed})
        return c


V2_LITE = DeepSeekShape()


def spec(**changes) -> DeepSeekShape:
    """:data:`V2_LITE` with some fields changed (e.g. fewer layers, or a tiny CPU model)."""
    return replace(V2_LITE, **changes)


def build(shape: DeepSeekShape = V2_LITE, device="cpu"):
    """The model (transformers' ``DeepseekV3ForCausalLM``) with random weights from ``shape.seed``
    (the library's initialisation under a seeded generator; the correction bias drawn small and
    nonzero so that it changes choices), in bf16 on ``device``."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(**{k: v for k, v in shape.hf_config().items()
                              if k not in ("architectures", "model_type", "torch_dtype", "kit_seed")})
    torch.manual_seed(shape.seed)
    with torch.device(device):
        model = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)
    g = torch.Generator(device="cpu").manual_seed(shape.seed + 1)
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            p.data.copy_((torch.randn(p.shape, generator=g) * 0.01).to(p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_((torch.randn(b.shape, generator=g) * 0.01).to(b.dtype))
    return model
