"""The DeepSeek-V2-Lite-shaped builder for the vLLM check: at a tiny size, transformers loads the
folder it writes as DeepseekV3ForCausalLM (MLA, grouped sigmoid routing, shared experts) and
runs it; the correction bias is nonzero; the full shape is V2-Lite's."""
import json

import torch

from batch_invariance_kit.vllm import deepseek_model as D

TINY = D.spec(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=2, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
              n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2)


def test_tiny_folder_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    D.build(TINY).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["kv_lora_rank"] == 32 and cfg["n_group"] == 4
    m = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(m).__name__ == "DeepseekV3ForCausalLM"
    assert m(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 256)
    bias = [t for n, t in list(m.named_parameters()) + list(m.named_buffers()) if n.endswith("e_score_correction_bias")]
    assert bias and all(bool((b != 0).any()) for b in bias)


def test_full_shape_is_v2_lite():
    c = D.V2_LITE.hf_config()
    assert (c["hidden_size"], c["num_hidden_layers"], c["kv_lora_rank"], c["qk_rope_head_dim"], c["n_routed_experts"],
            c["num_experts_per_tok"], c["n_shared_experts"], c["q_lora_rank"]) == (2048, 27, 512, 64, 64, 6, 2, None)
