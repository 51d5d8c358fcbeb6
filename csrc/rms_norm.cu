// Torch-free instantiations of the RMSNorm family for float, __half and __nv_bfloat16, behind
// the type-erased entry points of rms_norm_api.h (called by csrc/rms_norm_binding.cpp).
// Syntax check without a GPU:  nvcc -c -arch=sm_90 csrc/rms_norm.cu -o /tmp/x.o
#include "rms_norm.cuh"
#include "rms_norm_api.h"

namespace bik {
namespace api {
namespace {

// Calls f(T{}) with T the element type named by `dtype`.
template <typename F>
int dispatch(int dtype, F&& f) {
  switch (dtype) {
    case kFloat32: return static_cast<int>(f(float{}));
    case kFloat16: return static_cast<int>(f(__half{}));
    case kBFloat16: return static_cast<int>(f(__nv_bfloat16{}));
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

}  // namespace

int rms_norm(void* out, int64_t out_stride, const void* x, int64_t x_stride, const void* weight,
             int dtype, int64_t rows, int64_t hidden, float eps, int block, void* stream) {
  return dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    return launch_rms_norm<T>(static_cast<T*>(out), out_stride, static_cast<const T*>(x),
                              x_stride, static_cast<const T*>(weight), eps, rows, hidden, block,
                              as_stream(stream));
  });
}

int fused_add_rms_norm(void* x, int64_t x_stride, void* residual, int64_t residual_stride,
                       const void* weight, int dtype, int64_t rows, int64_t hidden, float eps,
                       int block, void* stream) {
  return dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    return launch_fused_add_rms_norm<T>(static_cast<T*>(x), x_stride, static_cast<T*>(residual),
                                        residual_stride, static_cast<const T*>(weight), eps, rows,
                                        hidden, block, as_stream(stream));
  });
}

int rms_norm_static_fp8_quant(void* out_fp8, int64_t out_stride, const void* x, int64_t x_stride,
                              const void* weight, const float* scale, int dtype, int64_t rows,
                              int64_t hidden, float eps, int block, void* stream) {
  return dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    return launch_rms_norm_static_fp8<T, false>(
        static_cast<uint8_t*>(out_fp8), out_stride, static_cast<const T*>(x), x_stride, nullptr,
        0, static_cast<const T*>(weight), scale, eps, rows, hidden, block, as_stream(stream));
  });
}

int fused_add_rms_norm_static_fp8_quant(void* out_fp8, int64_t out_stride, const void* x,
                                        int64_t x_stride, void* residual, int64_t residual_stride,
                                        const void* weight, const float* scale, int dtype,
                                        int64_t rows, int64_t hidden, float eps, int block,
                                        void* stream) {
  return dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    return launch_rms_norm_static_fp8<T, true>(
        static_cast<uint8_t*>(out_fp8), out_stride, static_cast<const T*>(x), x_stride,
        static_cast<T*>(residual), residual_stride, static_cast<const T*>(weight), scale, eps,
        rows, hidden, block, as_stream(stream));
  });
}

int rms_norm_per_block_quant(void* out_fp8, int64_t out_stride, float* scales,
                             int64_t scales_stride, const void* x, int64_t x_stride,
                             const void* weight, int dtype, int64_t rows, int64_t hidden,
                             float eps, int group_size, int block, void* stream) {
  return dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    return launch_rms_norm_per_block_quant<T>(
        static_cast<uint8_t*>(out_fp8), out_stride, scales, scales_stride,
        static_cast<const T*>(x), x_stride, static_cast<const T*>(weight), eps, group_size, rows,
        hidden, block, as_stream(stream));
  });
}

const char* error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // namespace api
}  // namespace bik
