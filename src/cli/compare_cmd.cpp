// compare_cmd.cpp — `actmem compare`: run several recompute strategies from the same seed and
// print one table (activation bytes measured and predicted, peak, step-time ratio to the plain
// run, bitwise equality of losses and gradient digests) plus an SVG memory timeline.
#include "actmem/plot.h"
#include "actmem/train_options.h"
#include "actmem/trainer.h"
#include "commands.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <sstream>

namespace actmem::cli {

namespace {

struct CompareOptions {
  TrainOptions train;
  std::vector<std::string> strategies = {"plain", "selective-core_attn",
                                         "selective-core_attn+mlp+layernorm", "full-block-2",
                                         "full-uniform-1"};
  int iters = 3;
  std::string svg = "actmem-compare.svg";
  std::string json;
};

// "plain", "full-uniform-N", "full-block-N", "selective" or "selective-m1+m2+..."
TransformerConfig apply_strategy(TransformerConfig c, const std::string& name) {
  auto bad = [&name] {
    TORCH_CHECK(false, "actmem compare: unknown strategy '", name, "'; expected plain, "
                "full-uniform-N, full-block-N, selective or selective-MOD[+MOD...] with MOD in "
                "core_attn, mlp, layernorm");
  };
  if (name == "plain") return c;
  if (name.rfind("full-", 0) == 0) {
    const auto dash = name.find('-', 5);
    if (dash == std::string::npos) bad();
    c.recompute_granularity = "full";
    c.recompute_method = name.substr(5, dash - 5);
    if (c.recompute_method != "uniform" && c.recompute_method != "block") bad();
    try {
      size_t used = 0;
      c.recompute_num_layers = std::stoll(name.substr(dash + 1), &used);
      if (used != name.size() - dash - 1) bad();
    } catch (const std::logic_error&) {
      bad();
    }
    return c;
  }
  if (name == "selective") {
    c.recompute_granularity = "selective";
    return c;
  }
  if (name.rfind("selective-", 0) == 0) {
    c.recompute_granularity = "selective";
    std::vector<std::string> modules;
    std::stringstream ss(name.substr(10));
    std::string m;
    while (std::getline(ss, m, '+')) modules.push_back(m);
    c.recompute_modules = modules;
    return c;
  }
  bad();
  return c;
}


int run(CompareOptions& o) {
  o.train.finalize();
  apply_thread_count(o.train.threads);
  TORCH_CHECK(o.iters > 0, "actmem compare: --iters must be positive, got ", o.iters);
  TORCH_CHECK(!o.strategies.empty(), "actmem compare: --strategies needs at least one strategy");
  std::vector<std::string> names = o.strategies;
  if (std::find(names.begin(), names.end(), "plain") == names.end()) {
    names.insert(names.begin(), "plain");  // the reference every ratio and equality refers to
  }
  std::vector<TransformerConfig> configs;
  for (const auto& n : names) {
    configs.push_back(apply_strategy(o.train.model, n));
    configs.back().validate();
  }
  TrainingConfig t = o.train.training;
  t.eval_interval = 0;
  t.train_iters = o.iters;
  std::vector<std::unique_ptr<Trainer>> trainers;
  for (const auto& c : configs) trainers.push_back(std::make_unique<Trainer>(c, t));
  for (auto& tr : trainers) tr->record_timeline(true);
  const size_t ref = static_cast<size_t>(
      std::find(names.begin(), names.end(), "plain") - names.begin());

  const size_t n = names.size();
  std::vector<std::vector<double>> times(n);
  std::vector<IterationStats> last(n);
  std::vector<bool> equal(n, true);
  std::vector<TimelineSeries> series(n);
  for (int it = 0; it < o.iters; ++it) {
    for (size_t i = 0; i < n; ++i) {  // round-robin: drift hits every strategy alike
      last[i] = trainers[i]->train_step(/*compute_digest=*/true);
      times[i].push_back(last[i].step_time_s);
    }
    for (size_t i = 0; i < n; ++i) {
      equal[i] = equal[i] && last[i].loss == last[ref].loss &&
                 last[i].grad_digest == last[ref].grad_digest;
    }
    std::cerr << "\rcompare: step " << it + 1 << "/" << o.iters << " of " << n << " strategies"
              << std::flush;
  }
  std::cerr << "\n";
  for (size_t i = 0; i < n; ++i) {
    series[i] = {names[i], trainers[i]->last_timeline().entries(), last[i].activation_peak_bytes};
  }
  const auto& m = o.train.model;
  const double plain_time = median(times[ref]);
  std::cout << "actmem compare: " << m.num_layers << " layers, hidden " << m.hidden_size << ", "
            << m.num_attention_heads << " heads, seq " << m.seq_length << ", micro-batch "
            << m.micro_batch_size << ", dropout " << m.attention_dropout << "/" << m.hidden_dropout
            << "; " << o.iters << " steps each, same seed\n\n"
            << std::left << std::setw(36) << "strategy" << std::right << std::setw(13)
            << "activations" << std::setw(13) << "predicted" << std::setw(9) << "error"
            << std::setw(13) << "act. peak" << std::setw(13) << "step ratio" << std::setw(15)
            << "bitwise equal\n";
  nlohmann::json out = {{"strategies", nlohmann::json::array()}};
  for (size_t i = 0; i < n; ++i) {
    const auto& st = last[i];
    const double err = st.activation_bytes > 0
                           ? 100.0 * (st.predicted_activation_bytes - st.activation_bytes) /
                                 static_cast<double>(st.activation_bytes)
                           : 0.0;
    const double ratio = median(times[i]) / plain_time;
    std::cout << std::left << std::setw(36) << names[i] << std::right << std::setw(13)
              << format_bytes(st.activation_bytes) << std::setw(13)
              << format_bytes(st.predicted_activation_bytes) << std::setw(8) << std::fixed
              << std::setprecision(2) << err << "%" << std::setw(13)
              << format_bytes(st.activation_peak_bytes) << std::setw(13) << std::setprecision(3)
              << ratio << std::setw(14) << (equal[i] ? "yes" : "NO") << "\n";
    out["strategies"].push_back({{"name", names[i]},
                                 {"activation_bytes", st.activation_bytes},
                                 {"predicted_activation_bytes", st.predicted_activation_bytes},
                                 {"activation_peak_bytes", st.activation_peak_bytes},
                                 {"peak_device_bytes", st.peak_device_bytes},
                                 {"step_time_s", median(times[i])},
                                 {"step_time_ratio", ratio},
                                 {"bitwise_equal_to_plain", static_cast<bool>(equal[i])}});
  }
  if (!o.svg.empty()) {
    std::ofstream f(o.svg);
    TORCH_CHECK(f.good(), "actmem compare: cannot write --svg file '", o.svg, "'");
    f << memory_timeline_svg(series, "Device memory through one training step");
    std::cout << "\nmemory timeline: " << o.svg << "\n";
  }
  if (!o.json.empty()) {
    std::ofstream f(o.json);
    TORCH_CHECK(f.good(), "actmem compare: cannot write --json file '", o.json, "'");
    f << out.dump(2) << "\n";
  }
  const bool all_equal = std::all_of(equal.begin(), equal.end(), [](bool b) { return b; });
  if (!all_equal) std::cout << "\nWARNING: some strategies are not bitwise equal to plain\n";
  return all_equal ? 0 : 3;
}

}  // namespace

Runner add_compare_command(CLI::App& app) {
  auto o = std::make_shared<CompareOptions>();
  // compare's own default model: large enough for the strategies to differ visibly, ~10 s.
  o->train.model.num_layers = 4;
  o->train.model.hidden_size = 128;
  o->train.model.seq_length = 256;
  o->train.model.micro_batch_size = 4;
  CLI::App* cmd = app.add_subcommand("compare", "Compare recompute strategies on one model");
  add_model_flags(*cmd, o->train);
  add_training_flags(*cmd, o->train);
  cmd->add_option("--strategies", o->strategies,
                  "plain, full-uniform-N, full-block-N, selective, selective-MOD[+MOD...]")
      ->capture_default_str()
      ->expected(1, -1);
  cmd->add_option("--iters", o->iters, "steps per strategy")->capture_default_str();
  cmd->add_option("--svg", o->svg, "memory-timeline plot to write ('' = none)")->capture_default_str();
  cmd->add_option("--json", o->json, "also write the table as JSON");
  return [o, cmd]() { return cmd->parsed() ? run(*o) : -1; };
}

}  // namespace actmem::cli
