// step_rounds.h — several trainers timed against each other in the same rounds: what `compare`,
// the planner's profile and `plan --verify` measure step-time ratios with.
//
// Note [Honest step ratios]
// A strategy's step time is only comparable with the plain step's when both ran under the same
// conditions. So: the first rounds are not timed (allocator and thread-pool warm-up, offload's
// warmup); in every timed round each strategy runs one step, in an order shuffled from round to
// round (no strategy always runs first, or always after the same one: Note [Step round order]);
// a strategy's ratio is the median over rounds of its time divided by the plain step's time *in
// the same round*, so drift of the machine cancels. `compare` prints the range of those
// per-round ratios beside it and warns when too few rounds or a plain step that varies a lot
// cannot carry the digits.
#pragma once

#include "actmem/train/trainer.h"

#include <functional>
#include <vector>

namespace actmem {

// Note [Step round order]
// The first round runs the trainers in their order, every later one in a pseudo-random order
// drawn from a fixed seed (reproducible from run to run). An order rotated by one each round
// would not do: in all but one round per cycle every trainer then runs right after the same
// predecessor, and whatever a step leaves behind is billed to that successor every time. It was
// measured: with layer-level offload of L - 1 layers appended last to the planner's profile of
// a 4-layer MoE model, the plain step (always its successor) took 150 ms against 100 ms without
// it, and every mechanism measured as free.

/// The order of each of `rounds` rounds of `n` trainers: the first round 0, 1, ..., n - 1, every
/// later one a permutation drawn from a fixed seed (Note [Step round order]).
std::vector<std::vector<size_t>> round_orders(size_t n, int rounds);

// Note [Warm until the allocator is steady]
// The first steps of a model allocate: the tracked CPU allocator's block cache (Note [Caching the
// tracked CPU allocator's blocks] in memory_tracker.cpp) gains a block whenever a step holds more
// of a size class at once than any step before, and a step that gains blocks pays for fresh
// memory. A dense model is steady after its first step; an MoE model's sizes follow the routing
// and keep reaching new highs for tens of steps. Measured on the 4-layer MoE model of
// docs/planner.md, a plain trainer against an identical second one in `compare`: 0.73 to 1.40 per
// round after 2 warm-up steps, 0.77 to 1.13 after 15 or 40. So the planner's profile and verify
// step warm up until the cache has not grown for three rounds in a row (at least one round, at
// most kMaxWarmUpRounds), and only then time.
constexpr int kMaxWarmUpRounds = 20;

/// Untimed rounds of one step of every trainer (in the shuffled orders of round_orders()) until
/// the block cache's reserved bytes have not grown for three rounds in a row, at least
/// `min_rounds` and at most `max_rounds` (Note [Warm until the allocator is steady]). Calls
/// `after_round(round)` after each; returns the rounds run.
int warm_up_rounds(const std::vector<Trainer*>& trainers, int min_rounds, int max_rounds,
                   const std::function<void(int round)>& after_round = nullptr);

/// Runs `rounds` rounds of one training step of every trainer, in a new order each round (Note
/// [Step round order]), and after each round calls `after_round(round, stats)` with every
/// trainer's stats in trainer order. `compute_digest` as in Trainer::train_step. When `stop` is
/// given, it is asked after each round (with the rounds done) whether enough were run; returns
/// the rounds run.
int run_shuffled_rounds(
    const std::vector<Trainer*>& trainers, int rounds, bool compute_digest,
    const std::function<void(int round, const std::vector<IterationStats>&)>& after_round,
    const std::function<bool(int rounds_done)>& stop = nullptr);

}  // namespace actmem
