// iteration_stats.cpp — what a training step measured, gathered over the ranks for the log
// and the JSON record (iteration_stats.h; IterationStats in trainer.h).
#include "actmem/train/iteration_stats.h"

#include "actmem/base/trace.h"
#include "actmem/memory/memory_tracker.h"
#include "actmem/parallel/tensor_parallel.h"

#include <ATen/ATen.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

namespace actmem {

namespace {
using Clock = std::chrono::steady_clock;

// Gathers one int64 per rank (rank order) over the tensor-parallel group; the value travels on
// the training device (NCCL takes device tensors only).
std::vector<int64_t> gather_per_rank(int64_t value, const at::Device& device) {
  const at::Tensor all =
      all_gather_dim0(at::full({1}, value, at::TensorOptions().dtype(at::kLong).device(device)))
          .cpu();
  return std::vector<int64_t>(all.data_ptr<int64_t>(), all.data_ptr<int64_t>() + all.numel());
}

// The MoE statistics of every stage's layers, on every stage (the log reports the model's).
MoEStats gather_moe_stats_over_stages(const MoEStats& local, const TransformerConfig& model_config_,
                                      const at::Device& device_) {
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
    for (int64_t j = 0; j < experts; ++j)
      l.routed_per_expert.push_back(static_cast<int64_t>(p[6 + j]));
    out.layers.push_back(std::move(l));
    p += fields;
  }
  return out;
}

}  // namespace

nlohmann::json to_json(const IterationStats& s) {
  nlohmann::json j = {
      {"iteration", s.iteration},
      {"loss", s.loss},
      {"grad_norm", s.skipped ? nlohmann::json(nullptr) : nlohmann::json(s.grad_norm)},
      {"grad_digest", s.grad_digest},
      {"lr", s.lr},
      {"decoupled_lr", s.decoupled_lr ? nlohmann::json(*s.decoupled_lr) : nlohmann::json(nullptr)},
      {"consumed_samples", s.consumed_samples},
      {"global_batch_size", s.global_batch_size},
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
        row.push_back({{"op", e.forward ? "F" : "B"},
                       {"microbatch", e.microbatch},
                       {"chunk", e.chunk},
                       {"start_s", e.start_s},
                       {"end_s", e.end_s}});
      }
      stages.push_back(std::move(row));
    }
    j["pipeline_schedule_per_stage"] = std::move(stages);
  }
  if (s.val_loss) j["val_loss"] = *s.val_loss;
  if (s.moe) {
    auto opt = [](const std::optional<double>& v) {
      return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
    };
    j["load_balancing_loss"] = opt(s.load_balancing_loss);
    j["z_loss"] = opt(s.z_loss);
    j["expert_load_imbalance"] = s.expert_load_imbalance;
    j["moe_routed_tokens"] = s.moe_routed_tokens;
    j["moe_dropped_tokens"] = s.moe_dropped_tokens;
  }
  return j;
}

StepStatistics::StepStatistics(const TransformerConfig& model, const at::Device& device)
    : model_config_(model), device_(device) {}

void StepStatistics::finish_forward_backward(IterationStats& st, double loss_sum,
                                             MoEStats moe) const {
  const TensorParallelGroup& dp = data_parallel_group();
  st.loss = loss_sum;  // the losses were divided by n_micro, so their sum is the mean
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
    moe = gather_moe_stats_over_stages(moe, model_config_, device_);
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
    const at::Tensor all = data_parallel_all_reduce_sum(
        at::tensor({loss_sum, static_cast<double>(st.moe_routed_tokens),
                    static_cast<double>(st.moe_dropped_tokens),
                    st.load_balancing_loss.value_or(0.0), st.z_loss.value_or(0.0)},
                   at::kDouble));
    st.loss = all[0].item<double>() / d;
    st.moe_routed_tokens = static_cast<int64_t>(all[1].item<double>());
    st.moe_dropped_tokens = static_cast<int64_t>(all[2].item<double>());
    if (st.load_balancing_loss) st.load_balancing_loss = all[3].item<double>() / d;
    if (st.z_loss) st.z_loss = all[4].item<double>() / d;
  }
}

void StepStatistics::gather_rank_stats(IterationStats& st, bool compute_digest) const {
  if (tensor_parallel_group().size == 1) return;
  if (compute_digest) {
    const std::string& d = st.grad_digest;
    at::Tensor bytes = at::empty({1, static_cast<int64_t>(d.size())}, at::kByte);
    std::memcpy(bytes.data_ptr<uint8_t>(), d.data(), d.size());
    const at::Tensor all = all_gather_dim0(bytes.to(device_)).cpu();
    for (int64_t r = 0; r < all.size(0); ++r) {
      st.grad_digest_per_rank.emplace_back(
          reinterpret_cast<const char*>(all[r].data_ptr<uint8_t>()), d.size());
    }
  }
  st.activation_bytes_per_rank = gather_per_rank(st.activation_bytes, device_);
  st.activation_peak_bytes_per_rank = gather_per_rank(st.activation_peak_bytes, device_);
}

void StepStatistics::gather_schedule(IterationStats& st, const TensorParallelGroup& pp,
                                     const std::vector<PipelineEvent>& schedule_) const {
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

void StepStatistics::finish(IterationStats& st, double busy_s, int64_t peak,
                            const std::vector<PipelineEvent>& schedule) const {
  // The whole global batch's tokens (every data-parallel rank's) per second of this rank's step.
  st.step_time_s = busy_s;
  st.tokens_per_s = static_cast<double>(st.global_batch_size * model_config_.seq_length) / busy_s;
  st.peak_device_bytes = peak;
  if (tensor_parallel_group().size > 1) {
    st.peak_device_bytes_per_rank = gather_per_rank(peak, device_);
  }
  if (const TensorParallelGroup& pp = pipeline_parallel_group(); pp.size > 1) {
    // Every stage's memory, for the log rank 0 (the first stage) writes.
    const at::Tensor mine =
        at::tensor({st.inflight_activation_bytes, st.predicted_inflight_activation_bytes, peak},
                   at::kLong)
            .to(device_);
    const at::Tensor all = group_all_gather_dim0(pp, mine).cpu().view({pp.size, 3});
    for (int64_t r = 0; r < pp.size; ++r) {
      st.inflight_activation_bytes_per_stage.push_back(all[r][0].item<int64_t>());
      st.predicted_inflight_activation_bytes_per_stage.push_back(all[r][1].item<int64_t>());
      st.peak_device_bytes_per_stage.push_back(all[r][2].item<int64_t>());
    }
    gather_schedule(st, pp, schedule);
  }
}

void trace_timeline(const MemoryTimeline& timeline, TraceRecorder& trace) {
  // Compute spans between consecutive timeline marks of the first micro-batch.
  const auto& e = timeline.entries();
  const auto origin = timeline.start_time();
  for (size_t i = 1; i < e.size(); ++i) {
    trace.span("compute", e[i].label,
               origin + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(e[i - 1].time_s)),
               origin + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(e[i].time_s)),
               "{\"device_bytes\": " + std::to_string(e[i].current_bytes) + "}");
  }
}

}  // namespace actmem
