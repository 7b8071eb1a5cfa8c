// compare_cmd.cpp — `actmem compare`: run several recompute strategies from the same seed and
// print one table (activation bytes measured and predicted, peak, step-time ratio to the plain
// run, bitwise equality of losses and gradient digests) plus an SVG memory timeline.
#include "actmem/base/blas.h"
#include "actmem/base/environment.h"
#include "actmem/base/output_file.h"
#include "actmem/config/activation_plan.h"
#include "actmem/config/strategy.h"
#include "actmem/flags/train_options.h"
#include "actmem/train/plot.h"
#include "actmem/train/step_rounds.h"
#include "actmem/train/trainer.h"
#include "commands.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <ATen/Parallel.h>

#include <algorithm>
#include <charconv>
#include <iomanip>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>

namespace actmem::cli {

namespace {

// Fewer timed rounds than this, or a plain step whose range exceeds this fraction of its median,
// is warned about (Note [Honest step ratios]).
constexpr int kMinTrustedSteps = 5;
constexpr double kMaxTrustedSpread = 0.25;

struct CompareOptions {
  TrainOptions train;
  std::vector<std::string> strategies = {"plain", "selective-core_attn",
                                         "selective-core_attn+mlp+layernorm", "full-block-2",
                                         "full-uniform-1"};
  int warmup = 2;
  int iters = 7;
  std::string svg = "actmem-compare.svg";
  std::string json;
};

// One strategy of --strategies (parse_strategy's grammar, strategy.h) applied to the run's flags;
// make_activation_plan() validates the result like any other flags.
TransformerConfig apply_strategy(const TransformerConfig& c, const std::string& name) {
  const TransformerConfig applied = parse_strategy(name).apply(c);
  try {
    make_activation_plan(applied);
  } catch (const c10::Error& e) {
    const std::string why = e.msg();
    TORCH_CHECK(false, "actmem compare: strategy '", name,
                "' cannot run: ", why.substr(0, why.find('\n')));
  }
  return applied;
}

// Timing follows Note [Honest step ratios] in step_rounds.h: --warmup untimed rounds, then
// rotated rounds, each ratio against the plain step of its round.
// The strategies run: those given, the default set fitted to the model (block recompute of at
// most its layers; MoE and MLA modules where it has them), and plain first if not named.
std::vector<std::string> strategy_names(const CompareOptions& o) {
  std::vector<std::string> names = o.strategies;
  if (o.strategies == CompareOptions().strategies && o.train.model.num_layers < 2) {
    // The default set's block recompute of two layers needs two: a one-layer model gets one.
    std::replace(names.begin(), names.end(), std::string("full-block-2"),
                 std::string("full-block-1"));
  }
  if (o.strategies == CompareOptions().strategies && o.train.model.is_moe()) {
    // An MoE model's default set recomputes its MoE layers where a dense one recomputes its MLPs
    // (mlp applies to dense layers only), and adds the experts' activation alone.
    const std::vector<bool> moe = o.train.model.moe_layers();
    const bool all_moe = std::find(moe.begin(), moe.end(), false) == moe.end();
    std::replace(names.begin(), names.end(), std::string("selective-core_attn+mlp+layernorm"),
                 std::string(all_moe ? "selective-core_attn+moe+layernorm"
                                     : "selective-core_attn+mlp+moe+layernorm"));
    if (o.train.model.moe_grouped_gemm) names.push_back("selective-moe_act");
  }
  if (o.strategies == CompareOptions().strategies && o.train.model.multi_latent_attention) {
    // MLA's own module: the up-projections alone and with core attention (mla.md).
    names.push_back("selective-mla_up_proj");
    names.push_back("selective-core_attn+mla_up_proj");
  }
  if (std::find(names.begin(), names.end(), "plain") == names.end()) {
    names.insert(names.begin(), "plain");  // the reference every ratio and equality refers to
  }
  return names;
}

// Every strategy's trainer, run in shuffled rounds (run_shuffled_rounds): per strategy the
// timed step times and their ratios to plain, the last step's statistics, and whether every
// step's loss and gradients equalled plain's bitwise.
struct CompareRuns {
  std::vector<std::vector<double>> times, ratios;
  std::vector<IterationStats> last;
  std::vector<bool> equal;
  std::vector<TimelineSeries> series;
  size_t ref = 0;
};

CompareRuns run_strategies(const CompareOptions& o, const std::vector<std::string>& names) {
  std::vector<TransformerConfig> configs;
  for (const auto& n : names) configs.push_back(apply_strategy(o.train.model, n));
  TrainingConfig t = o.train.training;
  t.eval_interval = 0;
  t.train_iters = o.warmup + o.iters;
  std::vector<std::unique_ptr<Trainer>> trainers;
  for (const auto& c : configs) trainers.push_back(std::make_unique<Trainer>(c, t));
  for (auto& tr : trainers) tr->record_timeline(true);
  const size_t ref =
      static_cast<size_t>(std::find(names.begin(), names.end(), "plain") - names.begin());

  const size_t n = names.size();
  const int rounds = o.warmup + o.iters;
  std::vector<std::vector<double>> times(n), ratios(n);
  std::vector<IterationStats> last(n);
  std::vector<bool> equal(n, true);
  std::vector<Trainer*> order;
  for (auto& tr : trainers) order.push_back(tr.get());
  run_shuffled_rounds(order, rounds, /*compute_digest=*/true,
                      [&](int round, const std::vector<IterationStats>& st) {
                        last = st;
                        for (size_t i = 0; i < n; ++i) {
                          equal[i] = equal[i] && st[i].loss == st[ref].loss &&
                                     st[i].grad_digest == st[ref].grad_digest;
                          if (round >= o.warmup) {
                            times[i].push_back(st[i].step_time_s);
                            ratios[i].push_back(st[i].step_time_s / st[ref].step_time_s);
                          }
                        }
                        std::cerr << "\rcompare: round " << round + 1 << "/" << rounds << " of "
                                  << n << " strategies"
                                  << (round < o.warmup ? " (warm-up, not timed)" : "")
                                  << "            " << std::flush;
                      });
  std::cerr << "\n";
  std::vector<TimelineSeries> series(n);
  for (size_t i = 0; i < n; ++i) {
    series[i] = {names[i], trainers[i]->last_timeline().entries(), last[i].activation_peak_bytes};
  }
  return {times, ratios, last, equal, series, ref};
}

nlohmann::json print_table(const CompareOptions& o, const std::vector<std::string>& names,
                           const CompareRuns& r) {
  const auto& [times, ratios, last, equal, series, ref] = r;
  const size_t n = names.size();
  const auto& m = o.train.model;
  std::cout << "actmem compare: " << m.num_layers << " layers, hidden " << m.hidden_size << ", "
            << m.num_attention_heads << " heads, seq " << m.seq_length << ", micro-batch "
            << m.micro_batch_size << ", dropout " << m.attention_dropout << "/" << m.hidden_dropout
            << (m.bf16 || m.fp16 ? std::string(", ") + m.precision() : std::string()) << "; "
            << o.warmup << " warm-up + " << o.iters << " timed steps each, same seed, "
            << at::get_num_threads() << " threads\n"
            << runtime_summary() << "\n"
            << blas_report().summary() << "\n\n"
            << std::left << std::setw(36) << "strategy" << std::right << std::setw(13)
            << "activations" << std::setw(13) << "predicted" << std::setw(9) << "error"
            << std::setw(13) << "act. peak" << std::setw(12) << "step ratio" << std::setw(15)
            << "range" << std::setw(15) << "bitwise equal\n";
  nlohmann::json out = {{"warmup_steps", o.warmup},
                        {"timed_steps", o.iters},
                        {"threads", at::get_num_threads()},
                        {"runtime", runtime_info()},
                        {"strategies", nlohmann::json::array()}};
  for (size_t i = 0; i < n; ++i) {
    const auto& st = last[i];
    const double err = st.activation_bytes > 0
                           ? 100.0 * (st.predicted_activation_bytes - st.activation_bytes) /
                                 static_cast<double>(st.activation_bytes)
                           : 0.0;
    const double ratio = median(ratios[i]);
    const auto [lo, hi] = std::minmax_element(ratios[i].begin(), ratios[i].end());
    std::ostringstream range;
    range << std::fixed << std::setprecision(3) << *lo << "-" << *hi;
    std::cout << std::left << std::setw(36) << names[i] << std::right << std::setw(13)
              << format_bytes(st.activation_bytes) << std::setw(13)
              << format_bytes(st.predicted_activation_bytes) << std::setw(8) << std::fixed
              << std::setprecision(2) << err << "%" << std::setw(13)
              << format_bytes(st.activation_peak_bytes) << std::setw(12) << std::setprecision(3)
              << ratio << std::setw(15) << range.str() << std::setw(14) << (equal[i] ? "yes" : "NO")
              << "\n";
    out["strategies"].push_back({{"name", names[i]},
                                 {"activation_bytes", st.activation_bytes},
                                 {"predicted_activation_bytes", st.predicted_activation_bytes},
                                 {"activation_peak_bytes", st.activation_peak_bytes},
                                 {"peak_device_bytes", st.peak_device_bytes},
                                 {"step_time_s", median(times[i])},
                                 {"step_times_s", times[i]},
                                 {"step_time_ratio", ratio},
                                 {"step_time_ratio_min", *lo},
                                 {"step_time_ratio_max", *hi},
                                 {"bitwise_equal_to_plain", static_cast<bool>(equal[i])}});
  }
  return out;
}

// Note [Honest step ratios]: say when the numbers above cannot carry their digits.
std::vector<std::string> ratio_warnings(const CompareOptions& o,
                                        const std::vector<double>& plain_times) {
  const double plain_median = median(plain_times);
  const auto [plain_lo, plain_hi] = std::minmax_element(plain_times.begin(), plain_times.end());
  const double plain_spread = (*plain_hi - *plain_lo) / plain_median;
  std::vector<std::string> warnings;
  if (o.iters < kMinTrustedSteps) {
    warnings.push_back(std::to_string(o.iters) +
                       " timed step(s) per strategy are too few to trust "
                       "the step ratios; use --iters " +
                       std::to_string(kMinTrustedSteps) + " or more");
  }
  if (plain_spread > kMaxTrustedSpread) {
    std::ostringstream w;
    w << "the plain step took " << std::fixed << std::setprecision(1) << *plain_lo * 1e3 << " to "
      << *plain_hi * 1e3 << " ms across rounds (" << std::setprecision(0) << 100 * plain_spread
      << "% of its median): the machine is busy or the steps are too short; the ratios are "
         "noisy (more --iters, or a larger model)";
    warnings.push_back(w.str());
  }
  return warnings;
}

int run(CompareOptions& o) {
  o.train.finalize();
  apply_thread_count(o.train.threads);
  TORCH_CHECK(o.iters > 0, "actmem compare: --iters must be positive, got ", o.iters);
  TORCH_CHECK(o.warmup >= 0, "actmem compare: --warmup must be >= 0, got ", o.warmup);
  TORCH_CHECK(!o.strategies.empty(), "actmem compare: --strategies needs at least one strategy");
  check_distinct_files({{"--data", o.train.training.data_path}},
                       {{"--svg", o.svg}, {"--json", o.json}});
  // Opened before any work (an unwritable path fails now, not after the work).
  OutputFile svg_file, json_file;
  if (!o.svg.empty()) svg_file = OutputFile({"--svg", o.svg});
  if (!o.json.empty()) json_file = OutputFile({"--json", o.json});
  const std::vector<std::string> names = strategy_names(o);
  const CompareRuns runs = run_strategies(o, names);
  nlohmann::json out = print_table(o, names, runs);
  const std::vector<std::string> warnings = ratio_warnings(o, runs.times[runs.ref]);
  out["warnings"] = warnings;
  for (const auto& w : warnings) std::cout << "\nwarning: " << w << "\n";
  if (svg_file.is_open()) {
    svg_file.write(memory_timeline_svg(runs.series, "Device memory through one training step"),
                   "the plot");
    svg_file.close();
    std::cout << "\nmemory timeline: " << o.svg << "\n";
  }
  if (json_file.is_open()) {
    json_file.write(out.dump(2) + "\n", "the table");
    json_file.close();
  }
  const bool all_equal =
      std::all_of(runs.equal.begin(), runs.equal.end(), [](bool b) { return b; });
  if (!all_equal) std::cout << "\nWARNING: some strategies are not bitwise equal to plain\n";
  return all_equal ? 0 : 3;
}

}  // namespace

void set_demo_model(TransformerConfig& model) {
  model.num_layers = 4;
  model.hidden_size = 128;
  model.seq_length = 256;
  model.micro_batch_size = 4;
}

Runner add_compare_command(CLI::App& app) {
  auto o = std::make_shared<CompareOptions>();
  set_demo_model(o->train.model);
  CLI::App* cmd = app.add_subcommand("compare", "Compare recompute strategies on one model");
  // Only what compare uses: the strategies set recompute, so its flags are not accepted here.
  add_flags(*cmd, o->train, kShapeFlags | kMoEFlags | kOptimizerFlags | kDataFlags | kRuntimeFlags);
  cmd->add_option("--strategies", o->strategies,
                  "Each of parts joined by ',': plain, selective, selective-MOD[+MOD...] (MOD: " +
                      recompute_module_list(", ") +
                      "), full-uniform-N, full-block-N, "
                      "offload-GROUP[+GROUP...] (GROUP: " +
                      offload_module_list(", ") + "), layer-offload-K")
      ->capture_default_str()
      ->expected(1, -1);
  cmd->add_option("--iters", o->iters, "timed steps per strategy (after the warm-up)")
      ->capture_default_str()
      ->check(integer_in_range(1, 1 << 20));
  cmd->add_option("--warmup", o->warmup, "untimed steps per strategy first")
      ->capture_default_str()
      ->check(integer_in_range(0, 1 << 20));
  cmd->add_option("--svg", o->svg, "memory-timeline plot to write ('' = none)")
      ->capture_default_str();
  cmd->add_option("--json", o->json, "also write the table as JSON");
  return [o, cmd]() { return cmd->parsed() ? run(*o) : -1; };
}

}  // namespace actmem::cli
