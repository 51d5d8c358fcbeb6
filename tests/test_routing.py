"""DeepSeek routing: a token's experts and weights are bitwise the same alone and in batches of
many sizes; the variant (renormalisation summed as a pairwise tree from 16 tokens on) fails the
same check; the router's choices equal float64's; the DeepSeek MoE layer (routed + shared
experts) is batch-invariant and close to float64; bad hyper-parameters are refused naming the
argument.  16 experts in 4 groups, 2 kept, top-4 (DeepSeek-V3: 256 in 8, 4 kept, top-8)."""
import pytest
import torch

import batch_invariance_kit
from batch_invariance_kit.ops import routing as R
from batch_invariance_kit.verify.harness import check_invariance, row_maker, seeded_normal

DEV = batch_invariance_kit.DEVICE
E, G, TG, K = 16, 4, 2, 4
CFG = R.RoutingConfig(E, G, TG, K, routed_scaling_factor=2.5)
BIAS = (seeded_normal((E,), 9) * 0.1).to(DEV)


def test_route_batch_invariant_and_variant_caught():
    mk = row_maker((E,), dtype=torch.float32, device=DEV)
    good = check_invariance(lambda x: R.route(x, BIAS, CFG), mk, [1, 16, 40], positions="all")
    bad = check_invariance(lambda x: R.route(x, BIAS, CFG, impl="variant"), mk, [1, 16, 40], positions="all")
    assert good.passed and good.checks == 114, good.summary()
    assert bad.checks == 114 and not bad.passed, bad.summary()


def test_route_matches_float64():
    x = row_maker((E,), dtype=torch.float32, device=DEV)(64)
    w, ids = R.route(x, BIAS, CFG)
    wr, ir = R.reference_route(x, BIAS, CFG)
    assert torch.equal(ids.cpu(), ir.cpu())
    assert (w.cpu() - wr.cpu()).abs().max() < 1e-6
    # chosen experts lie in the kept groups: at most TG distinct groups per token
    assert max(len(set((ids[t] // (E // G)).tolist())) for t in range(64)) <= TG


def test_deepseek_moe_layer_invariant_and_close_to_float64():
    H, I, IS = 32, 16, 32
    dt = torch.bfloat16
    rw, wgu, wd, sgu, sd = ((seeded_normal(s, i) * s[-1] ** -0.5).to(dtype=dt, device=DEV) for i, s in
                            enumerate([(E, H), (E, 2 * I, H), (E, H, I), (2 * IS, H), (H, IS)]))
    mk = row_maker((H,), dtype=dt, device=DEV)

    def f(x, impl="invariant"):
        return R.deepseek_moe(x, rw, BIAS, wgu, wd, sgu, sd, CFG, impl=impl)
    rep = check_invariance(f, mk, [1, 9], positions="all")
    assert rep.passed and rep.checks == 10, rep.summary()
    x = mk(9)
    assert (f(x).double() - f(x, "reference").double()).abs().max() < 6e-2


def test_bad_config_is_refused_naming_the_argument():
    with pytest.raises(ValueError, match="n_group"):
        R.RoutingConfig(16, 5, 2, 4)
    with pytest.raises(ValueError, match="topk_group"):
        R.RoutingConfig(16, 4, 5, 4)
    with pytest.raises(ValueError, match="top_k"):
        R.RoutingConfig(16, 4, 1, 5)
    with pytest.raises(ValueError, match="routed_scaling_factor"):
        R.RoutingConfig(16, 4, 2, 4, routed_scaling_factor=0.0)
    x = torch.zeros((3, E), device=DEV)
    with pytest.raises(ValueError, match="bias"):
        R.route(x, BIAS[:8], CFG)
    with pytest.raises(ValueError, match="logits"):
        R.route(x[:, :8], BIAS, CFG)
    with pytest.raises(ValueError, match="impl"):
        R.route(x, BIAS, CFG, impl="fast")
