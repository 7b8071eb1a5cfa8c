// config.h — TransformerConfig (the model's shape, regularisation and activation flags) and
// TrainingConfig (optimisation, data, runtime), with Megatron's field names.
//
// validate() rejects every inconsistent value with a TORCH_CHECK naming the field and what was
// expected.
#pragma once

#include "actmem/config/batch_schedule.h"

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace actmem {

/// The largest seed accepted: the named RNG streams add offsets to it (rng.h), which must not
/// wrap around.
constexpr uint64_t kMaxSeed = uint64_t{1} << 62;

/// The core-attention kernels (config.attention_kernel()): the unfused path (scores, mask,
/// softmax, dropout and the product with V as separate ops, every [b, a, s, s] tensor kept) or
/// the flash kernel (online softmax; keeps its inputs, output and the row logsumexp only).
enum class AttentionKernel { kUnfused, kFlash };
/// "unfused" or "flash".
const char* to_string(AttentionKernel kernel);

/// Shape and numerics of a GPT model, named as in Megatron-LM's TransformerConfig.
struct TransformerConfig {
  int64_t num_layers = 2;
  int64_t hidden_size = 128;
  int64_t num_attention_heads = 4;
  /// Grouped-query attention (Megatron's --group-query-attention --num-query-groups G): the keys
  /// and values have G heads, each shared by num_attention_heads / G query heads. 0 means one
  /// group per head (multi-head attention; Megatron's None).
  int64_t num_query_groups = 0;
  /// Megatron's --kv-channels: each attention head's width d. Unset = hidden_size /
  /// num_attention_heads (Megatron's default); set, the query projection is a * d wide whatever
  /// h is (Qwen3-Next: h 2048, 16 heads of 256). kv_channels() resolves it.
  std::optional<int64_t> kv_channels_arg;
  /// 0 means 4 * hidden_size (Megatron's default).
  int64_t ffn_hidden_size = 0;
  int64_t seq_length = 128;
  /// 0 means seq_length.
  int64_t max_position_embeddings = 0;
  int64_t micro_batch_size = 8;
  /// Byte-level tokenizer: 256 symbols.
  int64_t vocab_size = 256;

  double attention_dropout = 0.1;
  double hidden_dropout = 0.1;
  /// Megatron's --attention-backend (AttnBackend in megatron/core/transformer/enums.py): "auto"
  /// (its default), "flash", "fused", "unfused" or "local"; attention_kernel() says which kernel
  /// runs (Note [Attention backends] in config.cpp).
  std::string attention_backend = "auto";

  /// "LayerNorm" or "RMSNorm".
  std::string normalization = "LayerNorm";
  double layernorm_epsilon = 1e-5;
  /// Megatron's --apply-layernorm-1p: every norm multiplies by (1 + weight), its weight starting
  /// at zero (zero-centred gamma; Qwen3-Next's norms).
  bool layernorm_zero_centered_gamma = false;
  /// SwiGLU when true (fc1 produces 2 * ffn_hidden_size, activation silu(x1) * x2); GeLU otherwise.
  bool gated_linear_unit = false;
  bool add_bias_linear = true;
  /// "learned_absolute", "rope" or "none" (no position information but the causal mask).
  std::string position_embedding_type = "learned_absolute";
  double rotary_base = 10000.0;
  /// Megatron's --rotary-percent: RoPE rotates the first int(d * rotary_percent) features of
  /// each head and passes the rest through (partial RoPE; Qwen3-Next rotates a quarter).
  double rotary_percent = 1.0;
  bool untie_embeddings_and_output_weights = false;
  double init_method_std = 0.02;
  /// In [1, kMaxSeed] (Megatron requires seed > 0).
  uint64_t seed = 1234;

  // ---- precision (docs/mixed-precision.md) ----
  /// Parameters and activations in bfloat16 / float16 (Megatron's --bf16 / --fp16; at most one).
  /// The optimizer keeps fp32 main parameters; the loss is computed in fp32.
  bool bf16 = false;
  bool fp16 = false;
  /// Attention softmax computed in fp32 from 16-bit scores (its output is still kept in 16 bits,
  /// as Megatron's fused scale-mask-softmax kernel does).
  bool attention_softmax_in_fp32 = false;

  // ---- FP8 / FP4 training (docs/fp8.md), Megatron's TransformerConfig names and defaults ----
  /// --fp8-format: "e4m3" (every FP8 tensor E4M3) or "hybrid" (E4M3 forward, E5M2 for the
  /// output gradients); empty: no FP8. Every GEMM of the transformer layers quantizes its input
  /// and weight and keeps the quantized input for the backward, as Transformer Engine does.
  std::string fp8;
  /// --fp8-recipe: "delayed" (Megatron's default: scales from an amax history, updated after
  /// each forward and backward), "tensorwise" (current per-tensor scaling), "mxfp8",
  /// "blockwise".
  std::string fp8_recipe = "delayed";
  /// Delayed scaling: scale = (fp8_max / amax) / 2^margin, amax the history's most recent entry
  /// or its maximum over fp8_amax_history_len forwards.
  int64_t fp8_margin = 0;
  int64_t fp8_amax_history_len = 1;
  std::string fp8_amax_compute_algo = "most_recent";
  /// --no-fp8-wgrad: the weight gradient's GEMM in 16 bits from the 16-bit input (which the
  /// layer then keeps instead of the quantized one).
  bool fp8_wgrad = true;
  /// --first-last-layers-bf16: the first num_layers_at_start_in_bf16 and the last
  /// num_layers_at_end_in_bf16 layers run in 16 bits (not with delayed scaling).
  bool first_last_layers_bf16 = false;
  int64_t num_layers_at_start_in_bf16 = 1;
  int64_t num_layers_at_end_in_bf16 = 1;
  /// --fp4-format "e2m1" with --fp4-recipe "nvfp4"; empty: no FP4. Exclusive with fp8.
  /// (--fp8-param-gather and --fp4-param-gather, FP8/FP4 parameters, are refused: flags/.)
  std::string fp4;
  std::string fp4_recipe = "nvfp4";
  /// Whether layer `layer` (0-based, over the whole model) runs its GEMMs in FP8/FP4: quantized
  /// training is on and the layer is not one of the first/last kept in 16 bits (Megatron's
  /// is_first_last_bf16_layer in megatron/core/fp8_utils.py).
  bool quantized_layer(int64_t layer) const;
  /// Megatron's FP8/FP4 rules (TransformerConfig.__post_init__, validate_args) and what actmem
  /// runs of them (quantization.cpp); validate_shape() calls it.
  void validate_quantization() const;

  // ---- parallelism (docs/parallelism.md) ----
  int64_t tensor_model_parallel_size = 1;
  /// Pipeline stages p: the layers split across p ranks, run by the 1F1B schedule (pipeline.h).
  int64_t pipeline_model_parallel_size = 1;
  /// Uneven pipeline splits (Megatron's --decoder-first/last-pipeline-num-layers): the first or
  /// last stage's layer count; the other stages share the rest evenly.
  std::optional<int64_t> decoder_first_pipeline_num_layers;
  std::optional<int64_t> decoder_last_pipeline_num_layers;
  /// The interleaved 1F1B schedule (Megatron's virtual pipeline stages): each rank holds
  /// v = num_layers / p / num_layers_per_virtual_pipeline_stage model chunks (or v given
  /// directly); at most one of the two. Unset or v = 1: plain 1F1B.
  std::optional<int64_t> num_layers_per_virtual_pipeline_stage;
  std::optional<int64_t> num_virtual_stages_per_pipeline_rank;
  /// Micro-batches a virtual stage runs before the next chunk takes over (Megatron's
  /// microbatch_group_size_per_vp_stage; unset = p).
  std::optional<int64_t> microbatch_group_size_per_vp_stage;
  bool sequence_parallel = false;

  // ---- mixture of experts (docs/moe.md), Megatron's names ----
  /// Experts per MoE layer (--num-experts); 0 = a dense model (Megatron maps 0 to None).
  int64_t num_moe_experts = 0;
  /// Experts each token is routed to.
  int64_t moe_router_topk = 2;
  /// Each expert's hidden size; unset means ffn_hidden_size (Megatron's warning default).
  std::optional<int64_t> moe_ffn_hidden_size;
  /// Which layers are MoE (--moe-layer-freq): "N" makes layer i MoE when i % N == 0; a pattern
  /// of 0/1 per layer as Megatron spells it, "[1,0,1,0]" or "([1]*3+[0])*2". See moe_layers().
  std::string moe_layer_freq = "1";
  /// "aux_loss" (Switch load balancing) or "none".
  std::string moe_router_load_balancing_type = "aux_loss";
  double moe_aux_loss_coeff = 0.0;
  /// z-loss on the router logits (off when unset).
  std::optional<double> moe_z_loss_coeff;
  /// "softmax" or "sigmoid".
  std::string moe_router_score_function = "softmax";
  /// softmax over all experts before the top-k (default: top-k logits, then softmax over them).
  bool moe_router_pre_softmax = false;
  /// --moe-router-dtype: "fp32" or "fp64" runs the router's gating linear, scores and
  /// load-balancing losses in that type (Megatron's router_gating_linear); empty: the model's.
  std::string moe_router_dtype;
  std::optional<double> moe_router_topk_scaling_factor;
  /// Shared experts' total hidden size (num_shared_experts x each one's ffn); unset = none.
  std::optional<int64_t> moe_shared_expert_intermediate_size;
  /// Shared-expert output scaled by sigmoid(x . gate_weight) (gate_weight [1, h]).
  bool moe_shared_expert_gate = false;
  /// Token dropping: each expert takes at most ceil(tokens * topk / experts * factor) tokens.
  /// Unset = dropless (Megatron maps a negative factor to None).
  std::optional<double> moe_expert_capacity_factor;
  /// With a capacity factor: every expert gets exactly `capacity` rows (unrouted tokens with
  /// probability 0 fill the gaps).
  bool moe_pad_expert_input_to_capacity = false;
  /// Which tokens an over-full expert keeps: "probs" (the highest probabilities) or "position"
  /// (the earliest tokens).
  std::string moe_token_drop_policy = "probs";
  /// Experts as one grouped product over the permuted tokens (Megatron's TEGroupedMLP) instead of
  /// one MLP per expert (SequentialMLP); moe_act recompute and the expert offload groups need it.
  bool moe_grouped_gemm = false;
  /// "allgather" or "alltoall" (identical without expert parallelism).
  std::string moe_token_dispatcher_type = "allgather";
  int64_t expert_model_parallel_size = 1;
  /// Deprecated alias of --recompute-granularity selective --recompute-modules moe.
  bool moe_layer_recompute = false;
  /// actmem's extension (Megatron has no dropout inside experts): dropout on the experts'
  /// activation, drawn from the expert-parallel random stream. 0 = Megatron's behaviour.
  double moe_expert_dropout = 0.0;

  // ---- multi-latent attention (docs/mla.md), Megatron's names and CLI defaults ----
  /// Attention as Megatron's MLASelfAttention: queries and keys/values projected down to low-rank
  /// latents, normed, projected up per head; a decoupled RoPE part of qk_pos_emb_head_dim.
  bool multi_latent_attention = false;
  /// The query's latent rank; unset = no query compression (one linear_q_proj from h).
  std::optional<int64_t> q_lora_rank;
  int64_t kv_lora_rank = 32;
  /// Per head: the query/key part without position (qk_head_dim), the RoPE part shared by all
  /// heads of a key (qk_pos_emb_head_dim), and the value (v_head_dim).
  int64_t qk_head_dim = 128;
  int64_t qk_pos_emb_head_dim = 64;
  int64_t v_head_dim = 128;
  /// Megatron's --qk-layernorm, norms of --normalization's type: with multi-latent attention on
  /// the query and key/value latents (q_layernorm over q_lora_rank when set, kv_layernorm over
  /// kv_lora_rank); with standard attention on each query and key head (q_layernorm and
  /// k_layernorm over d, before RoPE; Qwen3's).
  bool qk_layernorm = false;
  /// Megatron's --attention-output-gate (Qwen3-Next's gated attention): linear_qkv also
  /// produces a gate per query head, and the core attention's output is multiplied by
  /// sigmoid(gate) before linear_proj.
  bool attention_output_gate = false;
  /// "rope" or "yarn"; empty = Megatron's default (yarn for MLA, rope otherwise).
  std::string rope_type;
  /// YaRN's context-extension factor and its attention-scale terms (mscale, mscale_all_dim).
  double rotary_scaling_factor = 1.0;
  double mscale = 1.0;
  double mscale_all_dim = 0.0;

  // ---- Gated DeltaNet hybrid models (docs/gdn.md), Megatron's names and defaults ----
  /// Megatron's --experimental-attention-variant: "" (none) or "gdn" (its deprecated spelling
  /// "gated_delta_net" is accepted and means the same): the layers linear_attention_freq marks
  /// run GatedDeltaNet (linear attention by the gated delta rule) instead of self-attention.
  std::string experimental_attention_variant;
  /// Which layers are GatedDeltaNet (--linear-attention-freq): "N" makes every N-th layer
  /// (i + 1 divisible by N) standard attention and the rest GDN; or a 0/1 pattern per layer
  /// (1 = GDN), "[1,1,1,0]" or "([1]*3+[0])*2". Required with the gdn variant.
  std::string linear_attention_freq;
  /// The causal depthwise convolution's kernel over q, k and v.
  int64_t linear_conv_kernel_dim = 4;
  /// Query/key and value/gate head dims, and the head counts (value heads a multiple of key
  /// heads: each key head serves num_value_heads / num_key_heads value heads).
  int64_t linear_key_head_dim = 128;
  int64_t linear_value_head_dim = 128;
  int64_t linear_num_key_heads = 16;
  int64_t linear_num_value_heads = 32;

  // ---- activation recompute (Megatron's fields; see docs/recompute.md) ----
  /// "" (none), "full" or "selective".
  std::string recompute_granularity;
  /// "" (none), "uniform" or "block"; full recompute only.
  std::string recompute_method;
  /// uniform: layers per checkpointed chunk; block: how many of the first layers are
  /// checkpointed. Required for full, must be unset for selective.
  std::optional<int64_t> recompute_num_layers;
  /// Keep each full-recompute checkpoint input as a 1/t shard per tensor-parallel rank.
  bool distribute_saved_activations = false;
  /// Selective targets by Megatron's names (kRecomputeModuleNames in activation_plan.h). Unset
  /// means Megatron's default, core_attn.
  std::optional<std::vector<std::string>> recompute_modules;

  // ---- CPU offload (docs/offload.md) ----
  /// Layer-level offload (Megatron's cpu_offloading_num_layers): the saved activations of the
  /// first K layers go to host memory after their forward and come back ahead of their backward.
  /// 0 = off; needs K < num_layers and no recompute.
  int64_t cpu_offloading_num_layers = 0;
  /// Saved tensors whose storage has fewer elements stay on the device (Megatron compares each
  /// tensor; offload here moves whole storages, see docs/offload.md; default 1024 * 1024).
  int64_t min_offloaded_tensor_size = 1024 * 1024;
  /// Fine-grained (module-level) offload, as Megatron's fine_grained_activation_offload.py: the
  /// groups named in offload_modules (kOffloadModuleNames in activation_plan.h) offload what
  /// they save.
  bool fine_grained_activation_offloading = false;
  std::vector<std::string> offload_modules;
  /// Groups of one name whose copies may be in flight before compute waits (-1 = no cap).
  int64_t fine_grained_offloading_max_inflight_offloads = -1;

  /// ffn_hidden_size with the 0 default resolved.
  int64_t ffn() const { return ffn_hidden_size > 0 ? ffn_hidden_size : 4 * hidden_size; }
  /// max_position_embeddings with the 0 default resolved.
  int64_t max_positions() const {
    return max_position_embeddings > 0 ? max_position_embeddings : seq_length;
  }
  int64_t kv_channels() const {
    return kv_channels_arg.value_or(hidden_size / num_attention_heads);
  }
  /// The query projection's width a * d (linear_proj's input); h unless --kv-channels says else.
  int64_t query_projection_size() const { return num_attention_heads * kv_channels(); }
  /// The features RoPE rotates per head (Megatron's RotaryEmbedding: int(d * rotary_percent)).
  int64_t rotary_dim() const;
  /// num_query_groups with the default (one group per head) resolved.
  int64_t query_groups() const {
    return num_query_groups > 0 ? num_query_groups : num_attention_heads;
  }
  /// Grouped-query attention proper: fewer key/value heads than query heads.
  bool grouped_query_attention() const { return query_groups() < num_attention_heads; }
  /// Whether the model has MoE layers at all.
  bool is_moe() const { return num_moe_experts > 0; }
  /// moe_ffn_hidden_size with its default (ffn()) resolved.
  int64_t moe_ffn() const { return moe_ffn_hidden_size.value_or(ffn()); }
  /// Per layer, whether it is an MoE layer (all false for a dense model); throws for a malformed
  /// moe_layer_freq.
  std::vector<bool> moe_layers() const;
  /// The GatedDeltaNet variant is on (experimental_attention_variant gdn or gated_delta_net).
  bool gated_delta_net() const {
    return experimental_attention_variant == "gdn" ||
           experimental_attention_variant == "gated_delta_net";
  }
  /// Per layer, whether it is a GatedDeltaNet layer (all false without the variant); throws for
  /// a malformed linear_attention_freq (Megatron's get_linear_attention_pattern).
  std::vector<bool> gdn_layers() const;
  /// The transformer layers of pipeline stage `stage` (0-based): the first layer's index and the
  /// count (Megatron's get_transformer_layer_offset and get_num_layers_to_build).
  struct StageLayers {
    int64_t offset = 0;
    int64_t count = 0;
    bool contains(int64_t layer) const { return layer >= offset && layer < offset + count; }
  };
  StageLayers pipeline_stage_layers(int64_t stage) const;
  /// Model chunks per pipeline rank: v under the interleaved schedule, else 1.
  int64_t virtual_pipeline_size() const;
  /// The layers of model chunk `chunk` on pipeline rank `stage`: without interleaving the stage's
  /// (chunk 0); with v chunks of n = num_layers / (p v) layers each, chunk c of rank r holds
  /// layers c (num_layers / v) + r n onwards (Megatron's get_transformer_layer_offset with a
  /// vp_stage): the model is cut into p v pieces dealt round-robin to the ranks.
  StageLayers model_chunk_layers(int64_t stage, int64_t chunk) const;
  /// The micro-batch group of the interleaved schedule: microbatch_group_size_per_vp_stage or p.
  int64_t microbatch_group_size() const;

  /// Learned absolute positions are not used (the model-level RoPE tables are built only
  /// without MLA, whose attention applies its own decoupled RoPE, as Megatron's GPTModel).
  bool use_rope() const { return position_embedding_type == "rope"; }
  /// A learned absolute position embedding (not with rope or none).
  bool learned_positions() const { return position_embedding_type == "learned_absolute"; }
  /// RoPE tables at the model level rotating every head's q and k (standard attention only).
  bool model_rope() const { return use_rope() && !multi_latent_attention; }
  /// MLA's per-head query/key width, qk_head_dim + qk_pos_emb_head_dim.
  int64_t mla_q_head_dim() const { return qk_head_dim + qk_pos_emb_head_dim; }
  /// rope_type with Megatron's default resolved: "yarn" with MLA, "rope" otherwise.
  std::string resolved_rope_type() const {
    return !rope_type.empty() ? rope_type : multi_latent_attention ? "yarn" : "rope";
  }
  bool use_rmsnorm() const { return normalization == "RMSNorm"; }
  /// The core-attention kernel attention_backend selects, with auto resolved, and why (throws
  /// for a backend this configuration cannot run; Note [Attention backends] in config.cpp).
  struct AttentionChoice {
    AttentionKernel kernel = AttentionKernel::kUnfused;
    std::string why;  // "auto: flash (no attention dropout)", "requested", ...
  };
  AttentionChoice attention_choice() const;
  AttentionKernel attention_kernel() const { return attention_choice().kernel; }
  bool flash_attention() const { return attention_kernel() == AttentionKernel::kFlash; }
  /// "flash (auto: flash, since the attention dropout is 0)": the kernel and why, as the
  /// headers of train, inspect and estimate print it.
  std::string attention_summary() const;
  /// "fp32", "bf16" or "fp16".
  const char* precision() const { return bf16 ? "bf16" : fp16 ? "fp16" : "fp32"; }
  /// Bytes of one parameter or activation element: 2 with --bf16 / --fp16, else 4.
  int64_t element_bytes() const { return bf16 || fp16 ? 2 : 4; }

  /// Throws c10::Error ("actmem::TransformerConfig: ...") for the first inconsistent field:
  /// validate_shape(), then the recompute and offload rules (make_activation_plan(), which
  /// resolves those flags into the typed plan the model executes).
  void validate() const;
  /// The shape, numerics and parallel-layout rules alone.
  void validate_shape() const;
};

/// Megatron's get_capacity (megatron/core/transformer/moe/moe_utils.py): the tokens one expert
/// takes under a capacity factor, ceil(tokens * topk / experts * factor).
int64_t moe_expert_capacity(int64_t tokens, int64_t topk, int64_t experts, double factor);

/// Every field, with the defaults resolved (ffn_hidden_size, max_position_embeddings,
/// recompute_modules), under Megatron's names.
nlohmann::json to_json(const TransformerConfig& config);
/// The FP8/FP4 settings as JSON (to_json adds them under "quantization" when FP8 or FP4 is on).
nlohmann::json quantization_json(const TransformerConfig& config);
/// Reads the FP8/FP4 settings from a checkpoint's flat args (Megatron's names: fp8, fp8_recipe,
/// ...), leaving the fields a key is absent for.
void quantization_from_json(const nlohmann::json& args, TransformerConfig& config);

/// The emulated host link's range (GB/s per direction) when it is capped: below the minimum a
/// copy of a few MiB takes minutes; above the maximum the cap cannot be told from none.
constexpr double kMinOffloadBandwidthGbps = 0.01;
constexpr double kMaxOffloadBandwidthGbps = 1e5;

/// Optimisation, data and runtime settings of training (Megatron's names where it has them).
struct TrainingConfig {
  /// 0 means micro_batch_size (one micro-batch per step).
  int64_t global_batch_size = 0;
  /// Megatron's --step-batch-size-schedule: the global batch by tokens consumed, as its text
  /// ("0:256 250B:512"; batch_schedule.h). Empty: global_batch_size throughout. Excludes
  /// global_batch_size (Megatron's validate_args), which global_batch() then reads as one
  /// micro-batch per data-parallel rank, as Megatron's args.global_batch_size does (validation).
  std::string step_batch_size_schedule;
  /// The run's optimizer steps (--train-iters); with train_samples set, derived from it:
  /// train_samples / global batch (Megatron's update_train_iters; resolve_train_iters).
  int64_t train_iters = 200;
  /// Megatron's --train-samples: the run's length in samples; the learning-rate schedule then
  /// counts samples (lr_warmup_samples, lr_decay_samples) instead of iterations.
  std::optional<int64_t> train_samples;
  double lr = 3e-3;
  /// Megatron's defaults: min_lr 0, no warmup, linear decay (arguments.py).
  double min_lr = 0.0;
  int64_t lr_warmup_iters = 0;
  /// --lr-warmup-samples (sample-based runs) and --lr-warmup-fraction (of the decay steps, either
  /// kind of run); --lr-warmup-init: where the warmup starts.
  int64_t lr_warmup_samples = 0;
  std::optional<double> lr_warmup_fraction;
  double lr_warmup_init = 0.0;
  /// --lr-decay-iters / --lr-decay-samples: where the decay reaches min_lr (default: the run's
  /// end), after which the rate stays at min_lr.
  std::optional<int64_t> lr_decay_iters;
  std::optional<int64_t> lr_decay_samples;
  /// "constant", "linear" or "cosine" (from lr after warmup down to min_lr).
  std::string lr_decay_style = "linear";
  /// Megatron's --decoupled-lr / --decoupled-min-lr: the input embedding's and output layer's
  /// parameters follow the same schedule from these rates instead (unset: lr / min_lr).
  std::optional<double> decoupled_lr;
  std::optional<double> decoupled_min_lr;
  /// Megatron's --calculate-per-token-loss: gradients of the loss summed over the step's tokens
  /// and divided by their count across micro-batches and data-parallel ranks (instead of the
  /// mean of each micro-batch's token mean).
  bool calculate_per_token_loss = false;
  /// --log-throughput: the log line adds Megatron's model TFLOP/s per rank.
  bool log_throughput = false;
  double weight_decay = 0.01;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;  // Megatron's default
  double adam_eps = 1e-8;
  /// Global gradient-norm clip; 0 disables.
  double clip_grad = 1.0;

  // ---- mixed precision (docs/mixed-precision.md), Megatron's names ----
  /// Gradients accumulated across micro-batches (and reduced) in fp32 main-grad buffers. Unset
  /// means Megatron's default: on with --bf16 (forced), off with --fp16.
  std::optional<bool> accumulate_allreduce_grads_in_fp32;
  /// Megatron's --grad-reduce-in-bf16: with bf16, the main-grad buffers (gradient accumulation
  /// and the data-parallel reduction) in bf16 instead of fp32.
  bool grad_reduce_in_bf16 = false;
  /// Constant loss scale (--loss-scale); unset means dynamic scaling with --fp16, none with bf16.
  std::optional<double> loss_scale;
  /// Dynamic loss scaling (--fp16 without --loss-scale): Megatron's DynamicGradScaler.
  double initial_loss_scale = 4294967296.0;  // 2^32
  double min_loss_scale = 1.0;
  int64_t loss_scale_window = 1000;
  int64_t hysteresis = 2;
  /// Validation every eval_interval iterations over eval_iters fixed micro-batches; 0 disables.
  int64_t eval_interval = 50;
  int64_t eval_iters = 4;
  int64_t log_interval = 20;
  /// Text file to train on; empty means the built-in corpus (or data_paths).
  std::string data_path;
  /// Megatron's --data-path: indexed-dataset prefixes, or weight-prefix pairs (a blend).
  std::vector<std::string> data_paths;
  /// Where the dataset indices are cached (--data-cache-path); empty:
  /// PREFIX/cache/GPTDataset_indices.
  std::string data_cache_path;
  /// The tokenizer the data was made with (tokenizer.h); empty: bytes, vocabulary --vocab-size.
  /// With one, the model's vocabulary is the tokenizer's padded to a multiple of
  /// make_vocab_size_divisible_by x tensor-parallel size (TrainOptions::finalize).
  std::string tokenizer_type;
  std::string tokenizer_model;
  /// GPT2BPETokenizer's files (--vocab-file vocab.json, --merge-file merges.txt).
  std::string vocab_file;
  std::string merge_file;
  /// TikTokenizer's --tiktoken-pattern (empty: v2), --tiktoken-num-special-tokens and
  /// --tokenizer-special-tokens (empty: Megatron's seven); Megatron reads them for no other type.
  std::string tiktoken_pattern;
  int64_t tiktoken_num_special_tokens = 1000;
  std::vector<std::string> special_tokens;
  int64_t make_vocab_size_divisible_by = 128;
  /// The tokenizer's vocabulary before padding and its end-of-document id (set with
  /// tokenizer_type by TrainOptions::finalize; 0 and -1 without a tokenizer).
  int64_t tokenizer_vocab_size = 0;
  int64_t eod_id = -1;
  /// Megatron's --mock-data: MockGPTDataset's generated documents (gpt_dataset.h) instead of
  /// files; needs a tokenizer (its vocabulary and end-of-document id shape the documents).
  bool mock_data = false;
  /// Train, validation and test weights (--split). Megatron's default when --data-path is given
  /// (arguments.py, legacy_default_split_value); the built-in corpus and --data use it too.
  std::string split = "969,30,1";
  // ---- checkpoints (docs/checkpoints.md), Megatron's names ----
  /// Directory to save checkpoints in (--save); empty means none.
  std::string save;
  /// Save every save_interval iterations (--save-interval); 0 saves only at the end of the run
  /// and when an exit signal arrives.
  int64_t save_interval = 0;
  /// Directory to resume from (--load): its latest checkpoint.
  std::string load;
  bool no_load_optim = false;
  bool no_load_rng = false;
  bool finetune = false;
  bool override_opt_param_scheduler = false;
  /// Catch SIGTERM/SIGINT, save (with --save) after the current step and exit
  /// (--exit-signal-handler).
  bool exit_signal_handler = false;
  /// Megatron's --exit-interval N: save (with --save) and exit after iteration N, 2N, ... (the
  /// first multiple reached); --exit-duration-in-mins M: save and exit after the first iteration
  /// that ends M minutes after the program started (every rank agreeing).
  std::optional<int64_t> exit_interval;
  std::optional<double> exit_duration_in_mins;
  /// "cpu" or "cuda[:i]".
  std::string device = "cpu";
  /// Device-memory limit in bytes (CPU tracker only); 0 means the machine's physical memory.
  int64_t device_memory_limit = 0;
  /// Emulated host-link bandwidth for offload copies, GB/s per direction; 0 = uncapped,
  /// otherwise in [kMinOffloadBandwidthGbps, kMaxOffloadBandwidthGbps].
  double offload_bandwidth_gbps = 0.0;
  /// Megatron's --overlap-grad-reduce: the data-parallel gradient all-reduce in buckets that start
  /// during the last micro-batch's backward (grad_reducer.h).
  bool overlap_grad_reduce = false;
  /// Megatron's --ddp-bucket-size: elements per bucket; unset: max(40M, 1M x d).
  std::optional<int64_t> ddp_bucket_size;
  /// Megatron's --use-distributed-optimizer: the optimizer state sharded over the data-parallel
  /// ranks (distributed_optimizer.h).
  bool use_distributed_optimizer = false;
  /// Megatron's --num-microbatches-with-partial-activation-checkpoints N (pipeline schedules,
  /// full block recompute): in each window of W = warmup + 1 forwards of a stage the first N
  /// checkpoint the block method's first recompute_num_layers layers, the others every layer
  /// (Note [Partial activation checkpoints] in schedules.cpp).
  std::optional<int64_t> num_microbatches_with_partial_activation_checkpoints;

  /// accumulate_allreduce_grads_in_fp32 with Megatron's default for `model`'s precision.
  bool fp32_main_grads(const TransformerConfig& model) const {
    return model.bf16 ? !grad_reduce_in_bf16 : accumulate_allreduce_grads_in_fp32.value_or(false);
  }
  /// Whether `model` trains with a dynamic loss scale (fp16 without a constant --loss-scale).
  bool dynamic_loss_scale(const TransformerConfig& model) const {
    return model.fp16 && !loss_scale.has_value();
  }

  /// Samples per optimizer step: global_batch_size, or one micro-batch when it is unset.
  /// global_batch_size, or (unset) one micro-batch per data-parallel rank (Megatron's default).
  int64_t global_batch(int64_t micro_batch_size, int64_t data_parallel_size = 1) const {
    return global_batch_size > 0 ? global_batch_size : micro_batch_size * data_parallel_size;
  }
  /// Micro-batches each data-parallel rank runs per step: global / (micro x d).
  int64_t num_microbatches(int64_t micro_batch_size, int64_t data_parallel_size = 1) const {
    return global_batch(micro_batch_size, data_parallel_size) /
           (micro_batch_size * data_parallel_size);
  }
  /// The global batch of every training step: step_batch_size_schedule read with `model`'s
  /// seq_length, or global_batch(micro, d) throughout.
  GlobalBatchSchedule batch_schedule(const TransformerConfig& model,
                                     int64_t data_parallel_size = 1) const;
  /// Throws a clear error for inconsistent values (given the model's micro-batch size).
  void validate(const TransformerConfig& model) const;

 private:
  // validate()'s parts, in its order (training_config.cpp).
  void validate_batch(const TransformerConfig& model) const;
  void validate_schedule(const TransformerConfig& model) const;
  void validate_optimizer(const TransformerConfig& model) const;
  void validate_run(const TransformerConfig& model) const;
  void validate_data_and_checkpoints(const TransformerConfig& model) const;

 public:
  /// With train_samples: train_iters from it (Megatron's update_train_iters: one batch size
  /// rounds down, the last partial batch is not run; a schedule runs until train_samples are
  /// consumed); a clear error below one batch.
  void resolve_train_iters(const GlobalBatchSchedule& batches);
  /// A run of `steps` steps that measures memory or time, not the schedule: train_iters = steps,
  /// no warmup, the decay over the steps, no early exit (a warmup longer than the few steps would
  /// be refused: OptimizerParamScheduler asserts lr_warmup_steps < lr_decay_steps).
  void set_measurement_steps(int64_t steps) {
    train_iters = steps;
    train_samples.reset();
    lr_warmup_iters = 0;
    lr_warmup_samples = 0;
    lr_warmup_fraction.reset();
    lr_decay_iters.reset();
    lr_decay_samples.reset();
    exit_interval.reset();
    exit_duration_in_mins.reset();
  }
};

/// The learning-rate schedule of Megatron's get_optimizer_param_scheduler (training.py), in
/// samples as its OptimizerParamScheduler counts them.
struct LrScheduleSteps {
  double warmup = 0;  // lr_warmup_steps (a fraction of the decay steps need not be whole)
  int64_t decay = 0;  // lr_decay_steps
};
/// For `config` (train_iters resolved) with `batches` per step. Iteration-based runs count the
/// samples their first iterations consume (lr_decay_iters x global batch with one size; under a
/// schedule the samples of that many steps of it, where Megatron multiplies by
/// micro-batch x data-parallel size: docs/train.md, "Global batch size schedule").
LrScheduleSteps lr_schedule_steps(const TrainingConfig& config, const GlobalBatchSchedule& batches);

/// Every field of the training config under its flag's name (data_path as "data").
nlohmann::json to_json(const TrainingConfig& config);

}  // namespace actmem
