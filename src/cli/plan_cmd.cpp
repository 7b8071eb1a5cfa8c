// plan_cmd.cpp — `actmem plan`: profile the model on this machine, predict every legal activation
// strategy's device peak and step time, print the Pareto front and the fastest strategy that fits
// --memory-budget as Megatron flags; --verify runs it and its neighbours on the front
// (docs/planner.md).
#include "actmem/base/environment.h"
#include "actmem/base/output_file.h"
#include "actmem/base/report.h"
#include "actmem/flags/presets.h"
#include "actmem/flags/train_options.h"
#include "actmem/model/layer_spec.h"
#include "actmem/plan/plan_analytic.h"
#include "actmem/plan/planner.h"
#include "actmem/train/plot.h"
#include "actmem/train/step_rounds.h"
#include "actmem/train/trainer.h"
#include "commands.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <ATen/Parallel.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <optional>
#include <set>
#include <sstream>

namespace actmem::cli {

namespace {

struct PlanOptions {
  TrainOptions train;
  std::string budget;     // "" = print the front only
  int profile_steps = 5;  // the fewest; then until profile_precision (Note [Rounds until sure])
  double profile_precision = kDefaultProfilePrecision * 100;  // percent; 0: profile_steps exactly
  bool verify = false;
  int verify_steps = 10;
  std::string json;
  std::string svg;
  std::string costs;  // the cost cache (Note [Planner cost cache]); "" = none
  double costs_speed_tolerance = kCostSpeedTolerance * 100;  // percent (Note [Machine speed check])
  int finalists = kDefaultFinalists;  // Note [Plan finalists]; 0: the model's choice
  int finalist_steps = kDefaultFinalistSteps;
  // Note [Rounds until sure] in planner.cpp: the standard error wanted of the confirmed and the
  // verified ratio (percent; 0: the minimum rounds only) and the most rounds spent on it.
  double ratio_precision = kDefaultRatioPrecision * 100;
  int max_timed_rounds = kDefaultMaxTimedRounds;
  // A paper preset planned analytically (Note [Analytic plan] in plan_analytic.h).
  std::string preset;
  std::string gpu = "h100";
  DescribedLayout layout;  // with --preset: d, the micro-batches, the expert tensor size
};

// Megatron's usual settings, marked on the plot and run beside the chosen plan by --verify: no
// recompute, selective core_attn (Megatron's default module), full uniform 1, full block 1 and
// full block of half the layers.
bool standard_setting(const Strategy& s, int64_t num_layers) {
  if (s.plain()) return true;
  if (!s.offload_modules.empty() || s.offload_layers > 0) return false;
  if (s.recompute_modules == std::vector<RecomputeModule>{RecomputeModule::kCoreAttn}) return true;
  if (s.full_method == RecomputeMethod::kUniform) return s.full_layers == 1;
  if (s.full_method == RecomputeMethod::kBlock)
    return s.full_layers == 1 || s.full_layers == std::max<int64_t>(1, num_layers / 2);
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

// A predicted ratio, with its spread when it was measured (Note [Planner uncertainty]).
std::string ratio_text(const PlanEstimate& e) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(3) << e.step_ratio;
  if (e.step_ratio_spread > 0) os << " ±" << e.step_ratio_spread;
  return os.str();
}

// What the planner states for a choice: its confirmation (Note [Confirming the choice] in
// planner.cpp), else its finalist measurement, else the prediction.
std::string planned_ratio_text(const PlanEstimate& e) {
  if (e.finalist_ratio <= 0) return ratio_text(e);
  std::ostringstream os;
  os << std::fixed << std::setprecision(3);
  if (e.confirmed_ratio > 0) {
    os << e.confirmed_ratio << " measured (standard error " << e.confirmed_ratio_error << ", "
       << e.confirmed_rounds << " rounds against the plain step; predicted " << ratio_text(e)
       << ")";
  } else {
    os << e.finalist_ratio << " ±" << e.finalist_ratio_spread << " measured (predicted "
       << ratio_text(e) << ")";
  }
  return os.str();
}

// The front as a table, the chosen entry marked.
void print_front(const std::vector<PlanEstimate>& front, const PlanEstimate* chosen) {
  std::cout << "\nPareto front (predicted device peak against step time):\n"
            << std::right << std::setw(14) << "peak" << std::setw(16) << "step ratio"
            << "  " << std::left << "strategy\n";
  for (const auto& e : front) {
    std::cout << std::right << std::setw(14) << format_bytes(static_cast<double>(e.peak_bytes))
              << std::setw(16) << ratio_text(e) << "  " << std::left << e.strategy.name()
              << (chosen != nullptr && chosen->strategy == e.strategy ? "   <- chosen" : "")
              << "\n";
  }
}

// The choice and its flags, ready to paste. `budget_note` says where the budget came from.
void print_choice(const PlanEstimate& chosen, int64_t budget, const std::string& budget_note,
                  const std::string& offload_flags) {
  std::cout << "\nmemory budget " << format_bytes(static_cast<double>(budget)) << budget_note
            << ": " << chosen.strategy.name() << ", predicted peak "
            << format_bytes(static_cast<double>(chosen.peak_bytes)) << ", step ratio "
            << planned_ratio_text(chosen) << "\n  flags: "
            << (chosen.strategy.plain() ? "(none: keep every activation)" : chosen.strategy.flags())
            << (chosen.strategy.offload_modules.empty() && chosen.strategy.offload_layers == 0
                    ? ""
                    : offload_flags)
            << "\n";
}

// Every strategy as a dot, the front, the standard settings, the budget and the choice.
void write_front_svg(OutputFile& file, const std::string& path,
                     const std::vector<PlanEstimate>& estimates,
                     const std::vector<PlanEstimate>& front, const PlanEstimate* chosen,
                     int64_t budget, int64_t num_layers, const std::string& title) {
  std::vector<PlanPoint> points;
  for (const auto& e : estimates) {
    const bool on_front = std::any_of(front.begin(), front.end(), [&e](const PlanEstimate& f) {
      return f.strategy == e.strategy;
    });
    points.push_back({e.strategy.name(), static_cast<double>(e.peak_bytes), e.step_ratio, on_front,
                      standard_setting(e.strategy, num_layers),
                      chosen != nullptr && chosen->strategy == e.strategy});
  }
  file.write(plan_front_svg(points, static_cast<double>(budget), title), "the plot");
  file.close();
  std::cout << "\nfront plot: " << path << "\n";
}

// Note [Plan verification]
// The chosen strategy, the finalists it was chosen against (Note [Plan finalists] in
// planner.cpp; without them, its neighbours on the front), Megatron's standard settings that fit
// and the plain run train from the same seed. Memory: each alone in the process for two steps
// (the tracker counts the whole process), the second step's peak. Time and exactness: all of
// them in interleaved rounds of their own (measure_step_ratios(), Note [Honest step ratios] in
// step_rounds.h), every round's loss and gradient digest compared with the plain run's bitwise.
// The measured ratio is set against the prediction and, for a finalist, what the planner stated
// for it (the choice's confirmation, the others' finalist measurements), each taken in rounds of
// its own.
struct Verification {
  std::vector<int64_t> peak;  // per run: its measured device peak
  MeasuredRatios time;        // per run: step ratio, its standard error, step times, bitwise
};

Verification verify(const TransformerConfig& base, const TrainingConfig& training,
                    const std::vector<PlanEstimate>& runs, const TimedRounds& rounds) {
  Verification out;
  TrainingConfig t = training;
  t.eval_interval = 0;
  t.set_measurement_steps(2);
  for (const auto& e : runs) {
    std::cerr << "\rplan: verifying the peak of " << e.strategy.name() << "            "
              << std::flush;
    Trainer solo(e.strategy.apply(base), t);
    solo.train_step(false);
    out.peak.push_back(solo.train_step(false).peak_device_bytes);
  }
  std::vector<Strategy> strategies;
  for (const auto& e : runs) strategies.push_back(e.strategy);  // runs[0] is plain
  out.time = measure_step_ratios(base, training, strategies, rounds, [](const std::string& line) {
    std::cerr << "\rplan: verifying step times and exactness, " << line << "            "
              << std::flush;
  });
  std::cerr << "\n";
  return out;
}

// Note [Plan a preset under each kernel]
// The seed's §4.3 question, answered for a preset: what selective core_attn recompute buys under
// each attention kernel, and what each kernel's fastest plan under the budget is. The unfused
// kernel keeps the 5as^2b/t scores that core_attn recompute removes; flash keeps a 4asb/t
// logsumexp, so the same recompute frees almost nothing and costs the two s^2 GEMMs again. Step
// times are absolute (ms per micro-batch of the roofline) since each kernel has its own plain
// step. The plan above uses the kernel the flags choose (auto: flash where it can run); flash
// cannot drop attention probabilities, so with attention dropout its row is what
// --attention-dropout 0 would give.
nlohmann::json print_kernels(const PaperShape& shape, const TransformerConfig& config,
                             const DeviceSpec& gpu, int64_t budget) {
  std::cout << "\nunder each attention kernel (Note [Plan a preset under each kernel]):\n"
            << std::left << std::setw(10) << "kernel" << std::right << std::setw(14) << "plain peak"
            << std::setw(12) << "plain ms" << std::setw(16) << "core_attn peak" << std::setw(16)
            << "core_attn ms" << std::setw(13) << "freed"
            << "  " << std::left << "fastest that fits\n";
  nlohmann::json rows = nlohmann::json::array();
  for (const bool flash : {false, true}) {
    PaperShape m = shape;
    m.flash = flash;
    const std::vector<Strategy> strategies = analytic_strategies(m);
    const std::vector<PlanEstimate> all = estimate_plans_analytic(m, strategies, gpu);
    const double plain_ms = analytic_basis(m, gpu).plain_step_s * 1e3;
    const auto named = [&all](const std::string& name) {
      return *std::find_if(all.begin(), all.end(),
                           [&name](const PlanEstimate& e) { return e.strategy.name() == name; });
    };
    const PlanEstimate plain = named("plain"), core = named("selective core_attn");
    const std::vector<PlanEstimate> front = pareto_front(all);
    const PlanEstimate* fits = nullptr;
    for (const auto& e : front) {
      if (e.peak_bytes <= budget) fits = &e;  // the front is sorted by peak: the last fastest
    }
    const bool used = flash == config.flash_attention();
    std::ostringstream name, best;
    name << (flash ? "flash" : "unfused") << (used ? "*" : "");
    if (fits != nullptr) {
      best << fits->strategy.name() << " (" << format_bytes(static_cast<double>(fits->peak_bytes))
           << ", " << std::fixed << std::setprecision(1) << plain_ms * fits->step_ratio << " ms)";
    } else {
      best << "none";
    }
    std::cout << std::left << std::setw(10) << name.str() << std::right << std::setw(14)
              << format_bytes(static_cast<double>(plain.peak_bytes)) << std::setw(12) << std::fixed
              << std::setprecision(1) << plain_ms << std::setw(16)
              << format_bytes(static_cast<double>(core.peak_bytes)) << std::setw(16)
              << plain_ms * core.step_ratio << std::setw(13)
              << format_bytes(static_cast<double>(plain.kept_bytes - core.kept_bytes)) << "  "
              << std::left << best.str() << "\n";
    nlohmann::json row = {{"kernel", flash ? "flash" : "unfused"},
                          {"chosen_by_the_flags", used},
                          {"plain_step_s", plain_ms / 1e3},
                          {"plain", plain.to_json()},
                          {"core_attn", core.to_json()},
                          {"core_attn_freed_bytes", plain.kept_bytes - core.kept_bytes}};
    row["fastest_that_fits"] = fits != nullptr ? fits->to_json() : nlohmann::json(nullptr);
    rows.push_back(std::move(row));
  }
  std::cout << "  * the kernel of these flags ("
            << (config.flash_attention() || config.attention_dropout == 0
                    ? "--attention-backend chooses the other"
                    : "flash needs --attention-dropout 0")
            << ")\n";
  return rows;
}

// The sizes of a preset's parts for its header line (LayerPart::summary; "" for the paper's
// dense model), the MLPs' then the mixers'.
std::string parts_summary(const PaperShape& m) {
  const TransformerConfig c = analytic_config(m);
  std::vector<std::pair<const LayerPart*, int64_t>> parts;
  for (const PartSlot slot : {PartSlot::kMlp, PartSlot::kMixer}) {
    for (const LayerSpec& spec : layer_specs(c)) {
      const LayerPart* part = slot == PartSlot::kMlp ? spec.mlp : spec.mixer;
      auto it =
          std::find_if(parts.begin(), parts.end(), [&](const auto& p) { return p.first == part; });
      if (it == parts.end()) it = parts.insert(parts.end(), {part, 0});
      it->second += 1;
    }
  }
  std::ostringstream out;
  for (const auto& [part, layers] : parts) {
    const std::string s = part->summary(c, layers);
    if (!s.empty()) out << "; " << s;
  }
  if (!paper_describes(c)) out << "; terms from the exact predictor";
  return out.str();
}

// Refuses the flags given that a preset's plan would not use (Note [Plan a preset]).
void check_preset_plan_flags(const CLI::App& cmd) {
  std::set<std::string> allowed = {"--preset",
                                   "--gpu",
                                   "--memory-budget",
                                   "--json",
                                   "--svg",
                                   "--global-batch-size",
                                   "--use-distributed-optimizer"};
  {
    TrainOptions scratch;
    DescribedLayout layout;
    CLI::App described;
    add_flags(described, scratch, kShapeFlags | kParallelFlags | kMoEFlags);
    add_described_layout_flags(described, scratch, layout, /*optimizer_flags_registered=*/false);
    for (const CLI::Option* opt : described.get_options()) allowed.insert(opt->get_name());
  }
  std::vector<std::string> refused;
  for (const CLI::Option* opt : cmd.get_options()) {
    if (opt->count() > 0 && !allowed.count(opt->get_name())) refused.push_back(opt->get_name());
  }
  TORCH_CHECK(refused.empty(), "actmem plan --preset: ", c10::Join(", ", refused),
              " not used: "
              "a preset is planned analytically, nothing runs (it takes the model and layout "
              "flags, --gpu, --data-parallel-size, --memory-budget, --json and --svg)");
}

// Prints the header of a preset's plan: the model and its layout, the GPU and the basis.
void print_preset_plan_header(const PlanOptions& o, const PaperShape& m, const DeviceSpec& gpu,
                              const AnalyticBasis& basis, size_t legal_strategies) {
  const WeightMemory w = analytic_weight_memory(m);
  std::cout << "actmem plan: preset " << o.preset << " (analytic: nothing runs here) — " << m.L
            << " layers, hidden " << m.h << ", " << m.a << " heads, ffn " << m.ffn
            << (m.swiglu ? " (SwiGLU)" : "") << parts_summary(m) << ", seq " << m.s
            << ", micro-batch " << m.b << ", vocab " << m.v << ", " << std::setprecision(4)
            << w.parameters / 1e9 << "B parameters; t " << m.t << (m.sp ? " with SP" : "") << ", p "
            << m.p;
  if (m.vpp) std::cout << " (" << *m.vpp << " virtual stages)";
  std::cout << ", d " << m.d << (m.distributed_optimizer ? " (distributed optimizer)" : "")
            << "; bf16; attention " << o.train.model.attention_summary() << "; " << legal_strategies
            << " legal strategies\n"
            << "GPU " << gpu.name << ": " << gpu.source << "; costed at " << std::setprecision(3)
            << gpu.matmul_flops / 1e12 << " TFLOP/s for GEMMs, " << gpu.memory_bandwidth / 1e12
            << " TB/s for element-wise ops, " << gpu.d2h_bandwidth / 1e9 << "/"
            << gpu.h2d_bandwidth / 1e9 << " GB/s device-to-host/host-to-device\n"
            << "per GPU of the first pipeline stage: " << basis.layers_per_stage
            << " layers, weights, gradients and optimizer state "
            << format_bytes(basis.static_bytes) << ", "
            << "micro-batches in flight " << basis.microbatches_in_flight << ", plain step "
            << std::fixed << std::setprecision(1) << basis.plain_step_s * 1e3
            << " ms per micro-batch (roofline)\n";
}

// The estimates of Megatron's standard settings (standard_setting) among `estimates`.
std::vector<PlanEstimate> preset_standard_settings(const std::vector<PlanEstimate>& estimates,
                                                   int64_t chunk_layers_n) {
  std::vector<PlanEstimate> standard;
  for (const auto& e : estimates) {
    if (standard_setting(e.strategy, chunk_layers_n)) standard.push_back(e);
  }
  return standard;
}

// Prints Megatron's standard settings with their peaks, step ratios and whether they fit.
void print_preset_standard_settings(const std::vector<PlanEstimate>& standard, int64_t budget) {
  std::cout << "\nMegatron's standard settings:\n";
  for (const auto& e : standard) {
    std::cout << std::right << std::setw(14) << format_bytes(static_cast<double>(e.peak_bytes))
              << std::setw(12) << std::setprecision(3) << e.step_ratio << "  " << std::left
              << std::setw(24) << e.strategy.name()
              << (e.peak_bytes <= budget ? "fits" : "does not fit") << "\n";
  }
}

// The "shape" object of a preset's plan in --json.
nlohmann::json preset_shape_json(const PaperShape& m) {
  return {{"s", m.s},
          {"b", m.b},
          {"h", m.h},
          {"a", m.a},
          {"L", m.L},
          {"ffn", m.ffn},
          {"v", m.v},
          {"t", m.t},
          {"p", m.p},
          {"d", m.d},
          {"sequence_parallel", m.sp},
          {"swiglu", m.swiglu}};
}

// Note [Plan a preset]
// `plan --preset NAME` plans a model that cannot run here (Note [Analytic plan] in
// plan_analytic.h): the preset's flags (Note [Presets are command lines] in flags/presets.h),
// changed by the model and layout flags given, planned per GPU of its first pipeline stage on
// --gpu, the budget defaulting to that GPU's memory. Flags that only mean something to a run here
// (data, runtime, the optimizer's settings, profiling, --verify) are refused rather than ignored.
int run_preset(PlanOptions& o, const CLI::App& cmd) {
  check_preset_plan_flags(cmd);
  const PaperShape m = describe_model(o.train, o.layout, "actmem plan --preset");
  const DeviceSpec gpu = device_spec(o.gpu);
  const int64_t budget =
      o.budget.empty() ? static_cast<int64_t>(gpu.memory_bytes) : parse_memory_budget(o.budget);
  check_distinct_files({}, {{"--svg", o.svg}, {"--json", o.json}});
  OutputFile json_file, svg_file;
  if (!o.json.empty()) json_file = OutputFile({"--json", o.json});
  if (!o.svg.empty()) svg_file = OutputFile({"--svg", o.svg});

  const auto start = std::chrono::steady_clock::now();
  const std::vector<Strategy> strategies = analytic_strategies(m);
  const AnalyticBasis basis = analytic_basis(m, gpu);
  const std::vector<PlanEstimate> estimates = estimate_plans_analytic(m, strategies, gpu);
  const std::vector<PlanEstimate> front = pareto_front(estimates);
  const double planning_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  print_preset_plan_header(o, m, gpu, basis, strategies.size());
  const PlanEstimate* chosen = &choose_plan(
      front, budget,
      "more tensor parallelism (--tensor-model-parallel-size; with --sequence-parallel it splits "
      "every activation), more pipeline stages (--pipeline-model-parallel-size), the "
      "distributed optimizer over more data-parallel ranks (--use-distributed-optimizer "
      "--data-parallel-size), a smaller --micro-batch-size, or a GPU with more memory or a "
      "faster host link (--gpu)");
  print_front(front, chosen);
  // Megatron's usual settings beside it: what the common choices would cost on this layout.
  const auto chunk_layers_n = static_cast<int64_t>(m.L / m.p / (m.vpp ? *m.vpp : 1.0));
  const std::vector<PlanEstimate> standard = preset_standard_settings(estimates, chunk_layers_n);
  print_preset_standard_settings(standard, budget);
  print_choice(*chosen, budget, o.budget.empty() ? " (the " + gpu.name + "'s memory)" : "", "");
  const nlohmann::json kernels = print_kernels(m, o.train.model, gpu, budget);
  std::cout << "\nplanned " << estimates.size() << " strategies in " << std::setprecision(3)
            << planning_s << " s\n";
  if (svg_file.is_open()) {
    std::ostringstream title;
    title << "Activation strategies of preset " << o.preset << " (t " << m.t << ", p " << m.p
          << ") on " << gpu.name << ": predicted device peak and step time";
    write_front_svg(svg_file, o.svg, estimates, front, chosen, budget, chunk_layers_n, title.str());
  }
  if (json_file.is_open()) {
    nlohmann::json out = {{"preset", o.preset},
                          {"analytic", true},
                          {"gpu", gpu.to_json()},
                          {"basis", basis.to_json()},
                          {"shape", preset_shape_json(m)},
                          {"legal_strategies", strategies.size()},
                          {"planning_s", planning_s},
                          {"attention", o.train.model.attention_summary()},
                          {"attention_kernels", kernels},
                          {"memory_budget_bytes", budget},
                          {"chosen", chosen->to_json()},
                          {"front", nlohmann::json::array()}};
    for (const auto& e : front) out["front"].push_back(e.to_json());
    out["standard_settings"] = nlohmann::json::array();
    for (const auto& e : standard) out["standard_settings"].push_back(e.to_json());
    out["estimates"] = nlohmann::json::array();  // every legal strategy, as the SVG plots them
    for (const auto& e : estimates) out["estimates"].push_back(e.to_json());
    json_file.write(out.dump(2) + "\n", "the plan");
    json_file.close();
  }
  return 0;
}

void print_measured_header(const TransformerConfig& base, const MeasuredPlan& plan) {
  const PlanCosts& costs = plan.costs;
  std::cout << "actmem plan: " << base.num_layers << " layers, hidden " << base.hidden_size << ", "
            << base.num_attention_heads << " heads, seq " << base.seq_length << ", micro-batch "
            << base.micro_batch_size << ", " << base.precision() << (base.is_moe() ? ", MoE" : "")
            << "; " << plan.strategies.size() << " legal strategies; profiled here with "
            << costs.threads << " threads, " << costs.steps << " timed rounds"
            << (plan.costs_note.empty() ? "" : " (" + plan.costs_note + ")") << "\n\n"
            << "measured: plain step " << std::fixed << std::setprecision(1)
            << costs.plain_step_s * 1e3 << " ms; parameters, gradients and optimizer state "
            << format_bytes(static_cast<double>(costs.static_bytes)) << "; optimizer-step peak "
            << format_bytes(static_cast<double>(costs.optimizer_peak_bytes))
            << "\nextra step time of each mechanism (Note [Planner cost basis]):";
  for (const auto& [mechanism, extra] : costs.extra) {
    std::cout << "  " << mechanism.key() << " " << (extra >= 0 ? "+" : "") << percent(extra) << " ±"
              << percent(costs.spread.count(mechanism) ? costs.spread.at(mechanism) : 0.0);
  }
  std::cout << "\n";
}

// The finalists' table (Note [Plan finalists] in planner.cpp), and their JSON rows.
nlohmann::json print_finalists(const std::vector<PlanEstimate>& finalists,
                               const PlanEstimate* chosen, int rounds) {
  std::cout << "\nfinalists (the " << finalists.size() << " fastest predicted that fit, timed "
            << "side by side with the plain run, " << rounds << " rounds):\n"
            << std::right << std::setw(14) << "peak" << std::setw(16) << "predicted"
            << std::setw(16) << "measured"
            << "  " << std::left << "strategy\n";
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& f : finalists) {
    std::ostringstream measured;
    measured << std::fixed << std::setprecision(3) << f.finalist_ratio << " ±"
             << f.finalist_ratio_spread;
    std::cout << std::right << std::setw(14) << format_bytes(static_cast<double>(f.peak_bytes))
              << std::setw(16) << ratio_text(f) << std::setw(16) << measured.str() << "  "
              << std::left << f.strategy.name() << (&f == chosen ? "   <- chosen" : "") << "\n";
    rows.push_back(f.to_json());
  }
  const PlanEstimate& c = finalists.front();
  if (c.confirmed_ratio > 0) {
    std::cout << std::fixed << std::setprecision(3) << "confirmed (Note [Confirming the choice] "
              << "in planner.cpp): " << c.strategy.name() << " timed again against the plain "
              << "step alone, " << c.confirmed_rounds << " rounds: " << c.confirmed_ratio
              << ", standard error " << c.confirmed_ratio_error << "\n";
  }
  return rows;
}

// What --verify runs: the plain run first (the reference), then the chosen plan and the
// finalists (without them, its front neighbours), then the standard settings predicted to fit.
std::vector<PlanEstimate> verify_runs(const MeasuredPlan& plan, const PlanEstimate& chosen,
                                      const std::vector<PlanEstimate>& finalists, int64_t budget,
                                      int64_t num_layers) {
  std::vector<PlanEstimate> runs;
  const auto plain = std::find_if(plan.estimates.begin(), plan.estimates.end(),
                                  [](const PlanEstimate& e) { return e.strategy.plain(); });
  runs.push_back(*plain);
  auto add = [&runs](const PlanEstimate& e) {
    const bool listed = std::any_of(
        runs.begin(), runs.end(), [&e](const PlanEstimate& r) { return r.strategy == e.strategy; });
    if (!listed) runs.push_back(e);
  };
  add(chosen);
  const std::vector<PlanEstimate>& front = plan.front;
  if (!finalists.empty()) {
    for (const auto& f : finalists) add(f);  // the ones it was chosen against
  } else {
    const auto on = std::find_if(front.begin(), front.end(), [&chosen](const PlanEstimate& e) {
      return e.strategy == chosen.strategy;
    });
    const size_t at = static_cast<size_t>(on - front.begin());
    for (size_t i = at == 0 ? 0 : at - 1; i <= std::min(at + 1, front.size() - 1); ++i) {
      add(front[i]);
    }
  }
  for (const auto& e : plan.estimates) {
    if (e.peak_bytes <= budget && standard_setting(e.strategy, num_layers)) add(e);
  }
  return runs;
}

// --verify: each run's measured peak and step ratio beside the prediction; 3 when a strategy is
// not bitwise equal to plain.
int print_verification(const PlanOptions& o, const TransformerConfig& base,
                       const MeasuredPlan& plan, const PlanEstimate& chosen,
                       const std::vector<PlanEstimate>& finalists, int64_t budget,
                       nlohmann::json& out) {
  const std::vector<PlanEstimate> runs =
      verify_runs(plan, chosen, finalists, budget, base.num_layers);
  // Rounds until the chosen plan's ratio is as sure as its confirmation (runs[1] is the chosen
  // one unless the plain run is).
  TimedRounds rounds = TimedRounds::until_sure(
      o.verify_steps, o.max_timed_rounds, chosen.strategy.plain() ? 0.0 : o.ratio_precision / 100);
  rounds.watch = {chosen.strategy.plain() ? size_t{0} : size_t{1}};
  const Verification v = verify(base, o.train.training, runs, rounds);
  const MeasuredRatios& measured = v.time;
  std::cout << "\nverified (" << measured.rounds << " timed rounds after "
            << measured.warm_up_rounds << " warm-up rounds, same seed):\n"
            << std::left << std::setw(58) << "strategy" << std::right << std::setw(13) << "peak"
            << std::setw(13) << "predicted" << std::setw(9) << "error" << std::setw(8) << "ratio"
            << std::setw(16) << "predicted" << std::setw(9) << "error" << std::setw(10) << "stated"
            << std::setw(9) << "error" << std::setw(6) << "fits" << std::setw(9) << "bitwise\n";
  out["verify_warm_up_rounds"] = measured.warm_up_rounds;
  out["verify_rounds"] = measured.rounds;
  out["verified"] = nlohmann::json::array();
  int rc = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    const PlanEstimate& e = runs[i];
    const int64_t peak = v.peak[i];
    const double ratio = measured.ratio[i];
    const bool bitwise = measured.bitwise[i];
    const double peak_err = static_cast<double>(e.peak_bytes - peak) / static_cast<double>(peak);
    const double ratio_err = (e.step_ratio - ratio) / ratio;
    // What the planner stated for a finalist (its confirmation, for the choice) from rounds of
    // its own, set against these.
    const double stated = e.planned_ratio();
    std::ostringstream stated_text, stated_err;
    if (e.finalist_ratio > 0) {
      stated_text << std::fixed << std::setprecision(3) << stated;
      stated_err << percent((stated - ratio) / ratio);
    }
    const bool fits = peak <= budget;
    std::cout << std::left << std::setw(58) << e.strategy.name() << std::right << std::setw(13)
              << format_bytes(static_cast<double>(peak)) << std::setw(13)
              << format_bytes(static_cast<double>(e.peak_bytes)) << std::setw(9)
              << percent(peak_err) << std::setw(8) << std::setprecision(3) << ratio << std::setw(16)
              << ratio_text(e) << std::setw(9) << percent(ratio_err) << std::setw(10)
              << stated_text.str() << std::setw(9) << stated_err.str() << std::setw(6)
              << (fits ? "yes" : "no") << std::setw(8) << (bitwise ? "yes" : "NO") << "\n";
    nlohmann::json row = {{"strategy", e.strategy.name()},
                          {"measured_peak_bytes", peak},
                          {"predicted_peak_bytes", e.peak_bytes},
                          {"measured_step_ratio", ratio},
                          {"measured_step_ratio_standard_error", measured.standard_error[i]},
                          {"predicted_step_ratio", e.step_ratio},
                          {"predicted_step_ratio_spread", e.step_ratio_spread},
                          {"planned_step_ratio", stated},
                          {"fits_budget", fits},
                          {"bitwise_equal_to_plain", bitwise},
                          {"step_times_s", measured.step_s[i]}};
    if (e.finalist_ratio > 0) row["finalist_step_ratio"] = e.finalist_ratio;
    if (e.confirmed_ratio > 0) row["confirmed_step_ratio"] = e.confirmed_ratio;
    out["verified"].push_back(std::move(row));
    if (!bitwise) rc = 3;
  }
  if (rc) std::cout << "\nWARNING: some strategies are not bitwise equal to plain\n";
  // Note [Machine speed check] in planner.cpp: a speed change after the profile (or its check).
  const double verify_plain = median(measured.step_s[0]);
  const double plain_s = plan.costs.plain_step_s;
  const double change = verify_plain / plain_s - 1;
  out["profile_plain_step_s"] = plain_s;
  out["verify_plain_step_s"] = verify_plain;
  if (o.costs_speed_tolerance > 0 && std::abs(change) * 100 > o.costs_speed_tolerance) {
    std::cout << std::fixed << std::setprecision(1) << "\nWARNING: the plain step took "
              << verify_plain * 1e3 << " ms in these rounds and " << plain_s * 1e3
              << " ms in the profile (" << std::showpos << change * 100 << std::noshowpos
              << "%): the machine's speed changed since the costs were measured, and the "
                 "predicted ratios may be off by more than their spread. Profile again (a "
                 "new --costs file, or none) to plan for the machine as it is now.\n";
  }
  return rc;
}

// Note [Plan under the other kernel]
// The seed's §4.3 question for a model measured here. When --attention-backend auto chose flash,
// the unfused kernel could run too: it is profiled as well (its own costs, cached beside --costs
// as FILE.unfused), and the two kernels are set side by side — the plain step, what core_attn
// recompute frees and costs under each, and each kernel's fastest plan that fits. The plan itself
// keeps the kernel the flags chose: the two kernels agree only to rounding, so switching is the
// user's decision (--attention-backend), not the planner's. When auto chose unfused (attention
// dropout or MLA), flash cannot run and there is nothing to compare.
nlohmann::json print_measured_kernels(const PlanOptions& o, const TransformerConfig& base,
                                      const MeasuredPlan& plan, int64_t budget) {
  TransformerConfig unfused = base;
  unfused.attention_backend = "unfused";
  const MeasuredPlan other = measured_plan(
      unfused, o.train.training,
      TimedRounds::until_sure(o.profile_steps, kMaxProfileRounds, o.profile_precision / 100),
      o.costs.empty() ? "" : o.costs + ".unfused",
      [](const std::string& line) {
        std::cerr << "\rplan: the unfused kernel, " << line << "            " << std::flush;
      },
      o.costs_speed_tolerance / 100);
  std::cerr << "\n";
  std::cout << "\nunder each attention kernel (Note [Plan under the other kernel]):\n"
            << std::left << std::setw(10) << "kernel" << std::right << std::setw(12) << "plain ms"
            << std::setw(14) << "plain kept" << std::setw(18) << "core_attn extra" << std::setw(14)
            << "freed"
            << "  " << std::left << "fastest that fits\n";
  nlohmann::json rows = nlohmann::json::array();
  for (const MeasuredPlan* p : {&plan, &other}) {
    const bool flash = p == &plan;
    const auto named = [p](const std::string& name) {
      return *std::find_if(p->estimates.begin(), p->estimates.end(),
                           [&name](const PlanEstimate& e) { return e.strategy.name() == name; });
    };
    const PlanEstimate plain = named("plain"), core = named("selective core_attn");
    const PlanEstimate* fits = nullptr;
    for (const auto& e : p->front) {
      if (budget > 0 && e.peak_bytes <= budget) fits = &e;  // sorted by peak: the last is fastest
    }
    const double plain_ms = p->costs.plain_step_s * 1e3;
    const Mechanism core_attn = Mechanism::recompute(RecomputeModule::kCoreAttn);
    const double extra = p->costs.extra.count(core_attn) ? p->costs.extra.at(core_attn) : 0.0;
    std::ostringstream best;
    if (budget <= 0) {
      best << "(no --memory-budget)";
    } else if (fits == nullptr) {
      best << "none";
    } else {
      best << fits->strategy.name() << " (" << format_bytes(static_cast<double>(fits->peak_bytes))
           << ", " << std::fixed << std::setprecision(1) << plain_ms * fits->step_ratio << " ms)";
    }
    std::cout << std::left << std::setw(10) << (flash ? "flash*" : "unfused") << std::right
              << std::fixed << std::setprecision(1) << std::setw(12) << plain_ms << std::setw(14)
              << format_bytes(static_cast<double>(plain.kept_bytes)) << std::setw(18)
              << ((extra >= 0 ? "+" : "") + percent(extra)) << std::setw(14)
              << format_bytes(static_cast<double>(plain.kept_bytes - core.kept_bytes)) << "  "
              << std::left << best.str() << "\n";
    nlohmann::json row = {{"kernel", flash ? "flash" : "unfused"},
                          {"chosen_by_the_flags", flash},
                          {"plain_step_s", p->costs.plain_step_s},
                          {"core_attn_extra", extra},
                          {"plain", plain.to_json()},
                          {"core_attn", core.to_json()},
                          {"core_attn_freed_bytes", plain.kept_bytes - core.kept_bytes}};
    row["fastest_that_fits"] = fits != nullptr ? fits->to_json() : nlohmann::json(nullptr);
    rows.push_back(std::move(row));
  }
  std::cout
      << "  * the kernel of these flags (auto); --attention-backend unfused plans the other\n";
  return rows;
}

int run(PlanOptions& o, const CLI::App& cmd) {
  if (!o.preset.empty()) return run_preset(o, cmd);
  for (const char* flag :
       {"--gpu", "--data-parallel-size", "--num-microbatches", "--expert-tensor-parallel-size"}) {
    TORCH_CHECK(cmd.count(flag) == 0, "actmem plan: ", flag,
                " applies with --preset (a paper "
                "model planned analytically); without it the model is measured here, in one "
                "process");
  }
  o.train.finalize();
  apply_thread_count(o.train.threads);
  const TransformerConfig& base = o.train.model;
  const int64_t budget = o.budget.empty() ? -1 : parse_memory_budget(o.budget);
  TORCH_CHECK(budget > 0 || (cmd.count("--finalists") == 0 && cmd.count("--finalist-steps") == 0),
              "actmem plan: --finalists chooses among strategies for --memory-budget; give both");
  check_distinct_files({{"--data", o.train.training.data_path}},
                       {{"--svg", o.svg}, {"--json", o.json}, {"--costs", o.costs}});
  OutputFile json_file, svg_file;  // opened before the work: an unwritable path fails now
  if (!o.json.empty()) json_file = OutputFile({"--json", o.json});
  if (!o.svg.empty()) svg_file = OutputFile({"--svg", o.svg});
  bool profiled = false;  // progress lines were printed: end them
  const MeasuredPlan plan = measured_plan(
      base, o.train.training,
      TimedRounds::until_sure(o.profile_steps, kMaxProfileRounds, o.profile_precision / 100),
      o.costs,
      [&profiled](const std::string& line) {
        profiled = true;
        std::cerr << "\rplan: " << line << "            " << std::flush;
      },
      o.costs_speed_tolerance / 100);
  if (profiled) std::cerr << "\n";
  print_measured_header(base, plan);
  const PlanEstimate* chosen = budget > 0 ? &choose_plan(plan.front, budget) : nullptr;
  // Note [Plan finalists] in planner.cpp: the few fastest-predicted that fit, timed side by side.
  std::vector<PlanEstimate> finalists;
  if (chosen != nullptr && o.finalists > 0) {
    finalists = timed_finalists(
        base, o.train.training, plan.estimates, budget, o.finalists, o.finalist_steps,
        TimedRounds::until_sure(o.finalist_steps, o.max_timed_rounds, o.ratio_precision / 100),
        [](const std::string& line) {
          std::cerr << "\rplan: timing the finalists, " << line << "            " << std::flush;
        });
    if (!finalists.empty()) {
      std::cerr << "\n";
      chosen = &finalists.front();
    }
  }
  print_front(plan.front, chosen);
  nlohmann::json out = {{"model", to_json(base)},
                        {"legal_strategies", plan.strategies.size()},
                        {"costs", plan.costs.to_json()},
                        {"front", nlohmann::json::array()},
                        {"runtime", runtime_info()}};
  for (const auto& e : plan.front) out["front"].push_back(e.to_json());
  if (!finalists.empty()) out["finalists"] = print_finalists(finalists, chosen, o.finalist_steps);
  if (base.attention_backend == "auto" && base.flash_attention()) {
    out["attention_kernels"] = print_measured_kernels(o, base, plan, budget);
  }
  if (chosen) {
    out["memory_budget_bytes"] = budget;
    out["chosen"] = chosen->to_json();
    print_choice(*chosen, budget, "", offload_extra_flags(base));
    const std::string note = copies_in_flight_note(base, chosen->strategy);
    if (!note.empty()) std::cout << "  " << note << "\n";
  }
  int rc = 0;
  if (o.verify) {
    TORCH_CHECK(chosen != nullptr, "actmem plan: --verify needs --memory-budget");
    rc = print_verification(o, base, plan, *chosen, finalists, budget, out);
  }
  if (svg_file.is_open()) {
    std::ostringstream title;
    title << "Activation strategies of a " << base.num_layers << "-layer h " << base.hidden_size
          << " model: predicted device peak and step time";
    write_front_svg(svg_file, o.svg, plan.estimates, plan.front, chosen, budget, base.num_layers,
                    title.str());
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
  // The parallel flags serve --preset (the measured plan refuses t, p > 1 with a clear message).
  add_flags(
      *cmd, o->train,
      kShapeFlags | kParallelFlags | kMoEFlags | kOptimizerFlags | kDataFlags | kRuntimeFlags);
  cmd->add_option("--min-offloaded-tensor-size", o->train.model.min_offloaded_tensor_size,
                  "offload keeps saved tensors of fewer elements on the device (as train)")
      ->capture_default_str()
      ->check(integer_in_range(0, int64_t{1} << 62));
  cmd->add_option("--fine-grained-offloading-max-inflight-offloads",
                  o->train.model.fine_grained_offloading_max_inflight_offloads,
                  "offload copies of one group name in flight before compute waits (-1: no cap; "
                  "as train)")
      ->capture_default_str()
      ->check(integer_in_range(-1, 1 << 20));
  cmd->add_option("--memory-budget", o->budget,
                  "device bytes a step may hold: bytes or with a unit (8GiB, 7.5G, 900MiB)");
  cmd->add_option("--profile-steps", o->profile_steps,
                  "the fewest timed rounds of the profiling run (then until --profile-precision)")
      ->capture_default_str()
      ->check(integer_in_range(1, 1000));
  cmd->add_option("--profile-precision", o->profile_precision,
                  "percent: profile until every mechanism's step ratio has this standard error, "
                  "at most " +
                      std::to_string(kMaxProfileRounds) +
                      " rounds (0: --profile-steps "
                      "exactly)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 100.0));
  cmd->add_option("--finalists", o->finalists,
                  "with --memory-budget: time this many fastest-predicted strategies that fit "
                  "side by side and choose the one measured fastest (0: the prediction's choice)")
      ->capture_default_str()
      ->check(integer_in_range(0, 64));
  cmd->add_option("--finalist-steps", o->finalist_steps,
                  "timed rounds of the finalists, and the fewest of the choice's confirmation")
      ->capture_default_str()
      ->check(integer_in_range(1, 1000));
  cmd->add_option("--ratio-precision", o->ratio_precision,
                  "percent: time the choice's confirmation and --verify until the chosen plan's "
                  "step ratio has this standard error (0: the fewest rounds only)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 100.0));
  cmd->add_option("--max-timed-rounds", o->max_timed_rounds,
                  "the most timed rounds --ratio-precision may take")
      ->capture_default_str()
      ->check(integer_in_range(1, 10000));
  cmd->add_flag("--verify", o->verify,
                "run the chosen strategy, the other finalists (or its front neighbours), the "
                "standard settings that fit and the plain run, and compare");
  cmd->add_option("--verify-steps", o->verify_steps,
                  "the fewest timed rounds of --verify (then until --ratio-precision)")
      ->capture_default_str()
      ->check(integer_in_range(1, 1000));
  cmd->add_option("--json", o->json, "also write the front, the costs and the choice as JSON");
  cmd->add_option("--svg", o->svg, "plot every strategy and the front (peak against step time)");
  add_preset_option(*cmd, o->preset,
                    "plan a named model analytically instead of measuring one here, with the "
                    "model flags given replacing its own (docs/planner.md)");
  cmd->add_option("--gpu", o->gpu,
                  "with --preset: the GPU costed (" + c10::Join(", ", device_spec_names()) + ")")
      ->capture_default_str()
      ->check(CLI::IsMember(device_spec_names()));
  add_described_layout_flags(*cmd, o->train, o->layout, /*optimizer_flags_registered=*/true);
  cmd->add_option("--costs", o->costs,
                  "keep the measured costs in this file and reuse them while the model, device, "
                  "threads and libraries are the same");
  cmd->add_option("--costs-speed-tolerance", o->costs_speed_tolerance,
                  "percent the plain step may have moved since the --costs profile before it is "
                  "profiled again; --verify warns beyond it (0: not checked)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1000.0));
  return [o, cmd]() { return cmd->parsed() ? run(*o, *cmd) : -1; };
}

}  // namespace actmem::cli
