// trainer.cpp — Trainer, IterationStats JSON, memory pre-check.
#include "actmem/trainer.h"

#include "actmem/digest.h"
#include "actmem/ledger.h"
#include "actmem/memory_model.h"
#include "actmem/offload.h"
#include "actmem/output_file.h"
#include "actmem/rng.h"
#include "actmem/tensor_parallel.h"
#include "actmem/trace.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/adamw.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
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

void print_offload_summary(std::ostream& os, const std::vector<OffloadSummaryRow>& rows) {
  // Megatron's post-warmup table (one rank): MiB offloaded per group name, and the total.
  int width = 12;
  for (const auto& r : rows) width = std::max(width, static_cast<int>(r.name.size()) + 2);
  const int total_width = 6 + width * static_cast<int>(rows.size() + 1);
  const std::string title = "Activation Offload Summary (MB)";
  os << std::string(total_width, '=') << "\n"
     << std::string(std::max(0, (total_width - static_cast<int>(title.size())) / 2), ' ') << title
     << "\n" << std::string(total_width, '=') << "\n" << std::setw(6) << std::left << "Rank"
     << std::right;
  for (const auto& r : rows) os << std::setw(width) << r.name;
  os << std::setw(width) << "Total" << "\n" << std::string(total_width, '-') << "\n";
  double total = 0;
  os << std::setw(6) << std::left << "0" << std::right << std::fixed << std::setprecision(2);
  for (const auto& r : rows) {
    os << std::setw(width) << r.bytes / 1048576.0;
    total += static_cast<double>(r.bytes);
  }
  os << std::setw(width) << total / 1048576.0 << "\n" << std::string(total_width, '=') << "\n";
}

double median(std::vector<double> v) {
  TORCH_CHECK(!v.empty(), "actmem::median: empty sample");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string format_bytes(double bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  double v = bytes;
  while (std::fabs(v) >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  std::ostringstream os;
  os << std::fixed << std::setprecision(u == 0 ? 0 : (std::fabs(v) < 10 ? 2 : 1)) << v << ' '
     << units[u];
  return os.str();
}

void TrainingConfig::validate(const TransformerConfig& model) const {
  TORCH_CHECK(global_batch_size >= 0, "actmem::TrainingConfig: global_batch_size must be positive, "
              "got ", global_batch_size);
  const int64_t gbs = global_batch_size > 0 ? global_batch_size : model.micro_batch_size;
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
}

nlohmann::json to_json(const IterationStats& s) {
  nlohmann::json j = {
      {"iteration", s.iteration},
      {"loss", s.loss},
      {"grad_norm", s.grad_norm},
      {"grad_digest", s.grad_digest},
      {"lr", s.lr},
      {"step_time_s", s.step_time_s},
      {"tokens_per_s", s.tokens_per_s},
      {"peak_device_bytes", s.peak_device_bytes},
      {"activation_bytes", s.activation_bytes},
      {"activation_peak_bytes", s.activation_peak_bytes},
      {"predicted_activation_bytes", s.predicted_activation_bytes},
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
  if (s.val_loss) j["val_loss"] = *s.val_loss;
  return j;
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
      {"eval_interval", t.eval_interval},
      {"eval_iters", t.eval_iters},
      {"log_interval", t.log_interval},
      {"data", t.data_path.empty() ? nlohmann::json(nullptr) : nlohmann::json(t.data_path)},
      {"split", t.split},
      {"device", t.device},
      {"device_memory_limit", t.device_memory_limit},
      {"offload_bandwidth_gbps", t.offload_bandwidth_gbps},
  };
}

// Note [Memory pre-check]
// The Trainer refuses a configuration whose step cannot fit before it allocates anything, so the
// bound must cover the whole peak of a step, for every strategy:
// - parameters, gradients and both AdamW moments (4 x parameters), plus the optimizer step's
//   temporaries (at most two of the largest parameter);
// - the activations the plain forward leaves for the backward (the exact predictor,
//   memory_model.h, for the config without recompute or offload: every strategy leaves less,
//   and a recomputed chunk is rebuilt from what the plain run would have kept);
// - the backward's transients on top of them: the gradient flowing through the op being
//   differentiated, its result and one temporary, each at most the largest single tensor of
//   the step (the logits [s, b, v], the scores [a/t, s, s, b], the MLP's [s, b, fc1/t]).
// Checked against the tracker's measured peak over a sweep of models and strategies
// (MemoryPreCheck.CountsEverythingTheRunAllocates in tests/test_robustness.cpp).
double estimate_required_bytes(const TransformerConfig& c, int64_t dtype_bytes) {
  const double h = static_cast<double>(c.hidden_size), f = static_cast<double>(c.ffn());
  const double L = static_cast<double>(c.num_layers), v = static_cast<double>(c.vocab_size);
  const double s = static_cast<double>(c.seq_length), b = static_cast<double>(c.micro_batch_size);
  const double a = static_cast<double>(c.num_attention_heads);
  const double fc1 = c.gated_linear_unit ? 2.0 * f : f;
  const double t = static_cast<double>(c.tensor_model_parallel_size);
  const double e = static_cast<double>(dtype_bytes);
  // Per rank: the linear layers are split t ways, norms, embedding and output layer replicated.
  // Replicated per layer: two norms (weight and bias, 4h) and the row-parallel biases (2h); the
  // final norm (2h); the word embedding and an untied output layer (2vh, an upper bound).
  const double params = L * ((4.0 * h * h + h * fc1 + f * h + fc1 + 3.0 * h) / t + 6.0 * h) +
                        2.0 * v * h + static_cast<double>(c.max_positions()) * h + 2.0 * h;
  const double largest_param = std::max(v * h, h * fc1 / t) * e;
  const double largest_tensor = std::max({s * b * v, a * s * s * b / t, s * b * fc1 / t}) * e;
  // Sizes whose exact count would not fit the predictor's 64-bit integers cannot fit a device.
  if (largest_tensor * L * 64.0 > 0x1p62) return std::numeric_limits<double>::infinity();
  TransformerConfig plain = c;
  plain.recompute_granularity.clear();
  plain.recompute_method.clear();
  plain.recompute_num_layers.reset();
  plain.recompute_modules.reset();
  plain.distribute_saved_activations = false;
  plain.cpu_offloading_num_layers = 0;
  plain.fine_grained_activation_offloading = false;
  plain.offload_modules.clear();
  const double activations =
      static_cast<double>(predict_activation_bytes(plain, dtype_bytes).total);
  return 4.0 * params * e + 2.0 * largest_param + activations + 3.0 * largest_tensor;
}

Trainer::Trainer(const TransformerConfig& model, const TrainingConfig& training)
    : model_config_(model),
      config_(training),
      device_(validated_device(model, training)),
      memory_(device_memory(device_)) {
  // The corpus lives in host memory, outside the tracked allocator (Note [Corpus in bounded
  // memory] in data.h); loading it first lets the pre-check count it.
  corpus_ = load_corpus(config_.data_path, config_.split, model_config_.seq_length);
  if (device_.is_cpu()) {
    // On CPU the device is this machine's memory: tensor-parallel ranks of one launch share it,
    // and the corpus held in it (unless memory-mapped) is not available to them.
    const bool explicit_limit = config_.device_memory_limit > 0;
    const int64_t limit =
        explicit_limit ? config_.device_memory_limit
                       : (physical_memory_bytes() - corpus_.resident_bytes()) /
                             tensor_parallel_group().size;
    const double need = estimate_required_bytes(model_config_);
    TORCH_CHECK(need <= static_cast<double>(limit), "actmem::Trainer: this configuration needs "
                "about ", format_bytes(need), " of device memory (parameters, gradients, AdamW "
                "state and one micro-batch of activations at their peak) but the limit is ",
                format_bytes(static_cast<double>(limit)),
                explicit_limit ? std::string() : " (physical memory less the corpus's " +
                    format_bytes(static_cast<double>(corpus_.resident_bytes())) + ")",
                "; reduce --num-layers, --hidden-size, --seq-length or --micro-batch-size");
    memory_.set_capacity(limit);
  }
  TORCH_CHECK(model_config_.vocab_size >= ByteTokenizer::kVocabSize, "actmem::Trainer: vocab_size (",
              model_config_.vocab_size, ") must be at least 256 for the byte-level tokenizer");

  generators_.push_back(at::detail::getDefaultCPUGenerator());
  if (!device_.is_cpu()) generators_.push_back(at::globalContext().defaultGenerator(device_));
  for (auto& gen : generators_) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    const at::Tensor ambient = gen.get_state();
    gen.set_current_seed(model_config_.seed);  // as Megatron's _set_random_seed
    rng_state_.push_back(gen.get_state());
    gen.set_state(ambient);
  }
  // The named streams of Megatron's model_parallel_cuda_manual_seed
  // (megatron/core/tensor_parallel/random.py: model-parallel-rng = seed + 2718 + tp_rank, ...),
  // kept by this trainer and swapped in per step; no global random state is touched.
  tracker_ = make_model_parallel_tracker(model_config_.seed, tensor_parallel_group().rank, 0, 0,
                                         device_);
  model_ = std::make_shared<GPTModel>(model_config_);
  model_->to_device(device_);
  model_->train();
  params_ = model_->ordered_parameters();
  tensor_parallel_flags_ = model_->tensor_parallel_flags();
  sequence_parallel_params_ = model_->sequence_parallel_parameters();
  {
    // Gradients live for the whole run: allocated once here, zeroed in place each step.
    at::NoGradGuard no_grad;
    for (auto& p : params_) p.mutable_grad() = at::zeros_like(p);
  }
  optimizer_ = std::make_unique<torch::optim::AdamW>(
      params_, torch::optim::AdamWOptions(config_.lr)
                   .betas({config_.adam_beta1, config_.adam_beta2})
                   .eps(config_.adam_eps)
                   .weight_decay(config_.weight_decay));
  train_sampler_ = std::make_unique<BatchSampler>(corpus_.train, model_config_.seq_length,
                                                  model_config_.micro_batch_size,
                                                  model_config_.seed);
  valid_sampler_ = std::make_unique<BatchSampler>(corpus_.valid, model_config_.seq_length,
                                                  model_config_.micro_batch_size,
                                                  model_config_.seed + 1);
  timeline_ = std::make_unique<MemoryTimeline>(memory_);
  if (model_config_.cpu_offloading() || model_config_.fine_grained_activation_offloading) {
    // On CUDA the copy engine uses CUDA streams and pinned host buffers (offload.cpp).
    offloader_ = std::make_unique<ActivationOffloader>(
        model_config_.min_offloaded_tensor_size, config_.offload_bandwidth_gbps * 1e9,
        static_cast<int>(model_config_.fine_grained_offloading_max_inflight_offloads), device_);
    for (const auto& p : params_) offloader_->exclude(p);
    for (const auto& b : model_->buffers()) offloader_->exclude(b);
    offloader_->exclude(model_->attention_mask());
    model_->set_activation_offloader(offloader_.get());
  }
  predicted_activation_bytes_ = predict_activation_bytes(model_config_, 4, device_.is_cpu()).total;
}

Trainer::~Trainer() = default;

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

IterationStats Trainer::train_step(bool compute_digest) {
  SwapRngState rng(generators_, rng_state_);
  SwapTracker tracker(tracker_);
  std::unique_ptr<TraceScope> trace_scope;
  const bool record = record_timeline_ || trace_ != nullptr;
  if (trace_ != nullptr) trace_scope = std::make_unique<TraceScope>(*trace_);
  IterationStats st;
  st.iteration = ++iteration_;
  st.predicted_activation_bytes = predicted_activation_bytes_;
  st.lr = lr_at(iteration_);
  for (auto& group : optimizer_->param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(st.lr);
  }
  const int64_t n_micro = config_.num_microbatches(model_config_.micro_batch_size);
  for (auto& p : params_) p.mutable_grad().zero_();
  if (offloader_) offloader_->begin_step();

  synchronize_device(device_);
  double busy_s = 0.0;
  int64_t step_peak = memory_.current_bytes();
  double loss_sum = 0.0;
  for (int64_t m = 0; m < n_micro; ++m) {
    auto batch = train_sampler_->next();
    const at::Tensor tokens = batch.first.to(device_), labels = batch.second.to(device_);
    synchronize_device(device_);
    std::unique_ptr<TimelineScope> scope;
    if (record && m == 0) {
      timeline_->clear();
      scope = std::make_unique<TimelineScope>(*timeline_);
    }
    std::unique_ptr<LedgerScope> ledger_scope;
    if (ledger_ != nullptr && m == 0) {
      ledger_->clear();
      ledger_->exclude(params_);
      for (const auto& buffer : model_->buffers()) ledger_->exclude(buffer);
      ledger_->exclude(model_->attention_mask());
      ledger_->exclude(tokens);
      ledger_->exclude(labels);
      ledger_scope = std::make_unique<LedgerScope>(*ledger_);
    }
    memory_.reset_peak();
    const int64_t before = memory_.current_bytes();
    const auto t0 = Clock::now();
    at::Tensor loss = model_->forward(tokens, labels);
    ledger_scope.reset();
    if (n_micro > 1) loss = loss / static_cast<double>(n_micro);
    synchronize_device(device_);
    const int64_t after_forward = memory_.current_bytes();
    loss.backward();
    synchronize_device(device_);
    busy_s += seconds_since(t0);
    timeline_mark("bwd end");
    const int64_t peak = memory_.peak_bytes();
    st.activation_bytes = std::max(st.activation_bytes, after_forward - before);
    st.activation_peak_bytes = std::max(st.activation_peak_bytes, peak - before);
    step_peak = std::max(step_peak, peak);
    loss_sum += loss.item<double>();
  }
  st.loss = loss_sum;  // the losses were scaled by 1/n_micro, so their sum is the mean

  const int tp = tensor_parallel_group().size;
  if (!sequence_parallel_params_.empty()) {
    // Sequence parallelism: norms and row-parallel biases saw this rank's tokens only; their
    // gradients are summed over the ranks (one flat all-reduce), then equal everywhere.
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> flat;
    for (const auto& p : sequence_parallel_params_) flat.push_back(p.grad().reshape({-1}));
    const at::Tensor summed = all_reduce_sum(at::cat(flat));
    int64_t offset = 0;
    for (const auto& p : sequence_parallel_params_) {
      const int64_t n = p.numel();
      p.grad().copy_(summed.narrow(0, offset, n).view_as(p.grad()));
      offset += n;
    }
  }

  if (compute_digest) st.grad_digest = grad_digest(params_);
  if (tp > 1) {
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

  const auto t1 = Clock::now();
  {
    at::NoGradGuard no_grad;
    if (tp == 1) {
      std::vector<at::Tensor> norms;
      norms.reserve(params_.size());
      for (const auto& p : params_) norms.push_back(p.grad().norm());
      st.grad_norm = at::stack(norms).norm().item<double>();
    } else {
      // Megatron's clip_grad_norm: split parameters count on every rank, replicated ones once.
      const bool first = tensor_parallel_group().rank == 0;
      at::Tensor sq = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(device_));
      for (size_t i = 0; i < params_.size(); ++i) {
        if (tensor_parallel_flags_[i] || first) {
          sq += params_[i].grad().to(at::kDouble).pow(2).sum();
        }
      }
      st.grad_norm = std::sqrt(all_reduce_sum(sq).item<double>());
    }
    // Megatron fails on a NaN gradient norm (check_for_nan_in_loss_and_grad); stopping before
    // the optimizer step leaves the parameters as they were.
    TORCH_CHECK(std::isfinite(st.loss) && std::isfinite(st.grad_norm), "actmem::Trainer: "
                "training diverged at iteration ", st.iteration, ": loss ", st.loss,
                ", gradient norm ", st.grad_norm, "; stopped before the optimizer step (try a "
                "lower --lr, a longer --lr-warmup-iters or --clip-grad)");
    if (config_.clip_grad > 0.0) {
      const double coeff = config_.clip_grad / (st.grad_norm + 1e-6);
      if (coeff < 1.0) {
        for (auto& p : params_) p.mutable_grad().mul_(coeff);
      }
    }
  }
  optimizer_->step();
  synchronize_device(device_);
  busy_s += seconds_since(t1);
  step_peak = std::max(step_peak, memory_.peak_bytes());

  st.step_time_s = busy_s;
  st.tokens_per_s = static_cast<double>(n_micro * model_config_.micro_batch_size *
                                        model_config_.seq_length) / busy_s;
  st.peak_device_bytes = step_peak;
  if (tp > 1) st.peak_device_bytes_per_rank = gather_per_rank(step_peak, device_);
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
    offloader_->end_step();  // the first step is the warmup (Note [Offload margin])
    const OffloadStats os = offloader_->stats();
    st.offloaded_bytes = os.offloaded_bytes;
    st.offload_wait_s = os.wait_s;
    st.offload_copy_s = os.d2h_busy_s + os.h2d_busy_s;
    st.host_peak_bytes = offloader_->pool().peak_bytes_in_use();
  }
  return st;
}

double Trainer::evaluate() {
  at::NoGradGuard no_grad;
  model_->eval();
  double total = 0.0;
  for (int64_t i = 0; i < config_.eval_iters; ++i) {
    auto batch = valid_sampler_->fixed(i, config_.eval_iters);
    total += model_->forward(batch.first.to(device_), batch.second.to(device_)).item<double>();
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
}  // namespace

void Trainer::run(const RunOutput& out,
                  const std::function<void(const IterationStats&)>& on_step,
                  bool compute_digest) {
  TraceRecorder recorder;
  const int64_t traced = std::min<int64_t>(2, config_.train_iters);
  const int64_t total = config_.train_iters;
  const int width = static_cast<int>(std::to_string(total).size());
  std::ostream* progress = out.progress;
  double window_time = 0.0;
  int64_t window_steps = 0;
  for (int64_t it = 1; it <= total; ++it) {
    const bool trace_now = out.trace != nullptr && it == traced;
    if (trace_now) set_trace(&recorder);
    IterationStats st = train_step(compute_digest);
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
    if (it == 1 && offloader_) {
      if (progress != nullptr && !offloader_->summary().empty()) {
        print_offload_summary(*progress, offloader_->summary());
      }
      if (out.warnings != nullptr && st.offloaded_bytes == 0) {
        *out.warnings << zero_offload_warning(*offloader_) << std::endl;
      }
    }
    window_time += st.step_time_s;
    ++window_steps;
    const bool eval_now = config_.eval_interval > 0 &&
                          (it % config_.eval_interval == 0 || it == total);
    if (eval_now) st.val_loss = evaluate();
    if (progress != nullptr && (it % config_.log_interval == 0 || it == 1 || it == total)) {
      const double mean_step = window_time / static_cast<double>(window_steps);
      *progress << "iter " << std::setw(width) << it << "/" << total << " | loss " << std::fixed
                << std::setprecision(4) << st.loss << " | grad norm " << std::setprecision(3)
                << st.grad_norm << " | lr " << std::scientific << std::setprecision(2) << st.lr
                << std::fixed << " | " << std::setprecision(1) << mean_step * 1e3 << " ms/step | "
                << std::setprecision(0) << st.tokens_per_s << " tok/s | peak "
                << format_bytes(static_cast<double>(st.peak_device_bytes)) << " | act "
                << format_bytes(static_cast<double>(st.activation_bytes)) << "\n";
      window_time = 0.0;
      window_steps = 0;
    }
    if (progress != nullptr && st.val_loss) {
      *progress << "validation at iter " << it << " | loss " << std::fixed << std::setprecision(4)
                << *st.val_loss << " | ppl " << std::setprecision(2) << std::exp(*st.val_loss)
                << "\n";
    }
    if (progress != nullptr) progress->flush();
    if (on_step) on_step(st);
  }
}

}  // namespace actmem
