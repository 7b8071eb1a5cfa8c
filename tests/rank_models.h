// rank_models.h — the small models and strategies the multi-process tests' ranks train
// (parallel_workers.h), shared by the test files that register those ranks.
#pragma once

#include "actmem/config/config.h"
#include "actmem/model/model.h"
#include "actmem/recompute/saved_tensor_hooks.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace actmem::testing {

using Mutator = std::function<void(TransformerConfig&)>;

/// The base model (4 layers, h 64, 4 heads, seq 32, micro-batch 4) over `t` tensor-parallel
/// ranks, dropout 0.1 or none; `variant` changes it: bf16, fp16, swiglu (RMSNorm, SwiGLU, RoPE,
/// untied output, no linear biases), gqa, mla, mla_no_q_lora, gdn, gated, unfused, flash_gqa.
TransformerConfig base_config(int t, bool sp, bool dropout, const std::string& variant = "base");

/// The recompute and offload strategies every layout is checked under, by name (`mla`: with
/// mla_up_proj's; without `sp`: with distribute-saved-activations, refused under sequence
/// parallelism).
std::vector<std::pair<std::string, Mutator>> strategies(bool sp, bool mla);

/// An MoE model (4 experts, top-2, shared experts, aux and z losses) over `tp` x `ep` ranks;
/// `variant`: base (dropless), capacity, padded, gated_bias, seq_aux.
TransformerConfig moe_config(int tp, int ep, bool dropout, const std::string& dispatcher,
                             const std::string& variant);

/// The recompute and offload strategies an MoE layout is checked under.
std::vector<std::pair<std::string, Mutator>> moe_strategies();

/// The digest of every parameter of `model`, in order.
std::string param_digest(GPTModel& model);

/// Three training steps (see rank_models.cpp).
nlohmann::json three_steps(const TransformerConfig& c, int64_t global_batch,
                           const std::string& batch_schedule = "");

/// `c` with `layers` layers over `pp` stages of `vp` model chunks each.
TransformerConfig with_pipeline(TransformerConfig c, int64_t layers, int pp, int64_t vp);

/// Training on global batches of `global_batch` samples, no evaluation.
TrainingConfig step_training(int64_t global_batch);

/// Records every dropout mask (bool tensor) saved in one training forward, with its module.
class MaskCollector : public SavedTensorHook {
 public:
  std::shared_ptr<PackedTensor> pack(const at::Tensor& t) override;
  std::vector<std::pair<std::string, at::Tensor>> masks;
};

}  // namespace actmem::testing
