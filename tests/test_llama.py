"""The kit's model runs Llama layers (no per-head q/k norms, tied embeddings: SmolLM2's
architecture), so the kit's serving stack and vLLM can run the same trained weights: a small
random Llama saved by the kit loads in ``transformers`` as ``LlamaForCausalLM`` and gives the same
next-token log-probabilities (to fp32 rounding), and a Llama ``config.json`` (SmolLM2's keys)
gives the matching kit config."""
import json

import pytest
import torch

from batch_invariance_kit.serving.engine import Engine, Request, seeded_prompt
from batch_invariance_kit.serving.model import Qwen3Config, Qwen3Model, param_names

transformers = pytest.importorskip("transformers")

LLAMA = Qwen3Config(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=100000.0,
                    max_position_embeddings=256, qk_norm=False, tie_word_embeddings=True, seed=3)


def test_llama_parameters_and_config_round_trip(tmp_path):
    names = [n for n, _ in param_names(LLAMA)]
    assert not any(n.endswith(("q_norm.weight", "k_norm.weight")) for n in names) and "lm_head.weight" not in names
    c = LLAMA.hf_config()
    assert c["architectures"] == ["LlamaForCausalLM"] and c["model_type"] == "llama" and c["tie_word_embeddings"]
    assert Qwen3Config.from_hf_config(json.loads(json.dumps(c))) == LLAMA
    # SmolLM2-135M-Instruct's config.json keys (rope_parameters, dtype, no torch_dtype)
    smol = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "head_dim": 64,
            "intermediate_size": 1536, "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
            "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
            "tie_word_embeddings": True, "vocab_size": 49152, "dtype": "bfloat16", "max_position_embeddings": 8192}
    s = Qwen3Config.from_hf_config(smol)
    assert (s.qk_norm, s.tie_word_embeddings, s.rope_theta, s.torch_dtype, s.num_experts) == \
        (False, True, 100000.0, "bfloat16", 0)
    with pytest.raises(ValueError, match="num_experts"):
        Qwen3Config(qk_norm=False, num_experts=4).hf_config()


def test_llama_layers_match_transformers(tmp_path):
    """The same weights in the kit's model (its invariant kernels) and in transformers'
    ``LlamaForCausalLM`` (fp32): the next-token log-probabilities after a prompt agree."""
    folder = tmp_path / "llama"
    Qwen3Model(LLAMA).save_pretrained(folder)
    kit = Qwen3Model.from_pretrained(str(folder))
    assert kit.lm_head is kit.embed
    prompt = seeded_prompt(23, 0, LLAMA.vocab_size)
    ours = Engine(kit).run([Request(prompt, 1)])[0].logprob_rows[0].cpu().double()
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1]
    ref = torch.log_softmax(logits.double(), -1)
    assert (ours - ref).abs().max().item() < 1e-4
