// trainer.cpp — the Trainer: its assembly, the training step, and what a step measures around the
// forward-backward schedules (schedules.h).
#include "actmem/train/trainer.h"

#include "actmem/train/iteration_stats.h"
#include "actmem/train/run_loop.h"

#include "actmem/base/digest.h"
#include "actmem/base/output_file.h"
#include "actmem/base/trace.h"
#include "actmem/memory/ledger.h"
#include "actmem/memory/memory_model.h"
#include "actmem/model/activation_bytes.h"
#include "actmem/offload/activation_offloader.h"
#include "actmem/parallel/distributed_optimizer.h"
#include "actmem/parallel/grad_reducer.h"
#include "actmem/parallel/pipeline.h"
#include "actmem/parallel/tensor_parallel.h"
#include "actmem/recompute/rng.h"
#include "actmem/train/mixed_precision.h"
#include "actmem/train/schedules.h"
#include "actmem/train/training_setup.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
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

// Validates the training config (the model's was by its plan) before anything is built; returns
// the training device.
at::Device validated_device(const TransformerConfig& model, const TrainingConfig& training) {
  training.validate(model);
  const at::Device device(training.device);
  TORCH_CHECK(device.is_cpu() || !model.flash_attention(),
              "actmem::Trainer: the flash attention "
              "kernel is wired on CPU only (CUDA's SDPA kernels are not yet: no GPU to check "
              "them on); on ",
              device, " use --attention-backend unfused (", model.attention_choice().why, ")");
  return device;
}

// The training config with train_iters derived from --train-samples (the global batch counts
// every data-parallel rank's micro-batches).
TrainingConfig resolved(const TransformerConfig& model, TrainingConfig training) {
  training.resolve_train_iters(training.batch_schedule(model, data_parallel_group().size));
  return training;
}
}  // namespace

Trainer::Trainer(const TransformerConfig& model, const TrainingConfig& training)
    : model_config_(model),
      config_(resolved(model, training)),
      batches_(config_.batch_schedule(model, data_parallel_group().size)),
      plan_(make_activation_plan(model)),  // validates the model
      device_(validated_device(model, config_)),
      memory_(device_memory(device_)),
      scheduler_(config_, batches_) {
  // A schedule's sizes are checked from the samples a run starts at (check_batch_sizes), as
  // Megatron checks only the size in effect: a resumed run may have passed sizes this layout
  // cannot run.
  if (!batches_.stepped()) check_batch_layout(model_config_, config_);
  // The corpus lives in host memory, outside the tracked allocator (Note [Corpus in bounded
  // memory] in data.h); loading it first lets the pre-check count it.
  TrainingData data = load_training_data(model_config_, config_);
  corpus_ = std::move(data.corpus);
  train_sampler_ = std::move(data.train);
  valid_sampler_ = std::move(data.valid);
  if (device_.is_cpu()) {
    memory_.set_capacity(checked_device_memory_limit(model_config_, config_, corpus_));
  }
  if (model_config_.fp16 || model_config_.bf16) {
    const auto missing = missing_kernel(params_dtype(model_config_), device_);
    TORCH_CHECK(
        !missing, "actmem::Trainer: --", model_config_.precision(), " needs ",
        params_dtype(model_config_), " kernels on ", device_, ", which this libtorch (",
        TORCH_VERSION, ") does not have: ", *missing,
        model_config_.fp16 && device_.is_cpu() ? "; use --bf16 on CPU (or --fp16 on CUDA)" : "");
  }
  seed_random_streams();
  model_ = std::make_shared<GPTModel>(model_config_, plan_);
  model_->to_device(device_);
  model_->train();
  groups_ = std::make_unique<ParameterGroups>(*model_);
  std::unique_ptr<OptimizerShards> shards;
  if (config_.use_distributed_optimizer) {
    // Note [Distributed optimizer] in distributed_optimizer.h: the buffer layout of Megatron's
    // DistributedOptimizer, its buckets those of the gradient reduction (one per group without
    // --overlap-grad-reduce, as Megatron's bucket_size None).
    std::vector<OptimizerShards::Group> buckets;
    for (const auto& g : groups_->data_parallel_groups()) buckets.push_back({g.group, g.params});
    shards = std::make_unique<OptimizerShards>(groups_->params(), std::move(buckets),
                                               ddp_bucket_size(), groups_->tied_embedding());
  }
  // --decoupled-lr: the word embedding and the output layer (Megatron's
  // is_embedding_or_output_parameter, set in LanguageModule) in a group of their own.
  std::vector<bool> decoupled;
  if (config_.decoupled_lr) {
    for (const at::Tensor& p : groups_->params()) {
      decoupled.push_back(
          (model_->word_embeddings.defined() && p.is_same(model_->word_embeddings)) ||
          (model_->output_weight.defined() && p.is_same(model_->output_weight)));
    }
  }
  optimizer_ = std::make_unique<Optimizer>(groups_->params(), model_config_, config_,
                                           std::move(shards), decoupled);
  if (config_.overlap_grad_reduce && data_parallel_group().size > 1) {
    // After the main-grad hooks (the optimizer's), so each parameter's hook sees its accumulated
    // gradient (Note [Overlapped gradient reduction] in grad_reducer.h). The routed experts
    // reduce over the expert-data-parallel group when expert parallelism splits them.
    std::vector<GradReducer::Group> buckets;
    for (const auto& g : groups_->data_parallel_groups()) {
      GradReducer::Group b{g.group, {}, {}};
      for (const size_t i : g.params) {
        b.params.push_back(groups_->params()[i]);
        b.grads.push_back(optimizer_->gradients()[i]);
      }
      buckets.push_back(std::move(b));
    }
    grad_reducer_ = std::make_unique<GradReducer>(
        std::move(buckets), *ddp_bucket_size(),
        data_parallel_gradient_scale(config_.calculate_per_token_loss));
  }
  timeline_ = std::make_unique<MemoryTimeline>(memory_);
  stats_ = std::make_unique<StepStatistics>(model_config_, device_);
  const ActivationPlan& plan = model_->plan();
  if (plan.offloads()) {
    // On CUDA the copy engine uses CUDA streams and pinned host buffers (copy_engine.h).
    offloader_ = std::make_unique<ActivationOffloader>(
        plan.min_offloaded_tensor_size, config_.offload_bandwidth_gbps * 1e9,
        static_cast<int>(plan.max_inflight_offloads), device_);
    for (const auto& p : groups_->params()) offloader_->exclude(p);
    for (const auto& b : model_->buffers()) offloader_->exclude(b);
    offloader_->exclude(model_->attention_mask());
    model_->set_activation_offloader(offloader_.get());
  }
  prediction_ = std::make_unique<ActivationPrediction>(
      model_config_, *model_, device_.is_cpu(),
      config_.num_microbatches_with_partial_activation_checkpoints.has_value());
}

void Trainer::seed_random_streams() {
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
  tracker_ =
      make_model_parallel_tracker(seed, tensor_parallel_group().rank, expert_parallel_group().rank,
                                  tensor_parallel_group().rank, device_);
}

Trainer::~Trainer() = default;

std::optional<int64_t> Trainer::ddp_bucket_size() const {
  // Megatron: --ddp-bucket-size, by default max(40M, 1M x d); None (one bucket) without
  // --overlap-grad-reduce.
  if (!config_.overlap_grad_reduce) return std::nullopt;
  return config_.ddp_bucket_size.value_or(
      std::max<int64_t>(40000000, 1000000 * data_parallel_group().size));
}

TrainState Trainer::train_state() {
  return {model_config_, config_,         device_,    *model_,    *optimizer_,
          scheduler_,    *train_sampler_, iteration_, rng_state_, tracker_};
}

std::string Trainer::save_checkpoint(const std::string& dir) {
  return actmem::save_checkpoint(dir, train_state());
}

std::optional<int64_t> Trainer::load_checkpoint(const std::string& dir,
                                                const CheckpointLoadOptions& options) {
  return actmem::load_checkpoint(dir, train_state(), options);
}

int64_t Trainer::consumed_train_samples() const {
  return train_sampler_->batches_drawn() * model_config_.micro_batch_size;
}

int64_t Trainer::next_global_batch() const {
  return batches_.at(consumed_train_samples());
}

void Trainer::check_batch_sizes(int64_t steps) const {
  const int64_t consumed = consumed_train_samples();
  for (const int64_t gbs : batches_.sizes_used(steps, consumed)) {
    try {
      check_batch_layout(model_config_, gbs, data_parallel_group().size);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "actmem::Trainer: --step-batch-size-schedule reaches a global batch of ",
                  gbs, " within the ", steps, " steps from sample ", consumed,
                  ", which this layout cannot run: ", e.what_without_backtrace(),
                  " (Megatron's update_num_microbatches checks the size in effect, when training "
                  "reaches it)");
    }
  }
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
  // The step's global batch, decided by the samples consumed before it (Megatron's
  // update_num_microbatches before train_step).
  st.global_batch_size = next_global_batch();
  if (batches_.stepped()) check_batch_sizes(1);
  step_microbatches_ =
      st.global_batch_size / (model_config_.micro_batch_size * data_parallel_group().size);
  st.iteration = ++iteration_;
  st.predicted_activation_bytes = prediction_->micro_batch_bytes();
  // The schedule advances with the optimizer steps taken: a skipped step (loss-scale overflow)
  // leaves it where it was, as Megatron's opt_param_scheduler.step only on a successful update.
  st.lr = scheduler_.next_lr();
  st.decoupled_lr = scheduler_.next_decoupled_lr();
  optimizer_->begin_step(st.lr, st.decoupled_lr);
  st.loss_scale = optimizer_->loss_scale();
  if (offloader_) offloader_->begin_step();

  StepClock clock{0.0, memory_.current_bytes()};
  forward_backward(st, clock);
  // What follows the backward is measured on its own (IterationStats::optimizer_peak_bytes).
  clock.peak = std::max(clock.peak, memory_.peak_bytes());
  memory_.reset_peak();
  std::optional<double> step_tokens;  // Note [Per-token loss]
  if (config_.calculate_per_token_loss) {
    step_tokens = static_cast<double>(st.global_batch_size * model_config_.seq_length);
  }
  finalize_model_grads(*groups_, optimizer_->gradients(), grad_reducer_.get(), step_tokens);
  const auto t1 = Clock::now();
  st.skipped = found_inf();
  clock.busy_s += seconds_since(t1);
  if (compute_digest) st.grad_digest = digest_of(optimizer_->gradients());
  stats_->gather_rank_stats(st, compute_digest);
  const auto t2 = Clock::now();
  if (st.skipped) {
    st.grad_norm = std::numeric_limits<double>::quiet_NaN();
  } else {
    st.grad_norm = clip_gradients(st);
    optimizer_->step();
    scheduler_.step(st.global_batch_size);
  }
  synchronize_device(device_);
  clock.busy_s += seconds_since(t2);
  st.optimizer_peak_bytes = memory_.peak_bytes();
  clock.peak = std::max(clock.peak, st.optimizer_peak_bytes);
  finish_stats(st, clock);
  st.consumed_samples = consumed_train_samples();
  return st;
}

bool Trainer::found_inf() {
  // Unscale and check for inf/NaN on every tensor-parallel rank (Megatron all-reduces found_inf
  // with MAX over the model-parallel group); the scaler updates either way. With expert
  // parallelism the experts' gradients differ between expert-parallel ranks: they agree over
  // that group too, so all skip or none.
  return optimizer_->unscale_and_check([this](bool local) {
    if (tensor_parallel_group().size == 1 && expert_parallel_group().size == 1 &&
        pipeline_parallel_group().size == 1) {
      return local;
    }
    const at::Tensor flag =
        at::full({1}, local ? 1.0f : 0.0f, at::TensorOptions().dtype(at::kFloat).device(device_));
    return group_all_reduce_sum(pipeline_parallel_group(),
                                group_all_reduce_sum(expert_parallel_group(), all_reduce_sum(flag)))
               .item<float>() > 0.0f;
  });
}

double Trainer::clip_gradients(const IterationStats& st) {
  at::NoGradGuard no_grad;
  // Megatron's clip_grad_norm_fp32 over get_grad_norm_fp32: one function for every layout.
  const double grad_norm = global_grad_norm(optimizer_->gradients(), groups_->grad_norm_roles());
  // Megatron fails on a NaN gradient norm (check_for_nan_in_loss_and_grad); stopping before
  // the optimizer step leaves the parameters as they were.
  TORCH_CHECK(std::isfinite(st.loss) && std::isfinite(grad_norm),
              "actmem::Trainer: "
              "training diverged at iteration ",
              st.iteration, ": loss ", st.loss, ", gradient norm ", grad_norm,
              "; stopped before the optimizer step (try a "
              "lower --lr, a longer --lr-warmup-iters or --clip-grad)");
  actmem::clip_gradients(optimizer_->gradients(), config_.clip_grad, grad_norm);
  return grad_norm;
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
  const int64_t s =
      model_config_.sequence_parallel ? model_config_.seq_length / t : model_config_.seq_length;
  return PipelineP2P(pipeline_parallel_group(),
                     {s, model_config_.micro_batch_size, model_config_.hidden_size},
                     at::TensorOptions().dtype(model_->dtype()).device(device_),
                     /*ring=*/model_config_.virtual_pipeline_size() > 1);
}

std::unique_ptr<LedgerScope> Trainer::open_ledger(const at::Tensor& tokens,
                                                  const at::Tensor& labels) {
  if (ledger_ == nullptr) return nullptr;
  ledger_->clear();
  ledger_->exclude(groups_->params());
  for (const auto& buffer : model_->buffers()) ledger_->exclude(buffer);
  ledger_->exclude(model_->attention_mask());
  ledger_->exclude(tokens);
  ledger_->exclude(labels);
  return std::make_unique<LedgerScope>(*ledger_);
}

// Note [What a step observes]
// Around each computation of a schedule (schedules.h) a step does three jobs, each an observer:
// the offloader's forwards and reload prefetches (OffloadDriver, Note [Offload under pipeline
// schedules] in activation_offloader.h), what the step measures (StepMeasurement), and what it
// predicts (StepPrediction). StepObservers runs them in that order at every point, so the
// prefetch's device buffers are in the baseline a forward's bytes count from, as the reload's
// are in the measured bytes. Without a pipeline: per micro-batch, its activation bytes (held at
// the end of its forward) and peak, its time, the first one's timeline and ledger record, and
// with routing-dependent MoE layers its predicted bytes. Under a pipeline schedule: per forward,
// the bytes it added and the bytes the stage holds, each micro-batch's predicted bytes, and the
// stage's events for the schedule plot.

namespace {
// The wall clock: one clock for every process of a node, and across nodes as aligned as their
// clocks are (the steady clock's epoch differs between machines).
double shared_clock_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}
}  // namespace

class Trainer::OffloadDriver : public ScheduleObserver {
 public:
  explicit OffloadDriver(Trainer& t)
      : t_(t),
        pipelined_(pipeline_parallel_group().size > 1),
        offload_forwards_(static_cast<size_t>(t.model_->num_model_chunks())) {}

  void before_forward(const Computation& c, const at::Tensor&, const at::Tensor&, bool) override {
    if (!t_.offloader_) return;
    if (!pipelined_) {
      t_.offloader_->begin_forward();  // each micro-batch: a forward of its own
      return;
    }
    prefetch_for(c);
    const bool own_backward_next = c.next != nullptr &&
                                   c.next->kind == PipelineStep::Kind::kBackward &&
                                   c.next->microbatch == c.microbatch && c.next->chunk == c.chunk;
    offload_forwards_[static_cast<size_t>(c.chunk)].emplace_back(
        c.microbatch, t_.offloader_->begin_forward(c.chunk, own_backward_next));
  }

  void before_backward(const Computation& c) override {
    if (!pipelined_ || !t_.offloader_) return;
    offload_forwards_[static_cast<size_t>(c.chunk)].pop_front();
    prefetch_for(c);
  }

 private:
  // Before a computation followed by another micro-batch's backward: start that backward's
  // first reloads, so they overlap this computation.
  void prefetch_for(const Computation& c) {
    const PipelineStep* next = c.next;
    if (next == nullptr || next->kind != PipelineStep::Kind::kBackward ||
        (next->microbatch == c.microbatch && next->chunk == c.chunk)) {
      return;
    }
    const auto& queue = offload_forwards_[static_cast<size_t>(next->chunk)];
    TORCH_INTERNAL_ASSERT(!queue.empty() && queue.front().first == next->microbatch,
                          "the next backward's forward is not the oldest in flight");
    t_.offloader_->prefetch_backward_start(queue.front().second);
  }

  Trainer& t_;
  const bool pipelined_;
  // Per model chunk, (micro-batch, the offloader's number for its forward) of the forwards in
  // flight.
  std::vector<std::deque<std::pair<int64_t, int>>> offload_forwards_;
};

class Trainer::StepMeasurement : public ScheduleObserver {
 public:
  StepMeasurement(Trainer& t, IterationStats& st, StepClock& clock, int64_t boundary_bytes,
                  int64_t step_base)
      : t_(t),
        st_(st),
        clock_(clock),
        pipelined_(pipeline_parallel_group().size > 1),
        boundary_bytes_(boundary_bytes),
        step_base_(step_base) {}

  void before_forward(const Computation& c, const at::Tensor& tokens, const at::Tensor& labels,
                      bool received) override {
    if (!pipelined_) {
      synchronize_device(t_.device_);
      if ((t_.record_timeline_ || t_.trace_ != nullptr) && c.microbatch == 0) {
        t_.timeline_->clear();
        timeline_ = std::make_unique<TimelineScope>(*t_.timeline_);
      }
      ledger_ = c.microbatch == 0 ? t_.open_ledger(tokens, labels) : nullptr;
      t_.memory_.reset_peak();
      before_ = t_.memory_.current_bytes();
      t0_ = Clock::now();
      return;
    }
    start_ = shared_clock_s();
    // A micro-batch's bytes count from its input's receipt.
    before_ = t_.memory_.current_bytes() - (received ? boundary_bytes_ : 0);
    ledger_ = c.microbatch == 0 && c.chunk == 0 ? t_.open_ledger(tokens, labels) : nullptr;
  }

  void after_forward(const Computation& c, bool) override {
    ledger_.reset();
    synchronize_device(t_.device_);
    const int64_t after = t_.memory_.current_bytes();
    if (!pipelined_) {
      after_forward_ = after;
      return;
    }
    st_.activation_bytes = std::max(st_.activation_bytes, after - before_);
    st_.inflight_activation_bytes = std::max(st_.inflight_activation_bytes, after - step_base_);
    t_.schedule_.push_back({true, c.microbatch, start_, shared_clock_s(), c.chunk});
  }

  void before_backward(const Computation&) override {
    if (pipelined_) start_ = shared_clock_s();
  }

  void after_backward(const Computation& c) override {
    synchronize_device(t_.device_);
    if (pipelined_) {
      t_.schedule_.push_back({false, c.microbatch, start_, shared_clock_s(), c.chunk});
      return;
    }
    clock_.busy_s += seconds_since(t0_);
    timeline_mark("bwd end");
    const int64_t peak = t_.memory_.peak_bytes();
    st_.activation_bytes = std::max(st_.activation_bytes, after_forward_ - before_);
    st_.activation_peak_bytes = std::max(st_.activation_peak_bytes, peak - before_);
    clock_.peak = std::max(clock_.peak, peak);
    timeline_.reset();
  }

 private:
  Trainer& t_;
  IterationStats& st_;
  StepClock& clock_;
  const bool pipelined_;
  const int64_t boundary_bytes_, step_base_;
  int64_t before_ = 0, after_forward_ = 0;
  Clock::time_point t0_;
  double start_ = 0.0;
  std::unique_ptr<TimelineScope> timeline_;
  std::unique_ptr<LedgerScope> ledger_;
};

class Trainer::StepPrediction : public ScheduleObserver {
 public:
  StepPrediction(Trainer& t, IterationStats& st, int64_t boundary_bytes)
      : t_(t),
        st_(st),
        pipelined_(pipeline_parallel_group().size > 1),
        boundary_bytes_(boundary_bytes),
        predicted_(
            static_cast<size_t>(t.model_->num_model_chunks()),
            std::vector<int64_t>(static_cast<size_t>(std::max<int64_t>(t.step_microbatches_, 1)))) {
  }

  void after_forward(const Computation& c, bool every_layer) override {
    if (!pipelined_) return;
    predicted_[static_cast<size_t>(c.chunk)][static_cast<size_t>(c.microbatch)] =
        t_.prediction_->chunk(*t_.model_, c.chunk, boundary_bytes_, every_layer);
  }

  void after_backward(const Computation& c) override {
    if (pipelined_ || !t_.prediction_->routing_dependent) return;
    // Exact given each micro-batch's routing (moe_rows.h): the largest over the step's
    // micro-batches, as activation_bytes is.
    const MoERouting routing = t_.model_->moe_stats().last_routing();
    st_.predicted_activation_bytes = std::max(
        c.microbatch == 0 ? int64_t{0} : st_.predicted_activation_bytes,
        predict_activation_bytes(t_.model_config_, t_.model_->plan(),
                                 t_.model_config_.element_bytes(), t_.device_.is_cpu(), &routing)
            .total);
  }

  /// Per model chunk and micro-batch, the bytes predicted to stay from its forward to its
  /// backward (pipeline schedules).
  int64_t predicted(int64_t chunk, int64_t m) const {
    return predicted_[static_cast<size_t>(chunk)][static_cast<size_t>(m)];
  }

 private:
  Trainer& t_;
  IterationStats& st_;
  const bool pipelined_;
  const int64_t boundary_bytes_;
  std::vector<std::vector<int64_t>> predicted_;
};

// The three jobs at every point, in Note [What a step observes]'s order.
class Trainer::StepObservers : public ScheduleObserver {
 public:
  StepObservers(Trainer& t, IterationStats& st, StepClock& clock, int64_t boundary_bytes,
                int64_t step_base)
      : offload(t),
        measurement(t, st, clock, boundary_bytes, step_base),
        prediction(t, st, boundary_bytes) {}
  void before_forward(const Computation& c, const at::Tensor& tokens, const at::Tensor& labels,
                      bool received) override {
    for (ScheduleObserver* o : all()) o->before_forward(c, tokens, labels, received);
  }
  void after_forward(const Computation& c, bool every_layer) override {
    for (ScheduleObserver* o : all()) o->after_forward(c, every_layer);
  }
  void before_backward(const Computation& c) override {
    for (ScheduleObserver* o : all()) o->before_backward(c);
  }
  void after_backward(const Computation& c) override {
    for (ScheduleObserver* o : all()) o->after_backward(c);
  }
  OffloadDriver offload;
  StepMeasurement measurement;
  StepPrediction prediction;

 private:
  std::array<ScheduleObserver*, 3> all() { return {&offload, &measurement, &prediction}; }
};

void Trainer::forward_backward(IterationStats& st, StepClock& clock) {
  const int64_t n_micro = step_microbatches_;
  synchronize_device(device_);
  // Megatron's MoEAuxLossAutoScaler.set_loss_scale(loss_scale / num_microbatches): the auxiliary
  // losses are weighted in backward as the main loss is.
  model_->moe_stats().reset();
  // Note [Per-token loss]
  // Megatron's --calculate-per-token-loss: each micro-batch's loss is the sum over its loss
  // tokens, backward from it undivided; the data-parallel reduction sums (no 1/d) and
  // finalize_model_grads divides every gradient by the step's loss tokens over all micro-batches
  // and data-parallel ranks (megatron/core/distributed/finalize_model_grads.py). The auxiliary
  // MoE losses keep their weight: MoEAuxLossAutoScaler's scale without the 1/num_microbatches,
  // and the router's multiplication by the micro-batch's tokens (router.py), which the final
  // division takes back. actmem's batches have no loss mask (no padding, no --eod-mask-loss), so
  // every micro-batch holds B s loss tokens and the count is known on every rank and stage
  // without Megatron's broadcast from the last stage.
  const bool per_token = config_.calculate_per_token_loss;
  const double tokens_per_microbatch =
      static_cast<double>(model_config_.micro_batch_size * model_config_.seq_length);
  model_->set_moe_aux_loss_scale(per_token
                                     ? optimizer_->loss_scale() * tokens_per_microbatch
                                     : optimizer_->loss_scale() / static_cast<double>(n_micro));
  model_->set_loss_sum(per_token);
  ScheduleSpec spec;
  spec.model = model_.get();
  spec.num_microbatches = n_micro;
  spec.backward_from_loss = [this](const at::Tensor& loss) { backward_from_loss(loss); };
  spec.grad_reducer = grad_reducer_.get();
  spec.partial_checkpoints = config_.num_microbatches_with_partial_activation_checkpoints;
  spec.microbatch_group_size = model_config_.microbatch_group_size();
  spec.per_token_loss = per_token;
  double loss_sum = 0.0;
  if (pipeline_parallel_group().size > 1) {
    loss_sum = forward_backward_pipelined(st, clock, spec);
  } else {
    StepObservers observer(*this, st, clock, 0, 0);
    loss_sum = forward_backward_no_pipelining(
        spec, [this] { return next_microbatch(); }, observer);
    // One micro-batch in flight at a time.
    st.inflight_activation_bytes = st.activation_bytes;
    st.predicted_inflight_activation_bytes = st.predicted_activation_bytes;
  }
  model_->set_loss_sum(false);
  // The logged loss is the step's token mean either way (Megatron's train_step reports the
  // summed losses over the summed tokens).
  if (per_token) loss_sum /= tokens_per_microbatch * static_cast<double>(n_micro);
  stats_->finish_forward_backward(st, loss_sum, model_->moe_stats());
}

void Trainer::backward_from_loss(const at::Tensor& loss) {
  if (optimizer_->scales_loss()) {
    // Megatron's grad_scale_func: backward from loss * scale (an fp32 product).
    (loss * optimizer_->loss_scale()).backward();
  } else {
    loss.backward();
  }
}

double Trainer::forward_backward_pipelined(IterationStats& st, StepClock& clock,
                                           const ScheduleSpec& spec) {
  const TensorParallelGroup& pp = pipeline_parallel_group();
  const int64_t n_micro = spec.num_microbatches, chunks = model_->num_model_chunks();
  const PipelineP2P p2p = pipeline_p2p();
  // The step's batches first, so what the stage holds at once is measured without them.
  std::vector<MicroBatch> batches;
  for (int64_t m = 0; m < n_micro; ++m) batches.push_back(next_microbatch());
  synchronize_device(device_);
  const int64_t step_base = memory_.current_bytes();
  memory_.reset_peak();
  std::unique_ptr<TimelineScope> scope;
  if (record_timeline_ || trace_ != nullptr) {
    // The whole schedule: the memory of every in-flight micro-batch, forwards and backwards.
    timeline_->clear();
    scope = std::make_unique<TimelineScope>(*timeline_);
  }
  const auto t0 = Clock::now();
  schedule_.clear();
  StepObservers observer(*this, st, clock, p2p.bytes(), step_base);
  const double loss_sum = forward_backward_pipelining(spec, p2p, batches, observer);
  synchronize_device(device_);
  clock.busy_s += seconds_since(t0);
  timeline_mark("bwd end");
  const int64_t peak = memory_.peak_bytes();
  st.activation_peak_bytes = peak - step_base;
  clock.peak = std::max(clock.peak, peak);
  // Per micro-batch: this stage's activations (ActivationPrediction::chunk; with
  // routing-dependent MoE layers each micro-batch's own) and, at the end of its forward, its
  // output (not on the last stage). At once, what the schedule holds at the end of each forward,
  // replayed over the computations the stage ran: under 1F1B min(p - stage, M) micro-batches;
  // under the interleaved schedule the micro-batches of every chunk in flight, the received
  // inputs and gradients queued for later steps and the output about to be sent
  // (pipeline_memory in pipeline.h).
  const auto bytes_of = [&observer](int64_t c, int64_t m) {
    return observer.prediction.predicted(c, m);
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
        pipeline_memory(
            interleaved_schedule(pp.rank, pp.size, chunks, n_micro, spec.microbatch_group_size),
            pp.rank, pp.size, chunks, bytes_of, p2p.bytes())
            .peak_at_forward_end;
  } else {
    const int64_t output = model_->post_process() ? 0 : p2p.bytes();
    int64_t held = 0;
    st.predicted_inflight_activation_bytes = 0;
    for (const PipelineStep& s :
         pipeline_compute_order(pp.rank, pp.size, 1, n_micro, spec.microbatch_group_size)) {
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

double Trainer::from_last_stage(double value) const {
  const TensorParallelGroup& pp = pipeline_parallel_group();
  if (pp.size == 1) return value;
  // The other stages add zeros, which is exact.
  return group_all_reduce_sum(
             pp, at::tensor({model_->post_process() ? value : 0.0}, at::kDouble).to(device_))
      .item<double>();
}

double Trainer::evaluate() {
  TORCH_CHECK(valid_sampler_ != nullptr,
              "actmem::Trainer::evaluate: no validation data (with "
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

int Trainer::run(const RunOutput& out, const std::function<void(const IterationStats&)>& on_step,
                 bool compute_digest) {
  return RunLoop(*this, out).run(on_step, compute_digest);
}

std::optional<double> Trainer::loss_scale() const {
  return optimizer_->scales_loss() ? std::optional(optimizer_->loss_scale()) : std::nullopt;
}

void Trainer::finish_stats(IterationStats& st, const StepClock& clock) {
  stats_->finish(st, clock.busy_s, clock.peak, schedule_);
  if (trace_ != nullptr) trace_timeline(*timeline_, *trace_);
  if (offloader_) {
    offloader_->end_step();  // the first step is the warmup (Note [Offload warmup and margin])
    const OffloadStats os = offloader_->stats();
    st.offloaded_bytes = os.offloaded_bytes;
    st.offload_wait_s = os.wait_s;
    st.offload_copy_s = os.d2h_busy_s + os.h2d_busy_s;
    st.host_peak_bytes = offloader_->pool().peak_bytes_in_use();
  }
}

}  // namespace actmem
