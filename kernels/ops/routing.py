"""DeepSeek-V3 routing and the DeepSeek MoE layer (routed experts plus shared experts): a float64
reference, a batch-invariant Triton router and its variant twin.

The routing steps, per token (a row of the router logits ``(T, E)``):

1. **score**: ``s = sigmoid(logit)`` in fp32;
2. **bias**: ``c = s + bias`` (``e_score_correction_bias``, fp32, only for choosing);
3. **group score**: the ``E`` experts form ``n_group`` groups of ``E / n_group``; a group's score
   is the sum of its two highest ``c`` (one addition: no order to choose);
4. **group top-k**: the ``topk_group`` highest group scores are kept (ties: lower group first);
5. **top-k**: the ``top_k`` highest ``c`` among the kept groups' experts (ties: lower expert
   first); the weight of a chosen expert is its *unbiased* ``s``;
6. **renormalise**: ``w / (w_0 + w_1 + ... + w_{k-1})``, the sum a left-to-right chain in
   rank order (when ``renormalize``);
7. **scale**: ``w * routed_scaling_factor``.

Selections (3-5) are max/min reductions and comparisons: exact in any order.  The one sum of
arbitrary order is the renormalisation (6): the invariant kernel adds in rank order for every
batch; the variant adds the ranks as a pairwise tree from 16 tokens on (a lane-parallel sum of
the kind production routers pick for large batches) and in rank order below: the same weights
in other bits once the batch grows (the negative control).

:func:`deepseek_moe`: the layer.  Router logits with the kit's matmul
(:func:`batch_invariance_kit.ops.matmul.linear`), :func:`route`, the kit's MoE dispatch,
grouped GEMMs and rank-order combine (:mod:`batch_invariance_kit.ops.moe`), and the shared
experts as one SwiGLU MLP (:func:`shared_mlp`: the kit's matmul, the activation kernel
:func:`batch_invariance_kit.ops.moe.silu_mul`) whose output the combine adds after the routed
ranks, in fp32, inside its one rounding.
"""
from __future__ import annotations

import torch

from .. import checks
from ..device import INTERPRET
from . import matmul as MM
from . import moe as MOE

import triton  # noqa: E402  (after batch_invariance_kit.device)
import triton.language as tl  # noqa: E402

from .direct_launch import DirectLaunch  # noqa: E402

__all__ = ["IMPLS", "RoutingConfig", "route", "reference_route", "deepseek_moe", "reference_deepseek_moe",
           "shared_mlp", "VARIANT_TREE_FROM"]

IMPLS = ("invariant", "variant", "reference")
#: the variant sums the renormalisation as a pairwise tree from this many tokens on
VARIANT_TREE_FROM = 16


class RoutingConfig:
    """DeepSeek routing hyper-parameters, checked against the number of experts:
    ``n_group`` must divide ``num_experts`` with at least two experts per group (the group
    score adds the top two), ``1 <= topk_group <= n_group``, ``1 <= top_k <=`` the experts of the
    kept groups, ``routed_scaling_factor > 0``."""

    def __init__(self, num_experts: int, n_group: int, topk_group: int, top_k: int,
                 routed_scaling_factor: float = 1.0, renormalize: bool = True):
        for name, v in (("num_experts", num_experts), ("n_group", n_group), ("topk_group", topk_group),
                        ("top_k", top_k)):
            checks.positive_int(name, v)
        if num_experts % n_group:
            raise ValueError(f"n_group={n_group} must divide num_experts={num_experts}")
        if num_experts // n_group < 2:
            raise ValueError(f"n_group={n_group} leaves {num_experts // n_group} expert per group; the group score "
                             f"adds the top two, so each group needs at least 2")
        if topk_group > n_group:
            raise ValueError(f"topk_group={topk_group} must be <= n_group={n_group}")
        kept = topk_group * (num_experts // n_group)
        if top_k > kept:
            raise ValueError(f"top_k={top_k} is more than the {kept} experts of the {topk_group} kept groups")
        self.routed_scaling_factor = checks.positive_float("routed_scaling_factor", routed_scaling_factor)
        if not isinstance(renormalize, bool):
            raise TypeError(f"renormalize must be a bool, got {type(renormalize).__name__}")
        self.num_experts, self.n_group, self.topk_group, self.top_k = num_experts, n_group, topk_group, top_k
        self.renormalize = renormalize

    def __repr__(self) -> str:
        return (f"RoutingConfig(num_experts={self.num_experts}, n_group={self.n_group}, topk_group="
                f"{self.topk_group}, top_k={self.top_k}, routed_scaling_factor={self.routed_scaling_factor}, "
                f"renormalize={self.renormalize})")


def _check_impl(impl):
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def _check_route_args(logits, bias, cfg):
    if not isinstance(cfg, RoutingConfig):
        raise TypeError(f"cfg must be a RoutingConfig, got {type(cfg).__name__}")
    checks.tensor("logits", logits, dim=2)
    checks.tensor("bias", bias, dtypes=(torch.float32,), dim=1)
    checks.same_device("bias", bias, "logits", logits)
    if logits.shape[1] != cfg.num_experts:
        raise ValueError(f"logits have {logits.shape[1]} experts but cfg.num_experts={cfg.num_experts}")
    if bias.shape[0] != cfg.num_experts:
        raise ValueError(f"bias must have shape ({cfg.num_experts},), got {tuple(bias.shape)}")


def reference_route(logits: torch.Tensor, bias: torch.Tensor, cfg: RoutingConfig) -> tuple:
    """float64 routing: ``(weights fp32 (T, k), ids int32 (T, k))``, ranks by biased score
    (ties: lower index first, by stable sorts)."""
    _check_route_args(logits, bias, cfg)
    T, E = logits.shape
    s = torch.sigmoid(logits.double())
    c = s + bias.double()
    g = c.view(T, cfg.n_group, E // cfg.n_group)
    gscore = torch.sort(g, dim=-1, descending=True, stable=True)[0][..., :2].sum(-1)
    keep = torch.sort(gscore, dim=-1, descending=True, stable=True)[1][:, :cfg.topk_group]
    gmask = torch.zeros((T, cfg.n_group), dtype=torch.bool, device=logits.device).scatter_(1, keep, True)
    cm = c.masked_fill(~gmask.repeat_interleave(E // cfg.n_group, dim=1), float("-inf"))
    ids = torch.sort(cm, dim=-1, descending=True, stable=True)[1][:, :cfg.top_k]
    w = s.gather(1, ids)
    if cfg.renormalize:
        w = w / w.sum(-1, keepdim=True)
    return (w * cfg.routed_scaling_factor).float(), ids.to(torch.int32)


@triton.jit(do_not_specialize=["T"])
def _ds_router_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, T, scaling, s_lt,
                      E: tl.constexpr, E_PAD: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                      TOPK_GROUP: tl.constexpr, TOPK: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                      RENORM: tl.constexpr, TREE: tl.constexpr):
    """Program: ``BLOCK_T`` tokens, each row on its own (max/min selections, the rank-order
    renormalisation; ``TREE``: the variant's pairwise sum)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    e = tl.arange(0, E_PAD)
    e_ok = e < E
    x = tl.load(logits_ptr + t.to(tl.int64)[:, None] * s_lt + e[None, :], mask=t_ok[:, None] & e_ok[None, :],
                other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-x))
    c = s + tl.load(bias_ptr + e, mask=e_ok, other=0.0)[None, :]
    c = tl.where(e_ok[None, :], c, float("-inf"))
    grp = e // (E // G)
    # group scores: top two of each group (the first maximum by index, then the rest's maximum)
    gs = tl.full((BLOCK_T, G_PAD), float("-inf"), tl.float32)
    gi = tl.arange(0, G_PAD)
    for g in tl.static_range(G):
        cg = tl.where((grp == g)[None, :], c, float("-inf"))
        m1 = tl.max(cg, 1)
        i1 = tl.min(tl.where(cg == m1[:, None], e[None, :], E_PAD), 1)
        m2 = tl.max(tl.where(e[None, :] == i1[:, None], float("-inf"), cg), 1)
        gs = tl.where((gi == g)[None, :], (m1 + m2)[:, None], gs)
    kept = tl.zeros((BLOCK_T, G_PAD), tl.int32)
    for _ in tl.static_range(TOPK_GROUP):
        mg = tl.max(gs, 1)
        ig = tl.min(tl.where(gs == mg[:, None], gi[None, :], G_PAD), 1)
        hit = gi[None, :] == ig[:, None]
        kept = tl.where(hit, 1, kept)
        gs = tl.where(hit, float("-inf"), gs)
    # experts of the kept groups: kept[t, grp[e]] as a sum of one-hot matches (integers)
    keep_e = tl.zeros((BLOCK_T, E_PAD), tl.int32)
    for g in tl.static_range(G):
        kg = tl.sum(tl.where((gi == g)[None, :], kept, 0), 1)
        keep_e = tl.where((grp == g)[None, :], kg[:, None], keep_e)
    c = tl.where((keep_e > 0) & e_ok[None, :], c, float("-inf"))
    kk = tl.arange(0, K_PAD)
    w = tl.zeros((BLOCK_T, K_PAD), tl.float32)
    ids = tl.zeros((BLOCK_T, K_PAD), tl.int32)
    total = tl.zeros((BLOCK_T,), tl.float32)
    for r in tl.static_range(TOPK):
        mc = tl.max(c, 1)
        ie = tl.min(tl.where(c == mc[:, None], e[None, :], E_PAD), 1)
        hit = e[None, :] == ie[:, None]
        wr = tl.sum(tl.where(hit, s, 0.0), 1)  # the one selected s (other terms are 0)
        c = tl.where(hit, float("-inf"), c)
        w = tl.where((kk == r)[None, :], wr[:, None], w)
        ids = tl.where((kk == r)[None, :], ie[:, None], ids)
        total = total + wr  # rank order: ((w0 + w1) + w2) + ...
    if RENORM:
        if TREE:  # the variant: a pairwise tree over the ranks (padded ranks hold 0)
            x2 = w
            for i in tl.static_range(K_PAD.bit_length() - 1):
                x2 = tl.sum(tl.reshape(x2, (BLOCK_T, K_PAD >> (i + 1), 2)), 2)
            total = tl.reshape(x2, (BLOCK_T,))
        w = w / total[:, None]
    w = w * scaling
    k_ok = t_ok[:, None] & (kk < TOPK)[None, :]
    o = t.to(tl.int64)[:, None] * TOPK + kk[None, :]
    tl.store(w_ptr + o, w, mask=k_ok)
    tl.store(ids_ptr + o, ids, mask=k_ok)


#: tokens per router program (rows never mix: a launch shape only)
ROUTER_BLOCK_T = 16


def route(logits: torch.Tensor, bias: torch.Tensor, cfg: RoutingConfig, *, impl: str = "invariant") -> tuple:
    """DeepSeek routing of ``logits`` ``(T, E)`` (any float dtype) with the correction ``bias``
    ``(E,)`` fp32 -> ``(weights fp32 (T, top_k), ids int32 (T, top_k))``, ranks by biased score."""
    _check_impl(impl)
    _check_route_args(logits, bias, cfg)
    if impl == "reference":
        return reference_route(logits, bias, cfg)
    checks.kernel_device("logits", logits)
    if logits.stride(1) != 1:
        raise ValueError(f"logits must have unit stride in the expert dim, got strides {logits.stride()}")
    T, E = logits.shape
    k = cfg.top_k
    w = torch.empty((T, k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((T, k), dtype=torch.int32, device=logits.device)
    tree = impl == "variant" and T >= VARIANT_TREE_FROM
    _DS_ROUTER(
        (triton.cdiv(T, ROUTER_BLOCK_T),), logits, bias.contiguous(), w, ids, T, cfg.routed_scaling_factor,
        logits.stride(0), E=E,
        E_PAD=max(16, triton.next_power_of_2(E)), G=cfg.n_group, G_PAD=max(2, triton.next_power_of_2(cfg.n_group)),
        TOPK_GROUP=cfg.topk_group, TOPK=k, K_PAD=max(2, triton.next_power_of_2(k)), BLOCK_T=ROUTER_BLOCK_T,
        RENORM=cfg.renormalize, TREE=tree)
    return w, ids


def _check_layer(x, router_weight, bias, w_gate_up, w_down, shared_gate_up, shared_down, cfg):
    checks.tensor("x", x, dim=2)
    T, H = x.shape
    for name, t, d in (("router_weight", router_weight, 2), ("w_gate_up", w_gate_up, 3), ("w_down", w_down, 3),
                       ("shared_gate_up", shared_gate_up, 2), ("shared_down", shared_down, 2)):
        checks.tensor(name, t, dim=d)
        checks.same_dtype(name, t, "x", x)
        checks.same_device(name, t, "x", x)
    E = cfg.num_experts if isinstance(cfg, RoutingConfig) else None
    if tuple(router_weight.shape) != (E, H):
        raise ValueError(f"router_weight must have shape ({E}, {H}), got {tuple(router_weight.shape)}")
    if w_gate_up.shape[0] != E or w_gate_up.shape[2] != H or w_gate_up.shape[1] % 2:
        raise ValueError(f"w_gate_up must have shape ({E}, 2*I, {H}), got {tuple(w_gate_up.shape)}")
    if tuple(w_down.shape) != (E, H, w_gate_up.shape[1] // 2):
        raise ValueError(f"w_down must have shape ({E}, {H}, {w_gate_up.shape[1] // 2}), got {tuple(w_down.shape)}")
    if shared_gate_up.shape[1] != H or shared_gate_up.shape[0] % 2:
        raise ValueError(f"shared_gate_up must have shape (2*I_shared, {H}), got {tuple(shared_gate_up.shape)}")
    if tuple(shared_down.shape) != (H, shared_gate_up.shape[0] // 2):
        raise ValueError(f"shared_down must have shape ({H}, {shared_gate_up.shape[0] // 2}), got "
                         f"{tuple(shared_down.shape)}")


def deepseek_moe(x, router_weight, bias, w_gate_up, w_down, shared_gate_up, shared_down, cfg: RoutingConfig, *,
                 impl: str = "invariant") -> torch.Tensor:
    """A DeepSeek MoE layer: ``x`` ``(T, H)``; ``router_weight`` ``(E, H)``; ``bias`` ``(E,)``
    fp32; routed experts ``w_gate_up`` ``(E, 2I, H)`` (gate rows, then up), ``w_down`` ``(E, H,
    I)``; the shared experts as one MLP ``shared_gate_up`` ``(2 I_s, H)``, ``shared_down`` ``(H,
    I_s)`` -> ``(T, H)`` in x's dtype: the routed experts' ranks summed in fp32 in rank order,
    then the shared experts' output added, rounded once (:func:`batch_invariance_kit.ops.moe.combine`)."""
    _check_impl(impl)
    if not isinstance(cfg, RoutingConfig):
        raise TypeError(f"cfg must be a RoutingConfig, got {type(cfg).__name__}")
    _check_layer(x, router_weight, bias, w_gate_up, w_down, shared_gate_up, shared_down, cfg)
    if impl == "reference":
        return reference_deepseek_moe(x, router_weight, bias, w_gate_up, w_down, shared_gate_up, shared_down, cfg)
    T, H = x.shape
    logits = MM.linear(x, router_weight, impl=impl)
    w, ids = route(logits, bias, cfg, impl=impl)
    mcfg = MOE.select_config(T, cfg.top_k, cfg.num_experts, x.dtype, impl)
    disp = MOE.dispatch(ids, cfg.num_experts, mcfg.block_m, validate=False)
    h = MOE.grouped_gemm(x, w_gate_up, disp, activation="silu_mul", gather_tokens=True, impl=impl, config=mcfg)
    y = MOE.grouped_gemm(h, w_down, disp, impl=impl, config=mcfg)
    return MOE.combine(y, w, shared=shared_mlp(x, shared_gate_up, shared_down, impl=impl), impl=impl)


def shared_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, *, impl: str = "invariant") -> torch.Tensor:
    """The shared experts as one SwiGLU MLP with the kit's matmul: ``x`` ``(T, H)``, ``gate_up``
    ``(2 I_s, H)`` (gate rows, then up), ``down`` ``(H, I_s)`` -> ``(T, H)`` in x's dtype; the
    activation ``silu(gate) * up`` in fp32, rounded once, by one elementwise kernel
    (:func:`batch_invariance_kit.ops.moe.silu_mul`: the same bits in any batch); with
    ``impl="reference"`` torch's matmul and the same formula in torch, on any device."""
    gu = MM.linear(x, gate_up, impl=impl)
    if impl == "reference":
        i_s = gu.shape[1] // 2
        g, u = gu[:, :i_s].float(), gu[:, i_s:].float()
        act = (g / (1.0 + torch.exp(-g)) * u).to(x.dtype)
    else:
        act = MOE.silu_mul(gu)
    return MM.linear(act, down, impl=impl)


def reference_deepseek_moe(x, router_weight, bias, w_gate_up, w_down, shared_gate_up, shared_down,
                           cfg: RoutingConfig) -> torch.Tensor:
    """float64 layer from the router logits (rounded to x's dtype, as the kernels' are) on,
    rounded once."""
    logits = (x.double() @ router_weight.double().t()).to(x.dtype)
    w, ids = reference_route(logits, bias, cfg)
    x64 = x.double()
    inter = w_gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for r in range(cfg.top_k):
        for e in torch.unique(ids[:, r]).tolist():
            sel = (ids[:, r] == e).nonzero().squeeze(1)
            h = x64[sel] @ w_gate_up[e].double().t()
            act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
            out[sel] += w[sel, r].double().unsqueeze(1) * (act @ w_down[e].double().t())
    gu = x64 @ shared_gate_up.double().t()
    i_s = gu.shape[1] // 2
    out += (torch.nn.functional.silu(gu[:, :i_s]) * gu[:, i_s:]) @ shared_down.double().t()
    return out.to(x.dtype)


#: the eager launch of the router kernel (:mod:`.direct_launch`)
_DS_ROUTER = DirectLaunch(_ds_router_kernel)
