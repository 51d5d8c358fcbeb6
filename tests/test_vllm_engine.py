"""A real vLLM engine (vLLM's CPU build) with the kit's plugin switched on: a tiny random-weight
Qwen3-MoE model (the kit's own, saved as an HF folder) gives every target prompt the same tokens
and bitwise the same log-probabilities alone and inside two batches of another order, and the
decode log-probabilities equal the prefill ones; the plugin's report proves that its linear,
RMSNorm and MoE replacements ran.  The engine runs **compiled**, as vLLM ships and as kit mode
runs by default (torch.compile traces the model with the kit's custom ops as opaque nodes, Inductor
compiles the rest); chapter 7 and ``tests/test_vllm_attention.py`` run engines eager.  One engine
process (about 1.5 minutes on 2 cores, half of it compiling).

The op-level negative controls (the same checks catching batch-dependent twins, and vLLM's own
CPU GEMM differing) are in ``tests/test_vllm_plugin.py``; chapter 7 shows vLLM's default mode
changing the real model's answers."""
import random
import subprocess
import sys

import pytest

from batch_invariance_kit.serving.model import Qwen3Config, Qwen3Model
from batch_invariance_kit.vllm import runner as R

HAS_VLLM = subprocess.run([sys.executable, "-c", "import importlib.util as u, sys; "
                           "sys.exit(u.find_spec('vllm') is None)"]).returncode == 0
pytestmark = pytest.mark.skipif(not HAS_VLLM, reason="vLLM's CPU build is not installed (bash tools/kit.sh)")

CFG = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=64, seed=5)


def prompts(n, seed, lo, hi):
    rng = random.Random(seed)
    return [[rng.randrange(2, CFG.vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_kit_plugin_makes_vllm_batch_invariant(tmp_path):
    folder = tmp_path / "qwen3-moe-tiny"
    Qwen3Model(CFG).save_pretrained(folder)
    spec = R.make_spec(prompts(3, 1, 20, 60), prompts(12, 2, 5, 120), max_tokens=8,
                       filler_max_tokens=[random.Random(3).randint(2, 16) for _ in range(12)],
                       orders=(0, 1), decode_vs_prefill=2, max_model_len=256)
    doc = R.run_mode(folder, "kit", spec, timeout=420)
    assert doc["status"] == "done", doc.get("error") or doc.get("log_tail")
    s = R.summarize(doc)
    assert s["all_bitwise_equal"], s
    assert s["decode_vs_prefill_equal"], s["decode_vs_prefill"]
    assert all(d["last_token_equal"] for d in doc["decode_vs_prefill"])
    # each target sat at another place in the two batches
    a, b = doc["batches"]
    assert a["positions"] != b["positions"] and a["requests"] == 15
    assert doc["engine"]["enforce_eager"] is False and int(doc["engine"]["compilation_mode"]) > 0
    rep = doc["plugin"]
    assert rep["platforms"] == ["cpu"]
    calls = rep["calls"]
    for name in ("linear", "rms_norm", "fused_add_rms_norm", "moe"):
        assert calls.get(name, 0) > 0, calls
    assert doc["mode_env"]["VLLM_CPU_ATTN_SPLIT_KV"] is None   # not set by the caller ...
    assert doc["engine_env"]["VLLM_CPU_ATTN_SPLIT_KV"] == "0"  # ... but by the plugin, in the engine
