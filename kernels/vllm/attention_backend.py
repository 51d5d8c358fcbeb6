"""A vLLM attention backend that runs the kit's batch-invariant attention
(:mod:`batch_invariance_kit.ops.attention`) over vLLM's paged KV cache.

Pieces (vLLM's backend interface: backend class, metadata builder, implementation):

* :class:`KitAttentionBackend`: names the builder and the implementation, the head sizes,
  dtypes and block sizes it takes, and the KV cache it expects;
* :class:`KitAttentionMetadataBuilder`: once per engine step (one call per KV cache group,
  shared by all its layers) builds :class:`KitAttentionMetadata`, holding the kit's launch
  plan (:func:`~batch_invariance_kit.ops.attention.make_plan`) from the step's host copies of
  ``query_start_loc`` and ``seq_lens``: no layer reads metadata back from the device;
* :class:`KitAttentionImpl`: per layer, writes the step's keys and values into the cache
  (``forward_includes_kv_cache_update``) and launches the kit's kernels with the step's plan.

The KV cache.  vLLM allocates one tensor per layer whose logical shape is ``[num_blocks,
kv_heads, block_size, head_dim_k + head_dim_v]`` (vLLM 0.32: the physical order is a
``KVCacheLayout``; the per-layer view is a strided view of it); the kit reads the key from the
first ``head_dim`` entries of a token's row and the value from the rest, as a strided
``(num_blocks, block_size, kv_heads, head_dim)`` view (:func:`kv_views`): no copy.  A 5-D
cache ``[2, num_blocks, block_size, kv_heads, head_dim]`` (the shape :meth:`KitAttentionBackend.
get_kv_cache_shape` asks for, the interface of older vLLM releases such as 0.26) is read as its
two halves.  The same kernel writes and reads the cache, so the content is the kit's own.

Scope: decoder self-attention (causal; GQA), prefill, decode, mixed batches, chunked prefill and
prefix caching, any block size that is a multiple of 16, ``kv_cache_dtype="auto"``.  Not
supported (refused at construction): sliding windows, ALiBi, logit soft-capping, sinks, fp8 KV
caches, encoder or cross attention.  CUDA graphs: the builder declares no full-graph support,
so vLLM keeps attention outside its captured pieces (piecewise graphs) and the plan is built on
the host every step (whole-array operations, no Python loop per sequence, tile or token); the
kit's plan can be padded to fixed sizes for a full graph
(``make_plan(decode_capacity=..., max_seq_len=...)``, :meth:`AttnPlan.copy_`), which this builder
does not use.

:data:`CALLS` counts the builder's plans and the implementation's launches, so a test can prove
the kit's attention was in the path.  :func:`set_impl` switches every layer to the kit's
split-KV *variant* (the negative control) or back.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..ops import attention as A

try:  # vLLM's interface (0.32: vllm.v1.attention.backend; older releases: vllm.attention.backends.abstract)
    from vllm.v1.attention.backend import (AttentionBackend, AttentionImpl, AttentionMetadataBuilder,
                                           AttentionType, CommonAttentionMetadata)
except ImportError:  # pragma: no cover - the layout of older vLLM releases
    from vllm.attention.backends.abstract import AttentionBackend, AttentionImpl, AttentionType  # type: ignore
    from vllm.v1.attention.backends.utils import AttentionMetadataBuilder, CommonAttentionMetadata  # type: ignore

try:
    from vllm.v1.attention.backend import MultipleOf
except ImportError:  # pragma: no cover
    from vllm.v1.attention.backends.utils import MultipleOf  # type: ignore

__all__ = ["CALLS", "KitAttentionBackend", "KitAttentionMetadata", "KitAttentionMetadataBuilder",
           "KitAttentionImpl", "kv_views", "set_impl"]

#: ``plans``: metadata builds (engine steps x KV cache groups); ``launches``: layer calls that
#: ran the kit's kernels; ``tokens``: query tokens those calls attended
CALLS: collections.Counter = collections.Counter()

_IMPL = {"impl": "invariant"}


def set_impl(impl: str) -> None:
    """Make every layer run the kit's ``"invariant"`` kernels (the default) or its split-KV
    ``"variant"`` twin (to show a check catches batch dependence)."""
    if impl not in ("invariant", "variant"):
        raise ValueError(f"impl must be 'invariant' or 'variant', got {impl!r}")
    _IMPL["impl"] = impl


def kv_views(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int) -> tuple:
    """``(k_cache, v_cache)`` as ``(num_blocks, block_size, kv_heads, head_dim)`` strided views
    of one layer's vLLM cache: 4-D ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` (key
    then value in a token's row) or 5-D ``[2, num_blocks, block_size, kv_heads, head_dim]``."""
    if kv_cache.dim() == 5:
        if kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != (num_kv_heads, head_size):
            raise ValueError(f"kv_cache must be [2, num_blocks, block_size, {num_kv_heads}, {head_size}], got "
                             f"{tuple(kv_cache.shape)}")
        return kv_cache[0], kv_cache[1]
    if kv_cache.dim() != 4 or kv_cache.shape[1] != num_kv_heads or kv_cache.shape[3] != 2 * head_size:
        raise ValueError(f"kv_cache must be [num_blocks, {num_kv_heads}, block_size, {2 * head_size}], got "
                         f"{tuple(kv_cache.shape)}")
    k = kv_cache[..., :head_size].permute(0, 2, 1, 3)
    v = kv_cache[..., head_size:].permute(0, 2, 1, 3)
    return k, v


class KitAttentionBackend(AttentionBackend):
    """The kit's batch-invariant attention as a vLLM attention backend."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        """The name of the backend slot this class is registered over (``register_backend``:
        ``CPU_ATTN`` on vLLM's CPU build, whichever slot a GPU plugin picks), ``CUSTOM`` if none:
        vLLM resolves the layer's backend by this name."""
        try:
            from vllm.v1.attention.backends.registry import AttentionBackendEnum
        except ImportError:  # pragma: no cover - older layout
            return "CUSTOM"
        me = f"{KitAttentionBackend.__module__}.{KitAttentionBackend.__qualname__}"
        for member in AttentionBackendEnum:
            if member.is_overridden() and member.get_path() == me:
                return member.name
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type["KitAttentionImpl"]:
        return KitAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["KitAttentionMetadataBuilder"]:
        return KitAttentionMetadataBuilder

    @staticmethod
    def get_metadata_cls() -> type["KitAttentionMetadata"]:
        return KitAttentionMetadata

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(16)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [16, 32, 64, 80, 96, 112, 128, 160, 192, 256]

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True

    @classmethod
    def supported_kv_cache_layouts(cls):
        return None  # any layout: the kernels take the per-layer view's strides

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple:
        return (2, num_blocks, block_size, num_kv_heads, head_size)


@dataclass
class KitAttentionMetadata:
    """One engine step's attention metadata, shared by the layers of a KV cache group."""

    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    #: the kit's launch plan of the step, built once from host metadata
    plan: A.AttnPlan


class KitAttentionMetadataBuilder(AttentionMetadataBuilder):
    """Builds :class:`KitAttentionMetadata` once per step (the plan from host metadata)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.head_size = kv_cache_spec.head_size
        self.num_heads = vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
        self.device = device

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KitAttentionMetadata:
        m = common_attn_metadata
        n_reqs = m.num_reqs
        qsl_cpu = m.query_start_loc_cpu[:n_reqs + 1]
        # one host copy per step (a no-op when vLLM runs on the CPU), never one per layer
        lens_cpu = m.seq_lens[:n_reqs].cpu()
        plan = A.make_plan(lens_cpu, qsl_cpu, q_heads=self.num_heads, kv_heads=self.num_kv_heads,
                           head_dim=self.head_size, impl=_IMPL["impl"], device=self.device)
        CALLS["plans"] += 1
        i32 = torch.int32
        return KitAttentionMetadata(
            num_actual_tokens=int(qsl_cpu[-1]),
            query_start_loc=m.query_start_loc[:n_reqs + 1].to(i32),
            seq_lens=m.seq_lens[:n_reqs].to(i32),
            block_table=m.block_table_tensor[:n_reqs].to(i32),
            slot_mapping=m.slot_mapping,
            plan=plan)


class KitAttentionImpl(AttentionImpl):
    """Per layer: write the step's keys/values, then the kit's attention with the step's plan."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window=None, kv_cache_dtype: str = "auto", logits_soft_cap=None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks=None, **extra) -> None:
        unsupported = {"alibi_slopes": alibi_slopes, "sliding_window": sliding_window,
                       "logits_soft_cap": logits_soft_cap or None, "sinks": sinks}
        bad = [k for k, v in unsupported.items() if v is not None]
        if bad:
            raise ValueError(f"the kit's attention backend does not support {', '.join(bad)}")
        if attn_type != AttentionType.DECODER:
            raise ValueError(f"attn_type must be decoder self-attention, got {attn_type!r}")
        if kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype must be 'auto' (the kit's cache holds the model dtype), got "
                             f"{kv_cache_dtype!r}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sliding_window = None
        self.logits_soft_cap = None
        self.alibi_slopes = None
        self.sinks = None

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: KitAttentionMetadata | None, output: torch.Tensor, output_scale=None,
                output_block_scale=None, **extra) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the kit's attention backend")
        if attn_metadata is None:  # a profiling / warm-up run
            return output
        md = attn_metadata
        n = md.num_actual_tokens
        k_cache, v_cache = kv_views(kv_cache, self.num_kv_heads, self.head_size)
        if self.kv_sharing_target_layer_name is None and key is not None and value is not None:
            A.write_kv(key[:n], value[:n], k_cache, v_cache, md.slot_mapping[:n], check_slots=False)
        q = query[:n].view(n, self.num_heads, self.head_size)
        out = output[:n].view(n, self.num_heads, self.head_size)
        A.attention(q, k_cache, v_cache, md.block_table, md.seq_lens, md.query_start_loc, scale=self.scale,
                    impl=md.plan.impl, out=out, plan=md.plan)
        CALLS["launches"] += 1
        CALLS["tokens"] += n
        return output
