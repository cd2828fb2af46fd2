// Turns a runtime dtype, head_dim or quantization bit width into a compile-time constant for the
// kernels' templates, the same in every backend (C++17: nvcc includes it); unknown values are refused.
#pragma once

#include <string>
#include <type_traits>
#include <utility>

#include "karakv/kernels/types.h"

namespace karakv::kernels::common {

namespace detail {
// f's result as a KernelStatus: a function returning nothing succeeded.
template <typename F, typename Arg>
KernelStatus call_to_status(F&& f, Arg arg) {
  if constexpr (std::is_void_v<std::invoke_result_t<F, Arg>>) {
    std::forward<F>(f)(arg);
    return KernelStatus::ok();
  } else {
    return std::forward<F>(f)(arg);
  }
}
}  // namespace detail

// Calls f(std::integral_constant<DType, D>{}) for the runtime storage dtype and returns its status
// (OK when f returns nothing). An unknown dtype calls nothing and is kInvalidArgument; the
// validators (checks.h) refuse one before any kernel runs.
template <typename F>
KernelStatus dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: return detail::call_to_status(f, std::integral_constant<DType, DType::kFloat32>{});
    case DType::kFloat16: return detail::call_to_status(f, std::integral_constant<DType, DType::kFloat16>{});
    case DType::kBFloat16: return detail::call_to_status(f, std::integral_constant<DType, DType::kBFloat16>{});
  }
  return KernelStatus::invalid("unknown dtype");
}

// Calls f(std::integral_constant<int, HD>{}) with HD = head_dim for the head dims kernels unroll
// for (64 and 128), else with HD = 0: any other head_dim, which the kernel handles with runtime
// bounds. Returns what f returns; never fails.
template <typename F>
decltype(auto) dispatch_head_dim(int head_dim, F&& f) {
  switch (head_dim) {
    case 64: return f(std::integral_constant<int, 64>{});
    case 128: return f(std::integral_constant<int, 128>{});
    default: return f(std::integral_constant<int, 0>{});
  }
}

// Calls f(std::integral_constant<int, B>{}) for the bit width `bits` (2, 3 or 4) of quantization
// format `format` and returns its status; any other width (quant_bits of an unknown format is 0)
// calls nothing and is kInvalidArgument naming the format.
template <typename F>
KernelStatus dispatch_quant_bits(QuantFormat format, int bits, F&& f) {
  switch (bits) {
    case 2: return detail::call_to_status(f, std::integral_constant<int, 2>{});
    case 3: return detail::call_to_status(f, std::integral_constant<int, 3>{});
    case 4: return detail::call_to_status(f, std::integral_constant<int, 4>{});
  }
  return KernelStatus::invalid("unknown quant format " + std::to_string(int(format)));
}

}  // namespace karakv::kernels::common
