// Type-erased, torch-free entry points of the kit's CUDA RMSNorm family (csrc/rms_norm.cu).
//
// Plain C++ (no CUDA headers), so that the torch binding (csrc/rms_norm_binding.cpp, a host
// file) can call the kernels without seeing CUB.  Every function returns 0 on success, else a
// cudaError_t value; error_string() describes it.  Pointers are device pointers; strides are
// row strides in elements (the innermost stride is 1).  `block` is the CUDA block size chosen
// by the launch policy (kernels/rms_norm_cuda.py:launch_block_size): a multiple of 32 in
// [32, 1024].  `stream` is a cudaStream_t.
#pragma once

#include <cstdint>

namespace bik {
namespace api {

enum Dtype : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// out = (T)((T)(x * s) * w), s = 1 / sqrtf(sum(x^2) / n + eps)
int rms_norm(void* out, int64_t out_stride, const void* x, int64_t x_stride, const void* weight,
             int dtype, int64_t rows, int64_t hidden, float eps, int block, void* stream);

// z = (T)(x + residual); residual <- z; x <- rms_norm(z)   (in place)
int fused_add_rms_norm(void* x, int64_t x_stride, void* residual, int64_t residual_stride,
                       const void* weight, int dtype, int64_t rows, int64_t hidden, float eps,
                       int block, void* stream);

// out_fp8 = e4m3(clamp(float(rms_norm(x)) * (1 / *scale), -448, 448))
int rms_norm_static_fp8_quant(void* out_fp8, int64_t out_stride, const void* x, int64_t x_stride,
                              const void* weight, const float* scale, int dtype, int64_t rows,
                              int64_t hidden, float eps, int block, void* stream);

// residual <- z = (T)(x + residual); out_fp8 as above from rms_norm(z); x is not written
int fused_add_rms_norm_static_fp8_quant(void* out_fp8, int64_t out_stride, const void* x,
                                        int64_t x_stride, void* residual, int64_t residual_stride,
                                        const void* weight, const float* scale, int dtype,
                                        int64_t rows, int64_t hidden, float eps, int block,
                                        void* stream);

// Dynamic per-group fp8: v = rms_norm(x) (in T); per group of group_size elements
// scale = max(absmax(v) / 448, kMinScale); out = e4m3(clamp(v / scale)); scales[row, g] = scale.
int rms_norm_per_block_quant(void* out_fp8, int64_t out_stride, float* scales,
                             int64_t scales_stride, const void* x, int64_t x_stride,
                             const void* weight, int dtype, int64_t rows, int64_t hidden,
                             float eps, int group_size, int block, void* stream);

const char* error_string(int code);

}  // namespace api
}  // namespace bik
