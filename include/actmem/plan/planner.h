// planner.h — `actmem plan`: the fastest activation strategy (keep, recompute, offload) whose
// step fits a device-memory budget, chosen from costs measured on this machine (docs/planner.md).
//
// Note [Planner]
// Every strategy the planner considers is a set of Megatron flags that make_activation_plan()
// accepts, so nothing it proposes is refused by train, and every one is bitwise exact (the
// mechanisms are; the verify step checks it again). For each strategy it predicts
//   device peak = static bytes (parameters, gradients, optimizer state: measured before a forward)
//               + kept bytes (the exact predictor, activation_bytes.h, for the whole model)
//               + backward transient (measured on a truncated copy of the model: see below),
// and a step-time ratio to the plain step, 1 + the sum of the measured extra time of each
// mechanism the strategy uses (a recompute module, a full-recompute layer, an offload group),
// each measured alone against the plain step in interleaved rounds (Note
// [Honest step ratios] in step_rounds.h). The search enumerates every legal strategy (hundreds
// for a dense model), so the chosen plan is the optimum under this model, not an approximation
// of it; the Pareto front (peak against ratio) is the strategies no other beats on both.
//
// Offload moves bytes off the device after the forward: the kept bytes less what the whole
// model offloads, measured once per selective set (Note [Offloaded bytes] in planner.cpp).
//
// The backward transient: after the forward a step holds the kept bytes; the backward adds, at
// its peak, what the first layers it reaches rebuild (a recomputed module or chunk), reload
// (offload) or create (gradients of the largest tensors). That depends on the plan of the last
// layers and the head only, so it is measured once per distinct tail on a copy of the model with
// at most three layers (a uniform chunk of N layers: N), one micro-batch, and added to the whole
// model's kept bytes. Offload groups that move nothing (all their tensors under the size
// threshold) are left out of a tail: they change nothing on the device. An MoE model is probed
// whole (its layers route by their inputs; a shorter copy routes differently).
#pragma once

#include "actmem/config/config.h"
#include "actmem/config/strategy.h"

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace actmem {

/// Every strategy make_activation_plan() accepts for `base`'s shape: plain; every non-empty set
/// of the applicable recompute modules; full uniform and block recompute with every N; every
/// legal set of fine-grained offload groups, alone and with every selective set; layer-level
/// offload of every K Megatron allows. Refuses what is not planned yet: pipeline, tensor and
/// expert parallelism, MoE capacity without padding.
std::vector<Strategy> legal_strategies(const TransformerConfig& base);

/// The enumeration behind legal_strategies() without its refusals (any parallel layout): every
/// strategy make_activation_plan() accepts for `base`, full recompute's N up to one model chunk's
/// layers, and with `layer_offload` every K of --cpu-offloading-num-layers Megatron allows.
std::vector<Strategy> enumerate_strategies(const TransformerConfig& base, bool layer_offload);

/// A memory budget in bytes: an integer count of bytes, or a number with a unit (B, K/KB/KiB,
/// M/MB/MiB, G/GB/GiB, T/TB/TiB; K, M, G, T mean binary units, KB/MB/GB/TB decimal ones, as in
/// "8GiB", "7.5G", "900MiB", "16GB"). Throws for anything else or a value below one byte.
int64_t parse_memory_budget(const std::string& text);

/// One mechanism whose extra step time PlanCosts records (Note [Planner cost basis] in
/// planner.cpp): a selective recompute module over all layers, one layer of full recompute, a
/// fine-grained offload group over all layers, or one layer of layer-level offload. key() is its
/// name in a costs record ("recompute:core_attn", "full-layer", "offload:mlp_norm",
/// "layer-offload"); from_key() its inverse, throwing for a name it does not know.
struct Mechanism {
  enum class Kind { kRecompute, kFullLayer, kOffload, kLayerOffload };
  Kind kind = Kind::kFullLayer;
  RecomputeModule module{};  // kRecompute only
  OffloadModule group{};     // kOffload only

  static Mechanism recompute(RecomputeModule m) { return {Kind::kRecompute, m, {}}; }
  static Mechanism full_layer() { return {Kind::kFullLayer, {}, {}}; }
  static Mechanism offload(OffloadModule g) { return {Kind::kOffload, {}, g}; }
  static Mechanism layer_offload() { return {Kind::kLayerOffload, {}, {}}; }
  std::string key() const;
  static Mechanism from_key(const std::string& key);
  bool operator<(const Mechanism& o) const;  // the order of key(), so a record reads as before
  bool operator==(const Mechanism& o) const { return key() == o.key(); }
};

/// What the profiling run measured (Note [Planner]).
struct PlanCosts {
  int64_t static_bytes = 0;  // held before a forward: parameters, gradients, optimizer state
  int64_t optimizer_peak_bytes = 0;  // the step's peak outside forward and backward
  double plain_step_s = 0;           // median step of the plain strategy
  /// Median step of the plain strategy alone in the process, timed before anything else of the
  /// profile: what a reuse of the costs checks the machine's speed against (Note [Machine speed
  /// check] in planner.cpp).
  double solo_step_s = 0;
  /// Extra step time over plain, as a fraction of the plain step, of each mechanism alone (Note
  /// [Planner cost basis] in planner.cpp): a recompute module or an offload group over all
  /// layers, one layer fully recomputed, one layer of layer-level offload.
  std::map<Mechanism, double> extra;
  /// How far each mechanism's per-round measurement spread: half the interquartile range of its
  /// per-round ratios to the plain step, on the scale of `extra` (Note [Planner uncertainty]).
  std::map<Mechanism, double> spread;
  /// The measured backward transient of each distinct tail (Note [Planner]), by tail key.
  std::map<std::string, int64_t> transient;
  /// Bytes one forward of the whole model offloads (Note [Offloaded bytes] in planner.cpp), per
  /// fine-grained group under each selective set, and per K of layer-level offload.
  std::map<std::string, int64_t> offloaded;
  /// Every timed round's step time of each measured trainer, by the name it is measured under
  /// ("plain", "recompute:MOD", "full-layer", "offload-set:G+...", "layer-offload"): what the
  /// extras were taken from, kept so a reader can recompute them (optional in a record).
  std::map<std::string, std::vector<double>> round_step_s;
  int steps = 0;  // timed rounds run (Note [Rounds until sure])
  int threads = 0;
  nlohmann::json to_json() const;
  /// The inverse of to_json(); throws for a record that lacks a field.
  static PlanCosts from_json(const nlohmann::json& j);
};

/// How many timed rounds measure_step_ratios() runs (Note [Rounds until sure] in planner.cpp):
/// at least `min_rounds`; then, while a watched strategy's ratio has a standard error above
/// `precision`, more, up to `max_rounds`. `precision` 0: exactly `min_rounds`.
struct TimedRounds {
  int min_rounds = 10;
  int max_rounds = 10;
  double precision = 0;       // the standard error wanted of each watched ratio (0.01: 1%)
  std::vector<size_t> watch;  // indices into the strategies; empty: every one but the plain
  /// `rounds` exactly.
  static TimedRounds fixed(int rounds) { return {rounds, rounds, 0.0, {}}; }
  /// At least `fewest` rounds (always: the cap bounds only the rounds after them), then until
  /// `precision`, at most `most` in all.
  static TimedRounds until_sure(int fewest, int most, double precision) {
    return {fewest, fewest > most ? fewest : most, precision, {}};
  }
};
/// Note [Rounds until sure]: the default precision of a measured step ratio (a standard error of
/// 1%) and the most rounds spent reaching it; for the profile, where every mechanism is watched
/// and a round steps them all, 2% and at most 30 rounds.
constexpr double kDefaultRatioPrecision = 0.01;
constexpr int kDefaultMaxTimedRounds = 60;
constexpr double kDefaultProfilePrecision = 0.02;
constexpr int kMaxProfileRounds = 30;

/// What a profile's costs depend on (Note [Planner cost cache] in planner.cpp): the model without
/// its activation flags, the micro-batches per step, the device, the threads, the BLAS
/// and the library versions. Two profiles with equal keys measured the same thing.
nlohmann::json plan_costs_key(const TransformerConfig& base, const TrainingConfig& training);

/// How far the plain step may have moved since a profile before its costs are measured again
/// (Note [Machine speed check] in planner.cpp): 10%.
constexpr double kCostSpeedTolerance = 0.10;

/// The median time of `steps` steps of `base` trained plainly and alone, after warming up until
/// the allocator is steady (Note [Warm until the allocator is steady] in step_rounds.h).
double solo_plain_step_s(const TransformerConfig& base, const TrainingConfig& training, int steps);

/// The costs of `base` for `training`: read from the cache file `costs_path` when it holds a
/// profile with this key (plan_costs_key) and the machine's speed has not changed by more than
/// `speed_tolerance` since (Note [Machine speed check]; 0: not checked), else profiled (as many
/// timed rounds as `rounds` asks) and, when `costs_path` is not empty, written there (Note
/// [Planner cost cache]).
/// `note` (may be null) says which ("costs reused from F ...", "costs written to F", "costs
/// profiled again: ..."). Throws for a file that is not a cost record. `progress` as in
/// profile_costs().
PlanCosts plan_costs(const TransformerConfig& base, const TrainingConfig& training,
                     const TimedRounds& rounds, const std::string& costs_path,
                     const std::function<void(const std::string&)>& progress = {},
                     std::string* note = nullptr, double speed_tolerance = kCostSpeedTolerance);

/// One strategy's prediction.
struct PlanEstimate {
  Strategy strategy;
  int64_t kept_bytes = 0;   // activation bytes the forward leaves on the device (exact predictor
                            // less what offload moves)
  int64_t peak_bytes = 0;   // predicted device peak of a step
  double step_ratio = 1.0;  // predicted step time over the plain step's
  double step_ratio_spread = 0;  // its uncertainty from the measurements' spread (0: analytic)
  /// Measured as a finalist (Note [Plan finalists] in planner.cpp): its step ratio among the
  /// finalists' rounds and that ratio's spread; 0 when it was not.
  double finalist_ratio = 0;
  double finalist_ratio_spread = 0;
  /// The choice among finalists measured again, against the plain step alone, in rounds of its
  /// own (Note [Confirming the choice] in planner.cpp): its ratio, that ratio's standard error
  /// and the rounds timed; 0 when it was not.
  double confirmed_ratio = 0;
  double confirmed_ratio_error = 0;
  int confirmed_rounds = 0;
  /// What the planner states for this strategy: the confirmed measurement, else the finalist
  /// one, else the prediction.
  double planned_ratio() const {
    return confirmed_ratio > 0 ? confirmed_ratio : finalist_ratio > 0 ? finalist_ratio : step_ratio;
  }
  nlohmann::json to_json() const;
};

/// Step ratios of strategies trained side by side from the same seed (Note [Honest step ratios]
/// in step_rounds.h).
struct MeasuredRatios {
  std::vector<double> ratio;  // per strategy: median over rounds of its step / the plain step's
  std::vector<double>
      spread;  // per strategy: half the interquartile range of those per-round ratios
  std::vector<double> standard_error;       // per strategy: median_standard_error() of those ratios
  std::vector<std::vector<double>> step_s;  // per strategy: every timed round's step time
  std::vector<bool> bitwise;  // per strategy: every round's loss and gradient digest the plain
                              // run's (the loss only without digests)
  int warm_up_rounds = 0;
  int rounds = 0;  // timed rounds run
};

/// Trains `strategies` of `base` (the first must be plain) side by side: untimed rounds until the
/// allocator is steady (Note [Warm until the allocator is steady]), then timed rounds in a new
/// order each, as many as `rounds` asks, every round's loss (and with `compute_digest` the
/// gradient digest) compared with the plain run's. `training`'s global batch is kept; its
/// evaluation, save and load are not run. `progress` (may be empty) is called with a line per
/// round.
MeasuredRatios measure_step_ratios(const TransformerConfig& base, const TrainingConfig& training,
                                   const std::vector<Strategy>& strategies,
                                   const TimedRounds& rounds,
                                   const std::function<void(const std::string&)>& progress = {},
                                   bool compute_digest = true);

/// Note [Plan finalists] in planner.cpp: how many strategies `plan --memory-budget` and `train
/// --memory-budget` time side by side before choosing.
constexpr int kDefaultFinalists = 4;
/// Their timed rounds: few trainers, so more rounds than the profile's for the same time.
constexpr int kDefaultFinalistSteps = 10;

/// The at most `n` strategies of `estimates` that fit `budget` with the least predicted step
/// ratios (ties: the smaller peak), fastest first.
std::vector<PlanEstimate> plan_finalists(const std::vector<PlanEstimate>& estimates, int64_t budget,
                                         int n);

/// plan_finalists() of `estimates` for `budget`, timed against the plain step (`steps` rounds of
/// measure_step_ratios()) and returned with their finalist ratios set, the one measured fastest
/// first (ties: the prediction's order); that one is then timed again against the plain step
/// alone, for as many rounds as `confirm` asks (Note [Confirming the choice]; `confirm.watch` is
/// ignored), and its confirmed ratio set. Empty when fewer than two fit (nothing to choose).
std::vector<PlanEstimate> timed_finalists(
    const TransformerConfig& base, const TrainingConfig& training,
    const std::vector<PlanEstimate>& estimates, int64_t budget, int n, int steps,
    const TimedRounds& confirm, const std::function<void(const std::string&)>& progress = {});

/// Profiles `base` (its own activation flags ignored) on this machine: the plain step alone (Note
/// [Machine speed check]), one forward-backward per distinct tail and per offload set, then
/// interleaved timed rounds of every mechanism alone (Note [Planner cost basis]) after warming up
/// until the allocator is steady, as many as `rounds` asks (`rounds.watch` is ignored: every
/// mechanism is watched). `progress` (may be empty) is called with a line per phase.
PlanCosts profile_costs(const TransformerConfig& base, const TrainingConfig& training,
                        const TimedRounds& rounds,
                        const std::function<void(const std::string&)>& progress = {});

/// The prediction for every strategy in `strategies` from `costs` (profile_costs() of `base`).
std::vector<PlanEstimate> estimate_plans(const TransformerConfig& base,
                                         const std::vector<Strategy>& strategies,
                                         const PlanCosts& costs);

/// Everything `actmem plan` and `train --memory-budget` compute for a model measured here:
/// legal_strategies(), plan_costs(), estimate_plans() and pareto_front().
struct MeasuredPlan {
  std::vector<Strategy> strategies;
  PlanCosts costs;
  std::string costs_note;  // plan_costs()'s note
  std::vector<PlanEstimate> estimates;
  std::vector<PlanEstimate> front;
};
MeasuredPlan measured_plan(const TransformerConfig& base, const TrainingConfig& training,
                           const TimedRounds& rounds, const std::string& costs_path,
                           const std::function<void(const std::string&)>& progress = {},
                           double speed_tolerance = kCostSpeedTolerance);

/// A warning for a chosen strategy that offloads while `base` lets copies stay in flight
/// (fine_grained_offloading_max_inflight_offloads < 0): its peak then depends on when the copy
/// thread runs, so the prediction is not guaranteed. Empty otherwise.
std::string copies_in_flight_note(const TransformerConfig& base, const Strategy& chosen);

/// The Pareto front of `estimates`: sorted by peak, each strictly faster than every one with a
/// smaller or equal peak (ties in ratio keep the smaller peak).
std::vector<PlanEstimate> pareto_front(std::vector<PlanEstimate> estimates);

/// The fastest estimate whose peak fits `budget` (the front's entry with the largest peak <=
/// budget). Throws when none fits, saying the smallest peak any strategy reaches, with which
/// strategy, and what else would lower it: `lower_it` (empty: the flags of a run here).
const PlanEstimate& choose_plan(const std::vector<PlanEstimate>& front, int64_t budget,
                                const std::string& lower_it = "");

}  // namespace actmem
