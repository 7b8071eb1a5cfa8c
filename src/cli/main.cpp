// main.cpp — the `actmem` command line. Library code throws; only this file turns errors into
// messages on stderr and exit codes.
#include "actmem/process.h"
#include "actmem/train_options.h"
#include "actmem/trainer.h"

#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <iomanip>
#include <iostream>

namespace {

// First line of a c10::Error's message, without libtorch's "Exception raised from" context.
std::string first_line(const std::string& text) {
  const auto nl = text.find('\n');
  return nl == std::string::npos ? text : text.substr(0, nl);
}

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
}

int run_train(actmem::TrainOptions& o) {
  o.finalize();
  actmem::apply_thread_count(o.threads);
  std::ofstream log;
  if (!o.log_json.empty()) {
    log.open(o.log_json, std::ios::trunc);
    TORCH_CHECK(log.good(), "actmem train: cannot write --log-json file '", o.log_json, "'");
  }
  actmem::Trainer trainer(o.model, o.training);
  print_header(trainer, o, trainer.model());
  double first_loss = NAN, last_loss = NAN, total_time = 0.0;
  std::optional<double> last_val;
  int64_t steps = 0;
  trainer.run(&std::cout, [&](const actmem::IterationStats& st) {
    if (std::isnan(first_loss)) first_loss = st.loss;
    last_loss = st.loss;
    total_time += st.step_time_s;
    ++steps;
    if (st.val_loss) last_val = st.val_loss;
    if (log.is_open()) {
      log << actmem::to_json(st).dump() << "\n";
      log.flush();
    }
  }, /*compute_digest=*/log.is_open());
  std::cout << std::fixed << std::setprecision(4) << "done: loss " << first_loss << " -> "
            << last_loss;
  if (last_val) std::cout << " | validation loss " << *last_val;
  std::cout << std::setprecision(1) << " | " << total_time << " s in steps ("
            << 1e3 * total_time / static_cast<double>(steps) << " ms/step)\n";
  if (log.is_open()) std::cout << "JSON log: " << o.log_json << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  actmem::ensure_passive_openmp_wait(argv);
  CLI::App app{"actmem: train transformers on libtorch with managed activation memory"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Show help for every subcommand");
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return "error: " + std::string(e.what()) + " (run with --help for usage)\n";
  });

  actmem::TrainOptions train;
  CLI::App* train_cmd = app.add_subcommand("train", "Train a GPT model and log each iteration");
  actmem::add_model_flags(*train_cmd, train);
  actmem::add_training_flags(*train_cmd, train);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (train_cmd->parsed()) return run_train(train);
  } catch (const c10::Error& e) {
    std::cerr << "error: " << first_line(e.msg()) << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << first_line(e.what()) << std::endl;
    return 1;
  }
  return 0;
}
