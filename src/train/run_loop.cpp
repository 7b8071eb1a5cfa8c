// run_loop.cpp — Trainer::run (the training loop with its log, validation, saves and exit on a
// signal) and Trainer::evaluate.
#include "actmem/train/trainer.h"

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
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}
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
      all_gather_dim0(at::full({1}, value, at::TensorOptions().dtype(at::kLong).device(device))).cpu();
  return std::vector<int64_t>(all.data_ptr<int64_t>(), all.data_ptr<int64_t>() + all.numel());
}

}  // namespace

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

namespace {
// The log's window: steps since the last progress line.
struct LogWindow {
  double time_s = 0.0;
  int64_t steps = 0;
  int64_t skipped = 0;  // Megatron's "number of skipped iterations" per log line
};

// What the progress line shows besides the step's statistics.
struct ProgressContext {
  int64_t total = 0;                 // the run's last iteration
  std::optional<double> loss_scale;  // with loss scaling
  bool capacity_factor = false;      // MoE with a capacity: the dropped share
  // --log-throughput's model FLOPs of one iteration / world size (else unset).
  std::optional<double> flops_per_rank_step;
  bool per_sequence_balancing = false;  // seq_aux_loss's name for the balancing loss
  bool batch_schedule = false;          // --step-batch-size-schedule: the step's global batch
  // For the ETA: the samples consumed when the run started and after its last step.
  int64_t first_samples = 0, last_samples = 0;
};

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

void Trainer::report_first_step(const RunOutput& out, const IterationStats& st) {
  if (!offloader_) return;
  // Every rank gathers (a collective); the progress stream's rank prints.
  const auto summary = gather_offload_summary(offloader_->summary(), device_);
  const bool any = std::any_of(summary.begin(), summary.end(),
                               [](const OffloadSummaryRank& r) { return !r.rows.empty(); });
  if (out.progress != nullptr && any) print_offload_summary(*out.progress, summary);
  if (out.warnings != nullptr && st.offloaded_bytes == 0) {
    *out.warnings << zero_offload_warning(*offloader_) << std::endl;
  }
}

int Trainer::exit_signal(const RunOutput& out) const {
  if (out.exit_signals == nullptr) return 0;
  // Every rank stops after the same step: the ranks agree on whether any received one.
  int signal = out.exit_signals->received();
  if (tensor_parallel_group().size > 1) {
    for (const int64_t r : signal_per_rank(signal, device_)) {
      signal = std::max(signal, static_cast<int>(r));
    }
  }
  return signal;
}

int Trainer::run(const RunOutput& out,
                 const std::function<void(const IterationStats&)>& on_step,
                 bool compute_digest) {
  TraceRecorder recorder;
  const int64_t first = iteration_ + 1;  // after a loaded checkpoint, the step that follows it
  const int64_t traced = std::min<int64_t>(first + 1, config_.train_iters);
  const int64_t total = config_.train_iters;
  int64_t saved_at = iteration_;  // a loaded checkpoint need not be saved again
  const auto run_start = Clock::now();
  std::ostream* progress = out.progress;
  auto save = [&] {
    const auto t0 = Clock::now();
    const std::string where = save_checkpoint(config_.save);
    saved_at = iteration_;
    if (progress != nullptr) {
      *progress << "saved checkpoint at iteration " << iteration_ << " to " << where << " in "
                << std::fixed << std::setprecision(2) << seconds_since(t0) << " s\n";
    }
  };
  LogWindow window;
  ProgressContext ctx;
  ctx.total = total;
  ctx.capacity_factor = model_config_.moe_expert_capacity_factor.has_value();
  ctx.per_sequence_balancing = model_config_.moe_router_load_balancing_type == "seq_aux_loss";
  ctx.batch_schedule = batches_.stepped();
  ctx.first_samples = consumed_train_samples();
  ctx.last_samples =
      batches_.samples_after(std::max<int64_t>(total - iteration_, 0), ctx.first_samples);
  // Every global batch the run's steps reach, checked before the first (Megatron finds a size
  // the layout cannot run when training reaches it).
  if (batches_.stepped()) check_batch_sizes(std::max<int64_t>(total - iteration_, 0));
  const int64_t world =
      tensor_parallel_group().size * data_parallel_group().size * pipeline_parallel_group().size;
  int64_t batch = next_global_batch();
  for (int64_t it = first; it <= total; ++it) {
    if (const int64_t next = next_global_batch(); next != batch) {
      // Megatron's train loop: when the number of micro-batches changes (not on the run's first
      // step), a checkpoint with --save before the first step at the new size.
      if (progress != nullptr) {
        *progress << "global batch size " << batch << " -> " << next << " at "
                  << consumed_train_samples() << " consumed samples (--step-batch-size-schedule)\n";
      }
      batch = next;
      if (!config_.save.empty() && iteration_ != 0 && saved_at != iteration_) save();
    }
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
    if (it == first) report_first_step(out, st);
    window.time_s += st.step_time_s;
    ++window.steps;
    if (st.skipped) ++window.skipped;
    if (config_.eval_interval > 0 && (it % config_.eval_interval == 0 || it == total)) {
      st.val_loss = evaluate();
    }
    if (progress != nullptr && (it % config_.log_interval == 0 || it == first || it == total)) {
      ctx.loss_scale =
          optimizer_->scales_loss() ? std::optional(optimizer_->loss_scale()) : std::nullopt;
      // Megatron's num_floating_point_operations(args, this step's global batch) / world size.
      if (config_.log_throughput) {
        ctx.flops_per_rank_step =
            megatron_model_flops(model_config_, st.global_batch_size) / static_cast<double>(world);
      }
      print_progress_line(*progress, st, ctx, window);
      window = LogWindow{};
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
    if (const int signal = exit_signal(out); signal != 0) {
      if (!config_.save.empty() && saved_at != iteration_) save();
      if (progress != nullptr) {
        *progress << "exiting after iteration " << iteration_ << " on signal " << signal
                  << (config_.save.empty() ? " (no --save: nothing saved)" : "") << "\n";
        progress->flush();
      }
      return signal;
    }
    // Megatron's checkpoint_and_decide_exit (training.py): the time limit, then the interval.
    if (config_.exit_duration_in_mins) {
      const double minutes = seconds_since(kProgramStart) / 60.0;
      if (on_any_rank(minutes > *config_.exit_duration_in_mins, device_)) {
        if (!config_.save.empty() && saved_at != iteration_) save();
        if (progress != nullptr) {
          *progress << "exiting program after " << std::setprecision(4) << minutes
                    << " minutes (--exit-duration-in-mins " << *config_.exit_duration_in_mins
                    << ")\n";
          progress->flush();
        }
        return 0;
      }
    }
    if (config_.exit_interval && it % *config_.exit_interval == 0) {
      if (!config_.save.empty() && saved_at != iteration_) save();
      if (progress != nullptr) {
        *progress << "exiting program at iteration " << it << " (--exit-interval "
                  << *config_.exit_interval << ")\n";
        progress->flush();
      }
      return 0;
    }
  }
  if (!config_.save.empty() && saved_at != iteration_) save();
  return 0;
}

}  // namespace actmem
