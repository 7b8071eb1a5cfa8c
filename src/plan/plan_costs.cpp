// plan_costs.cpp — the planner's measurements (Note [Planner] in planner.h): the profiling run
// (what each strategy offloads and holds at its peak, each mechanism's time against the plain
// step), the costs file and its cache key, the machine-speed check, and the step ratios measured
// in rounds until sure.
#include "actmem/plan/planner.h"

#include "planner_detail.h"

#include "actmem/base/environment.h"
#include "actmem/base/output_file.h"
#include "actmem/base/report.h"
#include "actmem/offload/activation_offloader.h"
#include "actmem/train/step_rounds.h"
#include "actmem/train/trainer.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/StringUtil.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <memory>
#include <optional>
#include <sstream>

namespace actmem {

using namespace plan_detail;  // NOLINT: the planner's own helpers (planner_detail.h)

namespace {
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

}  // namespace

std::string Mechanism::key() const {
  switch (kind) {
    case Kind::kRecompute:
      return std::string("recompute:") + to_string(module);
    case Kind::kFullLayer:
      return "full-layer";
    case Kind::kOffload:
      return std::string("offload:") + to_string(group);
    case Kind::kLayerOffload:
      return "layer-offload";
  }
  TORCH_CHECK(false, "actmem::Mechanism::key: unknown kind ", static_cast<int>(kind));
}

Mechanism Mechanism::from_key(const std::string& key) {
  if (key == "full-layer") return full_layer();
  if (key == "layer-offload") return layer_offload();
  const size_t colon = key.find(':');
  const std::string head = key.substr(0, colon), name = key.substr(colon + 1);
  if (colon != std::string::npos && head == "recompute") {
    if (const auto m = parse_recompute_module(name)) return recompute(*m);
  }
  if (colon != std::string::npos && head == "offload") {
    if (const auto g = parse_offload_module(name)) return offload(*g);
  }
  TORCH_CHECK(false, "actmem::Mechanism::from_key: '", key,
              "' is not a mechanism (expected recompute:MODULE, offload:GROUP, full-layer or "
              "layer-offload)");
}

bool Mechanism::operator<(const Mechanism& o) const {
  return key() < o.key();
}

namespace {
std::map<std::string, double> by_key(const std::map<Mechanism, double>& by_mechanism) {
  std::map<std::string, double> out;
  for (const auto& [m, value] : by_mechanism) out[m.key()] = value;
  return out;
}

std::map<Mechanism, double> by_mechanism(const std::map<std::string, double>& by_key) {
  std::map<Mechanism, double> out;
  for (const auto& [key, value] : by_key) out[Mechanism::from_key(key)] = value;
  return out;
}
}  // namespace

nlohmann::json PlanCosts::to_json() const {
  return {{"static_bytes", static_bytes},
          {"optimizer_peak_bytes", optimizer_peak_bytes},
          {"plain_step_s", plain_step_s},
          {"solo_plain_step_s", solo_step_s},
          {"extra_step_fraction", by_key(extra)},
          {"extra_step_fraction_spread", by_key(spread)},
          {"backward_transient_bytes", transient},
          {"offloaded_bytes", offloaded},
          {"round_step_times_s", round_step_s},
          {"timed_rounds", steps},
          {"threads", threads}};
}

PlanCosts PlanCosts::from_json(const nlohmann::json& j) {
  try {
    PlanCosts c;
    c.static_bytes = j.at("static_bytes").get<int64_t>();
    c.optimizer_peak_bytes = j.at("optimizer_peak_bytes").get<int64_t>();
    c.plain_step_s = j.at("plain_step_s").get<double>();
    c.solo_step_s = j.at("solo_plain_step_s").get<double>();
    c.extra = by_mechanism(j.at("extra_step_fraction").get<std::map<std::string, double>>());
    c.spread =
        by_mechanism(j.at("extra_step_fraction_spread").get<std::map<std::string, double>>());
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
          {"cost_format", 5}};  // 2: with the spread (Note [Planner uncertainty]); 3: layer
                                // offload; 4: signed extras (Note [Planner cost basis]); 5: the
                                // solo plain step (Note [Machine speed check])
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
  TORCH_CHECK(speed_tolerance >= 0,
              "actmem::plan_costs: the speed tolerance is a fraction >= 0 "
              "(0: not checked), got ",
              speed_tolerance);
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
                "actmem plan: --costs ", costs_path,
                " is not a cost record (no key and costs); "
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
         << " ms now, " << cached.solo_step_s * 1e3 << " ms when profiled (" << std::showpos
         << change * 100 << std::noshowpos << "%)";
      if (std::abs(change) <= speed_tolerance) {
        if (note) *note = "costs reused from " + costs_path + "; " + os.str();
        return cached;
      }
      said = "costs profiled again: the machine's speed changed since " + costs_path +
             " was measured: " + os.str() + ", more than the tolerance of " +
             std::to_string(static_cast<int>(std::lround(speed_tolerance * 100))) + "%";
    } else {
      said = "costs profiled again: " + costs_path +
             " was measured for another model, device, "
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
  TORCH_CHECK(!strategies.empty() && strategies.front().plain(),
              "actmem::measure_step_ratios: "
              "the first strategy must be plain, the reference");
  TORCH_CHECK(rounds.min_rounds >= 1 && rounds.max_rounds >= rounds.min_rounds,
              "actmem::measure_step_ratios: expected 1 <= min_rounds <= max_rounds, got ",
              rounds.min_rounds, " and ", rounds.max_rounds);
  TORCH_CHECK(rounds.precision >= 0,
              "actmem::measure_step_ratios: the precision is a standard "
              "error >= 0 (0: min_rounds exactly), got ",
              rounds.precision);
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
      m.bitwise[i] =
          m.bitwise[i] && st[i].loss == st[0].loss && st[i].grad_digest == st[0].grad_digest;
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

namespace {
// profile_costs' memory side: the plain model's static bytes and optimizer peak, what each
// offload set moves, each distinct tail's backward transient.
void measure_memory_costs(const TransformerConfig& base, const TrainingConfig& one,
                          const std::vector<Strategy>& all, PlanCosts& costs,
                          const std::function<void(const std::string&)>& say) {
  // The plain model alone in the process, then one measurement per distinct tail.
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
    if (widest != &s ||
        costs.offloaded.count(offload_key(s.recompute_modules, s.offload_modules[0]))) {
      continue;
    }
    say("measuring what " + s.name() + " offloads");
    const SecondStep run = second_step(s.apply(base), one);
    for (const auto& g : s.offload_modules)
      costs.offloaded[offload_key(s.recompute_modules, g)] = 0;
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
}

// One trainer measure_time_costs() times: the name its rounds are recorded under, the strategy,
// the mechanism it measures (none for plain and for a set of offload groups measured together)
// and how many of it the strategy holds (a layer-level mechanism over several layers).
struct TimedMechanism {
  std::string name;
  Strategy strategy;
  std::optional<Mechanism> mechanism;
  double times = 1;
};

// profile_costs' time side: each mechanism alone against the plain step (Note [Planner cost
// basis]), in the same rounds.
void measure_time_costs(const TransformerConfig& base, const TrainingConfig& training,
                        const TimedRounds& rounds, const std::vector<Strategy>& all,
                        PlanCosts& costs, const std::function<void(const std::string&)>& say) {
  const double L = static_cast<double>(base.num_layers);
  std::vector<TimedMechanism> basis = {{"plain", Strategy{}, std::nullopt}};
  // A group that cannot offload alone (attn_proj needs core_attn) is measured in the smallest
  // legal set holding it, less the others' measured extra.
  std::map<OffloadModule, std::vector<OffloadModule>> measured_with;
  for (const auto& s : all) {
    if (s.recompute_modules.size() == 1 && s.offload_modules.empty()) {
      const Mechanism m = Mechanism::recompute(s.recompute_modules[0]);
      basis.push_back({m.key(), s, m});
    }
    if (s.recompute_modules.empty() && s.full_method == RecomputeMethod::kNone) {
      for (const auto g : s.offload_modules) {
        auto& best = measured_with[g];
        if (best.empty() || s.offload_modules.size() < best.size()) best = s.offload_modules;
      }
    }
  }
  for (const auto& [g, set] : measured_with) {
    Strategy s;
    s.offload_modules = set;
    basis.push_back({"offload-set:" + join_names(set, "+"), s, std::nullopt});
  }
  for (const auto& s : all) {
    if (s.full_method == RecomputeMethod::kUniform && s.full_layers == 1) {
      basis.push_back({"full-layer", s, Mechanism::full_layer(), L});
    }
    // Layer-level offload of every layer it may take (L - 1), charged per layer.
    if (s.offload_layers == base.num_layers - 1) {
      basis.push_back({"layer-offload", s, Mechanism::layer_offload(), L - 1});
    }
  }
  std::vector<Strategy> runs;
  for (const auto& entry : basis) runs.push_back(entry.strategy);
  const size_t n = basis.size();
  const std::string what = "timing " + std::to_string(n) + " mechanisms: ";
  say(what + "warming up (not timed)");
  TimedRounds every = rounds;
  every.watch.clear();  // every mechanism
  const MeasuredRatios m = measure_step_ratios(
      base, training, runs, every, [&](const std::string& line) { say(what + line); },
      /*compute_digest=*/false);
  costs.steps = m.rounds;
  for (size_t i = 0; i < n; ++i) costs.round_step_s[basis[i].name] = m.step_s[i];
  costs.plain_step_s = median(m.step_s[0]);
  std::map<std::vector<OffloadModule>, std::pair<double, double>> set_cost;  // extra, spread
  for (size_t i = 1; i < n; ++i) {
    const double extra = (m.ratio[i] - 1.0) / basis[i].times;  // signed (Note [Planner cost basis])
    const double spread = m.spread[i] / basis[i].times;
    if (basis[i].mechanism) {
      costs.extra[*basis[i].mechanism] = extra;
      costs.spread[*basis[i].mechanism] = spread;
    } else {
      set_cost[basis[i].strategy.offload_modules] = {extra, spread};
    }
  }
  // Singletons first, then each group measured with others as the set's extra less theirs (its
  // spread: the set's and theirs in quadrature).
  for (const auto& [g, set] : measured_with) {
    if (set.size() > 1) continue;
    costs.extra[Mechanism::offload(g)] = set_cost.at(set).first;
    costs.spread[Mechanism::offload(g)] = set_cost.at(set).second;
  }
  for (const auto& [g, set] : measured_with) {
    if (set.size() == 1) continue;
    double extra = set_cost.at(set).first;
    double variance = std::pow(set_cost.at(set).second, 2);
    for (const auto other : set) {
      if (other == g) continue;
      const auto it = costs.extra.find(Mechanism::offload(other));
      TORCH_CHECK(it != costs.extra.end(), "actmem::profile_costs: offload group ", to_string(g),
                  " is measured with ", to_string(other), ", which was not measured alone");
      extra -= it->second;
      variance += std::pow(costs.spread.at(Mechanism::offload(other)), 2);
    }
    costs.extra[Mechanism::offload(g)] = extra;
    costs.spread[Mechanism::offload(g)] = std::sqrt(variance);
  }
}

}  // namespace

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

  measure_memory_costs(base, one, all, costs, say);
  measure_time_costs(base, training, rounds, all, costs, say);
  return costs;
}

}  // namespace actmem
