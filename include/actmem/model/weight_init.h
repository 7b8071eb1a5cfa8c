// weight_init.h — the model's initial weights as one sequence of draws, so a model is a pure
// function of its config whatever the parallel layout.
//
// Note [One sequence of draws]
// Initialisation draws from one generator seeded with config.seed, in the single-process
// construction order (the embeddings, then each layer's parts in order, then an untied output
// layer), independent of the global RNG that dropout uses. Every rank draws the full (t = 1)
// weight and keeps its slice (Megatron's _initialize_affine_weight_cpu), and every pipeline stage
// draws the layers of the other stages too and drops them (Note [Pipeline stages draw the whole
// model] in model.cpp), so a model split over t tensor ranks, p stages or e expert ranks is the
// same function as the single-process one, and checkpoints compare across layouts. A 16-bit
// model is the fp32 model rounded: the draws are made in fp32 and cast, as Megatron initialises
// in fp32 and converts to params_dtype. A part draws its weights in WeightInit's order in its
// own init_weights() (layer_part.h).
#pragma once

#include "actmem/config/config.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace actmem {

class WeightInit {
 public:
  /// Draws for `config` (config.seed, init_method_std) at `dtype`, sliced for this process's
  /// tensor-parallel rank.
  WeightInit(const TransformerConfig& config, at::ScalarType dtype);
  WeightInit(const WeightInit&) = delete;
  WeightInit& operator=(const WeightInit&) = delete;

  /// config.init_method_std, and Megatron's output_layer_init_method for the residual
  /// projections (linear_proj, linear_fc2, out_proj): std / sqrt(2 num_layers).
  double std() const { return std_; }
  double scaled_std() const { return scaled_std_; }
  /// The parameters' type.
  at::ScalarType dtype() const { return dtype_; }

  /// The next draws: a full tensor of `shape` from N(0, std^2) or U(lo, hi), in the parameters'
  /// type (drawn in fp32 for a 16-bit model); `draw` overrides the type drawn in and returned.
  at::Tensor normal(at::IntArrayRef shape, double std);
  at::Tensor uniform(at::IntArrayRef shape, double lo, double hi);
  at::Tensor uniform(at::IntArrayRef shape, double lo, double hi, at::ScalarType draw);

  /// The tensor-parallel size the slices are for.
  int64_t tp_size() const { return tp_size_; }
  /// This tensor rank's slice of a full weight: its rows (column-parallel), its columns
  /// (row-parallel); `full` itself on one rank.
  at::Tensor rows(const at::Tensor& full) const;
  at::Tensor cols(const at::Tensor& full) const;
  /// The rows of a weight made of row sections, each split over the ranks (a fused projection
  /// holding, per rank, its slice of each section: [q | k | v | ...]).
  at::Tensor section_rows(const at::Tensor& full, const std::vector<int64_t>& sections) const;
  /// An MLP's fc1 weight [fc1_rows, h]: its rows, or with a gated unit ([gate; up]) the rank's
  /// slice of each half, in that order, so chunk(2) of the local output still splits gate from up.
  at::Tensor fc1_rows(const at::Tensor& full, bool gated) const;

 private:
  at::Generator gen_;
  double std_, scaled_std_;
  at::ScalarType dtype_;
  int tp_rank_, tp_size_;
};

}  // namespace actmem
