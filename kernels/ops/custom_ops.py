"""The kit's ops as registered torch custom ops (``torch.library.custom_op`` with a fake
implementation), so that ``torch.compile`` traces through them and CUDA graphs capture them:
the op is one node of the graph, its fake implementation gives the output's shape and dtype,
and the compiled graph calls the kit's kernel itself (the same bits as eager).

Every op vLLM's serving path calls in kit mode lives here, in the namespace
``batch_invariance_kit`` (``torch.ops.batch_invariance_kit.<name>``):

=========================  ===================================================================
op                          kit function
=========================  ===================================================================
``rms_norm``                :func:`.rms_norm.rms_norm`
``fused_add_rms_norm``      :func:`.rms_norm.fused_add_rms_norm` (functional: returns both)
``fused_add_rms_norm_``     :func:`.rms_norm.fused_add_rms_norm_` (in place, vLLM's form)
``linear``                  :func:`.matmul.linear` (linear layers and lm_head)
``fused_moe``               :func:`.moe.fused_moe`
``write_kv``                :func:`.attention.write_kv` (mutates the paged caches)
``attention``               :func:`.attention.attention`
``moe_from_logits``         the MoE of :mod:`.moe` from given router logits (vLLM computes them)
``moe_grouped_from_logits`` the same experts routed by DeepSeek-V3's grouped sigmoid routing (:func:`.routing.route`)
``cpu_linear``              :func:`.fixed_shape.tiled_linear` (vLLM's CPU build)
``cpu_rms_norm``            :func:`.fixed_shape.rms_norm_fixed_tree` (vLLM's CPU build)
``cpu_fused_add_rms_norm``  :func:`.fixed_shape.rms_norm_fixed_tree` with a residual (returns both)
``cpu_moe_experts``         :func:`.fixed_shape.moe_experts_tiled` (vLLM's CPU build)
=========================  ===================================================================

Every call of an op's implementation is counted in :data:`CALLS` under the vLLM op it stands for
(``linear``, ``rms_norm``, ``fused_add_rms_norm``, ``moe``, ``attention``), then :data:`ON_CALL`
hooks run (the vLLM plugin's report writer).  The count is taken where the kernel runs, so it
holds in eager and compiled mode; a CUDA-graph replay runs no Python and is not counted.

Only APIs present in torch 2.4 and later are used (``custom_op``, ``register_fake``).  The ops
take the device metadata of a step; an engine that plans attention once per step on the host
calls :func:`.attention.attention` with its plan from inside its own opaque attention op (the
vLLM backend does).
"""
from __future__ import annotations

import collections

import torch
from torch.library import custom_op

from . import attention as A
from . import fixed_shape as FS
from . import matmul as MM
from . import moe as MOE
from . import rms_norm as RN
from . import routing as RT

NAMESPACE = "batch_invariance_kit"

__all__ = ["NAMESPACE", "CALLS", "ON_CALL", "rms_norm", "fused_add_rms_norm", "fused_add_rms_norm_", "linear",
           "fused_moe", "moe_from_logits", "moe_grouped_from_logits", "write_kv", "attention", "cpu_linear", "cpu_rms_norm",
           "cpu_fused_add_rms_norm", "cpu_moe_experts"]

#: Calls of the ops' implementations, by the vLLM op each stands for.
CALLS: collections.Counter = collections.Counter()
#: Functions called (no arguments) after every counted call.
ON_CALL: list = []


def _called(name: str) -> None:
    CALLS[name] += 1
    for hook in ON_CALL:
        hook()


@custom_op(f"{NAMESPACE}::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, impl: str = "invariant") -> torch.Tensor:
    _called("rms_norm")
    return RN.rms_norm(x, weight, eps, impl=impl)


@rms_norm.register_fake
def _(x, weight, eps, impl="invariant"):
    return torch.empty_like(x)


@custom_op(f"{NAMESPACE}::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       impl: str = "invariant") -> tuple[torch.Tensor, torch.Tensor]:
    _called("fused_add_rms_norm")
    return RN.fused_add_rms_norm(x, residual, weight, eps, impl=impl)


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps, impl="invariant"):
    return torch.empty_like(x), torch.empty_like(x)


@custom_op(f"{NAMESPACE}::fused_add_rms_norm_", mutates_args=("x", "residual"))
def fused_add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        impl: str = "invariant") -> None:
    _called("fused_add_rms_norm")
    RN.fused_add_rms_norm_(x, residual, weight, eps, impl=impl)


@fused_add_rms_norm_.register_fake
def _(x, residual, weight, eps, impl="invariant"):
    return None


@custom_op(f"{NAMESPACE}::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           impl: str = "invariant") -> torch.Tensor:
    _called("linear")
    return MM.linear(x, weight, bias, impl=impl)


@linear.register_fake
def _(x, weight, bias=None, impl="invariant"):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@custom_op(f"{NAMESPACE}::fused_moe", mutates_args=())
def fused_moe(x: torch.Tensor, router_weight: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              top_k: int, renormalize: bool = True, scoring: str = "softmax", impl: str = "invariant") -> torch.Tensor:
    _called("moe")
    return MOE.fused_moe(x, router_weight, w_gate_up, w_down, top_k, scoring=scoring, renormalize=renormalize,
                         impl=impl)


@fused_moe.register_fake
def _(x, router_weight, w_gate_up, w_down, top_k, renormalize=True, scoring="softmax", impl="invariant"):
    return torch.empty_like(x)


@custom_op(f"{NAMESPACE}::write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    A.write_kv(key, value, k_cache, v_cache, slot_mapping)


@write_kv.register_fake
def _(key, value, k_cache, v_cache, slot_mapping):
    return None


@custom_op(f"{NAMESPACE}::attention", mutates_args=())
def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
              seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float | None = None,
              impl: str = "invariant") -> torch.Tensor:
    _called("attention")
    return A.attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale=scale, impl=impl)


@attention.register_fake
def _(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale=None, impl="invariant"):
    return torch.empty_like(q)


@custom_op(f"{NAMESPACE}::moe_from_logits", mutates_args=())
def moe_from_logits(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    top_k: int, renormalize: bool) -> torch.Tensor:
    """The kit's MoE from given router logits (vLLM computes them with its gate linear):
    :func:`.moe.route` (softmax), ``dispatch``, ``grouped_gemm`` (gate/up + SiLU-and-mul, then
    down), ``combine``.  Layouts are vLLM's: ``w13`` ``(E, 2I, H)`` gate rows then up rows, ``w2``
    ``(E, H, I)``.  No host sync (the dispatch is not validated on the host): CUDA-graph safe."""
    _called("moe")
    x = x.contiguous()
    weights, ids = MOE.route(router_logits.contiguous(), top_k, scoring="softmax", renormalize=renormalize,
                             impl="invariant")
    return _routed_experts(x, w13, w2, weights, ids)


@moe_from_logits.register_fake
def _(x, router_logits, w13, w2, top_k, renormalize):
    return torch.empty_like(x)


def _routed_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor:
    """The experts of a routed batch (``weights`` fp32, ``ids`` int32, both ``(T, top_k)``):
    ``dispatch``, gate/up + SiLU-and-mul, down, ``combine``, all invariant, without host syncs."""
    T, E, top_k = x.shape[0], w13.shape[0], ids.shape[1]
    cfg = MOE.select_config(T, top_k, E, x.dtype, "invariant")
    disp = MOE.dispatch(ids, E, cfg.block_m, validate=False)
    h = MOE.grouped_gemm(x, w13, disp, activation="silu_mul", gather_tokens=True, impl="invariant", config=cfg)
    y = MOE.grouped_gemm(h, w2, disp, impl="invariant", config=cfg)
    return MOE.combine(y, weights)


@custom_op(f"{NAMESPACE}::moe_grouped_from_logits", mutates_args=())
def moe_grouped_from_logits(x: torch.Tensor, router_logits: torch.Tensor, bias: torch.Tensor, w13: torch.Tensor,
                            w2: torch.Tensor, n_group: int, topk_group: int, top_k: int, renormalize: bool,
                            routed_scaling_factor: float) -> torch.Tensor:
    """The routed experts of a DeepSeek-V3 MoE layer from given router logits: grouped sigmoid
    routing with the correction ``bias`` (:func:`.routing.route`: ``n_group`` groups, the best
    ``topk_group`` of them by the sum of their top two biased scores, ``top_k`` experts among
    those, weights from the unbiased scores, renormalised if asked, times
    ``routed_scaling_factor``), then the experts as :func:`moe_from_logits` runs them.  The shared
    experts are not part of it (vLLM runs them as their own MLP and adds them)."""
    _called("moe")
    cfg = RT.RoutingConfig(w13.shape[0], int(n_group), int(topk_group), int(top_k),
                           routed_scaling_factor=float(routed_scaling_factor), renormalize=bool(renormalize))
    weights, ids = RT.route(router_logits.contiguous(), bias, cfg, impl="invariant")
    return _routed_experts(x.contiguous(), w13, w2, weights, ids)


@moe_grouped_from_logits.register_fake
def _(x, router_logits, bias, w13, w2, n_group, topk_group, top_k, renormalize, routed_scaling_factor):
    return torch.empty_like(x)


# ---------------------------------------------------------------------------------------------
# vLLM's CPU build: fixed-shape library calls (plain torch, :mod:`.fixed_shape`)
# ---------------------------------------------------------------------------------------------

@custom_op(f"{NAMESPACE}::cpu_linear", mutates_args=())
def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tm: int) -> torch.Tensor:
    _called("linear")
    return FS.tiled_linear(x, weight, bias, tm=tm)


@cpu_linear.register_fake
def _(x, weight, bias, tm):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@custom_op(f"{NAMESPACE}::cpu_rms_norm", mutates_args=())
def cpu_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    _called("rms_norm")
    return FS.rms_norm_fixed_tree(x, weight, eps)


@cpu_rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@custom_op(f"{NAMESPACE}::cpu_fused_add_rms_norm", mutates_args=())
def cpu_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    _called("fused_add_rms_norm")
    return FS.rms_norm_fixed_tree(x, weight, eps, residual)


@cpu_fused_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@custom_op(f"{NAMESPACE}::cpu_moe_experts", mutates_args=())
def cpu_moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, tm_gate_up: int, tm_down: int) -> torch.Tensor:
    _called("moe")
    return FS.moe_experts_tiled(x, w13, w2, topk_weights, topk_ids, tm_gate_up=tm_gate_up, tm_down=tm_down)


@cpu_moe_experts.register_fake
def _(x, w13, w2, topk_weights, topk_ids, tm_gate_up, tm_down):
    return torch.empty_like(x)
