// train_cmd.cpp — `actmem train`: train a GPT model and log each iteration.
#include "actmem/distributed.h"
#include "actmem/tensor_parallel.h"
#include "actmem/train_options.h"
#include "actmem/trainer.h"
#include "commands.h"

#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>

namespace actmem::cli {

namespace {

void print_header(const actmem::Trainer& trainer, const actmem::TrainOptions& o,
                  actmem::GPTModel& model) {
  const auto& m = o.model;
  const auto& t = o.training;
  std::cout << "actmem train: " << m.num_layers << " layers, hidden " << m.hidden_size << ", "
            << m.num_attention_heads << " heads, ffn " << m.ffn() << ", seq " << m.seq_length
            << ", micro-batch " << m.micro_batch_size << " x "
            << t.num_microbatches(m.micro_batch_size) << " micro-batches, "
            << (m.gated_linear_unit ? "SwiGLU" : "GeLU") << ", " << m.normalization << ", "
            << (m.use_rope() ? "RoPE" : "learned positions") << "\n"
            << "  parameters " << model.num_parameters() << " | dropout attention "
            << m.attention_dropout << " hidden " << m.hidden_dropout << " | corpus "
            << trainer.corpus().source << " (" << trainer.corpus().train.numel() << " train / "
            << trainer.corpus().valid.numel() << " validation tokens) | device " << t.device
            << " | " << at::get_num_threads() << " threads\n";
  if (m.tensor_model_parallel_size > 1) {
    std::cout << "  tensor parallel " << m.tensor_model_parallel_size << " ranks"
              << (m.sequence_parallel ? " with sequence parallelism" : "")
              << " | parameters per rank " << model.num_parameters() << " | numbers below are "
              << "rank 0's; the JSON log has every rank's memory\n";
  }
}

int run_train(actmem::TrainOptions& o) {
  o.finalize();
  actmem::apply_thread_count(o.threads);
  // Under `actmem launch`, rank 0 alone writes the JSON log, the trace and the progress.
  const actmem::DistEnv dist = actmem::dist_env_from_environment();
  TORCH_CHECK(dist.world_size == o.model.tensor_model_parallel_size, "actmem train: ",
              dist.world_size, " process(es) but --tensor-model-parallel-size ",
              o.model.tensor_model_parallel_size, "; every launched process is one tensor-parallel "
              "rank (data parallelism is not implemented), so use `actmem launch --nproc-per-node ",
              o.model.tensor_model_parallel_size, " -- train ...`");
  o.training.device = actmem::device_for_rank(o.training.device, dist);
  const actmem::TensorParallelSession tp_session(dist, c10::Device(o.training.device));
  // Every rank computes the digests when rank 0 logs them (they are gathered collectively).
  const bool digests = !o.log_json.empty();
  if (dist.rank != 0) {
    o.log_json.clear();
    o.trace.clear();
  }
  std::ofstream log;
  if (!o.log_json.empty()) {
    log.open(o.log_json, std::ios::trunc);
    TORCH_CHECK(log.good(), "actmem train: cannot write --log-json file '", o.log_json, "'");
  }
  actmem::Trainer trainer(o.model, o.training);
  if (dist.rank == 0) print_header(trainer, o, trainer.model());
  double first_loss = NAN, last_loss = NAN, total_time = 0.0;
  std::optional<double> last_val;
  int64_t steps = 0;
  trainer.run(dist.rank == 0 ? &std::cout : nullptr, [&](const actmem::IterationStats& st) {
    if (std::isnan(first_loss)) first_loss = st.loss;
    last_loss = st.loss;
    total_time += st.step_time_s;
    ++steps;
    if (st.val_loss) last_val = st.val_loss;
    if (log.is_open()) {
      log << actmem::to_json(st).dump() << "\n";
      log.flush();
    }
  }, /*compute_digest=*/digests, o.trace);
  if (dist.rank != 0) return 0;
  std::cout << std::fixed << std::setprecision(4) << "done: loss " << first_loss << " -> "
            << last_loss;
  if (last_val) std::cout << " | validation loss " << *last_val;
  std::cout << std::setprecision(1) << " | " << total_time << " s in steps ("
            << 1e3 * total_time / static_cast<double>(steps) << " ms/step)\n";
  if (log.is_open()) std::cout << "JSON log: " << o.log_json << "\n";
  return 0;
}

}  // namespace

Runner add_train_command(CLI::App& app) {
  auto options = std::make_shared<TrainOptions>();
  CLI::App* cmd = app.add_subcommand("train", "Train a GPT model and log each iteration");
  add_model_flags(*cmd, *options);
  add_training_flags(*cmd, *options);
  return [options, cmd]() { return cmd->parsed() ? run_train(*options) : -1; };
}

}  // namespace actmem::cli
