// training_config.cpp — TrainingConfig (config.h): the run's batch, schedule, optimizer, data and
// checkpoint settings, Megatron's rules for them, their JSON.
#include "actmem/config/config.h"

#include "actmem/config/batch_schedule.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <string>
#include <utility>

namespace actmem {

GlobalBatchSchedule TrainingConfig::batch_schedule(const TransformerConfig& model,
                                                   int64_t data_parallel_size) const {
  if (step_batch_size_schedule.empty()) {
    return GlobalBatchSchedule(global_batch(model.micro_batch_size, data_parallel_size));
  }
  return GlobalBatchSchedule::parse(step_batch_size_schedule, model.seq_length);
}

void TrainingConfig::resolve_train_iters(const GlobalBatchSchedule& batches) {
  if (!train_samples) return;
  const int64_t first = batches.at(0);
  TORCH_CHECK(*train_samples >= first, "actmem: --train-samples ", *train_samples,
              " is less than one global batch (", first, " samples)");
  train_iters = batches.iterations_for(*train_samples);
}

LrScheduleSteps lr_schedule_steps(const TrainingConfig& c, const GlobalBatchSchedule& batches) {
  // get_optimizer_param_scheduler: the scheduler counts samples in either kind of run.
  LrScheduleSteps s;
  if (c.train_samples) {
    s.decay = c.lr_decay_samples.value_or(*c.train_samples);
    s.warmup = c.lr_warmup_fraction ? *c.lr_warmup_fraction * static_cast<double>(s.decay)
                                    : static_cast<double>(c.lr_warmup_samples);
  } else {
    s.decay = batches.samples_after(c.lr_decay_iters.value_or(c.train_iters));
    s.warmup = c.lr_warmup_fraction ? *c.lr_warmup_fraction * static_cast<double>(s.decay)
                                    : static_cast<double>(batches.samples_after(c.lr_warmup_iters));
  }
  // OptimizerParamScheduler.__init__'s asserts, with the flags named.
  TORCH_CHECK(s.decay > 0, "actmem: the learning-rate decay must be positive (lr_decay_steps ",
              s.decay, " samples)");
  TORCH_CHECK(s.warmup < static_cast<double>(s.decay), "actmem: the learning-rate warmup (",
              s.warmup,
              " samples: --lr-warmup-iters, --lr-warmup-samples or --lr-warmup-fraction) "
              "must end before the decay does (",
              s.decay,
              " samples: --lr-decay-iters, "
              "--lr-decay-samples or the run's length); Megatron's OptimizerParamScheduler "
              "asserts lr_warmup_steps < lr_decay_steps");
  return s;
}

void TrainingConfig::validate(const TransformerConfig& model) const {
  // In this order, each of Megatron's rules with its message (the first violation is reported).
  validate_batch(model);
  validate_schedule(model);
  validate_optimizer(model);
  validate_run(model);
  validate_data_and_checkpoints(model);
}

// The global batch, or the step batch-size schedule, and the micro-batch.
void TrainingConfig::validate_batch(const TransformerConfig& model) const {
  TORCH_CHECK(global_batch_size >= 0,
              "actmem::TrainingConfig: global_batch_size must be positive, "
              "got ",
              global_batch_size);
  if (!step_batch_size_schedule.empty()) {
    // Megatron's validate_args, its ValueError's text.
    TORCH_CHECK(global_batch_size == 0,
                "Cannot specify both --step-batch-size-schedule and --global-batch-size");
    (void)GlobalBatchSchedule::parse(step_batch_size_schedule, model.seq_length);
  }
  const int64_t gbs = global_batch(model.micro_batch_size);
  TORCH_CHECK(gbs % model.micro_batch_size == 0, "actmem::TrainingConfig: global_batch_size (", gbs,
              ") must be a multiple of micro_batch_size (", model.micro_batch_size, ")");
}

// The run's length, its exit conditions and the learning-rate schedule.
void TrainingConfig::validate_schedule(const TransformerConfig& model) const {
  TORCH_CHECK(train_iters > 0, "actmem::TrainingConfig: train_iters must be positive, got ",
              train_iters);
  // Megatron's validate_args (arguments.py): a run is iteration-based or sample-based, and its
  // schedule flags are of the same kind.
  if (train_samples) {
    TORCH_CHECK(*train_samples > 0,
                "actmem::TrainingConfig: --train-samples must be positive, "
                "got ",
                *train_samples);
    TORCH_CHECK(!lr_decay_iters,
                "expected sample-based learning rate decay (--lr-decay-samples "
                "with --train-samples, not --lr-decay-iters)");
    TORCH_CHECK(lr_warmup_iters == 0,
                "expected sample-based learning rate warmup "
                "(--lr-warmup-samples with --train-samples, not --lr-warmup-iters)");
    TORCH_CHECK(!lr_warmup_fraction || lr_warmup_samples == 0,
                "can only specify one of lr-warmup-fraction and lr-warmup-samples");
  } else {
    TORCH_CHECK(!lr_decay_samples,
                "expected iteration-based learning rate decay "
                "(--lr-decay-iters with --train-iters, not --lr-decay-samples)");
    TORCH_CHECK(lr_warmup_samples == 0,
                "expected iteration-based learning rate warmup "
                "(--lr-warmup-iters with --train-iters, not --lr-warmup-samples)");
    TORCH_CHECK(!lr_warmup_fraction || lr_warmup_iters == 0,
                "can only specify one of lr-warmup-fraction and lr-warmup-iters");
  }
  TORCH_CHECK(!exit_interval || *exit_interval > 0,
              "actmem::TrainingConfig: --exit-interval must "
              "be positive, got ",
              exit_interval.value_or(0));
  TORCH_CHECK(!exit_duration_in_mins ||
                  (std::isfinite(*exit_duration_in_mins) && *exit_duration_in_mins >= 0),
              "actmem::TrainingConfig: --exit-duration-in-mins must be >= 0, got ",
              exit_duration_in_mins.value_or(0));
  TORCH_CHECK(!lr_decay_iters || *lr_decay_iters > 0,
              "actmem::TrainingConfig: --lr-decay-iters "
              "must be positive, got ",
              lr_decay_iters.value_or(0));
  TORCH_CHECK(!lr_decay_samples || *lr_decay_samples > 0,
              "actmem::TrainingConfig: "
              "--lr-decay-samples must be positive, got ",
              lr_decay_samples.value_or(0));
  TORCH_CHECK(lr_warmup_samples >= 0,
              "actmem::TrainingConfig: --lr-warmup-samples must be >= 0, "
              "got ",
              lr_warmup_samples);
  TORCH_CHECK(!lr_warmup_fraction || (*lr_warmup_fraction >= 0 && *lr_warmup_fraction <= 1),
              "actmem::TrainingConfig: --lr-warmup-fraction must be in [0, 1], got ",
              lr_warmup_fraction.value_or(0));
  TORCH_CHECK(std::isfinite(lr_warmup_init) && lr_warmup_init >= 0 && lr_warmup_init <= lr,
              "actmem::TrainingConfig: --lr-warmup-init must be in [0, lr] (Megatron's "
              "OptimizerParamScheduler asserts init_lr <= max_lr), got ",
              lr_warmup_init);
  TORCH_CHECK(lr > 0.0 && std::isfinite(lr), "actmem::TrainingConfig: lr must be positive, got ",
              lr);
  TORCH_CHECK(min_lr >= 0.0 && min_lr <= lr,
              "actmem::TrainingConfig: min_lr must be in [0, lr], "
              "got ",
              min_lr);
  TORCH_CHECK(lr_warmup_iters >= 0, "actmem::TrainingConfig: lr_warmup_iters must be >= 0, got ",
              lr_warmup_iters);
  TORCH_CHECK(
      lr_decay_style == "constant" || lr_decay_style == "linear" || lr_decay_style == "cosine",
      "actmem::TrainingConfig: lr_decay_style must be constant, linear or cosine, got \"",
      lr_decay_style, "\"");
}

// AdamW, clipping and mixed precision (Megatron's arguments.py and optimizer/__init__.py).
void TrainingConfig::validate_optimizer(const TransformerConfig& model) const {
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
              "forces accumulate_allreduce_grads_in_fp32 with bf16); --grad-reduce-in-bf16 keeps "
              "them in bf16");
  // Megatron reads --grad-reduce-in-bf16 only with --bf16, where it overrides
  // --accumulate-allreduce-grads-in-fp32; here the two together, or the flag without bf16,
  // are refused rather than one silently dropped.
  TORCH_CHECK(!grad_reduce_in_bf16 || model.bf16,
              "actmem::TrainingConfig: --grad-reduce-in-bf16 "
              "applies to --bf16 training");
  TORCH_CHECK(!(grad_reduce_in_bf16 && accumulate_allreduce_grads_in_fp32.value_or(false)),
              "actmem::TrainingConfig: --grad-reduce-in-bf16 and "
              "--accumulate-allreduce-grads-in-fp32 contradict each other");
  TORCH_CHECK(!accumulate_allreduce_grads_in_fp32.value_or(false) || model.bf16 || model.fp16,
              "actmem::TrainingConfig: accumulate_allreduce_grads_in_fp32 applies to --bf16 or "
              "--fp16 (fp32 training already accumulates in fp32)");
  TORCH_CHECK(!loss_scale || model.bf16 || model.fp16,
              "actmem::TrainingConfig: loss_scale "
              "applies to --fp16 or --bf16 training");
  TORCH_CHECK(!loss_scale || (*loss_scale > 0.0 && std::isfinite(*loss_scale)),
              "actmem::TrainingConfig: loss_scale must be positive and finite, got ",
              loss_scale.value_or(0.0));
  TORCH_CHECK(initial_loss_scale > 0.0 && std::isfinite(initial_loss_scale) &&
                  min_loss_scale > 0.0 && min_loss_scale <= initial_loss_scale,
              "actmem::TrainingConfig: the dynamic loss scale needs 0 < min_loss_scale <= "
              "initial_loss_scale (finite), got ",
              min_loss_scale, " and ", initial_loss_scale);
  TORCH_CHECK(loss_scale_window >= 1 && hysteresis >= 1,
              "actmem::TrainingConfig: "
              "loss_scale_window and hysteresis must be at least 1, got ",
              loss_scale_window, " and ", hysteresis);
}

// Evaluation, logging, the device and offload link, the gradient buckets, the partially
// checkpointed micro-batches.
void TrainingConfig::validate_run(const TransformerConfig& model) const {
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
  TORCH_CHECK(
      offload_bandwidth_gbps == 0.0 || (offload_bandwidth_gbps >= kMinOffloadBandwidthGbps &&
                                        offload_bandwidth_gbps <= kMaxOffloadBandwidthGbps),
      "actmem::TrainingConfig: offload_bandwidth_gbps must be 0 (uncapped) or in [",
      kMinOffloadBandwidthGbps, ", ", kMaxOffloadBandwidthGbps, "] GB/s, got ",
      offload_bandwidth_gbps);
  TORCH_CHECK(!ddp_bucket_size || *ddp_bucket_size > 0,
              "actmem::TrainingConfig: "
              "ddp_bucket_size must be positive, got ",
              ddp_bucket_size.value_or(0));
  // Megatron sets the bucket size to None (one bucket) without overlap_grad_reduce: refused
  // rather than ignored.
  TORCH_CHECK(!ddp_bucket_size || overlap_grad_reduce,
              "actmem::TrainingConfig: "
              "--ddp-bucket-size applies with --overlap-grad-reduce (without it the gradients "
              "reduce in one all-reduce after backward)");
  if (const auto& n = num_microbatches_with_partial_activation_checkpoints) {
    // Megatron's schedules pass the choice to the model, whose mcore GPT ignores it (the flag has
    // no effect there); here it applies, so its preconditions are checked rather than ignored.
    const char* api =
        "actmem::TrainingConfig: num_microbatches_with_partial_activation_checkpoints";
    TORCH_CHECK(*n >= 0, api, " must be >= 0, got ", *n);
    TORCH_CHECK(model.pipeline_model_parallel_size > 1, api,
                " applies to the pipeline schedules "
                "(--pipeline-model-parallel-size > 1); without a pipeline every micro-batch runs "
                "the same plan");
    TORCH_CHECK(model.recompute_granularity == "full" && model.recompute_method == "block", api,
                " needs --recompute-granularity full --recompute-method block: its micro-batches "
                "checkpoint the first --recompute-num-layers layers, the others every layer (with "
                "uniform every layer is already checkpointed)");
    TORCH_CHECK(!model.fine_grained_activation_offloading && model.cpu_offloading_num_layers == 0,
                api, " together with activation offload is not implemented");
  }
}

// The data sources and the checkpoint flags.
void TrainingConfig::validate_data_and_checkpoints(const TransformerConfig& model) const {
  TORCH_CHECK(!decoupled_min_lr || decoupled_lr,
              "actmem::TrainingConfig: --decoupled-min-lr "
              "applies with --decoupled-lr (the word embedding and output layer's own schedule)");
  TORCH_CHECK(device_memory_limit >= 0,
              "actmem::TrainingConfig: device_memory_limit must be >= 0, "
              "got ",
              device_memory_limit);
  TORCH_CHECK(data_path.empty() || data_paths.empty(),
              "actmem::TrainingConfig: --data (a text "
              "file) and --data-path (indexed datasets) are exclusive");
  // Megatron's validate_args: "A single data source must be provided in training mode, else
  // None" (--mock-data, --data-path; actmem's --data is a third).
  TORCH_CHECK(static_cast<int>(mock_data) + static_cast<int>(!data_paths.empty()) +
                      static_cast<int>(!data_path.empty()) <=
                  1,
              "actmem::TrainingConfig: a single data source must be provided: --mock-data, "
              "--data-path and --data are exclusive");
  TORCH_CHECK(!mock_data || eod_id >= 0,
              "actmem::TrainingConfig: --mock-data needs a tokenizer "
              "(--tokenizer-type): its vocabulary and end-of-document id shape the generated "
              "documents (NullTokenizer --vocab-size N needs no files)");
  TORCH_CHECK(data_cache_path.empty() || !data_paths.empty() || mock_data,
              "actmem::TrainingConfig: --data-cache-path applies to --data-path and --mock-data");
  TORCH_CHECK((data_paths.empty() && !mock_data) || model.seed <= 0xffffffffULL,
              "actmem::TrainingConfig: "
              "--data-path shuffles with numpy's RandomState(seed), as Megatron, which takes seeds "
              "below 2^32; got --seed ",
              model.seed);
  TORCH_CHECK(save_interval >= 0, "actmem::TrainingConfig: save_interval must be >= 0, got ",
              save_interval);
  TORCH_CHECK(save_interval == 0 || !save.empty(), "actmem::TrainingConfig: save_interval (",
              save_interval, ") needs a directory to save in (--save DIR)");
  // Flags that only modify a load do nothing without one: refused rather than ignored.
  for (const auto& [on, flag] :
       {std::pair<bool, const char*>{no_load_optim, "--no-load-optim"},
        {no_load_rng, "--no-load-rng"},
        {finetune, "--finetune"},
        {override_opt_param_scheduler, "--override-opt_param-scheduler"}}) {
    TORCH_CHECK(!on || !load.empty(), "actmem::TrainingConfig: ", flag,
                " applies to loading a "
                "checkpoint; give --load DIR");
  }
}

nlohmann::json to_json(const TrainingConfig& t) {
  return {
      {"global_batch_size", t.global_batch_size},
      {"step_batch_size_schedule", t.step_batch_size_schedule.empty()
                                       ? nlohmann::json(nullptr)
                                       : nlohmann::json(t.step_batch_size_schedule)},
      {"train_iters", t.train_iters},
      {"lr", t.lr},
      {"min_lr", t.min_lr},
      {"lr_warmup_iters", t.lr_warmup_iters},
      {"lr_decay_style", t.lr_decay_style},
      {"train_samples",
       t.train_samples ? nlohmann::json(*t.train_samples) : nlohmann::json(nullptr)},
      {"lr_warmup_samples", t.lr_warmup_samples},
      {"lr_warmup_fraction",
       t.lr_warmup_fraction ? nlohmann::json(*t.lr_warmup_fraction) : nlohmann::json(nullptr)},
      {"lr_warmup_init", t.lr_warmup_init},
      {"lr_decay_iters",
       t.lr_decay_iters ? nlohmann::json(*t.lr_decay_iters) : nlohmann::json(nullptr)},
      {"lr_decay_samples",
       t.lr_decay_samples ? nlohmann::json(*t.lr_decay_samples) : nlohmann::json(nullptr)},
      {"decoupled_lr", t.decoupled_lr ? nlohmann::json(*t.decoupled_lr) : nlohmann::json(nullptr)},
      {"decoupled_min_lr",
       t.decoupled_min_lr ? nlohmann::json(*t.decoupled_min_lr) : nlohmann::json(nullptr)},
      {"calculate_per_token_loss", t.calculate_per_token_loss},
      {"log_throughput", t.log_throughput},
      {"weight_decay", t.weight_decay},
      {"adam_beta1", t.adam_beta1},
      {"adam_beta2", t.adam_beta2},
      {"adam_eps", t.adam_eps},
      {"clip_grad", t.clip_grad},
      {"accumulate_allreduce_grads_in_fp32",
       t.accumulate_allreduce_grads_in_fp32 ? nlohmann::json(*t.accumulate_allreduce_grads_in_fp32)
                                            : nlohmann::json(nullptr)},
      {"grad_reduce_in_bf16", t.grad_reduce_in_bf16},
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
      {"tokenizer_type",
       t.tokenizer_type.empty() ? nlohmann::json(nullptr) : nlohmann::json(t.tokenizer_type)},
      {"tokenizer_model",
       t.tokenizer_model.empty() ? nlohmann::json(nullptr) : nlohmann::json(t.tokenizer_model)},
      {"vocab_file", t.vocab_file.empty() ? nlohmann::json(nullptr) : nlohmann::json(t.vocab_file)},
      {"merge_file", t.merge_file.empty() ? nlohmann::json(nullptr) : nlohmann::json(t.merge_file)},
      {"tiktoken_pattern",
       t.tiktoken_pattern.empty() ? nlohmann::json(nullptr) : nlohmann::json(t.tiktoken_pattern)},
      {"tiktoken_num_special_tokens", t.tiktoken_num_special_tokens},
      {"special_tokens",
       t.special_tokens.empty() ? nlohmann::json(nullptr) : nlohmann::json(t.special_tokens)},
      {"make_vocab_size_divisible_by", t.make_vocab_size_divisible_by},
      {"tokenizer_vocab_size", t.tokenizer_vocab_size},
      {"mock_data", t.mock_data},
      {"data_cache_path",
       t.data_cache_path.empty() ? nlohmann::json(nullptr) : nlohmann::json(t.data_cache_path)},
      {"split", t.split},
      {"save", t.save.empty() ? nlohmann::json(nullptr) : nlohmann::json(t.save)},
      {"save_interval", t.save_interval},
      {"load", t.load.empty() ? nlohmann::json(nullptr) : nlohmann::json(t.load)},
      {"no_load_optim", t.no_load_optim},
      {"no_load_rng", t.no_load_rng},
      {"finetune", t.finetune},
      {"override_opt_param_scheduler", t.override_opt_param_scheduler},
      {"exit_signal_handler", t.exit_signal_handler},
      {"exit_interval",
       t.exit_interval ? nlohmann::json(*t.exit_interval) : nlohmann::json(nullptr)},
      {"exit_duration_in_mins", t.exit_duration_in_mins ? nlohmann::json(*t.exit_duration_in_mins)
                                                        : nlohmann::json(nullptr)},
      {"device", t.device},
      {"device_memory_limit", t.device_memory_limit},
      {"offload_bandwidth_gbps", t.offload_bandwidth_gbps},
      {"overlap_grad_reduce", t.overlap_grad_reduce},
      {"ddp_bucket_size",
       t.ddp_bucket_size ? nlohmann::json(*t.ddp_bucket_size) : nlohmann::json(nullptr)},
      {"use_distributed_optimizer", t.use_distributed_optimizer},
      {"num_microbatches_with_partial_activation_checkpoints",
       t.num_microbatches_with_partial_activation_checkpoints
           ? nlohmann::json(*t.num_microbatches_with_partial_activation_checkpoints)
           : nlohmann::json(nullptr)},
  };
}

}  // namespace actmem
