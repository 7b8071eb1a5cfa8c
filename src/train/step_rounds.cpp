// step_rounds.cpp — rounds of training steps, in a new order each round (Note [Honest step ratios]
// and Note [Step round order] in step_rounds.h).
#include "actmem/train/step_rounds.h"

#include "actmem/memory/memory_tracker.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <numeric>
#include <random>

namespace actmem {

std::vector<std::vector<size_t>> round_orders(size_t n, int rounds) {
  // Note [Step round order]: each round in a new order, the same in every run (a fixed seed).
  std::vector<std::vector<size_t>> orders;
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  std::mt19937_64 rng(0x61637431);
  for (int round = 0; round < rounds; ++round) {
    if (round > 0) std::shuffle(order.begin(), order.end(), rng);
    orders.push_back(order);
  }
  return orders;
}

int run_shuffled_rounds(
    const std::vector<Trainer*>& trainers, int rounds, bool compute_digest,
    const std::function<void(int round, const std::vector<IterationStats>&)>& after_round,
    const std::function<bool(int rounds_done)>& stop) {
  std::vector<IterationStats> stats(trainers.size());
  const std::vector<std::vector<size_t>> orders = round_orders(trainers.size(), rounds);
  for (int round = 0; round < rounds; ++round) {
    for (const size_t i : orders[static_cast<size_t>(round)]) {
      stats[i] = trainers[i]->train_step(compute_digest);
    }
    if (after_round) after_round(round, stats);
    if (stop && stop(round + 1)) return round + 1;
  }
  return rounds;
}

int warm_up_rounds(const std::vector<Trainer*>& trainers, int min_rounds, int max_rounds,
                   const std::function<void(int round)>& after_round) {
  TORCH_CHECK(min_rounds >= 1 && max_rounds >= min_rounds,
              "actmem::warm_up_rounds: expected 1 <= "
              "min_rounds <= max_rounds, got ",
              min_rounds, " and ", max_rounds);
  const std::vector<std::vector<size_t>> orders = round_orders(trainers.size(), max_rounds);
  int steady = 0;
  for (int round = 0; round < max_rounds; ++round) {
    const int64_t before = cpu_block_cache_stats().reserved;
    for (const size_t i : orders[static_cast<size_t>(round)]) trainers[i]->train_step(false);
    steady = cpu_block_cache_stats().reserved > before ? 0 : steady + 1;
    if (after_round) after_round(round);
    if (round + 1 >= min_rounds && steady >= 3) return round + 1;
  }
  return max_rounds;
}

}  // namespace actmem
