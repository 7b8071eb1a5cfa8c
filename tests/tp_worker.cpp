// tp_worker.cpp — one rank of the tensor-parallel tests (test_tensor_parallel.cpp starts N of
// them with launch_workers). Each rank trains or probes a small model with t = WORLD_SIZE and
// writes what it measured to OUT_DIR/rank<R>.json; the test process compares the ranks' files.
//
//   actmem_tp_worker strategies OUT_DIR [--sp] [--no-dropout] [--only NAME] [--variant V]
//     V = base (LayerNorm, GeLU, learned positions, tied output, biases) or
//         swiglu (RMSNorm, SwiGLU, RoPE, untied output layer, no linear biases)
//   actmem_tp_worker masks OUT_DIR [--sp]
#include "actmem/digest.h"
#include "actmem/distributed.h"
#include "actmem/ledger.h"
#include "actmem/saved_tensor_hooks.h"
#include "actmem/tensor_parallel.h"
#include "actmem/trainer.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <functional>
#include <iostream>
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
  if (variant == "bf16") {
    c.bf16 = true;
    c.attention_softmax_in_fp32 = true;
  } else if (variant == "swiglu") {
    c.normalization = "RMSNorm";
    c.gated_linear_unit = true;
    c.position_embedding_type = "rope";
    c.untie_embeddings_and_output_weights = true;
    c.add_bias_linear = false;
  } else {
    TORCH_CHECK(variant == "base", "actmem_tp_worker: unknown variant ", variant);
  }
  return c;
}

std::vector<std::pair<std::string, Mutator>> strategies(bool sp) {
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
  for (const auto& [name, mutate] : strategies(sp)) {
    if (!only.empty() && name != only) continue;
    TransformerConfig c = base_config(t, sp, dropout, variant);
    mutate(c);
    actmem::TrainingConfig tc;
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
    out.push_back({{"module", module}, {"shape", mask.sizes().vec()}, {"same_on_all_ranks", same},
                   {"dropped_fraction", 1.0 - mask.to(at::kDouble).mean().item<double>()}});
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    TORCH_CHECK(argc >= 3, "usage: actmem_tp_worker strategies|masks OUT_DIR [--sp] "
                "[--no-dropout] [--only NAME]");
    const std::string scenario = argv[1], out_dir = argv[2];
    bool sp = false, dropout = true;
    std::string only, variant = "base";
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
      } else {
        TORCH_CHECK(false, "actmem_tp_worker: unknown argument ", a);
      }
    }
    at::set_num_threads(1);  // N ranks share this machine's cores
    const actmem::DistEnv env = actmem::dist_env_from_environment();
    const auto& group = actmem::init_tensor_parallel_from_environment(env);
    nlohmann::json result = {{"rank", group.rank}, {"world_size", group.size}};
    if (scenario == "strategies") {
      result["strategies"] = run_strategies(group.size, sp, dropout, only, variant);
    } else if (scenario == "masks") {
      result["masks"] = run_masks(group.size, sp);
    } else {
      TORCH_CHECK(false, "actmem_tp_worker: unknown scenario ", scenario);
    }
    std::ofstream f(out_dir + "/rank" + std::to_string(group.rank) + ".json");
    f << result.dump(1) << "\n";
    TORCH_CHECK(f.good(), "actmem_tp_worker: cannot write to ", out_dir);
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "actmem_tp_worker: " << e.what() << std::endl;
    return 1;
  }
}
