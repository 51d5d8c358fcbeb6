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

// One element of pass 1: returns the value whose square is accumulated.  kFused: the
// rounded z = (T)(x + r), which is also stored to r.
template <typename T, bool kFused>
__device__ __forceinline__ float pass1_element(const T* x, T* r, int i) {
  if constexpr (kFused) {
    const T z = from_float<T>(to_float(x[i]) + to_float(r[i]));
    r[i] = z;
    return to_float(z);
  } else {
    return to_float(x[i]);
  }
}

// Pass 1 of one row: this thread's fp32 partial sum of squares (see the header comment).
template <typename T, int V, bool kFused>
__device__ __forceinline__ float row_sum_sq(const T* x, T* r, int n) {
  const int tid = threadIdx.x;
  const int nthr = blockDim.x;
  const int prefix = (V > 1) ? min(elems_to_alignment<T>(x), n) : 0;
  const int nvec = (n - prefix) / V;
  const int tail = prefix + nvec * V;
  float acc = 0.0f;
  if (tid < prefix) {  // prefix < V <= 8 <= blockDim.x
    const float e = pass1_element<T, kFused>(x, r, tid);
    acc = fmaf(e, e, acc);
  }
  using Vec = VecT<T, V>;
  for (int j = tid; j < nvec; j += nthr) {
    const int base = prefix + j * V;  // 16-byte aligned for V > 1
    const Vec xv = *reinterpret_cast<const Vec*>(x + base);
    if constexpr (kFused) {
      const Vec rv = *reinterpret_cast<const Vec*>(r + base);
      Vec zv;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        zv.v[k] = from_float<T>(to_float(xv.v[k]) + to_float(rv.v[k]));
        const float e = to_float(zv.v[k]);
        acc = fmaf(e, e, acc);
      }
      *reinterpret_cast<Vec*>(r + base) = zv;
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float e = to_float(xv.v[k]);
        acc = fmaf(e, e, acc);
      }
    }
  }
  for (int i = tail + tid; i < n; i += nthr) {
    const float e = pass1_element<T, kFused>(x, r, i);
    acc = fmaf(e, e, acc);
  }
  return acc;
}

// Fused-add pass 1: vectorized only when x and r share their misalignment.
template <typename T, int V>
__device__ __forceinline__ float fused_row_sum_sq(const T* x, T* r, int n) {
  if (V > 1 && elems_to_alignment<T>(x) == elems_to_alignment<T>(r)) {
    return row_sum_sq<T, V, true>(x, r, n);
  }
  return row_sum_sq<T, 1, true>(x, r, n);
}

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

// ---------------------------------- kernels ----------------------------------

template <typename T, int V>
__global__ void rms_norm_kernel(T* out, int64_t out_stride, const T* x, int64_t x_stride,
                                const T* w, float eps, int n) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * x_stride;
  T* outr = out + row * out_stride;
  const float s = block_rms_scale(row_sum_sq<T, V, false>(xr, nullptr, n), n, eps);
  for (int i = threadIdx.x; i < n; i += blockDim.x) outr[i] = normed<T>(xr[i], w[i], s);
}

template <typename T, int V>
__global__ void fused_add_rms_norm_kernel(T* x, int64_t x_stride, T* r, int64_t r_stride,
                                          const T* w, float eps, int n) {
  const int64_t row = blockIdx.x;
  T* xr = x + row * x_stride;
  T* rr = r + row * r_stride;
  const float s = block_rms_scale(fused_row_sum_sq<T, V>(xr, rr, n), n, eps);
  for (int i = threadIdx.x; i < n; i += blockDim.x) xr[i] = normed<T>(rr[i], w[i], s);
}

// kFused = false: r is unused (nullptr); the normalized source is x.
template <typename T, int V, bool kFused>
__global__ void rms_norm_static_fp8_kernel(uint8_t* out, int64_t out_stride, const T* x,
                                           int64_t x_stride, T* r, int64_t r_stride, const T* w,
                                           const float* scale, float eps, int n) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * x_stride;
  uint8_t* outr = out + row * out_stride;
  float acc;
  const T* src;
  if constexpr (kFused) {
    T* rr = r + row * r_stride;
    acc = fused_row_sum_sq<T, V>(xr, rr, n);
    src = rr;
  } else {
    acc = row_sum_sq<T, V, false>(xr, nullptr, n);
    src = xr;
  }
  const float s = block_rms_scale(acc, n, eps);
  const float inv = 1.0f / *scale;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    outr[i] = to_fp8(to_float(normed<T>(src[i], w[i], s)) * inv);
  }
}

// Per-group dynamic fp8.  Warp g' handles groups g', g' + warps, ...; its lanes stride the
// group by 32.  The group absmax is a max (order-free); only pass 1 depends on blockDim.x.
template <typename T, int V>
__global__ void rms_norm_per_block_quant_kernel(uint8_t* out, int64_t out_stride, float* scales,
                                                int64_t scales_stride, const T* x,
                                                int64_t x_stride, const T* w, float eps, int n,
                                                int group_size) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * x_stride;
  uint8_t* outr = out + row * out_stride;
  const float s = block_rms_scale(row_sum_sq<T, V, false>(xr, nullptr, n), n, eps);
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
    if (lane == 0) scales[row * scales_stride + g] = gscale;
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

template <typename T>
cudaError_t launch_rms_norm(T* out, int64_t out_stride, const T* x, int64_t x_stride, const T* w,
                            float eps, int64_t rows, int64_t hidden, int block,
                            cudaStream_t stream) {
  if (!valid_launch(rows, hidden, block)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  rms_norm_kernel<T, vec_width<T>()><<<static_cast<unsigned>(rows), block, 0, stream>>>(
      out, out_stride, x, x_stride, w, eps, static_cast<int>(hidden));
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_fused_add_rms_norm(T* x, int64_t x_stride, T* r, int64_t r_stride, const T* w,
                                      float eps, int64_t rows, int64_t hidden, int block,
                                      cudaStream_t stream) {
  if (!valid_launch(rows, hidden, block)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  fused_add_rms_norm_kernel<T, vec_width<T>()><<<static_cast<unsigned>(rows), block, 0, stream>>>(
      x, x_stride, r, r_stride, w, eps, static_cast<int>(hidden));
  return cudaGetLastError();
}

template <typename T, bool kFused>
cudaError_t launch_rms_norm_static_fp8(uint8_t* out, int64_t out_stride, const T* x,
                                       int64_t x_stride, T* r, int64_t r_stride, const T* w,
                                       const float* scale, float eps, int64_t rows,
                                       int64_t hidden, int block, cudaStream_t stream) {
  if (!valid_launch(rows, hidden, block)) return cudaErrorInvalidValue;
  if (kFused && r == nullptr) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  rms_norm_static_fp8_kernel<T, vec_width<T>(), kFused>
      <<<static_cast<unsigned>(rows), block, 0, stream>>>(out, out_stride, x, x_stride, r,
                                                          r_stride, w, scale, eps,
                                                          static_cast<int>(hidden));
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_rms_norm_per_block_quant(uint8_t* out, int64_t out_stride, float* scales,
                                            int64_t scales_stride, const T* x, int64_t x_stride,
                                            const T* w, float eps, int group_size, int64_t rows,
                                            int64_t hidden, int block, cudaStream_t stream) {
  if (!valid_launch(rows, hidden, block)) return cudaErrorInvalidValue;
  if (group_size < 1 || hidden % group_size != 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  rms_norm_per_block_quant_kernel<T, vec_width<T>()>
      <<<static_cast<unsigned>(rows), block, 0, stream>>>(out, out_stride, scales, scales_stride,
                                                          x, x_stride, w, eps,
                                                          static_cast<int>(hidden), group_size);
  return cudaGetLastError();
}

}  // namespace bik
