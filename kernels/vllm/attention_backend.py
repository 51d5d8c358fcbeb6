"""A vLLM attention backend that runs the kit's batch-invariant attention
(:mod:`batch_invariance_kit.ops.attention`) over vLLM's paged KV cache.

Pieces (vLLM's backend interface: backend class, metadata builder, implementation):

* :class:`KitAttentionBackend`: names the builder and the implementation, the head sizes,
  dtypes and block sizes it takes, and the KV cache it expects;
* :class:`KitAttentionMetadataBuilder`: once per engine step (one call per KV cache group,
  shared by all its layers) builds :class:`KitAttentionMetadata`, holding the kit's launch
  plan (:func:`~batch_invariance_kit.ops.attention.make_plan`) from the step's host copies of
  ``query_start_loc`` and ``seq_lens`` that vLLM keeps (:func:`host_seq_lens`): neither the
  builder nor a layer reads metadata back from the device;
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
caches, encoder or cross attention.

CUDA graphs.  The builder declares ``AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE``
(:meth:`KitAttentionMetadataBuilder.get_cudagraph_support`; vLLM 0.26 and 0.32 alike): with
vLLM's default ``FULL_AND_PIECEWISE`` mode, a step whose requests all decode one token runs the
whole forward, attention included, as one captured graph; every other step (prefill, mixed,
chunked prefill, speculative verification) runs attention eagerly between the piecewise graphs.
A full graph replays the launches it recorded with the pointers and grid of its capture, so for
decode steps the builder keeps one padded plan (:class:`DecodePlanBuffers`: ``make_plan(
decode_capacity=capacity, max_seq_len=max_model_len)``, whose tensor sizes and launch grid do
not depend on the batch) in buffers allocated once on the device.  A capture fills them for the
capture batch; every decode step builds its padded plan on the host and copies it into the same
buffers (one copy).  ``capacity`` (:func:`decode_graph_capacity`) is the most requests a full
decode graph holds: vLLM's largest CUDA-graph capture size, at most ``max_num_seqs``.  vLLM pads
a decode batch to a capture size with requests of no new token; they get no plan entry, and the
padding tiles and merge entries up to ``capacity`` do nothing.  The metadata's
``query_start_loc``, ``seq_lens``, ``block_table`` and ``slot_mapping`` are views of vLLM's own
persistent buffers (``query_start_loc``, ``seq_lens`` and ``block_table`` in another dtype than
int32 are copied into persistent int32 buffers of the builder), and the layer call reads nothing
back from the device.  A padded plan with ``capacity * kv_heads`` programs at or above the
config's ``serial_programs`` runs serially for every batch (no workspace); below, its workspace
holds ``capacity`` tokens' split states for contexts up to ``max_model_len``.

Steps that no full graph replays keep the exact plan of the step, built on the host each step
(whole-array operations, no Python loop per sequence, tile or token): prefill and mixed steps,
decode steps of more than ``capacity`` requests, and every step when vLLM captures no full
decode graph (``enforce_eager``, ``PIECEWISE``, vLLM's CPU build, which captures none).  A layer refuses to run a
per-step plan while a CUDA graph is being captured.

:data:`CALLS` counts the builder's plans and the implementation's launches, so a test can prove
the kit's attention was in the path.  :func:`set_impl` switches every layer to the kit's
split-KV *variant* (the negative control) or back.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from ..checks import positive_int
from ..device import DEVICE
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

try:  # vLLM 0.26 and 0.32: vllm.v1.attention.backend; older releases: vllm.v1.attention.backends.utils
    from vllm.v1.attention.backend import AttentionCGSupport
except ImportError:  # pragma: no cover
    from vllm.v1.attention.backends.utils import AttentionCGSupport  # type: ignore

__all__ = ["CALLS", "DecodePlanBuffers", "KitAttentionBackend", "KitAttentionMetadata",
           "KitAttentionMetadataBuilder", "KitAttentionImpl", "decode_graph_capacity", "host_seq_lens", "kv_views",
           "set_impl"]

#: ``plans``: metadata builds (engine steps x KV cache groups), of which ``padded_plans`` refilled
#: the persistent padded decode plan; ``seq_lens_device_reads``: builds that found no exact host
#: copy of ``seq_lens`` and read the device's (a wait for the GPU); ``launches``: layer calls that
#: ran the kit's kernels outside CUDA-graph replays; ``tokens``: query tokens those calls attended
CALLS: collections.Counter = collections.Counter()

_IMPL = {"impl": "invariant"}


def set_impl(impl: str) -> None:
    """Make every layer run the kit's ``"invariant"`` kernels (the default) or its split-KV
    ``"variant"`` twin (to show a check catches batch dependence).  Once vLLM has captured full
    CUDA graphs of decode steps, they hold the plan buffers of the impl of the capture: a decode
    step under the other impl is then refused (switch with ``enforce_eager=True``)."""
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


def decode_graph_capacity(vllm_config) -> int | None:
    """The most requests a full CUDA graph of a decode step holds under ``vllm_config``: vLLM's
    largest capture size (of ``compilation_config.cudagraph_capture_sizes``), at most
    ``scheduler_config.max_num_seqs`` (vLLM captures no decode graph of more requests); ``None``
    when vLLM captures no full decode graph: its ``cudagraph_mode`` has no FULL decode mode
    (``NONE``, ``PIECEWISE``, ``enforce_eager``) or it has no capture size (vLLM's CPU build)."""
    cc = getattr(vllm_config, "compilation_config", None)
    mode = getattr(cc, "cudagraph_mode", None)
    sizes = getattr(cc, "cudagraph_capture_sizes", None)
    if mode is None or not hasattr(mode, "decode_mode") or mode.decode_mode().name != "FULL" or not sizes:
        return None
    return min(int(max(sizes)), int(vllm_config.scheduler_config.max_num_seqs))


#: vLLM's host copies of ``seq_lens`` in the step's ``CommonAttentionMetadata``, in the order
#: :func:`host_seq_lens` tries them: ``seq_lens_cpu_upper_bound`` (vLLM 0.26 and 0.32) and
#: ``_seq_lens_cpu`` (vLLM 0.26's V1 runner; absent from 0.32).  Both are the runner's host count
#: of computed plus scheduled tokens: exact, but for the draft tokens of speculative decoding,
#: which they count as accepted before the verification says how many were.
HOST_SEQ_LENS = ("seq_lens_cpu_upper_bound", "_seq_lens_cpu")


def host_seq_lens(m, n_reqs: int, *, speculative: bool = False) -> torch.Tensor | None:
    """The first ``n_reqs`` entries of the step's ``seq_lens`` from a host copy vLLM keeps in the
    common metadata ``m`` (:data:`HOST_SEQ_LENS`), or ``None`` when it keeps none, or when the
    engine verifies draft tokens (``speculative``: the host copies are upper bounds then).  The
    copy is a view of vLLM's buffer; the plan reads it at once."""
    if speculative:
        return None
    for name in HOST_SEQ_LENS:
        t = getattr(m, name, None)
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() == 1 and t.shape[0] >= n_reqs:
            return t[:n_reqs]
    return None


class DecodePlanBuffers:
    """One padded decode plan in persistent buffers: what a full CUDA graph of a decode step
    records and replays.

    ``make_plan(..., decode_capacity=capacity, max_seq_len=max_seq_len)`` gives every decode step
    of up to ``capacity`` one-token sequences the same tensor sizes and launch grid but for the
    per-token entries (the last three index tensors: ``num_tokens`` entries each).  The buffers
    hold each of the plan's index tensors at its capacity in one int32 device tensor, laid out
    by the plan's layout (:class:`~batch_invariance_kit.ops.attention.PlanLayout`, 16-byte
    aligned), and its workspace; :meth:`refill` builds a step's padded plan on the host, writes it
    into a host staging copy (pinned on CUDA) and moves that to the device in one asynchronous
    copy, and returns the step's plan as views of the buffers: the same pointers at every step.
    Entries past a step's tokens keep older values that no program reads (a token's entries are
    read only for the step's own tokens; a padding merge entry reads token 0's)."""

    def __init__(self, capacity: int, max_seq_len: int, *, q_heads: int, kv_heads: int, head_dim: int,
                 impl: str = "invariant", device=None):
        positive_int("capacity", capacity)
        positive_int("max_seq_len", max_seq_len)
        self.capacity, self.max_seq_len, self.impl = capacity, max_seq_len, impl
        self._kw = dict(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, impl=impl,
                        decode_capacity=capacity, max_seq_len=max_seq_len)
        # the largest step: every tensor at its capacity
        full = A.make_plan([max_seq_len] * capacity, np.arange(capacity + 1), device="cpu", **self._kw)
        self._launch = self._launch_shape(full)
        self.layout = A.PlanLayout.of(full)
        dev = DEVICE if device is None else torch.device(device)
        self.buffer = torch.zeros(self.layout.size, dtype=torch.int32, device=dev)
        cuda = self.buffer.is_cuda
        self._stage = torch.zeros(self.layout.size, dtype=torch.int32, pin_memory=True) if cuda else self.buffer
        self._stage_np = self._stage.numpy()
        self._copied = torch.cuda.Event() if cuda else None  # the last copy out of the staging buffer
        self.acc = torch.zeros(full.merge.acc.shape, dtype=torch.float32, device=dev)
        self.ml = torch.zeros(full.merge.ml.shape, dtype=torch.float32, device=dev)
        self._plans: dict = {}

    @staticmethod
    def _launch_shape(plan: A.AttnPlan) -> tuple:
        """What a captured launch fixes besides the per-token entries."""
        return (plan.tiles.seq.numel(), plan.decode.seq.numel(), plan.merge.tokens.numel(), plan.tiles.serial,
                plan.decode.serial, plan.merge.max_splits, tuple(plan.merge.acc.shape))

    def refill(self, seq_lens, query_start_loc) -> A.AttnPlan:
        """The padded plan of a decode step (host ``seq_lens``, ``query_start_loc``: every
        sequence has one new token, or none as a padding entry; at most ``capacity`` tokens)
        written into the buffers; returns it as views of them."""
        plan = A.make_plan(seq_lens, query_start_loc, device="cpu", **self._kw)
        if self._launch_shape(plan) != self._launch:
            raise ValueError("seq_lens/query_start_loc must describe a decode step (one new token per sequence, "
                             f"at most {self.capacity} of them)")
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the staging buffer
        self.layout.write(self._stage_np, plan)
        if self._copied is not None:
            self.buffer.copy_(self._stage, non_blocking=True)
            self._copied.record()
        # the plan over the buffers, one object per token count (built once)
        views = self._plans.get(plan.num_tokens)
        if views is None:
            views = self._plans[plan.num_tokens] = self.layout.over(self.buffer, plan, acc=self.acc, ml=self.ml)
        return views


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
    #: the plan and the tensors live in persistent buffers (a full CUDA graph may record them)
    persistent: bool = False


class KitAttentionMetadataBuilder(AttentionMetadataBuilder):
    """Builds :class:`KitAttentionMetadata` once per step from host metadata.  Full CUDA graphs
    for uniform single-token decode batches (see the module docstring): a decode step of up to
    :func:`decode_graph_capacity` requests gets the padded plan refilled in persistent buffers
    (:class:`DecodePlanBuffers`); every other step gets its exact plan."""

    #: vLLM 0.26 and 0.32 read ``_cudagraph_support`` through :meth:`get_cudagraph_support`;
    #: older releases read ``cudagraph_support``
    _cudagraph_support: ClassVar = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    cudagraph_support: ClassVar = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.head_size = kv_cache_spec.head_size
        self.num_heads = vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        #: draft tokens are verified: vLLM's host upper bound of ``seq_lens`` is not exact
        self.speculative = getattr(vllm_config, "speculative_config", None) is not None
        self.device = device
        self._capacity: int | None = None
        self._capacity_read = False
        #: per impl, the persistent padded decode plan (allocated at its first decode step)
        self._decode: dict = {}
        #: the impl whose buffers the captured graphs recorded
        self._captured_impl: str | None = None
        self._int32: dict = {}

    @classmethod
    def get_cudagraph_support(cls, vllm_config=None, kv_cache_spec=None):
        """``UNIFORM_SINGLE_TOKEN_DECODE``: full graphs for batches whose requests all decode
        one token (the padded plan covers them); prefill, mixed and speculative-decoding
        batches stay piecewise, attention outside the graphs."""
        return cls._cudagraph_support

    @property
    def capacity(self) -> int | None:
        """:func:`decode_graph_capacity` of the engine's configuration, read at the first build
        (after vLLM settled its CUDA-graph mode)."""
        if not self._capacity_read:
            self._capacity = decode_graph_capacity(self.vllm_config)
            self._capacity_read = True
        return self._capacity

    def _persistent_int32(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` as int32 at a fixed address: ``t`` itself (a view of vLLM's persistent buffer)
        when it is int32, else a copy into a persistent int32 buffer of the builder."""
        if t.dtype == torch.int32:
            return t
        buf = self._int32.get(name)
        if buf is None or buf.shape[0] < t.shape[0] or buf.shape[1:] != t.shape[1:]:
            rows = max(t.shape[0], (self.capacity or 0) + (name == "query_start_loc"))
            buf = self._int32[name] = torch.empty((rows, *t.shape[1:]), dtype=torch.int32, device=t.device)
        out = buf[:t.shape[0]]
        out.copy_(t)
        return out

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KitAttentionMetadata:
        return self._build(common_attn_metadata, capture=False)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> KitAttentionMetadata:
        """The metadata of a capture batch: for a decode batch of up to :attr:`capacity`
        requests, the padded plan in the persistent buffers (every later decode step refills
        them), and the impl of the captured graphs is fixed; any other batch (a piecewise capture
        runs attention outside the graph) gets its exact plan, which the layer refuses to run
        inside a graph capture."""
        return self._build(common_attn_metadata, capture=True)

    def _build(self, m: CommonAttentionMetadata, capture: bool) -> KitAttentionMetadata:
        n_reqs = m.num_reqs
        qsl_cpu = m.query_start_loc_cpu[:n_reqs + 1]
        num_tokens = int(qsl_cpu[-1])
        lens_cpu = host_seq_lens(m, n_reqs, speculative=self.speculative)
        if lens_cpu is None:  # no exact host copy (speculative decoding, a runner without one): wait for the GPU
            CALLS["seq_lens_device_reads"] += 1
            lens_cpu = m.seq_lens[:n_reqs].cpu()
        impl = _IMPL["impl"]
        CALLS["plans"] += 1
        capacity = self.capacity
        # a decode step: every request has one new token or none (vLLM's padding); a superset of
        # the batches vLLM replays in a full decode graph, read from the host copy (not from
        # max_query_len, which a runner may give as a bound)
        qsl_np = qsl_cpu.numpy()
        decode = num_tokens > 0 and int(np.diff(qsl_np).max()) <= 1
        if decode and capacity is not None and num_tokens <= capacity:
            if capture:
                self._captured_impl = impl
            elif self._captured_impl not in (None, impl):
                raise RuntimeError(f"set_impl({impl!r}) after CUDA-graph capture: the captured decode graphs replay "
                                   f"the {self._captured_impl!r} plan's buffers; switch impl with enforce_eager=True")
            bufs = self._decode.get(impl)
            if bufs is None:
                bufs = self._decode[impl] = DecodePlanBuffers(
                    capacity, self.max_model_len, q_heads=self.num_heads, kv_heads=self.num_kv_heads,
                    head_dim=self.head_size, impl=impl, device=self.device)
            CALLS["padded_plans"] += 1
            return KitAttentionMetadata(
                num_actual_tokens=num_tokens,
                query_start_loc=self._persistent_int32("query_start_loc", m.query_start_loc[:n_reqs + 1]),
                seq_lens=self._persistent_int32("seq_lens", m.seq_lens[:n_reqs]),
                block_table=self._persistent_int32("block_table", m.block_table_tensor[:n_reqs]),
                slot_mapping=m.slot_mapping,
                plan=bufs.refill(lens_cpu, qsl_cpu),
                persistent=True)
        plan = A.make_plan(lens_cpu, qsl_cpu, q_heads=self.num_heads, kv_heads=self.num_kv_heads,
                           head_dim=self.head_size, impl=impl, device=self.device)
        i32 = torch.int32
        return KitAttentionMetadata(
            num_actual_tokens=num_tokens,
            query_start_loc=m.query_start_loc[:n_reqs + 1].to(i32),
            seq_lens=m.seq_lens[:n_reqs].to(i32),
            block_table=m.block_table_tensor[:n_reqs].to(i32),
            slot_mapping=m.slot_mapping,
            plan=plan)


def _capturing(t: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream of ``t``'s device."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


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
        #: the layout whose tensors passed the kit's checks in this layer (:meth:`_layout`): a
        #: later call with the same layout launches unchecked (``validate=False``), since the
        #: checks of write_kv and attention cost more host time than their launches
        self._checked_layout = None

    @staticmethod
    def _layout(query, key, value, kv_cache, output, slot_mapping) -> tuple:
        """What the checks of a forward read beyond the step's sizes: the cache (its storage,
        shape, strides, dtype, device), the dtype, device, row strides and trailing shape of the
        query, new keys and values and output, and the slot mapping's dtype and device.  The
        sizes that change per step are checked on every call (:meth:`_check_sizes`), the plan
        against the call by :func:`~batch_invariance_kit.ops.attention.attention`."""
        rows = tuple(None if t is None else (t.dtype, t.device, t.stride(), t.shape[1:])
                     for t in (query, key, value, output))
        return (kv_cache.data_ptr(), kv_cache.shape, kv_cache.stride(), kv_cache.dtype, kv_cache.device,
                slot_mapping.dtype, slot_mapping.device) + rows

    @staticmethod
    def _check_sizes(md, n: int) -> None:
        """The per-step sizes an unchecked launch relies on: a slot per new token, a block-table
        row per sequence, ``num_seqs + 1`` query offsets (a few integer comparisons)."""
        s = md.seq_lens.shape[0]
        if md.slot_mapping.shape[0] < n:
            raise ValueError(f"slot_mapping has {md.slot_mapping.shape[0]} entries for {n} tokens")
        if md.block_table.shape[0] != s or md.query_start_loc.shape[0] != s + 1:
            raise ValueError(f"block_table has {md.block_table.shape[0]} rows and query_start_loc "
                             f"{md.query_start_loc.shape[0]} entries for {s} sequences (want {s} and {s + 1})")

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: KitAttentionMetadata | None, output: torch.Tensor, output_scale=None,
                output_block_scale=None, **extra) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the kit's attention backend")
        if attn_metadata is None:  # a profiling / warm-up run: no plan, no cache; zeros, never the buffer's old bytes
            return output.zero_()
        md = attn_metadata
        if not md.persistent and _capturing(query):
            raise RuntimeError("attn_metadata holds a per-step plan, which a CUDA graph being captured would replay "
                               "stale: the kit's backend has full graphs for single-token decode batches of up to "
                               "the builder's capacity only")
        n = md.num_actual_tokens
        k_cache, v_cache = kv_views(kv_cache, self.num_kv_heads, self.head_size)
        layout = self._layout(query, key, value, kv_cache, output, md.slot_mapping)
        validate = layout != self._checked_layout
        if not validate:
            self._check_sizes(md, n)
        new = {}
        if self.kv_sharing_target_layer_name is None and key is not None and value is not None:
            A.write_kv(key[:n], value[:n], k_cache, v_cache, md.slot_mapping[:n], check_slots=False, validate=validate)
            if key.dtype == k_cache.dtype:  # the step's chunks read from the keys just written (same values)
                new = {"key": key[:n], "value": value[:n]}
        q = query[:n].view(n, self.num_heads, self.head_size)
        out = output[:n].view(n, self.num_heads, self.head_size)
        A.attention(q, k_cache, v_cache, md.block_table, md.seq_lens, md.query_start_loc, scale=self.scale,
                    impl=md.plan.impl, out=out, plan=md.plan, validate=validate, **new)
        self._checked_layout = layout
        CALLS["launches"] += 1
        CALLS["tokens"] += n
        return output
