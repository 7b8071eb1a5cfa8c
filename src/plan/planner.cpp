// planner.cpp — legal strategies, the profiling run, the per-strategy prediction and the search
// (Note [Planner] in planner.h).
#include "actmem/plan/planner.h"

#include "actmem/offload/activation_offloader.h"
#include "actmem/config/activation_plan.h"
#include "actmem/base/environment.h"
#include "actmem/memory/memory_model.h"
#include "actmem/model/activation_bytes.h"
#include "actmem/base/output_file.h"
#include "actmem/base/report.h"
#include "actmem/train/step_rounds.h"
#include "actmem/train/trainer.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/StringUtil.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <limits>
#include <memory>
#include <set>
#include <sstream>

namespace actmem {

namespace {

// Timed steps of the plain step alone (Note [Machine speed check]).
constexpr int kSpeedCheckSteps = 5;

bool accepted(const TransformerConfig& c) {
  try {
    make_activation_plan(c);
    return true;
  } catch (const c10::Error&) {
    return false;
  }
}

// Every subset of `names` (in their order), the empty one first.
template <typename T>
std::vector<std::vector<T>> subsets(const std::vector<T>& names) {
  std::vector<std::vector<T>> out;
  const size_t n = names.size();
  for (uint64_t mask = 0; mask < (uint64_t{1} << n); ++mask) {
    std::vector<T> s;
    for (size_t i = 0; i < n; ++i) {
      if (mask & (uint64_t{1} << i)) s.push_back(names[i]);
    }
    out.push_back(std::move(s));
  }
  return out;
}

// How many mechanisms a strategy uses: among equally good ones the simplest is listed.
int complexity(const Strategy& s) {
  return static_cast<int>(s.recompute_modules.size() + s.offload_modules.size()) +
         (s.full_method == RecomputeMethod::kNone ? 0 : 1) + (s.offload_layers > 0 ? 1 : 0);
}

// The model a strategy's backward transient is measured on, and the key of that measurement
// (Note [Planner]): the last layers with the same per-layer plan, at most three of them.
struct Tail {
  std::string key;
  TransformerConfig probe;
};

Tail tail_of(const TransformerConfig& base, const Strategy& s) {
  const int64_t L = base.num_layers;
  if (base.is_moe()) {
    // An MoE layer routes each token by its hidden state, so the layers of a shorter probe (which
    // see other inputs) route differently, and the backward's transient with them (the experts'
    // intermediates follow their token counts): on a 4-layer top-2 model of 4 experts the
    // three-layer probes over-predicted the peak by 48 KB (selective moe) and 167 KB (full
    // uniform 1), 0.1 to 0.3%. The whole model, from the same seed, routes as the run does.
    std::ostringstream key;
    key << L << " layers: " << s.name();
    return {key.str(), s.apply(base)};
  }
  const int64_t probe_layers_default = std::min<int64_t>(L, 3);
  Strategy t = s;
  int64_t layers = probe_layers_default;
  const bool uniform = s.full_method == RecomputeMethod::kUniform;
  if (uniform || (s.full_method == RecomputeMethod::kBlock && s.full_layers >= L)) {
    // A chunk is rebuilt while every earlier chunk's input is held: the last two chunks (the
    // last may be shorter, and then the one before it holds the peak), cut as the model cuts
    // them.
    layers = uniform ? std::min(L, s.full_layers + L % s.full_layers) : 1;
    t.full_method = RecomputeMethod::kUniform;
    t.full_layers = uniform ? std::min(s.full_layers, L) : 1;
  } else if (s.full_method == RecomputeMethod::kBlock) {
    // The last layers run plainly: the backward starts as the plain one does, and rebuilding one
    // checkpointed layer later holds less (the plain layers after it are freed by then).
    t = Strategy{};
  } else if (s.offload_layers > 0) {
    // Layer-level offload of the first K layers: the tail offloads those of its layers that are
    // among them, so the backward reaching the first kept layer reloads the one before it as
    // the whole model does (K < L: the last layer is never offloaded).
    t.offload_layers = std::max<int64_t>(0, s.offload_layers - (L - layers));
  }
  TransformerConfig probe = t.apply(base);
  probe.num_layers = layers;
  if (layers < L && !accepted(probe)) {
    // Should a rule of the shorter model refuse it, measure on the whole model (it was needed
    // for MoE tails, mlp recompute on MoE layers only; MoE models are now probed whole above).
    layers = L;
    probe = t.apply(base);
  }
  std::ostringstream key;
  key << layers << " layers: " << t.name();
  return {key.str(), probe};
}

// Note [Offloaded bytes]
// What a forward offloads depends on the whole model (every layer but the last offloads; the
// last is the margin, Note [Offload warmup and margin] in offload_schedule.h) and on the
// selective set (a recomputed module saves nothing to offload), and the threshold
// min_offloaded_tensor_size keeps small tensors on the device. So it is measured on the whole
// model: per selective set, one step with every offload group that set allows, read per group
// name from the offloader's summary (the bytes of one forward after the margin rule); a
// strategy's offloaded bytes are the sum over its groups (the groups are disjoint modules).
std::string offload_key(const std::vector<RecomputeModule>& recompute, const std::string& group) {
  return "selective " + (recompute.empty() ? std::string("none") : join_names(recompute, "+")) +
         ": offload " + group;
}
std::string offload_key(const std::vector<RecomputeModule>& recompute, OffloadModule group) {
  return offload_key(recompute, to_string(group));
}
// Layer-level offload of the first K layers moves everything they save of at least the
// threshold (no margin: every one of the K groups offloads), measured per K on the whole model.
std::string layer_offload_key(int64_t k) { return "layer offload " + std::to_string(k); }

// `s` without the offload groups that move nothing under its selective set (every tensor below
// min_offloaded_tensor_size, or none saved): the same memory as `s`, so its tail is measured once
// for both (where dropping them leaves a legal strategy).
Strategy moving_groups(const TransformerConfig& base, const Strategy& s, const PlanCosts& costs) {
  Strategy m = s;
  m.offload_modules.clear();
  for (const auto& g : s.offload_modules) {
    const auto it = costs.offloaded.find(offload_key(s.recompute_modules, g));
    if (it == costs.offloaded.end() || it->second != 0) m.offload_modules.push_back(g);
  }
  return m.offload_modules.size() == s.offload_modules.size() || accepted(m.apply(base)) ? m : s;
}

// Training settings of one measured step: one micro-batch, no validation.
TrainingConfig probe_training(TrainingConfig t, const TransformerConfig& model, int64_t steps) {
  t.global_batch_size = model.micro_batch_size;
  t.eval_interval = 0;
  t.set_measurement_steps(steps);
  t.save.clear();
  t.load.clear();
  t.save_interval = 0;
  return t;
}

// A model alone in the process for two steps (the first warms the allocator, the caches and the
// offloader's warmup up): the trainer, for what it holds afterwards, and the second step's stats.
struct SecondStep {
  std::unique_ptr<Trainer> trainer;
  IterationStats stats;
};

SecondStep second_step(const TransformerConfig& model, const TrainingConfig& two_steps) {
  SecondStep r{std::make_unique<Trainer>(model, two_steps), {}};
  r.trainer->train_step(false);
  r.stats = r.trainer->train_step(false);
  return r;
}

// The selective and fine-grained mechanisms `s` runs, as cost keys (Note [Planner cost basis]):
// "recompute:MOD" per recompute module, "offload:GROUP" per offload group that moves bytes under
// its selective set (a group that moves nothing there costs nothing).
std::vector<std::string> mixed_mechanisms(const Strategy& s, const PlanCosts& costs) {
  std::vector<std::string> out;
  for (const auto m : s.recompute_modules) out.push_back(std::string("recompute:") + to_string(m));
  for (const auto g : s.offload_modules) {
    const auto it = costs.offloaded.find(offload_key(s.recompute_modules, g));
    if (it == costs.offloaded.end() || it->second != 0) {
      out.push_back(std::string("offload:") + to_string(g));
    }
  }
  return out;
}

}  // namespace

std::vector<Strategy> enumerate_strategies(const TransformerConfig& base, bool layer_offload) {
  base.validate_shape();
  std::vector<RecomputeModule> modules;
  std::vector<OffloadModule> groups;
  for (const auto& [m, name] : kRecomputeModuleNames) modules.push_back(m);
  for (const auto& [g, name] : kOffloadModuleNames) groups.push_back(g);
  std::vector<std::vector<RecomputeModule>> selective;
  std::vector<std::vector<OffloadModule>> offload;
  for (auto& set : subsets(modules)) {
    Strategy s;
    s.recompute_modules = set;
    if (set.empty() || accepted(s.apply(base))) selective.push_back(std::move(set));
  }
  for (auto& set : subsets(groups)) {
    Strategy s;
    s.offload_modules = set;
    if (!set.empty() && accepted(s.apply(base))) offload.push_back(std::move(set));
  }
  std::vector<Strategy> out;
  for (const auto& sel : selective) {
    Strategy s;
    s.recompute_modules = sel;
    out.push_back(s);
    for (const auto& off : offload) {
      s.offload_modules = off;
      if (accepted(s.apply(base))) out.push_back(s);
    }
  }
  // N beyond one model chunk's layers is the same plan as N equal to them.
  const int64_t chunk_layers =
      base.num_layers / base.pipeline_model_parallel_size / base.virtual_pipeline_size();
  for (const RecomputeMethod method : {RecomputeMethod::kUniform, RecomputeMethod::kBlock}) {
    for (int64_t n = 1; n <= chunk_layers; ++n) {
      Strategy s;
      s.full_method = method;
      s.full_layers = n;
      if (accepted(s.apply(base))) out.push_back(s);
    }
  }
  for (int64_t k = 1; layer_offload && k < base.num_layers; ++k) {
    Strategy s;
    s.offload_layers = k;
    if (accepted(s.apply(base))) out.push_back(s);
  }
  return out;
}

std::vector<Strategy> legal_strategies(const TransformerConfig& base) {
  base.validate_shape();
  TORCH_CHECK(base.pipeline_model_parallel_size == 1, "actmem::legal_strategies: pipeline "
              "parallelism is not planned yet (each stage holds a different number of "
              "micro-batches); plan one stage's layers with --pipeline-model-parallel-size 1, or a paper "
              "model's layout analytically with --preset");
  TORCH_CHECK(base.tensor_model_parallel_size == 1 && base.expert_model_parallel_size == 1,
              "actmem::legal_strategies: tensor and expert parallelism are not planned yet (the "
              "profiling run is one process); plan with sizes of one rank's share, or a paper model's "
              "layout analytically with --preset");
  TORCH_CHECK(!base.is_moe() || !base.moe_expert_capacity_factor.has_value() ||
                  base.moe_pad_expert_input_to_capacity,
              "actmem::legal_strategies: MoE with a capacity factor and no padding is not planned "
              "yet (each micro-batch's activation bytes follow its routing); plan the dropless or "
              "padded model (--moe-pad-expert-input-to-capacity), which bounds it");
  return enumerate_strategies(base, /*layer_offload=*/true);
}

int64_t parse_memory_budget(const std::string& text) {
  auto bad = [&text](const char* why) {
    TORCH_CHECK(false, "actmem plan: --memory-budget '", text, "': ", why, "; expected bytes "
                "('8589934592') or a number with a unit ('8GiB', '7.5G', '900MiB', '16GB')");
  };
  size_t pos = 0;
  while (pos < text.size() && (std::isdigit(static_cast<unsigned char>(text[pos])) || text[pos] == '.')) ++pos;
  if (pos == 0) bad("no number");
  double value = 0;
  try {
    size_t used = 0;
    value = std::stod(text.substr(0, pos), &used);
    if (used != pos) bad("not a number");
  } catch (const std::logic_error&) {
    bad("not a number");
  }
  std::string unit = text.substr(pos);
  while (!unit.empty() && unit.front() == ' ') unit.erase(unit.begin());
  std::string u;
  for (char ch : unit) u += static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  double scale = 0;
  const std::vector<std::pair<const char*, double>> units = {
      {"", 1}, {"B", 1}, {"K", 1024.0}, {"KIB", 1024.0}, {"KB", 1e3},
      {"M", 1048576.0}, {"MIB", 1048576.0}, {"MB", 1e6}, {"G", 1073741824.0},
      {"GIB", 1073741824.0}, {"GB", 1e9}, {"T", 1099511627776.0}, {"TIB", 1099511627776.0},
      {"TB", 1e12}};
  for (const auto& [name, factor] : units) {
    if (u == name) scale = factor;
  }
  if (scale == 0) bad("unknown unit");
  const double bytes = std::floor(value * scale);
  if (!(bytes >= 1)) bad("less than one byte");
  if (bytes > 9.0e18) bad("too large");
  return static_cast<int64_t>(bytes);
}

nlohmann::json PlanCosts::to_json() const {
  return {{"static_bytes", static_bytes}, {"optimizer_peak_bytes", optimizer_peak_bytes},
          {"plain_step_s", plain_step_s}, {"solo_plain_step_s", solo_step_s},
          {"extra_step_fraction", extra},
          {"extra_step_fraction_spread", spread},
          {"backward_transient_bytes", transient}, {"offloaded_bytes", offloaded},
          {"round_step_times_s", round_step_s}, {"timed_rounds", steps}, {"threads", threads}};
}

PlanCosts PlanCosts::from_json(const nlohmann::json& j) {
  try {
    PlanCosts c;
    c.static_bytes = j.at("static_bytes").get<int64_t>();
    c.optimizer_peak_bytes = j.at("optimizer_peak_bytes").get<int64_t>();
    c.plain_step_s = j.at("plain_step_s").get<double>();
    c.solo_step_s = j.at("solo_plain_step_s").get<double>();
    c.extra = j.at("extra_step_fraction").get<std::map<std::string, double>>();
    c.spread = j.at("extra_step_fraction_spread").get<std::map<std::string, double>>();
    c.transient = j.at("backward_transient_bytes").get<std::map<std::string, int64_t>>();
    c.offloaded = j.at("offloaded_bytes").get<std::map<std::string, int64_t>>();
    if (j.contains("round_step_times_s")) {
      c.round_step_s = j.at("round_step_times_s").get<std::map<std::string, std::vector<double>>>();
    }
    c.steps = j.at("timed_rounds").get<int>();
    c.threads = j.at("threads").get<int>();
    return c;
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "actmem::PlanCosts::from_json: not a cost record (", e.what(), ")");
  }
}

// Note [Planner cost cache]
// A profile takes a minute or more; its results depend only on what plan_costs_key() records.
// `actmem plan --costs FILE` keeps {"key", "costs"} in FILE and reuses it when the key matches
// (the same model, micro-batches, device, threads, BLAS and versions), so a sweep of
// budgets, or a later `train --memory-budget`, plans from the same measurement.
nlohmann::json plan_costs_key(const TransformerConfig& base, const TrainingConfig& training) {
  const TransformerConfig plainly = Strategy{}.apply(base);
  return {{"model", actmem::to_json(plainly)},
          {"microbatches_per_step", training.num_microbatches(base.micro_batch_size)},
          {"device", training.device},
          {"runtime", runtime_info()},
          {"cost_format", 5}};  // 2: with the spread (Note [Planner uncertainty]); 3: layer offload;
                                // 4: signed extras (Note [Planner cost basis]); 5: the solo
                                // plain step (Note [Machine speed check])
}

// Note [Machine speed check]
// The cost key (plan_costs_key) names the machine but not how fast it runs now: on a shared
// machine a neighbour can slow it by a third for minutes, and not every mechanism by the same
// fraction. Measured on the development machine (2 cores, bench/plan_sweep.sh): the dense
// model's profile ran while the plain step took 188 ms, its verify runs a minute later at 139
// ms; recomputing the MLP measured +1.8% in the slow phase and +8% in the fast one, and the
// chosen plans' predicted ratios missed by 8.5 to 11.3%, where the two models profiled and
// verified at one speed missed by 3.0% at most. (Memory-bound work, the copies and the
// element-wise kernels, suffers from a busy neighbour more than the matrix products do.) So a
// profile first times the plain step alone (solo_plain_step_s(), before anything else, in a
// fresh process), and a reuse of the costs times it again the same way: when the two differ by
// more than the tolerance (kCostSpeedTolerance, `--costs-speed-tolerance`), the costs are
// measured again rather than trusted. It cannot see a change after the check: `plan --verify`
// compares the plain step of its rounds with the profile's and warns.
double solo_plain_step_s(const TransformerConfig& base, const TrainingConfig& training, int steps) {
  TORCH_CHECK(steps >= 1, "actmem::solo_plain_step_s: at least one timed step, got ", steps);
  TrainingConfig t = probe_training(training, base, kMaxWarmUpRounds + steps);
  Trainer plain(Strategy{}.apply(base), t);
  warm_up_rounds({&plain}, 1, kMaxWarmUpRounds);
  std::vector<double> times;
  for (int i = 0; i < steps; ++i) times.push_back(plain.train_step(false).step_time_s);
  return median(times);
}

PlanCosts plan_costs(const TransformerConfig& base, const TrainingConfig& training,
                     const TimedRounds& rounds, const std::string& costs_path,
                     const std::function<void(const std::string&)>& progress, std::string* note,
                     double speed_tolerance) {
  TORCH_CHECK(speed_tolerance >= 0, "actmem::plan_costs: the speed tolerance is a fraction >= 0 "
              "(0: not checked), got ", speed_tolerance);
  const nlohmann::json key = plan_costs_key(base, training);
  std::string said;
  if (!costs_path.empty() && std::filesystem::exists(costs_path)) {
    nlohmann::json record;
    try {
      record = nlohmann::json::parse(std::ifstream(costs_path));
    } catch (const nlohmann::json::exception& e) {
      TORCH_CHECK(false, "actmem plan: --costs ", costs_path, " is not a cost record (", e.what(),
                  "); remove it to profile again");
    }
    TORCH_CHECK(record.is_object() && record.contains("key") && record.contains("costs"),
                "actmem plan: --costs ", costs_path, " is not a cost record (no key and costs); "
                "remove it to profile again");
    if (record["key"] == key) {
      PlanCosts cached = PlanCosts::from_json(record["costs"]);
      if (speed_tolerance == 0) {
        if (note) *note = "costs reused from " + costs_path + " (the machine's speed not checked)";
        return cached;
      }
      if (progress) progress("checking the machine's speed against " + costs_path);
      const double now = solo_plain_step_s(base, training, kSpeedCheckSteps);
      const double change = now / cached.solo_step_s - 1;
      std::ostringstream os;
      os << std::fixed << std::setprecision(1) << "the plain step alone takes " << now * 1e3
         << " ms now, " << cached.solo_step_s * 1e3 << " ms when profiled ("
         << std::showpos << change * 100 << std::noshowpos << "%)";
      if (std::abs(change) <= speed_tolerance) {
        if (note) *note = "costs reused from " + costs_path + "; " + os.str();
        return cached;
      }
      said = "costs profiled again: the machine's speed changed since " + costs_path +
             " was measured: " + os.str() + ", more than the tolerance of " +
             std::to_string(static_cast<int>(std::lround(speed_tolerance * 100))) + "%";
    } else {
      said = "costs profiled again: " + costs_path + " was measured for another model, device, "
             "thread count or library";
    }
  }
  const PlanCosts costs = profile_costs(base, training, rounds, progress);
  if (!costs_path.empty()) {
    OutputFile cache({"--costs", costs_path});
    cache.write(nlohmann::json{{"key", key}, {"costs", costs.to_json()}}.dump(1) + "\n",
                "the costs");
    cache.close();
    if (said.empty()) said = "costs written to " + costs_path;
  }
  if (note) *note = said;
  return costs;
}

MeasuredPlan measured_plan(const TransformerConfig& base, const TrainingConfig& training,
                           const TimedRounds& rounds, const std::string& costs_path,
                           const std::function<void(const std::string&)>& progress,
                           double speed_tolerance) {
  MeasuredPlan plan;
  plan.strategies = legal_strategies(base);
  plan.costs = plan_costs(base, training, rounds, costs_path, progress, &plan.costs_note,
                          speed_tolerance);
  plan.estimates = estimate_plans(base, plan.strategies, plan.costs);
  plan.front = pareto_front(plan.estimates);
  return plan;
}

nlohmann::json PlanEstimate::to_json() const {
  nlohmann::json j = {{"strategy", strategy.name()}, {"flags", strategy.flags()},
                      {"kept_bytes", kept_bytes}, {"peak_bytes", peak_bytes},
                      {"step_ratio", step_ratio}, {"step_ratio_spread", step_ratio_spread}};
  if (finalist_ratio > 0) {
    j["finalist_step_ratio"] = finalist_ratio;
    j["finalist_step_ratio_spread"] = finalist_ratio_spread;
  }
  if (confirmed_ratio > 0) {
    j["confirmed_step_ratio"] = confirmed_ratio;
    j["confirmed_step_ratio_standard_error"] = confirmed_ratio_error;
    j["confirmed_rounds"] = confirmed_rounds;
  }
  return j;
}

// Note [Rounds until sure]
// A measured step ratio is the median of per-round ratios, and on a shared machine one round's
// ratio scatters by 5 to 15% (the development machine, 2 cores with a busy neighbour: half
// interquartile ranges of 0.02 to 0.06). Ten rounds then leave a standard error of 1.5 to 3% on
// the median, and two such measurements of the same plan (the finalists' and --verify's) differ
// by more than 5% once in every few budgets: measured, 1 of 9 in one sweep. A fixed count is too
// few on a noisy machine and wasted on a quiet one, so the planner measures until it is sure:
// after the minimum, another round while a watched ratio's standard error
// (median_standard_error(): from the interquartile range, as for independent normal draws) is
// above the precision wanted (kDefaultRatioPrecision, 1%; `--ratio-precision`), up to a maximum
// (kDefaultMaxTimedRounds, `--max-timed-rounds`). The profile watches every mechanism it times,
// to a looser 2% (kDefaultProfilePrecision, `--profile-precision`) and at most kMaxProfileRounds
// (30): a round there steps a dozen trainers, and the model's predictions sum several of its
// ratios, so their errors matter more than one ratio's. Rounds minutes apart are not independent
// draws when the machine's speed drifts (Note [Machine speed check]); the error assumes they
// are, so it is a floor, not a bound.
MeasuredRatios measure_step_ratios(const TransformerConfig& base, const TrainingConfig& training,
                                   const std::vector<Strategy>& strategies,
                                   const TimedRounds& rounds,
                                   const std::function<void(const std::string&)>& progress,
                                   bool compute_digest) {
  TORCH_CHECK(!strategies.empty() && strategies.front().plain(), "actmem::measure_step_ratios: "
              "the first strategy must be plain, the reference");
  TORCH_CHECK(rounds.min_rounds >= 1 && rounds.max_rounds >= rounds.min_rounds,
              "actmem::measure_step_ratios: expected 1 <= min_rounds <= max_rounds, got ",
              rounds.min_rounds, " and ", rounds.max_rounds);
  TORCH_CHECK(rounds.precision >= 0, "actmem::measure_step_ratios: the precision is a standard "
              "error >= 0 (0: min_rounds exactly), got ", rounds.precision);
  const size_t n = strategies.size();
  std::vector<size_t> watch = rounds.watch;
  if (watch.empty()) {
    for (size_t i = 1; i < n; ++i) watch.push_back(i);
  }
  for (const size_t i : watch) {
    TORCH_CHECK(i < n, "actmem::measure_step_ratios: watched strategy ", i, " of ", n);
  }
  const int most = rounds.precision > 0 ? rounds.max_rounds : rounds.min_rounds;
  auto say = [&progress](const std::string& line) {
    if (progress) progress(line);
  };
  TrainingConfig t = probe_training(training, base, kMaxWarmUpRounds + most);
  t.global_batch_size = training.global_batch(base.micro_batch_size);
  std::vector<std::unique_ptr<Trainer>> trainers;
  for (const auto& s : strategies) trainers.push_back(std::make_unique<Trainer>(s.apply(base), t));
  std::vector<Trainer*> order;
  for (auto& tr : trainers) order.push_back(tr.get());
  MeasuredRatios m;
  m.step_s.resize(n);
  m.bitwise.assign(n, true);
  std::vector<std::vector<double>> ratios(n);
  m.warm_up_rounds = warm_up_rounds(order, 1, kMaxWarmUpRounds, [&](int round) {
    say("warm-up round " + std::to_string(round + 1) + " done (not timed)");
  });
  auto worst_error = [&] {
    double worst = 0;
    for (const size_t i : watch) worst = std::max(worst, median_standard_error(ratios[i]));
    return worst;
  };
  say("round 1/" + std::to_string(rounds.min_rounds));
  const auto after = [&](int, const std::vector<IterationStats>& st) {
    for (size_t i = 0; i < n; ++i) {
      m.bitwise[i] = m.bitwise[i] && st[i].loss == st[0].loss && st[i].grad_digest == st[0].grad_digest;
      ratios[i].push_back(st[i].step_time_s / st[0].step_time_s);
      m.step_s[i].push_back(st[i].step_time_s);
    }
  };
  m.rounds = run_shuffled_rounds(order, most, compute_digest, after, [&](int done) {
    if (done < rounds.min_rounds) {
      say("round " + std::to_string(done + 1) + "/" + std::to_string(rounds.min_rounds));
      return false;
    }
    if (rounds.precision == 0) return true;
    const double error = worst_error();
    if (error <= rounds.precision) return true;
    std::ostringstream line;
    line << "round " << done + 1 << " (until the standard error is " << std::fixed
         << std::setprecision(1) << rounds.precision * 100 << "%, now " << error * 100
         << "%; at most " << most << ")";
    if (done < most) say(line.str());
    return false;
  });
  for (size_t i = 0; i < n; ++i) {
    m.ratio.push_back(median(ratios[i]));
    m.spread.push_back((quantile(ratios[i], 0.75) - quantile(ratios[i], 0.25)) / 2);
    m.standard_error.push_back(median_standard_error(ratios[i]));
  }
  return m;
}

// Note [Plan finalists]
// The search chooses the strategy whose predicted ratio is least, and every prediction carries
// the errors of the measurements it sums: the least-predicted strategy is, more often than not,
// one whose errors happened to fall low (the winner's curse). On the development machine
// (bench/plan_sweep.sh, four sweeps of 9 budgets) the standard settings' predictions missed by
// -1.1% to +0.2% on average, the chosen plans' by -2.5% to -4.6%: measured slower than promised,
// worst when a plan of five to seven nearly free mechanisms summed to 1.000. So with a budget the
// planner does not stop at the prediction: it trains the plain run and the kDefaultFinalists
// (`--finalists`) strategies that fit with the least predicted ratios side by side
// (measure_step_ratios(), kDefaultFinalistSteps rounds, `--finalist-steps`) and chooses the one
// measured fastest. The prediction narrows 100-odd strategies to a few; the measurement decides
// among them, each ratio measured whole, so a plan is no longer favoured for how many errors it
// sums. What is stated for the choice is measured once more (Note [Confirming the choice]). The front (and its monotonicity) stays the
// model's; choosing among measured finalists is no longer exact under the model but cannot be
// slower than the model's choice by more than the measurement's noise, since that is a finalist.
std::vector<PlanEstimate> plan_finalists(const std::vector<PlanEstimate>& estimates,
                                         int64_t budget, int n) {
  TORCH_CHECK(n >= 1, "actmem::plan_finalists: at least one finalist, got ", n);
  std::vector<PlanEstimate> fits;
  for (const auto& e : estimates) {
    if (e.peak_bytes <= budget && !e.strategy.plain()) fits.push_back(e);
  }
  std::stable_sort(fits.begin(), fits.end(), [](const PlanEstimate& a, const PlanEstimate& b) {
    if (a.step_ratio != b.step_ratio) return a.step_ratio < b.step_ratio;
    return a.peak_bytes < b.peak_bytes;
  });
  const auto plain = std::find_if(estimates.begin(), estimates.end(),
                                  [](const PlanEstimate& e) { return e.strategy.plain(); });
  if (plain != estimates.end() && plain->peak_bytes <= budget) fits.insert(fits.begin(), *plain);
  if (fits.size() > static_cast<size_t>(n)) fits.resize(static_cast<size_t>(n));
  return fits;
}

// Note [Confirming the choice]
// Choosing the finalist measured fastest brings the winner's curse back on a smaller scale: among
// finalists whose true ratios nearly tie, the one chosen is, more often than not, one whose
// finalist rounds happened to run fast, so its finalist ratio understates what it costs. So the
// ratio the planner states is not the one it chose by: the choice is timed again against the
// plain step alone, in rounds of its own (two trainers a round, so cheap), until its standard
// error reaches the precision wanted (Note [Rounds until sure]). That measurement is independent
// of the choice, so it is as likely above the truth as below.
std::vector<PlanEstimate> timed_finalists(const TransformerConfig& base,
                                          const TrainingConfig& training,
                                          const std::vector<PlanEstimate>& estimates,
                                          int64_t budget, int n, int steps,
                                          const TimedRounds& confirm,
                                          const std::function<void(const std::string&)>& progress) {
  std::vector<PlanEstimate> finalists = plan_finalists(estimates, budget, n);
  if (finalists.size() < 2) return {};  // nothing to choose between
  std::vector<Strategy> runs = {Strategy{}};  // the reference, plain, first
  for (const auto& f : finalists) {
    if (!f.strategy.plain()) runs.push_back(f.strategy);
  }
  const MeasuredRatios m = measure_step_ratios(base, training, runs, TimedRounds::fixed(steps),
                                               progress);
  for (auto& f : finalists) {
    const auto i = static_cast<size_t>(std::find(runs.begin(), runs.end(), f.strategy) - runs.begin());
    f.finalist_ratio = m.ratio[i];
    f.finalist_ratio_spread = m.spread[i];
  }
  std::stable_sort(finalists.begin(), finalists.end(),
                   [](const PlanEstimate& a, const PlanEstimate& b) {
                     return a.finalist_ratio < b.finalist_ratio;
                   });
  PlanEstimate& chosen = finalists.front();
  if (chosen.strategy.plain()) return finalists;  // the plain step is its own reference
  TimedRounds again = confirm;
  again.watch = {1};
  const MeasuredRatios c = measure_step_ratios(
      base, training, {Strategy{}, chosen.strategy}, again, [&progress](const std::string& line) {
        if (progress) progress("confirming the choice, " + line);
      });
  chosen.confirmed_ratio = c.ratio[1];
  chosen.confirmed_ratio_error = c.standard_error[1];
  chosen.confirmed_rounds = c.rounds;
  return finalists;
}

// Note [Planner cost basis]
// The time side is measured per mechanism, not per strategy: the plain step, each recompute
// module alone, full recompute of every layer (uniform 1), each offload group alone (a group
// that cannot offload alone, in the smallest legal set holding it) and layer-level offload of
// L - 1 layers, all in the same rounds in a new order each round, each ratio taken against the
// plain step of the same round (Note [Honest step ratios] in step_rounds.h). A strategy's predicted
// ratio is 1 + the sum of its mechanisms' extra fractions: each recompute module; each offload
// group that moves bytes under the strategy's selective set (one that moves nothing there, every
// tensor it would take being recomputed or under the size threshold, costs nothing); full
// recompute of n layers (block n) at n/L of every layer's (uniform N rebuilds every layer once,
// whatever N); layer offload of K layers at K/(L - 1) of L - 1 layers'. No strategy is predicted
// faster than plain. Each mechanism's extra is kept as measured, below 0 too. A nearly free
// mechanism (most offload groups here) measures a little above or below 0; counting the ones
// below as 0 (as this did up to cost format 3) biases every such mechanism upwards by about 0.4
// times the standard error of its median (E[max(0, X)] for X centred on 0), +0.02 to +0.03 at 5
// rounds with the per-round spreads seen on 2 cores, and a plan of three or four offload groups
// collected it three or four times. Only the strategy's total is bounded, at the plain step.
// Signed or clamped, a sum of many noisy extras is what the search exploits: Note [Plan
// finalists]. (Fitting the selective and offload extras by least squares to a design of 12 mixed
// strategies instead of timing each alone was tried: the same sweep's chosen plans missed by as
// much, the spreads grew, and the profile took a third longer; not kept.)
//
// Note [Planner uncertainty]
// "How sure is that?": each mechanism's spread is half the interquartile range of its per-round
// ratios (on the scale of its extra fraction: /L for full-layer); a group measured with others
// takes the set's spread and theirs in quadrature. A strategy's spread adds its mechanisms' in
// quadrature, each times its count (n layers of full recompute: n times full-layer's), as for
// independent measurements. Printed beside every predicted ratio; two plans whose ratios differ
// by less than their spreads are a tie on this machine.
PlanCosts profile_costs(const TransformerConfig& base, const TrainingConfig& training,
                        const TimedRounds& rounds,
                        const std::function<void(const std::string&)>& progress) {
  const std::vector<Strategy> all = legal_strategies(base);
  auto say = [&progress](const std::string& line) {
    if (progress) progress(line);
  };
  PlanCosts costs;
  costs.threads = at::get_num_threads();
  // First, in the fresh process: the plain step alone, as a later reuse will time it (Note
  // [Machine speed check]).
  say("timing the plain step alone");
  costs.solo_step_s = solo_plain_step_s(base, training, kSpeedCheckSteps);
  const TrainingConfig one = probe_training(training, base, 2);

  // Memory: the plain model's static bytes and optimizer peak (alone in the process), then one
  // measurement per distinct tail.
  {
    const SecondStep plain = second_step(Strategy{}.apply(base), one);
    const IterationStats& st = plain.stats;
    // Held when the forward starts (the batch included): the step's peak less the activation
    // peak, unless the optimizer step is the peak; then what the step ends with.
    costs.static_bytes = st.peak_device_bytes > st.optimizer_peak_bytes
                             ? st.peak_device_bytes - st.activation_peak_bytes
                             : plain.trainer->memory().current_bytes();
    costs.optimizer_peak_bytes = st.optimizer_peak_bytes;
  }
  for (const auto& s : all) {
    if (s.offload_modules.empty()) continue;
    // Per selective set, its widest offload set measures every group that set allows.
    const Strategy* widest = &s;
    for (const auto& o : all) {
      if (o.recompute_modules == s.recompute_modules && o.full_method == RecomputeMethod::kNone &&
          o.offload_modules.size() > widest->offload_modules.size()) {
        widest = &o;
      }
    }
    if (widest != &s || costs.offloaded.count(offload_key(s.recompute_modules, s.offload_modules[0]))) {
      continue;
    }
    say("measuring what " + s.name() + " offloads");
    const SecondStep run = second_step(s.apply(base), one);
    for (const auto& g : s.offload_modules) costs.offloaded[offload_key(s.recompute_modules, g)] = 0;
    for (const auto& row : run.trainer->offloader()->summary()) {
      costs.offloaded[offload_key(s.recompute_modules, row.name)] = row.bytes;
    }
  }
  for (const auto& s : all) {
    if (s.offload_layers == 0) continue;
    say("measuring what " + s.name() + " offloads");
    const SecondStep run = second_step(s.apply(base), one);
    int64_t bytes = 0;
    for (const auto& row : run.trainer->offloader()->summary()) bytes += row.bytes;
    costs.offloaded[layer_offload_key(s.offload_layers)] = bytes;
  }
  std::vector<Tail> tails;
  for (const auto& s : all) {
    Tail tail = tail_of(base, moving_groups(base, s, costs));
    if (costs.transient.count(tail.key)) continue;
    costs.transient[tail.key] = 0;
    tails.push_back(std::move(tail));
  }
  for (size_t i = 0; i < tails.size(); ++i) {
    say("measuring the backward transient " + std::to_string(i + 1) + "/" +
        std::to_string(tails.size()));
    const IterationStats st = second_step(tails[i].probe, one).stats;
    costs.transient[tails[i].key] = st.activation_peak_bytes - st.activation_bytes;
  }

  // Time: each mechanism alone against the plain step (Note [Planner cost basis]).
  std::vector<std::pair<std::string, Strategy>> basis = {{"plain", Strategy{}}};
  // A group that cannot offload alone (attn_proj needs core_attn) is measured in the smallest
  // legal set holding it, less the others' measured extra.
  std::map<std::string, std::vector<OffloadModule>> measured_with;  // by group name
  for (const auto& s : all) {
    if (s.recompute_modules.size() == 1 && s.offload_modules.empty()) {
      basis.push_back({std::string("recompute:") + to_string(s.recompute_modules[0]), s});
    }
    if (s.recompute_modules.empty() && s.full_method == RecomputeMethod::kNone) {
      for (const auto g : s.offload_modules) {
        auto& best = measured_with[to_string(g)];
        if (best.empty() || s.offload_modules.size() < best.size()) best = s.offload_modules;
      }
    }
  }
  for (const auto& [g, set] : measured_with) {
    Strategy s;
    s.offload_modules = set;
    basis.push_back({"offload-set:" + join_names(set, "+"), s});
  }
  for (const auto& s : all) {
    if (s.full_method == RecomputeMethod::kUniform && s.full_layers == 1) {
      basis.push_back({"full-layer", s});
    }
    // Layer-level offload of every layer it may take (L - 1), charged per layer.
    if (s.offload_layers == base.num_layers - 1) basis.push_back({"layer-offload", s});
  }
  std::vector<Strategy> runs;
  for (const auto& entry : basis) runs.push_back(entry.second);
  const size_t n = basis.size();
  const std::string what = "timing " + std::to_string(n) + " mechanisms: ";
  say(what + "warming up (not timed)");
  TimedRounds every = rounds;
  every.watch.clear();  // every mechanism
  const MeasuredRatios m = measure_step_ratios(
      base, training, runs, every, [&](const std::string& line) { say(what + line); },
      /*compute_digest=*/false);
  costs.steps = m.rounds;
  for (size_t i = 0; i < n; ++i) costs.round_step_s[basis[i].first] = m.step_s[i];
  costs.plain_step_s = median(m.step_s[0]);
  const double L = static_cast<double>(base.num_layers);
  std::map<std::string, double> set_extra, set_spread;
  for (size_t i = 1; i < n; ++i) {
    double extra = m.ratio[i] - 1.0;  // signed (Note [Planner cost basis])
    double spread = m.spread[i];
    if (basis[i].first == "full-layer") extra /= L, spread /= L;
    if (basis[i].first == "layer-offload") extra /= L - 1, spread /= L - 1;
    if (basis[i].first.rfind("offload-set:", 0) == 0) {
      const std::string set = join_names(basis[i].second.offload_modules, "+");
      set_extra[set] = extra;
      set_spread[set] = spread;
    } else {
      costs.extra[basis[i].first] = extra;
      costs.spread[basis[i].first] = spread;
    }
  }
  // Singletons first, then each group measured with others as the set's extra less theirs (its
  // spread: the set's and theirs in quadrature).
  for (const auto& [g, set] : measured_with) {
    if (set.size() > 1) continue;
    costs.extra["offload:" + g] = set_extra.at(g);
    costs.spread["offload:" + g] = set_spread.at(g);
  }
  for (const auto& [g, set] : measured_with) {
    if (set.size() == 1) continue;
    double extra = set_extra.at(join_names(set, "+"));
    double variance = std::pow(set_spread.at(join_names(set, "+")), 2);
    for (const auto o : set) {
      const std::string other = to_string(o);
      if (other == g) continue;
      const auto it = costs.extra.find("offload:" + other);
      TORCH_CHECK(it != costs.extra.end(), "actmem::profile_costs: offload group ", g,
                  " is measured with ", other, ", which was not measured alone");
      extra -= it->second;
      variance += std::pow(costs.spread.at("offload:" + other), 2);
    }
    costs.extra["offload:" + g] = extra;
    costs.spread["offload:" + g] = std::sqrt(variance);
  }
  return costs;
}

std::vector<PlanEstimate> estimate_plans(const TransformerConfig& base,
                                         const std::vector<Strategy>& strategies,
                                         const PlanCosts& costs) {
  std::vector<PlanEstimate> out;
  const double L = static_cast<double>(base.num_layers);
  auto extra = [&costs](const std::string& key) {
    const auto it = costs.extra.find(key);
    TORCH_CHECK(it != costs.extra.end(), "actmem::estimate_plans: the costs have no measurement of '",
                key, "' (profile the same model)");
    return it->second;
  };
  for (const auto& s : strategies) {
    const TransformerConfig c = s.apply(base);
    PlanEstimate e;
    e.strategy = s;
    e.kept_bytes = predict_activation_bytes(c).total;
    auto offloaded = [&costs, &s](const std::string& key) {
      const auto it = costs.offloaded.find(key);
      TORCH_CHECK(it != costs.offloaded.end(), "actmem::estimate_plans: the costs have no "
                  "measurement of '", key, "' for ", s.name(), " (profile the same model)");
      return it->second;
    };
    for (const auto& g : s.offload_modules) e.kept_bytes -= offloaded(offload_key(s.recompute_modules, g));
    if (s.offload_layers > 0) e.kept_bytes -= offloaded(layer_offload_key(s.offload_layers));
    const auto tail = costs.transient.find(tail_of(base, moving_groups(base, s, costs)).key);
    TORCH_CHECK(tail != costs.transient.end(), "actmem::estimate_plans: no transient measured for '",
                s.name(), "' (profile the same model)");
    e.peak_bytes = std::max(costs.static_bytes + e.kept_bytes + tail->second,
                            costs.optimizer_peak_bytes);
    double ratio = 1.0, variance = 0.0;
    auto add = [&](const std::string& key, double times) {
      ratio += times * extra(key);
      const auto it = costs.spread.find(key);
      if (it != costs.spread.end()) variance += std::pow(times * it->second, 2);
    };
    for (const auto& key : mixed_mechanisms(s, costs)) add(key, 1.0);
    if (s.full_method == RecomputeMethod::kUniform) add("full-layer", L);
    if (s.full_method == RecomputeMethod::kBlock) {
      add("full-layer", static_cast<double>(std::min<int64_t>(s.full_layers, base.num_layers)));
    }
    if (s.offload_layers > 0) add("layer-offload", static_cast<double>(s.offload_layers));
    e.step_ratio = std::max(1.0, ratio);  // nothing is faster than plain (Note [Planner cost basis])
    e.step_ratio_spread = std::sqrt(variance);
    out.push_back(std::move(e));
  }
  return out;
}

std::string copies_in_flight_note(const TransformerConfig& base, const Strategy& chosen) {
  if (base.fine_grained_offloading_max_inflight_offloads >= 0 ||
      (chosen.offload_modules.empty() && chosen.offload_layers == 0)) {
    return "";
  }
  return "note: offload copies may stay in flight (no --fine-grained-offloading-max-inflight-"
         "offloads), so the peak depends on when the copy thread runs and may exceed the "
         "prediction; plan and train with --fine-grained-offloading-max-inflight-offloads 0 for "
         "the predicted peak";
}

std::vector<PlanEstimate> pareto_front(std::vector<PlanEstimate> estimates) {
  std::sort(estimates.begin(), estimates.end(), [](const PlanEstimate& a, const PlanEstimate& b) {
    if (a.peak_bytes != b.peak_bytes) return a.peak_bytes < b.peak_bytes;
    if (a.step_ratio != b.step_ratio) return a.step_ratio < b.step_ratio;
    return complexity(a.strategy) < complexity(b.strategy);
  });
  std::vector<PlanEstimate> front;
  double best = std::numeric_limits<double>::infinity();
  for (auto& e : estimates) {
    if (e.step_ratio < best) {
      best = e.step_ratio;
      front.push_back(std::move(e));
    }
  }
  return front;
}

const PlanEstimate& choose_plan(const std::vector<PlanEstimate>& front, int64_t budget,
                                const std::string& lower_it) {
  TORCH_CHECK(!front.empty(), "actmem::choose_plan: no strategy to choose from");
  const PlanEstimate* chosen = nullptr;
  for (const auto& e : front) {
    if (e.peak_bytes <= budget) chosen = &e;
  }
  TORCH_CHECK(chosen != nullptr, "actmem plan: no strategy fits a memory budget of ",
              format_bytes(static_cast<double>(budget)), " (", budget, " bytes): the smallest "
              "predicted peak is ", format_bytes(static_cast<double>(front.front().peak_bytes)),
              " (", front.front().peak_bytes, " bytes), with ", front.front().strategy.name(),
              " (", front.front().strategy.flags(), "). To go lower: ",
              lower_it.empty() ? "more tensor parallelism (--tensor-model-parallel-size with "
                                 "--sequence-parallel splits the activations and the weights), "
                                 "pipeline stages (--pipeline-model-parallel-size), the "
                                 "distributed optimizer over data-parallel ranks "
                                 "(--use-distributed-optimizer), a smaller --micro-batch-size, "
                                 "or 16-bit training (--bf16)"
                               : lower_it);
  return *chosen;
}

}  // namespace actmem
