"""Matmul: a float64 reference, a batch-*invariant* Triton matmul and its split-K *variant* twin.

Public ops (each takes ``impl=``, ``out=`` and ``config=``):

* ``mm(a, b)``                 ``(M, K) @ (K, N)``
* ``addmm(bias, a, b)``        ``bias + a @ b``, bias broadcastable to ``(M, N)``
* ``linear(x, weight, bias)``  ``x @ weight.T + bias``; ``x`` may be N-D (leading dims flattened)
* ``bmm(a, b)``                ``(B, M, K) @ (B, K, N)``

``impl``:

* ``"invariant"`` (default): every output element is reduced over K in ONE order whatever M is,
  the order of :mod:`batch_invariance_kit.ops.k_order` (shared with the MoE grouped GEMM; its
  ``block_k``, ``k_chunk`` and ``k_chunk_blocks`` are re-exported here):
  no split-K chosen from the shape, ``BLOCK_K`` a function of the dtype only (:func:`block_k`),
  ``acc = tl.dot(a, b, acc)`` with fp32 accumulation (fp32 inputs: ``input_precision="ieee"``,
  so TF32 never enters), K from 0 upward.  Up to ``K = 4096`` that is one loop over K.  A
  longer K (a "long K", :func:`k_chunk`) is cut into fixed chunks of 2048 keys, each summed from
  zero upward, the chunk sums added in chunk order: a *fixed* split-K, a function of K only
  (the weight's shape), never of M, the matmul's twin of attention's fixed split size.  So
  thin-M configs may compute each chunk in its own program (``split_chunks``) and add the fp32
  chunk sums in the same order in a second kernel, with the same bits: more programs where
  M is too thin to fill the GPU.  The M/N tiling (:data:`CONFIGS`) only decides *which
  program* computes an element, not *how*, so any config may be forced with ``config=`` and
  must give the same bits (tests and :func:`batch_invariance_kit.bench.matmul.config_sweep`
  check that);
* ``"variant"``: the same kernel launched like production: split-K picked from the shape
  (:func:`variant_split_k`: more splits for small M and long K, none from M = 256 on), fp32
  partial sums added in split order by a second kernel, then rounded.  Another M, another
  split, another summation order: it fails the invariance check (the negative control);
* ``"cublas"``: plain torch (``torch.mm`` / ``addmm`` / ``F.linear`` / ``bmm``): cuBLAS on a GPU,
  the CPU BLAS here; the real-world peer;
* ``"reference"``: float64 torch, rounded once to the output dtype.

Numerics of the kit's kernels: inputs fp32, fp16 or bf16 (``a``, ``b``, bias of one dtype);
accumulation fp32; the bias is widened to fp32 and added after the *whole* K reduction; the
sum is rounded once to the input dtype (round to nearest even, by integer arithmetic for bf16:
the Triton interpreter's own fp32->bf16 cast truncates).  ``K = 0`` gives ``0 + bias`` (zeros
without a bias); ``M = 0`` or ``N = 0`` gives an empty output; nothing is launched for them.

Config selection (:func:`select_config`) is therefore about speed only: a small cost model
(:func:`predict_us`) predicts each config's time from the shape and the GPU's SM count, never
from the data, as ``launches * launch_us + max(bytes / GB/s, steps * us per step)``: a
memory-bound term (thin M streams the weight once, at the bandwidth that config's pipeline
reaches) and a compute-bound term with wave quantisation (the busiest SM runs
``ceil(programs / SMs)`` programs in turn, so 160 tiles on 132 SMs cost two tiles' time).  Two
coefficients per config and one launch cost (:data:`COST_MODEL`) are fit to the H200 sweep by
:func:`batch_invariance_kit.bench.matmul.fit_cost_model`; the pick is cached per shape.  A long
K's split-chunks configs enter the same way: their extra programs, the fp32 chunk sums' bytes
and the second launch are in the terms (:func:`cost_terms`).

Strides: inputs of any strides (transposed weights, expanded views, slices) are read in place
(the strides go to the kernel; nothing is copied); ``out`` may be strided too but must not
share memory with an input.

Under the Triton interpreter (no GPU) 16-bit tiles are widened to fp32 before ``tl.dot``
(exact: the product of two 16-bit floats fits in fp32), because the interpreter's ``tl.dot``
reads bf16 tiles as raw integers.  Compiled on a GPU, 16-bit tiles go to the tensor cores.
Loads: configs with ``tma=True`` read 2-D operands with Hopper TMA (host-side
``triton.tools.tensor_descriptor.TensorDescriptor``; Triton >= 3.4; B either as (K, N) rows or
as a linear weight's (N, K) rows), optionally with a warp-specialised K loop; everything else
(bmm, unaligned rows, split-K) uses plain pointer loads.  The loads differ, the arithmetic does
not: every config gives the same bits (tests on CPU, the H200 sweep on the GPU).  ``M`` (and the
tile count from it) reaches the kernels unspecialised (``do_not_specialize``; the chunk reduction
pass's ``M`` too): Triton compiles once per launch config, not once per integer class of M (1, a
multiple of 16, other).
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch

from .. import checks
from ..device import INTERPRET, sm_count
from .k_order import LONG_K, Product, block_k, k_chunk, k_chunk_blocks, launch_chunk_reduce, ptr_step

import triton  # noqa: E402  (after batch_invariance_kit.device: the interpreter is chosen first)
import triton.language as tl  # noqa: E402

from .tma import descriptor  # noqa: E402
from .direct_launch import DirectLaunch  # noqa: E402

__all__ = [
    "IMPLS",
    "MMConfig",
    "CONFIGS",
    "TRIAL_CONFIGS",
    "CostModel",
    "COST_MODEL",
    "cost_terms",
    "predict_us",
    "rank_configs",
    "block_k",
    "k_chunk",
    "k_chunk_blocks",
    "select_config",
    "invariant_candidates",
    "variant_split_k",
    "launch_info",
    "stream_k_runs",
    "launch",
    "plant_variant",
    "mm",
    "addmm",
    "linear",
    "bmm",
]

IMPLS = ("invariant", "variant", "cublas", "reference")


# --------------------------------------------------------------------------------------------
# Configurations (pure data and functions: the book prints them)
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MMConfig:
    """An M/N tiling of the output.  ``BLOCK_K`` is *not* here: it is fixed by the dtype."""

    name: str
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int
    persistent: bool = False
    #: load tiles with Hopper TMA (host tensor descriptors) when the operands allow it (2-D,
    #: unit inner stride, 16-byte aligned rows); other operands fall back to pointer loads.
    #: The loads change, not the arithmetic: the same bits either way (tests and the sweep).
    tma: bool = False
    #: warp-specialised K loop (``tl.range(warp_specialize=True)``); TMA configs only
    warp_spec: bool = False
    #: thin M: one program per (tile, K chunk), the chunks' fp32 sums added in chunk order by a
    #: second kernel (the same additions the one-program loop does: the same bits, more CTAs)
    split_chunks: bool = False
    #: stream-K over a long K's fixed chunks (TMA configs, one 2-D product): one program per SM
    #: takes an equal run of (tile, chunk) units in tile order, so a tile may be cut between two
    #: programs at a chunk boundary; the earlier program hands its running fp32 sum on, the later
    #: one adds its chunks to it in chunk order (:func:`_mm_stream_k_kernel`): the additions of
    #: the one-program chunk loop, the same bits, without a partial last wave
    stream_k: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


#: The shipped configs (all give the same bits: the tests and the GPU sweep check it): each is
#: within a few percent of the best in some cell of the H200 sweep
#: (``results/h200/matmul_sweep.json``); :func:`select_config` weighs them all.  ``m16``: BLOCK_M =
#: 16 compiles to ``mma.sync`` rather than ``wgmma`` on Hopper, with the same bits; thin-M configs
#: with deep pipelines; TMA configs (``tma=True``: Hopper's bulk tensor copies from host tensor
#: descriptors; ``warp_spec``: a warp-specialised K loop).  A persistent grid (``persistent=True``)
#: gives the same bits too (tests), but no persistent config came within a few percent of the best
#: in the sweep.
CONFIGS = [
    MMConfig("mid", 64, 128, num_warps=4, num_stages=4, group_m=8),
    MMConfig("m16", 16, 64, num_warps=4, num_stages=4, group_m=1),
    # thin M (memory-bound): narrow N tiles for many CTAs, deep pipelines for bytes in flight
    MMConfig("t64n32s8", 64, 32, num_warps=4, num_stages=8, group_m=1),
    MMConfig("t64n32s12", 64, 32, num_warps=4, num_stages=12, group_m=1),
    MMConfig("t16n32tma", 16, 32, num_warps=2, num_stages=8, group_m=1, tma=True),
    # thin M, long K: one program per (tile, fixed K chunk), chunk sums added in order
    MMConfig("m16c", 16, 64, num_warps=4, num_stages=6, group_m=1, split_chunks=True),
    MMConfig("midc", 64, 128, num_warps=4, num_stages=4, group_m=1, split_chunks=True),
    # mid and large M: TMA loads, deeper pipelines, warp specialisation
    MMConfig("mid_tma", 64, 128, num_warps=4, num_stages=6, group_m=8, tma=True),
    MMConfig("large_tma", 128, 128, num_warps=8, num_stages=4, group_m=8, tma=True),
    MMConfig("tall_tma", 256, 128, num_warps=8, num_stages=4, group_m=8, tma=True),
    MMConfig("wide_tma", 128, 256, num_warps=8, num_stages=4, group_m=8, tma=True),
    MMConfig("wide_tma_ws", 128, 256, num_warps=8, num_stages=3, group_m=8, tma=True, warp_spec=True),
]

#: Configs to measure, not shipped: tiles and schedules a GPU sweep times beside :data:`CONFIGS`
#: for a refit of the cost model (:func:`batch_invariance_kit.bench.matmul.refit_sweep`).  Each
#: changes only which program computes an output tile (the tile shape, the grid order, the
#: programs along a long K's fixed chunks), never the K order of :mod:`.k_order`, so each gives the
#: bits of every shipped config (tests under the interpreter; the sweep checks each on the GPU).
#: :func:`select_config` never picks one (it has no coefficients until a sweep fits it); a refit
#: that finds one fastest somewhere moves it into :data:`CONFIGS` with its fitted coefficients.
#: (No 128 x 128 tile with two resident programs per SM: its fp32 accumulator alone is 16384
#: values, 128 registers a thread with 4 warps before any address or pipeline state; with 8
#: warps it is 64 a thread, and two resident 256-thread programs leave each thread at most 128
#: of the SM's 65536 registers for everything.)
TRIAL_CONFIGS = [
    # narrower N tiles: more programs for 5120-wide outputs at mid M
    MMConfig("m128n64_tma", 128, 64, num_warps=4, num_stages=4, group_m=8, tma=True),
    MMConfig("m64n64_tma", 64, 64, num_warps=4, num_stages=6, group_m=8, tma=True),
    # persistent grids: one program per SM walks the tiles in the fixed grouped order
    MMConfig("large_tma_p", 128, 128, num_warps=8, num_stages=4, group_m=8, persistent=True, tma=True),
    MMConfig("mid_tma_p", 64, 128, num_warps=4, num_stages=6, group_m=8, persistent=True, tma=True),
    # thin M, long K: narrow tiles times the fixed chunks, for more programs than SMs
    MMConfig("t16n32c", 16, 32, num_warps=2, num_stages=8, group_m=1, split_chunks=True),
    MMConfig("t64n32c", 64, 32, num_warps=4, num_stages=8, group_m=1, split_chunks=True),
    # stream-K over a long K's chunks: every SM busy to the end, whatever the tile count.  On an
    # H100 (results/h100/matmul_refit_*.json) the handed-on sums gave the chunk loop's bits in every
    # cell, but no stream-K config was the fastest anywhere: at K > 4096 0.41-0.94 of the speed of
    # the fastest other config (0.63 at M 1024, K 32768).  Not profiled; likely causes: programs
    # that run at the same time start at other tiles and chunks, so they read different K slices
    # (little L2 reuse), and a continuation computes its chunks only after the wait
    MMConfig("large_tma_sk", 128, 128, num_warps=8, num_stages=4, group_m=8, tma=True, stream_k=True),
    MMConfig("mid_tma_sk", 64, 128, num_warps=4, num_stages=6, group_m=8, tma=True, stream_k=True),
    MMConfig("m128n64_sk", 128, 64, num_warps=4, num_stages=4, group_m=8, tma=True, stream_k=True),
]
_BY_NAME = {c.name: c for c in CONFIGS + TRIAL_CONFIGS}

class CostModel(NamedTuple):
    """Coefficients of :func:`predict_us`, fit by
    :func:`batch_invariance_kit.bench.matmul.fit_cost_model` from a GPU sweep."""

    #: host-to-kernel cost of one launch, us (a split-chunks launch makes two)
    launch_us: float
    #: config name -> (us per K step of one program, GB/s the config streams at)
    coef: dict
    #: SMs of the GPU it was fit on (the default SM count where no GPU is asked)
    sms: int


#: The shipped cost model, fit on the stored H200 sweeps (bf16; every config at four (N, K), the
#: top configs at eight: ``batch_invariance_kit.bench.matmul.FIT_SOURCES``) by
#: :func:`batch_invariance_kit.bench.matmul.fit_cost_model` (a test refits it from those files and
#: compares).  Every config of :data:`CONFIGS` has coefficients.
COST_MODEL = CostModel(launch_us=2.5, sms=132, coef={
    # name: (us per K step, GB/s)
    "mid": (0.3454, 4100.0),
    "m16": (0.247, 4200.0),
    "t64n32s8": (0.1571, 3000.0),
    "t64n32s12": (0.1889, 2800.0),
    "t16n32tma": (0.1124, 3000.0),
    "m16c": (0.1921, 4100.0),
    "midc": (0.4084, 4000.0),
    "mid_tma": (0.2641, 3300.0),
    "large_tma": (0.4294, 2300.0),
    "tall_tma": (0.8118, 2900.0),
    "wide_tma": (0.7983, 2400.0),
    "wide_tma_ws": (0.772, 2400.0),
})


def _check_select_args(M, N, K, dtype, sms) -> int:
    """Validate :func:`select_config`'s arguments; the SM count to use."""
    for name, v in (("M", M), ("N", N), ("K", K)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    block_k(dtype)  # a float dtype, or TypeError
    return _default_sms() if sms is None else checks.positive_int("sms", sms)


def _default_sms() -> int:
    """SMs of the current GPU; under the interpreter, those of the GPU :data:`COST_MODEL` was fit on."""
    return COST_MODEL.sms if INTERPRET else sm_count()


def cost_terms(cfg: MMConfig, M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16, *, sms: int,
               compiled: bool | None = None) -> dict:
    """The shape facts :func:`predict_us` weighs for ``cfg``: ``programs`` (output tiles times
    programs along K), ``rounds`` (programs per SM on the busiest SM: ``ceil(programs / sms)``,
    the wave quantisation), ``steps`` (BLOCK_K steps the busiest SM runs: rounds times the steps
    of one program), ``bytes`` (A, B and C once, plus the fp32 chunk sums of a split-chunks
    launch, written and read back) and ``launches`` (2 with a split-chunks second pass).  A
    stream-K config (``stream_k``) runs ``min(sms, units)`` programs over the ``tiles * chunks``
    units (:func:`_k_units`): one round, the busiest program ``ceil(units / programs)`` chunks of
    the mean length (``K / chunks``); its handed-on sums add their bytes, and the zeroed flags a
    second launch."""
    programs_k, per_program, chunk_blocks = _k_plan("invariant", cfg, M, N, K, dtype, compiled)
    tiles = _cdiv(M, cfg.block_m) * _cdiv(N, cfg.block_n)
    elt = torch.empty((), dtype=dtype).element_size()
    nbytes = (M * K + K * N + M * N) * elt
    if cfg.stream_k:
        k_blocks, chunks = _k_units(K, dtype, chunk_blocks)
        units = tiles * chunks
        programs = min(sms, units)
        return {"programs": programs, "rounds": 1, "steps": _cdiv(units, programs) * k_blocks / chunks,
                "bytes": nbytes + 2 * programs * cfg.block_m * cfg.block_n * 4, "launches": 2}
    programs = tiles * programs_k
    rounds = _cdiv(programs, sms)
    nbytes += 2 * programs_k * M * N * 4 if programs_k > 1 else 0
    return {"programs": programs, "rounds": rounds, "steps": rounds * per_program, "bytes": nbytes,
            "launches": 2 if programs_k > 1 else 1}


def predict_us(cfg: MMConfig, M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16, *, sms: int,
               compiled: bool | None = None, model: CostModel | None = None) -> float:
    """Predicted kernel time (us) of ``cfg`` for an (M, K) x (K, N) product on a GPU of ``sms``
    SMs (:data:`COST_MODEL` unless ``model``)::

        launches * launch_us + max(bytes / GB/s of cfg,  steps * us per step of cfg)

    with the terms of :func:`cost_terms`.  The first term of the max is the memory-bound time
    (thin M: the weight streamed once, at the bandwidth this config's pipeline reaches), the
    second the compute-bound time with wave quantisation: a step is one BLOCK_K slice of one
    output tile, and the busiest SM runs ``ceil(programs / sms)`` programs one after another
    (several resident programs share its tensor cores), so 160 tiles on 132 SMs cost two
    tiles' time, not 1.2."""
    model = COST_MODEL if model is None else model
    t = cost_terms(cfg, M, N, K, dtype, sms=sms, compiled=compiled)
    us_per_step, gbs = model.coef[cfg.name]
    return t["launches"] * model.launch_us + max(t["bytes"] / (gbs * 1e3), t["steps"] * us_per_step)


def _candidates(dtype: torch.dtype) -> list:
    """The configs :func:`select_config` weighs: all of :data:`CONFIGS`; for fp32 only tiles up
    to 128 x 128 (fp32 tiles take twice the registers and shared memory of 16-bit ones)."""
    if dtype == torch.float32:
        return [c for c in CONFIGS if c.block_m * c.block_n <= 128 * 128]
    return list(CONFIGS)


def rank_configs(M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16, *, sms: int | None = None,
                 compiled: bool | None = None, model: CostModel | None = None, configs=None) -> list:
    """``[(predicted us, config), ...]`` of :func:`select_config`'s candidates (or of
    ``configs``, each with coefficients in the model), fastest first (ties: list order).
    ``sms``: None for this process's GPU (:func:`_default_sms`)."""
    sms = _check_select_args(M, N, K, dtype, sms)
    cands = _candidates(dtype) if configs is None else list(configs)
    pred = [predict_us(c, max(M, 1), max(N, 1), max(K, 1), dtype, sms=sms, compiled=compiled, model=model)
            for c in cands]
    order = sorted(range(len(cands)), key=lambda i: (pred[i], i))
    return [(pred[i], cands[i]) for i in order]


@functools.lru_cache(maxsize=8192)
def _select(M: int, N: int, K: int, dtype: torch.dtype, compiled: bool, sms: int) -> MMConfig:
    return rank_configs(M, N, K, dtype, sms=sms, compiled=compiled)[0][1]


def select_config(M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16, *,
                  compiled: bool | None = None, sms: int | None = None) -> MMConfig:
    """The config the kit launches for an (M, K) x (K, N) product: the one :func:`predict_us`
    predicts fastest on a GPU of ``sms`` SMs (None: this process's GPU, or the fit's under the
    interpreter).  A function of the shape, the dtype and the SM count only (never of the
    data), cached per shape; whatever it picks, the bits are the same (the tiling over M/N never
    touches the K order).  ``compiled``: as in :func:`k_chunk` (which K is long, so which
    configs run one program per K chunk)."""
    sms = _check_select_args(M, N, K, dtype, sms)
    return _select(M, N, K, dtype, (not INTERPRET) if compiled is None else bool(compiled), sms)


def invariant_candidates() -> list:
    """Every config a GPU sweep checks bitwise: all of :data:`CONFIGS`."""
    return list(CONFIGS)


def variant_split_k(M: int, N: int, K: int, dtype: torch.dtype) -> int:
    """Production-like split-K: none from M = 256 on (enough output tiles to fill the GPU);
    below, 8 / 4 / 2 splits for M <= 16 / <= 64 / < 256, at most one split per K block."""
    kb = triton.cdiv(K, block_k(dtype)) if K > 0 else 0
    if M >= 256 or kb < 2:
        return 1
    want = 8 if M <= 16 else 4 if M <= 64 else 2
    return min(want, kb)


def _config_arg(config):
    """The ``config=`` argument of an op: ``None`` (:func:`select_config` picks) or an :class:`MMConfig`
    (a name is looked up in :data:`CONFIGS`)."""
    if config is None or isinstance(config, MMConfig):
        return config
    if isinstance(config, str):
        if config not in _BY_NAME:
            raise ValueError(f"config must be one of {sorted(_BY_NAME)} or an MMConfig, got {config!r}")
        return _BY_NAME[config]
    raise TypeError(f"config must be None, a config name or an MMConfig, got {type(config).__name__}")


def _resolve_config(config, M, N, K, dtype, compiled=None) -> MMConfig:
    config = _config_arg(config)
    return select_config(M, N, K, dtype, compiled=compiled) if config is None else config


def _num_programs_persistent(tiles: int, device_index: int | None = None) -> int:
    """Persistent grid: one program per SM of the device (the current one when ``device_index``
    is None; 3 under the interpreter, to exercise the loop)."""
    sms = 3 if INTERPRET else sm_count(device_index)
    return max(1, min(sms, tiles))


def launch_info(M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16, *, impl: str = "invariant",
                config=None, batch: int = 1, compiled: bool | None = None) -> dict:
    """What a launch of ``impl`` does for this shape: config, BLOCK_K, split_k, K chunks, grid
    (``compiled``: the long-K rule of a GPU or of the interpreter, ``None``: this process's; see
    :func:`k_chunk`.  A persistent grid is sized from this process's SM count either way)."""
    cfg = _resolve_config(config, M, N, K, dtype, compiled)
    bk = block_k(dtype)
    programs_k, _, chunk_blocks = _k_plan(impl, cfg, M, N, K, dtype, compiled)
    split = programs_k if impl == "variant" else 1
    tiles = batch * triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    persistent = cfg.persistent and programs_k == 1
    progs = _num_programs_persistent(tiles) if persistent and tiles else tiles
    return {"impl": impl, "M": M, "N": N, "K": K, "batch": batch, "dtype": checks.dtype_name(dtype),
            "config": cfg.name, "block_m": cfg.block_m, "block_n": cfg.block_n, "block_k": bk,
            "split_k": split, "k_blocks": triton.cdiv(K, bk) if K else 0, "persistent": persistent,
            "k_chunk": chunk_blocks * bk or K, "chunk_programs": programs_k if impl != "variant" else 1,
            "tiles": tiles, "grid": (progs, programs_k), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
            "tma": cfg.tma and programs_k == 1 and batch == 1, "warp_spec": cfg.warp_spec,
            "split_chunks": programs_k > 1 and impl != "variant"}


from .tl_numerics import dot_acc, from_f32, to_f32  # noqa: E402  (exact fp32 <-> 16-bit moves, the tile product)


# --------------------------------------------------------------------------------------------
# The kernels
# --------------------------------------------------------------------------------------------

@triton.jit
def _tile_coords(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(batch, tile row, tile column) of linear tile number ``tile``: GROUP_M tile rows are
    walked column by column (L2 reuse of the B columns)."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_batch = num_pid_m * num_pid_n
    bid = tile // per_batch
    t = tile % per_batch
    in_group = GROUP_M * num_pid_n
    first_m = (t // in_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    return bid, first_m + (t % in_group) % group_size, (t % in_group) // group_size


@triton.jit
def _epilogue(acc, c_ptr, bias_ptr, bid, pid_m, pid_n, M, N, s_cb, s_cm, s_cn, s_biasm, s_biasn,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr):
    """``out = round(acc + bias)``: the bias widened to fp32 after the whole K reduction, one
    rounding (RNE) to out's dtype."""
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows[:, None] * s_biasm + cols[None, :] * s_biasn, mask=mask, other=0.0)
        acc = acc + to_f32(bias)
    c_offs = bid.to(tl.int64) * s_cb + rows[:, None] * s_cm + cols[None, :] * s_cn
    tl.store(c_ptr + c_offs, from_f32(acc, c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tile(a_ptr, b_ptr, c_ptr, bias_ptr, ws_ptr, tile, split, blocks_per_split, M, N, K, n_batch,
          s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn, s_biasm, s_biasn,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
          CHUNK_BLOCKS: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr):
    """One output tile (and, with SPLIT_K > 1, one K range of it)."""
    bid, pid_m, pid_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    a_base = a_ptr + bid.to(tl.int64) * s_ab + rows[:, None] * s_am
    b_base = b_ptr + bid.to(tl.int64) * s_bb + cols[None, :] * s_bn

    k_blocks = tl.cdiv(K, BLOCK_K)
    if SPLIT_K == 1 and CHUNK_BLOCKS == 0:  # the whole K in one loop
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, k_blocks):  # upward
            acc = ptr_step(a_base, b_base, acc, kb, K, s_ak, s_bk, mask_m, mask_n, BLOCK_K, UPCAST)
    elif SPLIT_K == 1:  # a long K: chunk sums from zero, added in chunk order
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for c0 in range(0, k_blocks, CHUNK_BLOCKS):
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kb in range(c0, tl.minimum(c0 + CHUNK_BLOCKS, k_blocks)):  # upward
                part = ptr_step(a_base, b_base, part, kb, K, s_ak, s_bk, mask_m, mask_n, BLOCK_K, UPCAST)
            acc += part
    else:  # one K range: one chunk (the invariant's chunk split) or one variant split
        kb_lo = split * blocks_per_split
        kb_hi = tl.minimum(kb_lo + blocks_per_split, k_blocks)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(kb_lo, kb_hi):  # always upward from the range's first block
            acc = ptr_step(a_base, b_base, acc, kb, K, s_ak, s_bk, mask_m, mask_n, BLOCK_K, UPCAST)

    if SPLIT_K == 1:
        _epilogue(acc, c_ptr, bias_ptr, bid, pid_m, pid_n, M, N, s_cb, s_cm, s_cn, s_biasm, s_biasn,
                  BLOCK_M, BLOCK_N, HAS_BIAS)
    else:  # fp32 partial sums, contiguous [SPLIT_K, B, M, N]
        mask = mask_m[:, None] & mask_n[None, :]
        ws_offs = ((split * n_batch + bid).to(tl.int64) * M + rows[:, None]) * N + cols[None, :]
        tl.store(ws_ptr + ws_offs, acc, mask=mask)


@triton.jit(do_not_specialize=["M", "total_tiles"])
def _mm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, ws_ptr, blocks_per_split, M, N, K, n_batch, total_tiles,
               s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn, s_biasm, s_biasn,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
               CHUNK_BLOCKS: tl.constexpr, SPLIT_K: tl.constexpr, PERSISTENT: tl.constexpr,
               HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr):
    """Grid ``(tiles or persistent programs, SPLIT_K)``.  Persistent: program p does tiles
    p, p + P, p + 2P, ... (P = number of programs); each tile's K order is the same."""
    split = tl.program_id(1)
    if PERSISTENT:
        for tile in range(tl.program_id(0), total_tiles, tl.num_programs(0)):
            _tile(a_ptr, b_ptr, c_ptr, bias_ptr, ws_ptr, tile, split, blocks_per_split, M, N, K, n_batch,
                  s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn, s_biasm, s_biasn,
                  BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, CHUNK_BLOCKS, SPLIT_K, HAS_BIAS, UPCAST)
    else:
        _tile(a_ptr, b_ptr, c_ptr, bias_ptr, ws_ptr, tl.program_id(0), split, blocks_per_split, M, N, K, n_batch,
              s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn, s_biasm, s_biasn,
              BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, CHUNK_BLOCKS, SPLIT_K, HAS_BIAS, UPCAST)


@triton.jit
def _tma_step(a_desc, b_desc, acc, kb, off_m, off_n, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
              B_KN: tl.constexpr, UPCAST: tl.constexpr):
    """``acc += A[off_m:, kb-th K block] @ B[kb-th K block, off_n:]`` from TMA tiles (out-of-range
    rows/columns/K arrive as zeros, like the pointer kernel's masked loads)."""
    a = a_desc.load([off_m, kb * BLOCK_K])
    if B_KN:
        b = b_desc.load([kb * BLOCK_K, off_n])
    else:  # B given as its (N, K) transpose with unit K stride (a linear layer's weight)
        b = b_desc.load([off_n, kb * BLOCK_K]).T
    if UPCAST and not B_KN:  # interpreter only: numpy's matmul rounds a transposed (F-ordered)
        # operand differently from a C-ordered one; a reshape round trip hands it C order
        b = tl.reshape(tl.reshape(to_f32(b), (BLOCK_K * BLOCK_N,)), (BLOCK_K, BLOCK_N))
    return dot_acc(a, b, acc, UPCAST)


@triton.jit(do_not_specialize=["M", "total_tiles"])
def _mm_tma_kernel(a_desc, b_desc, c_ptr, bias_ptr, M, N, K, total_tiles, s_cm, s_cn, s_biasm, s_biasn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   CHUNK_BLOCKS: tl.constexpr, B_KN: tl.constexpr, PERSISTENT: tl.constexpr,
                   WARP_SPEC: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr):
    """The invariant matmul with TMA loads (2-D operands, one program per tile): the same tiles
    and the same K order as ``_tile`` (one loop, or with CHUNK_BLOCKS > 0 chunks of CHUNK_BLOCKS
    blocks, each summed from zero upward with ``part = tl.dot(a, b, part)``, added to ``acc``
    in chunk order)."""
    if PERSISTENT:
        first, step = tl.program_id(0), tl.num_programs(0)
    else:
        first, step = tl.program_id(0), total_tiles
    k_blocks = tl.cdiv(K, BLOCK_K)
    for tile in range(first, total_tiles, step):
        bid, pid_m, pid_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if CHUNK_BLOCKS == 0:  # the whole K in one loop
            if WARP_SPEC:
                for kb in tl.range(0, k_blocks, warp_specialize=True):
                    acc = _tma_step(a_desc, b_desc, acc, kb, off_m, off_n, BLOCK_K, BLOCK_N, B_KN, UPCAST)
            else:
                for kb in range(0, k_blocks):
                    acc = _tma_step(a_desc, b_desc, acc, kb, off_m, off_n, BLOCK_K, BLOCK_N, B_KN, UPCAST)
        else:
            for c0 in range(0, k_blocks, CHUNK_BLOCKS):
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                c1 = tl.minimum(c0 + CHUNK_BLOCKS, k_blocks)
                if WARP_SPEC:
                    for kb in tl.range(c0, c1, warp_specialize=True):
                        part = _tma_step(a_desc, b_desc, part, kb, off_m, off_n, BLOCK_K, BLOCK_N, B_KN, UPCAST)
                else:
                    for kb in range(c0, c1):
                        part = _tma_step(a_desc, b_desc, part, kb, off_m, off_n, BLOCK_K, BLOCK_N, B_KN, UPCAST)
                acc += part
        _epilogue(acc, c_ptr, bias_ptr, bid, pid_m, pid_n, M, N, 0, s_cm, s_cn, s_biasm, s_biasn,
                  BLOCK_M, BLOCK_N, HAS_BIAS)


@triton.jit
def _tma_chunks(a_desc, b_desc, acc, c_lo, c_hi, k_blocks, off_m, off_n, BLOCK_K: tl.constexpr,
                BLOCK_N: tl.constexpr, CHUNK_BLOCKS: tl.constexpr, B_KN: tl.constexpr, UPCAST: tl.constexpr):
    """``acc`` plus the sums of chunks ``c_lo .. c_hi - 1`` of a long K, each summed from zero
    upward and added in chunk order (the additions of ``_mm_tma_kernel``'s chunk loop)."""
    for c in range(c_lo, c_hi):
        part = tl.zeros(acc.shape, dtype=tl.float32)
        for kb in range(c * CHUNK_BLOCKS, tl.minimum((c + 1) * CHUNK_BLOCKS, k_blocks)):
            part = _tma_step(a_desc, b_desc, part, kb, off_m, off_n, BLOCK_K, BLOCK_N, B_KN, UPCAST)
        acc += part
    return acc


@triton.jit
def _mm_stream_k_kernel(a_desc, b_desc, c_ptr, bias_ptr, ws_ptr, flag_ptr, M, N, K, total_tiles,
                        s_cm, s_cn, s_biasm, s_biasn,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        CHUNK_BLOCKS: tl.constexpr, B_KN: tl.constexpr, HAS_BIAS: tl.constexpr,
                        UPCAST: tl.constexpr):
    """Stream-K over the fixed K chunks: the ``total_tiles * C`` units (tile, chunk), in tile
    order, are cut into ``P`` equal runs, one per program (``P`` = the grid, at most the units).
    A tile cut between programs ``p - 1`` and ``p`` has its first chunks at the end of ``p - 1``'s
    run and the rest at the start of ``p``'s.  Program ``p`` therefore works (1) on its last tile
    first when the run ends inside it: the running sum of that tile's first chunks, from zero,
    goes to workspace slot ``p`` and its flag is raised; (2) on its whole tiles, each the chunk
    loop of ``_mm_tma_kernel``, rounded and stored; (3) last on its first tile when the run
    starts inside it: it waits for flag ``p - 1`` (the flags are zeroed for each launch), loads
    that running sum, adds its own chunks in order, then stores the tile (or, when the run ends inside the same tile,
    hands the sum on through slot ``p``).  Every tile gets exactly the additions of the
    one-program chunk loop, ``acc = 0; acc += chunk_0; acc += chunk_1; ...``: the same bits as
    every other config.  A program waits only for the one before it, which started no later and
    raises its flag before its other work (programs run in order under the interpreter).  A K
    summed in one loop has one unit per tile: whole tiles only."""
    p = tl.program_id(0)
    P = tl.num_programs(0)
    k_blocks = tl.cdiv(K, BLOCK_K)
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    if CHUNK_BLOCKS == 0:  # one loop over K: runs of whole tiles
        t_lo = (p.to(tl.int64) * total_tiles // P).to(tl.int32)
        t_hi = ((p + 1).to(tl.int64) * total_tiles // P).to(tl.int32)
        for tile in range(t_lo, t_hi):
            bid, pid_m, pid_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kb in range(0, k_blocks):
                acc = _tma_step(a_desc, b_desc, acc, kb, pid_m * BLOCK_M, pid_n * BLOCK_N, BLOCK_K, BLOCK_N, B_KN,
                                UPCAST)
            _epilogue(acc, c_ptr, bias_ptr, bid, pid_m, pid_n, M, N, 0, s_cm, s_cn, s_biasm, s_biasn,
                      BLOCK_M, BLOCK_N, HAS_BIAS)
    else:
        C = tl.cdiv(k_blocks, CHUNK_BLOCKS)
        units = total_tiles.to(tl.int64) * C
        u0 = (p.to(tl.int64) * units // P).to(tl.int32)
        u1 = ((p + 1).to(tl.int64) * units // P).to(tl.int32)
        t_first = u0 // C
        t_last = (u1 - 1) // C
        first_mid = (u0 % C) != 0  # the run starts inside a tile: a continuation
        last_mid = (u1 % C) != 0  # the run ends inside a tile: its sum is handed on
        # (1) the last tile's first chunks, when the run ends inside a tile it did not continue
        if last_mid and ((t_last > t_first) or (u0 % C) == 0):
            bid, pid_m, pid_n = _tile_coords(t_last, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc = _tma_chunks(a_desc, b_desc, acc, 0, u1 - t_last * C, k_blocks, pid_m * BLOCK_M,
                              pid_n * BLOCK_N, BLOCK_K, BLOCK_N, CHUNK_BLOCKS, B_KN, UPCAST)
            tl.store(ws_ptr + p.to(tl.int64) * (BLOCK_M * BLOCK_N) + offs, acc)
            tl.debug_barrier()
            tl.atomic_xchg(flag_ptr + p, 1, sem="release")
        # (2) whole tiles
        t_lo = t_first + first_mid.to(tl.int32)
        t_hi = t_last + 1 - last_mid.to(tl.int32)
        for tile in range(t_lo, t_hi):
            bid, pid_m, pid_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc = _tma_chunks(a_desc, b_desc, acc, 0, C, k_blocks, pid_m * BLOCK_M, pid_n * BLOCK_N,
                              BLOCK_K, BLOCK_N, CHUNK_BLOCKS, B_KN, UPCAST)
            _epilogue(acc, c_ptr, bias_ptr, bid, pid_m, pid_n, M, N, 0, s_cm, s_cn, s_biasm, s_biasn,
                      BLOCK_M, BLOCK_N, HAS_BIAS)
        # (3) the first tile's later chunks, added to the sum program p - 1 handed on
        if first_mid:
            while tl.atomic_add(flag_ptr + p - 1, 0, sem="acquire") == 0:
                pass
            tl.debug_barrier()
            acc = tl.load(ws_ptr + (p - 1).to(tl.int64) * (BLOCK_M * BLOCK_N) + offs, cache_modifier=".cg")
            bid, pid_m, pid_n = _tile_coords(t_first, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            acc = _tma_chunks(a_desc, b_desc, acc, u0 - t_first * C, tl.minimum(u1 - t_first * C, C), k_blocks,
                              pid_m * BLOCK_M, pid_n * BLOCK_N, BLOCK_K, BLOCK_N, CHUNK_BLOCKS, B_KN, UPCAST)
            if last_mid and t_last == t_first:  # the run lies inside one tile: hand the sum on
                tl.store(ws_ptr + p.to(tl.int64) * (BLOCK_M * BLOCK_N) + offs, acc)
                tl.debug_barrier()
                tl.atomic_xchg(flag_ptr + p, 1, sem="release")
            else:
                _epilogue(acc, c_ptr, bias_ptr, bid, pid_m, pid_n, M, N, 0, s_cm, s_cn, s_biasm, s_biasn,
                          BLOCK_M, BLOCK_N, HAS_BIAS)


def _k_plan(impl, cfg, M, N, K, dtype, compiled=None) -> tuple:
    """``(programs along K, K blocks per program, K blocks per chunk)`` of a launch (0 blocks
    per chunk: K is not long, one loop).  Invariant: one program per tile (the chunk loop
    inside), or with ``split_chunks`` and a long K one per chunk; variant: the split count of
    :func:`variant_split_k`, an even share of the blocks each."""
    bk = block_k(dtype)
    k_blocks = triton.cdiv(K, bk) if K > 0 else 0
    chunk_blocks = k_chunk_blocks(K, dtype, compiled=compiled)
    if impl == "variant":
        split = variant_split_k(M, N, K, dtype)
        return split, triton.cdiv(k_blocks, split) if split > 1 else k_blocks, chunk_blocks
    if chunk_blocks == 0:
        return 1, k_blocks, 0
    chunks = triton.cdiv(k_blocks, chunk_blocks)
    if cfg.split_chunks and chunks > 1:
        return chunks, chunk_blocks, chunk_blocks
    return 1, k_blocks, chunk_blocks


def _tma_rows(ptr: int, size: int, inner_stride: int, outer_stride: int, inner_len: int, outer_len: int) -> bool:
    """Whether TMA can read a 2-D operand as rows along its ``inner`` dim: unit inner stride, the
    outer stride and the base 16-byte aligned, rows of at least 16 bytes that do not overlap
    (no expanded, stride-0 operands)."""
    return (inner_stride == 1 and (outer_stride * size) % 16 == 0 and ptr % 16 == 0 and inner_len * size >= 16
            and (outer_stride >= inner_len or outer_len == 1))


def _b_layout(a_ptr: int, b_ptr: int, size: int, M: int, N: int, K: int, sa: tuple, sb: tuple):
    """:func:`_tma_layout` from pointers and strides: ``sa = (s_am, s_ak)``, ``sb = (s_bk, s_bn)``."""
    if not _tma_rows(a_ptr, size, sa[1], sa[0], K, M):
        return None
    if _tma_rows(b_ptr, size, sb[1], sb[0], N, K):
        return True
    if _tma_rows(b_ptr, size, sb[0], sb[1], K, N):
        return False
    return None


def _tma_layout(a, b):
    """For 2-D ``a`` (M, K) and ``b`` (K, N): ``True`` when B can be read by TMA as (K, N) rows,
    ``False`` as its (N, K) transpose (a linear weight), ``None`` when TMA cannot read them
    (TMA wants a unit inner stride, 16-byte aligned other strides and base addresses)."""
    return _b_layout(a.data_ptr(), b.data_ptr(), a.element_size(), a.shape[0], b.shape[1], a.shape[1],
                     a.stride(), b.stride())


class _Plan(NamedTuple):
    """The launch of one product shape (:func:`_plan`): everything but the tensors and strides."""

    grid: tuple
    #: K ranges per tile (the variant's splits or the invariant's chunk programs), K blocks each
    split: int
    per_split: int
    tiles: int
    #: the config asks for TMA loads and the launch allows them (one 2-D product, no K split)
    tma: bool
    #: constexprs and launch options of ``_mm_kernel`` / ``_mm_tma_kernel``
    kw: dict
    tma_kw: dict
    #: grid of the second pass that adds the K ranges' fp32 sums (split > 1)
    reduce_grid: tuple
    #: stream-K programs (:func:`_mm_stream_k_kernel`; 0: not a stream-K launch)
    stream_programs: int = 0


#: Tile of the second pass (:func:`batch_invariance_kit.ops.k_order.chunk_reduce_kernel`)
_REDUCE_M, _REDUCE_N = 32, 128


@functools.lru_cache(maxsize=4096)
def _plan(B: int, M: int, N: int, K: int, dtype: torch.dtype, impl: str, cfg, has_bias: bool,
          device: torch.device) -> _Plan:
    """The launch of ``impl`` for a (B, M, K) x (B, K, N) product (K > 0, non-empty output):
    config (``cfg``: a forced :class:`MMConfig`, or ``None`` for :func:`select_config`'s pick), K plan, grid,
    constexprs.  Cached per shape: an eager call looks it up and launches."""
    if cfg is None:  # the cost model's pick for one product on this device
        cfg = select_config(M, N, K, dtype, sms=None if INTERPRET or device.index is None else sm_count(device.index))
    bk = block_k(dtype)
    split, per_split, chunk_blocks = _k_plan(impl, cfg, M, N, K, dtype)
    tiles = B * _cdiv(M, cfg.block_m) * _cdiv(N, cfg.block_n)
    persistent = cfg.persistent and split == 1
    progs = _num_programs_persistent(tiles, device.index) if persistent else tiles
    common = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, GROUP_M=cfg.group_m,
                  CHUNK_BLOCKS=chunk_blocks, PERSISTENT=persistent, HAS_BIAS=has_bias, UPCAST=INTERPRET,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    tma = cfg.tma and split == 1 and B == 1
    stream = 0
    if tma and cfg.stream_k:
        stream = min(_stream_k_programs(device.index), tiles * _k_units(K, dtype, chunk_blocks)[1])
    return _Plan(grid=(progs, split), split=split, per_split=per_split, tiles=tiles,
                 tma=tma, kw=dict(common, SPLIT_K=split),
                 tma_kw=dict(common, WARP_SPEC=cfg.warp_spec),
                 reduce_grid=(_cdiv(M, _REDUCE_M), _cdiv(N, _REDUCE_N), B), stream_programs=stream)


def _k_units(K: int, dtype: torch.dtype, chunk_blocks: int) -> tuple:
    """``(K blocks, chunks)`` of a reduction of length ``K``: a stream-K unit is one chunk of one
    tile (the whole K when it is summed in one loop, ``chunk_blocks == 0``)."""
    k_blocks = _cdiv(K, block_k(dtype))
    return k_blocks, _cdiv(k_blocks, chunk_blocks or k_blocks)


def stream_k_runs(tiles: int, chunks: int, programs: int) -> list:
    """The runs of a stream-K launch (:func:`_mm_stream_k_kernel`'s formula): per program, its
    ``(first unit, end unit)`` of the ``tiles * chunks`` units (tile ``u // chunks``, chunk
    ``u % chunks``).  A run edge that is not a multiple of ``chunks`` cuts a tile."""
    for name, v in (("tiles", tiles), ("chunks", chunks), ("programs", programs)):
        checks.positive_int(name, v)
    units = tiles * chunks
    if programs > units:
        raise ValueError(f"programs must be at most tiles * chunks ({units}), got {programs}")
    return [(p * units // programs, (p + 1) * units // programs) for p in range(programs)]


def _stream_k_programs(device_index: int | None = None) -> int:
    """Stream-K programs: one per SM (5 under the interpreter, so that small tests cut tiles)."""
    return 5 if INTERPRET else sm_count(device_index)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _launch_tma(a, b, out, bias, plan, p: Product, b_kn):
    """The TMA kernel for one 2-D product: descriptors of ``a`` (M, K) and of ``b`` as (K, N)
    rows (``b_kn``) or as the (N, K) rows of a linear weight, built from ``p``'s strides."""
    M, N, K, sa, sb, sc = p.M, p.N, p.K, p.a, p.b, p.c
    kw = plan.tma_kw
    bm, bn, bk = kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"]
    a_desc = descriptor(a, [M, K], [sa[1], sa[2]], [bm, bk])
    b_desc = descriptor(b, [K, N], [sb[1], sb[2]], [bk, bn]) if b_kn else \
        descriptor(b, [N, K], [sb[2], sb[1]], [bn, bk])
    if plan.stream_programs:
        P = plan.stream_programs
        ws = torch.empty((P, bm * bn), dtype=torch.float32, device=a.device)
        flags = torch.zeros(P, dtype=torch.int32, device=a.device)
        skw = {k: v for k, v in kw.items() if k not in ("PERSISTENT", "WARP_SPEC")}
        _MM_STREAM_K((P,), a_desc, b_desc, out, bias, ws, flags, M, N, K, plan.tiles, sc[1], sc[2], *p.bias,
                     B_KN=b_kn, **skw)
        return
    _MM_TMA((plan.grid[0],), a_desc, b_desc, out, bias, M, N, K, plan.tiles, sc[1], sc[2], *p.bias,
            B_KN=b_kn, **kw)


#: Set by :func:`plant_variant`: every invariant launch runs the variant twin instead
_variant_planted = False


def plant_variant(on: bool = True) -> None:
    """Plant a fault: while ``on``, every invariant launch of this module (and the MoE gating
    matmul, which launches through it) runs its split-K variant twin.  It exists so that the
    guards can be shown to work (the book's claims, the tests, a reader's CI must stop on it);
    :mod:`batch_invariance_kit.verify.planted` calls it for ``KIT_PLANT_VARIANT=matmul``."""
    global _variant_planted
    if not isinstance(on, bool):
        raise TypeError(f"on must be a bool, got {type(on).__name__}")
    _variant_planted = on


def launch(a, b, out, bias, p: Product, *, impl: str = "invariant", config=None) -> None:
    """``out = a @ b (+ bias)`` for the ``p.batch`` products of (M, K) x (K, N) that
    :class:`~batch_invariance_kit.ops.k_order.Product` ``p`` describes, each tensor read in
    place through its element strides (``bias`` None: no bias).  The launch behind every public
    op here, for callers that have checked their operands (the MoE layer's gating matmul).
    Nothing is launched for an empty output; ``K = 0`` gives ``0 + bias``.  ``config``: None
    (:func:`select_config`) or an :class:`MMConfig`."""
    B, M, N, K = p.batch, p.M, p.N, p.K
    if B == 0 or M == 0 or N == 0:
        return
    if K == 0:  # acc = 0, then + bias, then rounded: the same as the kernel would give
        out.zero_()
        if bias is not None:
            out.add_(bias)
        return
    if impl == "invariant" and _variant_planted:
        impl = "variant"  # the fault the book's claims must catch (plant_variant)
    has_bias = bias is not None
    plan = _plan(B, M, N, K, a.dtype, impl, config, has_bias, a.device)
    if not has_bias:
        bias = out
    if plan.tma:
        b_kn = _b_layout(a.data_ptr(), b.data_ptr(), a.element_size(), M, N, K, p.a[1:], p.b[1:])
        if b_kn is not None:
            _launch_tma(a, b, out, bias, plan, p, b_kn)
            return
    split = plan.split
    ws = torch.empty((split, B, M, N), dtype=torch.float32, device=a.device) if split > 1 else out
    _MM(plan.grid, a, b, out, bias, ws, plan.per_split, M, N, K, B, plan.tiles, *p.a, *p.b, *p.c, *p.bias,
        **plan.kw)
    if split > 1:
        launch_chunk_reduce(ws, out, bias if has_bias else None, M, N, B, p.c, p.bias, split,
                            block_m=_REDUCE_M, block_n=_REDUCE_N, grid=plan.reduce_grid)


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------

def _check_impl(impl):
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def _check_pair(a, b, a_name, b_name, impl, dim):
    checks.tensor(a_name, a, dim=dim, contiguous=False, nonempty=False)
    checks.tensor(b_name, b, dim=dim, contiguous=False, nonempty=False)
    checks.same_dtype(b_name, b, a_name, a)
    checks.same_device(b_name, b, a_name, a)
    if impl in ("invariant", "variant"):
        checks.kernel_device(a_name, a)


def _check_out(out, shape, like, inputs):
    return checks.output("out", out, shape, like.dtype, like, like_name="a", contiguous=False, inputs=inputs)


def _check_bias(bias, name, shape, a):
    checks.tensor(name, bias, contiguous=False, nonempty=False)
    checks.same_dtype(name, bias, "a", a)
    checks.same_device(name, bias, "a", a)
    try:
        return bias.expand(shape)
    except RuntimeError:
        raise ValueError(f"{name} of shape {tuple(bias.shape)} does not broadcast to the output shape "
                         f"{tuple(shape)}") from None


# --------------------------------------------------------------------------------------------
# Public ops
# --------------------------------------------------------------------------------------------

def _run2d(a, b, bias2, out, impl, config):
    """Shared body of mm / addmm (and of linear's torch impls) on 2-D operands (validated)."""
    M, N = a.shape[0], b.shape[1]
    out = _check_out(out, (M, N), a, (("a", a), ("b", b), ("bias", bias2)))
    if impl == "reference":
        r = a.double() @ b.double()
        if bias2 is not None:
            r = r + bias2.double()
        return out.copy_(r)
    if impl == "cublas":
        if bias2 is None:
            return torch.mm(a, b, out=out)
        row_bias = bias2[0] if bias2.stride(0) == 0 else bias2  # what the caller passed: 1-D bias
        return torch.addmm(row_bias, a, b, out=out)
    sa, sb, sc = a.stride(), b.stride(), out.stride()
    launch(a, b, out, bias2, Product(1, M, N, a.shape[1], (0, sa[0], sa[1]), (0, sb[0], sb[1]), (0, sc[0], sc[1]),
                                     (0, 0) if bias2 is None else bias2.stride()), impl=impl, config=_config_arg(config))
    return out


def mm(a, b, *, impl="invariant", out=None, config=None):
    """``a @ b`` for 2-D ``a`` (M, K) and ``b`` (K, N) of one float dtype; returns ``out``."""
    _check_impl(impl)
    _check_pair(a, b, "a", "b", impl, 2)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"b has {b.shape[0]} rows but a has {a.shape[1]} columns (inner dims must match)")
    return _run2d(a, b, None, out, impl, config)


def addmm(bias, a, b, *, impl="invariant", out=None, config=None):
    """``bias + a @ b``; ``bias`` (of a's dtype) broadcasts to (M, N) and is added in fp32
    after the whole K reduction, before the one rounding."""
    _check_impl(impl)
    _check_pair(a, b, "a", "b", impl, 2)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"b has {b.shape[0]} rows but a has {a.shape[1]} columns (inner dims must match)")
    bias2 = _check_bias(bias, "bias", (a.shape[0], b.shape[1]), a)
    return _run2d(a, b, bias2, out, impl, config)


def linear(x, weight, bias=None, *, impl="invariant", out=None, config=None):
    """``x @ weight.T + bias`` like ``torch.nn.functional.linear``: ``x`` (..., K), ``weight``
    (N, K), ``bias`` (N,) or None; returns (..., N).  The leading dims of ``x`` are flattened
    into M (a copy only when they cannot be viewed flat).  The kit's kernels read ``weight``
    and ``bias`` in place through their strides (no transposed or expanded views are made)."""
    _check_impl(impl)
    checks.tensor("x", x, contiguous=False, nonempty=False)
    if x.dim() < 1:
        raise ValueError(f"x must have at least 1 dim, got shape {tuple(x.shape)}")
    _check_pair(x, weight, "x", "weight", impl, None)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D, got shape {tuple(weight.shape)}")
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"weight has {K} columns but x has {x.shape[-1]} features (last dim)")
    if bias is not None:
        checks.tensor("bias", bias, dim=1, contiguous=False, nonempty=False)
        if bias.shape[0] != N:
            raise ValueError(f"bias has {bias.shape[0]} elements but weight has {N} rows")
        checks.same_dtype("bias", bias, "x", x)
        checks.same_device("bias", bias, "x", x)
    lead = x.shape[:-1]
    x2 = x if x.dim() == 2 else x.reshape(math.prod(lead), K)
    M = x2.shape[0]
    out2 = None
    if out is not None:
        checks.tensor("out", out, dtypes=(x.dtype,), contiguous=False, nonempty=False)
        if tuple(out.shape) != lead + (N,):
            raise ValueError(f"out must have shape {tuple(lead) + (N,)}, got {tuple(out.shape)}")
        try:
            out2 = out.view(M, N)
        except RuntimeError:
            raise ValueError("out must be viewable as (M, N) with M the product of x's leading dims "
                             f"(got strides {out.stride()})") from None
    if impl in ("reference", "cublas"):
        bias2 = None if bias is None else bias.expand(M, N)
        res = _run2d(x2, weight.t(), bias2, out2, impl, config)
        return out if out is not None else res.view(lead + (N,))
    config = _config_arg(config)
    if out is None:
        out = x.new_empty(lead + (N,))
        out2, sc = out, (0, N, 1)
    else:
        _check_out(out2, (M, N), x2, (("x", x2), ("weight", weight), ("bias", bias)))
        sc = (0, *out2.stride())
    sx, sw = x2.stride(), weight.stride()
    launch(x2, weight, out2, bias, Product(1, M, N, K, (0, sx[0], sx[1]), (0, sw[1], sw[0]), sc,
                                           (0, 0) if bias is None else (0, bias.stride(0))), impl=impl, config=config)
    return out


def bmm(a, b, *, impl="invariant", out=None, config=None):
    """Batched ``a @ b``: ``a`` (B, M, K), ``b`` (B, K, N) -> (B, M, N).  The config is chosen
    from the per-batch M; every batch entry is reduced in the one K order."""
    _check_impl(impl)
    _check_pair(a, b, "a", "b", impl, 3)
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"b has batch size {b.shape[0]} but a has {a.shape[0]}")
    if a.shape[2] != b.shape[1]:
        raise ValueError(f"b has {b.shape[1]} rows per batch but a has {a.shape[2]} columns (inner dims)")
    B, M, N = a.shape[0], a.shape[1], b.shape[2]
    out = _check_out(out, (B, M, N), a, (("a", a), ("b", b)))
    if impl == "reference":
        return out.copy_(torch.bmm(a.double(), b.double()))
    if impl == "cublas":
        return torch.bmm(a, b, out=out)
    launch(a, b, out, None, Product(B, M, N, a.shape[2], a.stride(), b.stride(), out.stride()), impl=impl,
           config=_config_arg(config))
    return out


#: the eager launches of this module's kernels (:mod:`.direct_launch`)
_MM, _MM_TMA, _MM_STREAM_K = (DirectLaunch(_mm_kernel), DirectLaunch(_mm_tma_kernel),
                               DirectLaunch(_mm_stream_k_kernel))
