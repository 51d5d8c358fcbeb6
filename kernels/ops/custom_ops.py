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
=========================  ===================================================================

Only APIs present in torch 2.4 and later are used (``custom_op``, ``register_fake``).  The ops
take the device metadata of a step; an engine that plans attention once per step on the host
calls :func:`.attention.attention` with its plan from inside its own opaque attention op (the
vLLM backend does).
"""
from __future__ import annotations

import torch
from torch.library import custom_op

from . import attention as A
from . import matmul as MM
from . import moe as MOE
from . import rms_norm as RN

NAMESPACE = "batch_invariance_kit"

__all__ = ["NAMESPACE", "rms_norm", "fused_add_rms_norm", "fused_add_rms_norm_", "linear", "fused_moe", "write_kv",
           "attention"]


@custom_op(f"{NAMESPACE}::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, impl: str = "invariant") -> torch.Tensor:
    return RN.rms_norm(x, weight, eps, impl=impl)


@rms_norm.register_fake
def _(x, weight, eps, impl="invariant"):
    return torch.empty_like(x)


@custom_op(f"{NAMESPACE}::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       impl: str = "invariant") -> tuple[torch.Tensor, torch.Tensor]:
    return RN.fused_add_rms_norm(x, residual, weight, eps, impl=impl)


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps, impl="invariant"):
    return torch.empty_like(x), torch.empty_like(x)


@custom_op(f"{NAMESPACE}::fused_add_rms_norm_", mutates_args=("x", "residual"))
def fused_add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        impl: str = "invariant") -> None:
    RN.fused_add_rms_norm_(x, residual, weight, eps, impl=impl)


@fused_add_rms_norm_.register_fake
def _(x, residual, weight, eps, impl="invariant"):
    return None


@custom_op(f"{NAMESPACE}::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           impl: str = "invariant") -> torch.Tensor:
    return MM.linear(x, weight, bias, impl=impl)


@linear.register_fake
def _(x, weight, bias=None, impl="invariant"):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@custom_op(f"{NAMESPACE}::fused_moe", mutates_args=())
def fused_moe(x: torch.Tensor, router_weight: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              top_k: int, renormalize: bool = True, scoring: str = "softmax", impl: str = "invariant") -> torch.Tensor:
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
    return A.attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale=scale, impl=impl)


@attention.register_fake
def _(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale=None, impl="invariant"):
    return torch.empty_like(q)
