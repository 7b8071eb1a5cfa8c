// weight_init.cpp — the model's draws (weight_init.h).
#include "actmem/model/weight_init.h"

#include "actmem/model/layers.h"
#include "actmem/parallel/tensor_parallel.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

namespace actmem {

WeightInit::WeightInit(const TransformerConfig& config, at::ScalarType dtype)
    : gen_(at::make_generator<at::CPUGeneratorImpl>(config.seed)),
      std_(config.init_method_std),
      // Megatron's output_layer_init_method: std / sqrt(2 * num_layers).
      scaled_std_(config.init_method_std / std::sqrt(2.0 * static_cast<double>(config.num_layers))),
      dtype_(dtype),
      tp_rank_(tensor_parallel_group().rank),
      tp_size_(tensor_parallel_group().size) {}

at::Tensor WeightInit::normal(at::IntArrayRef shape, double std) {
  at::NoGradGuard no_grad;
  const at::ScalarType draw = is_16bit(dtype_) ? at::kFloat : dtype_;
  return at::empty(shape, at::TensorOptions().dtype(draw)).normal_(0.0, std, gen_).to(dtype_);
}

at::Tensor WeightInit::uniform(at::IntArrayRef shape, double lo, double hi) {
  return uniform(shape, lo, hi, dtype_);
}

at::Tensor WeightInit::uniform(at::IntArrayRef shape, double lo, double hi, at::ScalarType type) {
  at::NoGradGuard no_grad;
  const at::ScalarType draw = is_16bit(type) ? at::kFloat : type;
  return at::empty(shape, at::TensorOptions().dtype(draw)).uniform_(lo, hi, gen_).to(type);
}

at::Tensor WeightInit::rows(const at::Tensor& full) const {
  return full.chunk(tp_size_, 0)[tp_rank_];
}

at::Tensor WeightInit::cols(const at::Tensor& full) const {
  return tp_size_ == 1 ? full : full.chunk(tp_size_, 1)[tp_rank_];
}

at::Tensor WeightInit::section_rows(const at::Tensor& full,
                                    const std::vector<int64_t>& sections) const {
  if (tp_size_ == 1) return full;
  std::vector<at::Tensor> mine;
  for (const at::Tensor& part : full.split_with_sizes(sections, 0)) mine.push_back(rows(part));
  return at::cat(mine, 0);
}

at::Tensor WeightInit::fc1_rows(const at::Tensor& full, bool gated) const {
  if (tp_size_ == 1) return full;
  if (!gated) return rows(full);
  const auto halves = full.chunk(2, 0);
  return at::cat({rows(halves[0]), rows(halves[1])}, 0);
}

}  // namespace actmem
