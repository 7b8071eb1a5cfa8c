// model_flags.cpp — CLI11 bindings for the model's flags: its shape, parallel layout, mixture of
// experts, Gated DeltaNet and multi-latent attention switches, recompute and offload.
#include "actmem/flags/train_options.h"

#include "flag_groups.h"

#include "actmem/config/activation_plan.h"

#include <CLI/CLI.hpp>

#include <c10/util/StringUtil.h>

#include <limits>
#include <string>

namespace actmem::flags_detail {

namespace {
const CLI::Validator& kModelPositive = positive_number_validator();
const CLI::Validator& kModelNonNegative = non_negative_number_validator();
}  // namespace

void add_shape_flags(CLI::App& app, TrainOptions& o) {
  auto& m = o.model;
  const CLI::Validator positive = integer_in_range(1, kMaxInt);
  app.add_option("--num-layers", m.num_layers, "Number of transformer layers")
      ->capture_default_str()
      ->check(positive);
  app.add_option("--hidden-size", m.hidden_size, "Hidden size h")
      ->capture_default_str()
      ->check(positive);
  app.add_option("--num-attention-heads", m.num_attention_heads, "Attention heads a")
      ->capture_default_str()
      ->check(positive);
  app.add_option("--ffn-hidden-size", m.ffn_hidden_size, "MLP hidden size (default 4h)")
      ->check(positive);
  app.add_flag("--group-query-attention", o.group_query_attention,
               "Grouped-query attention: keys and values of --num-query-groups heads");
  app.add_option("--num-query-groups", m.num_query_groups,
                 "With --group-query-attention: key/value heads G, each shared by heads / G query "
                 "heads (Megatron's default 1)")
      ->check(positive);
  app.add_option("--seq-length", m.seq_length, "Sequence length s")
      ->capture_default_str()
      ->check(positive);
  app.add_option("--max-position-embeddings", m.max_position_embeddings,
                 "Learned position table size (default seq-length)")
      ->check(positive);
  app.add_option("--micro-batch-size", m.micro_batch_size, "Micro-batch size b")
      ->capture_default_str()
      ->check(positive);
  app.add_option("--vocab-size", m.vocab_size,
                 "Vocabulary size (>= 256 for bytes; set by --tokenizer-type when given)")
      ->capture_default_str()
      ->check(positive)
      ->each([&o](const std::string&) { o.vocab_size_given = true; });
  app.add_option("--attention-dropout", m.attention_dropout, "Dropout on attention probabilities")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--hidden-dropout", m.hidden_dropout, "Dropout in bias-dropout-add and embedding")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--attention-backend", m.attention_backend,
                 "Core attention kernel (Megatron's names): flash (no s x s tensors kept; no "
                 "attention dropout), unfused (every s x s tensor kept, as Korthikanti et al. "
                 "count), local (= unfused), fused (not on CPU), auto (flash where it can run, "
                 "else unfused, and the header says why)")
      ->capture_default_str()
      ->check(CLI::IsMember({"flash", "fused", "unfused", "local", "auto"}));
  app.add_option("--normalization", o.normalization_flag, "LayerNorm or RMSNorm")
      ->capture_default_str()
      ->check(CLI::IsMember({"LayerNorm", "RMSNorm"}));
  app.add_option("--layernorm-epsilon,--norm-epsilon", m.layernorm_epsilon,
                 "Norm epsilon (--norm-epsilon: Megatron's current name)")
      ->capture_default_str()
      ->check(kModelPositive);
  app.add_flag("--apply-layernorm-1p,!--no-apply-layernorm-1p", m.layernorm_zero_centered_gamma,
               "Zero-centred gamma: every norm multiplies by (1 + weight), weights start at 0");
  // The negations turn off what a preset (flags/presets.h) or an earlier flag turned on: the
  // last of a flag and its negation wins, as with argparse.
  app.add_flag("--swiglu,!--no-swiglu", o.swiglu,
               "Gated linear unit with SiLU (SwiGLU) instead of GeLU (default ffn: Megatron's "
               "int(8h/3/64) x 64)");
  app.add_flag("--disable-bias-linear", o.disable_bias_linear, "Linear layers without biases");
  app.add_flag("--use-rotary-position-embeddings", o.use_rope,
               "RoPE instead of learned absolute positions (Megatron's deprecated spelling of "
               "--position-embedding-type rope)");
  app.add_option("--position-embedding-type", o.position_embedding_type,
                 "learned_absolute (default), rope or none")
      ->check(CLI::IsMember({"learned_absolute", "rope", "none"}));
  app.add_flag("--no-position-embedding", o.no_position_embedding,
               "Megatron's deprecated switch: allowed with --position-embedding-type rope (where "
               "it changes nothing), refused otherwise as Megatron refuses it");
  app.add_option("--rotary-percent", m.rotary_percent,
                 "Fraction of each head's features RoPE rotates (partial RoPE; the rest pass)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  app.add_option_function<int64_t>(
         "--kv-channels", [&m](const int64_t& v) { m.kv_channels_arg = v; },
         "Width of each attention head (default hidden-size / num-attention-heads)")
      ->check(positive);
  app.add_option("--rotary-base", m.rotary_base, "RoPE base")
      ->capture_default_str()
      ->check(kModelPositive);
  app.add_flag("--untie-embeddings-and-output-weights,!--tie-embeddings-and-output-weights",
               o.untie, "Separate output layer instead of the tied word embedding");
  app.add_option("--init-method-std", m.init_method_std, "Std of the normal initialisation")
      ->capture_default_str()
      ->check(kModelPositive);
  // Precision (docs/mixed-precision.md).
  app.add_flag("--bf16", m.bf16,
               "Parameters and activations in bfloat16 (fp32 main parameters, "
               "gradients accumulated in fp32)");
  app.add_flag("--fp16", m.fp16,
               "Parameters and activations in float16 with loss scaling "
               "(needs half-precision kernels: CUDA)");
  app.add_flag("--attention-softmax-in-fp32", m.attention_softmax_in_fp32,
               "Compute the attention softmax in fp32 (16-bit runs)");
  add_quantization_flags(app, o);
  // Megatron requires seed > 0; the upper bound leaves room for the stream offsets added to it.
  app.add_option("--seed", m.seed, "Seed for initialisation, dropout and sampling (> 0)")
      ->capture_default_str()
      ->check(integer_in_range(1, static_cast<int64_t>(kMaxSeed)));
}

void add_quantization_flags(CLI::App& app, TrainOptions& o) {
  auto& m = o.model;
  // FP8 / FP4 (docs/fp8.md), Megatron's names and defaults; the rules are TransformerConfig's.
  app.add_option("--fp8-format", m.fp8,
                 "FP8 GEMMs in every transformer layer: e4m3, or hybrid (E5M2 output gradients)")
      ->check(CLI::IsMember({"e4m3", "hybrid"}));
  app.add_option("--fp8-recipe", m.fp8_recipe,
                 "FP8 scaling: delayed (amax history) or tensorwise (current per-tensor); "
                 "Megatron's mxfp8 and blockwise are refused")
      ->capture_default_str();
  app.add_option("--fp8-margin", m.fp8_margin, "Delayed scaling: scale divided by 2^margin")
      ->capture_default_str();
  app.add_option("--fp8-amax-history-len", m.fp8_amax_history_len,
                 "Delayed scaling: forwards in the amax window")
      ->capture_default_str();
  app.add_option("--fp8-amax-compute-algo", m.fp8_amax_compute_algo,
                 "Delayed scaling: amax of the window, most_recent or max")
      ->capture_default_str()
      ->check(CLI::IsMember({"most_recent", "max"}));
  app.add_flag("--fp8-wgrad,!--no-fp8-wgrad", m.fp8_wgrad,
               "The weight gradient's GEMM in FP8 (off: in 16 bits from the 16-bit input)");
  app.add_flag("--first-last-layers-bf16", m.first_last_layers_bf16,
               "Keep the first and last layers in 16 bits under FP8");
  app.add_option("--num-layers-at-start-in-bf16", m.num_layers_at_start_in_bf16,
                 "With --first-last-layers-bf16: layers at the start kept in 16 bits")
      ->capture_default_str();
  app.add_option("--num-layers-at-end-in-bf16", m.num_layers_at_end_in_bf16,
                 "With --first-last-layers-bf16: layers at the end kept in 16 bits")
      ->capture_default_str();
  app.add_option("--fp4-format", m.fp4, "FP4 GEMMs (e2m1; refused: not implemented yet)");
  app.add_option("--fp4-recipe", m.fp4_recipe, "FP4 scaling (nvfp4)")->capture_default_str();
}

void add_parallel_flags(CLI::App& app, TrainOptions& o) {
  auto& m = o.model;
  // Tensor and sequence parallelism (docs/parallelism.md); run under `actmem launch`.
  app.add_option("--tensor-model-parallel-size", m.tensor_model_parallel_size,
                 "Tensor-parallel ranks t (= the launch's --nproc-per-node)")
      ->capture_default_str()
      ->check(integer_in_range(1, 1 << 20));
  app.add_flag("--sequence-parallel,!--no-sequence-parallel", m.sequence_parallel,
               "Shard norms and dropouts along the sequence across the t ranks (turned off with "
               "a warning when t = 1, as Megatron does)");
  app.add_option("--pipeline-model-parallel-size", m.pipeline_model_parallel_size,
                 "Pipeline stages p (1F1B schedule; the launch has t x p x d processes)")
      ->capture_default_str()
      ->check(integer_in_range(1, 1 << 20));
  app.add_option_function<int64_t>(
         "--decoder-first-pipeline-num-layers",
         [&m](const int64_t& n) { m.decoder_first_pipeline_num_layers = n; },
         "Layers of the first pipeline stage (uneven split; the others share the rest)")
      ->check(integer_in_range(1, 1 << 20));
  app.add_option_function<int64_t>(
         "--decoder-last-pipeline-num-layers",
         [&m](const int64_t& n) { m.decoder_last_pipeline_num_layers = n; },
         "Layers of the last pipeline stage (uneven split)")
      ->check(integer_in_range(1, 1 << 20));
  app.add_option_function<int64_t>(
         "--num-layers-per-virtual-pipeline-stage",
         [&m](const int64_t& n) { m.num_layers_per_virtual_pipeline_stage = n; },
         "Interleaved 1F1B: layers per model chunk (each rank holds num_layers / p / N chunks)")
      ->check(integer_in_range(1, 1 << 20));
  app.add_option_function<int64_t>(
         "--num-virtual-stages-per-pipeline-rank",
         [&m](const int64_t& n) { m.num_virtual_stages_per_pipeline_rank = n; },
         "Interleaved 1F1B: model chunks per pipeline rank")
      ->check(integer_in_range(1, 1 << 20));
  app.add_option_function<int64_t>(
         "--microbatch-group-size-per-virtual-pipeline-stage",
         [&m](const int64_t& n) { m.microbatch_group_size_per_vp_stage = n; },
         "Interleaved 1F1B: micro-batches a chunk runs before the next takes over (default p)")
      ->check(integer_in_range(1, 1 << 20));
}

// Adds the Gated DeltaNet flags (--experimental-attention-variant, --linear-*).
void add_gated_delta_net_flags(CLI::App& app, TrainOptions& o) {
  auto& m = o.model;
  // Gated DeltaNet hybrid models (docs/gdn.md), Megatron's flags and defaults.
  app.add_option("--experimental-attention-variant", m.experimental_attention_variant,
                 "gdn: GatedDeltaNet (linear attention by the gated delta rule) on the layers "
                 "--linear-attention-freq marks (gated_delta_net: Megatron's deprecated spelling)")
      ->check(CLI::IsMember({"gdn", "gated_delta_net", "gdn2", "dsa"}));
  app.add_option("--linear-attention-freq", m.linear_attention_freq,
                 "N: every N-th layer is standard attention, the others GatedDeltaNet; or a 0/1 "
                 "pattern per layer (1 = GDN), e.g. \"([1]*3+[0])*2\"");
  app.add_option("--linear-conv-kernel-dim", m.linear_conv_kernel_dim,
                 "GatedDeltaNet's causal convolution kernel")
      ->capture_default_str()
      ->check(integer_in_range(1, kMaxInt));
  app.add_option("--linear-key-head-dim", m.linear_key_head_dim,
                 "GatedDeltaNet's query and key head dimension")
      ->capture_default_str()
      ->check(integer_in_range(1, kMaxInt));
  app.add_option("--linear-value-head-dim", m.linear_value_head_dim,
                 "GatedDeltaNet's value and gate head dimension")
      ->capture_default_str()
      ->check(integer_in_range(1, kMaxInt));
  app.add_option("--linear-num-key-heads", m.linear_num_key_heads,
                 "GatedDeltaNet's query and key heads")
      ->capture_default_str()
      ->check(integer_in_range(1, kMaxInt));
  app.add_option("--linear-num-value-heads", m.linear_num_value_heads,
                 "GatedDeltaNet's value and gate heads (a multiple of the key heads)")
      ->capture_default_str()
      ->check(integer_in_range(1, kMaxInt));
}

// Adds the multi-latent attention flags (and YaRN's, which MLA uses by default).
void add_multi_latent_attention_flags(CLI::App& app, TrainOptions& o) {
  auto& m = o.model;
  // Multi-latent attention (docs/mla.md), Megatron's flags and CLI defaults.
  app.add_flag("--multi-latent-attention", m.multi_latent_attention,
               "Attention through low-rank query and key/value latents (Megatron's MLA)");
  app.add_option_function<int64_t>(
         "--q-lora-rank", [&m](const int64_t& v) { m.q_lora_rank = v; },
         "Rank of the query's latent (default: no query compression)")
      ->check(integer_in_range(1, kMaxInt));
  app.add_option("--kv-lora-rank", m.kv_lora_rank, "Rank of the keys' and values' latent")
      ->capture_default_str()
      ->check(integer_in_range(1, kMaxInt));
  app.add_option("--qk-head-dim", m.qk_head_dim, "Per-head query/key width without position")
      ->capture_default_str()
      ->check(integer_in_range(1, kMaxInt));
  app.add_option("--qk-pos-emb-head-dim", m.qk_pos_emb_head_dim,
                 "Per-head width of the decoupled RoPE part of queries and keys")
      ->capture_default_str()
      ->check(integer_in_range(1, kMaxInt));
  app.add_option("--v-head-dim", m.v_head_dim, "Per-head value width")
      ->capture_default_str()
      ->check(integer_in_range(1, kMaxInt));
  app.add_flag("--qk-layernorm,!--no-qk-layernorm", m.qk_layernorm,
               "Norms on each query and key head (q_layernorm, k_layernorm before RoPE); with MLA "
               "on the query and key/value latents (q_layernorm, kv_layernorm)");
  app.add_flag("--attention-output-gate,!--no-attention-output-gate", m.attention_output_gate,
               "Gated attention: linear_qkv also yields a gate per query head; the core "
               "attention's output is multiplied by sigmoid(gate) before linear_proj");
  app.add_option("--rope-type", m.rope_type, "rope or yarn (default yarn with MLA, rope otherwise)")
      ->check(CLI::IsMember({"rope", "yarn"}));
  app.add_option("--rotary-scaling-factor", m.rotary_scaling_factor, "YaRN's scaling factor")
      ->capture_default_str()
      ->check(kModelPositive);
  app.add_option("--mscale", m.mscale, "YaRN's mscale (MLA)")->capture_default_str();
  app.add_option("--mscale-all-dim", m.mscale_all_dim, "YaRN's mscale_all_dim (MLA)")
      ->capture_default_str();
}

void add_moe_flags(CLI::App& app, TrainOptions& o) {
  auto& m = o.model;
  // Mixture of experts (docs/moe.md), Megatron's flags and defaults.
  app.add_option("--num-experts", m.num_moe_experts, "Experts per MoE layer (0 = dense)")
      ->check(integer_in_range(0, 1 << 20));
  app.add_option("--moe-router-topk", m.moe_router_topk, "Experts each token is routed to")
      ->capture_default_str()
      ->check(integer_in_range(1, 1 << 20));
  app.add_option_function<int64_t>(
         "--moe-ffn-hidden-size", [&m](const int64_t& v) { m.moe_ffn_hidden_size = v; },
         "Each expert's hidden size (default --ffn-hidden-size)")
      ->check(integer_in_range(1, kMaxInt));
  app.add_option(
         "--moe-layer-freq", m.moe_layer_freq,
         "MoE every N layers from layer 0, or a 0/1 pattern: \"[1,0,1,0]\", \"([1]*3+[0])*2\"")
      ->capture_default_str();
  app.add_option("--moe-router-load-balancing-type", m.moe_router_load_balancing_type,
                 "aux_loss (Switch load balancing) or none")
      ->capture_default_str();
  app.add_option("--moe-aux-loss-coeff", m.moe_aux_loss_coeff, "Load-balancing loss coefficient")
      ->capture_default_str()
      ->check(kModelNonNegative);
  app.add_option_function<double>(
         "--moe-z-loss-coeff", [&m](const double& v) { m.moe_z_loss_coeff = v; },
         "Router z-loss coefficient (default off)")
      ->check(kModelNonNegative);
  app.add_option("--moe-router-score-function", m.moe_router_score_function, "softmax or sigmoid")
      ->capture_default_str();
  app.add_flag("--moe-router-pre-softmax", m.moe_router_pre_softmax,
               "Softmax over all experts before the top-k (needed with --moe-router-topk 1)");
  app.add_option("--moe-router-dtype", m.moe_router_dtype,
                 "Run the router's gating linear, scores and load-balancing losses in fp32 or "
                 "fp64 (Megatron's; default: the model's type)")
      ->check(CLI::IsMember({"fp32", "fp64"}));
  app.add_option_function<double>(
         "--moe-router-topk-scaling-factor",
         [&m](const double& v) { m.moe_router_topk_scaling_factor = v; },
         "Multiply the routing probabilities by this")
      ->check(kModelPositive);
  app.add_option_function<int64_t>(
         "--moe-shared-expert-intermediate-size",
         [&m](const int64_t& v) { m.moe_shared_expert_intermediate_size = v; },
         "Shared experts' total hidden size (num_shared_experts x each one's ffn)")
      ->check(integer_in_range(1, kMaxInt));
  app.add_flag("--moe-shared-expert-gate", m.moe_shared_expert_gate,
               "Scale the shared-expert output by a learned sigmoid gate");
  app.add_option_function<double>(
      "--moe-expert-capacity-factor",
      [&m](const double& v) {
        // Megatron: a negative factor means none (dropless).
        if (v >= 0.0)
          m.moe_expert_capacity_factor = v;
        else
          m.moe_expert_capacity_factor.reset();
      },
      "Token dropping: each expert takes at most ceil(tokens x topk / experts x factor) tokens "
      "(default dropless)");
  app.add_flag("--moe-pad-expert-input-to-capacity", m.moe_pad_expert_input_to_capacity,
               "With a capacity factor: every expert computes exactly `capacity` rows");
  app.add_option("--moe-token-drop-policy", m.moe_token_drop_policy,
                 "Over capacity, keep the tokens with the highest probs or the earliest position")
      ->capture_default_str();
  app.add_flag("--moe-grouped-gemm", m.moe_grouped_gemm,
               "Experts as one grouped product over the permuted tokens (TEGroupedMLP)");
  app.add_option("--moe-token-dispatcher-type", m.moe_token_dispatcher_type,
                 "allgather or alltoall")
      ->capture_default_str();
  app.add_option("--expert-model-parallel-size", m.expert_model_parallel_size,
                 "Expert-parallel ranks: the routed experts split e ways (e divides the "
                 "data-parallel ranks; docs/moe.md)")
      ->capture_default_str()
      ->check(integer_in_range(1, 1 << 20));
  app.add_flag("--moe-layer-recompute", m.moe_layer_recompute,
               "Deprecated: --recompute-granularity selective --recompute-modules core_attn moe");
  app.add_option("--moe-expert-dropout", m.moe_expert_dropout,
                 "actmem: dropout on the experts' activation, from the expert-parallel random "
                 "stream (Megatron has none; default 0)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  add_gated_delta_net_flags(app, o);
  add_multi_latent_attention_flags(app, o);
}

void add_recompute_flags(CLI::App& app, TrainOptions& o) {
  auto& m = o.model;
  // Activation recompute (docs/recompute.md).
  app.add_option("--recompute-granularity", m.recompute_granularity,
                 "full (whole layers) or selective (--recompute-modules)")
      ->check(CLI::IsMember({"full", "selective"}));
  app.add_option("--recompute-method", m.recompute_method,
                 "Full recompute: uniform (chunks of N layers) or block (first N layers)")
      ->check(CLI::IsMember({"uniform", "block"}));
  app.add_option_function<int64_t>(
         "--recompute-num-layers", [&m](const int64_t& n) { m.recompute_num_layers = n; },
         "Full recompute: layers per chunk (uniform) or checkpointed layers (block)")
      ->check(integer_in_range(0, kMaxInt));
  auto& t = o.training;
  app.add_option_function<int64_t>(
         "--num-microbatches-with-partial-activation-checkpoints",
         [&t](const int64_t& n) { t.num_microbatches_with_partial_activation_checkpoints = n; },
         "Pipeline schedules with full block recompute: per window of warmup + 1 forwards, the "
         "first N checkpoint --recompute-num-layers layers, the others every layer")
      ->check(integer_in_range(0, kMaxInt));
  app.add_option_function<std::vector<std::string>>(
         "--recompute-modules",
         [&m](const std::vector<std::string>& v) { m.recompute_modules = v; },
         "Selective targets, space-separated: " + recompute_module_list(" ") +
             " (default core_attn)")
      ->expected(1, -1);
  app.add_flag("--recompute-activations", o.recompute_activations,
               "Legacy: same as --recompute-granularity selective");
  app.add_flag("--checkpoint-activations", o.checkpoint_activations,
               "Removed (refused): use --recompute-activations or --recompute-granularity");
  app.add_flag("--distribute-saved-activations", m.distribute_saved_activations,
               "Full recompute: keep checkpoint inputs sharded over tensor-parallel ranks");
}

void add_offload_flags(CLI::App& app, TrainOptions& o) {
  auto& m = o.model;
  auto setting = [&o](const char* flag) {
    return [&o, flag](const std::string&) { o.offload_setting_flag = flag; };
  };
  // CPU offload (docs/offload.md).
  app.add_option("--cpu-offloading-num-layers", m.cpu_offloading_num_layers,
                 "Offload the saved activations of the first K layers to host memory")
      ->check(integer_in_range(0, kMaxInt));
  app.add_flag("--fine-grained-activation-offloading", m.fine_grained_activation_offloading,
               "Offload what the modules of --offload-modules save");
  app.add_option("--offload-modules", m.offload_modules,
                 "Space-separated: " + offload_module_list(" "))
      ->expected(1, -1);
  app.add_option("--fine-grained-offloading-max-inflight-offloads",
                 m.fine_grained_offloading_max_inflight_offloads,
                 "Groups of one name with copies in flight before compute waits (-1 = no cap)")
      ->capture_default_str()
      ->check(integer_in_range(-1, kMaxInt))
      ->each(setting("--fine-grained-offloading-max-inflight-offloads"));
  app.add_option("--min-offloaded-tensor-size", m.min_offloaded_tensor_size,
                 "Saved tensors with fewer elements stay on the device")
      ->capture_default_str()
      ->check(integer_in_range(0, kMaxInt))
      ->each(setting("--min-offloaded-tensor-size"));
  app.add_option("--offload-bandwidth-gbps", o.training.offload_bandwidth_gbps,
                 "Emulated host link for offload copies, GB/s per direction (0 = uncapped; "
                 "otherwise " +
                     c10::str(kMinOffloadBandwidthGbps) + " to " +
                     c10::str(kMaxOffloadBandwidthGbps) + ")")
      ->capture_default_str()
      ->check(kModelNonNegative)
      ->each(setting("--offload-bandwidth-gbps"));
}

}  // namespace actmem::flags_detail
