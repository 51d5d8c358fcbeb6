"""The kit as a vLLM general plugin: batch-invariant vLLM through vLLM's public extension points.

Installed with the kit (``pyproject.toml``: entry point ``batch_invariance_kit`` in the group
``vllm.general_plugins``), vLLM calls :func:`register` in every process it starts.  The plugin
is inert unless ``KIT_BATCH_INVARIANT=1`` (``KIT_JIT_LOG`` alone only logs Triton's compiles:
:mod:`batch_invariance_kit.vllm.jit_log`).  Switched on, it replaces every batch-variant op of
the model before the model is built:

CPU (vLLM's CPU build)
    * **linear layers and the lm_head**: ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``
      (vLLM calls it once per layer after the weights are loaded to choose that layer's GEMM:
      oneDNN, a packed-weight kernel or ``F.linear``, by shape and CPU) is replaced by one that
      gives every 2-D layer :func:`~batch_invariance_kit.ops.fixed_shape.tiled_linear`: the rows are cut into tiles of ``TILE_M`` rows
      (the last one padded with zeros), so the GEMM library only ever sees one shape per layer,
      whatever the batch.  Its blocking, K order and threading are a function of that shape.
      The one property a shape cannot fix, that a row's bits do not depend on its place in the
      tile, is checked once per (N, K, dtype) by :func:`~batch_invariance_kit.ops.fixed_shape.tile_is_position_free` on the present
      CPU; a shape that fails it runs one row per GEMM (``tile_m = 1``).
    * **RMSNorm** (plain and fused residual-add): ``CustomOp.register_oot`` makes every
      ``RMSNorm(...)`` of the model a :class:`KitRMSNorm` whose ``forward``, ``forward_native``
      and ``forward_cpu`` all run :func:`~batch_invariance_kit.ops.fixed_shape.rms_norm_fixed_tree`: the sum of squares of a row is a
      fixed pairwise tree of elementwise fp32 additions (the row padded with zeros to a power of
      two), so each row's bits are those of the row alone by construction.
    * **attention**: vLLM's CPU attention splits a long KV sequence into chunks chosen from the
      batch (``VLLM_CPU_ATTN_SPLIT_KV``, on by default); the plugin sets
      ``VLLM_CPU_ATTN_SPLIT_KV=0`` so that every query reduces its keys in one fixed order.  The
      kit's own backend (``batch_invariance_kit.vllm.attention_backend.KitAttentionBackend``, the
      kit's Triton attention) replaces ``CPU_ATTN`` through ``register_backend`` only when
      ``KIT_ATTENTION=1``: vLLM's CPU build imports Triton before it loads plugins, so Triton is
      not in interpreter mode in that process unless ``TRITON_INTERPRET=1`` was set before vLLM
      started, and the interpreter is far too slow for a 30-layer model.
    * **MoE experts**: ``CustomOp.register_oot`` replaces ``UnquantizedFusedMoEMethod`` by
      :class:`KitCPUMoEMethod` (its ``apply`` runs each expert's tokens through
      ``tiled_linear``, SiLU-and-mul, and sums the top-k outputs of a token in fp32 in rank
      order).  vLLM's router (a linear layer: tiled) and its softmax/top-k (one row at a time)
      feed it.

CUDA (vLLM 0.26)
    The kit's Triton kernels, through the torch custom ops of
    :mod:`batch_invariance_kit.ops.custom_ops`: every ``RMSNorm`` runs
    :mod:`batch_invariance_kit.ops.rms_norm`; every unquantized linear layer and the lm_head run
    :func:`batch_invariance_kit.ops.matmul.linear` (:func:`register_linear_layers`: vLLM's linear
    and embedding classes are pluggable layers; ``KIT_LINEAR=0`` keeps vLLM's); the unquantized
    MoE method runs :mod:`batch_invariance_kit.ops.moe` from vLLM's router logits.  The kit's
    attention backend, when present and ``KIT_ATTENTION`` is not ``0``, is registered as vLLM's
    ``CUSTOM`` backend (chosen with ``attention_config={"backend": "CUSTOM"}``).  The plugin sets
    ``VLLM_BATCH_INVARIANT=1`` unless the caller set it: vLLM's own mode then covers the sampler's
    ``log_softmax`` and, when another attention backend is chosen, attention.

    **The kit alone**: with ``KIT_VLLM_INVARIANT=0`` the plugin sets ``VLLM_BATCH_INVARIANT=0``
    in its process (before vLLM builds its configuration; the engine's processes inherit it),
    whatever a driver put there; a caller's own ``VLLM_BATCH_INVARIANT=0`` does the same.  What
    vLLM 0.26's own mode does on an sm_90 GPU, and what of it the kit needs
    (:data:`VLLM_MODE_PARTS`):

    * ``aten::_log_softmax`` (and softmax, ``mean.dim``, ``bmm``) through ``torch.library``: the
      sampler of vLLM's V1 model runner takes log-probabilities with ``log_softmax``; the plugin
      routes that op alone to the kit's row-wise kernel (:mod:`batch_invariance_kit.ops.override`,
      ``enable(ops=("_log_softmax",))``).  vLLM's V2 model runner (the one 0.26 runs for Qwen3 on
      a GPU) computes them in its own kernel, one program per row over fixed 1024-wide chunks:
      invariant by construction, no override needed.  No other of these ops runs in the models'
      forward (norms, GEMMs, MoE and attention are the kit's);
    * ``CUBLAS_WORKSPACE_CONFIG`` / ``CUBLASLT_WORKSPACE_SIZE`` (no split-K in cuBLAS) and TF32 off:
      for cuBLAS GEMMs, and every GEMM of an unquantized model is the kit's (``KIT_LINEAR=0`` puts
      vLLM's back: then vLLM's mode is needed);
    * attention: FlashAttention with ``num_splits=1``, cascade attention off, the AOT scheduler
      off; the kit's backend has none of these (one plan per step from the sequence lengths, no
      cascade), so **the kit alone needs the kit's attention** (``CUSTOM``): with vLLM's
      FlashAttention and its own mode off, decode splits the KV sequence by the batch;
    * the fused-MoE config pinned: the kit's MoE replaces vLLM's; NCCL settings and custom
      all-reduce off: tensor parallelism, outside this plugin's scope.

Compiled mode (vLLM's default: torch.compile, and CUDA graphs on a GPU) and eager mode
(``enforce_eager=True``) run the same replacements: everything that runs in the model's forward
is a torch custom op of :mod:`batch_invariance_kit.ops.custom_ops` (``cpu_linear``,
``cpu_rms_norm``, ``cpu_fused_add_rms_norm``, ``cpu_moe_experts`` on the CPU; ``rms_norm``,
``fused_add_rms_norm``, ``moe_from_logits`` on CUDA) with a fake implementation, so torch.compile
traces the model with each as one opaque node and the compiled graph calls the kit's code; the
decisions that need Python (the tile height of a layer) are taken when the weights are loaded.

What ran is recorded: each replacement counts its calls where its kernel runs, and with ``KIT_PLUGIN_REPORT=DIR`` every
process writes ``DIR/plugin-<pid>.json`` (plain JSON: the platform, the replacements registered,
the per-shape tile decisions and the call counters; rewritten at most every
``REPORT_INTERVAL_S`` seconds and at exit).  :func:`read_report` merges the files.  Nothing needs
an in-process engine or insecure serialization.
"""
from __future__ import annotations

import atexit
import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

from ..checks import dtype_name
from . import jit_log

ENV_SWITCH = "KIT_BATCH_INVARIANT"
ENV_REPORT = "KIT_PLUGIN_REPORT"
ENV_ATTENTION = "KIT_ATTENTION"
ENV_TILE_M = "KIT_TILE_M"
#: ``KIT_LINEAR=0`` leaves vLLM's linear layers in place on CUDA (vLLM's batch-invariant GEMM).
ENV_LINEAR = "KIT_LINEAR"
#: ``KIT_MOE=0`` leaves vLLM's MoE method in place (the other replacements still apply).
ENV_MOE = "KIT_MOE"
#: ``KIT_VLLM_INVARIANT=0``: on CUDA, kit mode without vLLM's own batch-invariant mode under it.
ENV_VLLM_INVARIANT = "KIT_VLLM_INVARIANT"
#: Rows per GEMM tile on the CPU (``KIT_TILE_M`` overrides it).
TILE_M = 16
REPORT_INTERVAL_S = 1.0

#: What the plugin puts in place of each batch-variant op of vLLM: ``(vLLM op, on the CPU (vLLM's
#: CPU build), on CUDA)``.  Chapter 7 prints it.
REPLACEMENT_TABLE = (
    ("linear layers, lm_head",
     "custom op cpu_linear = ops.fixed_shape.tiled_linear: GEMMs of TILE_M rows (dispatch_cpu_unquantized_gemm)",
     "custom op linear = ops.matmul.linear, Triton (PluggableLayer.register_oot of vLLM's linear and lm_head "
     "classes)"),
    ("RMSNorm: plain, fused residual add, q/k norms",
     "custom ops cpu_rms_norm, cpu_fused_add_rms_norm = ops.fixed_shape.rms_norm_fixed_tree (CustomOp.register_oot)",
     "custom ops rms_norm, fused_add_rms_norm = ops.rms_norm, Triton (CustomOp.register_oot)"),
    ("attention",
     "VLLM_CPU_ATTN_SPLIT_KV=0: one KV order per query; with KIT_ATTENTION=1 the kit's backend over CPU_ATTN",
     "the kit's backend (ops.attention) registered as CUSTOM; without it, vLLM's batch-invariant backend"),
    ("MoE experts (unquantized)",
     "custom op cpu_moe_experts = ops.fixed_shape.moe_experts_tiled (CustomOp.register_oot)",
     "custom op moe_from_logits = ops.moe route, dispatch, grouped GEMM, combine, Triton; DeepSeek-V3's grouped "
     "sigmoid routing: moe_grouped_from_logits = ops.routing.route, then the same experts (CustomOp.register_oot)"),
    ("sampler: log_softmax (argmax, exact in any order, is not replaced)",
     "not replaced: one row at a time on the CPU (vLLM's own mode cannot run on its CPU build)",
     "vLLM's own mode on (VLLM_BATCH_INVARIANT=1, the default): its batch-invariant log_softmax; off "
     "(KIT_VLLM_INVARIANT=0): aten::_log_softmax = ops.override.log_softmax, the kit's row-wise kernel "
     "(torch.library); vLLM's V2 runner: its own logprob kernel, one program per row"),
)

#: What vLLM's own batch-invariant mode (``VLLM_BATCH_INVARIANT=1``, vLLM 0.26 on an sm_90 GPU)
#: does, and whether the kit alone needs it: ``(part, what it covers, what kit mode does without it)``.
VLLM_MODE_PARTS = (
    ("torch.library overrides of aten::_log_softmax, softmax, mean.dim, bmm",
     "the V1 runner's sampler log-probabilities (log_softmax); nothing else in a Qwen3/Llama forward",
     "the kit routes aten::_log_softmax to ops.override.log_softmax; the V2 runner's own logprob kernel is "
     "one program per row (invariant by construction)"),
    ("CUBLAS_WORKSPACE_CONFIG=:16:8, CUBLASLT_WORKSPACE_SIZE=1, TF32 and reduced-precision reductions off",
     "cuBLAS GEMMs (no split-K)",
     "not needed: every unquantized linear layer and the lm_head run ops.matmul.linear (KIT_LINEAR=0: needed)"),
    ("FlashAttention num_splits=1, cascade attention off, AOT scheduling off",
     "vLLM's attention backends",
     "needed with vLLM's attention; the kit's backend (CUSTOM) plans splits from the sequence lengths alone"),
    ("fused-MoE config pinned (BLOCK 64x64x32, no split-K)", "vLLM's fused MoE",
     "not needed: the kit's MoE method replaces it (KIT_MOE=0: needed)"),
    ("NCCL settings, custom all-reduce off", "tensor parallelism", "outside the plugin's scope (one GPU)"),
)

#: Calls of each replacement in this process.
CALLS: dict = {}
#: What :func:`register` installed in this process (name -> description).
REPLACEMENTS: dict = {}
#: ``"N x K dtype" -> tile_m`` decided by :func:`tile_is_position_free`.
TILES: dict = {}
_STATE = {"registered": False, "platform": None, "last_write": 0.0}
_LOCK = threading.Lock()


def enabled(environ=None) -> bool:
    """``True`` when ``KIT_BATCH_INVARIANT`` is ``1`` (the only switch; anything else: inert)."""
    value = (os.environ if environ is None else environ).get(ENV_SWITCH, "0")
    if value not in ("0", "1", ""):
        raise ValueError(f"{ENV_SWITCH} must be 0 or 1, got {value!r}")
    return value == "1"


def vllm_invariant_under_kit(environ=None) -> bool:
    """Whether kit mode on CUDA runs vLLM's own batch-invariant mode under it:
    ``KIT_VLLM_INVARIANT`` ``1`` (the default) or ``0`` (the kit alone)."""
    value = (os.environ if environ is None else environ).get(ENV_VLLM_INVARIANT, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_VLLM_INVARIANT} must be 0 or 1, got {value!r}")
    return value == "1"


def tile_m(environ=None) -> int:
    value = (os.environ if environ is None else environ).get(ENV_TILE_M)
    if value is None:
        return TILE_M
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{ENV_TILE_M} must be a positive integer, got {value!r}")
    return int(value)


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------

def count(name: str) -> None:
    """Count a plugin event outside the model's forward (a layer dispatched at load).  The
    replacements that run in the forward are counted by their custom ops
    (:data:`batch_invariance_kit.ops.custom_ops.CALLS`), where the kernel runs, so the count
    holds in compiled mode too."""
    CALLS[name] = CALLS.get(name, 0) + 1
    maybe_write_report()


def maybe_write_report() -> None:
    """Rewrite the report if ``KIT_PLUGIN_REPORT`` is set and the last write is older than
    ``REPORT_INTERVAL_S``."""
    if os.environ.get(ENV_REPORT) and time.monotonic() - _STATE["last_write"] > REPORT_INTERVAL_S:
        write_report()


def snapshot() -> dict:
    calls = dict(CALLS)
    ops = sys.modules.get(f"{__package__.rsplit('.', 1)[0]}.ops.custom_ops")
    for k, v in (ops.CALLS.items() if ops is not None else ()):
        calls[k] = calls.get(k, 0) + v
    backend = sys.modules.get(f"{__package__}.attention_backend")
    if backend is not None and backend.CALLS["launches"]:
        calls["attention"] = calls.get("attention", 0) + backend.CALLS["launches"]
    return {"pid": os.getpid(), "platform": _STATE["platform"], "replacements": dict(REPLACEMENTS),
            "tiles": dict(TILES), "calls": calls}


def write_report() -> None:
    """Write this process's counters to ``$KIT_PLUGIN_REPORT/plugin-<pid>.json`` (atomically)."""
    folder = os.environ.get(ENV_REPORT)
    if not folder:
        return
    with _LOCK:
        _STATE["last_write"] = time.monotonic()
        path = Path(folder) / f"plugin-{os.getpid()}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(snapshot(), indent=1))
        os.replace(tmp, path)


def read_report(folder) -> dict:
    """Merge the per-process files of a report folder: the summed call counters, the union of
    replacements and tile decisions, and the processes that wrote one."""
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"folder must be a path, got {type(folder).__name__}")
    merged = {"processes": 0, "platforms": [], "replacements": {}, "tiles": {}, "calls": {}}
    for path in sorted(Path(folder).glob("plugin-*.json")):
        doc = json.loads(path.read_text())
        merged["processes"] += 1
        if doc.get("platform") not in merged["platforms"]:
            merged["platforms"].append(doc.get("platform"))
        merged["replacements"].update(doc.get("replacements") or {})
        merged["tiles"].update(doc.get("tiles") or {})
        for k, v in (doc.get("calls") or {}).items():
            merged["calls"][k] = merged["calls"].get(k, 0) + v
    return merged


# ---------------------------------------------------------------------------------------------
# CPU replacements: fixed-shape GEMM tiles and a fixed reduction tree
# ---------------------------------------------------------------------------------------------

def tile_for(weight: torch.Tensor) -> int:
    """The tile height for this weight's shape and dtype, decided once when the engine loads the
    layer (:func:`~batch_invariance_kit.ops.fixed_shape.tile_is_position_free` on the present CPU)
    and recorded in ``TILES``."""
    from ..ops.fixed_shape import tile_is_position_free

    key = f"{weight.shape[0]}x{weight.shape[1]} {dtype_name(weight.dtype)}"
    if key not in TILES:
        tm = tile_m()
        TILES[key] = tm if tile_is_position_free(weight, tm) else 1
    return TILES[key]


ATTENTION_BACKEND = f"{__package__}.attention_backend.KitAttentionBackend"


def _has_attention_backend() -> bool:
    return importlib.util.find_spec(f"{__package__}.attention_backend") is not None


def _register_cpu() -> None:
    import vllm.model_executor.layers.utils as vutils
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.layernorm import RMSNorm

    from ..ops import custom_ops as OPS

    original = vutils.dispatch_cpu_unquantized_gemm

    def kit_dispatch_cpu_unquantized_gemm(layer, remove_weight):
        weight = getattr(layer, "weight", None)
        if weight is None or weight.is_meta or weight.ndim != 2:
            return original(layer, remove_weight)  # not a linear layer (conv, 3-D experts)
        tm = tile_for(weight.data)

        def cpu_linear(x, w, bias):
            return OPS.cpu_linear(x, w, bias, tm)

        layer.cpu_linear = cpu_linear
        count("linear_layers_dispatched")

    vutils.dispatch_cpu_unquantized_gemm = kit_dispatch_cpu_unquantized_gemm
    REPLACEMENTS["linear"] = (f"every 2-D linear layer and the lm_head: {OPS.NAMESPACE}::cpu_linear = "
                              f"fixed_shape.tiled_linear (GEMMs of {tile_m()} rows, the shape fixed per layer)")

    class KitRMSNorm(RMSNorm):
        def forward(self, x, residual=None):
            if self.variance_size_override is not None:
                raise NotImplementedError("the kit's RMSNorm does not support var_hidden_size")
            w = self.weight if self.has_weight else None
            if residual is None:
                return OPS.cpu_rms_norm(x, w, self.variance_epsilon)
            return OPS.cpu_fused_add_rms_norm(x, residual, w, self.variance_epsilon)

        forward_native = forward
        forward_cpu = forward

    CustomOp.register_oot(KitRMSNorm, name="RMSNorm")
    REPLACEMENTS["RMSNorm"] = (f"KitRMSNorm: {OPS.NAMESPACE}::cpu_rms_norm / cpu_fused_add_rms_norm = "
                               "fixed_shape.rms_norm_fixed_tree (a fixed pairwise fp32 tree per row)")

    os.environ["VLLM_CPU_ATTN_SPLIT_KV"] = "0"
    REPLACEMENTS["attention_split_kv"] = "VLLM_CPU_ATTN_SPLIT_KV=0 (no batch-chosen KV splits)"
    if os.environ.get(ENV_ATTENTION) == "1" and _has_attention_backend():
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        register_backend(AttentionBackendEnum.CPU_ATTN, ATTENTION_BACKEND)
        REPLACEMENTS["attention"] = f"{ATTENTION_BACKEND} in place of CPU_ATTN"

    if os.environ.get(ENV_MOE, "1") == "0":
        return
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    class KitCPUMoEMethod(UnquantizedFusedMoEMethod):
        def process_weights_after_loading(self, layer):
            super().process_weights_after_loading(layer)
            # tile heights decided at load, outside any traced code
            layer.kit_tiles = (tile_for(layer.w13_weight.data[0]), tile_for(layer.w2_weight.data[0]))

        def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
            if shared_experts is not None or getattr(layer, "expert_map", None) is not None:
                raise NotImplementedError("the kit's CPU MoE supports neither shared experts nor expert maps")
            tm13, tm2 = layer.kit_tiles
            return OPS.cpu_moe_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, tm13, tm2)

    CustomOp.register_oot(KitCPUMoEMethod, name="UnquantizedFusedMoEMethod")
    REPLACEMENTS["moe"] = (f"KitCPUMoEMethod: {OPS.NAMESPACE}::cpu_moe_experts = fixed_shape.moe_experts_tiled "
                           "(tiled expert GEMMs, rank-ordered fp32 combine)")


# ---------------------------------------------------------------------------------------------
# CUDA replacements: the kit's Triton kernels
# ---------------------------------------------------------------------------------------------

def kit_rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, residual=None):
    """vLLM's ``RMSNorm.forward`` contract on the kit's Triton kernels: ``x`` of any shape
    ``(..., H)`` (Qwen3's q/k norms pass a strided ``(T, heads, head_dim)`` view), returns ``out``
    shaped like ``x``, or ``(out, x + residual)`` when a residual is given.  Rows are flattened and
    copied when needed, the weight cast to ``x``'s dtype if it differs.  The kernels are called
    through their torch custom ops (:mod:`batch_invariance_kit.ops.custom_ops`), so torch.compile
    sees one opaque node each (and the ops count their calls)."""
    from ..ops import custom_ops as OPS

    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    w = (weight if weight.dtype == x.dtype else weight.to(x.dtype)).contiguous()
    if residual is None:
        return OPS.rms_norm(x2, w, float(eps)).view(shape)
    r2 = residual.reshape(-1, shape[-1]).contiguous()
    out, z = OPS.fused_add_rms_norm(x2, r2, w, float(eps))
    return out.view(shape), z.view(residual.shape)


def kit_moe_from_logits(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        top_k: int, renormalize: bool) -> torch.Tensor:
    """The kit's MoE from vLLM's router logits: the custom op
    :func:`batch_invariance_kit.ops.custom_ops.moe_from_logits` (route, dispatch, grouped GEMM,
    combine of :mod:`batch_invariance_kit.ops.moe`)."""
    from ..ops import custom_ops as OPS

    return OPS.moe_from_logits(x, router_logits, w13, w2, int(top_k), bool(renormalize))


def kit_moe_for_layer(layer, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
    """The kit's MoE for one of vLLM's unquantized MoE layers (its routed experts; vLLM runs the
    shared experts, if any, and adds them): softmax top-k routing
    (:func:`kit_moe_from_logits`), or DeepSeek-V3's grouped sigmoid routing with a correction bias
    (``use_grouped_topk``, ``scoring_func="sigmoid"``, ``e_score_correction_bias``;
    :func:`batch_invariance_kit.ops.custom_ops.moe_grouped_from_logits`).  A layer that asks for
    anything else (a custom routing function, an expert map, weights applied on the input,
    softmax groups, a bias or a scaling factor without groups) is refused by a
    ``NotImplementedError`` naming what it asked for."""
    from ..ops import custom_ops as OPS

    grouped = bool(getattr(layer, "use_grouped_topk", False))
    scoring = getattr(layer, "scoring_func", "softmax")
    bias = getattr(layer, "e_score_correction_bias", None)
    scale = float(getattr(layer, "routed_scaling_factor", 1.0) or 1.0)
    unsupported = {
        "custom_routing_function": getattr(layer, "custom_routing_function", None) is not None,
        "expert_map": getattr(layer, "expert_map", None) is not None,
        "apply_router_weight_on_input": bool(getattr(layer, "apply_router_weight_on_input", False)),
    }
    if grouped:  # only DeepSeek-V3's form (noaux_tc): sigmoid scores and a correction bias
        unsupported["use_grouped_topk with scoring_func!=sigmoid"] = scoring != "sigmoid"
        unsupported["use_grouped_topk without e_score_correction_bias"] = bias is None
    else:
        unsupported["e_score_correction_bias"] = bias is not None
        unsupported["scoring_func!=softmax"] = scoring != "softmax"
        unsupported["routed_scaling_factor!=1"] = scale != 1.0
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise NotImplementedError(f"the kit's MoE does not support {bad}")
    if grouped:
        return OPS.moe_grouped_from_logits(x, router_logits, bias, layer.w13_weight, layer.w2_weight,
                                           int(layer.num_expert_group), int(layer.topk_group), int(layer.top_k),
                                           bool(layer.renormalize), scale)
    return kit_moe_from_logits(x, router_logits, layer.w13_weight, layer.w2_weight, int(layer.top_k),
                               bool(layer.renormalize))


def _register_cuda() -> None:
    """``RMSNorm`` and the unquantized MoE method on the kit's Triton kernels (vLLM 0.26 API:
    a method that says it is *monolithic* gets ``apply_monolithic(layer, x, router_logits)``)."""
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.layernorm import RMSNorm

    set_vllm_mode()
    from ..ops import custom_ops  # noqa: F401  (registers the kit's custom ops before vLLM compiles)

    if os.environ.get(ENV_LINEAR, "1") != "0":
        register_linear_layers()

    class KitRMSNorm(RMSNorm):
        def forward(self, x, residual=None):
            if self.variance_size_override is not None:
                raise NotImplementedError("the kit's RMSNorm does not support var_hidden_size")
            # a norm without weight: times ones (exact), the same kernel
            w = self.weight if self.has_weight else torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
            return kit_rms_norm_forward(x, w, self.variance_epsilon, residual)

        forward_native = forward
        forward_cuda = forward

    CustomOp.register_oot(KitRMSNorm, name="RMSNorm")
    REPLACEMENTS["RMSNorm"] = "KitRMSNorm: batch_invariance_kit.ops.rms_norm (Triton, impl='invariant')"

    if os.environ.get(ENV_MOE, "1") != "0":
        _register_cuda_moe()
    if os.environ.get(ENV_ATTENTION, "1") != "0" and _has_attention_backend():
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        register_backend(AttentionBackendEnum.CUSTOM, ATTENTION_BACKEND)
        REPLACEMENTS["attention"] = (f"{ATTENTION_BACKEND} registered as CUSTOM "
                                     "(selected with attention_config={'backend': 'CUSTOM'})")


def set_vllm_mode() -> bool:
    """vLLM's own batch-invariant mode under kit mode (CUDA), in this process's environment, which
    the engine's processes inherit: ``VLLM_BATCH_INVARIANT=1`` unless the caller set it, ``0`` with
    ``KIT_VLLM_INVARIANT=0``.  Off, the kit stands alone: the sampler's ``aten::_log_softmax`` runs
    the kit's row-wise kernel (:mod:`batch_invariance_kit.ops.override`; :data:`VLLM_MODE_PARTS`
    says what else vLLM's mode would do).  Returns whether vLLM's mode is on."""
    if not vllm_invariant_under_kit():
        os.environ["VLLM_BATCH_INVARIANT"] = "0"
    value = os.environ.setdefault("VLLM_BATCH_INVARIANT", "1").strip()
    if not (value.isdigit() and int(value) == 0):  # vLLM reads bool(int(value))
        REPLACEMENTS["sampler_attention"] = ("vLLM's own batch-invariant mode (VLLM_BATCH_INVARIANT=1): the sampler's "
                                             "log_softmax, and attention unless the kit's backend is selected")
        return True
    from ..ops import override

    if "_log_softmax" not in override.enabled_ops():
        override.enable(ops=("_log_softmax",))
    REPLACEMENTS["sampler"] = ("aten::_log_softmax = ops.override.log_softmax (the kit's row-wise kernel; "
                               "vLLM's own batch-invariant mode is off)")
    return False


def register_linear_layers() -> list:
    """Every unquantized linear layer and the lm_head on the kit's matmul (CUDA).

    vLLM's linear classes (``ReplicatedLinear``, ``ColumnParallelLinear``,
    ``MergedColumnParallelLinear``, ``QKVParallelLinear``, ``RowParallelLinear``) and its
    embedding/lm_head classes (``VocabParallelEmbedding``, ``ParallelLMHead``) are *pluggable
    layers*: ``PluggableLayer.register_oot`` puts a subclass in place of each, by class name.  The
    subclass builds the layer as vLLM does, then, if its method is vLLM's unquantized one, gives
    it the kit's (same weights, same loading; ``apply`` runs the custom op
    :func:`batch_invariance_kit.ops.custom_ops.linear`, i.e. :func:`batch_invariance_kit.ops.matmul.linear`).
    Quantized layers keep their own method.  Returns the class names registered."""
    import vllm.model_executor.layers.linear as L
    import vllm.model_executor.layers.vocab_parallel_embedding as V
    from vllm.model_executor.custom_op import PluggableLayer

    from ..ops import custom_ops as OPS

    def apply(self, layer, x, bias=None):
        return OPS.linear(x, layer.weight, bias)

    KitLinearMethod = type("KitLinearMethod", (L.UnquantizedLinearMethod,), {"apply": apply})
    KitEmbeddingMethod = type("KitEmbeddingMethod", (V.UnquantizedEmbeddingMethod,), {"apply": apply})

    def swapped(base, unquantized, kit):
        def __init__(self, *args, **kwargs):
            base.__init__(self, *args, **kwargs)
            if type(self.quant_method) is unquantized:
                self.quant_method = kit()

        # the same class name: vLLM finds the replacement by the name of the class it instantiates
        return type(base.__name__, (base,), {"__init__": __init__, "__module__": __name__,
                                             "__qualname__": f"kit.{base.__name__}"})

    names = []
    for module, unquantized, kit, classes in (
            (L, L.UnquantizedLinearMethod, KitLinearMethod,
             ("ReplicatedLinear", "ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear",
              "RowParallelLinear")),
            (V, V.UnquantizedEmbeddingMethod, KitEmbeddingMethod, ("VocabParallelEmbedding", "ParallelLMHead"))):
        for name in classes:
            base = getattr(module, name, None)
            if base is not None:
                PluggableLayer.register_oot(swapped(base, unquantized, kit), name=name)
                names.append(name)
    REPLACEMENTS["linear"] = (f"{', '.join(names)}: PluggableLayer.register_oot; unquantized layers run "
                              f"{OPS.NAMESPACE}::linear = ops.matmul.linear (Triton)")
    return names


def _register_cuda_moe() -> None:
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    class KitMoEMethod(UnquantizedFusedMoEMethod):
        @property
        def is_monolithic(self) -> bool:
            return True

        def apply_monolithic(self, layer, x, router_logits, input_ids=None):
            return kit_moe_for_layer(layer, x, router_logits)

    CustomOp.register_oot(KitMoEMethod, name="UnquantizedFusedMoEMethod")
    REPLACEMENTS["moe"] = ("KitMoEMethod: batch_invariance_kit.ops.moe route/dispatch/grouped_gemm/combine; "
                           "DeepSeek-V3 grouped sigmoid routing by batch_invariance_kit.ops.routing.route")


# ---------------------------------------------------------------------------------------------
# The entry point
# ---------------------------------------------------------------------------------------------

def register() -> None:
    """The ``vllm.general_plugins`` entry point (called by vLLM in each of its processes).  With
    ``KIT_JIT_LOG`` set it logs the process's Triton compiles in any mode
    (:mod:`batch_invariance_kit.vllm.jit_log`)."""
    if os.environ.get(jit_log.ENV):
        try:
            jit_log.install(os.environ[jit_log.ENV])
        except ImportError as e:  # no Triton in this process: nothing to log, the engine still starts
            print(f"[batch_invariance_kit] {jit_log.ENV} ignored: {e}", file=sys.stderr)
    if not enabled() or _STATE["registered"]:
        return
    _STATE["registered"] = True
    import batch_invariance_kit  # noqa: F401  (device selection before Triton is used)
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        _STATE["platform"] = "cpu"
        _register_cpu()
    elif current_platform.is_cuda():
        _STATE["platform"] = "cuda"
        _register_cuda()
    else:
        raise RuntimeError(f"{ENV_SWITCH}=1: the kit's vLLM plugin supports the CPU and CUDA platforms, "
                           f"not {current_platform.device_name!r}")
    if os.environ.get(ENV_REPORT):
        from ..ops import custom_ops

        custom_ops.ON_CALL.append(maybe_write_report)
        write_report()
        atexit.register(write_report)
