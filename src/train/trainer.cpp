// trainer.cpp — Trainer and the IterationStats JSON.
#include "actmem/train/trainer.h"

#include "actmem/base/digest.h"
#include "actmem/data/gpt_dataset.h"
#include "actmem/memory/ledger.h"
#include "actmem/offload/activation_offloader.h"
#include "actmem/parallel/distributed_optimizer.h"
#include "actmem/parallel/grad_reducer.h"
#include "actmem/memory/memory_model.h"
#include "actmem/train/mixed_precision.h"
#include "actmem/base/output_file.h"
#include "actmem/parallel/pipeline.h"
#include "actmem/recompute/rng.h"
#include "actmem/parallel/tensor_parallel.h"
#include "actmem/base/trace.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/optim/adamw.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <iomanip>
#include <limits>
#include <mutex>
#include <ostream>
#include <sstream>

namespace actmem {

namespace {
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}
// Note [Trainer RNG stream]
// Dropout draws from libtorch's default generators, as in Megatron. A Trainer owns its stream:
// it starts as manual_seed(model.seed) would leave it, is swapped into the default generators for
// the duration of each train_step() and swapped out afterwards, so two trainers in one process
// (compare, tests) never disturb each other and the ambient state is left as it was.
class SwapRngState {
 public:
  SwapRngState(std::vector<at::Generator>& gens, std::vector<at::Tensor>& states)
      : gens_(gens), states_(states) {
    for (size_t i = 0; i < gens_.size(); ++i) {
      std::lock_guard<std::mutex> lock(gens_[i].mutex());
      ambient_.push_back(gens_[i].get_state());
      gens_[i].set_state(states_[i]);
    }
  }
  ~SwapRngState() {
    for (size_t i = 0; i < gens_.size(); ++i) {
      std::lock_guard<std::mutex> lock(gens_[i].mutex());
      states_[i] = gens_[i].get_state();
      gens_[i].set_state(ambient_[i]);
    }
  }

 private:
  std::vector<at::Generator>& gens_;
  std::vector<at::Tensor>& states_;
  std::vector<at::Tensor> ambient_;
};

// The trainer's named streams (model-parallel-rng, ...) live in its own tracker, swapped with
// the process-wide one for a step like its default-generator stream (Note [Trainer RNG
// stream]): states, seeds and device travel together, and the swap cannot throw on the way out.
class SwapTracker {
 public:
  explicit SwapTracker(RngStatesTracker& own) : own_(own) {
    TORCH_CHECK(get_rng_tracker().current_state_name() == kDefaultRng,
                "actmem::Trainer::train_step: called inside an RNG fork ('",
                get_rng_tracker().current_state_name(), "'); the trainer uses its own streams");
    std::swap(get_rng_tracker(), own_);
  }
  ~SwapTracker() { std::swap(get_rng_tracker(), own_); }
  SwapTracker(const SwapTracker&) = delete;
  SwapTracker& operator=(const SwapTracker&) = delete;

 private:
  RngStatesTracker& own_;
};

// Gathers one int64 per rank (rank order) over the tensor-parallel group; the value travels on
// the training device (NCCL takes device tensors only).
std::vector<int64_t> gather_per_rank(int64_t value, const at::Device& device) {
  const at::Tensor all =
      all_gather_dim0(at::full({1}, value, at::TensorOptions().dtype(at::kLong).device(device))).cpu();
  return std::vector<int64_t>(all.data_ptr<int64_t>(), all.data_ptr<int64_t>() + all.numel());
}

// Validates both configs before anything is built; returns the training device.
at::Device validated_device(const TransformerConfig& model, const TrainingConfig& training) {
  model.validate();
  training.validate(model);
  return at::Device(training.device);
}
}  // namespace

nlohmann::json to_json(const IterationStats& s) {
  nlohmann::json j = {
      {"iteration", s.iteration},
      {"loss", s.loss},
      {"grad_norm", s.skipped ? nlohmann::json(nullptr) : nlohmann::json(s.grad_norm)},
      {"grad_digest", s.grad_digest},
      {"lr", s.lr},
      {"consumed_samples", s.consumed_samples},
      {"elapsed_s", s.elapsed_s},
      {"loss_scale", s.loss_scale},
      {"skipped", s.skipped},
      {"step_time_s", s.step_time_s},
      {"tokens_per_s", s.tokens_per_s},
      {"peak_device_bytes", s.peak_device_bytes},
      {"optimizer_peak_bytes", s.optimizer_peak_bytes},
      {"activation_bytes", s.activation_bytes},
      {"activation_peak_bytes", s.activation_peak_bytes},
      {"predicted_activation_bytes", s.predicted_activation_bytes},
      {"inflight_activation_bytes", s.inflight_activation_bytes},
      {"predicted_inflight_activation_bytes", s.predicted_inflight_activation_bytes},
      {"offloaded_bytes", s.offloaded_bytes},
      {"host_peak_bytes", s.host_peak_bytes},
      {"offload_wait_s", s.offload_wait_s},
      {"offload_copy_s", s.offload_copy_s},
  };
  if (!s.activation_bytes_per_rank.empty()) {
    j["activation_bytes_per_rank"] = s.activation_bytes_per_rank;
    j["activation_peak_bytes_per_rank"] = s.activation_peak_bytes_per_rank;
    j["peak_device_bytes_per_rank"] = s.peak_device_bytes_per_rank;
  }
  if (!s.grad_digest_per_rank.empty()) j["grad_digest_per_rank"] = s.grad_digest_per_rank;
  if (!s.inflight_activation_bytes_per_stage.empty()) {
    j["inflight_activation_bytes_per_stage"] = s.inflight_activation_bytes_per_stage;
    j["predicted_inflight_activation_bytes_per_stage"] =
        s.predicted_inflight_activation_bytes_per_stage;
    j["peak_device_bytes_per_stage"] = s.peak_device_bytes_per_stage;
  }
  if (!s.pipeline_schedule_per_stage.empty()) {
    nlohmann::json stages = nlohmann::json::array();
    for (const auto& events : s.pipeline_schedule_per_stage) {
      nlohmann::json row = nlohmann::json::array();
      for (const auto& e : events) {
        row.push_back({{"op", e.forward ? "F" : "B"}, {"microbatch", e.microbatch},
                       {"chunk", e.chunk}, {"start_s", e.start_s}, {"end_s", e.end_s}});
      }
      stages.push_back(std::move(row));
    }
    j["pipeline_schedule_per_stage"] = std::move(stages);
  }
  if (s.val_loss) j["val_loss"] = *s.val_loss;
  if (s.moe) {
    auto opt = [](const std::optional<double>& v) { return v ? nlohmann::json(*v) : nlohmann::json(nullptr); };
    j["load_balancing_loss"] = opt(s.load_balancing_loss);
    j["z_loss"] = opt(s.z_loss);
    j["expert_load_imbalance"] = s.expert_load_imbalance;
    j["moe_routed_tokens"] = s.moe_routed_tokens;
    j["moe_dropped_tokens"] = s.moe_dropped_tokens;
  }
  return j;
}

Trainer::Trainer(const TransformerConfig& model, const TrainingConfig& training)
    : model_config_(model),
      config_(training),
      device_(validated_device(model, training)),
      memory_(device_memory(device_)) {
  {
    // Megatron's validate_args: each data-parallel rank runs whole micro-batches.
    const int64_t mbs = model_config_.micro_batch_size, d = data_parallel_group().size;
    const int64_t gbs = config_.global_batch(mbs, d);
    TORCH_CHECK(gbs % (mbs * d) == 0, "actmem::Trainer: global batch size (", gbs,
                ") is not divisible by micro batch size (", mbs, ") times data parallel size (",
                d, ")");
    if (model_config_.virtual_pipeline_size() > 1) {
      // The interleaved schedule's rules on the micro-batches (Megatron checks them when the
      // schedule starts; here before anything is built).
      check_interleaved_microbatches(model_config_.pipeline_model_parallel_size, gbs / (mbs * d),
                                     model_config_.microbatch_group_size());
    }
  }
  // The corpus lives in host memory, outside the tracked allocator (Note [Corpus in bounded
  // memory] in data.h); loading it first lets the pre-check count it.
  std::shared_ptr<const SampleSource> train_samples, valid_samples;
  if (config_.data_paths.empty()) {
    corpus_ = load_corpus(config_.data_path, config_.split, model_config_.seq_length);
  } else {
    // Megatron's GPTDataset and BlendedDataset over memory-mapped indexed datasets, sized as
    // Megatron sizes them (train_valid_test_num_samples).
    const int64_t gbs =
        config_.global_batch(model_config_.micro_batch_size, data_parallel_group().size);
    const int64_t valid = config_.eval_interval > 0
                              ? (config_.train_iters / config_.eval_interval + 1) *
                                    config_.eval_iters * gbs
                              : 0;
    const DataBlend blend = parse_data_path(config_.data_paths);
    const GPTSplits splits =
        build_gpt_splits(blend, config_.split, model_config_.seq_length,
                         static_cast<uint32_t>(model_config_.seed),
                         {config_.train_iters * gbs, valid, 0}, config_.data_cache_path);
    train_samples = splits.train;
    valid_samples = splits.valid;
    std::ostringstream source;
    for (size_t i = 0; i < blend.prefixes.size(); ++i) {
      if (i) source << " + ";
      if (!blend.weights.empty()) source << blend.weights[i] << " x ";
      source << blend.prefixes[i];
    }
    corpus_.source = source.str();
    corpus_.memory_mapped = true;
    corpus_.documents = splits.documents;
    corpus_.sequences = splits.sequences;
    corpus_.bytes = splits.bytes;
    corpus_.tokens = splits.tokens;
    corpus_.train_samples = train_samples->size();
    corpus_.valid_samples = valid_samples ? valid_samples->size() : 0;
  }
  if (device_.is_cpu()) {
    // On CPU the device is this machine's memory: tensor-parallel ranks of one launch share it,
    // and the corpus held in it (unless memory-mapped) is not available to them.
    const bool explicit_limit = config_.device_memory_limit > 0;
    const int64_t limit =
        explicit_limit ? config_.device_memory_limit
                       : (physical_memory_bytes() - corpus_.resident_bytes()) /
                             (tensor_parallel_group().size * data_parallel_group().size *
                              pipeline_parallel_group().size);
    // A pipeline stage: its own weights and the micro-batches 1F1B keeps in flight on it (under
    // the interleaved schedule, per model chunk, with the boundary tensors its queues hold).
    const TensorParallelGroup& pp = pipeline_parallel_group();
    const int64_t n_micro =
        config_.num_microbatches(model_config_.micro_batch_size, data_parallel_group().size);
    int64_t in_flight = one_f_one_b_in_flight(pp.rank, pp.size, n_micro);
    // The distributed optimizer's state: 1/d of it (the experts' over their own, possibly
    // smaller, data-parallel group: the smaller size keeps the bound a bound).
    const int64_t shards =
        config_.use_distributed_optimizer
            ? std::min(data_parallel_group().size, expert_data_parallel_group().size)
            : 1;
    double need = 0.0;
    if (const int64_t v = model_config_.virtual_pipeline_size(); v > 1) {
      const PipelineMemory counts = pipeline_memory(
          interleaved_schedule(pp.rank, pp.size, v, n_micro, model_config_.microbatch_group_size()),
          pp.rank, pp.size, std::vector<int64_t>(static_cast<size_t>(v), 0), 0);
      in_flight = 0;
      for (const int64_t n : counts.max_in_flight) in_flight += n;
      need = predict_step_peak_bound(model_config_, 0, pp.rank, counts.max_in_flight,
                                     counts.max_boundary_tensors + 2, shards);
    } else {
      need = predict_step_peak_bound(model_config_, 0, pp.rank, in_flight, shards);
    }
    TORCH_CHECK(need <= static_cast<double>(limit), "actmem::Trainer: this configuration needs "
                "about ", format_bytes(need), " of device memory (parameters, gradients, AdamW "
                "state", shards > 1 ? " (1/" + std::to_string(shards) + " of it)" : std::string(),
                " and ", in_flight == 1 ? std::string("one micro-batch") :
                std::to_string(in_flight) +
                    (model_config_.virtual_pipeline_size() > 1 ? " model-chunk micro-batches"
                                                               : " micro-batches") +
                    " (pipeline stage " + std::to_string(pp.rank) + ")",
                " of activations at their peak) but the limit is ",
                format_bytes(static_cast<double>(limit)),
                explicit_limit ? std::string() : " (physical memory less the corpus's " +
                    format_bytes(static_cast<double>(corpus_.resident_bytes())) + ")",
                "; reduce --num-layers, --hidden-size, --seq-length or --micro-batch-size");
    memory_.set_capacity(limit);
  }
  if (model_config_.fp16 || model_config_.bf16) {
    const auto missing = missing_kernel(params_dtype(model_config_), device_);
    TORCH_CHECK(!missing, "actmem::Trainer: --", model_config_.precision(), " needs ",
                params_dtype(model_config_), " kernels on ", device_, ", which this libtorch (",
                TORCH_VERSION, ") does not have: ", *missing,
                model_config_.fp16 && device_.is_cpu() ? "; use --bf16 on CPU (or --fp16 on CUDA)"
                                                       : "");
  }
  TORCH_CHECK(!config_.data_paths.empty() || model_config_.vocab_size >= ByteTokenizer::kVocabSize,
              "actmem::Trainer: vocab_size (",
              model_config_.vocab_size, ") must be at least 256 for the byte-level tokenizer");

  generators_.push_back(at::detail::getDefaultCPUGenerator());
  if (!device_.is_cpu()) generators_.push_back(at::globalContext().defaultGenerator(device_));
  // Megatron's _set_random_seed: each pipeline stage draws its dropout from seed + 100 * its
  // pipeline rank (megatron/training/initialize.py), the named streams below included.
  const uint64_t seed = static_cast<uint64_t>(model_config_.seed) +
                        100 * static_cast<uint64_t>(pipeline_parallel_group().rank);
  for (auto& gen : generators_) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    const at::Tensor ambient = gen.get_state();
    gen.set_current_seed(seed);  // as Megatron's _set_random_seed
    rng_state_.push_back(gen.get_state());
    gen.set_state(ambient);
  }
  // The named streams of Megatron's model_parallel_cuda_manual_seed
  // (megatron/core/tensor_parallel/random.py: model-parallel-rng = seed + 2718 + tp_rank, ...),
  // kept by this trainer and swapped in per step; no global random state is touched.
  // expert-parallel-rng = seed + 1024 + 100 * ep_rank + etp_rank (etp = t, Megatron's default).
  tracker_ = make_model_parallel_tracker(seed, tensor_parallel_group().rank,
                                         expert_parallel_group().rank, tensor_parallel_group().rank,
                                         device_);
  model_ = std::make_shared<GPTModel>(model_config_);
  model_->to_device(device_);
  model_->train();
  params_ = model_->ordered_parameters();
  tensor_parallel_flags_ = model_->tensor_parallel_flags();
  expert_parallel_flags_ = model_->expert_parallel_flags();
  // Where a parameter sits in params_ (and so its gradient in grads_).
  auto index_of = [this](const at::Tensor& p) {
    const auto it = std::find_if(params_.begin(), params_.end(),
                                 [&p](const at::Tensor& q) { return q.is_same(p); });
    TORCH_INTERNAL_ASSERT(it != params_.end());
    return static_cast<size_t>(it - params_.begin());
  };
  if (config_.use_distributed_optimizer) {
    // Note [Distributed optimizer] in distributed_optimizer.h: the buffer layout of Megatron's
    // DistributedOptimizer, its buckets those of the gradient reduction (one per group without
    // --overlap-grad-reduce, as Megatron's bucket_size None).
    const bool apart = expert_parallel_group().size > 1;
    OptimizerShards::Group dense{&data_parallel_group(), {}};
    OptimizerShards::Group experts{&expert_data_parallel_group(), {}};
    for (size_t i = 0; i < params_.size(); ++i) {
      (apart && expert_parallel_flags_[i] ? experts : dense).params.push_back(i);
    }
    std::vector<OptimizerShards::Group> groups = {std::move(dense)};
    if (!experts.params.empty()) groups.push_back(std::move(experts));
    int64_t tied = -1;
    if (const at::Tensor shared = model_->shared_embedding_or_output_weight();
        shared.defined() && embedding_group().size > 1) {
      tied = static_cast<int64_t>(index_of(shared));
    }
    shards_ = std::make_unique<OptimizerShards>(params_, std::move(groups), ddp_bucket_size(),
                                                tied);
  }
  if (is_16bit(model_->dtype())) {
    // Megatron's Float16OptimizerWithFloat16Params with main-grad buffers (mixed_precision.h).
    std::optional<GradScaler> scaler;
    if (config_.loss_scale) {
      scaler = GradScaler::constant(*config_.loss_scale);
    } else if (config_.dynamic_loss_scale(model_config_)) {
      scaler = GradScaler::dynamic(config_.initial_loss_scale, config_.min_loss_scale,
                                   config_.loss_scale_window, config_.hysteresis);
    }
    mixed_ = std::make_unique<MixedPrecisionOptimizer>(
        params_,
        AdamWSettings{config_.lr, config_.adam_beta1, config_.adam_beta2, config_.adam_eps,
                      config_.weight_decay},
        config_.fp32_main_grads(model_config_) ? at::kFloat : model_->dtype(), scaler,
        shards_.get());
    grads_ = mixed_->main_grads();
  } else {
    {
      // Gradients live for the whole run: allocated once here, zeroed in place each step.
      at::NoGradGuard no_grad;
      for (auto& p : params_) p.mutable_grad() = at::zeros_like(p);
    }
    for (auto& p : params_) grads_.push_back(p.grad());
    // With the distributed optimizer AdamW steps views of this rank's elements of each parameter
    // (Megatron's fp32 shards are views of the parameters too), their gradients views of the
    // gradients' same elements; the step writes straight into the parameters.
    optimizer_params_ = params_;
    if (shards_) {
      for (size_t i = 0; i < params_.size(); ++i) {
        optimizer_params_[i] = shards_->shard(params_[i].detach(), i);
        optimizer_params_[i].mutable_grad() = shards_->shard(grads_[i], i);
      }
    }
    optimizer_ = std::make_unique<torch::optim::AdamW>(
        optimizer_params_, torch::optim::AdamWOptions(config_.lr)
                     .betas({config_.adam_beta1, config_.adam_beta2})
                     .eps(config_.adam_eps)
                     .weight_decay(config_.weight_decay));
  }
  // The gradients the sequence-parallel all-reduce sums (at 16 bits: their main grads), found
  // once here rather than per step.
  for (const auto& p : model_->sequence_parallel_parameters()) {
    sequence_parallel_grads_.push_back(grads_[index_of(p)]);
  }
  std::vector<GradNormParameter> norm_attributes(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    norm_attributes[i] = {tensor_parallel_flags_[i], expert_parallel_flags_[i], false};
  }
  if (const at::Tensor shared = model_->shared_embedding_or_output_weight();
      shared.defined() && embedding_group().size > 1) {
    const size_t i = index_of(shared);
    embedding_grad_ = grads_[i];
    // The last stage's copy is left out of the gradient norm: it equals the first stage's after
    // the embedding all-reduce (Megatron's param_is_not_shared).
    norm_attributes[i].shared_copy = !model_->pre_process();
  }
  grad_norm_roles_ = grad_norm_roles(norm_attributes, tensor_parallel_group().rank,
                                     expert_parallel_group().size);
  if (train_samples) {
    train_sampler_ = std::make_unique<DatasetBatches>(
        train_samples, model_config_.seq_length, model_config_.micro_batch_size,
        model_config_.vocab_size, "training");
    if (valid_samples) {
      valid_sampler_ = std::make_unique<DatasetBatches>(
          valid_samples, model_config_.seq_length, model_config_.micro_batch_size,
          model_config_.vocab_size, "validation");
    }
  } else {
    train_sampler_ = std::make_unique<BatchSampler>(corpus_.train, model_config_.seq_length,
                                                    model_config_.micro_batch_size,
                                                    model_config_.seed);
    valid_sampler_ = std::make_unique<BatchSampler>(corpus_.valid, model_config_.seq_length,
                                                    model_config_.micro_batch_size,
                                                    model_config_.seed + 1);
  }
  if (config_.overlap_grad_reduce && data_parallel_group().size > 1) {
    // After the main-grad hooks (mixed_), so each parameter's hook sees its accumulated gradient
    // (Note [Overlapped gradient reduction] in grad_reducer.h). The routed experts reduce over
    // the expert-data-parallel group when expert parallelism splits them.
    const int64_t d = data_parallel_group().size;
    const bool apart = expert_parallel_group().size > 1;
    GradReducer::Group dense{&data_parallel_group(), {}, {}};
    GradReducer::Group experts{&expert_data_parallel_group(), {}, {}};
    for (size_t i = 0; i < params_.size(); ++i) {
      GradReducer::Group& g = apart && expert_parallel_flags_[i] ? experts : dense;
      g.params.push_back(params_[i]);
      g.grads.push_back(grads_[i]);
    }
    std::vector<GradReducer::Group> groups = {std::move(dense)};
    if (!experts.params.empty()) groups.push_back(std::move(experts));
    grad_reducer_ = std::make_unique<GradReducer>(std::move(groups), *ddp_bucket_size(),
                                                  1.0 / static_cast<double>(d));
  }
  timeline_ = std::make_unique<MemoryTimeline>(memory_);
  const ActivationPlan& plan = model_->plan();
  if (plan.offloads()) {
    // On CUDA the copy engine uses CUDA streams and pinned host buffers (copy_engine.h).
    offloader_ = std::make_unique<ActivationOffloader>(
        plan.min_offloaded_tensor_size, config_.offload_bandwidth_gbps * 1e9,
        static_cast<int>(plan.max_inflight_offloads), device_);
    for (const auto& p : params_) offloader_->exclude(p);
    for (const auto& b : model_->buffers()) offloader_->exclude(b);
    offloader_->exclude(model_->attention_mask());
    model_->set_activation_offloader(offloader_.get());
  }
  // With a capacity factor and no padding an MoE model's bytes depend on the routing: predicted
  // per step from the router's counts (train_step); otherwise once, here.
  routing_dependent_prediction_ =
      model_config_.is_moe() && !moe_expert_rows(model_config_, 0).has_value();
  if (!routing_dependent_prediction_) {
    for (int64_t c = 0; c < model_->num_model_chunks(); ++c) {
      chunk_activation_bytes_.push_back(
          predict_activation_bytes(model_config_, plan, model_config_.element_bytes(),
                                   device_.is_cpu(), nullptr, pipeline_parallel_group().rank, c)
              .total);
    }
    predicted_activation_bytes_ = chunk_activation_bytes_.front();
  }
  if (config_.num_microbatches_with_partial_activation_checkpoints) {
    // The block method over all of a chunk's layers: what the model runs in every-layer mode.
    TransformerConfig every = model_config_;
    int64_t largest = 0;  // the model's largest chunk (make_activation_plan's bound on n)
    for (int64_t s = 0; s < model_config_.pipeline_model_parallel_size; ++s) {
      for (int64_t c = 0; c < model_config_.virtual_pipeline_size(); ++c) {
        largest = std::max(largest, model_config_.model_chunk_layers(s, c).count);
      }
    }
    every.recompute_num_layers = largest;
    every_layer_plan_ = std::make_unique<ActivationPlan>(make_activation_plan(every));
    if (!routing_dependent_prediction_) {
      for (int64_t c = 0; c < model_->num_model_chunks(); ++c) {
        every_layer_chunk_bytes_.push_back(
            predict_activation_bytes(model_config_, *every_layer_plan_, model_config_.element_bytes(),
                                     device_.is_cpu(), nullptr, pipeline_parallel_group().rank, c)
                .total);
      }
    }
  }
}

Trainer::~Trainer() = default;

std::optional<int64_t> Trainer::ddp_bucket_size() const {
  // Megatron: --ddp-bucket-size, by default max(40M, 1M x d); None (one bucket) without
  // --overlap-grad-reduce.
  if (!config_.overlap_grad_reduce) return std::nullopt;
  return config_.ddp_bucket_size.value_or(
      std::max<int64_t>(40000000, 1000000 * data_parallel_group().size));
}

double Trainer::lr_at(int64_t it) const {
  // it is 1-based. Warmup is linear from lr/warmup to lr; then decay to min_lr at train_iters.
  const auto& c = config_;
  if (c.lr_warmup_iters > 0 && it <= c.lr_warmup_iters) {
    return c.lr * static_cast<double>(it) / static_cast<double>(c.lr_warmup_iters);
  }
  if (c.lr_decay_style == "constant" || c.train_iters <= c.lr_warmup_iters) return c.lr;
  const double progress = static_cast<double>(it - c.lr_warmup_iters) /
                          static_cast<double>(c.train_iters - c.lr_warmup_iters);
  const double coeff = c.lr_decay_style == "linear"
                           ? 1.0 - progress
                           : 0.5 * (std::cos(M_PI * progress) + 1.0);
  return c.min_lr + coeff * (c.lr - c.min_lr);
}

// Note [The steps of a training step]
// train_step() reads as Megatron's train_step: forward and backward of every micro-batch
// (forward_backward_func), the reduction of the gradients the ranks computed on their own tokens
// (finalize_model_grads), the gradient norm with its NaN check and the clip
// (clip_grad_norm_fp32), the optimizer step, and the measurements. The order of these steps is
// the order of their floating-point operations: changing it changes the bits.
IterationStats Trainer::train_step(bool compute_digest) {
  SwapRngState rng(generators_, rng_state_);
  SwapTracker tracker(tracker_);
  std::unique_ptr<TraceScope> trace_scope;
  if (trace_ != nullptr) trace_scope = std::make_unique<TraceScope>(*trace_);
  IterationStats st;
  st.iteration = ++iteration_;
  st.predicted_activation_bytes = predicted_activation_bytes_;
  // The schedule advances with the optimizer steps taken: a skipped step (loss-scale overflow)
  // leaves it where it was, as Megatron's opt_param_scheduler.step only on a successful update.
  st.lr = lr_at(scheduler_steps_ + 1);
  if (mixed_) {
    mixed_->set_lr(st.lr);
    mixed_->zero_grad();
    st.loss_scale = mixed_->loss_scale();
  } else {
    for (auto& group : optimizer_->param_groups()) {
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(st.lr);
    }
    for (auto& g : grads_) g.zero_();
  }
  if (offloader_) offloader_->begin_step();

  StepClock clock{0.0, memory_.current_bytes()};
  forward_backward(st, clock);
  // What follows the backward is measured on its own (IterationStats::optimizer_peak_bytes).
  clock.peak = std::max(clock.peak, memory_.peak_bytes());
  memory_.reset_peak();
  // Megatron's finalize_model_grads: the data-parallel sync, then the sequence-parallel norms.
  reduce_data_parallel_gradients();
  reduce_sequence_parallel_gradients();
  reduce_embedding_gradients();
  const auto t1 = Clock::now();
  if (mixed_) {
    // Unscale and check for inf/NaN on every tensor-parallel rank (Megatron all-reduces
    // found_inf with MAX over the model-parallel group); the scaler updates either way.
    // With expert parallelism the experts' gradients differ between expert-parallel ranks:
    // they agree over that group too, so all skip or none.
    st.skipped = mixed_->unscale_and_check([this](bool local) {
      if (tensor_parallel_group().size == 1 && expert_parallel_group().size == 1 &&
          pipeline_parallel_group().size == 1) {
        return local;
      }
      const at::Tensor flag = at::full({1}, local ? 1.0f : 0.0f,
                                       at::TensorOptions().dtype(at::kFloat).device(device_));
      return group_all_reduce_sum(
                 pipeline_parallel_group(),
                 group_all_reduce_sum(expert_parallel_group(), all_reduce_sum(flag)))
                 .item<float>() > 0.0f;
    });
  }
  clock.busy_s += seconds_since(t1);
  if (compute_digest) st.grad_digest = digest_of(grads_);
  gather_rank_stats(st, compute_digest);
  const auto t2 = Clock::now();
  if (st.skipped) {
    st.grad_norm = std::numeric_limits<double>::quiet_NaN();
  } else {
    st.grad_norm = clip_gradients(st);
    if (mixed_) {
      mixed_->step();
    } else {
      optimizer_->step();
      // The distributed optimizer's all-gather of every rank's updated elements.
      if (shards_) shards_->all_gather(params_);
    }
    ++scheduler_steps_;
  }
  synchronize_device(device_);
  clock.busy_s += seconds_since(t2);
  st.optimizer_peak_bytes = memory_.peak_bytes();
  clock.peak = std::max(clock.peak, st.optimizer_peak_bytes);
  finish_stats(st, clock);
  st.consumed_samples = consumed_train_samples();
  return st;
}

std::pair<at::Tensor, at::Tensor> Trainer::next_microbatch() {
  // Megatron's sampler: micro-batch m of data-parallel rank r is the global batch's micro-batch
  // m * d + r (each rank draws them all and keeps its own, so every rank's sampler stays where a
  // single process's would be). Every pipeline stage draws alike: the first reads the tokens,
  // the last the labels.
  const TensorParallelGroup& dp = data_parallel_group();
  std::pair<at::Tensor, at::Tensor> batch;
  for (int r = 0; r < dp.size; ++r) {
    auto drawn = train_sampler_->next();
    if (r == dp.rank) batch = std::move(drawn);
  }
  return {batch.first.to(device_), batch.second.to(device_)};
}

PipelineP2P Trainer::pipeline_p2p() const {
  // What crosses a stage boundary: [s, b, h] in the parameters' type, or with sequence
  // parallelism this rank's [s/t, b, h] shard (Megatron's get_tensor_shapes).
  const int64_t t = tensor_parallel_group().size;
  const int64_t s = model_config_.sequence_parallel ? model_config_.seq_length / t
                                                    : model_config_.seq_length;
  return PipelineP2P(pipeline_parallel_group(),
                     {s, model_config_.micro_batch_size, model_config_.hidden_size},
                     at::TensorOptions().dtype(model_->dtype()).device(device_),
                     /*ring=*/model_config_.virtual_pipeline_size() > 1);
}

std::unique_ptr<LedgerScope> Trainer::open_ledger(const at::Tensor& tokens,
                                                  const at::Tensor& labels) {
  if (ledger_ == nullptr) return nullptr;
  ledger_->clear();
  ledger_->exclude(params_);
  for (const auto& buffer : model_->buffers()) ledger_->exclude(buffer);
  ledger_->exclude(model_->attention_mask());
  ledger_->exclude(tokens);
  ledger_->exclude(labels);
  return std::make_unique<LedgerScope>(*ledger_);
}

void Trainer::forward_backward(IterationStats& st, StepClock& clock) {
  const TensorParallelGroup& dp = data_parallel_group();
  const int64_t n_micro = config_.num_microbatches(model_config_.micro_batch_size, dp.size);
  synchronize_device(device_);
  // Megatron's MoEAuxLossAutoScaler.set_loss_scale(loss_scale / num_microbatches): the auxiliary
  // losses are weighted in backward as the main loss is.
  model_->moe_stats().reset();
  model_->set_moe_aux_loss_scale((mixed_ && mixed_->scaler() ? mixed_->loss_scale() : 1.0) /
                                 static_cast<double>(n_micro));
  const double loss_sum = pipeline_parallel_group().size > 1
                              ? forward_backward_pipelined(st, clock, n_micro)
                              : forward_backward_microbatches(st, clock, n_micro);
  finish_forward_backward(st, loss_sum);
}

double Trainer::forward_backward_microbatches(IterationStats& st, StepClock& clock,
                                              int64_t n_micro) {
  const bool record = record_timeline_ || trace_ != nullptr;
  double loss_sum = 0.0;
  for (int64_t m = 0; m < n_micro; ++m) {
    const auto [tokens, labels] = next_microbatch();
    synchronize_device(device_);
    std::unique_ptr<TimelineScope> scope;
    if (record && m == 0) {
      timeline_->clear();
      scope = std::make_unique<TimelineScope>(*timeline_);
    }
    std::unique_ptr<LedgerScope> ledger_scope = m == 0 ? open_ledger(tokens, labels) : nullptr;
    if (offloader_) offloader_->begin_forward();  // each micro-batch: a forward of its own
    memory_.reset_peak();
    const int64_t before = memory_.current_bytes();
    const auto t0 = Clock::now();
    at::Tensor loss = model_->forward(tokens, labels);
    ledger_scope.reset();
    if (n_micro > 1) loss = loss / static_cast<double>(n_micro);
    synchronize_device(device_);
    const int64_t after_forward = memory_.current_bytes();
    // Megatron's no_sync for every micro-batch but the last.
    if (grad_reducer_) grad_reducer_->set_last_microbatch(m == n_micro - 1);
    if (mixed_ && mixed_->scaler()) {
      // Megatron's grad_scale_func: backward from loss * scale (an fp32 product).
      (loss * mixed_->loss_scale()).backward();
    } else {
      loss.backward();
    }
    synchronize_device(device_);
    clock.busy_s += seconds_since(t0);
    timeline_mark("bwd end");
    const int64_t peak = memory_.peak_bytes();
    st.activation_bytes = std::max(st.activation_bytes, after_forward - before);
    if (routing_dependent_prediction_) {
      // Exact given each micro-batch's routing (memory_model.h): the largest over the step's
      // micro-batches, as activation_bytes is.
      const MoERouting routing = model_->moe_stats().last_routing();
      st.predicted_activation_bytes = std::max(
          m == 0 ? int64_t{0} : st.predicted_activation_bytes,
          predict_activation_bytes(model_config_, model_->plan(), model_config_.element_bytes(),
                                   device_.is_cpu(), &routing).total);
    }
    st.activation_peak_bytes = std::max(st.activation_peak_bytes, peak - before);
    clock.peak = std::max(clock.peak, peak);
    loss_sum += loss.item<double>();
  }
  // One micro-batch in flight at a time.
  st.inflight_activation_bytes = st.activation_bytes;
  st.predicted_inflight_activation_bytes = st.predicted_activation_bytes;
  return loss_sum;
}

// Note [Pipeline step]
// One stage's share of a step under the 1F1B schedule (Note [1F1B] in pipeline.cpp). Forward of
// micro-batch m: the input received from the previous stage becomes a leaf that requires grad;
// the stage's output is sent on and dropped, keeping only its gradient edge (Megatron's
// deallocate_output_tensor: the output's memory is freed once sent, and backward runs the
// autograd engine from the edge with the gradient the next stage returns). The last stage's
// output is its loss (divided by the micro-batch count), backward from it as without a pipeline.
// What a micro-batch holds from its forward to its backward is this stage's activations, the
// received input among them (the first layer's norm saves it); at the end of its forward, its
// output as well.
double Trainer::forward_backward_pipelined(IterationStats& st, StepClock& clock, int64_t n_micro) {
  const TensorParallelGroup& pp = pipeline_parallel_group();
  const bool record = record_timeline_ || trace_ != nullptr;
  const PipelineP2P p2p = pipeline_p2p();
  struct InFlight {
    int64_t microbatch = 0;
    int offload_forward = -1;          // the offloader's number for this forward
    at::Tensor input;                  // the received input (a leaf), undefined on the first stage
    torch::autograd::Edge output_edge;  // where the output's gradient enters (not the last stage)
    at::Tensor loss;                   // the last stage's
  };
  const int64_t chunks = model_->num_model_chunks();
  std::vector<std::deque<InFlight>> in_flight(static_cast<size_t>(chunks));  // per model chunk
  // Per model chunk and micro-batch, the bytes predicted to stay from its forward to its backward.
  std::vector<std::vector<int64_t>> predicted(static_cast<size_t>(chunks),
                                              std::vector<int64_t>(static_cast<size_t>(n_micro)));
  double loss_sum = 0.0;
  // The step's batches first, so what the stage holds at once is measured without them.
  std::vector<std::pair<at::Tensor, at::Tensor>> batches;
  for (int64_t m = 0; m < n_micro; ++m) batches.push_back(next_microbatch());
  synchronize_device(device_);
  const int64_t step_base = memory_.current_bytes();
  memory_.reset_peak();
  std::unique_ptr<TimelineScope> scope;
  if (record) {
    // The whole schedule: the memory of every in-flight micro-batch, forwards and backwards.
    timeline_->clear();
    scope = std::make_unique<TimelineScope>(*timeline_);
  }
  const auto t0 = Clock::now();
  schedule_.clear();
  // The schedule's computations in order: each callback checks it is the one expected and looks
  // at the next (Note [Offload under pipeline schedules] in activation_offloader.h).
  const std::vector<PipelineStep> order = pipeline_compute_order(
      pp.rank, pp.size, chunks, n_micro, model_config_.microbatch_group_size());
  // Note [Partial activation checkpoints]
  // Megatron's --num-microbatches-with-partial-activation-checkpoints N (schedules.py, after
  // Korthikanti et al. 2022, appendix C): a stage keeps at most W = warmup + 1 forwards in flight
  // (its max_outstanding_backprops); forward k (counted over the step, every model chunk) checks
  // k % W >= N: false for the first N of each window, which run the configured plan (the block
  // method's first recompute_num_layers layers checkpointed), true for the others, which
  // checkpoint every layer. So at most N in-flight micro-batches keep the partial plan's bytes;
  // the last stage (W = 1) runs every micro-batch partially. Megatron passes the flag to the
  // model's forward step, which its mcore GPT ignores; here the model applies it
  // (TransformerBlock::set_checkpoint_every_layer), bitwise like any recompute.
  // W is read off the stage's own order: the forwards before its first backward are the warmup
  // and one more (all of them when the schedule is all warmup, where k mod W is k either way).
  const std::optional<int64_t>& partial = config_.num_microbatches_with_partial_activation_checkpoints;
  const int64_t outstanding =
      std::find_if(order.begin(), order.end(),
                   [](const PipelineStep& s) { return s.kind == PipelineStep::Kind::kBackward; }) -
      order.begin();
  int64_t forwards_run = 0;
  size_t computed = 0;
  auto advance = [&](PipelineStep::Kind kind, int64_t m, int64_t chunk) -> const PipelineStep* {
    TORCH_INTERNAL_ASSERT(computed < order.size() && order[computed].kind == kind &&
                              order[computed].microbatch == m && order[computed].chunk == chunk,
                          "the pipeline ran a computation out of pipeline_compute_order's order");
    ++computed;
    return computed < order.size() ? &order[computed] : nullptr;
  };
  // Before a computation followed by another micro-batch's backward: start that backward's
  // first reloads, so they overlap this computation.
  auto prefetch_for = [&](const PipelineStep* next, int64_t m, int64_t chunk) {
    if (!offloader_ || next == nullptr || next->kind != PipelineStep::Kind::kBackward ||
        (next->microbatch == m && next->chunk == chunk)) {
      return;
    }
    const std::deque<InFlight>& queue = in_flight[static_cast<size_t>(next->chunk)];
    TORCH_INTERNAL_ASSERT(!queue.empty() && queue.front().microbatch == next->microbatch,
                          "the next backward's forward is not the oldest in flight");
    offloader_->prefetch_backward_start(queue.front().offload_forward);
  };
  // The wall clock: one clock for every process of a node, and across nodes as aligned as their
  // clocks are (the steady clock's epoch differs between machines).
  auto shared_clock_s = [] {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  };
  auto forward = [&](int64_t m, int64_t chunk, const at::Tensor& received) {
    const double start = shared_clock_s();
    const auto& [tokens, labels] = batches[static_cast<size_t>(m)];
    const PipelineStep* next = advance(PipelineStep::Kind::kForward, m, chunk);
    prefetch_for(next, m, chunk);
    InFlight f;
    f.microbatch = m;
    if (offloader_) {
      const bool own_backward_next = next != nullptr &&
                                     next->kind == PipelineStep::Kind::kBackward &&
                                     next->microbatch == m && next->chunk == chunk;
      f.offload_forward = offloader_->begin_forward(chunk, own_backward_next);
    }
    int64_t before = memory_.current_bytes();
    if (received.defined()) {
      f.input = received;
      f.input.requires_grad_(true);
      before -= p2p.bytes();  // this micro-batch's from its receipt
    }
    std::unique_ptr<LedgerScope> ledger_scope =
        m == 0 && chunk == 0 ? open_ledger(tokens, labels) : nullptr;
    // Note [Partial activation checkpoints]
    const bool every_layer = partial && forwards_run % outstanding >= *partial;
    ++forwards_run;
    model_->set_checkpoint_every_layer(every_layer);
    at::Tensor out = model_->forward_stage(tokens, labels, f.input, chunk);
    model_->set_checkpoint_every_layer(false);
    ledger_scope.reset();
    if (model_->chunk_post_process(chunk)) {
      if (n_micro > 1) out = out / static_cast<double>(n_micro);
      loss_sum += out.item<double>();
      f.loss = out;
      out = at::Tensor();
    } else {
      f.output_edge = torch::autograd::impl::gradient_edge(out);
    }
    synchronize_device(device_);
    const int64_t after = memory_.current_bytes();
    st.activation_bytes = std::max(st.activation_bytes, after - before);
    st.inflight_activation_bytes = std::max(st.inflight_activation_bytes, after - step_base);
    predicted[static_cast<size_t>(chunk)][static_cast<size_t>(m)] =
        predicted_chunk_bytes(chunk, p2p.bytes(), every_layer);
    in_flight[static_cast<size_t>(chunk)].push_back(std::move(f));
    schedule_.push_back({true, m, start, shared_clock_s(), chunk});
    return out;
  };
  auto backward = [&](int64_t m, int64_t chunk, const at::Tensor& output_grad) {
    const double start = shared_clock_s();
    std::deque<InFlight>& queue = in_flight[static_cast<size_t>(chunk)];
    InFlight f = std::move(queue.front());
    queue.pop_front();
    TORCH_INTERNAL_ASSERT(f.microbatch == m, "backward of micro-batch ", m, " found ", f.microbatch);
    prefetch_for(advance(PipelineStep::Kind::kBackward, m, chunk), m, chunk);
    // The chunk's last backward of the step reduces its gradients (Megatron's interleaved
    // schedule enables grad sync for each model chunk's last micro-batch).
    if (grad_reducer_) grad_reducer_->set_last_microbatch(m == n_micro - 1);
    if (f.loss.defined()) {
      if (mixed_ && mixed_->scaler()) {
        (f.loss * mixed_->loss_scale()).backward();  // Megatron's grad_scale_func
      } else {
        f.loss.backward();
      }
    } else {
      torch::autograd::Engine::get_default_engine().execute(
          {f.output_edge}, {output_grad}, /*keep_graph=*/false, /*create_graph=*/false,
          /*accumulate_grad=*/true);
    }
    synchronize_device(device_);
    schedule_.push_back({false, m, start, shared_clock_s(), chunk});
    return f.input.defined() ? f.input.grad() : at::Tensor();
  };
  if (chunks > 1) {
    run_interleaved_one_f_one_b(p2p, chunks, n_micro, model_config_.microbatch_group_size(),
                                forward, backward);
  } else {
    run_one_f_one_b(
        p2p, n_micro, [&](int64_t m, const at::Tensor& in) { return forward(m, 0, in); },
        [&](int64_t m, const at::Tensor& g) { return backward(m, 0, g); });
  }
  synchronize_device(device_);
  clock.busy_s += seconds_since(t0);
  timeline_mark("bwd end");
  const int64_t peak = memory_.peak_bytes();
  st.activation_peak_bytes = peak - step_base;
  clock.peak = std::max(clock.peak, peak);
  // Per micro-batch: this stage's activations (predicted_chunk_bytes; with routing-dependent MoE
  // layers each micro-batch's own) and, at the end of its forward, its output (not on the last
  // stage). At once, what the schedule holds at the end of each forward, replayed over the
  // computations the stage ran: under 1F1B min(p - stage, M) micro-batches; under the interleaved
  // schedule the micro-batches of every chunk in flight, the received inputs and gradients queued
  // for later steps and the output about to be sent (pipeline_memory in pipeline.h).
  const auto bytes_of = [&](int64_t c, int64_t m) {
    return predicted[static_cast<size_t>(c)][static_cast<size_t>(m)];
  };
  st.predicted_activation_bytes = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    for (int64_t m = 0; m < n_micro; ++m) {
      st.predicted_activation_bytes =
          std::max(st.predicted_activation_bytes,
                   bytes_of(c, m) + (model_->chunk_post_process(c) ? 0 : p2p.bytes()));
    }
  }
  if (chunks > 1) {
    st.predicted_inflight_activation_bytes =
        pipeline_memory(interleaved_schedule(pp.rank, pp.size, chunks, n_micro,
                                             model_config_.microbatch_group_size()),
                        pp.rank, pp.size, chunks, bytes_of, p2p.bytes())
            .peak_at_forward_end;
  } else {
    const int64_t output = model_->post_process() ? 0 : p2p.bytes();
    int64_t held = 0;
    st.predicted_inflight_activation_bytes = 0;
    for (const PipelineStep& s : order) {
      if (s.kind == PipelineStep::Kind::kForward) {
        held += bytes_of(0, s.microbatch);
        st.predicted_inflight_activation_bytes =
            std::max(st.predicted_inflight_activation_bytes, held + output);
      } else {
        held -= bytes_of(0, s.microbatch);
      }
    }
  }
  return from_last_stage(loss_sum);  // the loss is the last stage's: every stage reports it
}

int64_t Trainer::predicted_chunk_bytes(int64_t chunk, int64_t boundary_bytes,
                                       bool every_layer) const {
  // A micro-batch's bytes in a model chunk: its layers' bytes (the received input among them: the
  // first layer's norm keeps it, as it keeps the embedding's output on the first stage). With
  // distribute_saved_activations a checkpoint that starts the chunk keeps its 1/t shard of the
  // received input, and the input itself stays too (the schedule needs its gradient; Megatron's
  // CheckpointFunction swaps the tensor's storage for the shard instead, which this project does
  // not do).
  const ActivationPlan& plan = every_layer ? *every_layer_plan_ : model_->plan();
  const bool kept_input =
      !model_->chunk_pre_process(chunk) && plan.distribute_saved_activations &&
      plan.layers[static_cast<size_t>(model_->stage_layers(chunk).offset)].starts_chunk;
  int64_t layers = 0;
  if (routing_dependent_prediction_) {
    // The chunk's MoE layers as its latest forward routed them (the caller asks right after it).
    const TransformerConfig::StageLayers mine = model_->stage_layers(chunk);
    MoERouting routing;
    for (const auto& l : model_->moe_stats().layers) {
      if (mine.contains(l.layer_number - 1)) {
        routing.emplace_back(l.last_tokens_per_expert, l.last_dispatched_rows);
      }
    }
    layers = predict_activation_bytes(model_config_, plan, model_config_.element_bytes(),
                                      device_.is_cpu(), &routing, pipeline_parallel_group().rank,
                                      chunk)
                 .total;
  } else {
    layers = (every_layer ? every_layer_chunk_bytes_ : chunk_activation_bytes_)
                 .at(static_cast<size_t>(chunk));
  }
  return layers + (kept_input ? boundary_bytes : 0);
}

double Trainer::from_last_stage(double value) const {
  const TensorParallelGroup& pp = pipeline_parallel_group();
  if (pp.size == 1) return value;
  // The other stages add zeros, which is exact.
  return group_all_reduce_sum(
             pp, at::tensor({model_->post_process() ? value : 0.0}, at::kDouble).to(device_))
      .item<double>();
}

void Trainer::finish_forward_backward(IterationStats& st, double loss_sum) {
  const TensorParallelGroup& dp = data_parallel_group();
  st.loss = loss_sum;  // the losses were divided by n_micro, so their sum is the mean
  MoEStats moe = model_->moe_stats();
  if (!moe.layers.empty() && tensor_parallel_group().size > 1) {
    // With sequence parallelism each tensor rank routed its own s/t tokens: the step's counts
    // and load-balancing shares are summed over the tensor ranks, the z-losses (means over a
    // rank's tokens) averaged, for the log.
    std::vector<double> v;
    for (const auto& l : moe.layers) {
      v.push_back(static_cast<double>(l.routed));
      v.push_back(static_cast<double>(l.dropped));
      v.push_back(l.load_balancing_loss);
      v.push_back(l.z_loss / static_cast<double>(tensor_parallel_group().size));
      for (const int64_t n : l.routed_per_expert) v.push_back(static_cast<double>(n));
    }
    const at::Tensor sum = all_reduce_sum(at::tensor(v, at::kDouble).to(device_)).cpu();
    const double* p = sum.data_ptr<double>();
    for (auto& l : moe.layers) {
      l.routed = static_cast<int64_t>(*p++);
      l.dropped = static_cast<int64_t>(*p++);
      l.load_balancing_loss = *p++;
      l.z_loss = *p++;
      for (auto& n : l.routed_per_expert) n = static_cast<int64_t>(*p++);
    }
  }
  if (model_config_.is_moe() && pipeline_parallel_group().size > 1) {
    moe = gather_moe_stats_over_stages(moe);
  }
  if (!moe.layers.empty()) {
    st.moe = true;
    const double lb = moe.mean_load_balancing_loss(), z = moe.mean_z_loss();
    if (!std::isnan(lb)) st.load_balancing_loss = lb;
    if (!std::isnan(z)) st.z_loss = z;
    st.expert_load_imbalance = moe.max_load_imbalance();
    st.moe_routed_tokens = moe.total_routed();
    st.moe_dropped_tokens = moe.total_dropped();
  }
  if (dp.size > 1) {
    // For the log: the mean loss over the data-parallel ranks (as Megatron reports), the global
    // batch's routed and dropped token counts, and the auxiliary losses averaged over the ranks
    // (Megatron's MoE metrics tracker, needs_dp_avg), in one all-reduce.
    const double d = static_cast<double>(dp.size);
    const at::Tensor all = data_parallel_all_reduce_sum(at::tensor(
        {loss_sum, static_cast<double>(st.moe_routed_tokens), static_cast<double>(st.moe_dropped_tokens),
         st.load_balancing_loss.value_or(0.0), st.z_loss.value_or(0.0)},
        at::kDouble));
    st.loss = all[0].item<double>() / d;
    st.moe_routed_tokens = static_cast<int64_t>(all[1].item<double>());
    st.moe_dropped_tokens = static_cast<int64_t>(all[2].item<double>());
    if (st.load_balancing_loss) st.load_balancing_loss = all[3].item<double>() / d;
    if (st.z_loss) st.z_loss = all[4].item<double>() / d;
  }
}

MoEStats Trainer::gather_moe_stats_over_stages(const MoEStats& local) const {
  // Each stage routed its own MoE layers: every layer's counts and loss sums go in the model's
  // slot for it, zeros elsewhere, summed over the pipeline group (exact: one non-zero term each).
  // Megatron's tracker does the same (reduce_aux_losses_tracker_across_ranks in
  // megatron/core/transformer/moe/moe_utils.py, an all-reduce over the pipeline group of values
  // indexed by layer).
  const std::vector<bool> is_moe = model_config_.moe_layers();
  const int64_t experts = model_config_.num_moe_experts;
  const int64_t fields = 6 + experts;
  std::vector<int64_t> slot(is_moe.size(), -1);  // layer index -> MoE layer index in the model
  int64_t n = 0;
  for (size_t i = 0; i < is_moe.size(); ++i) {
    if (is_moe[i]) slot[i] = n++;
  }
  std::vector<double> v(static_cast<size_t>(n * fields), 0.0);
  for (const auto& l : local.layers) {
    const int64_t k = slot.at(static_cast<size_t>(l.layer_number - 1));
    TORCH_INTERNAL_ASSERT(k >= 0, "MoE statistics for a dense layer ", l.layer_number);
    double* p = v.data() + k * fields;
    p[0] = static_cast<double>(l.routed);
    p[1] = static_cast<double>(l.dropped);
    p[2] = l.load_balancing_loss;
    p[3] = static_cast<double>(l.load_balancing_count);
    p[4] = l.z_loss;
    p[5] = static_cast<double>(l.z_loss_count);
    for (size_t j = 0; j < l.routed_per_expert.size() && j < static_cast<size_t>(experts); ++j) {
      p[6 + j] = static_cast<double>(l.routed_per_expert[j]);
    }
  }
  const at::Tensor sum =
      group_all_reduce_sum(pipeline_parallel_group(), at::tensor(v, at::kDouble).to(device_)).cpu();
  const double* p = sum.data_ptr<double>();
  MoEStats out;
  for (size_t i = 0; i < is_moe.size(); ++i) {
    if (!is_moe[i]) continue;
    MoEStats::Layer l;
    l.layer_number = static_cast<int64_t>(i) + 1;
    l.routed = static_cast<int64_t>(p[0]);
    l.dropped = static_cast<int64_t>(p[1]);
    l.load_balancing_loss = p[2];
    l.load_balancing_count = static_cast<int64_t>(p[3]);
    l.z_loss = p[4];
    l.z_loss_count = static_cast<int64_t>(p[5]);
    for (int64_t j = 0; j < experts; ++j) l.routed_per_expert.push_back(static_cast<int64_t>(p[6 + j]));
    out.layers.push_back(std::move(l));
    p += fields;
  }
  return out;
}

namespace {
// One collective for many gradients: `tensors` flattened into one buffer, `reduce` applied to
// it, the result copied back into each.
void reduce_as_one(std::vector<at::Tensor>& tensors,
                   const std::function<at::Tensor(at::Tensor)>& reduce) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> flat;
  flat.reserve(tensors.size());
  for (const auto& g : tensors) flat.push_back(g.reshape({-1}));
  const at::Tensor reduced = reduce(at::cat(flat));
  int64_t offset = 0;
  for (auto& g : tensors) {
    const int64_t n = g.numel();
    g.copy_(reduced.narrow(0, offset, n).view_as(g));
    offset += n;
  }
}
}  // namespace

void Trainer::reduce_data_parallel_gradients() {
  const TensorParallelGroup& dp = data_parallel_group();
  if (dp.size == 1) return;
  if (grad_reducer_) {
    grad_reducer_->finish();  // the buckets started during backward, and the rest
    return;
  }
  // Megatron's DistributedDataParallel scales by 1/d before the sum (gradient_scaling_factor);
  // at 16 bits these are the fp32 main grads (accumulate_allreduce_grads_in_fp32).
  const double scale = 1.0 / static_cast<double>(dp.size);
  // With expert parallelism the routed experts' gradients already hold the tokens of their
  // expert-parallel peers (the dispatcher brought them); they are summed over the ranks holding
  // the same experts (the expert-data-parallel group, world / (t e)), scaled by the same 1/d
  // (Megatron's expert_gradient_scaling_factor), so every weight ends with the mean over the
  // global batch. Without it the experts are data-parallel like the rest: one collective.
  const bool apart = expert_parallel_group().size > 1;
  std::vector<at::Tensor> dense, experts;
  for (size_t i = 0; i < grads_.size(); ++i) {
    (apart && expert_parallel_flags_[i] ? experts : dense).push_back(grads_[i]);
  }
  reduce_as_one(dense, [scale](at::Tensor flat) {
    return data_parallel_all_reduce_sum(flat.mul_(scale));
  });
  if (experts.empty()) return;
  reduce_as_one(experts, [scale](at::Tensor flat) {
    return group_all_reduce_sum(expert_data_parallel_group(), flat.mul_(scale));
  });
}

void Trainer::reduce_sequence_parallel_gradients() {
  if (sequence_parallel_grads_.empty()) return;
  // Sequence parallelism: norms and row-parallel biases saw this rank's tokens only; their
  // gradients are summed over the ranks (one flat all-reduce), then equal everywhere.
  // At 16 bits the reduction runs on the main-grad buffers (fp32 with bf16), as Megatron's
  // _allreduce_layernorm_grads reduces param.main_grad.
  reduce_as_one(sequence_parallel_grads_, [](at::Tensor flat) { return all_reduce_sum(flat); });
}

void Trainer::reduce_embedding_gradients() {
  if (!embedding_grad_.defined()) return;
  // Megatron's _allreduce_word_embedding_grads: the first stage's word embedding and the last
  // stage's output layer are one tied weight; each saw half of the uses, so both take the sum.
  at::NoGradGuard no_grad;
  embedding_grad_.copy_(group_all_reduce_sum(embedding_group(), embedding_grad_));
}

void Trainer::gather_rank_stats(IterationStats& st, bool compute_digest) {
  if (tensor_parallel_group().size == 1) return;
  if (compute_digest) {
    const std::string& d = st.grad_digest;
    at::Tensor bytes = at::empty({1, static_cast<int64_t>(d.size())}, at::kByte);
    std::memcpy(bytes.data_ptr<uint8_t>(), d.data(), d.size());
    const at::Tensor all = all_gather_dim0(bytes.to(device_)).cpu();
    for (int64_t r = 0; r < all.size(0); ++r) {
      st.grad_digest_per_rank.emplace_back(reinterpret_cast<const char*>(all[r].data_ptr<uint8_t>()),
                                           d.size());
    }
  }
  st.activation_bytes_per_rank = gather_per_rank(st.activation_bytes, device_);
  st.activation_peak_bytes_per_rank = gather_per_rank(st.activation_peak_bytes, device_);
}

double Trainer::clip_gradients(const IterationStats& st) {
  at::NoGradGuard no_grad;
  // Megatron's clip_grad_norm_fp32 over get_grad_norm_fp32: one function for every layout.
  const double grad_norm = global_grad_norm(grads_, grad_norm_roles_);
  // Megatron fails on a NaN gradient norm (check_for_nan_in_loss_and_grad); stopping before
  // the optimizer step leaves the parameters as they were.
  TORCH_CHECK(std::isfinite(st.loss) && std::isfinite(grad_norm), "actmem::Trainer: "
              "training diverged at iteration ", st.iteration, ": loss ", st.loss,
              ", gradient norm ", grad_norm, "; stopped before the optimizer step (try a "
              "lower --lr, a longer --lr-warmup-iters or --clip-grad)");
  if (config_.clip_grad > 0.0) {
    const double coeff = config_.clip_grad / (grad_norm + 1e-6);
    if (coeff < 1.0) {
      for (auto& g : grads_) g.mul_(coeff);
    }
  }
  return grad_norm;
}

void Trainer::gather_schedule(IterationStats& st, const TensorParallelGroup& pp) const {
  // Every stage ran 2Mv events (M forwards and M backwards per model chunk), so the rows gather
  // evenly; times become
  // seconds from the earliest stage's first event.
  std::vector<double> mine;
  for (const auto& e : schedule_) {
    mine.insert(mine.end(), {e.forward ? 1.0 : 0.0, static_cast<double>(e.microbatch), e.start_s,
                             e.end_s, static_cast<double>(e.chunk)});
  }
  constexpr size_t kFields = 5;
  const at::Tensor all =
      group_all_gather_dim0(pp, at::tensor(mine, at::kDouble).to(device_)).cpu().contiguous();
  const double* v = all.data_ptr<double>();
  const size_t per_stage = mine.size() / kFields;
  double origin = std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < per_stage * static_cast<size_t>(pp.size); ++i) {
    origin = std::min(origin, v[kFields * i + 2]);
  }
  st.pipeline_schedule_per_stage.assign(static_cast<size_t>(pp.size), {});
  for (size_t i = 0; i < per_stage * static_cast<size_t>(pp.size); ++i) {
    const double* e = v + kFields * i;
    st.pipeline_schedule_per_stage[i / per_stage].push_back(
        {e[0] != 0.0, static_cast<int64_t>(e[1]), e[2] - origin, e[3] - origin,
         static_cast<int64_t>(e[4])});
  }
}

void Trainer::finish_stats(IterationStats& st, const StepClock& clock) {
  // The whole global batch's tokens (every data-parallel rank's) per second of this rank's step.
  const int64_t gbs = config_.global_batch(model_config_.micro_batch_size, data_parallel_group().size);
  st.step_time_s = clock.busy_s;
  st.tokens_per_s = static_cast<double>(gbs * model_config_.seq_length) / clock.busy_s;
  st.peak_device_bytes = clock.peak;
  if (tensor_parallel_group().size > 1) {
    st.peak_device_bytes_per_rank = gather_per_rank(clock.peak, device_);
  }
  if (const TensorParallelGroup& pp = pipeline_parallel_group(); pp.size > 1) {
    // Every stage's memory, for the log rank 0 (the first stage) writes.
    const at::Tensor mine = at::tensor({st.inflight_activation_bytes,
                                        st.predicted_inflight_activation_bytes, clock.peak},
                                       at::kLong)
                                .to(device_);
    const at::Tensor all = group_all_gather_dim0(pp, mine).cpu().view({pp.size, 3});
    for (int64_t r = 0; r < pp.size; ++r) {
      st.inflight_activation_bytes_per_stage.push_back(all[r][0].item<int64_t>());
      st.predicted_inflight_activation_bytes_per_stage.push_back(all[r][1].item<int64_t>());
      st.peak_device_bytes_per_stage.push_back(all[r][2].item<int64_t>());
    }
    gather_schedule(st, pp);
  }
  if (trace_ != nullptr) {
    // Compute spans between consecutive timeline marks of the first micro-batch.
    const auto& e = timeline_->entries();
    const auto origin = timeline_->start_time();
    for (size_t i = 1; i < e.size(); ++i) {
      trace_->span("compute", e[i].label,
                   origin + std::chrono::duration_cast<Clock::duration>(
                                std::chrono::duration<double>(e[i - 1].time_s)),
                   origin + std::chrono::duration_cast<Clock::duration>(
                                std::chrono::duration<double>(e[i].time_s)),
                   "{\"device_bytes\": " + std::to_string(e[i].current_bytes) + "}");
    }
  }
  if (offloader_) {
    offloader_->end_step();  // the first step is the warmup (Note [Offload warmup and margin])
    const OffloadStats os = offloader_->stats();
    st.offloaded_bytes = os.offloaded_bytes;
    st.offload_wait_s = os.wait_s;
    st.offload_copy_s = os.d2h_busy_s + os.h2d_busy_s;
    st.host_peak_bytes = offloader_->pool().peak_bytes_in_use();
  }
}

double Trainer::evaluate() {
  TORCH_CHECK(valid_sampler_ != nullptr, "actmem::Trainer::evaluate: no validation data (with "
              "--data-path, validation samples are built only when --eval-interval > 0)");
  at::NoGradGuard no_grad;
  model_->eval();
  double total = 0.0;
  if (pipeline_parallel_group().size > 1) {
    // The schedule's forward-only form: each batch through the stages; the last stage's losses
    // reported by all.
    const PipelineP2P p2p = pipeline_p2p();
    auto forward = [&](int64_t i, int64_t chunk, const at::Tensor& input) {
      auto batch = valid_sampler_->fixed(i, config_.eval_iters);
      at::Tensor out =
          model_->forward_stage(batch.first.to(device_), batch.second.to(device_), input, chunk);
      if (!model_->chunk_post_process(chunk)) return out;
      total += out.item<double>();
      return at::Tensor();
    };
    if (model_->num_model_chunks() == 1) {
      run_one_f_one_b(
          p2p, config_.eval_iters,
          [&](int64_t i, const at::Tensor& input) { return forward(i, 0, input); }, {},
          /*forward_only=*/true);
    } else {
      // Each batch round the ring once per model chunk (no micro-batch grouping rules: nothing
      // waits for a backward).
      for (int64_t i = 0; i < config_.eval_iters; ++i) {
        for (int64_t c = 0; c < model_->num_model_chunks(); ++c) {
          const at::Tensor input = model_->chunk_pre_process(c) ? at::Tensor() : p2p.recv_forward();
          const at::Tensor out = forward(i, c, input);
          if (!model_->chunk_post_process(c)) p2p.send_forward(out);
        }
      }
    }
    total = from_last_stage(total);
  } else {
    for (int64_t i = 0; i < config_.eval_iters; ++i) {
      auto batch = valid_sampler_->fixed(i, config_.eval_iters);
      total += model_->forward(batch.first.to(device_), batch.second.to(device_)).item<double>();
    }
  }
  model_->train();
  return total / static_cast<double>(config_.eval_iters);
}

namespace {
// Note [Offload that moves nothing]: with Megatron's default --min-offloaded-tensor-size (2^20
// elements) a small model saves no tensor large enough, and offload silently does nothing.
std::string zero_offload_warning(const ActivationOffloader& offloader) {
  const auto kept = offloader.largest_below_threshold();
  std::ostringstream os;
  os << "warning: offload moved 0 bytes in its warmup step: ";
  if (kept.numel == 0) {
    os << "the offload groups saved no tensor";
  } else {
    os << "every saved tensor is below --min-offloaded-tensor-size " << offloader.min_elements()
       << " elements; the largest, in group " << kept.group << ", has " << kept.numel
       << " elements ([";
    for (size_t i = 0; i < kept.shape.size(); ++i) os << (i ? ", " : "") << kept.shape[i];
    os << "] " << kept.dtype << "); pass --min-offloaded-tensor-size " << kept.numel
       << " or less to offload it";
  }
  return os.str();
}

// Every rank's `text` of group `g`, in rank order (collective).
std::vector<std::string> gather_text(const TensorParallelGroup& g, const std::string& text,
                                     const at::Device& device) {
  if (g.size == 1) return {text};
  const at::TensorOptions longs = at::TensorOptions().dtype(at::kLong).device(device);
  const at::Tensor lengths =
      group_all_gather_dim0(g, at::full({1}, static_cast<int64_t>(text.size()), longs)).cpu();
  const int64_t longest = lengths.max().item<int64_t>();
  at::Tensor bytes = at::zeros({1, std::max<int64_t>(longest, 1)}, at::kByte);
  std::memcpy(bytes.data_ptr<uint8_t>(), text.data(), text.size());
  const at::Tensor all = group_all_gather_dim0(g, bytes.to(device)).cpu();
  std::vector<std::string> out;
  for (int r = 0; r < g.size; ++r) {
    out.emplace_back(reinterpret_cast<const char*>(all[r].data_ptr<uint8_t>()),
                     static_cast<size_t>(lengths[r].item<int64_t>()));
  }
  return out;
}

// Megatron's offload summary has a row per rank: every pipeline stage's and tensor-parallel
// rank's rows of the first replica ("name\tbytes\ttensors" lines between ranks), labelled by
// stage and tensor rank (collective over both groups).
std::vector<OffloadSummaryRank> gather_offload_summary(const std::vector<OffloadSummaryRow>& mine,
                                                       const at::Device& device) {
  std::ostringstream os;
  for (const auto& r : mine) os << r.name << '\t' << r.bytes << '\t' << r.tensors << '\n';
  const auto& tp = tensor_parallel_group();
  const auto& pp = pipeline_parallel_group();
  std::string stage;  // this stage's tensor ranks, separated by '\f'
  for (const auto& t : gather_text(tp, os.str(), device)) stage += t + '\f';
  std::vector<OffloadSummaryRank> out;
  const auto stages = gather_text(pp, stage, device);
  for (size_t p = 0; p < stages.size(); ++p) {
    std::istringstream ranks(stages[p]);
    std::string rows;
    for (int t = 0; std::getline(ranks, rows, '\f'); ++t) {
      OffloadSummaryRank rank;
      rank.label = pp.size == 1 && tp.size == 1
                       ? "0"
                       : (pp.size > 1 ? "pp" + std::to_string(p) : std::string()) +
                             (pp.size > 1 && tp.size > 1 ? " " : "") +
                             (tp.size > 1 ? "tp" + std::to_string(t) : std::string());
      std::istringstream lines(rows);
      OffloadSummaryRow row;
      while (std::getline(lines, row.name, '\t') && lines >> row.bytes >> row.tensors) {
        lines.ignore(1);  // the line's end
        rank.rows.push_back(row);
      }
      out.push_back(std::move(rank));
    }
  }
  return out;
}
}  // namespace

int Trainer::run(const RunOutput& out,
                 const std::function<void(const IterationStats&)>& on_step,
                 bool compute_digest) {
  TraceRecorder recorder;
  const int64_t first = iteration_ + 1;  // after a loaded checkpoint, the step that follows it
  const int64_t traced = std::min<int64_t>(first + 1, config_.train_iters);
  const int64_t total = config_.train_iters;
  int64_t saved_at = iteration_;  // a loaded checkpoint need not be saved again
  const auto run_start = Clock::now();
  auto save = [&] {
    const auto t0 = Clock::now();
    const std::string where = save_checkpoint(config_.save);
    saved_at = iteration_;
    if (out.progress != nullptr) {
      *out.progress << "saved checkpoint at iteration " << iteration_ << " to " << where << " in "
                    << std::fixed << std::setprecision(2) << seconds_since(t0) << " s\n";
    }
  };
  const int width = static_cast<int>(std::to_string(total).size());
  std::ostream* progress = out.progress;
  double window_time = 0.0;
  int64_t window_steps = 0;
  int64_t window_skipped = 0;  // Megatron's "number of skipped iterations" per log line
  for (int64_t it = first; it <= total; ++it) {
    const bool trace_now = out.trace != nullptr && it == traced;
    if (trace_now) set_trace(&recorder);
    IterationStats st = train_step(compute_digest);
    st.elapsed_s = seconds_since(run_start);
    if (trace_now) {
      set_trace(nullptr);
      // Copies of this step may still be running: wait for the streams to drain first.
      if (offloader_) offloader_->wait_idle();
      out.trace->write(recorder.json(), "the trace of iteration " + std::to_string(it));
      out.trace->close();
      if (progress != nullptr) {
        *progress << "trace of iteration " << it << ": " << out.trace->path() << "\n";
      }
    }
    if (it == first && offloader_) {
      // Every rank gathers (a collective); the progress stream's rank prints.
      const auto summary = gather_offload_summary(offloader_->summary(), device_);
      const bool any = std::any_of(summary.begin(), summary.end(),
                                   [](const OffloadSummaryRank& r) { return !r.rows.empty(); });
      if (progress != nullptr && any) print_offload_summary(*progress, summary);
      if (out.warnings != nullptr && st.offloaded_bytes == 0) {
        *out.warnings << zero_offload_warning(*offloader_) << std::endl;
      }
    }
    window_time += st.step_time_s;
    ++window_steps;
    if (st.skipped) ++window_skipped;
    const bool eval_now = config_.eval_interval > 0 &&
                          (it % config_.eval_interval == 0 || it == total);
    if (eval_now) st.val_loss = evaluate();
    if (progress != nullptr && (it % config_.log_interval == 0 || it == first || it == total)) {
      const double mean_step = window_time / static_cast<double>(window_steps);
      *progress << "iter " << std::setw(width) << it << "/" << total << " | loss " << std::fixed
                << std::setprecision(4) << st.loss;
      if (st.skipped) {
        *progress << " | skipped (gradient overflow at loss scale " << std::defaultfloat
                  << st.loss_scale << ")" << std::fixed;
      } else {
        *progress << " | grad norm " << std::setprecision(3) << st.grad_norm;
      }
      if (mixed_ && mixed_->scaler()) {
        *progress << " | loss scale " << std::defaultfloat << mixed_->loss_scale() << std::fixed
                  << " | skipped " << window_skipped;
      }
      if (st.moe) {
        // Megatron's names: load_balancing_loss and z_loss, unscaled (1 = balanced routing).
        if (st.load_balancing_loss) {
          *progress << " | load_balancing_loss " << std::setprecision(3) << *st.load_balancing_loss;
        }
        if (st.z_loss) *progress << " | z_loss " << std::setprecision(3) << *st.z_loss;
        *progress << " | expert load max/mean " << std::setprecision(2) << st.expert_load_imbalance;
        if (model_config_.moe_expert_capacity_factor) {
          *progress << " | dropped " << std::setprecision(1)
                    << 100.0 * static_cast<double>(st.moe_dropped_tokens) /
                           static_cast<double>(std::max<int64_t>(st.moe_routed_tokens, 1))
                    << "%";
        }
      }
      *progress << " | lr " << std::scientific << std::setprecision(2) << st.lr
                << std::fixed << " | " << std::setprecision(1) << mean_step * 1e3 << " ms/step | "
                << std::setprecision(0) << st.tokens_per_s << " tok/s | peak "
                << format_bytes(static_cast<double>(st.peak_device_bytes)) << " | act "
                << format_bytes(static_cast<double>(st.activation_bytes));
      if (it < total) {
        // Wall time per step so far (validation and saves included) times the steps left.
        const double per_step = st.elapsed_s / static_cast<double>(it - first + 1);
        *progress << " | ETA " << format_duration(per_step * static_cast<double>(total - it));
      }
      *progress << "\n";
      window_time = 0.0;
      window_steps = 0;
      window_skipped = 0;
    }
    if (progress != nullptr && st.val_loss) {
      *progress << "validation at iter " << it << " | loss " << std::fixed << std::setprecision(4)
                << *st.val_loss << " | ppl " << std::setprecision(2) << std::exp(*st.val_loss)
                << "\n";
    }
    if (progress != nullptr) progress->flush();
    if (on_step) on_step(st);
    if (!config_.save.empty() && config_.save_interval > 0 && it % config_.save_interval == 0) {
      save();
    }
    if (out.exit_signals != nullptr) {
      // Every rank stops after the same step: the ranks agree on whether any received one.
      int signal = out.exit_signals->received();
      if (tensor_parallel_group().size > 1) {
        for (const int64_t r : gather_per_rank(signal, device_)) {
          signal = std::max(signal, static_cast<int>(r));
        }
      }
      if (signal != 0) {
        if (!config_.save.empty() && saved_at != iteration_) save();
        if (progress != nullptr) {
          *progress << "exiting after iteration " << iteration_ << " on signal " << signal
                    << (config_.save.empty() ? " (no --save: nothing saved)" : "") << "\n";
          progress->flush();
        }
        return signal;
      }
    }
  }
  if (!config_.save.empty() && saved_at != iteration_) save();
  return 0;
}

}  // namespace actmem
