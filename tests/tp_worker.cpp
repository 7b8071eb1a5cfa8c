// tp_worker.cpp — one rank of the tensor-parallel tests (test_tensor_parallel.cpp starts N of
// them with launch_workers). Each rank trains or probes a small model with t = WORLD_SIZE and
// writes what it measured to OUT_DIR/rank<R>.json; the test process compares the ranks' files.
//
//   actmem_tp_worker strategies OUT_DIR [--sp] [--no-dropout] [--only NAME] [--variant V]
//     V = base (LayerNorm, GeLU, learned positions, tied output, biases) or
//         swiglu (RMSNorm, SwiGLU, RoPE, untied output layer, no linear biases)
//   actmem_tp_worker masks OUT_DIR [--sp]
//   actmem_tp_worker dispatch OUT_DIR      (the ranks as one expert-parallel group)
//   actmem_tp_worker data OUT_DIR --tp T (--global-batch G | --batch-schedule S) [--no-dropout]
//     (t x d ranks, d = WORLD_SIZE / T: three steps of the base model on global batch G)
//   actmem_tp_worker overlap OUT_DIR --tp T --pp P [--vp V] --layers L --global-batch G
//                    --bucket N [--no-dropout]   (data parallelism with and without
//                    --overlap-grad-reduce)
//   actmem_tp_worker distopt OUT_DIR --tp T --pp P [--vp V] --layers L --global-batch G
//                    --bucket N [--variant base|bf16|moe] [--ep E] [--no-dropout]   (the
//                    distributed optimizer against the replicated one; bucket 0: no
//                    --overlap-grad-reduce)
//   actmem_tp_worker experts OUT_DIR --tp T --ep E --global-batch G [--dispatcher D]
//     [--no-dropout] [--only STRATEGY] [--variant base|capacity|padded]   (an MoE model's three
//     steps per recompute/offload strategy; WORLD_SIZE = E x the expert-data-parallel size)
//   actmem_tp_worker expert_masks OUT_DIR --tp 1 --ep E   (expert dropout masks per rank)
//   actmem_tp_worker pipeline OUT_DIR --tp T --pp P --global-batch G [--no-dropout]
//     [--only STRATEGY] [--variant base|swiglu] [--first N] [--last N] [--layers L (4)]
//     [--vp V]   (V model chunks per stage: the interleaved schedule)
//     (t x p x d ranks: three steps per recompute strategy of the base model, clip-grad off;
//     each stage reports its steps and its parameters' digests under their global names)
//   actmem_tp_worker pipeline_fault OUT_DIR --tp 1 --pp P --die STAGE   (1F1B on small
//     tensors; stage STAGE kills itself with SIGKILL in the forward of micro-batch 2)
#include "actmem/base/blas.h"
#include "actmem/base/digest.h"
#include "actmem/config/activation_plan.h"
#include "actmem/memory/ledger.h"
#include "actmem/memory/memory_model.h"
#include "actmem/model/activation_bytes.h"
#include "actmem/model/moe/moe.h"
#include "actmem/parallel/distributed.h"
#include "actmem/parallel/distributed_optimizer.h"
#include "actmem/parallel/grad_reducer.h"
#include "actmem/parallel/moe_dispatch.h"
#include "actmem/parallel/pipeline.h"
#include "actmem/parallel/tensor_parallel.h"
#include "actmem/recompute/rng.h"
#include "actmem/recompute/saved_tensor_hooks.h"
#include "actmem/train/trainer.h"
#include "fixtures.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <csignal>
#include <fstream>
#include <functional>
#include <iostream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace {

using actmem::TransformerConfig;
using Mutator = std::function<void(TransformerConfig&)>;

TransformerConfig base_config(int t, bool sp, bool dropout, const std::string& variant = "base") {
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
    TORCH_CHECK(variant == "base", "actmem_tp_worker: unknown variant ", variant);
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

std::string param_digest(actmem::GPTModel& model) {
  actmem::Digest d;
  for (const auto& p : model.ordered_parameters()) d.update(p);
  return d.hex();
}

nlohmann::json run_strategies(int t, bool sp, bool dropout, const std::string& only,
                              const std::string& variant) {
  nlohmann::json out;
  for (const auto& [name, mutate] : strategies(sp, variant.rfind("mla", 0) == 0)) {
    if (!only.empty() && name != only) continue;
    TransformerConfig c = base_config(t, sp, dropout, variant);
    mutate(c);
    actmem::TrainingConfig tc;
    if (c.fp16) tc.initial_loss_scale = actmem::testing::kFp16TestLossScale;
    tc.global_batch_size = 2 * c.micro_batch_size;  // two micro-batches per step
    tc.train_iters = 3;
    tc.eval_interval = 0;
    actmem::Trainer trainer(c, tc);
    nlohmann::json r;
    for (int i = 0; i < 3; ++i) {
      const actmem::IterationStats st = trainer.train_step(true);
      r["loss"].push_back(st.loss);
      r["grad_norm"].push_back(st.grad_norm);
      r["grad_digest"].push_back(st.grad_digest);
      r["activation_bytes"].push_back(st.activation_bytes);
      r["predicted_activation_bytes"] = st.predicted_activation_bytes;
    }
    r["param_digest"] = param_digest(trainer.model());
    // The parameters every tensor-parallel rank holds whole: equal on every rank unless a
    // partial gradient went unreduced (GatedDeltaNet's out_norm without sequence parallelism).
    actmem::Digest replicated;
    const auto attributes = trainer.model().parameter_attributes();
    const auto params = trainer.model().ordered_parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      if (!attributes[i].tensor_parallel) replicated.update(params[i]);
    }
    r["replicated_digest"] = replicated.hex();
    out[name] = r;
  }
  return out;
}

// Records every dropout mask (bool tensor) saved in one training forward, with its module.
class MaskCollector : public actmem::SavedTensorHook {
 public:
  std::shared_ptr<actmem::PackedTensor> pack(const at::Tensor& t) override {
    if (t.scalar_type() == at::kBool && t.numel() > 1) {
      masks.emplace_back(actmem::current_module_path(), t.clone());
    }
    return nullptr;
  }
  std::vector<std::pair<std::string, at::Tensor>> masks;
};

nlohmann::json run_masks(int t, bool sp) {
  TransformerConfig c = base_config(t, sp, /*dropout=*/true);
  c.num_layers = 2;
  actmem::TrainingConfig tc;
  tc.eval_interval = 0;
  actmem::Trainer trainer(c, tc);
  MaskCollector collector;
  {
    actmem::SavedTensorHooksGuard guard(collector);
    trainer.train_step(false);
  }
  // The attention mask buffer is a parameter-like constant, not a dropout mask.
  nlohmann::json out = nlohmann::json::array();
  for (const auto& [module, mask] : collector.masks) {
    if (mask.sizes() == trainer.model().attention_mask().sizes()) continue;
    const at::Tensor all = actmem::all_gather_dim0(mask.to(at::kByte).unsqueeze(0));
    bool same = true;
    for (int64_t r = 1; r < all.size(0); ++r) same = same && at::equal(all[0], all[r]);
    out.push_back({{"module", module},
                   {"shape", mask.sizes().vec()},
                   {"same_on_all_ranks", same},
                   {"dropped_fraction", 1.0 - mask.to(at::kDouble).mean().item<double>()}});
  }
  return out;
}

}  // namespace

// Note [All-to-all dispatch] checked against its definition: every rank routes its own tokens
// (a different number per rank) to two of E = 2 x ranks experts; each rank rebuilds every rank's
// tokens and routing from their seeds, so it knows which rows its experts must receive, in which
// order, and what the combined output and the gradients must be. Expert j of rank r multiplies
// its rows by a parameter w (initially its global index + 1).
nlohmann::json run_dispatch(const actmem::TensorParallelGroup& group) {
  const int ep = group.size, rank = group.rank;
  const int64_t E = 2 * ep, local = 2, h = 6;
  struct Data {
    at::Tensor x, c;                            // tokens [T, h], the loss's weights [T, h]
    std::vector<std::vector<int64_t>> experts;  // per token, its two experts
    std::vector<std::vector<double>> probs;
  };
  auto make = [&](int r) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1000 + r);
    Data d;
    const int64_t T = 5 + 3 * r;
    const auto f64 = at::TensorOptions().dtype(at::kDouble);
    d.x = at::randn({T, h}, gen, f64);
    d.c = at::randn({T, h}, gen, f64);
    for (int64_t t = 0; t < T; ++t) {
      const at::Tensor pick = at::randperm(E, gen, at::TensorOptions().dtype(at::kLong));
      d.experts.push_back({pick[0].item<int64_t>(), pick[1].item<int64_t>()});
      d.probs.push_back(
          {at::rand({1}, gen, f64).item<double>(), at::rand({1}, gen, f64).item<double>()});
    }
    return d;
  };
  std::vector<Data> data;
  for (int r = 0; r < ep; ++r) data.push_back(make(r));
  const Data& me = data[static_cast<size_t>(rank)];
  // This rank's rows expert-major, each expert's tokens in token order (Megatron's permute).
  std::vector<int64_t> token_of_row, rows_per_expert(static_cast<size_t>(E), 0);
  std::vector<double> prob_of_row;
  for (int64_t g = 0; g < E; ++g) {
    for (size_t t = 0; t < me.experts.size(); ++t) {
      for (int k = 0; k < 2; ++k) {
        if (me.experts[t][static_cast<size_t>(k)] != g) continue;
        token_of_row.push_back(static_cast<int64_t>(t));
        prob_of_row.push_back(me.probs[t][static_cast<size_t>(k)]);
        ++rows_per_expert[static_cast<size_t>(g)];
      }
    }
  }
  const at::Tensor x = me.x.clone().requires_grad_(true);
  const at::Tensor index = at::tensor(token_of_row, at::kLong);
  const at::Tensor permuted = x.index_select(0, index);
  const at::Tensor probs = at::tensor(prob_of_row, at::kDouble);
  actmem::AlltoAllTokenDispatcher dispatcher(group, actmem::TensorParallelGroup{}, group, E);
  const auto d = dispatcher.dispatch(permuted, probs, rows_per_expert);
  // What local expert j must have received: from each source rank in order, its tokens routed
  // to global expert rank * 2 + j, in token order.
  std::vector<at::Tensor> expect_rows;
  std::vector<double> expect_probs;
  for (int64_t j = 0; j < local; ++j) {
    const int64_t g = rank * local + j;
    for (int src = 0; src < ep; ++src) {
      const Data& s = data[static_cast<size_t>(src)];
      for (size_t t = 0; t < s.experts.size(); ++t) {
        for (int k = 0; k < 2; ++k) {
          if (s.experts[t][static_cast<size_t>(k)] != g) continue;
          expect_rows.push_back(s.x[static_cast<int64_t>(t)]);
          expect_probs.push_back(s.probs[t][static_cast<size_t>(k)]);
        }
      }
    }
    TORCH_CHECK(
        d.tokens_per_local_expert[static_cast<size_t>(j)] ==
            static_cast<int64_t>(expect_rows.size()) - (j == 0 ? 0 : d.tokens_per_local_expert[0]),
        "dispatch: expert ", g, " got ", d.tokens_per_local_expert[static_cast<size_t>(j)],
        " rows");
  }
  TORCH_CHECK(at::equal(d.tokens, at::stack(expect_rows)), "dispatch: rank ", rank,
              "'s experts received other rows than those routed to them");
  TORCH_CHECK(at::equal(d.probs, at::tensor(expect_probs, at::kDouble)),
              "dispatch: probabilities differ");
  // The experts, combine, unpermute; then backward.
  const at::Tensor w =
      at::arange(rank * local + 1, rank * local + local + 1, at::kDouble).requires_grad_(true);
  const at::Tensor scale = w.repeat_interleave(at::tensor(d.tokens_per_local_expert, at::kLong));
  const at::Tensor y = d.tokens * (scale * d.probs).unsqueeze(1);
  const at::Tensor back = dispatcher.combine(y);
  const at::Tensor out = at::zeros_like(me.x).index_add(0, index, back);
  (out * me.c).sum().backward();
  for (size_t t = 0; t < me.experts.size(); ++t) {
    double f = 0;
    for (int k = 0; k < 2; ++k)
      f += static_cast<double>(me.experts[t][static_cast<size_t>(k)] + 1) *
           me.probs[t][static_cast<size_t>(k)];
    const int64_t ti = static_cast<int64_t>(t);
    TORCH_CHECK(at::allclose(out[ti], me.x[ti] * f, 1e-12, 1e-12), "combine: token ", t,
                " of rank ", rank);
    TORCH_CHECK(at::allclose(x.grad()[ti], me.c[ti] * f, 1e-12, 1e-12), "backward: token ", t,
                " of rank ", rank);
  }
  for (int64_t j = 0; j < local; ++j) {  // each expert learns from every rank's tokens
    const int64_t g = rank * local + j;
    double expect = 0;
    for (const Data& s : data) {
      for (size_t t = 0; t < s.experts.size(); ++t) {
        for (int k = 0; k < 2; ++k) {
          if (s.experts[t][static_cast<size_t>(k)] != g) continue;
          expect +=
              s.probs[t][static_cast<size_t>(k)] *
              at::dot(s.x[static_cast<int64_t>(t)], s.c[static_cast<int64_t>(t)]).item<double>();
        }
      }
    }
    TORCH_CHECK(std::abs(w.grad()[j].item<double>() - expect) < 1e-10 * (1 + std::abs(expect)),
                "backward: expert ", g, "'s gradient ", w.grad()[j].item<double>(), ", expected ",
                expect);
  }
  return {{"rows_received", d.tokens.size(0)}, {"rows_sent", permuted.size(0)}};
}

// Three training steps of `c` on global batch `global_batch`: per step what the tests compare,
// and the parameters' digest after them.
// With `batch_schedule` (--step-batch-size-schedule's text) instead of one global batch.
nlohmann::json three_steps(const TransformerConfig& c, int64_t global_batch,
                           const std::string& batch_schedule = "") {
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

// Pipeline parallelism: three steps per recompute and fine-grained offload strategy (layer-level
// offload is refused under pipeline parallelism, as in Megatron) without gradient clipping, so the
// parameters after them depend on the gradients alone (the reported norm is computed per stage and
// summed). Each rank reports its steps, its stage, and every parameter's digest under its
// single-process name (decoder.layers.<global index>...; the last stage's copy of a tied embedding
// as output_layer.weight).
TransformerConfig moe_config(int tp, int ep, bool dropout, const std::string& dispatcher,
                             const std::string& variant);
std::vector<std::pair<std::string, Mutator>> moe_strategies();

// variant moe / moe_capacity: the MoE model of run_experts (dropless / capacity factor 1, whose
// predicted bytes follow each micro-batch's routing), its experts over `ep` ranks, under
// moe_strategies().
nlohmann::json run_pipeline(int t, int pp, int ep, bool dropout, int64_t global_batch,
                            const std::string& only, const std::string& variant,
                            std::optional<int64_t> first, std::optional<int64_t> last,
                            int64_t layers, int64_t vp) {
  nlohmann::json out;
  const bool moe = variant.rfind("moe", 0) == 0;
  auto all = moe ? moe_strategies() : strategies(false, variant.rfind("mla", 0) == 0);
  // With 3 layers per stage: uniform chunks [0, 2) [2, 3) on every stage (a clamped tail).
  all.emplace_back("full_uniform_2", [](TransformerConfig& c) {
    c.recompute_granularity = "full";
    c.recompute_method = "uniform";
    c.recompute_num_layers = 2;
  });
  if (!moe) {
    // Block 1 with --num-microbatches-with-partial-activation-checkpoints 1 (set below): per
    // window of a stage's outstanding forwards the first keeps block 1's bytes, the others
    // checkpoint every layer.
    all.emplace_back("full_block_1_partial_1", [](TransformerConfig& c) {
      c.recompute_granularity = "full";
      c.recompute_method = "block";
      c.recompute_num_layers = 1;
    });
  }
  // Offload beside selective recompute, each commit waiting for its copy (the in-flight cap 0).
  all.emplace_back("offload_fine_grained_selective", [moe](TransformerConfig& c) {
    c.fine_grained_activation_offloading = true;
    c.offload_modules = {"attn_norm", "qkv_linear", "mlp_norm"};
    c.min_offloaded_tensor_size = 0;
    c.fine_grained_offloading_max_inflight_offloads = 0;
    c.recompute_granularity = "selective";
    c.recompute_modules = {"core_attn", moe ? "moe_act" : "mlp", "layernorm"};
  });
  for (const auto& [name, mutate] : all) {
    if (!only.empty() && name != only) continue;
    if (name.rfind("offload_layers", 0) == 0 || (t == 1 && name.rfind("distribute_", 0) == 0))
      continue;
    TransformerConfig c =
        moe ? moe_config(t, ep, dropout, "alltoall", variant == "moe" ? "base" : "capacity")
            : base_config(t, false, dropout, variant);
    c.num_layers = layers;
    c.pipeline_model_parallel_size = pp;
    c.decoder_first_pipeline_num_layers = first;
    c.decoder_last_pipeline_num_layers = last;
    if (vp > 1) c.num_virtual_stages_per_pipeline_rank = vp;
    mutate(c);
    // With copies still in flight at a forward's end a stage can hold what the plain run holds
    // (the MoE groups are small; the dense run did so once under load too). Each commit waits
    // for its copy, so the tests' "holds less" does not depend on the copy thread's timing.
    if (c.fine_grained_activation_offloading) c.fine_grained_offloading_max_inflight_offloads = 0;
    // n counts a model chunk's (a stage's) layers: skip what fits no chunk.
    int64_t largest = 0;
    for (int64_t stage = 0; stage < pp; ++stage) {
      for (int64_t k = 0; k < c.virtual_pipeline_size(); ++k) {
        largest = std::max(largest, c.model_chunk_layers(stage, k).count);
      }
    }
    if (c.recompute_num_layers && *c.recompute_num_layers > largest) continue;
    actmem::TrainingConfig tc;
    tc.global_batch_size = global_batch;
    tc.eval_interval = 0;
    tc.clip_grad = 0.0;
    if (name == "full_block_1_partial_1")
      tc.num_microbatches_with_partial_activation_checkpoints = 1;
    actmem::Trainer trainer(c, tc);
    nlohmann::json r;
    for (int i = 0; i < 3; ++i) {
      const actmem::IterationStats st = trainer.train_step(true);
      r["steps"].push_back(
          {{"loss", st.loss},
           {"grad_norm", st.grad_norm},
           {"grad_digest", st.grad_digest},
           {"activation_bytes", st.activation_bytes},
           {"predicted_activation_bytes", st.predicted_activation_bytes},
           {"inflight_activation_bytes", st.inflight_activation_bytes},
           {"predicted_inflight_activation_bytes", st.predicted_inflight_activation_bytes},
           {"peak_device_bytes", st.peak_device_bytes},
           {"offloaded_bytes", st.offloaded_bytes},
           {"offload_wait_s", st.offload_wait_s},
           {"host_peak_bytes", st.host_peak_bytes}});
      if (moe) {
        r["steps"].back().update({{"load_balancing_loss", st.load_balancing_loss.value_or(-1.0)},
                                  {"z_loss", st.z_loss.value_or(-1.0)},
                                  {"routed", st.moe_routed_tokens},
                                  {"dropped", st.moe_dropped_tokens},
                                  {"imbalance", st.expert_load_imbalance}});
      }
    }
    // The trainer's up-front bound for this stage (Note [Memory pre-check] in
    // activation_bytes.cpp).
    const auto& pp_group = actmem::pipeline_parallel_group();
    const int64_t n_micro =
        tc.num_microbatches(c.micro_batch_size, actmem::data_parallel_group().size);
    if (vp > 1) {
      const actmem::PipelineMemory counts = actmem::pipeline_memory(
          actmem::interleaved_schedule(pp_group.rank, pp_group.size, vp, n_micro,
                                       c.microbatch_group_size()),
          pp_group.rank, pp_group.size, std::vector<int64_t>(static_cast<size_t>(vp), 0), 0);
      r["peak_bound"] = actmem::predict_step_peak_bound(c, 0, pp_group.rank, counts.max_in_flight,
                                                        counts.max_boundary_tensors + 2);
    } else {
      r["peak_bound"] = actmem::predict_step_peak_bound(
          c, 0, pp_group.rank,
          actmem::one_f_one_b_in_flight(pp_group.rank, pp_group.size, n_micro));
    }
    const actmem::GPTModel& model = trainer.model();
    for (const auto& item : model.named_parameters()) {
      // Model chunk c's block is registered as decoder (c = 0) or decoder_vp<c>; its layers are
      // numbered from 0 within the chunk.
      std::string key = item.key();
      int64_t chunk = 0;
      if (key.rfind("decoder_vp", 0) == 0) {
        const size_t dot = key.find('.');
        chunk = std::stoll(key.substr(10, dot - 10));
        key = "decoder" + key.substr(dot);
      }
      const std::string prefix = "decoder.layers.";
      if (key.rfind(prefix, 0) == 0) {
        const size_t dot = key.find('.', prefix.size());
        key = prefix +
              std::to_string(std::stoll(key.substr(prefix.size(), dot - prefix.size())) +
                             model.stage_layers(chunk).offset) +
              key.substr(dot);
      }
      actmem::Digest d;
      d.update(item.value());
      r["params"][key] = d.hex();
    }
    int64_t stage_layers = 0;
    for (int64_t k = 0; k < model.num_model_chunks(); ++k) {
      r["chunk_offsets"].push_back(model.stage_layers(k).offset);
      stage_layers += model.stage_layers(k).count;
    }
    r["stage_offset"] = model.stage_layers(0).offset;
    r["stage_layers"] = stage_layers;
    out[name] = r;
  }
  return {{"strategies", out},
          {"pp_rank", actmem::pipeline_parallel_group().rank},
          {"tp_rank", actmem::tensor_parallel_group().rank}};
}

// A stage dying in the middle of the 1F1B schedule: the others are blocked in a send or receive
// to it, and only the launcher can stop them (Launch.AStageKilledMidScheduleStopsEveryWorker).
nlohmann::json run_pipeline_fault(int die_stage) {
  const actmem::TensorParallelGroup& pp = actmem::pipeline_parallel_group();
  const actmem::PipelineP2P p2p(pp, {4}, at::TensorOptions().dtype(at::kFloat));
  int64_t forwards = 0;
  actmem::run_one_f_one_b(
      p2p, 4,
      [&](int64_t m, const at::Tensor& input) {
        if (pp.rank == die_stage && m == 2) std::raise(SIGKILL);
        ++forwards;
        return input.defined() ? input + 1 : at::ones({4});
      },
      [&](int64_t, const at::Tensor& grad) { return grad.defined() ? grad * 2 : at::ones({4}); });
  return {{"forwards", forwards}};
}

// Data parallelism: the ranks train the base model on one global batch per step; each reports its
// steps (loss, gradient norm, its gradient digest) and its place in the layout.
nlohmann::json run_data(int t, bool dropout, int64_t global_batch,
                        const std::string& batch_schedule) {
  TransformerConfig c = base_config(t, false, dropout);
  return {{"steps", three_steps(c, global_batch, batch_schedule)["steps"]},
          {"tp_rank", actmem::tensor_parallel_group().rank},
          {"dp_rank", actmem::data_parallel_group().rank},
          {"dp_size", actmem::data_parallel_group().size}};
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

// Data parallelism with and without --overlap-grad-reduce (buckets of `bucket` elements) on the
// same layout (t x p x d, the interleaved schedule with vp > 1): three steps each, dropout as
// asked; per step what the tests compare and how many buckets started during backward.
nlohmann::json run_overlap(int t, int pp, int64_t vp, int64_t layers, bool dropout,
                           int64_t global_batch, int64_t bucket) {
  nlohmann::json out;
  for (const bool overlap : {false, true}) {
    const TransformerConfig c = with_pipeline(base_config(t, false, dropout), layers, pp, vp);
    actmem::TrainingConfig tc = step_training(global_batch);
    tc.overlap_grad_reduce = overlap;
    if (overlap) tc.ddp_bucket_size = bucket;
    actmem::Trainer trainer(c, tc);
    nlohmann::json r;
    for (int i = 0; i < 3; ++i) {
      const actmem::IterationStats st = trainer.train_step(true);
      nlohmann::json step = {
          {"loss", st.loss}, {"grad_norm", st.grad_norm}, {"grad_digest", st.grad_digest}};
      if (const actmem::GradReducer* reducer = trainer.grad_reducer()) {
        step["buckets"] = reducer->buckets();
        step["started_in_backward"] = reducer->started_in_backward();
      }
      r["steps"].push_back(step);
    }
    r["param_digest"] = param_digest(trainer.model());
    out[overlap ? "overlap" : "plain"] = r;
  }
  out["dp_size"] = actmem::data_parallel_group().size;
  out["pp_rank"] = actmem::pipeline_parallel_group().rank;
  return out;
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
              "actmem_tp_worker: unknown MoE variant ", variant);
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

// The distributed optimizer against the replicated one on the same layout (t x p x d, the
// interleaved schedule with vp > 1; buckets of `bucket` elements with --overlap-grad-reduce, one
// per group with bucket 0): three steps each, dropout as asked, clip-grad on. Reports per step what
// the tests compare, the parameters' digest, this rank's share of the optimizer state and the
// tracker's device bytes once the trainer holds its state. With p = 1 also resumes across the
// two: a checkpoint saved by either continues bitwise in the other.
nlohmann::json run_distopt(int t, int pp, int ep, int64_t vp, int64_t layers, bool dropout,
                           int64_t global_batch, int64_t bucket, const std::string& variant,
                           const std::string& dir) {
  auto make = [&](bool dist) {
    // variant moe: the MoE model of run_experts, its experts sharded over the
    // expert-data-parallel group and the rest over the data-parallel group.
    const TransformerConfig c =
        with_pipeline(variant == "moe" ? moe_config(t, ep, dropout, "alltoall", "base")
                                       : base_config(t, false, dropout, variant),
                      layers, pp, vp);
    actmem::TrainingConfig tc = step_training(global_batch);
    tc.clip_grad = 0.05;  // small enough to clip: the coefficient comes from the whole gradient
    tc.use_distributed_optimizer = dist;
    if (bucket > 0) {
      tc.overlap_grad_reduce = true;
      tc.ddp_bucket_size = bucket;
    }
    return std::make_unique<actmem::Trainer>(c, tc);
  };
  auto step_json = [](const actmem::IterationStats& st) {
    return nlohmann::json{
        {"loss", st.loss}, {"grad_norm", st.grad_norm}, {"grad_digest", st.grad_digest}};
  };
  nlohmann::json out;
  for (const bool dist : {false, true}) {
    auto trainer = make(dist);
    trainer->memory().reset_peak();
    nlohmann::json r;
    for (int i = 0; i < 3; ++i) r["steps"].push_back(step_json(trainer->train_step(true)));
    r["param_digest"] = param_digest(trainer->model());
    r["device_bytes"] = trainer->memory().current_bytes();
    r["peak"] = trainer->memory().peak_bytes();
    if (pp == 1) {
      // The trainer's memory pre-check, with the optimizer state split d ways.
      const int64_t d =
          std::min(actmem::data_parallel_group().size, actmem::expert_data_parallel_group().size);
      r["peak_bound"] =
          actmem::predict_step_peak_bound(trainer->model().config(), 0, 0, 1, dist ? d : 1);
    }
    if (const actmem::OptimizerShards* shards = trainer->optimizer_shards()) {
      r["owned"] = shards->owned_elements();
      r["total"] = shards->total_elements();
      r["buckets"] = shards->buckets();
    }
    out[dist ? "distributed" : "plain"] = r;
  }
  if (pp == 1) {
    // Two steps, a checkpoint, the third step: saved by one optimizer, resumed by the other.
    for (const bool dist : {false, true}) {
      const std::string ckpt = dir + (dist ? "/ckpt_distributed" : "/ckpt_plain");
      {
        auto saver = make(dist);
        saver->train_step(false);
        saver->train_step(false);
        saver->save_checkpoint(ckpt);
      }
      auto resumed = make(!dist);
      resumed->load_checkpoint(ckpt);
      nlohmann::json r = step_json(resumed->train_step(true));
      r["param_digest"] = param_digest(resumed->model());
      out[dist ? "resumed_from_distributed" : "resumed_from_plain"] = r;
    }
  }
  out["dp_size"] = actmem::data_parallel_group().size;
  out["dp_rank"] = actmem::data_parallel_group().rank;
  out["pp_rank"] = actmem::pipeline_parallel_group().rank;
  out["tp_rank"] = actmem::tensor_parallel_group().rank;
  return out;
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

nlohmann::json run_experts(int tp, int ep, bool dropout, int64_t global_batch,
                           const std::string& dispatcher, const std::string& only,
                           const std::string& variant) {
  nlohmann::json out;
  for (const auto& [name, mutate] : moe_strategies()) {
    if (!only.empty() && name != only) continue;
    TransformerConfig c = moe_config(tp, ep, dropout, dispatcher, variant);
    mutate(c);
    out[name] = three_steps(c, global_batch);
  }
  return {{"strategies", out},
          {"tp_rank", actmem::tensor_parallel_group().rank},
          {"ep_rank", actmem::expert_parallel_group().rank},
          {"ep_size", actmem::expert_parallel_group().size},
          {"edp_size", actmem::expert_data_parallel_group().size},
          {"dp_rank", actmem::data_parallel_group().rank},
          {"dp_size", actmem::data_parallel_group().size}};
}

// Expert dropout: the same rows through this rank's experts under the trainer's streams for
// expert-parallel rank r (seed + 1024 + 100 r); the saved dropout masks of all ranks gathered.
// Each rank also redraws every other rank's mask from that rank's seed: equal to what the rank
// drew, so the difference comes from the stream, not from the rows.
nlohmann::json run_expert_masks() {
  const auto& ep = actmem::expert_parallel_group();
  TransformerConfig c = moe_config(1, ep.size, true, "alltoall", "base");
  c.moe_expert_dropout = 0.5;
  const actmem::ActivationPlan plan = actmem::make_activation_plan(c);
  actmem::Experts experts(c, plan.layers[0], at::kFloat);
  experts.train();
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const int64_t rows = 64, local = c.num_moe_experts / ep.size;
  const at::Tensor x = at::randn({rows, c.hidden_size}, gen);
  const at::Tensor probs = at::ones({rows});
  std::vector<int64_t> counts(static_cast<size_t>(local), rows / local);
  auto draw = [&](int ep_rank) {
    actmem::RngStatesTracker streams = actmem::make_model_parallel_tracker(c.seed, 0, ep_rank, 0);
    std::swap(actmem::get_rng_tracker(), streams);
    MaskCollector collector;
    {
      actmem::SavedTensorHooksGuard guard(collector);
      experts.forward(x, counts, probs, nullptr);
    }
    std::swap(actmem::get_rng_tracker(), streams);
    TORCH_CHECK(collector.masks.size() == 1, "expert masks: ", collector.masks.size(),
                " masks saved");
    return collector.masks[0].second.to(at::kByte);
  };
  const at::Tensor mine = draw(ep.rank);
  const at::Tensor all = actmem::all_gather_tokens(mine.unsqueeze(0), ep);
  nlohmann::json out;
  out["dropped_fraction"] = 1.0 - mine.to(at::kDouble).mean().item<double>();
  out["ep_rank"] = ep.rank;
  for (int r = 0; r < ep.size; ++r) {
    out["equal_to_rank"].push_back(at::equal(all[r], mine));
    out["redrawn_equal"].push_back(at::equal(draw(r), all[r]));
  }
  return out;
}

int main(int argc, char** argv) {
  actmem::set_reproducible_blas();  // Note [Reproducible products] in blas.h
  try {
    TORCH_CHECK(argc >= 3,
                "usage: actmem_tp_worker strategies|masks OUT_DIR [--sp] "
                "[--no-dropout] [--only NAME]");
    const std::string scenario = argv[1], out_dir = argv[2];
    bool sp = false, dropout = true;
    std::string only, variant = "base";
    int tp = 0, ep = 1, pp = 1;
    int64_t layers = 4, vp = 1;
    int die_stage = -1;
    std::optional<int64_t> first_layers, last_layers;
    int64_t global_batch = 0, bucket = 0;
    std::string dispatcher = "alltoall", batch_schedule;
    for (int i = 3; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--sp") {
        sp = true;
      } else if (a == "--no-dropout") {
        dropout = false;
      } else if (a == "--only" && i + 1 < argc) {
        only = argv[++i];
      } else if (a == "--variant" && i + 1 < argc) {
        variant = argv[++i];
      } else if (a == "--tp" && i + 1 < argc) {
        tp = std::stoi(argv[++i]);
      } else if (a == "--ep" && i + 1 < argc) {
        ep = std::stoi(argv[++i]);
      } else if (a == "--pp" && i + 1 < argc) {
        pp = std::stoi(argv[++i]);
      } else if (a == "--die" && i + 1 < argc) {
        die_stage = std::stoi(argv[++i]);
      } else if (a == "--vp" && i + 1 < argc) {
        vp = std::stoll(argv[++i]);
      } else if (a == "--layers" && i + 1 < argc) {
        layers = std::stoll(argv[++i]);
      } else if (a == "--first" && i + 1 < argc) {
        first_layers = std::stoll(argv[++i]);
      } else if (a == "--last" && i + 1 < argc) {
        last_layers = std::stoll(argv[++i]);
      } else if (a == "--dispatcher" && i + 1 < argc) {
        dispatcher = argv[++i];
      } else if (a == "--bucket" && i + 1 < argc) {
        bucket = std::stoll(argv[++i]);
      } else if (a == "--global-batch" && i + 1 < argc) {
        global_batch = std::stoll(argv[++i]);
      } else if (a == "--batch-schedule" && i + 1 < argc) {
        batch_schedule = argv[++i];
      } else {
        TORCH_CHECK(false, "actmem_tp_worker: unknown argument ", a);
      }
    }
    at::set_num_threads(1);  // N ranks share this machine's cores
    const actmem::DistEnv env = actmem::dist_env_from_environment();
    const auto& group = actmem::init_tensor_parallel_from_environment(env, c10::kCPU, tp, ep, pp);
    nlohmann::json result = {{"rank", group.rank}, {"world_size", group.size}};
    if (scenario == "strategies") {
      result["strategies"] = run_strategies(group.size, sp, dropout, only, variant);
    } else if (scenario == "masks") {
      result["masks"] = run_masks(group.size, sp);
    } else if (scenario == "dispatch") {
      result["dispatch"] = run_dispatch(group);
    } else if (scenario == "pipeline") {
      result["pipeline"] = run_pipeline(std::max(tp, 1), pp, ep, dropout, global_batch, only,
                                        variant, first_layers, last_layers, layers, vp);
    } else if (scenario == "pipeline_fault") {
      result["pipeline_fault"] = run_pipeline_fault(die_stage);
    } else if (scenario == "overlap") {
      result["overlap"] =
          run_overlap(std::max(tp, 1), pp, vp, layers, dropout, global_batch, bucket);
    } else if (scenario == "distopt") {
      result["distopt"] = run_distopt(std::max(tp, 1), pp, ep, vp, layers, dropout, global_batch,
                                      bucket, variant, out_dir);
    } else if (scenario == "data") {
      result["data"] = run_data(group.size, dropout, global_batch, batch_schedule);
    } else if (scenario == "experts") {
      result["experts"] =
          run_experts(std::max(tp, 1), ep, dropout, global_batch, dispatcher, only, variant);
    } else if (scenario == "expert_masks") {
      result["expert_masks"] = run_expert_masks();
    } else {
      TORCH_CHECK(false, "actmem_tp_worker: unknown scenario ", scenario);
    }
    std::ofstream f(out_dir + "/rank" + std::to_string(env.rank) + ".json");
    f << result.dump(1) << "\n";
    TORCH_CHECK(f.good(), "actmem_tp_worker: cannot write to ", out_dir);
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "actmem_tp_worker: " << e.what() << std::endl;
    return 1;
  }
}
