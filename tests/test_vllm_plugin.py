"""The kit's vLLM plugin, op by op, on the CPU (no engine): every replacement gives a row the
same bits alone and inside a batch, at every position; the same check catches the variant
twins; the switch, the report and the registration.

The engine-level test is ``tests/test_vllm_engine.py``."""
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batch_invariance_kit.ops import fixed_shape as FS
from batch_invariance_kit.verify.harness import bitwise_equal, seeded_normal
from batch_invariance_kit.vllm import plugin as P

ROOT = Path(__file__).resolve().parent.parent
HAS_VLLM = subprocess.run([sys.executable, "-c", "import importlib.util as u, sys; "
                           "sys.exit(u.find_spec('vllm') is None)"]).returncode == 0


def rows_alone_vs_batch(f, x: torch.Tensor) -> list:
    """Row indices whose ``f(batch)`` bits differ from ``f(row alone)`` (compared as bits: a NaN
    equals the same NaN, -0.0 differs from 0.0)."""
    whole = f(x)
    return [i for i in range(x.shape[0]) if not bitwise_equal(f(x[i:i + 1])[0], whole[i])]


def tiled(x, w, bias=None):
    """The plugin's linear: tiles of the height it decides for this weight on this CPU."""
    return FS.tiled_linear(x, w, bias, tm=P.tile_for(w))


def moe_tiled(x, w13, w2, tw, ti):
    return FS.moe_experts_tiled(x, w13, w2, tw, ti, tm_gate_up=P.tile_for(w13[0]), tm_down=P.tile_for(w2[0]))


def split_k_linear(x, w):
    """Variant twin of a linear: K cut in two halves, summed in fp32, when the batch has more
    than 8 rows (a split chosen from M, as production GEMMs choose it)."""
    if x.shape[0] <= 8:
        return torch.mm(x.float(), w.t().float()).to(x.dtype)
    h = w.shape[1] // 2
    return (torch.mm(x[:, :h].float(), w[:, :h].t().float())
            + torch.mm(x[:, h:].float(), w[:, h:].t().float())).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [5, 16, 37])
def test_tiled_linear_rows_alone_equal_rows_in_batch(dtype, m):
    g = torch.Generator().manual_seed(m)
    w = torch.randn(384, 576, generator=g).to(dtype)
    x = torch.randn(m, 576, generator=g).to(dtype)
    bias = torch.randn(384, generator=g).to(dtype)
    assert rows_alone_vs_batch(lambda t: tiled(t, w, bias), x) == []
    ref = x.double() @ w.double().t() + bias.double()
    tol = 0.1 if dtype == torch.bfloat16 else 1e-3
    assert (tiled(x, w, bias).double() - ref).abs().max() < tol * ref.abs().max()
    # a 3-D input (tokens of several sequences) keeps its leading shape
    assert tiled(x.reshape(1, m, 576), w).shape == (1, m, 384)


def test_the_same_check_catches_split_k():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 1024, generator=g)
    x = torch.randn(24, 1024, generator=g)
    assert len(rows_alone_vs_batch(lambda t: split_k_linear(t, w), x)) > 0


def test_tile_decision_is_recorded():
    w = torch.randn(64, 128).to(torch.bfloat16)
    tm = P.tile_for(w)
    assert tm in (1, P.TILE_M) and P.TILES["64x128 bfloat16"] == tm
    assert FS.tile_is_position_free(w, 1)


def test_tiled_linear_bad_input():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="weight"):
        tiled(torch.randn(2, 16), torch.randn(2, 8, 16))
    with pytest.raises(ValueError, match="K"):
        tiled(torch.randn(2, 15), w)
    with pytest.raises(TypeError, match="dtype"):
        tiled(torch.randn(2, 16).double(), w)
    with pytest.raises(TypeError, match="x must"):
        tiled([[1.0] * 16], w)


def test_tree_sum_is_fixed_and_exact_for_integers():
    v = torch.arange(1, 577, dtype=torch.float32).reshape(1, 576)
    assert FS.tree_sum_last(v).item() == 576 * 577 / 2
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(1))
    assert rows_alone_vs_batch(FS.tree_sum_last, x) == []
    assert FS.tree_sum_last(torch.ones(3, 1)).flatten().tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_fixed_tree(dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, 576, generator=g).to(dtype)
    r = torch.randn(300, 576, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    assert rows_alone_vs_batch(lambda t: FS.rms_norm_fixed_tree(t, w, 1e-5), x) == []
    both = FS.rms_norm_fixed_tree(x, w, 1e-5, r)
    for i in (0, 7, 299):
        one = FS.rms_norm_fixed_tree(x[i:i + 1], w, 1e-5, r[i:i + 1])
        assert bitwise_equal(one[0][0], both[0][i]) and bitwise_equal(one[1][0], both[1][i])
    # vLLM's semantics: the residual sum (rounded to dtype) and the normalized sum
    s = x.double() + r.double()
    ref = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    tol = 0.05 if dtype == torch.bfloat16 else 1e-5
    assert (both[0].double() - ref).abs().max() < tol * ref.abs().max()
    assert torch.equal(both[1], (x.float() + r.float()).to(dtype))


def test_moe_experts_tiled_alone_equals_batch():
    g = torch.Generator().manual_seed(3)
    T, H, I, E, k = 20, 64, 32, 4, 2
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w13 = (0.2 * torch.randn(E, 2 * I, H, generator=g)).to(torch.bfloat16)
    w2 = (0.2 * torch.randn(E, H, I, generator=g)).to(torch.bfloat16)
    logits = torch.randn(T, E, generator=g)
    tw, ti = torch.softmax(logits, -1).topk(k, -1)
    tw = tw / tw.sum(-1, keepdim=True)
    out = moe_tiled(x, w13, w2, tw, ti)
    for i in range(T):
        assert bitwise_equal(moe_tiled(x[i:i + 1], w13, w2, tw[i:i + 1], ti[i:i + 1])[0], out[i])
    # against a float64 reference
    ref = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = ti[t, j]
            h = x[t].double() @ w13[e].double().t()
            a = torch.nn.functional.silu(h[:I]) * h[I:]
            ref[t] += tw[t, j].double() * (a @ w2[e].double().t())
    assert (out.double() - ref).abs().max() < 0.05 * ref.abs().max()


def rms_norm_block_by_tokens(x, w, eps):
    """Variant twin of the RMSNorm replacement: the row's sum of squares is taken in blocks whose
    width follows the number of rows (1024 below 256 rows, 256 from there: the block-size rule
    of vLLM's RMSNorm kernel), each block by the fixed tree, the blocks added in order."""
    xf = x.float()
    b = 1024 if x.shape[0] < 256 else 256
    sq = (xf * xf).view(x.shape[0], -1, b)
    parts = FS.tree_sum_last(sq)[..., 0]
    total = parts[:, 0]
    for j in range(1, parts.shape[1]):
        total = total + parts[:, j]
    return (xf * torch.rsqrt(total[:, None] / x.shape[-1] + eps) * w.float()).to(x.dtype)


def test_the_same_check_catches_a_block_size_chosen_by_the_batch():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(300, 1024, generator=g)
    w = 1 + 0.1 * torch.randn(1024, generator=g)
    assert rows_alone_vs_batch(lambda t: FS.rms_norm_fixed_tree(t, w, 1e-5), x) == []
    assert len(rows_alone_vs_batch(lambda t: rms_norm_block_by_tokens(t, w, 1e-5), x)) > 0


def test_the_same_check_catches_split_k_experts(monkeypatch):
    """Variant twin of the MoE replacement: each expert's GEMMs split K once the expert holds
    more than 8 tokens (a config chosen from the tokens per expert, as tuned MoE kernels do)."""
    g = torch.Generator().manual_seed(3)
    T, H, I, E, k = 20, 64, 32, 4, 2
    x = torch.randn(T, H, generator=g)
    w13 = 0.2 * torch.randn(E, 2 * I, H, generator=g)
    w2 = 0.2 * torch.randn(E, H, I, generator=g)
    tw, ti = torch.softmax(torch.randn(T, E, generator=g), -1).topk(k, -1)

    def moe(t, i):
        return moe_tiled(t, w13, w2, tw[i], ti[i])

    def differing():
        whole = moe(x, slice(None))
        return [i for i in range(T) if not bitwise_equal(moe(x[i:i + 1], slice(i, i + 1))[0], whole[i])]

    assert differing() == []
    monkeypatch.setattr(FS, "tiled_linear", lambda t, w, bias=None, tm=None: split_k_linear(t, w))
    assert len(differing()) > 0


def test_sampler_log_softmax_rows_alone_equal_rows_in_batch():
    """vLLM's sampler (not replaced): fp32 log_softmax and argmax over a 49152-entry vocabulary
    are row-wise on the CPU."""
    logits = torch.randn(33, 49152, generator=torch.Generator().manual_seed(4))
    assert rows_alone_vs_batch(lambda t: torch.log_softmax(t, -1), logits) == []
    assert rows_alone_vs_batch(lambda t: t.argmax(-1, keepdim=True), logits) == []


def test_switch_and_report(tmp_path, monkeypatch):
    assert P.enabled({}) is False and P.enabled({"KIT_BATCH_INVARIANT": "1"}) is True
    with pytest.raises(ValueError, match="KIT_BATCH_INVARIANT"):
        P.enabled({"KIT_BATCH_INVARIANT": "yes"})
    with pytest.raises(ValueError, match="KIT_TILE_M"):
        P.tile_m({"KIT_TILE_M": "0"})
    assert P.tile_m({"KIT_TILE_M": "8"}) == 8 and P.tile_m({}) == P.TILE_M
    monkeypatch.setenv("KIT_PLUGIN_REPORT", str(tmp_path))
    monkeypatch.setattr(P, "CALLS", {})
    for name in ("batch_invariance_kit.ops.custom_ops", "batch_invariance_kit.vllm.attention_backend"):
        if name in sys.modules:  # counters of other tests in this process
            monkeypatch.setattr(sys.modules[name], "CALLS", collections.Counter())
    P.count("linear")
    P.count("linear")
    P.write_report()
    (tmp_path / "plugin-1.json").write_text(json.dumps({"platform": "cpu", "calls": {"linear": 5, "moe": 1},
                                                        "replacements": {"moe": "m"}}))
    r = P.read_report(tmp_path)
    assert r["processes"] == 2 and r["calls"] == {"linear": 7, "moe": 1} and r["replacements"]["moe"] == "m"
    with pytest.raises(TypeError, match="folder"):
        P.read_report(None)


def test_register_is_inert_without_the_switch():
    code = ("import os, sys; os.environ.pop('KIT_BATCH_INVARIANT', None); "
            "from batch_invariance_kit.vllm import plugin as P; P.register(); "
            "assert P.REPLACEMENTS == {} and 'vllm' not in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM's CPU build is not installed (bash tools/kit.sh installs it)")
def test_entry_point_and_registration_in_vllm(tmp_path):
    """In a fresh process: vLLM finds the entry point; with the switch on, register() installs
    every CPU replacement into vLLM's registries; vLLM's own GEMM dispatch is replaced."""
    code = r"""
import json, os, sys
os.environ["KIT_BATCH_INVARIANT"] = "1"
os.environ["KIT_PLUGIN_REPORT"] = sys.argv[1]
from importlib.metadata import entry_points
eps = [e.value for e in entry_points(group="vllm.general_plugins")]
assert "batch_invariance_kit.vllm.plugin:register" in eps, eps
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.model_executor.custom_op import op_registry_oot
import vllm.model_executor.layers.utils as U
from batch_invariance_kit.ops import fixed_shape as FS
from batch_invariance_kit.vllm import plugin as P
print(json.dumps({"oot": sorted(op_registry_oot), "dispatch": U.dispatch_cpu_unquantized_gemm.__name__,
                  "split_kv": os.environ.get("VLLM_CPU_ATTN_SPLIT_KV"), "repl": sorted(P.REPLACEMENTS)}))
"""
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"RMSNorm", "UnquantizedFusedMoEMethod"} <= set(got["oot"])
    assert got["dispatch"] == "kit_dispatch_cpu_unquantized_gemm" and got["split_kv"] == "0"
    assert {"linear", "RMSNorm", "attention_split_kv", "moe"} <= set(got["repl"])
    assert P.read_report(tmp_path)["platforms"] == ["cpu"]


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM's CPU build is not installed (bash tools/kit.sh installs it)")
@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(),
                    reason="the unreplaced GEMM's batch dependence shown here is that of AMX CPUs")
def test_unreplaced_vllm_gemm_differs_where_the_tiled_one_does_not():
    """vLLM's own CPU GEMM for SmolLM2's lm_head shape (chosen by its dispatch at load: oneDNN on
    an AMX CPU) gives a row other bits inside a batch than alone, for some batch size up to 64;
    the plugin's tiled GEMM on the same weight and rows never does."""
    code = r"""
import json, torch
import vllm.model_executor.layers.utils as U
from batch_invariance_kit.ops import fixed_shape as FS
from batch_invariance_kit.ops import fixed_shape as FS
from batch_invariance_kit.vllm import plugin as P
g = torch.Generator().manual_seed(0)
layer = torch.nn.Module()
layer.weight = torch.nn.Parameter((0.05 * torch.randn(49152, 576, generator=g)).bfloat16(), requires_grad=False)
U.dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
x = torch.randn(64, 576, generator=g).bfloat16()
out = {"vllm": [], "kit": []}
for name, f in (("vllm", lambda t: layer.cpu_linear(t, layer.weight, None)),
                ("kit", lambda t: FS.tiled_linear(t, layer.weight, tm=P.tile_for(layer.weight)))):
    alone = torch.cat([f(x[i:i + 1]) for i in range(64)])
    for m in (2, 5, 8, 16, 33, 64):
        if not torch.equal(f(x[:m]), alone[:m]):
            out[name].append(m)
print(json.dumps(out))
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["kit"] == [] and got["vllm"] != [], got


def test_vllm_mode_switch():
    assert P.vllm_invariant_under_kit({}) and P.vllm_invariant_under_kit({"KIT_VLLM_INVARIANT": "1"})
    assert not P.vllm_invariant_under_kit({"KIT_VLLM_INVARIANT": "0"})
    with pytest.raises(ValueError, match="KIT_VLLM_INVARIANT"):
        P.vllm_invariant_under_kit({"KIT_VLLM_INVARIANT": "off"})
    assert [p[0] for p in P.VLLM_MODE_PARTS] and all(len(p) == 3 for p in P.VLLM_MODE_PARTS)


@pytest.mark.parametrize("kit_vllm, driver_vllm", [(None, None), (None, "1"), ("0", "1"), (None, "0")])
def test_vllms_mode_under_kit_mode(kit_vllm, driver_vllm, monkeypatch):
    """What the CUDA registration sets before vLLM builds its configuration: vLLM's own mode under
    kit mode by default (``VLLM_BATCH_INVARIANT=1``, the sampler left to it); with
    ``KIT_VLLM_INVARIANT=0`` vLLM's mode off even where a driver set it on (or the caller's own
    ``VLLM_BATCH_INVARIANT=0``), and ``aten::_log_softmax`` (the V1 sampler's) alone routed to the
    kit's row kernel (on the kit's device: the CPU here), whose bits a log_softmax then has."""
    from batch_invariance_kit.ops import override as O

    for k, v in (("KIT_VLLM_INVARIANT", kit_vllm), ("VLLM_BATCH_INVARIANT", driver_vllm)):
        # setenv first, so that monkeypatch restores the variable set_vllm_mode writes (an absent
        # variable deleted with raising=False is not recorded, and would leak to later tests)
        monkeypatch.setenv(k, v or "")
        if v is None:
            monkeypatch.delenv(k)
    monkeypatch.setattr(P, "REPLACEMENTS", {})
    x = seeded_normal((3, 1000), 0)
    try:
        on = P.set_vllm_mode()
        n = O.call_counts["_log_softmax"]
        y = torch.log_softmax(x, -1)
        calls, ops = O.call_counts["_log_softmax"] - n, O.enabled_ops()
    finally:
        while O.is_enabled():
            O.disable()
    alone = kit_vllm == "0" or driver_vllm == "0"
    assert on is not alone and os.environ["VLLM_BATCH_INVARIANT"] == ("0" if alone else "1")
    if alone:
        assert list(P.REPLACEMENTS) == ["sampler"] and ops == ("_log_softmax",) and calls == 1
        assert bitwise_equal(y, O.log_softmax(x, -1))
    else:
        assert list(P.REPLACEMENTS) == ["sampler_attention"] and ops == () and calls == 0


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM's CPU build is not installed (bash tools/kit.sh installs it)")
def test_cuda_linear_layers_become_the_kits_matmul():
    """The CUDA replacement of linear layers and the lm_head (``register_linear_layers``), built
    here in vLLM's CPU build: vLLM's pluggable linear and lm_head classes instantiate the plugin's
    subclasses, whose unquantized method runs the kit's matmul custom op (the Triton interpreter
    here): the same bits as ``ops.matmul.linear``, counted as ``linear``."""
    code = r"""
import json, tempfile, torch
from batch_invariance_kit.vllm import plugin as P
from batch_invariance_kit.ops import custom_ops as OPS, matmul as MM
names = P.register_linear_layers()
import vllm.model_executor.layers.linear as L
import vllm.model_executor.layers.vocab_parallel_embedding as V
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
with set_current_vllm_config(VllmConfig()):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{tempfile.mktemp()}")
    initialize_model_parallel(1, 1)
    layers = {"row": L.RowParallelLinear(64, 32, bias=True, params_dtype=torch.float32),
              "qkv": L.QKVParallelLinear(64, 16, 4, 2, bias=False, params_dtype=torch.float32),
              "head": V.ParallelLMHead(100, 64, params_dtype=torch.float32)}
g = torch.Generator().manual_seed(0)
for m in layers.values():
    for p in m.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g))
x = torch.randn(7, 64, generator=g)
before = OPS.CALLS["linear"]
row, _ = layers["row"](x)
qkv, _ = layers["qkv"](x)
head = layers["head"].quant_method.apply(layers["head"], x)
same = [torch.equal(row, MM.linear(x, layers["row"].weight, layers["row"].bias)),
        torch.equal(qkv, MM.linear(x, layers["qkv"].weight)),
        torch.equal(head, MM.linear(x, layers["head"].weight))]
print(json.dumps({"names": names, "methods": sorted({type(m.quant_method).__name__ for m in layers.values()}),
                  "same": same, "calls": OPS.CALLS["linear"] - before}))
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"QKVParallelLinear", "RowParallelLinear", "ParallelLMHead", "VocabParallelEmbedding"} <= set(got["names"])
    assert got["methods"] == ["KitEmbeddingMethod", "KitLinearMethod"]
    assert got["same"] == [True, True, True] and got["calls"] == 3
