// layer_part.h — what a part of a transformer layer is: the module that runs in a layer's slot
// (PartModule) and the kind's whole contract (LayerPart). layer_spec.h says which kind fills
// which slot of which layer.
//
// Note [A layer part owns its contract]
// A transformer layer is a spec of slots, as Megatron's TransformerLayerSubmodules
// (megatron/core/transformer/transformer_layer.py, built from a ModuleSpec by
// gpt_layer_specs.py): input_layernorm -> self_attention (the mixer) -> bias-dropout-add ->
// pre_mlp_layernorm -> mlp -> bias-dropout-add. The norms and the bias-dropout-adds are the
// same for every layer; the mixer (standard or grouped-query attention, multi-latent attention,
// Gated DeltaNet) and the MLP (dense, or mixture of experts) are parts of a kind. Each kind keeps
// everything that depends on it in its own folder of src/model/: its weights and their draws, its
// forward and the recompute and offload units it runs, the bytes it saves for the backward under
// any plan (the exact predictor), its analytic terms (estimate, plan --preset), its FLOPs and its
// parameter count. Central code — the layer, the model, the predictor, the analytic planner,
// estimate, throughput — sums over the parts of each layer and never asks which kind a part is.
#pragma once

#include "actmem/config/activation_plan.h"
#include "actmem/config/config.h"
#include "actmem/memory/memory_model.h"
#include "actmem/model/moe/moe_rows.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace actmem {

class ActivationOffloader;
class Fp8Registry;
class RotaryEmbedding;
struct PartEstimate;
struct PartEstimateContext;
class WeightInit;
struct MoEStats;

/// What every layer's parts receive besides their input (Megatron passes the same to each layer).
struct LayerContext {
  const RotaryEmbedding* rope = nullptr;     // the model's rotary tables; null without RoPE
  at::Tensor attention_mask;                 // [1, 1, S, S] bool, S >= s (make_causal_mask)
  ActivationOffloader* offloader = nullptr;  // layer-level or fine-grained offload (training)
};

/// A mixer's state across the steps of incremental decoding (generate.h's KVCache): what it
/// keeps of the positions it has seen.
class DecodeState {
 public:
  virtual ~DecodeState() = default;
  /// Device bytes the state holds.
  virtual int64_t bytes() const = 0;
};

/// The module in a layer's slot: the mixer, registered as "self_attention", or the MLP,
/// registered as "mlp" (Megatron's names, whatever the kind).
class PartModule : public torch::nn::Module {
 public:
  /// x: the slot's norm output [s, b, h] (this rank's [s/t, b, h] shard under sequence
  /// parallelism) -> (output [s, b, h], a bias the bias-dropout-add adds, or undefined). Runs
  /// the part's recompute and offload units as the layer's plan says.
  virtual std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& x,
                                                    const LayerContext& ctx) = 0;
  /// Draws the part's weights, in the single-process order (Note [One sequence of draws] in
  /// weight_init.h), into this rank's slices.
  virtual void init_weights(WeightInit& init) = 0;

  /// Incremental decoding (generation, one process, evaluation mode). A state for `capacity`
  /// positions of parameters like `options`, or null for a part that keeps nothing across steps
  /// (an MLP); throws for a part that cannot decode incrementally, naming itself.
  virtual std::unique_ptr<DecodeState> make_decode_state(int64_t capacity,
                                                         const at::TensorOptions& options) const;
  /// x: the norm output of positions [offset, offset + n) as [n, 1, h] -> (output, bias), the
  /// positions appended to `state` (null when make_decode_state() returned null). By default
  /// the part's forward, which sees each position on its own.
  virtual std::pair<at::Tensor, at::Tensor> decode(const at::Tensor& x, DecodeState* state,
                                                   int64_t offset, const LayerContext& ctx);

  /// Where the part reports what it measures per forward (the MoE layers' routing and losses);
  /// called once by GPTModel, in layer order. Nothing by default.
  virtual void bind_stats(MoEStats& stats) {}
  /// The backward scale of the part's auxiliary losses (MoE's load-balancing and z-losses:
  /// Megatron's MoEAuxLossAutoScaler.set_loss_scale). Nothing by default.
  virtual void set_aux_loss_scale(double scale) {}
  /// Runs the part's GEMMs in FP8 under `registry`'s recipe (fp8.h), for a layer that is not
  /// kept in 16 bits (TransformerConfig::quantized_layer). By default every Linear below the
  /// part, each keeping its quantized input; a part overrides it to keep the 16-bit input of
  /// GEMMs whose input is kept or recomputed anyway (Megatron's set_save_original_input).
  virtual void use_fp8(const std::shared_ptr<Fp8Registry>& registry);
};

/// Which slot of a layer a part fills.
enum class PartSlot : uint8_t { kMixer, kMlp };

/// What the exact predictor (activation_bytes.h) tells a part about the layer it predicts: one
/// micro-batch on this rank (Note [What this model saves] in activation_bytes.cpp).
struct SavedBytesContext {
  const TransformerConfig& config;
  const LayerPlan& plan;  // the layer's
  int64_t e = 4;          // bytes per activation element
  int64_t up = 4;         // upcast values: fp32 at 16 bits, the dtype otherwise
  int64_t ln_stat = 4;    // LayerNorm's mean and rstd: the dtype on CPU, upcast on CUDA
  bool cpu = true;        // CPU conventions (ln_stat; snapshots on the device)
  int64_t snapshot = 0;   // one checkpoint's random-state snapshot (0 when kept on the host)
  int64_t tokens = 0;     // this rank's tokens of the residual stream: s b, or s b / t with SP
  /// The slot norm's output where the part first saves it (0 when selective layernorm recompute
  /// frees it: the norm's checkpoint keeps the norm's input instead).
  int64_t input = 0;
  /// The layer among the predicted layers of this part's kind (0-based): its entry in `routing`.
  size_t kind_index = 0;
  /// The MoE layers' measured routing (MoEStats::routing()), or null.
  const MoERouting* routing = nullptr;
  /// Size data-dependent tensors at the most they can be (the memory pre-check's bound) when the
  /// routing does not say.
  bool upper_bound = false;
  /// The layer's GEMMs run in FP8 (TransformerConfig::quantized_layer): each keeps its input
  /// quantized, 1 byte per element (fp8.h).
  bool fp8 = false;
  /// What a GEMM of the layer keeps of an input of `elements` whose 16-bit storage costs this
  /// module `kept_bytes` (0 when another module keeps it): that storage in 16 bits; under FP8
  /// the quantized copy and its fp32 scale_inv plus the weight's scale (elements + 8), or with
  /// `save_original` (Megatron's set_save_original_input) or a 16-bit weight gradient
  /// (--no-fp8-wgrad) the 16-bit storage plus the weight's scale.
  int64_t gemm_input(int64_t elements, int64_t kept_bytes, bool save_original = false) const;
  /// Adds `bytes` to `module`, a path under the slot ("linear_qkv"; "" for the slot itself).
  std::function<void(const std::string& module, int64_t bytes)> add = nullptr;
  /// What a norm over `rows` rows keeps besides its input: RMSNorm's rstd upcast, LayerNorm's
  /// mean and rstd.
  int64_t norm_statistics(int64_t rows) const;
  /// --apply-layernorm-1p: each norm call keeps its scale 1 + weight, `features` elements.
  int64_t norm_scale(int64_t features) const;
};

/// Korthikanti et al.'s term for one module (korthikanti_module_bytes in activation_bytes.h)
/// and what this implementation keeps beyond it, and why.
struct ModuleTerms {
  double paper = -1;  // -1: the paper's per-layer formula has no term for the module
  int64_t beyond = 0;
  std::string what;
};

/// The parameters a part holds in one layer (count_parameters in activation_bytes.h).
struct PartParameters {
  int64_t sharded = 0;         // split over the tensor-parallel ranks
  int64_t replicated = 0;      // on every tensor-parallel rank
  int64_t experts = 0;         // routed experts, all of them
  int64_t active_experts = 0;  // of them, the ones a token runs through (top-k)
  double experts_on_rank = 0;  // the routed experts' on one rank (expert x tensor ranks split)
};

/// Megatron's transformer_flops terms of one layer's part (megatron/training/training.py,
/// num_floating_point_operations), forward and backward: per token its GEMMs, per token and
/// position of the sequence (the causal attention core) what grows with the sequence.
struct PartFlops {
  double per_token = 0;
  double per_token_position = 0;
};

/// The memory pre-check's terms of one layer's part (Note [Memory pre-check] in
/// activation_bytes.cpp), in elements unless said: an upper bound of its parameters on one rank,
/// the largest of them, its largest tensor of one micro-batch on one rank, the parameter tensors
/// it registers (the distributed optimizer's padding), and the bytes its backward adds for the
/// duration of one layer's backward beyond the gradient flowing through it.
struct PeakTerms {
  double parameters = 0;
  double largest_parameter = 0;
  double largest_tensor = 0;
  double parameter_tensors = 0;
  double backward_bytes = 0;
};

/// The analytic planner's view of one layer's part (Note [Analytic plan] in plan/plan_analytic.h):
/// what it keeps of one micro-batch on one rank in the paper's 16-bit terms, and its forward as
/// a roofline of GEMM FLOPs and element-wise bytes.
struct AnalyticTensor {
  double bytes = 0;
  /// The selective units any of which drops it (a part names only units it runs).
  std::vector<RecomputeModule> dropped_by;
  /// The fine-grained offload group that moves it while it is kept.
  std::optional<OffloadModule> moved_by;
};
struct AnalyticWork {
  double flops = 0;  // GEMMs, at the device's matmul rate
  double bytes = 0;  // element-wise reads and writes, at its memory bandwidth
  /// The selective units any of which repeats it in the backward.
  std::vector<RecomputeModule> repeated_by;
};
struct AnalyticTerms {
  std::vector<AnalyticTensor> tensors;  // its input (the slot norm's output) first
  std::vector<AnalyticWork> work;
  /// GEMM FLOPs the backward adds beyond twice the forward (the flash kernel's Q K^T again).
  double backward_extra_flops = 0;
};

/// A kind of part and its contract (Note [A layer part owns its contract]). One instance per
/// kind, stateless; layer_spec() hands them out.
class LayerPart {
 public:
  virtual ~LayerPart() = default;
  /// The kind's name in tables and JSON (LayerSpec::name() joins a layer's).
  virtual const char* name() const = 0;
  virtual PartSlot slot() const = 0;
  /// The module for layer `layer_number` (1-based, Megatron's) with its plan.
  virtual std::shared_ptr<PartModule> build(const TransformerConfig& config, const LayerPlan& plan,
                                            int64_t layer_number, at::ScalarType dtype) const = 0;
  /// The model-level rotary tables the kind reads through LayerContext::rope (GPTModel builds
  /// them once and registers them as buffers), or null when it reads none.
  virtual std::unique_ptr<RotaryEmbedding> rotary_tables(const TransformerConfig& config,
                                                         at::ScalarType dtype) const;
  /// Bytes of the state make_decode_state() gives one layer's module for `capacity` positions of
  /// `element_bytes` parameters (generation, one process), without building it; 0 by default.
  virtual int64_t decode_state_bytes(const TransformerConfig& config, int64_t capacity,
                                     int64_t element_bytes) const;

  /// The exact bytes the part saves for the backward under the layer's plan, per module
  /// (SavedBytesContext::add).
  virtual void saved_bytes(const SavedBytesContext& ctx) const = 0;
  /// Korthikanti's term and what is kept beyond it for `module`, a path under the slot
  /// ("linear_qkv"), at `dtype_bytes` without recompute; the paper's own units (-1: none) by
  /// default.
  virtual ModuleTerms module_terms(const std::string& module, const TransformerConfig& config,
                                   int64_t dtype_bytes, bool cpu) const;
  /// Whether Korthikanti et al.'s per-layer formulas (and Megatron's theoretical_memory_usage.py)
  /// describe the part as `config` builds it.
  virtual bool paper_describes(const TransformerConfig& config) const = 0;
  virtual PartParameters parameters(const TransformerConfig& config) const = 0;
  virtual PartFlops megatron_flops(const TransformerConfig& config) const = 0;
  /// `element_bytes`: the activations' and parameters' bytes per element.
  virtual PeakTerms peak_terms(const TransformerConfig& config, double element_bytes) const = 0;
  /// The analytic planner's terms for `m` (whose PaperShape::config the part reads for the sizes
  /// the doubles leave out).
  virtual AnalyticTerms analytic_terms(const PaperShape& m) const = 0;
  /// The fine-grained offload group that moves what module `module` (a path under the slot)
  /// saves, for the analytic planner's exact-predictor terms; none by default.
  virtual std::optional<OffloadModule> offload_group(const std::string& module) const;

  /// `estimate`'s paper path (Korthikanti et al.'s per-layer formulas, memory/memory_model.h): the
  /// layer's bytes without recompute, with Megatron's selective set and with full recompute,
  /// given `layer`, the bytes with this slot as the paper's (estimate composes the MLP's part,
  /// then the mixer's, on paper_layer_bytes()). `layer` itself by default.
  virtual LayerBytes paper_layer_bytes(const PaperShape& m, const LayerBytes& layer) const;
  /// What estimate prints about the part beyond the layers' totals (part_estimate.h); nothing by
  /// default.
  virtual void paper_estimate(const PartEstimateContext& ctx, PartEstimate& out) const;
  /// The selective units estimate's cumulative sets add for the part on a model the paper does
  /// not describe (the exact-predictor path), in the order they are added; none by default.
  virtual std::vector<RecomputeModule> estimate_units(const TransformerConfig& config) const;
  /// The part's sizes in a line of `plan --preset`'s header, for the `layers` layers that have it
  /// ("" when there is nothing to say, the default).
  virtual std::string summary(const TransformerConfig& config, int64_t layers) const;
};

}  // namespace actmem
