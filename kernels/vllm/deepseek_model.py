"""A DeepSeek-V2-Lite-shaped model with random weights, written as a Hugging Face folder that vLLM
(and transformers) load as ``DeepseekV3ForCausalLM``: MLA attention (no q LoRA, latent 512,
rope 64, nope 128, values 128), DeepSeek-V3 routing (sigmoid scores plus a correction bias,
group-limited top-k) over 64 routed experts in 8 groups, 4 kept, top-6, 2 shared experts, the
first layer dense.  Built on the box from a seed (no hub).

:data:`V2_LITE` is the shape (a :class:`batch_invariance_kit.serving.deepseek.DeepSeekConfig`, the
config of the kit's own DeepSeek model too); :func:`spec` gives a smaller one with the same
structure (the CPU test builds a tiny one); :func:`build` returns transformers' model, with
``save_pretrained(folder)``.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..serving.deepseek import DeepSeekConfig

__all__ = ["V2_LITE", "spec", "build"]

#: DeepSeek-V2-Lite's shape with DeepSeek-V3's routing (the config's defaults)
V2_LITE = DeepSeekConfig()


def spec(**changes) -> DeepSeekConfig:
    """:data:`V2_LITE` with some fields changed (e.g. fewer layers, or a tiny CPU model)."""
    return replace(V2_LITE, **changes)


def build(shape: DeepSeekConfig = V2_LITE, device="cpu"):
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
