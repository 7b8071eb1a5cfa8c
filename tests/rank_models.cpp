// rank_models.cpp — the multi-process tests' models and strategies (rank_models.h).
#include "rank_models.h"

#include "actmem/base/digest.h"
#include "actmem/memory/ledger.h"
#include "actmem/train/trainer.h"
#include "fixtures.h"

#include <ATen/ATen.h>

namespace actmem::testing {

TransformerConfig base_config(int t, bool sp, bool dropout, const std::string& variant) {
  TransformerConfig c;
  c.num_layers = 4;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.ffn_hidden_size = 256;
  c.seq_length = 32;
  c.micro_batch_size = 4;
  c.attention_dropout = dropout ? 0.1 : 0.0;
  c.hidden_dropout = dropout ? 0.1 : 0.0;
  c.tensor_model_parallel_size = t;
  c.sequence_parallel = sp;
  if (variant == "bf16" || variant == "fp16") {
    actmem::testing::set_precision(c, variant);
  } else if (variant == "swiglu") {
    c.normalization = "RMSNorm";
    c.gated_linear_unit = true;
    c.position_embedding_type = "rope";
    c.untie_embeddings_and_output_weights = true;
    c.add_bias_linear = false;
  } else if (variant == "gqa") {
    // Grouped-query attention: 2 key/value groups of the 4 heads, one per tensor-parallel rank,
    // with RoPE rotating the grouped keys.
    c.num_query_groups = 2;
    c.position_embedding_type = "rope";
  } else if (variant == "mla" || variant == "mla_no_q_lora") {
    // Multi-latent attention, each rank holding 2 of the 4 heads (Note [MLA under tensor
    // parallelism] in mla/mla.cpp): compressed queries (or one linear_q_proj), normed latents,
    // YaRN with a factor > 1.
    c.multi_latent_attention = true;
    if (variant == "mla") c.q_lora_rank = 24;
    c.kv_lora_rank = 20;
    c.qk_head_dim = 12;
    c.qk_pos_emb_head_dim = 8;
    c.v_head_dim = 10;
    c.qk_layernorm = variant == "mla";
    c.normalization = "RMSNorm";
    c.position_embedding_type = "rope";
    c.rotary_scaling_factor = 4.0;
    c.mscale_all_dim = 0.5;
  } else if (variant == "gdn") {
    // A 3:1 GatedDeltaNet hybrid (layers 0-2 GDN, 3 attention), SwiGLU/RMSNorm/RoPE: 2 key heads
    // serving 4 value heads, one key head and two value heads per rank.
    c.normalization = "RMSNorm";
    c.gated_linear_unit = true;
    c.position_embedding_type = "rope";
    c.untie_embeddings_and_output_weights = true;
    c.add_bias_linear = false;
    c.experimental_attention_variant = "gdn";
    c.linear_attention_freq = "4";
    c.linear_num_key_heads = 2;
    c.linear_num_value_heads = 4;
    c.linear_key_head_dim = 16;
    c.linear_value_head_dim = 12;
  } else if (variant == "gated") {
    // Qwen3-Next's attention: heads of 24 (a d = 96, not h), 2 groups (one per rank), q/k norms
    // (each rank normalising its own heads: their gradients summed over the ranks), the output
    // gate, RoPE on half of each head, zero-centred RMSNorm, SwiGLU.
    c.kv_channels_arg = 24;
    c.num_query_groups = 2;
    c.qk_layernorm = true;
    c.attention_output_gate = true;
    c.position_embedding_type = "rope";
    c.rotary_percent = 0.5;
    c.layernorm_zero_centered_gamma = true;
    c.normalization = "RMSNorm";
    c.gated_linear_unit = true;
    c.add_bias_linear = false;
  } else if (variant == "unfused") {
    c.attention_backend = "unfused";  // without attention dropout auto would run flash
  } else if (variant == "flash_gqa") {
    // The flash kernel (no attention dropout; hidden dropout as asked) with 2 key/value groups,
    // one per rank, read at their G heads by the kernel, and RoPE.
    c.attention_dropout = 0.0;
    c.attention_backend = "flash";
    c.num_query_groups = 2;
    c.position_embedding_type = "rope";
  } else {
    TORCH_CHECK(variant == "base", "base_config: unknown variant ", variant);
  }
  return c;
}

std::vector<std::pair<std::string, Mutator>> strategies(bool sp, bool mla) {
  auto full = [](const char* method, int64_t n, bool distribute) {
    return [=](TransformerConfig& c) {
      c.recompute_granularity = "full";
      c.recompute_method = method;
      c.recompute_num_layers = n;
      c.distribute_saved_activations = distribute;
    };
  };
  auto selective = [](std::vector<std::string> modules) {
    return [=](TransformerConfig& c) {
      c.recompute_granularity = "selective";
      c.recompute_modules = modules;
    };
  };
  std::vector<std::pair<std::string, Mutator>> s = {
      {"plain", [](TransformerConfig&) {}},
      {"full_uniform_1", full("uniform", 1, false)},
      {"full_uniform_3", full("uniform", 3, false)},  // 4 layers: chunks [0,3) [3,4)
      {"full_block_2", full("block", 2, false)},
      {"selective_core_attn", selective({"core_attn"})},
      {"selective_mlp", selective({"mlp"})},
      {"selective_layernorm", selective({"layernorm"})},
      {"selective_all", selective({"core_attn", "mlp", "layernorm"})},
      {"offload_fine_grained",
       [](TransformerConfig& c) {
         c.fine_grained_activation_offloading = true;
         c.offload_modules = {"attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"};
         c.min_offloaded_tensor_size = 0;
       }},
      {"offload_layers_2",
       [](TransformerConfig& c) {
         c.cpu_offloading_num_layers = 2;
         c.min_offloaded_tensor_size = 0;
       }},
  };
  if (mla) {
    s.emplace_back("selective_mla_up_proj", selective({"mla_up_proj"}));
    s.emplace_back("selective_mla_up_proj_core_attn_layernorm",
                   selective({"mla_up_proj", "core_attn", "layernorm"}));
  }
  if (!sp) {
    // Refused with sequence parallelism (Megatron's rule).
    s.emplace_back("distribute_uniform_1", full("uniform", 1, true));
    s.emplace_back("distribute_block_2", full("block", 2, true));
  }
  return s;
}

// Expert parallelism: an MoE model (4 experts, top-2, shared experts, aux loss) trained for three
// steps on one global batch, under the recompute or offload strategy `strategy`; each rank
// reports its steps and its place in the layout.
// variant: "base" (dropless), "capacity" (capacity factor 1, tokens dropped), "padded" (and
// padded to the capacity), "gated_bias" (dropless SwiGLU experts with biases, no grouping),
// "seq_aux" (dropless, DeepSeek-V2's per-sequence load-balancing loss).
TransformerConfig moe_config(int tp, int ep, bool dropout, const std::string& dispatcher,
                             const std::string& variant) {
  // MoE under tensor parallelism needs sequence parallelism (Megatron's rule).
  TransformerConfig c = base_config(tp, tp > 1, dropout);
  TORCH_CHECK(variant == "base" || variant == "capacity" || variant == "padded" ||
                  variant == "gated_bias" || variant == "seq_aux",
              "moe_config: unknown MoE variant ", variant);
  if (variant == "seq_aux") c.moe_router_load_balancing_type = "seq_aux_loss";
  if (variant == "capacity" || variant == "padded") c.moe_expert_capacity_factor = 1.0;
  c.moe_pad_expert_input_to_capacity = variant == "padded";
  c.num_moe_experts = 4;
  c.moe_router_topk = 2;
  c.moe_ffn_hidden_size = 64;
  c.moe_grouped_gemm = true;
  c.moe_shared_expert_intermediate_size = 64;
  c.moe_aux_loss_coeff = 0.01;
  c.moe_z_loss_coeff = 0.001;
  c.add_bias_linear = false;  // shared experts have no bias (Megatron's rule)
  c.moe_expert_dropout = dropout ? 0.1 : 0.0;
  c.expert_model_parallel_size = ep;
  c.moe_token_dispatcher_type = dispatcher;
  if (variant == "gated_bias") {
    // SwiGLU experts with biases, one MLP per expert (SequentialMLP), no shared experts (they
    // take no bias): the gated halves' slices and fc2's bias under expert tensor parallelism.
    c.gated_linear_unit = true;
    c.add_bias_linear = true;
    c.moe_grouped_gemm = false;
    c.moe_shared_expert_intermediate_size.reset();
  }
  return c;
}

std::vector<std::pair<std::string, Mutator>> moe_strategies() {
  auto selective = [](std::vector<std::string> modules) {
    return [=](TransformerConfig& c) {
      c.recompute_granularity = "selective";
      c.recompute_modules = modules;
    };
  };
  return {
      {"plain", [](TransformerConfig&) {}},
      {"moe", selective({"moe"})},
      {"moe_act", selective({"moe_act"})},
      {"shared_experts", selective({"shared_experts"})},
      {"layernorm_moe_act", selective({"layernorm", "moe_act"})},
      {"full_uniform_1",
       [](TransformerConfig& c) {
         c.recompute_granularity = "full";
         c.recompute_method = "uniform";
         c.recompute_num_layers = 1;
       }},
      {"offload_expert_fc1_moe_act",
       [](TransformerConfig& c) {
         c.fine_grained_activation_offloading = true;
         c.offload_modules = {"expert_fc1", "moe_act"};
         c.min_offloaded_tensor_size = 0;
       }},
      {"offload_moe_act_recompute_moe_act",
       [](TransformerConfig& c) {
         c.fine_grained_activation_offloading = true;
         c.offload_modules = {"moe_act"};
         c.min_offloaded_tensor_size = 0;
         c.recompute_granularity = "selective";
         c.recompute_modules = {"moe_act"};
       }},
  };
}

std::string param_digest(actmem::GPTModel& model) {
  actmem::Digest d;
  for (const auto& p : model.ordered_parameters()) d.update(p);
  return d.hex();
}

// Three training steps of `c` on global batch `global_batch`: per step what the tests compare,
// and the parameters' digest after them.
// With `batch_schedule` (--step-batch-size-schedule's text) instead of one global batch.
nlohmann::json three_steps(const TransformerConfig& c, int64_t global_batch,
                           const std::string& batch_schedule) {
  actmem::TrainingConfig tc;
  tc.global_batch_size = batch_schedule.empty() ? global_batch : 0;
  tc.step_batch_size_schedule = batch_schedule;
  tc.eval_interval = 0;
  actmem::Trainer trainer(c, tc);
  nlohmann::json steps = nlohmann::json::array();
  for (int i = 0; i < 3; ++i) {
    const auto st = trainer.train_step(true);
    steps.push_back({{"loss", st.loss},
                     {"grad_norm", st.grad_norm},
                     {"grad_digest", st.grad_digest},
                     {"consumed", st.consumed_samples},
                     {"global_batch", st.global_batch_size},
                     {"activation_bytes", st.activation_bytes},
                     {"predicted_activation_bytes", st.predicted_activation_bytes},
                     {"routed", st.moe_routed_tokens},
                     {"dropped", st.moe_dropped_tokens},
                     {"load_balancing_loss", st.load_balancing_loss.value_or(-1.0)},
                     {"z_loss", st.z_loss.value_or(-1.0)}});
  }
  return {{"steps", steps}, {"param_digest", param_digest(trainer.model())}};
}

// `c` with `layers` layers over `pp` stages of `vp` model chunks each.
TransformerConfig with_pipeline(TransformerConfig c, int64_t layers, int pp, int64_t vp) {
  c.num_layers = layers;
  c.pipeline_model_parallel_size = pp;
  if (vp > 1) c.num_virtual_stages_per_pipeline_rank = vp;
  return c;
}

// Training on global batches of `global_batch` samples, no evaluation.
actmem::TrainingConfig step_training(int64_t global_batch) {
  actmem::TrainingConfig tc;
  tc.global_batch_size = global_batch;
  tc.eval_interval = 0;
  return tc;
}

std::shared_ptr<actmem::PackedTensor> MaskCollector::pack(const at::Tensor& t) {
  if (t.scalar_type() == at::kBool && t.numel() > 1) {
    masks.emplace_back(actmem::current_module_path(), t.clone());
  }
  return nullptr;
}

}  // namespace actmem::testing
