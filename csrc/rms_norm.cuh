// The kit's CUDA RMSNorm family: production-style kernels (one CUDA block per row), written
// for this kit.  Torch-free: CUDA and CUB headers only, so `nvcc -c -arch=sm_90` compiles
// them on a machine without a GPU.
//
// Every kernel follows the schedule that kernels/emulator.py models, so that the CPU
// emulator (kernels/rms_norm_cuda.py:emulate) predicts the GPU's bits:
//
//   pass 1 (the only order-dependent part): thread t accumulates squares in fp32,
//     acc = fmaf(v, v, acc), starting at 0.0f, over
//       - the scalar prefix (elements before the first 16-byte-aligned address of the row):
//         element i by thread i;
//       - the 16-byte vectors (V = 16 / sizeof(T) elements) that follow: vector j by thread
//         j % blockDim.x, elements in order inside a vector;
//       - the scalar tail after the last whole vector: tail element j by thread j % blockDim.x.
//     (kernels/emulator.py:thread_schedule.)  The fused-add kernels vectorize only when x and
//     residual have the same misalignment; otherwise they use V = 1 (no prefix).
//   reduction: cub::BlockReduce<float, 1024> (default BLOCK_REDUCE_WARP_REDUCTIONS)
//     .Sum(acc, blockDim.x): shuffle-down tree with offsets 1, 2, 4, 8, 16 in each warp, then
//     thread 0 folds the warp aggregates left to right.
//   scale (thread 0): 1.0f / sqrtf(sum / (float)n + eps), correctly rounded sqrtf and
//     division (nvcc's defaults -prec-sqrt=true -prec-div=true; never build with fast-math).
//   pass 2 (elementwise, order-free): out = (T)((float)(T)(v * scale) * (float)w), i.e. the
//     weight multiply is one product of two T values rounded once to T.
//
// NaN inputs are outside the bit-exact contract (the GPU's and torch's NaN payloads differ).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cub/block/block_reduce.cuh>

namespace bik {

constexpr int kWarp = 32;
constexpr int kMaxBlock = 1024;
constexpr float kFp8Max = 448.0f;
// Smallest dynamic fp8 scale: (float)(1 / (448 * 512)), written as its exact fp32 value
// (kernels/rms_norm_cuda.py: MIN_SCALE is the same number).
constexpr float kMinScale = 0x1.24924ap-18f;

// ---- conversions (explicit intrinsics: torch builds with __CUDA_NO_HALF_CONVERSIONS__) ----

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// (T)((float)(T)(v * s) * (float)w): the normalized, weighted output element.
template <typename T>
__device__ __forceinline__ T normed(T v, T w, float s) {
  const T a = from_float<T>(to_float(v) * s);
  return from_float<T>(to_float(a) * to_float(w));
}

// e4m3 with round-to-nearest-even after clamping to [-448, 448]; fminf/fmaxf semantics
// (a NaN operand yields the other one) are reproduced by numpy's fmin/fmax in the emulator.
__device__ __forceinline__ uint8_t to_fp8(float v) {
  v = fmaxf(fminf(v, kFp8Max), -kFp8Max);
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

template <typename T, int V>
struct alignas(sizeof(T) * V) VecT {
  T v[V];
};

// Elements from p to the first 16-byte-aligned address (p is T-aligned).
template <typename T>
__device__ __forceinline__ int elems_to_alignment(const void* p) {
  const unsigned a = static_cast<unsigned>(reinterpret_cast<uintptr_t>(p) & 15u);
  return static_cast<int>(((16u - a) & 15u) / sizeof(T));
}

// ---- loads and stores ----

// One element of pass 1: the value whose square is accumulated.  kFused: the rounded
// z = (T)(x + r), which is also stored to r.
template <typename T, bool kFused>
__device__ __forceinline__ T load_z(const T* x, T* r, int i) {
  if constexpr (kFused) {
    const T z = from_float<T>(to_float(x[i]) + to_float(r[i]));
    r[i] = z;
    return z;
  } else {
    return x[i];
  }
}

// One vector of pass 1 at element `base` (x + base, and r + base when kFused, are
// V * sizeof(T)-aligned).  kFused: z = (T)(x + r) element by element, stored to r.
template <typename T, int V, bool kFused>
__device__ __forceinline__ VecT<T, V> load_zvec(const T* x, T* r, int base) {
  using Vec = VecT<T, V>;
  const Vec xv = *reinterpret_cast<const Vec*>(x + base);
  if constexpr (kFused) {
    const Vec rv = *reinterpret_cast<const Vec*>(r + base);
    Vec zv;
#pragma unroll
    for (int k = 0; k < V; ++k) zv.v[k] = from_float<T>(to_float(xv.v[k]) + to_float(rv.v[k]));
    *reinterpret_cast<Vec*>(r + base) = zv;
    return zv;
  } else {
    return xv;
  }
}

// V weights from w + base through the read-only (non-coherent) cache: one 16-byte load when
// `aligned` (w + base is 16-byte aligned), else V scalar loads.
template <typename T, int V>
__device__ __forceinline__ VecT<T, V> load_w(const T* w, int base, bool aligned) {
  using Vec = VecT<T, V>;
  Vec r;
  if constexpr (sizeof(Vec) == 16) {
    if (aligned) {
      const uint4 u = __ldg(reinterpret_cast<const uint4*>(w + base));
      memcpy(&r, &u, sizeof(Vec));
      return r;
    }
  }
#pragma unroll
  for (int k = 0; k < V; ++k) r.v[k] = w[base + k];
  return r;
}

// V values of T to p: one vector store when `aligned`, else V scalar stores.
template <typename T, int V>
__device__ __forceinline__ void store_vec(T* p, const VecT<T, V>& v, bool aligned) {
  if (aligned) {
    *reinterpret_cast<VecT<T, V>*>(p) = v;
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) p[k] = v.v[k];
  }
}

// V fp8 bytes to p: packed into one 8-, 4- or 2-byte store when `aligned` (p is V-byte
// aligned), else V byte stores.
template <int V>
__device__ __forceinline__ void store_fp8(uint8_t* p, const uint8_t (&b)[V], bool aligned) {
  if constexpr (V == 8) {
    if (aligned) {
      uint2 u;
      u.x = b[0] | (b[1] << 8) | (b[2] << 16) | (static_cast<uint32_t>(b[3]) << 24);
      u.y = b[4] | (b[5] << 8) | (b[6] << 16) | (static_cast<uint32_t>(b[7]) << 24);
      *reinterpret_cast<uint2*>(p) = u;
      return;
    }
  } else if constexpr (V == 4) {
    if (aligned) {
      *reinterpret_cast<uint32_t*>(p) =
          b[0] | (b[1] << 8) | (b[2] << 16) | (static_cast<uint32_t>(b[3]) << 24);
      return;
    }
  }
#pragma unroll
  for (int k = 0; k < V; ++k) p[k] = b[k];
}

// ---- one row: the split, pass 1 (order-dependent), pass 2 (elementwise) ----

// The row's prefix / vector / tail split (kernels/emulator.py:thread_schedule), plus the
// thread's values kept in registers between the passes: its prefix element, its first VPT
// vectors (cache[k] is vector tid + k * blockDim.x) and its tail element.  Vectors past the
// first VPT per thread (rows longer than VPT * blockDim.x vectors) are re-read in pass 2.
template <typename T, int V, int VPT>
struct Row {
  int n, prefix, nvec, tail;
  T pre, tl;
  VecT<T, V> cache[VPT];

  __device__ __forceinline__ Row(const T* x, int n_) : n(n_) {
    prefix = (V > 1) ? min(elems_to_alignment<T>(x), n) : 0;
    nvec = (n - prefix) / V;
    tail = prefix + nvec * V;
  }

  // Pass 1: this thread's fp32 partial sum of squares, in the emulator's order: prefix
  // element, vectors tid, tid + B, ... (elements in order), tail element.  Each thread has
  // at most one prefix element (prefix < V <= 8 <= blockDim.x) and one tail element
  // (n - tail < V), so `if` replaces the strided loops there.
  template <bool kFused>
  __device__ __forceinline__ float sum_sq(const T* x, T* r) {
    const int tid = threadIdx.x;
    const int nthr = blockDim.x;
    float acc = 0.0f;
    if (tid < prefix) {
      pre = load_z<T, kFused>(x, r, tid);
      const float e = to_float(pre);
      acc = fmaf(e, e, acc);
    }
#pragma unroll
    for (int k = 0; k < VPT; ++k) {  // all loads first, then the (ordered) FMA chain
      const int j = tid + k * nthr;
      if (j < nvec) cache[k] = load_zvec<T, V, kFused>(x, r, prefix + j * V);
    }
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      if (tid + k * nthr < nvec) {
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float e = to_float(cache[k].v[i]);
          acc = fmaf(e, e, acc);
        }
      }
    }
    for (int j = tid + VPT * nthr; j < nvec; j += nthr) {
      const VecT<T, V> zv = load_zvec<T, V, kFused>(x, r, prefix + j * V);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float e = to_float(zv.v[i]);
        acc = fmaf(e, e, acc);
      }
    }
    if (tail + tid < n) {
      tl = load_z<T, kFused>(x, r, tail + tid);
      const float e = to_float(tl);
      acc = fmaf(e, e, acc);
    }
    return acc;
  }

  // Pass 2 over the same elements (order-free): one(i, z) for the prefix and tail elements,
  // vec(base, zv) for the vectors.  src: where the pass-1 values of uncached vectors are
  // re-read (x, or r, which holds z after a fused pass 1 by this same thread).
  template <typename One, typename Vec_>
  __device__ __forceinline__ void for_each(const T* src, One one, Vec_ vec) const {
    const int tid = threadIdx.x;
    const int nthr = blockDim.x;
    if (tid < prefix) one(tid, pre);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int j = tid + k * nthr;
      if (j < nvec) vec(prefix + j * V, cache[k]);
    }
    for (int j = tid + VPT * nthr; j < nvec; j += nthr) {
      const int base = prefix + j * V;
      vec(base, *reinterpret_cast<const VecT<T, V>*>(src + base));
    }
    if (tail + tid < n) one(tail + tid, tl);
  }
};

// Block reduction of the partials and the row's scale, broadcast to every thread.
__device__ __forceinline__ float block_rms_scale(float acc, int n, float eps) {
  using BlockReduce = cub::BlockReduce<float, kMaxBlock>;
  __shared__ typename BlockReduce::TempStorage temp;
  __shared__ float s_scale;
  const float total = BlockReduce(temp).Sum(acc, static_cast<int>(blockDim.x));  // valid in thread 0
  if (threadIdx.x == 0) {
    s_scale = 1.0f / sqrtf(total / static_cast<float>(n) + eps);
  }
  __syncthreads();  // also orders pass 1's residual stores before pass 2's loads
  return s_scale;
}

// out = normed(z) for one row (T output).  out_aligned: out + base is 16-byte aligned for
// every vector base (out has the source row's misalignment).
template <typename T, int V, int VPT>
__device__ __forceinline__ void write_normed(const Row<T, V, VPT>& row, const T* src, T* out,
                                             const T* w, float s, bool out_aligned) {
  const bool w_aligned = V > 1 && elems_to_alignment<T>(w) == row.prefix % V;
  row.for_each(
      src, [&](int i, T z) { out[i] = normed<T>(z, w[i], s); },
      [&](int base, const VecT<T, V>& zv) {
        const VecT<T, V> wv = load_w<T, V>(w, base, w_aligned);
        VecT<T, V> o;
#pragma unroll
        for (int k = 0; k < V; ++k) o.v[k] = normed<T>(zv.v[k], wv.v[k], s);
        store_vec<T, V>(out + base, o, out_aligned);
      });
}

// ---------------------------------- kernels ----------------------------------
// VPT: vectors per thread kept in registers (1, 2, 4 or 8; the launcher picks the smallest
// that holds the row).  It changes no bit: the FMA chain is the same.  VPT = 8 kernels are
// bounded to 256 threads (more registers: capped at 64, the bf16 and fp16 ones spill).
constexpr int max_threads(int vpt) { return vpt > 4 ? kMaxBlock / 4 : kMaxBlock; }

template <typename T, int V, int VPT>
__global__ void __launch_bounds__(max_threads(VPT))
rms_norm_kernel(T* out, int64_t out_stride, const T* x, int64_t x_stride, const T* w, float eps,
                int n) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * x_stride;
  T* outr = out + row * out_stride;
  Row<T, V, VPT> rw(xr, n);
  const float s = block_rms_scale(rw.template sum_sq<false>(xr, nullptr), n, eps);
  const bool out_aligned = V > 1 && elems_to_alignment<T>(outr) == elems_to_alignment<T>(xr);
  write_normed(rw, xr, outr, w, s, out_aligned);
}

// Fused add, one layout: V-wide when x and r rows share their misalignment, else V = 1.
template <typename T, int V, int VPT>
__device__ __forceinline__ void fused_add_row(T* xr, T* rr, const T* w, float eps, int n) {
  Row<T, V, VPT> rw(xr, n);
  const float s = block_rms_scale(rw.template sum_sq<true>(xr, rr), n, eps);
  write_normed(rw, rr, xr, w, s, true);  // x <- normed(z): x + base is aligned like r + base
}

template <typename T, int V, int VPT>
__global__ void __launch_bounds__(max_threads(VPT))
fused_add_rms_norm_kernel(T* x, int64_t x_stride, T* r, int64_t r_stride, const T* w, float eps,
                          int n) {
  const int64_t row = blockIdx.x;
  T* xr = x + row * x_stride;
  T* rr = r + row * r_stride;
  if (elems_to_alignment<T>(xr) == elems_to_alignment<T>(rr)) {  // uniform in the block
    fused_add_row<T, V, VPT>(xr, rr, w, eps, n);
  } else {
    fused_add_row<T, 1, VPT>(xr, rr, w, eps, n);
  }
}

// Static fp8 for one layout.  kFused = false: r is unused (nullptr); the source is x.
template <typename T, int V, int VPT, bool kFused>
__device__ __forceinline__ void static_fp8_row(uint8_t* outr, const T* xr, T* rr, const T* w,
                                               const float* scale, float eps, int n) {
  Row<T, V, VPT> rw(xr, n);
  const float s = block_rms_scale(rw.template sum_sq<kFused>(xr, rr), n, eps);
  const float inv = 1.0f / *scale;
  const T* src = kFused ? static_cast<const T*>(rr) : xr;
  const bool w_aligned = V > 1 && elems_to_alignment<T>(w) == rw.prefix % V;
  const bool out_aligned =
      V > 1 && (reinterpret_cast<uintptr_t>(outr) + static_cast<unsigned>(rw.prefix)) % V == 0;
  rw.for_each(
      src, [&](int i, T z) { outr[i] = to_fp8(to_float(normed<T>(z, w[i], s)) * inv); },
      [&](int base, const VecT<T, V>& zv) {
        const VecT<T, V> wv = load_w<T, V>(w, base, w_aligned);
        uint8_t b[V];
#pragma unroll
        for (int k = 0; k < V; ++k) b[k] = to_fp8(to_float(normed<T>(zv.v[k], wv.v[k], s)) * inv);
        store_fp8<V>(outr + base, b, out_aligned);
      });
}

template <typename T, int V, int VPT, bool kFused>
__global__ void __launch_bounds__(max_threads(VPT))
rms_norm_static_fp8_kernel(uint8_t* out, int64_t out_stride, const T* x, int64_t x_stride, T* r,
                           int64_t r_stride, const T* w, const float* scale, float eps, int n) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * x_stride;
  uint8_t* outr = out + row * out_stride;
  if constexpr (kFused) {
    T* rr = r + row * r_stride;
    if (elems_to_alignment<T>(xr) == elems_to_alignment<T>(rr)) {
      static_fp8_row<T, V, VPT, true>(outr, xr, rr, w, scale, eps, n);
    } else {
      static_fp8_row<T, 1, VPT, true>(outr, xr, rr, w, scale, eps, n);
    }
  } else {
    static_fp8_row<T, V, VPT, false>(outr, xr, nullptr, w, scale, eps, n);
  }
}

// Per-group dynamic fp8.  Only pass 1 depends on blockDim.x; the group absmax is a max
// (order-free).  Fast path (row 16-byte aligned, so prefix = tail = 0 and vectors never
// straddle groups): each thread quantizes its own vectors; the lpg = group_size / V lanes
// holding one group (lpg consecutive, lpg-aligned lanes of one warp, since blockDim.x is a
// multiple of 32 and lpg divides 32) combine their absmax with xor shuffles.  Every lane of
// the block runs every shuffle (inactive lanes contribute 0 to groups wholly past the row's
// end: nvec is a multiple of lpg).  Otherwise: warp g' handles groups g', g' + warps, ...,
// its lanes striding the group by 32 and re-reading x.
template <typename T, int V, int VPT>
__global__ void __launch_bounds__(max_threads(VPT))
rms_norm_per_block_quant_kernel(uint8_t* out, int64_t out_stride, float* scales,
                                int64_t scales_stride, const T* x, int64_t x_stride, const T* w,
                                float eps, int n, int group_size) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * x_stride;
  uint8_t* outr = out + row * out_stride;
  float* srow = scales + row * scales_stride;
  Row<T, V, VPT> rw(xr, n);
  const float s = block_rms_scale(rw.template sum_sq<false>(xr, nullptr), n, eps);
  const int lpg = group_size / V;
  const bool fast = V > 1 && rw.prefix == 0 && group_size % V == 0 && lpg <= kWarp &&
                    (lpg & (lpg - 1)) == 0 && n % group_size == 0;
  if (fast) {
    const int tid = threadIdx.x;
    const int nthr = blockDim.x;
    const bool w_aligned = elems_to_alignment<T>(w) == 0;
    const bool out_aligned = reinterpret_cast<uintptr_t>(outr) % V == 0;
    auto quant = [&](int j, const VecT<T, V>& zv) {  // called by every lane; active: j < nvec
      const bool active = j < rw.nvec;
      const int base = j * V;
      float v[V];
      float amax = 0.0f;
      if (active) {
        const VecT<T, V> wv = load_w<T, V>(w, base, w_aligned);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          v[k] = to_float(normed<T>(zv.v[k], wv.v[k], s));
          amax = fmaxf(amax, fabsf(v[k]));
        }
      }
      for (int o = lpg / 2; o > 0; o /= 2) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      }
      if (active) {
        const float gscale = fmaxf(amax / kFp8Max, kMinScale);
        uint8_t b[V];
#pragma unroll
        for (int k = 0; k < V; ++k) b[k] = to_fp8(v[k] / gscale);
        store_fp8<V>(outr + base, b, out_aligned);
        if (j % lpg == 0) srow[j / lpg] = gscale;
      }
    };
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      if (k * nthr < rw.nvec) quant(tid + k * nthr, rw.cache[k]);  // condition uniform in the block
    }
    for (int jb = VPT * nthr; jb < rw.nvec; jb += nthr) {  // uniform in the block
      const int j = jb + tid;
      VecT<T, V> zv;
      if (j < rw.nvec) zv = *reinterpret_cast<const VecT<T, V>*>(xr + j * V);
      quant(j, zv);
    }
    return;
  }
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int nwarps = blockDim.x / kWarp;
  const int ngroups = n / group_size;
  for (int g = warp; g < ngroups; g += nwarps) {  // uniform per warp: full-mask shuffles are safe
    const int begin = g * group_size;
    const int end = begin + group_size;
    float amax = 0.0f;
    for (int i = begin + lane; i < end; i += kWarp) {
      amax = fmaxf(amax, fabsf(to_float(normed<T>(xr[i], w[i], s))));
    }
#pragma unroll
    for (int o = kWarp / 2; o > 0; o /= 2) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    }
    const float gscale = fmaxf(amax / kFp8Max, kMinScale);
    if (lane == 0) srow[g] = gscale;
    for (int i = begin + lane; i < end; i += kWarp) {
      outr[i] = to_fp8(to_float(normed<T>(xr[i], w[i], s)) / gscale);
    }
  }
}

// ---------------------------------- launchers ----------------------------------

inline bool valid_launch(int64_t rows, int64_t hidden, int block) {
  return rows >= 0 && rows <= 0x7fffffff && hidden >= 1 && hidden <= 0x7fffffff &&
         block >= kWarp && block <= kMaxBlock && block % kWarp == 0;
}

template <typename T>
constexpr int vec_width() {
  return 16 / static_cast<int>(sizeof(T));
}

// Calls f(std::integral_constant<int, VPT>{}) with the smallest VPT in {1, 2, 4, 8} such
// that VPT * block >= ceil(hidden / V); longer rows get 8 (4 when block > 256, the bound of
// the VPT = 8 kernels) and re-read the rest.  A function of (hidden, dtype, block) only, and
// bit-neutral.
template <typename T, typename F>
cudaError_t with_vpt(int64_t hidden, int block, F&& f) {
  const int64_t vecs = (hidden + vec_width<T>() - 1) / vec_width<T>();
  const int64_t need = (vecs + block - 1) / block;
  if (need <= 1) return f(std::integral_constant<int, 1>{});
  if (need <= 2) return f(std::integral_constant<int, 2>{});
  if (need <= 4 || block > max_threads(8)) return f(std::integral_constant<int, 4>{});
  return f(std::integral_constant<int, 8>{});
}

template <typename T>
cudaError_t launch_rms_norm(T* out, int64_t out_stride, const T* x, int64_t x_stride, const T* w,
                            float eps, int64_t rows, int64_t hidden, int block,
                            cudaStream_t stream) {
  if (!valid_launch(rows, hidden, block)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  return with_vpt<T>(hidden, block, [&](auto vpt) {
    rms_norm_kernel<T, vec_width<T>(), decltype(vpt)::value>
        <<<static_cast<unsigned>(rows), block, 0, stream>>>(out, out_stride, x, x_stride, w, eps,
                                                            static_cast<int>(hidden));
    return cudaGetLastError();
  });
}

template <typename T>
cudaError_t launch_fused_add_rms_norm(T* x, int64_t x_stride, T* r, int64_t r_stride, const T* w,
                                      float eps, int64_t rows, int64_t hidden, int block,
                                      cudaStream_t stream) {
  if (!valid_launch(rows, hidden, block)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  return with_vpt<T>(hidden, block, [&](auto vpt) {
    fused_add_rms_norm_kernel<T, vec_width<T>(), decltype(vpt)::value>
        <<<static_cast<unsigned>(rows), block, 0, stream>>>(x, x_stride, r, r_stride, w, eps,
                                                            static_cast<int>(hidden));
    return cudaGetLastError();
  });
}

template <typename T, bool kFused>
cudaError_t launch_rms_norm_static_fp8(uint8_t* out, int64_t out_stride, const T* x,
                                       int64_t x_stride, T* r, int64_t r_stride, const T* w,
                                       const float* scale, float eps, int64_t rows,
                                       int64_t hidden, int block, cudaStream_t stream) {
  if (!valid_launch(rows, hidden, block)) return cudaErrorInvalidValue;
  if (kFused && r == nullptr) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  return with_vpt<T>(hidden, block, [&](auto vpt) {
    rms_norm_static_fp8_kernel<T, vec_width<T>(), decltype(vpt)::value, kFused>
        <<<static_cast<unsigned>(rows), block, 0, stream>>>(out, out_stride, x, x_stride, r,
                                                            r_stride, w, scale, eps,
                                                            static_cast<int>(hidden));
    return cudaGetLastError();
  });
}

template <typename T>
cudaError_t launch_rms_norm_per_block_quant(uint8_t* out, int64_t out_stride, float* scales,
                                            int64_t scales_stride, const T* x, int64_t x_stride,
                                            const T* w, float eps, int group_size, int64_t rows,
                                            int64_t hidden, int block, cudaStream_t stream) {
  if (!valid_launch(rows, hidden, block)) return cudaErrorInvalidValue;
  if (group_size < 1 || hidden % group_size != 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  return with_vpt<T>(hidden, block, [&](auto vpt) {
    rms_norm_per_block_quant_kernel<T, vec_width<T>(), decltype(vpt)::value>
        <<<static_cast<unsigned>(rows), block, 0, stream>>>(out, out_stride, scales,
                                                            scales_stride, x, x_stride, w, eps,
                                                            static_cast<int>(hidden), group_size);
    return cudaGetLastError();
  });
}

}  // namespace bik
