// plan_cmd.cpp — `actmem plan`: profile the model on this machine, predict every legal activation
// strategy's device peak and step time, print the Pareto front and the fastest strategy that fits
// --memory-budget as Megatron flags; --verify runs it and its neighbours on the front
// (docs/planner.md).
#include "actmem/environment.h"
#include "actmem/output_file.h"
#include "actmem/planner.h"
#include "actmem/plot.h"
#include "actmem/report.h"
#include "actmem/train_options.h"
#include "actmem/trainer.h"
#include "commands.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <ATen/Parallel.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <iomanip>
#include <iostream>
#include <memory>
#include <sstream>

namespace actmem::cli {

namespace {

struct PlanOptions {
  TrainOptions train;
  std::string budget;  // "" = print the front only
  int profile_steps = 5;
  bool verify = false;
  int verify_steps = 5;
  std::string json;
  std::string svg;
  std::string costs;  // the cost cache (Note [Planner cost cache]); "" = none
};

// Megatron's usual settings, marked on the plot and run beside the chosen plan by --verify: no
// recompute, selective core_attn (Megatron's default module), full uniform 1, full block 1 and
// full block of half the layers.
bool standard_setting(const Strategy& s, int64_t num_layers) {
  if (s.plain()) return true;
  if (!s.offload_modules.empty() || s.offload_layers > 0) return false;
  if (s.recompute_modules == std::vector<std::string>{"core_attn"}) return true;
  if (s.full_method == "uniform") return s.full_layers == 1;
  if (s.full_method == "block") return s.full_layers == 1 || s.full_layers == std::max<int64_t>(1, num_layers / 2);
  return false;
}

std::string percent(double fraction) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(1) << 100.0 * fraction << "%";
  return os.str();
}

// The offload settings the plan was measured with, when they are not train's defaults.
std::string offload_extra_flags(const TransformerConfig& base) {
  const TransformerConfig defaults;
  std::string out;
  if (base.min_offloaded_tensor_size != defaults.min_offloaded_tensor_size) {
    out += " --min-offloaded-tensor-size " + std::to_string(base.min_offloaded_tensor_size);
  }
  if (base.fine_grained_offloading_max_inflight_offloads !=
      defaults.fine_grained_offloading_max_inflight_offloads) {
    out += " --fine-grained-offloading-max-inflight-offloads " +
           std::to_string(base.fine_grained_offloading_max_inflight_offloads);
  }
  return out;
}

// Note [Plan verification]
// The chosen strategy, its neighbours on the front and the plain run train from the same seed.
// Memory: each alone in the process for two steps (the tracker counts the whole process), the
// second step's peak. Time and exactness: all of them in interleaved rounds (Note [Honest step
// ratios] in compare_cmd.cpp), every round's loss and gradient digest compared with the plain
// run's bitwise.
struct Verified {
  PlanEstimate estimate;
  int64_t peak = 0;
  double ratio = 0;
  bool bitwise = true;
};

std::vector<Verified> verify(const TransformerConfig& base, const TrainingConfig& training,
                             const std::vector<PlanEstimate>& runs, int steps) {
  std::vector<Verified> out;
  TrainingConfig t = training;
  t.eval_interval = 0;
  for (const auto& e : runs) {
    std::cerr << "\rplan: verifying the peak of " << e.strategy.name() << "            "
              << std::flush;
    t.train_iters = 2;
    Trainer solo(e.strategy.apply(base), t);
    solo.train_step(false);
    out.push_back({e, solo.train_step(false).peak_device_bytes, 0.0, true});
  }
  t.train_iters = 1 + steps;
  std::vector<std::unique_ptr<Trainer>> trainers;
  for (const auto& e : runs) trainers.push_back(std::make_unique<Trainer>(e.strategy.apply(base), t));
  const size_t n = runs.size();
  std::vector<std::vector<double>> ratios(n);
  for (int round = 0; round <= steps; ++round) {
    std::cerr << "\rplan: verifying step times and exactness, round " << round + 1 << "/"
              << steps + 1 << "            " << std::flush;
    std::vector<IterationStats> st(n);
    for (size_t k = 0; k < n; ++k) {
      const size_t i = (k + static_cast<size_t>(round)) % n;
      st[i] = trainers[i]->train_step(true);
    }
    for (size_t i = 0; i < n; ++i) {  // runs[0] is plain
      out[i].bitwise = out[i].bitwise && st[i].loss == st[0].loss &&
                       st[i].grad_digest == st[0].grad_digest;
      if (round > 0) ratios[i].push_back(st[i].step_time_s / st[0].step_time_s);
    }
  }
  std::cerr << "\n";
  for (size_t i = 0; i < n; ++i) out[i].ratio = median(ratios[i]);
  return out;
}

int run(PlanOptions& o) {
  o.train.finalize();
  apply_thread_count(o.train.threads);
  const TransformerConfig& base = o.train.model;
  const int64_t budget = o.budget.empty() ? -1 : parse_memory_budget(o.budget);
  check_distinct_files({{"--data", o.train.training.data_path}},
                       {{"--svg", o.svg}, {"--json", o.json}, {"--costs", o.costs}});
  OutputFile json_file, svg_file;  // opened before the work: an unwritable path fails now
  if (!o.json.empty()) json_file = OutputFile({"--json", o.json});
  if (!o.svg.empty()) svg_file = OutputFile({"--svg", o.svg});
  const std::vector<Strategy> strategies = legal_strategies(base);
  const nlohmann::json key = plan_costs_key(base, o.train.training);
  std::optional<PlanCosts> cached;
  std::string cache_note;
  if (!o.costs.empty() && std::filesystem::exists(o.costs)) {
    nlohmann::json record;
    try {
      record = nlohmann::json::parse(std::ifstream(o.costs));
    } catch (const nlohmann::json::exception& e) {
      TORCH_CHECK(false, "actmem plan: --costs ", o.costs, " is not a cost record (", e.what(),
                  "); remove it to profile again");
    }
    TORCH_CHECK(record.is_object() && record.contains("key") && record.contains("costs"),
                "actmem plan: --costs ", o.costs, " is not a cost record (no key and costs); "
                "remove it to profile again");
    if (record["key"] == key) {
      cached = PlanCosts::from_json(record["costs"]);
      cache_note = "costs reused from " + o.costs;
    } else {
      cache_note = "costs profiled again: " + o.costs + " was measured for another model, "
                   "device, thread count or library";
    }
  }
  const PlanCosts costs =
      cached ? *cached
             : profile_costs(base, o.train.training, o.profile_steps, [](const std::string& line) {
                 std::cerr << "\rplan: " << line << "            " << std::flush;
               });
  if (!cached) std::cerr << "\n";
  if (!cached && !o.costs.empty()) {
    OutputFile cache({"--costs", o.costs});
    cache.write(nlohmann::json{{"key", key}, {"costs", costs.to_json()}}.dump(1) + "\n",
                "the costs");
    cache.close();
    if (cache_note.empty()) cache_note = "costs written to " + o.costs;
  }
  const std::vector<PlanEstimate> estimates = estimate_plans(base, strategies, costs);
  const std::vector<PlanEstimate> front = pareto_front(estimates);

  std::cout << "actmem plan: " << base.num_layers << " layers, hidden " << base.hidden_size << ", "
            << base.num_attention_heads << " heads, seq " << base.seq_length << ", micro-batch "
            << base.micro_batch_size << ", " << base.precision() << (base.is_moe() ? ", MoE" : "")
            << "; " << strategies.size() << " legal strategies; profiled here with "
            << costs.threads << " threads, " << costs.steps << " timed rounds"
            << (cache_note.empty() ? "" : " (" + cache_note + ")") << "\n\n"
            << "measured: plain step " << std::fixed << std::setprecision(1)
            << costs.plain_step_s * 1e3 << " ms; parameters, gradients and optimizer state "
            << format_bytes(static_cast<double>(costs.static_bytes))
            << "; optimizer-step peak " << format_bytes(static_cast<double>(costs.optimizer_peak_bytes))
            << "\nextra step time of each mechanism alone:";
  for (const auto& [name, extra] : costs.extra) std::cout << "  " << name << " +" << percent(extra);
  std::cout << "\n\nPareto front (predicted device peak against step time):\n"
            << std::right << std::setw(14) << "peak" << std::setw(12) << "step ratio" << "  "
            << std::left << "strategy\n";
  const PlanEstimate* chosen = budget > 0 ? &choose_plan(front, budget) : nullptr;
  for (const auto& e : front) {
    std::cout << std::right << std::setw(14) << format_bytes(static_cast<double>(e.peak_bytes))
              << std::setw(12) << std::setprecision(3) << e.step_ratio << "  " << std::left
              << e.strategy.name() << (chosen == &e ? "   <- chosen" : "") << "\n";
  }
  nlohmann::json out = {{"model", to_json(base)}, {"legal_strategies", strategies.size()},
                        {"costs", costs.to_json()}, {"front", nlohmann::json::array()},
                        {"runtime", runtime_info()}};
  for (const auto& e : front) out["front"].push_back(e.to_json());
  if (chosen) {
    out["memory_budget_bytes"] = budget;
    out["chosen"] = chosen->to_json();
    std::cout << "\nmemory budget " << format_bytes(static_cast<double>(budget)) << ": "
              << chosen->strategy.name() << ", predicted peak "
              << format_bytes(static_cast<double>(chosen->peak_bytes)) << ", step ratio "
              << std::setprecision(3) << chosen->step_ratio << "\n  flags: "
              << (chosen->strategy.plain() ? "(none: keep every activation)" : chosen->strategy.flags())
              << (chosen->strategy.offload_modules.empty() && chosen->strategy.offload_layers == 0
                      ? ""
                      : offload_extra_flags(base))
              << "\n";
  }
  int rc = 0;
  if (o.verify) {
    TORCH_CHECK(chosen != nullptr, "actmem plan: --verify needs --memory-budget");
    // The plain run first (the reference), then the chosen plan and its front neighbours.
    std::vector<PlanEstimate> runs;
    const auto plain = std::find_if(estimates.begin(), estimates.end(),
                                    [](const PlanEstimate& e) { return e.strategy.plain(); });
    runs.push_back(*plain);
    const size_t at = static_cast<size_t>(chosen - front.data());
    for (size_t i = at == 0 ? 0 : at - 1; i <= std::min(at + 1, front.size() - 1); ++i) {
      if (!front[i].strategy.plain()) runs.push_back(front[i]);
    }
    // And the standard settings predicted to fit: what the plan is measured against.
    for (const auto& e : estimates) {
      const bool listed = std::any_of(runs.begin(), runs.end(), [&e](const PlanEstimate& r) {
        return r.strategy == e.strategy;
      });
      if (!listed && e.peak_bytes <= budget && standard_setting(e.strategy, base.num_layers)) {
        runs.push_back(e);
      }
    }
    const std::vector<Verified> v = verify(base, o.train.training, runs, o.verify_steps);
    std::cout << "\nverified (" << o.verify_steps << " timed rounds after one warm-up, same seed):\n"
              << std::left << std::setw(58) << "strategy" << std::right << std::setw(13)
              << "peak" << std::setw(13) << "predicted" << std::setw(9) << "error"
              << std::setw(8) << "ratio" << std::setw(11) << "predicted" << std::setw(9)
              << "error" << std::setw(10) << "fits" << std::setw(9) << "bitwise\n";
    out["verified"] = nlohmann::json::array();
    for (const auto& r : v) {
      const double peak_err = static_cast<double>(r.estimate.peak_bytes - r.peak) /
                              static_cast<double>(r.peak);
      const double ratio_err = (r.estimate.step_ratio - r.ratio) / r.ratio;
      const bool fits = r.peak <= budget;
      std::cout << std::left << std::setw(58) << r.estimate.strategy.name() << std::right
                << std::setw(13) << format_bytes(static_cast<double>(r.peak)) << std::setw(13)
                << format_bytes(static_cast<double>(r.estimate.peak_bytes)) << std::setw(9)
                << percent(peak_err) << std::setw(8) << std::setprecision(3) << r.ratio
                << std::setw(11) << r.estimate.step_ratio << std::setw(9) << percent(ratio_err)
                << std::setw(10) << (fits ? "yes" : "no") << std::setw(8)
                << (r.bitwise ? "yes" : "NO") << "\n";
      out["verified"].push_back({{"strategy", r.estimate.strategy.name()},
                                 {"measured_peak_bytes", r.peak},
                                 {"predicted_peak_bytes", r.estimate.peak_bytes},
                                 {"measured_step_ratio", r.ratio},
                                 {"predicted_step_ratio", r.estimate.step_ratio},
                                 {"fits_budget", fits},
                                 {"bitwise_equal_to_plain", r.bitwise}});
      if (!r.bitwise) rc = 3;
    }
    if (rc) std::cout << "\nWARNING: some strategies are not bitwise equal to plain\n";
  }
  if (svg_file.is_open()) {
    std::vector<PlanPoint> points;
    for (const auto& e : estimates) {
      const bool on_front = std::any_of(front.begin(), front.end(), [&e](const PlanEstimate& f) {
        return f.strategy == e.strategy;
      });
      points.push_back({e.strategy.name(), static_cast<double>(e.peak_bytes), e.step_ratio,
                        on_front, standard_setting(e.strategy, base.num_layers),
                        chosen != nullptr && chosen->strategy == e.strategy});
    }
    std::ostringstream title;
    title << "Activation strategies of a " << base.num_layers << "-layer h " << base.hidden_size
          << " model: predicted device peak and step time";
    svg_file.write(plan_front_svg(points, static_cast<double>(budget), title.str()), "the plot");
    svg_file.close();
    std::cout << "\nfront plot: " << o.svg << "\n";
  }
  if (json_file.is_open()) {
    json_file.write(out.dump(2) + "\n", "the plan");
    json_file.close();
  }
  return rc;
}

}  // namespace

Runner add_plan_command(CLI::App& app) {
  auto o = std::make_shared<PlanOptions>();
  set_demo_model(o->train.model);  // compare's
  CLI::App* cmd = app.add_subcommand(
      "plan", "Find the fastest activation strategy that fits a device-memory budget");
  // The strategies are the planner's: the recompute and offload flags are not accepted here.
  add_flags(*cmd, o->train, kShapeFlags | kMoEFlags | kOptimizerFlags | kDataFlags | kRuntimeFlags);
  cmd->add_option("--min-offloaded-tensor-size", o->train.model.min_offloaded_tensor_size,
                  "offload keeps saved tensors of fewer elements on the device (as train)")
      ->capture_default_str()->check(integer_in_range(0, int64_t{1} << 62));
  cmd->add_option("--fine-grained-offloading-max-inflight-offloads",
                  o->train.model.fine_grained_offloading_max_inflight_offloads,
                  "offload copies of one group name in flight before compute waits (-1: no cap; "
                  "as train)")
      ->capture_default_str()->check(integer_in_range(-1, 1 << 20));
  cmd->add_option("--memory-budget", o->budget,
                  "device bytes a step may hold: bytes or with a unit (8GiB, 7.5G, 900MiB)");
  cmd->add_option("--profile-steps", o->profile_steps, "timed rounds of the profiling run")
      ->capture_default_str()->check(integer_in_range(1, 1000));
  cmd->add_flag("--verify", o->verify,
                "run the chosen strategy, its front neighbours and the plain run, and compare");
  cmd->add_option("--verify-steps", o->verify_steps, "timed rounds of --verify")
      ->capture_default_str()->check(integer_in_range(1, 1000));
  cmd->add_option("--json", o->json, "also write the front, the costs and the choice as JSON");
  cmd->add_option("--svg", o->svg, "plot every strategy and the front (peak against step time)");
  cmd->add_option("--costs", o->costs,
                  "keep the measured costs in this file and reuse them while the model, device, "
                  "threads and libraries are the same");
  return [o, cmd]() { return cmd->parsed() ? run(*o) : -1; };
}

}  // namespace actmem::cli
