// config.cpp — TransformerConfig and TrainingConfig: validation and JSON.
#include "actmem/config.h"

#include "actmem/activation_plan.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <utility>

namespace actmem {

namespace {
void check_positive(int64_t value, const char* name) {
  TORCH_CHECK(value > 0, "actmem::TransformerConfig: ", name, " must be positive, got ", value);
}
void check_dropout(double p, const char* name) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "actmem::TransformerConfig: ", name,
              " must be in [0, 1), got ", p);
}
}  // namespace

void TransformerConfig::validate() const { make_activation_plan(*this); }

void TransformerConfig::validate_shape() const {
  check_positive(num_layers, "num_layers");
  check_positive(hidden_size, "hidden_size");
  check_positive(num_attention_heads, "num_attention_heads");
  TORCH_CHECK(hidden_size % num_attention_heads == 0,
              "actmem::TransformerConfig: num_attention_heads (", num_attention_heads,
              ") must divide hidden_size (", hidden_size, ")");
  TORCH_CHECK(ffn_hidden_size >= 0, "actmem::TransformerConfig: ffn_hidden_size must be positive "
              "(or 0 for 4 * hidden_size), got ", ffn_hidden_size);
  check_positive(seq_length, "seq_length");
  TORCH_CHECK(max_position_embeddings >= 0, "actmem::TransformerConfig: max_position_embeddings "
              "must be positive (or 0 for seq_length), got ", max_position_embeddings);
  TORCH_CHECK(max_positions() >= seq_length, "actmem::TransformerConfig: max_position_embeddings (",
              max_positions(), ") must be at least seq_length (", seq_length, ")");
  check_positive(micro_batch_size, "micro_batch_size");
  check_positive(vocab_size, "vocab_size");
  check_dropout(attention_dropout, "attention_dropout");
  check_dropout(hidden_dropout, "hidden_dropout");
  TORCH_CHECK(normalization == "LayerNorm" || normalization == "RMSNorm",
              "actmem::TransformerConfig: normalization must be \"LayerNorm\" or \"RMSNorm\", got \"",
              normalization, "\"");
  TORCH_CHECK(layernorm_epsilon > 0.0, "actmem::TransformerConfig: layernorm_epsilon must be "
              "positive, got ", layernorm_epsilon);
  TORCH_CHECK(position_embedding_type == "learned_absolute" || position_embedding_type == "rope",
              "actmem::TransformerConfig: position_embedding_type must be \"learned_absolute\" or "
              "\"rope\", got \"", position_embedding_type, "\"");
  TORCH_CHECK(!use_rope() || kv_channels() % 2 == 0, "actmem::TransformerConfig: rope needs an even "
              "head dimension (hidden_size / num_attention_heads), got ", kv_channels());
  TORCH_CHECK(rotary_base > 0.0, "actmem::TransformerConfig: rotary_base must be positive, got ",
              rotary_base);
  TORCH_CHECK(init_method_std > 0.0, "actmem::TransformerConfig: init_method_std must be "
              "positive, got ", init_method_std);
  TORCH_CHECK(seed >= 1 && seed <= kMaxSeed, "actmem::TransformerConfig: seed must be in [1, ",
              kMaxSeed, "] (Megatron requires seed > 0), got ", seed);
  // Megatron's arguments.py: "assert not args.bf16" under fp16, and the converse.
  TORCH_CHECK(!(bf16 && fp16), "actmem::TransformerConfig: bf16 and fp16 are exclusive; choose "
              "one of --bf16 and --fp16");
  // Tensor and sequence parallelism (docs/parallelism.md): heads, the MLP's columns and, with
  // sequence parallelism, the sequence are split evenly across the t ranks.
  const int64_t t = tensor_model_parallel_size;
  check_positive(t, "tensor_model_parallel_size");
  TORCH_CHECK(num_attention_heads % t == 0, "actmem::TransformerConfig: num_attention_heads (",
              num_attention_heads, ") must be divisible by tensor_model_parallel_size (", t, ")");
  TORCH_CHECK(ffn() % t == 0, "actmem::TransformerConfig: ffn_hidden_size (", ffn(),
              ") must be divisible by tensor_model_parallel_size (", t, ")");
  TORCH_CHECK(pipeline_model_parallel_size == 1, "actmem::TransformerConfig: "
              "pipeline_model_parallel_size must be 1 (pipeline parallelism is not implemented), "
              "got ", pipeline_model_parallel_size);
  TORCH_CHECK(!sequence_parallel || t > 1, "actmem::TransformerConfig: "
              "sequence_parallel requires tensor_model_parallel_size > 1");
  TORCH_CHECK(!sequence_parallel || seq_length % t == 0, "actmem::TransformerConfig: "
              "sequence_parallel needs seq_length (", seq_length, ") divisible by "
              "tensor_model_parallel_size (", t, ")");
  // The recompute and offload rules live with the plan they decide (activation_plan.cpp).
}

nlohmann::json to_json(const TransformerConfig& c) {
  nlohmann::json j = {
      {"num_layers", c.num_layers},
      {"hidden_size", c.hidden_size},
      {"num_attention_heads", c.num_attention_heads},
      {"ffn_hidden_size", c.ffn()},
      {"seq_length", c.seq_length},
      {"max_position_embeddings", c.max_positions()},
      {"micro_batch_size", c.micro_batch_size},
      {"vocab_size", c.vocab_size},
      {"attention_dropout", c.attention_dropout},
      {"hidden_dropout", c.hidden_dropout},
      {"normalization", c.normalization},
      {"layernorm_epsilon", c.layernorm_epsilon},
      {"gated_linear_unit", c.gated_linear_unit},
      {"add_bias_linear", c.add_bias_linear},
      {"position_embedding_type", c.position_embedding_type},
      {"rotary_base", c.rotary_base},
      {"untie_embeddings_and_output_weights", c.untie_embeddings_and_output_weights},
      {"init_method_std", c.init_method_std},
      {"seed", c.seed},
      {"precision", c.precision()},
      {"bf16", c.bf16},
      {"fp16", c.fp16},
      {"attention_softmax_in_fp32", c.attention_softmax_in_fp32},
      {"tensor_model_parallel_size", c.tensor_model_parallel_size},
      {"pipeline_model_parallel_size", c.pipeline_model_parallel_size},
      {"sequence_parallel", c.sequence_parallel},
      {"recompute_granularity", c.recompute_granularity.empty()
                                    ? nlohmann::json(nullptr)
                                    : nlohmann::json(c.recompute_granularity)},
      {"recompute_method", c.recompute_method.empty() ? nlohmann::json(nullptr)
                                                      : nlohmann::json(c.recompute_method)},
      {"recompute_num_layers", c.recompute_num_layers ? nlohmann::json(*c.recompute_num_layers)
                                                      : nlohmann::json(nullptr)},
      {"recompute_modules", c.recompute_granularity == "selective"
                                ? make_activation_plan(c).to_json()["recompute_modules"]
                                : nlohmann::json(nullptr)},
      {"distribute_saved_activations", c.distribute_saved_activations},
      {"cpu_offloading_num_layers", c.cpu_offloading_num_layers},
      {"fine_grained_activation_offloading", c.fine_grained_activation_offloading},
      {"offload_modules", c.offload_modules},
      {"fine_grained_offloading_max_inflight_offloads",
       c.fine_grained_offloading_max_inflight_offloads},
      {"min_offloaded_tensor_size", c.min_offloaded_tensor_size},
  };
  return j;
}

void TrainingConfig::validate(const TransformerConfig& model) const {
  TORCH_CHECK(global_batch_size >= 0, "actmem::TrainingConfig: global_batch_size must be positive, "
              "got ", global_batch_size);
  const int64_t gbs = global_batch(model.micro_batch_size);
  TORCH_CHECK(gbs % model.micro_batch_size == 0, "actmem::TrainingConfig: global_batch_size (", gbs,
              ") must be a multiple of micro_batch_size (", model.micro_batch_size, ")");
  TORCH_CHECK(train_iters > 0, "actmem::TrainingConfig: train_iters must be positive, got ",
              train_iters);
  TORCH_CHECK(lr > 0.0 && std::isfinite(lr), "actmem::TrainingConfig: lr must be positive, got ", lr);
  TORCH_CHECK(min_lr >= 0.0 && min_lr <= lr, "actmem::TrainingConfig: min_lr must be in [0, lr], "
              "got ", min_lr);
  TORCH_CHECK(lr_warmup_iters >= 0, "actmem::TrainingConfig: lr_warmup_iters must be >= 0, got ",
              lr_warmup_iters);
  TORCH_CHECK(lr_decay_style == "constant" || lr_decay_style == "linear" ||
                  lr_decay_style == "cosine",
              "actmem::TrainingConfig: lr_decay_style must be constant, linear or cosine, got \"",
              lr_decay_style, "\"");
  TORCH_CHECK(weight_decay >= 0.0, "actmem::TrainingConfig: weight_decay must be >= 0, got ",
              weight_decay);
  TORCH_CHECK(adam_beta1 >= 0.0 && adam_beta1 < 1.0 && adam_beta2 >= 0.0 && adam_beta2 < 1.0,
              "actmem::TrainingConfig: adam_beta1 and adam_beta2 must be in [0, 1), got ",
              adam_beta1, " and ", adam_beta2);
  TORCH_CHECK(adam_eps > 0.0, "actmem::TrainingConfig: adam_eps must be positive, got ", adam_eps);
  TORCH_CHECK(clip_grad >= 0.0, "actmem::TrainingConfig: clip_grad must be >= 0, got ", clip_grad);
  // Mixed precision (Megatron's arguments.py and optimizer/__init__.py).
  TORCH_CHECK(!(model.bf16 && accumulate_allreduce_grads_in_fp32 == false),
              "actmem::TrainingConfig: bf16 accumulates and reduces gradients in fp32 (Megatron "
              "forces accumulate_allreduce_grads_in_fp32 with bf16); it cannot be turned off");
  TORCH_CHECK(!accumulate_allreduce_grads_in_fp32.value_or(false) || model.bf16 || model.fp16,
              "actmem::TrainingConfig: accumulate_allreduce_grads_in_fp32 applies to --bf16 or "
              "--fp16 (fp32 training already accumulates in fp32)");
  TORCH_CHECK(!loss_scale || model.bf16 || model.fp16, "actmem::TrainingConfig: loss_scale "
              "applies to --fp16 or --bf16 training");
  TORCH_CHECK(!loss_scale || (*loss_scale > 0.0 && std::isfinite(*loss_scale)),
              "actmem::TrainingConfig: loss_scale must be positive and finite, got ",
              loss_scale.value_or(0.0));
  TORCH_CHECK(initial_loss_scale > 0.0 && std::isfinite(initial_loss_scale) &&
                  min_loss_scale > 0.0 && min_loss_scale <= initial_loss_scale,
              "actmem::TrainingConfig: the dynamic loss scale needs 0 < min_loss_scale <= "
              "initial_loss_scale (finite), got ", min_loss_scale, " and ", initial_loss_scale);
  TORCH_CHECK(loss_scale_window >= 1 && hysteresis >= 1, "actmem::TrainingConfig: "
              "loss_scale_window and hysteresis must be at least 1, got ", loss_scale_window,
              " and ", hysteresis);
  TORCH_CHECK(eval_interval >= 0, "actmem::TrainingConfig: eval_interval must be >= 0, got ",
              eval_interval);
  TORCH_CHECK(eval_iters > 0, "actmem::TrainingConfig: eval_iters must be positive, got ",
              eval_iters);
  TORCH_CHECK(log_interval > 0, "actmem::TrainingConfig: log_interval must be positive, got ",
              log_interval);
  const bool cuda_index = device.rfind("cuda:", 0) == 0 && device.size() > 5 &&
                          device.find_first_not_of("0123456789", 5) == std::string::npos;
  TORCH_CHECK(device == "cpu" || device == "cuda" || cuda_index,
              "actmem::TrainingConfig: device must be cpu, cuda or cuda:N, got \"", device, "\"");
  TORCH_CHECK(offload_bandwidth_gbps == 0.0 ||
                  (offload_bandwidth_gbps >= kMinOffloadBandwidthGbps &&
                   offload_bandwidth_gbps <= kMaxOffloadBandwidthGbps),
              "actmem::TrainingConfig: offload_bandwidth_gbps must be 0 (uncapped) or in [",
              kMinOffloadBandwidthGbps, ", ", kMaxOffloadBandwidthGbps, "] GB/s, got ",
              offload_bandwidth_gbps);
  TORCH_CHECK(device_memory_limit >= 0, "actmem::TrainingConfig: device_memory_limit must be >= 0, "
              "got ", device_memory_limit);
  TORCH_CHECK(data_path.empty() || data_paths.empty(), "actmem::TrainingConfig: --data (a text "
              "file) and --data-path (indexed datasets) are exclusive");
  TORCH_CHECK(data_cache_path.empty() || !data_paths.empty(), "actmem::TrainingConfig: "
              "--data-cache-path applies to --data-path");
  TORCH_CHECK(data_paths.empty() || model.seed <= 0xffffffffULL, "actmem::TrainingConfig: "
              "--data-path shuffles with numpy's RandomState(seed), as Megatron, which takes seeds "
              "below 2^32; got --seed ", model.seed);
  TORCH_CHECK(save_interval >= 0, "actmem::TrainingConfig: save_interval must be >= 0, got ",
              save_interval);
  TORCH_CHECK(save_interval == 0 || !save.empty(), "actmem::TrainingConfig: save_interval (",
              save_interval, ") needs a directory to save in (--save DIR)");
  // Flags that only modify a load do nothing without one: refused rather than ignored.
  for (const auto& [on, flag] : {std::pair<bool, const char*>{no_load_optim, "--no-load-optim"},
                                 {no_load_rng, "--no-load-rng"},
                                 {finetune, "--finetune"},
                                 {override_opt_param_scheduler, "--override-opt_param-scheduler"}}) {
    TORCH_CHECK(!on || !load.empty(), "actmem::TrainingConfig: ", flag, " applies to loading a "
                "checkpoint; give --load DIR");
  }
}

nlohmann::json to_json(const TrainingConfig& t) {
  return {
      {"global_batch_size", t.global_batch_size},
      {"train_iters", t.train_iters},
      {"lr", t.lr},
      {"min_lr", t.min_lr},
      {"lr_warmup_iters", t.lr_warmup_iters},
      {"lr_decay_style", t.lr_decay_style},
      {"weight_decay", t.weight_decay},
      {"adam_beta1", t.adam_beta1},
      {"adam_beta2", t.adam_beta2},
      {"adam_eps", t.adam_eps},
      {"clip_grad", t.clip_grad},
      {"accumulate_allreduce_grads_in_fp32",
       t.accumulate_allreduce_grads_in_fp32 ? nlohmann::json(*t.accumulate_allreduce_grads_in_fp32)
                                            : nlohmann::json(nullptr)},
      {"loss_scale", t.loss_scale ? nlohmann::json(*t.loss_scale) : nlohmann::json(nullptr)},
      {"initial_loss_scale", t.initial_loss_scale},
      {"min_loss_scale", t.min_loss_scale},
      {"loss_scale_window", t.loss_scale_window},
      {"hysteresis", t.hysteresis},
      {"eval_interval", t.eval_interval},
      {"eval_iters", t.eval_iters},
      {"log_interval", t.log_interval},
      {"data", t.data_path.empty() ? nlohmann::json(nullptr) : nlohmann::json(t.data_path)},
      {"data_path", t.data_paths},
      {"tokenizer_type", t.tokenizer_type.empty() ? nlohmann::json(nullptr) : nlohmann::json(t.tokenizer_type)},
      {"tokenizer_model", t.tokenizer_model.empty() ? nlohmann::json(nullptr) : nlohmann::json(t.tokenizer_model)},
      {"make_vocab_size_divisible_by", t.make_vocab_size_divisible_by},
      {"data_cache_path", t.data_cache_path.empty() ? nlohmann::json(nullptr)
                                                    : nlohmann::json(t.data_cache_path)},
      {"split", t.split},
      {"save", t.save.empty() ? nlohmann::json(nullptr) : nlohmann::json(t.save)},
      {"save_interval", t.save_interval},
      {"load", t.load.empty() ? nlohmann::json(nullptr) : nlohmann::json(t.load)},
      {"no_load_optim", t.no_load_optim},
      {"no_load_rng", t.no_load_rng},
      {"finetune", t.finetune},
      {"override_opt_param_scheduler", t.override_opt_param_scheduler},
      {"exit_signal_handler", t.exit_signal_handler},
      {"device", t.device},
      {"device_memory_limit", t.device_memory_limit},
      {"offload_bandwidth_gbps", t.offload_bandwidth_gbps},
  };
}

}  // namespace actmem
