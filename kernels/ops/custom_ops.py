"""The kit's ops as torch operators with a fake implementation, so that ``torch.compile`` traces
through them and CUDA graphs capture them: the op is one node of the graph, its fake
implementation gives the output's shape and dtype, and the compiled graph calls the kit's kernel
itself (the same bits as eager).

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

Registration: each op is a schema string defined in a ``torch.library.Library(NAMESPACE,
"FRAGMENT")``, its Python body registered as the kernel of the ``CPU`` and ``CUDA`` dispatch
keys, and a fake implementation registered with ``torch.library.register_fake``; :func:`_op`
does the three.  The schema declares what an op writes (``Tensor(a!)``): ``fused_add_rms_norm_``
writes ``x`` and ``residual``, ``write_kv`` writes ``k_cache`` and ``v_cache``, no other op writes
an argument, so torch.compile functionalises the two mutating ops and keeps their writes; their
kernels bump the version counters of the written tensors, as torch's own in-place ops do.  The
module's public names (``custom_ops.linear``, ...) are the ops' default overloads
(``torch.ops.batch_invariance_kit.linear.default``), called with the same arguments and defaults
as the bodies.

Why a ``Library`` with backend dispatch keys: the per-call host cost.  vLLM calls these ops about
ten times per layer per step, and a step that runs without CUDA graphs pays the host cost of
every call.  ``torch.library.custom_op`` puts Python kernels in front of the body (an autograd
kernel on every op, a version-counter kernel on the mutating ones), each a Python call and a
redispatch; a schema with backend kernels goes from the dispatcher to the body through one thin
Python wrapper (the grad check, and the version bumps of the mutating ops): a few microseconds
per call instead of a dozen or more (``tools/oneoff/host_cost.py`` times each op's call through
the dispatcher beside the kit function under it).  Kernels are registered for the ``CPU`` and
``CUDA`` keys (ROCm builds dispatch through ``CUDA``); a tensor of another backend gets torch's
error that the op has no kernel for it.  Every op carries ``pt2_compliant_tag``.

Autograd: the ops are for inference and have no derivative.  An op called with grad mode on and
a tensor argument that requires grad raises a ``RuntimeError`` naming the op and the arguments,
before its body runs (eager, and when torch.compile traces it through the fake implementation);
under ``torch.no_grad()`` or ``torch.inference_mode()`` (how vLLM runs) the check is one call of
``torch.is_grad_enabled()``.

Every call of an op's implementation is counted in :data:`CALLS` under the vLLM op it stands for
(``linear``, ``rms_norm``, ``fused_add_rms_norm``, ``moe``, ``attention``), then :data:`ON_CALL`
hooks run (the vLLM plugin's report writer).  The count is taken where the kernel runs, so it
holds in eager and compiled mode; a CUDA-graph replay runs no Python and is not counted.

Importing the module again in the same process (``importlib.reload``, or a new module object
once the first is gone from ``sys.modules``) defines nothing: the ops of the first import stay
registered for the process (a reload keeps the ``Library`` that holds them) and the public names
bind to them.  Their kernels are the first import's functions, which count in the first import's
:data:`CALLS` and run its :data:`ON_CALL` hooks: a reload rebinds both names to new, empty
objects (hooks such as the vLLM plugin's report writer must be appended again), and a new module
object's :data:`CALLS` does not see the calls.

Only APIs present in torch 2.4 and later are used (``Library.define``/``impl``, ``register_fake``,
``torch.autograd.graph.increment_version`` on one tensor).  The ops take the device metadata of
a step; an engine that plans attention once per step on the host calls
:func:`.attention.attention` with its plan from inside its own opaque attention op (the vLLM
backend does).
"""
from __future__ import annotations

import collections
import functools

import torch

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

#: The library that holds the definitions and kernels.  A reload keeps it: dropping it would
#: deregister the ops that compiled graphs and the public names refer to.
_LIB = globals().get("_LIB") or torch.library.Library(NAMESPACE, "FRAGMENT")
_OPS = getattr(torch.ops, NAMESPACE)
_grad_enabled = torch.is_grad_enabled
_increment_version = torch.autograd.graph.increment_version


def _called(name: str) -> None:
    CALLS[name] += 1
    for hook in ON_CALL:
        hook()


def _refuse_grad(qualname: str, args: tuple, kwargs: dict) -> None:
    """Raise if a tensor argument requires grad (called with grad mode on: the ops have no
    derivative), naming the op and those arguments."""
    given = (*args, *kwargs.values())
    if not any(isinstance(v, torch.Tensor) and v.requires_grad for v in given):
        return
    names = [a.name for a in getattr(_OPS, qualname.split("::")[1]).default._schema.arguments]
    grads = [n for n, v in (*zip(names, args), *kwargs.items()) if isinstance(v, torch.Tensor) and v.requires_grad]
    raise RuntimeError(
        f"{qualname} has no autograd formula (the kit's ops are for inference): called with grad mode on "
        f"and {', '.join(grads)} requiring grad; call it under torch.no_grad() or torch.inference_mode(), "
        f"or pass tensors that do not require grad")


def _inference_only(qualname: str, fn, written: tuple = ()):
    """``fn`` behind the grad check of :func:`_refuse_grad` (one ``is_grad_enabled`` call when
    grad mode is off), then the version counters of the positional arguments ``written`` bumped
    (the kernels write them through pointers, which autograd does not see)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if _grad_enabled():
            _refuse_grad(qualname, args, kwargs)
        out = fn(*args, **kwargs)
        for i in written:
            _increment_version(args[i])
        return out
    return run


def _op(schema: str, fake):
    """Decorator: define ``schema`` in :data:`NAMESPACE`, register the decorated body as its
    ``CPU`` and ``CUDA`` kernel and ``fake`` as its fake implementation, both behind the grad
    check (the kernel also bumps the version counters of the arguments the schema marks as
    written); returns the op's default overload.  An op already defined in this process (a
    second import of this module) is left as it is."""
    name = schema.split("(", 1)[0]
    qualname = f"{NAMESPACE}::{name}"

    def register(body):
        if not hasattr(_OPS, name):
            _LIB.define(schema, tags=(torch.Tag.pt2_compliant_tag,))
            args = getattr(_OPS, name).default._schema.arguments
            written = tuple(i for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write)
            # the kernel bumps the versions of args[i]: a written argument must always arrive positionally
            assert all(not args[i].kwarg_only and not args[i].has_default_value() for i in written), schema
            kernel = _inference_only(qualname, body, written)
            for key in ("CPU", "CUDA"):
                _LIB.impl(name, kernel, key)
            torch.library.register_fake(qualname, _inference_only(qualname, fake), lib=_LIB)
        return getattr(_OPS, name).default
    return register


# Fake implementations (shapes and dtypes only), shared by the ops whose outputs look alike.

def _like_first(x, *_, **__):
    return torch.empty_like(x)


def _two_like_first(x, *_, **__):
    return torch.empty_like(x), torch.empty_like(x)


def _nothing(*_, **__):
    return None


def _linear_out(x, weight, *_, **__):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@_op('rms_norm(Tensor x, Tensor weight, float eps, str impl="invariant") -> Tensor', _like_first)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, impl: str = "invariant") -> torch.Tensor:
    _called("rms_norm")
    return RN.rms_norm(x, weight, eps, impl=impl)


@_op('fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, str impl="invariant") '
     '-> (Tensor, Tensor)', _two_like_first)
def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       impl: str = "invariant") -> tuple[torch.Tensor, torch.Tensor]:
    _called("fused_add_rms_norm")
    return RN.fused_add_rms_norm(x, residual, weight, eps, impl=impl)


@_op('fused_add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, str impl="invariant") -> ()',
     _nothing)
def fused_add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        impl: str = "invariant") -> None:
    _called("fused_add_rms_norm")
    RN.fused_add_rms_norm_(x, residual, weight, eps, impl=impl)


@_op('linear(Tensor x, Tensor weight, Tensor? bias=None, str impl="invariant") -> Tensor', _linear_out)
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           impl: str = "invariant") -> torch.Tensor:
    _called("linear")
    return MM.linear(x, weight, bias, impl=impl)


@_op('fused_moe(Tensor x, Tensor router_weight, Tensor w_gate_up, Tensor w_down, SymInt top_k, '
     'bool renormalize=True, str scoring="softmax", str impl="invariant") -> Tensor', _like_first)
def fused_moe(x: torch.Tensor, router_weight: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              top_k: int, renormalize: bool = True, scoring: str = "softmax", impl: str = "invariant") -> torch.Tensor:
    _called("moe")
    return MOE.fused_moe(x, router_weight, w_gate_up, w_down, top_k, scoring=scoring, renormalize=renormalize,
                         impl=impl)


@_op("write_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()",
     _nothing)
def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    A.write_kv(key, value, k_cache, v_cache, slot_mapping)


@_op('attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, '
     'Tensor query_start_loc, float? scale=None, str impl="invariant") -> Tensor', _like_first)
def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
              seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float | None = None,
              impl: str = "invariant") -> torch.Tensor:
    _called("attention")
    return A.attention(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale=scale, impl=impl)


@_op("moe_from_logits(Tensor x, Tensor router_logits, Tensor w13, Tensor w2, SymInt top_k, bool renormalize) "
     "-> Tensor", _like_first)
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


@_op("moe_grouped_from_logits(Tensor x, Tensor router_logits, Tensor bias, Tensor w13, Tensor w2, SymInt n_group, "
     "SymInt topk_group, SymInt top_k, bool renormalize, float routed_scaling_factor) -> Tensor", _like_first)
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


# ---------------------------------------------------------------------------------------------
# vLLM's CPU build: fixed-shape library calls (plain torch, :mod:`.fixed_shape`)
# ---------------------------------------------------------------------------------------------

@_op("cpu_linear(Tensor x, Tensor weight, Tensor? bias, SymInt tm) -> Tensor", _linear_out)
def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tm: int) -> torch.Tensor:
    _called("linear")
    return FS.tiled_linear(x, weight, bias, tm=tm)


@_op("cpu_rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor", _like_first)
def cpu_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    _called("rms_norm")
    return FS.rms_norm_fixed_tree(x, weight, eps)


@_op("cpu_fused_add_rms_norm(Tensor x, Tensor residual, Tensor? weight, float eps) -> (Tensor, Tensor)",
     _two_like_first)
def cpu_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    _called("fused_add_rms_norm")
    return FS.rms_norm_fixed_tree(x, weight, eps, residual)


@_op("cpu_moe_experts(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, SymInt tm_gate_up, "
     "SymInt tm_down) -> Tensor", _like_first)
def cpu_moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, tm_gate_up: int, tm_down: int) -> torch.Tensor:
    _called("moe")
    return FS.moe_experts_tiled(x, w13, w2, topk_weights, topk_ids, tm_gate_up=tm_gate_up, tm_down=tm_down)
