// Torch binding of the RMSNorm family (built only on a GPU box, by kernels/cuda_ext.py).
// Minimal: basic checks, then the type-erased launchers of rms_norm_api.h on the current
// stream.  Full argument validation (with errors naming the argument) is done in Python,
// kernels/rms_norm_cuda.py; the block size comes from its launch policy.
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "rms_norm_api.h"

namespace {

int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return bik::api::kFloat32;
    case at::kHalf: return bik::api::kFloat16;
    case at::kBFloat16: return bik::api::kBFloat16;
    default: TORCH_CHECK(false, "unsupported dtype ", t.scalar_type());
  }
  return -1;
}

// 2-D CUDA tensor with unit inner stride, `cols` columns, on x's device.
void check_2d(const at::Tensor& t, const char* name, const at::Tensor& x, int64_t cols) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.device() == x.device(), name, " must be on ", x.device());
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D");
  TORCH_CHECK(t.size(0) == x.size(0) && t.size(1) == cols, name, " has the wrong shape");
  TORCH_CHECK(cols == 1 || t.stride(1) == 1, name, " must have a unit inner stride");
}

void check_common(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && (x.size(1) == 1 || x.stride(1) == 1),
              "x must be a 2-D CUDA tensor with a unit inner stride");
  TORCH_CHECK(weight.is_cuda() && weight.device() == x.device() && weight.dim() == 1 &&
                  weight.size(0) == x.size(1) && weight.is_contiguous(),
              "weight must be a contiguous (hidden,) tensor on x's device");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight dtype must match x");
}

void check_same(const at::Tensor& t, const char* name, const at::Tensor& x) {
  check_2d(t, name, x, x.size(1));
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), name, " dtype must match x");
}

void check_fp8(const at::Tensor& out, const at::Tensor& x) {
  check_2d(out, "out", x, x.size(1));
  TORCH_CHECK(out.scalar_type() == at::kFloat8_e4m3fn, "out must be float8_e4m3fn");
}

void check_scale(const at::Tensor& scale, const at::Tensor& x) {
  TORCH_CHECK(scale.is_cuda() && scale.device() == x.device() && scale.numel() == 1 &&
                  scale.scalar_type() == at::kFloat,
              "scale must be a one-element float32 tensor on x's device");
}

void raise_if(int err, const char* op) {
  TORCH_CHECK(err == 0, op, " failed: ", bik::api::error_string(err));
}

void* stream() { return static_cast<void*>(c10::cuda::getCurrentCUDAStream().stream()); }

void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps,
              int64_t block) {
  check_common(x, weight);
  check_same(out, "out", x);
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  raise_if(bik::api::rms_norm(out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0),
                              weight.data_ptr(), dtype_code(x), x.size(0), x.size(1),
                              static_cast<float>(eps), static_cast<int>(block), stream()),
           "rms_norm");
}

void fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                        double eps, int64_t block) {
  check_common(x, weight);
  check_same(residual, "residual", x);
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  raise_if(bik::api::fused_add_rms_norm(x.data_ptr(), x.stride(0), residual.data_ptr(),
                                        residual.stride(0), weight.data_ptr(), dtype_code(x),
                                        x.size(0), x.size(1), static_cast<float>(eps),
                                        static_cast<int>(block), stream()),
           "fused_add_rms_norm");
}

void rms_norm_static_fp8_quant(const at::Tensor& out, const at::Tensor& x,
                               const at::Tensor& weight, const at::Tensor& scale, double eps,
                               int64_t block) {
  check_common(x, weight);
  check_fp8(out, x);
  check_scale(scale, x);
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  raise_if(bik::api::rms_norm_static_fp8_quant(
               out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0), weight.data_ptr(),
               scale.data_ptr<float>(), dtype_code(x), x.size(0), x.size(1),
               static_cast<float>(eps), static_cast<int>(block), stream()),
           "rms_norm_static_fp8_quant");
}

void fused_add_rms_norm_static_fp8_quant(const at::Tensor& out, const at::Tensor& x,
                                         const at::Tensor& residual, const at::Tensor& weight,
                                         const at::Tensor& scale, double eps, int64_t block) {
  check_common(x, weight);
  check_fp8(out, x);
  check_same(residual, "residual", x);
  check_scale(scale, x);
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  raise_if(bik::api::fused_add_rms_norm_static_fp8_quant(
               out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0), residual.data_ptr(),
               residual.stride(0), weight.data_ptr(), scale.data_ptr<float>(), dtype_code(x),
               x.size(0), x.size(1), static_cast<float>(eps), static_cast<int>(block), stream()),
           "fused_add_rms_norm_static_fp8_quant");
}

void rms_norm_per_block_quant(const at::Tensor& out, const at::Tensor& scales,
                              const at::Tensor& x, const at::Tensor& weight, double eps,
                              int64_t group_size, int64_t block) {
  check_common(x, weight);
  check_fp8(out, x);
  TORCH_CHECK(group_size > 0 && x.size(1) % group_size == 0, "hidden must be a multiple of group_size");
  check_2d(scales, "scales", x, x.size(1) / group_size);
  TORCH_CHECK(scales.scalar_type() == at::kFloat, "scales must be float32");
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  raise_if(bik::api::rms_norm_per_block_quant(
               out.data_ptr(), out.stride(0), scales.data_ptr<float>(), scales.stride(0),
               x.data_ptr(), x.stride(0), weight.data_ptr(), dtype_code(x), x.size(0),
               x.size(1), static_cast<float>(eps), static_cast<int>(group_size),
               static_cast<int>(block), stream()),
           "rms_norm_per_block_quant");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Batch-invariance kit: CUDA RMSNorm family (block size passed in by the caller)";
  m.def("rms_norm", &rms_norm, "out, x, weight, eps, block");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "x, residual, weight, eps, block (in place)");
  m.def("rms_norm_static_fp8_quant", &rms_norm_static_fp8_quant,
        "out_fp8, x, weight, scale, eps, block");
  m.def("fused_add_rms_norm_static_fp8_quant", &fused_add_rms_norm_static_fp8_quant,
        "out_fp8, x, residual, weight, scale, eps, block");
  m.def("rms_norm_per_block_quant", &rms_norm_per_block_quant,
        "out_fp8, scales, x, weight, eps, group_size, block");
}
