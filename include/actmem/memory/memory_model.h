// memory_model.h — the paper's formulas (Korthikanti et al. 2022) and Megatron's
// theoretical_memory_usage terms: the 16-bit view of a model described once by its config
// (PaperShape). The exact predictor of this project's model, a sum over its layers' parts, is
// model/activation_bytes.h.
//
// The paper and Megatron count 16-bit activations and 1-byte dropout masks; the predictor counts
// what libtorch's ops save for this model at its dtype (read off the activation ledger, see
// docs/memory-model.md), and the tests check it against the tracker to the byte.
#pragma once

#include "actmem/config/activation_plan.h"
#include "actmem/config/config.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace actmem {

/// The MoE part of a PaperShape (expert parallelism 1): `experts` experts of hidden size `ffn`
/// each, top-k routing, on `layers` of the model's layers; shared experts of `shared_ffn`;
/// capacity_factor 0 = dropless.
struct MoEPaperShape {
  double experts = 0, topk = 2, ffn = 0, shared_ffn = 0, capacity_factor = 0, layers = 0;
  bool pad_to_capacity = false;
  bool aux_loss = true;  // the Switch load-balancing loss is on (a coefficient > 0)
  bool z_loss = false;
  bool shared_gate = false;  // the shared experts' sigmoid gate (h weights)
  double ep = 1, etp = 0;    // expert-parallel size and expert tensor size (0 = t)
};

/// Multi-latent attention's sizes (docs/mla.md); kv_lora 0 = standard attention.
struct MLAPaperShape {
  double q_lora = 0;  // 0: no query compression (linear_q_proj)
  double kv_lora = 0, qk = 128, pos = 64, v = 128;
  bool qk_layernorm = false;  // RMSNorm on the latents (fp32 rstd)
};

/// Sizes of a (possibly very large) model for the analytic formulas. Doubles: no overflow.
struct PaperShape {
  double s = 0, b = 0, h = 0, a = 0, L = 0, ffn = 0, v = 0;
  double g = 0;  // key/value groups of grouped-query attention; 0 = a (one per head)
  double t = 1;  // tensor-parallel size
  double p = 1;  // pipeline-parallel size
  bool sp = false;
  std::optional<double> vpp;  // virtual pipeline stages per rank (interleaved 1F1B)
  std::optional<double> num_microbatches;
  bool swiglu = false;  // gated MLP: fc1 is 2 x ffn wide (Megatron's 3/2 multiplier)
  bool untied = false;  // separate output layer (untie_embeddings_and_output_weights)
  double d = 1;         // data-parallel size
  bool distributed_optimizer = false;  // optimizer state sharded over the d ranks
  MoEPaperShape moe;                   // experts == 0: dense
  MLAPaperShape mla;                   // kv_lora == 0: standard attention
  bool rmsnorm = false;                // norms without bias (Megatron's norm_size 1)
  /// The flash attention kernel: no s^2 term; its logsumexp, 4asb bytes (fp32), instead.
  bool flash = false;
  /// The configuration paper_shape() read this from: what the doubles leave out (which layers
  /// are MoE, the MoE and MLA switches), for the analytic planner's strategies and layer terms.
  /// Null for a shape written by hand (a dense one describes itself).
  std::shared_ptr<const TransformerConfig> config;
  double sbh() const { return s * b * h; }
  bool is_mla() const { return mla.kv_lora > 0; }
  double layers_per_stage() const { return L / p; }
  bool is_moe() const { return moe.experts > 0; }
};

/// The paper's view of a model (Note [One model description] in memory_model.cpp): its sizes,
/// layout, MoE and MLA read off the config, in doubles. What the config does not say is left at
/// its default for the caller to set: d = 1, no distributed optimizer, the number of
/// micro-batches unset, the expert tensor size t. The presets (actmem estimate --preset) are
/// command lines in flags/presets.h, described through this.
PaperShape paper_shape(const TransformerConfig& config);

/// Activation bytes of one transformer layer for one micro-batch (Korthikanti Table 2, 16-bit):
/// none: sbh(34 + 5as/h) (eq. 1), or with t > 1 sbh(10 + 24/t + 5as/(ht)) (eq. 2) and with SP
/// sbh(34 + 5as/h)/t (eq. 4); selective: Megatron's generalisation sbh(18 + 4 ffn/h), divided by
/// t with SP, else sbh(10 + 24/t) for ffn = 4h ... generalised as (10 + (8 + 4 ffn/h)/t);
/// full: 2sbh, divided by t with SP (the kept input is sequence-sharded). With the flash kernel
/// the s^2 term 5as/h becomes the logsumexp's 4a/h (docs/memory-model.md, "Attention backends").
struct LayerBytes {
  double none = 0, selective = 0, full = 0;
  double s2_fraction = 0;  // share of the s^2 term (flash: the logsumexp) in `none`
};
LayerBytes paper_layer_bytes(const PaperShape& m);

/// The paper's s^2 term 5as/h in units of sbh; with the flash kernel its logsumexp [b, a, s] in
/// fp32, 4a/h, instead (docs/memory-model.md, "Attention backends").
double paper_squared_term(const PaperShape& m);

/// Megatron's megatron/training/theoretical_memory_usage.py activation terms:
/// compute_activation_memory (SP + selective) and compute_activation_memory_without_sp, for the
/// first pipeline stage, including input ids, the embedding dropout mask, logits and the
/// interleaving / in-flight factors.
double megatron_activation_memory(const PaperShape& m);
double megatron_activation_memory_without_sp(const PaperShape& m);

/// Megatron's compute_weight_and_optimizer_memory (megatron/training/theoretical_memory_usage.py)
/// for mixed-precision training: parameters counted as Megatron counts them — attention (4h^2,
/// or MLA's projections and latent norms), the dense MLP with the gated multiplier, MoE layers'
/// router, routed experts and shared experts (and its gate), the layer norms (weight and bias, or
/// RMSNorm's weight), the embedding; other biases ignored. The most loaded rank holds 1/p of the
/// layers plus the embedding (and an untied output layer when p = 1): attention, dense MLPs,
/// shared experts and the embedding split t ways, norms and routers replicated, routed experts
/// split etp x e ways. 18 bytes per parameter (2 bf16 weight + 4 fp32 grad + 4 fp32 main
/// parameter + 8 Adam moments), or 6 + 12/d with the distributed optimizer, d being the expert
/// data-parallel size world / (etp e p) for the routed experts.
struct WeightMemory {
  double parameters = 0;                 // the whole model
  double active_parameters = 0;          // with top-k of the routed experts per MoE layer
  double parameters_on_rank = 0;         // the most loaded rank (first pipeline stage)
  double expert_parameters_on_rank = 0;  // of which routed experts
  double weight_bytes = 0;               // 2 per parameter on the rank
  double gradient_bytes = 0;             // 4
  double optimizer_bytes = 0;            // 12, or 12/d with the distributed optimizer
  double bytes_per_parameter = 0;        // 18 or 6 + 12/d
  double total() const { return weight_bytes + gradient_bytes + optimizer_bytes; }
};
WeightMemory megatron_weight_and_optimizer_memory(const PaperShape& m);

/// Transfer time, in seconds, of `bytes` each way (device->host then host->device) over a link
/// of `gbps` GB/s (10^9 bytes/s) per direction, not overlapped.
double offload_round_trip_seconds(double bytes, double gbps);

}  // namespace actmem
