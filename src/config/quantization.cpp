// quantization.cpp — FP8 and FP4 training's settings (config.h): Megatron's rules for them, the
// layers that run quantized, their JSON. What runs is in src/model/fp8.cpp (docs/fp8.md).
#include "actmem/config/config.h"

#include <nlohmann/json.hpp>

namespace actmem {

bool TransformerConfig::quantized_layer(int64_t layer) const {
  if (fp8.empty() && fp4.empty()) return false;
  // Megatron's is_first_last_bf16_layer (megatron/core/fp8_utils.py), over global layer indices.
  if (!first_last_layers_bf16) return true;
  return layer >= num_layers_at_start_in_bf16 && layer < num_layers - num_layers_at_end_in_bf16;
}

void TransformerConfig::validate_quantization() const {
  const char* api = "actmem::TransformerConfig: ";
  TORCH_CHECK(fp8.empty() || fp8 == "e4m3" || fp8 == "hybrid", api,
              "--fp8-format must be e4m3 or hybrid, got \"", fp8, "\"");
  TORCH_CHECK(fp4.empty() || fp4 == "e2m1", api, "--fp4-format must be e2m1, got \"", fp4, "\"");
  TORCH_CHECK(fp8_recipe == "delayed" || fp8_recipe == "tensorwise" || fp8_recipe == "mxfp8" ||
                  fp8_recipe == "blockwise" || fp8_recipe == "custom",
              api,
              "--fp8-recipe must be one of tensorwise, delayed, mxfp8, blockwise, custom, got \"",
              fp8_recipe, "\"");
  TORCH_CHECK(fp4_recipe == "nvfp4" || fp4_recipe == "custom", api,
              "--fp4-recipe must be nvfp4 or custom, got \"", fp4_recipe, "\"");
  TORCH_CHECK(fp8_amax_compute_algo == "most_recent" || fp8_amax_compute_algo == "max", api,
              "--fp8-amax-compute-algo must be most_recent or max, got \"", fp8_amax_compute_algo,
              "\"");
  // actmem's bounds (Transformer Engine checks neither): a window each GEMM keeps three of, and a
  // margin whose 2^margin stays far inside fp32's exponents (beyond it every scale is 0 or inf).
  TORCH_CHECK(fp8_amax_history_len >= 1 && fp8_amax_history_len <= (1 << 16), api,
              "--fp8-amax-history-len must be in [1, 65536] (the amax window), got ",
              fp8_amax_history_len);
  TORCH_CHECK(fp8_margin >= -64 && fp8_margin <= 64, api,
              "--fp8-margin must be in [-64, 64] (the scale is divided by 2^margin), got ",
              fp8_margin);
  // Megatron's TransformerConfig.__post_init__ (megatron/core/transformer/transformer_config.py),
  // its messages.
  if (!fp8.empty()) {
    TORCH_CHECK(!(first_last_layers_bf16 && fp8_recipe == "delayed"), api,
                "Delayed scaling does not support first / last layer in BF16.");
    const int64_t per_stage = num_layers / pipeline_model_parallel_size;
    if (first_last_layers_bf16) {
      TORCH_CHECK(num_layers_at_start_in_bf16 >= 0 && num_layers_at_start_in_bf16 <= per_stage, api,
                  "num_layers_at_start_in_bf16 (", num_layers_at_start_in_bf16,
                  ") must be between 0 and number of layers per pipeline stage (", per_stage, ").");
      TORCH_CHECK(num_layers_at_end_in_bf16 >= 0 && num_layers_at_end_in_bf16 <= per_stage, api,
                  "num_layers_at_end_in_bf16 (", num_layers_at_end_in_bf16,
                  ") must be between 0 and number of layers per pipeline stage (", per_stage, ").");
    }
    TORCH_CHECK(fp8_recipe != "custom", api,
                "fp8_quantizer_factory must be provided when fp8_recipe is 'custom'. "
                "(a Python import path Megatron loads; actmem has no Python quantizers)");
  }
  TORCH_CHECK(fp4.empty() || fp8.empty(), api,
              "fp4 and fp8 cannot be used simultaneously. Please choose one.");
  TORCH_CHECK(fp4.empty() || fp4_recipe != "custom", api,
              "fp4_quantizer_factory must be provided when fp4_recipe is 'custom'. (a Python "
              "import path Megatron loads; actmem has no Python quantizers)");
  if (fp8.empty() && fp4.empty()) return;
  // Transformer Engine quantizes the 16-bit activations of a --bf16 or --fp16 run.
  TORCH_CHECK(bf16 || fp16, api, fp8.empty() ? "--fp4-format" : "--fp8-format",
              " quantizes the GEMMs of a 16-bit run: add --bf16 (an fp32 run has no FP8 path)");
  // What actmem runs so far (issue 64 lands in steps; docs/fp8.md says which).
  TORCH_CHECK(fp4.empty(), api,
              "--fp4-format (NVFP4) is not implemented in actmem yet; FP8 runs with "
              "--fp8-recipe delayed or tensorwise");
  TORCH_CHECK(fp8_recipe == "delayed" || fp8_recipe == "tensorwise", api, "--fp8-recipe ",
              fp8_recipe,
              " is not implemented in actmem yet (block scales); use delayed or tensorwise");
  TORCH_CHECK(tensor_model_parallel_size == 1, api,
              "FP8 under tensor parallelism (the quantized all-gathers and the amax reduction "
              "over the tensor-parallel ranks) is not implemented in actmem yet");
  TORCH_CHECK(num_moe_experts == 0 && !multi_latent_attention, api,
              "FP8 covers the standard attention, Gated DeltaNet and dense MLP layers in actmem "
              "so far; the MoE experts' and MLA's FP8 GEMMs are not implemented yet");
}

nlohmann::json quantization_json(const TransformerConfig& c) {
  return {{"fp8", c.fp8.empty() ? nlohmann::json(nullptr) : nlohmann::json(c.fp8)},
          {"fp8_recipe", c.fp8_recipe},
          {"fp8_margin", c.fp8_margin},
          {"fp8_amax_history_len", c.fp8_amax_history_len},
          {"fp8_amax_compute_algo", c.fp8_amax_compute_algo},
          {"fp8_wgrad", c.fp8_wgrad},
          {"first_last_layers_bf16", c.first_last_layers_bf16},
          {"num_layers_at_start_in_bf16", c.num_layers_at_start_in_bf16},
          {"num_layers_at_end_in_bf16", c.num_layers_at_end_in_bf16},
          {"fp4", c.fp4.empty() ? nlohmann::json(nullptr) : nlohmann::json(c.fp4)},
          {"fp4_recipe", c.fp4_recipe}};
}

void quantization_from_json(const nlohmann::json& a, TransformerConfig& c) {
  auto get = [&a](const char* key, auto& field) {
    if (!a.contains(key) || a[key].is_null()) return;
    try {
      field = a[key].get<std::decay_t<decltype(field)>>();
    } catch (const nlohmann::json::exception&) {
      TORCH_CHECK(false, "actmem::quantization_from_json: the field ", key, " is ", a[key].dump(),
                  ", not a value of the field's type");
    }
  };
  get("fp8", c.fp8);
  get("fp8_recipe", c.fp8_recipe);
  get("fp8_margin", c.fp8_margin);
  get("fp8_amax_history_len", c.fp8_amax_history_len);
  get("fp8_amax_compute_algo", c.fp8_amax_compute_algo);
  get("fp8_wgrad", c.fp8_wgrad);
  get("first_last_layers_bf16", c.first_last_layers_bf16);
  get("num_layers_at_start_in_bf16", c.num_layers_at_start_in_bf16);
  get("num_layers_at_end_in_bf16", c.num_layers_at_end_in_bf16);
  get("fp4", c.fp4);
  get("fp4_recipe", c.fp4_recipe);
}

}  // namespace actmem
