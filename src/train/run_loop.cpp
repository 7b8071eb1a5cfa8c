// run_loop.cpp — the training loop (run_loop.h): its log, validation, saves, trace and exits.
#include "actmem/train/run_loop.h"

#include "actmem/base/output_file.h"
#include "actmem/base/trace.h"
#include "actmem/offload/activation_offloader.h"
#include "actmem/parallel/pipeline.h"
#include "actmem/parallel/tensor_parallel.h"
#include "actmem/train/throughput.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <optional>
#include <ostream>
#include <sstream>

namespace actmem {

namespace {
using Clock = std::chrono::steady_clock;
// Gathers one int64 per rank (rank order) over the tensor-parallel group; the value travels on
// the training device (NCCL takes device tensors only).
// Whether `mine` holds on any rank of the world (tensor, data and pipeline groups together span
// it): Megatron's MAX all-reduce of a done flag.
bool on_any_rank(bool mine, const at::Device& device) {
  at::Tensor flag =
      at::full({1}, mine ? 1.0 : 0.0, at::TensorOptions().dtype(at::kFloat).device(device));
  for (const TensorParallelGroup* g :
       {&tensor_parallel_group(), &data_parallel_group(), &pipeline_parallel_group()}) {
    if (g->size > 1) flag = group_all_reduce_sum(*g, flag);
  }
  return flag.item<float>() > 0;
}

// When the program started: a static of this library, set before main runs (Megatron measures
// --exit-duration-in-mins from its script's start, _TRAIN_START_TIME).
const Clock::time_point kProgramStart = Clock::now();

std::vector<int64_t> signal_per_rank(int64_t value, const at::Device& device) {
  const at::Tensor all =
      all_gather_dim0(at::full({1}, value, at::TensorOptions().dtype(at::kLong).device(device)))
          .cpu();
  return std::vector<int64_t>(all.data_ptr<int64_t>(), all.data_ptr<int64_t>() + all.numel());
}

}  // namespace

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

namespace {

// One progress line, Megatron's fields in its order where it has them.
void print_progress_line(std::ostream& os, const IterationStats& st, const ProgressContext& ctx,
                         const LogWindow& window) {
  const int64_t total = ctx.total;
  const std::optional<double>& loss_scale = ctx.loss_scale;
  const int width = static_cast<int>(std::to_string(total).size());
  const double mean_step = window.time_s / static_cast<double>(window.steps);
  os << "iter " << std::setw(width) << st.iteration << "/" << total << " | loss " << std::fixed
     << std::setprecision(4) << st.loss;
  if (st.skipped) {
    os << " | skipped (gradient overflow at loss scale " << std::defaultfloat << st.loss_scale
       << ")" << std::fixed;
  } else {
    os << " | grad norm " << std::setprecision(3) << st.grad_norm;
  }
  if (loss_scale) {
    os << " | loss scale " << std::defaultfloat << *loss_scale << std::fixed << " | skipped "
       << window.skipped;
  }
  if (st.moe) {
    // Megatron's names: load_balancing_loss (seq_load_balancing_loss with seq_aux_loss) and
    // z_loss, unscaled (1 = balanced routing).
    if (st.load_balancing_loss) {
      os << (ctx.per_sequence_balancing ? " | seq_load_balancing_loss " : " | load_balancing_loss ")
         << std::setprecision(3) << *st.load_balancing_loss;
    }
    if (st.z_loss) os << " | z_loss " << std::setprecision(3) << *st.z_loss;
    os << " | expert load max/mean " << std::setprecision(2) << st.expert_load_imbalance;
    if (ctx.capacity_factor) {
      os << " | dropped " << std::setprecision(1)
         << 100.0 * static_cast<double>(st.moe_dropped_tokens) /
                static_cast<double>(std::max<int64_t>(st.moe_routed_tokens, 1))
         << "%";
    }
  }
  os << " | lr " << std::scientific << std::setprecision(2) << st.lr;
  if (st.decoupled_lr) os << " | decoupled lr " << *st.decoupled_lr;
  if (ctx.batch_schedule) os << " | global batch size " << st.global_batch_size;
  os << std::fixed << " | " << std::setprecision(1) << mean_step * 1e3 << " ms/step | ";
  if (ctx.flops_per_rank_step) {
    // Megatron's training_log with --log-throughput (per GPU there; per rank here).
    os << "throughput per rank (TFLOP/s/rank): " << std::setprecision(3)
       << tflops_per_rank(*ctx.flops_per_rank_step, mean_step, 1) << " | ";
  }
  os << std::setprecision(0) << st.tokens_per_s << " tok/s | peak "
     << format_bytes(static_cast<double>(st.peak_device_bytes)) << " | act "
     << format_bytes(static_cast<double>(st.activation_bytes));
  if (st.iteration < total) {
    // Wall time per sample so far (validation and saves included) times the samples left: the
    // steps left, when the batch is constant.
    const double per_sample =
        st.elapsed_s / static_cast<double>(st.consumed_samples - ctx.first_samples);
    os << " | ETA "
       << format_duration(per_sample * static_cast<double>(ctx.last_samples - st.consumed_samples));
  }
  os << "\n";
}
}  // namespace

RunLoop::RunLoop(Trainer& trainer, const Trainer::RunOutput& out)
    : t_(trainer), out_(out), progress_(out.progress), saved_at_(trainer.iteration()) {}

void RunLoop::save() {
  const auto t0 = Clock::now();
  const std::string where = t_.save_checkpoint(t_.config().save);
  saved_at_ = t_.iteration();
  if (progress_ != nullptr) {
    *progress_ << "saved checkpoint at iteration " << t_.iteration() << " to " << where << " in "
               << std::fixed << std::setprecision(2) << seconds_since(t0) << " s\n";
  }
}

void RunLoop::save_unless_saved() {
  if (!t_.config().save.empty() && saved_at_ != t_.iteration()) save();
}

void RunLoop::report_first_step(const IterationStats& st) {
  ActivationOffloader* offloader = t_.offloader();
  if (offloader == nullptr) return;
  // Every rank gathers (a collective); the progress stream's rank prints.
  const auto summary = gather_offload_summary(offloader->summary(), t_.device());
  const bool any = std::any_of(summary.begin(), summary.end(),
                               [](const OffloadSummaryRank& r) { return !r.rows.empty(); });
  if (progress_ != nullptr && any) print_offload_summary(*progress_, summary);
  if (out_.warnings != nullptr && st.offloaded_bytes == 0) {
    *out_.warnings << zero_offload_warning(*offloader) << std::endl;
  }
}

int RunLoop::exit_signal() const {
  if (out_.exit_signals == nullptr) return 0;
  // Every rank stops after the same step: the ranks agree on whether any received one.
  int signal = out_.exit_signals->received();
  if (tensor_parallel_group().size > 1) {
    for (const int64_t r : signal_per_rank(signal, t_.device())) {
      signal = std::max(signal, static_cast<int>(r));
    }
  }
  return signal;
}

void RunLoop::start() {
  const TrainingConfig& config = t_.config();
  const TransformerConfig& model = t_.model().config();
  const GlobalBatchSchedule& batches = t_.batch_schedule();
  first_ = t_.iteration() + 1;  // after a loaded checkpoint, the step that follows it
  total_ = config.train_iters;
  traced_ = std::min<int64_t>(first_ + 1, total_);
  ctx_.total = total_;
  ctx_.capacity_factor = model.moe_expert_capacity_factor.has_value();
  ctx_.per_sequence_balancing = model.moe_router_load_balancing_type == "seq_aux_loss";
  ctx_.batch_schedule = batches.stepped();
  ctx_.first_samples = t_.consumed_train_samples();
  ctx_.last_samples =
      batches.samples_after(std::max<int64_t>(total_ - t_.iteration(), 0), ctx_.first_samples);
  // Every global batch the run's steps reach, checked before the first (Megatron finds a size
  // the layout cannot run when training reaches it).
  if (batches.stepped()) t_.check_batch_sizes(std::max<int64_t>(total_ - t_.iteration(), 0));
  world_ =
      tensor_parallel_group().size * data_parallel_group().size * pipeline_parallel_group().size;
  batch_ = t_.next_global_batch();
}

void RunLoop::follow_batch_schedule() {
  if (const int64_t next = t_.next_global_batch(); next != batch_) {
    // Megatron's train loop: when the number of micro-batches changes (not on the run's first
    // step), a checkpoint with --save before the first step at the new size.
    if (progress_ != nullptr) {
      *progress_ << "global batch size " << batch_ << " -> " << next << " at "
                 << t_.consumed_train_samples()
                 << " consumed samples (--step-batch-size-schedule)\n";
    }
    batch_ = next;
    if (!t_.config().save.empty() && t_.iteration() != 0 && saved_at_ != t_.iteration()) save();
  }
}

IterationStats RunLoop::step(int64_t it, bool compute_digest) {
  const bool trace_now = out_.trace != nullptr && it == traced_;
  if (trace_now) t_.set_trace(&recorder_);
  IterationStats st = t_.train_step(compute_digest);
  st.elapsed_s = seconds_since(run_start_);
  if (trace_now) {
    t_.set_trace(nullptr);
    // Copies of this step may still be running: wait for the streams to drain first.
    if (t_.offloader() != nullptr) t_.offloader()->wait_idle();
    out_.trace->write(recorder_.json(), "the trace of iteration " + std::to_string(it));
    out_.trace->close();
    if (progress_ != nullptr) {
      *progress_ << "trace of iteration " << it << ": " << out_.trace->path() << "\n";
    }
  }
  return st;
}

void RunLoop::log(int64_t it, const IterationStats& st) {
  const TrainingConfig& config = t_.config();
  if (progress_ != nullptr && (it % config.log_interval == 0 || it == first_ || it == total_)) {
    ctx_.loss_scale = t_.loss_scale();
    // Megatron's num_floating_point_operations(args, this step's global batch) / world size.
    if (config.log_throughput) {
      ctx_.flops_per_rank_step = megatron_model_flops(t_.model().config(), st.global_batch_size) /
                                 static_cast<double>(world_);
    }
    print_progress_line(*progress_, st, ctx_, window_);
    window_ = LogWindow{};
  }
  if (progress_ != nullptr && st.val_loss) {
    *progress_ << "validation at iter " << it << " | loss " << std::fixed << std::setprecision(4)
               << *st.val_loss << " | ppl " << std::setprecision(2) << std::exp(*st.val_loss)
               << "\n";
  }
  if (progress_ != nullptr) progress_->flush();
}

std::optional<int> RunLoop::exit_after(int64_t it) {
  const TrainingConfig& config = t_.config();
  if (const int signal = exit_signal(); signal != 0) {
    save_unless_saved();
    if (progress_ != nullptr) {
      *progress_ << "exiting after iteration " << t_.iteration() << " on signal " << signal
                 << (config.save.empty() ? " (no --save: nothing saved)" : "") << "\n";
      progress_->flush();
    }
    return signal;
  }
  // Megatron's checkpoint_and_decide_exit (training.py): the time limit, then the interval.
  if (config.exit_duration_in_mins) {
    const double minutes = seconds_since(kProgramStart) / 60.0;
    if (on_any_rank(minutes > *config.exit_duration_in_mins, t_.device())) {
      save_unless_saved();
      if (progress_ != nullptr) {
        *progress_ << "exiting program after " << std::setprecision(4) << minutes
                   << " minutes (--exit-duration-in-mins " << *config.exit_duration_in_mins
                   << ")\n";
        progress_->flush();
      }
      return 0;
    }
  }
  if (config.exit_interval && it % *config.exit_interval == 0) {
    save_unless_saved();
    if (progress_ != nullptr) {
      *progress_ << "exiting program at iteration " << it << " (--exit-interval "
                 << *config.exit_interval << ")\n";
      progress_->flush();
    }
    return 0;
  }
  return std::nullopt;
}

int RunLoop::run(const std::function<void(const IterationStats&)>& on_step, bool compute_digest) {
  const TrainingConfig& config = t_.config();
  run_start_ = Clock::now();
  start();
  for (int64_t it = first_; it <= total_; ++it) {
    follow_batch_schedule();
    IterationStats st = step(it, compute_digest);
    if (it == first_) report_first_step(st);
    window_.time_s += st.step_time_s;
    ++window_.steps;
    if (st.skipped) ++window_.skipped;
    if (config.eval_interval > 0 && (it % config.eval_interval == 0 || it == total_)) {
      st.val_loss = t_.evaluate();
    }
    log(it, st);
    if (on_step) on_step(st);
    if (!config.save.empty() && config.save_interval > 0 && it % config.save_interval == 0) {
      save();
    }
    if (const std::optional<int> code = exit_after(it)) return *code;
  }
  save_unless_saved();
  return 0;
}

}  // namespace actmem
