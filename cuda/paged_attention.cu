// PLACEHOLDER owned by the CUDA kernel engineer (cudakern): replace this file with the real
// kernels. It exists only so that a CUDA build links before they land; every call throws.
#include <stdexcept>

#include "kernels.h"

namespace pagedllm::cuda {

void paged_attention(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                     const TensorView&, const TensorView&, float, const AttentionOptions&,
                     std::uintptr_t) {
  throw std::runtime_error("CUDA paged_attention is not implemented yet in this build");
}

void paged_prefill_attention(const TensorView&, const TensorView&, const TensorView&,
                             const TensorView&, const TensorView&, const TensorView&,
                             const TensorView&, float, const AttentionOptions&, std::uintptr_t) {
  throw std::runtime_error("CUDA paged_prefill_attention is not implemented yet in this build");
}

}  // namespace pagedllm::cuda
