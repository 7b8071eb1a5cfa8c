// fp8.h — FP8 training as Megatron runs it through Transformer Engine, emulated on CPU with
// libtorch's float8 tensors: the recipes' scaling, the quantized GEMM that keeps its quantized
// input for the backward, and the scaling state that a recompute must not touch twice
// (docs/fp8.md).
//
// Note [FP8 as actmem runs it]
// A linear layer under FP8 (Transformer Engine's Linear, transformer_engine/pytorch/module/
// linear.py) quantizes its input and its weight to E4M3 with one fp32 scale per tensor
// (x_fp8 = saturate(x * scale), x ~ x_fp8 * scale_inv), runs the GEMM on the float8 operands
// with fp32 accumulation and a 16-bit output (at::_scaled_mm, which libtorch runs on CPU too),
// and saves the *quantized* input (1 byte per element plus its fp32 scale_inv) for the backward
// instead of the 16-bit one. The backward quantizes the output gradient (E4M3, or E5M2 with the
// "hybrid" format) and runs the data gradient grad_fp8 x weight_fp8 and, with fp8_wgrad, the
// weight gradient grad_fp8^T x input_fp8 on float8 operands too (without it, in 16 bits from
// the 16-bit input, which the layer then saves instead).
// Two recipes decide the scales:
// - tensorwise (current scaling, TE's Float8CurrentScaling): scale = fp8_max / amax(x) of the
//   tensor being quantized (compute_scale_from_amax in TE's recipe_common.cuh: 1 when amax is
//   0, inf or nan; fp32 max when the quotient overflows). No state.
// - delayed (TE's DelayedScaling, Megatron's default): each quantized tensor of each GEMM has an
//   amax history of fp8_amax_history_len entries and a scale. A forward quantizes with the scale
//   it finds and records amax(x) into history[0]; when the region's forward ends (TE's
//   fp8_autocast exit around Megatron's TransformerBlock) every GEMM's scales are updated:
//   amax = history[0] (most_recent) or max(history) (max), scale = (fp8_max / amax) / 2^margin
//   (kept when amax is 0 or not finite), then the history rolls one place and history[0] is
//   zeroed (TE's _amax_and_scale_update). The output gradients' scales are updated the same way
//   when the backward of the region's first GEMM ends (TE's reduce_and_update_bwd_fp8_tensors).
// A recompute replays a forward in the backward, after the scales were updated: under delayed
// scaling it must quantize with the scales the original forward used and must not record its
// amaxes (what Transformer Engine's distributed.checkpoint, te_checkpoint in Megatron, exists
// for). Each GEMM stashes its scales (and whether it was its region's first GEMM) when its
// forward runs inside a checkpoint, and its replay takes them back in the same order
// (TE's copy_forward_fp8_meta_tensors_for_recompute / get_old_fp8_meta_tensors_for_recompute);
// the replay records nothing. Tensorwise scales are a function of the tensor, so a replay of the
// same tensor gives the same scale by itself.
#pragma once

#include "actmem/config/activation_plan.h"
#include "actmem/config/config.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

namespace actmem {

/// The largest finite magnitudes of E4M3 (448) and E5M2 (57344).
double fp8_max(at::ScalarType fp8_dtype);

/// TE's compute_scale_from_amax (current scaling): fp8_max / amax, 1 for an amax that is 0, inf
/// or nan, fp32's max when the quotient overflows. amax: a float scalar tensor.
at::Tensor scale_from_amax(const at::Tensor& amax, double fp8_max);

/// x quantized with `scale` (a float scalar tensor): saturate(x * scale) as `fp8_dtype`
/// (round to nearest even, magnitudes above the type's maximum saturate to it).
at::Tensor quantize_fp8(const at::Tensor& x, const at::Tensor& scale, at::ScalarType fp8_dtype);

/// A model's FP8 recipe as its configuration gives it (TransformerConfig's fp8_* fields).
struct Fp8Recipe {
  bool delayed = true;      // delayed scaling; false: tensorwise current scaling
  bool hybrid = false;      // output gradients in E5M2
  int64_t margin = 0;       // delayed: scale divided by 2^margin
  int64_t history_len = 1;  // delayed: amax history entries
  bool amax_max = false;    // delayed: amax = max(history); false: history[0]
  bool wgrad = true;        // the weight gradient's GEMM in FP8
  at::ScalarType forward_dtype() const { return at::kFloat8_e4m3fn; }
  at::ScalarType backward_dtype() const { return hybrid ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn; }
  static Fp8Recipe from(const TransformerConfig& config);
};

/// One quantized tensor's delayed-scaling state (an entry of TE's fp8_meta): its amax history
/// and its current scale, float tensors of [history_len] and [].
struct DelayedScale {
  at::Tensor history;
  at::Tensor scale;
  /// An amax was recorded since the last update: the next update of its region is its own.
  bool recorded = false;
  explicit DelayedScale(int64_t history_len);
  /// TE's _amax_and_scale_update: the amax from the history, the new scale, the history rolled
  /// and its entry 0 zeroed.
  void update(const Fp8Recipe& recipe, double fp8_max);
};

class Fp8Registry;

/// One FP8 GEMM's quantization state: its input's, weight's and output gradient's scales under
/// delayed scaling, and the scales its forwards inside checkpoints stashed for their replays.
class Fp8Gemm {
 public:
  explicit Fp8Gemm(std::shared_ptr<Fp8Registry> registry);
  Fp8Registry& registry() const { return *registry_; }
  DelayedScale input, weight, grad_output;
  /// The delayed-scaling state as one float tensor [3 (history_len + 1)]: input, weight and
  /// output gradient, each its history then its scale (checkpoints), and back.
  at::Tensor state() const;
  void set_state(const at::Tensor& state);

  /// What a forward inside a checkpoint leaves for its replay: the scales it used, as host
  /// floats (exact; no device memory is held from the forward to the replay).
  struct Stash {
    float input_scale = 1.0f, weight_scale = 1.0f;
    bool first = false;
  };
  std::deque<Stash> recompute_stash;

 private:
  std::shared_ptr<Fp8Registry> registry_;
};

/// The FP8 state of one model (TE's FP8GlobalStateManager for the GEMMs of one process): the
/// recipe, every GEMM's delayed-scaling state, and the forward and backward regions whose ends
/// update the scales.
class Fp8Registry {
 public:
  explicit Fp8Registry(const Fp8Recipe& recipe) : recipe_(recipe) {}
  const Fp8Recipe& recipe() const { return recipe_; }
  /// A new GEMM's state, updated with the others.
  std::shared_ptr<Fp8Gemm> add_gemm(const std::shared_ptr<Fp8Registry>& self);

  /// A training forward of the region (the transformer block) begins: its first GEMM will
  /// update the output gradients' scales when its backward ends.
  void begin_forward() { first_pending_ = true; }
  /// Called by each recording forward GEMM: true for the region's first.
  bool take_first() {
    const bool first = first_pending_;
    first_pending_ = false;
    return first;
  }
  /// The region's training forward ended: the input and weight scales of every GEMM that ran
  /// in it are updated (delayed scaling; nothing under current scaling). (TE updates every
  /// module it has seen at each region's end; with one region per model chunk, as the
  /// interleaved pipeline schedule runs them, that rolls the other chunks' windows too — here a
  /// chunk's region updates its own GEMMs, so the interleaved schedule trains the one-process
  /// model.)
  void end_forward();
  /// The backward of the region's first GEMM ended: the output-gradient scales of every GEMM
  /// whose backward ran since are updated.
  void end_backward();

  /// How many forward and backward updates ran (tests).
  int64_t forward_updates() const { return forward_updates_; }
  int64_t backward_updates() const { return backward_updates_; }
  /// Every GEMM's delayed-scaling tensors in registration order: input history, input scale,
  /// weight history, weight scale, output-gradient history, output-gradient scale (tests and
  /// checkpoints).
  std::vector<at::Tensor> state_tensors() const;

  /// Replays update the scaling state like a first forward (recording amaxes, ignoring the
  /// stash): the wrong recompute te_checkpoint prevents, for the test that shows it differs.
  bool naive_recompute_for_test = false;

 private:
  Fp8Recipe recipe_;
  std::vector<std::weak_ptr<Fp8Gemm>> gemms_;
  bool first_pending_ = false;
  int64_t forward_updates_ = 0, backward_updates_ = 0;
};

/// Under FP8, whether a GEMM reading a slot norm's output keeps that 16-bit output instead of a
/// quantized copy: with selective layernorm recompute, which frees the output and recomputes it,
/// under a current-scaling recipe (Megatron's set_for_recompute_input_layernorm, and
/// set_save_original_input on a dense MLP's linear_fc1), so the GEMM quantizes the recomputed
/// output again in the backward.
bool fp8_keeps_recomputed_norm_output(bool delayed_scaling, const LayerPlan& plan);

/// y = x W^T (+ bias) on FP8 operands under `gemm`'s recipe (Note [FP8 as actmem runs it]).
/// x: [..., in] 16-bit, weight [out, in], bias [out] or undefined. save_original_input keeps the
/// 16-bit input instead of the quantized one and quantizes it again in the backward (Megatron's
/// set_save_original_input; current scaling only, where the replayed quantization is the same).
at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                      Fp8Gemm& gemm, bool save_original_input);

}  // namespace actmem
