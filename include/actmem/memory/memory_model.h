// memory_model.h — activation memory in one place: the paper's formulas (Korthikanti et al. 2022),
// Megatron's theoretical_memory_usage terms, and an exact predictor for this project's model.
//
// The paper and Megatron count 16-bit activations and 1-byte dropout masks; the predictor counts
// what libtorch's ops save for this model at its dtype (read off the activation ledger, see
// docs/memory-model.md), and is checked against the tracker within 3% by the tests.
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
  std::optional<double> vpp;   // virtual pipeline stages per rank (interleaved 1F1B)
  std::optional<double> num_microbatches;
  bool swiglu = false;   // gated MLP: fc1 is 2 x ffn wide (Megatron's 3/2 multiplier)
  bool untied = false;   // separate output layer (untie_embeddings_and_output_weights)
  double d = 1;          // data-parallel size
  bool distributed_optimizer = false;  // optimizer state sharded over the d ranks
  MoEPaperShape moe;    // experts == 0: dense
  MLAPaperShape mla;    // kv_lora == 0: standard attention
  bool rmsnorm = false;  // norms without bias (Megatron's norm_size 1)
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

/// One MoE layer's activation bytes for one micro-batch at 16 bits (fp32 router scores, 8-byte
/// indices), per tensor-parallel rank with sequence parallelism (Megatron requires it for MoE
/// with t > 1; the all-gather dispatcher gives every rank all N rows, each expert's columns split
/// t ways). Megatron's theoretical_memory_usage counts every layer as dense (Megatron-LM's known
/// gap); these are the terms of Note [What an MoE layer saves] in memory_model.cpp, which the
/// exact predictor checks against the tracker:
///   router   (input 2sbh + top-k indices 8sbk + top-k softmax 4sbk + load-balancing scores
///            4sbE + counts 4E + z-loss logits 4sbE + logsumexp 4sb + capacity mask sbE) / t
///   dispatch index vectors 16N, permuted probabilities 2N, permuted tokens 2Nh
///   experts  GeLU 6Nf (fc1 output, GeLU output, fc2 input), SwiGLU 10Nf, over t
///   shared   GeLU 4sb*fs, SwiGLU 8sb*fs, over t
/// with N = sbk dropless, E*min(capacity, sb) padded, at most min(sbk, E*capacity) otherwise
/// (taken as that bound). `layer` is the whole layer: the attention half as the paper's
/// sbh(13 + 5as/h) (13sbh with selective core_attn recompute), the pre-MLP norm 2sbh and the
/// residual dropout mask sbh, all over t; full recompute keeps 2sbh/t.
struct MoELayerBytes {
  double rows = 0;  // N
  double router = 0, dispatch = 0, experts = 0, shared = 0;
  LayerBytes layer;
  double mlp() const { return router + dispatch + experts + shared; }
};
MoELayerBytes paper_moe_layer_bytes(const PaperShape& m);

/// One MLA attention module's activation bytes for one micro-batch at 16 bits (the attention
/// half without its input norm and residual dropout mask: everything under self_attention),
/// the terms of Note [What MLA saves] in memory_model.cpp, which the exact predictor checks
/// against the tracker. Heads are split t ways; the latents are replicated on every
/// tensor-parallel rank (Megatron's duplicated down projections), sequence-sharded with SP.
///   latents  the down projections' input 2sbh, the query latent 2sb*q_lora (with qk_layernorm
///            plus its normed copy 2sb*q_lora and fp32 rstd 4sb), the kv latent with the RoPE key
///            part 2sb*(kv_lora + pos) (with qk_layernorm plus 2sb*kv_lora and 4sb)
///   qkv      q, k, v after the up-projections and RoPE: 2sba*(2(qk + pos) + v)
///   scores   softmax output 2as^2b, dropout mask as^2b, dropped probabilities 2as^2b
///   context  linear_proj's input 2sba*v
/// Selective core_attn drops `scores`; mla_up_proj drops `qkv` (output-discarding).
struct MLAAttentionBytes {
  double latents = 0, qkv = 0, scores = 0, context = 0;
  double none() const { return latents + qkv + scores + context; }
  /// What the module keeps with selective core_attn and/or mla_up_proj recompute.
  double kept(bool core_attn, bool mla_up_proj) const {
    return none() - (core_attn ? scores : 0.0) - (mla_up_proj ? qkv : 0.0);
  }
};
MLAAttentionBytes paper_mla_attention_bytes(const PaperShape& m);

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
  double parameters = 0;             // the whole model
  double active_parameters = 0;      // with top-k of the routed experts per MoE layer
  double parameters_on_rank = 0;     // the most loaded rank (first pipeline stage)
  double expert_parameters_on_rank = 0;  // of which routed experts
  double weight_bytes = 0;           // 2 per parameter on the rank
  double gradient_bytes = 0;         // 4
  double optimizer_bytes = 0;        // 12, or 12/d with the distributed optimizer
  double bytes_per_parameter = 0;    // 18 or 6 + 12/d
  double total() const { return weight_bytes + gradient_bytes + optimizer_bytes; }
};
WeightMemory megatron_weight_and_optimizer_memory(const PaperShape& m);

/// The parameters GPTModel builds for `config`, counted from the configuration alone (no tensor
/// is made): standard attention (--kv-channels, the output gate, q/k norms), GatedDeltaNet
/// layers, dense and MoE MLPs (routed experts, shared experts and their gate), embeddings and
/// norms. Multi-latent attention is not counted (megatron_weight_and_optimizer_memory does).
struct ParameterCount {
  int64_t total = 0;   // the whole model
  int64_t active = 0;  // top-k of the routed experts per MoE layer
  /// One rank of the first pipeline stage: tensor-parallel weights split t ways, routed experts
  /// over expert x tensor ranks, norms, routers and the shared experts' gate replicated.
  double on_rank = 0;
  double experts_on_rank = 0;  // of which routed experts
};
ParameterCount count_parameters(const TransformerConfig& config);

/// Weights, gradients and optimizer state on the first stage's most loaded rank from
/// count_parameters() at Megatron's bytes per parameter (2 + 4 + 12, the optimizer's 12 over the
/// data-parallel size `d` with the distributed optimizer; the routed experts over their own
/// data-parallel size d / EP): what megatron_weight_and_optimizer_memory() computes from the
/// paper's shape, for every model the configuration describes (GatedDeltaNet layers, the output
/// gate, q/k norms, heads wider than h / a). Multi-latent attention is refused as there.
WeightMemory config_weight_and_optimizer_memory(const TransformerConfig& config, double d,
                                                bool distributed_optimizer);

/// Whether Korthikanti et al.'s per-layer formulas (and Megatron's theoretical_memory_usage.py)
/// describe `config`'s layers: standard attention a x d = h wide without the output gate or q/k
/// norms, or multi-latent attention; no GatedDeltaNet layers. For the others estimate and the
/// analytic planner take their terms from the exact predictor.
bool paper_describes(const TransformerConfig& config);

/// Transfer time, in seconds, of `bytes` each way (device->host then host->device) over a link
/// of `gbps` GB/s (10^9 bytes/s) per direction, not overlapped.
double offload_round_trip_seconds(double bytes, double gbps);

/// Korthikanti et al. §4.1's term for one module of a transformer layer (module path ending in
/// input_layernorm, self_attention.linear_qkv, self_attention.core_attention,
/// self_attention.linear_proj, self_attn_bda, pre_mlp_layernorm, mlp.linear_fc1,
/// mlp.activation_func, mlp.linear_fc2, mlp_bda), at `dtype_bytes` per activation element
/// (the paper's 16-bit terms scaled by dtype_bytes / 2; dropout masks stay 1 byte), for the
/// model's sizes without recompute. -1 for modules the paper's per-layer formula has no term for.
double korthikanti_module_bytes(const std::string& module_path, const TransformerConfig& config,
                                int64_t dtype_bytes);

/// What this project's GPTModel keeps for a module beyond korthikanti_module_bytes() at the
/// config's precision, without recompute or offload, and why (docs/memory-model.md): the norms'
/// statistics, RoPE's rotated q and k, SwiGLU's second fc1 half and its SiLU output.
struct ModuleExtra {
  int64_t bytes = 0;
  std::string what;  // "" when nothing
};
ModuleExtra module_bytes_beyond_paper(const std::string& module_path,
                                      const TransformerConfig& config, bool cpu = true);

/// Exact activation bytes this project's GPTModel keeps from the end of a training forward to
/// its backward, per module, for `config` (including its recompute policy) at `dtype_bytes`
/// (2 = bf16/fp16, 4 = fp32, 8 = double; 0 = the config's precision, config.element_bytes()).
/// Derived from what libtorch's ops save (see docs/memory-model.md). At 16 bits the loss is
/// computed in fp32, and the norms' statistics are fp32 except libtorch's CPU LayerNorm, which
/// keeps its mean and rstd in the input's type.
struct PredictedBytes {
  std::vector<std::pair<std::string, int64_t>> by_module;  // module path -> bytes
  int64_t total = 0;
};
/// Bytes of the random-state snapshot each checkpoint in a Trainer keeps (CPU generator state and
/// the three tracker streams, 4 x 5056 bytes on CPU); 0 when snapshots are not on the device.
int64_t checkpoint_snapshot_bytes(bool snapshots_on_device = true);

/// On CUDA the checkpoints' random-state snapshots live in host memory and are not counted;
/// on CPU they are device bytes like everything else. Walks the activation plan the model
/// executes (Note [One plan] in activation_plan.h): for config's own plan, or for `plan`.
///
/// MoE layers (Note [What an MoE layer saves] in memory_model.cpp): every byte depends on the
/// number of rows N the experts compute, not on which expert computes which. Dropless routing
/// computes N = s*b*topk rows and padded capacity E*capacity rows whatever the router decides, so
/// both are exact up front; capacity without padding computes what fits under each expert's
/// capacity, which the router decides: pass its per-layer counts as `routing`
/// (MoEStats::routing(), one entry per MoE layer; the trainer records them). With expert
/// parallelism a rank's experts compute the rows every rank routed to them, which the routing
/// decides even when dropless (padded capacity stays exact up front: each rank sends each expert
/// its capacity), and the rank's own routed rows (what its dispatcher keeps indices of) differ
/// from them: the entry records both. Without the routing where it is needed, throws.
struct MoELayerRouting {
  MoELayerRouting(std::vector<int64_t> rows = {}, int64_t dispatched = -1)  // NOLINT: implicit
      : expert_rows(std::move(rows)), dispatched_rows(dispatched) {}
  /// Rows each of this rank's experts computed (all experts without expert parallelism).
  std::vector<int64_t> expert_rows;
  /// Rows this rank's router sent to the experts (its permuted tokens); -1: the sum of
  /// expert_rows (the same rows without expert parallelism).
  int64_t dispatched_rows = -1;
};
using MoERouting = std::vector<MoELayerRouting>;

/// Routed experts' rows at a balanced routing (each expert k T / E of the T tokens a router sees,
/// from every rank that routes to it, rounded up, at most the capacity bound), one entry per MoE
/// layer, for predict_activation_bytes() on a model that cannot run here; empty for a dense model
/// or padded capacity (whose rows do not depend on the routing).
MoERouting balanced_moe_routing(const TransformerConfig& config);

PredictedBytes predict_activation_bytes(const TransformerConfig& config, int64_t dtype_bytes = 0,
                                        bool snapshots_on_device = true,
                                        const MoERouting* routing = nullptr);
/// With pipeline parallelism, `pipeline_stage`'s bytes per micro-batch: its layers, the
/// embedding on the first stage, the head and loss on the last (what crosses the stage
/// boundaries is the schedule's: Note [Pipeline step] in schedules.cpp). Under the interleaved
/// schedule, model chunk `model_chunk`'s of that stage.
PredictedBytes predict_activation_bytes(const TransformerConfig& config, const ActivationPlan& plan,
                                        int64_t dtype_bytes = 0, bool snapshots_on_device = true,
                                        const MoERouting* routing = nullptr,
                                        int64_t pipeline_stage = 0, int64_t model_chunk = 0);
/// Rows the experts of MoE layer `moe_index` (0-based among the MoE layers) on this rank compute
/// in one micro-batch: the routing's sum when given, else moe_max_expert_rows() where that is
/// exact (dropless without expert parallelism, padded), else nullopt.
std::optional<int64_t> moe_expert_rows(const TransformerConfig& config, size_t moe_index,
                                       const MoERouting* routing = nullptr);
/// The most rows one MoE layer's experts on one rank can compute in one micro-batch: s*b*topk
/// dropless, E*min(capacity, s*b) padded, min(s*b*topk, E*min(capacity, s*b)) with dropping;
/// with expert parallelism e its L = E/e experts see e ranks' tokens: e*s*b*min(topk, L)
/// dropless, L*e*min(capacity, s*b) padded, the smaller of the two with dropping.
int64_t moe_max_expert_rows(const TransformerConfig& config);
/// The most rows one rank's router sends to the experts in one micro-batch (its own tokens):
/// moe_max_expert_rows() without expert parallelism; exact when dropless or padded.
int64_t moe_max_routed_rows(const TransformerConfig& config);

/// An upper bound of the device bytes one training step of `config` holds at its peak:
/// parameters, gradients and AdamW state (at 16 bits: 16-bit parameters and their transient
/// gradients, fp32 main parameters, main grads and moments), the activations of one micro-batch
/// and the transient buffers of its backward (Note [Memory pre-check] in memory_model.cpp). +inf
/// for sizes whose exact count would overflow. dtype_bytes 0 = the config's precision. With
/// pipeline parallelism, `pipeline_stage`'s: its layers' weights (the embedding on the first
/// stage, the output layer on the last) and `microbatches_in_flight` micro-batches of its
/// activations (1F1B: one_f_one_b_in_flight in pipeline.h) with the tensors crossing its
/// boundaries.
/// `optimizer_shards`: d with the distributed optimizer (its AdamW moments and fp32 main
/// parameters take 1/d of their bytes), else 1.
double predict_step_peak_bound(const TransformerConfig& config, int64_t dtype_bytes = 0,
                               int64_t pipeline_stage = 0, int64_t microbatches_in_flight = 1,
                               int64_t optimizer_shards = 1);
/// The same for a stage of v model chunks (the interleaved schedule): per chunk the most
/// micro-batches in flight at once, and the most tensors crossing a stage boundary the stage
/// holds at once beyond them (pipeline_memory in pipeline.h, plus the one being received and
/// the one being produced).
double predict_step_peak_bound(const TransformerConfig& config, int64_t dtype_bytes,
                               int64_t pipeline_stage,
                               const std::vector<int64_t>& in_flight_per_chunk,
                               int64_t boundary_tensors, int64_t optimizer_shards = 1);

}  // namespace actmem
