// step_rounds.cpp — rounds of training steps, in a new order each round (Note [Honest step ratios]
// and Note [Step round order] in step_rounds.h).
#include "actmem/step_rounds.h"

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

void run_shuffled_rounds(const std::vector<Trainer*>& trainers, int rounds, bool compute_digest,
                        const std::function<void(int round, const std::vector<IterationStats>&)>&
                            after_round) {
  std::vector<IterationStats> stats(trainers.size());
  const std::vector<std::vector<size_t>> orders = round_orders(trainers.size(), rounds);
  for (int round = 0; round < rounds; ++round) {
    for (const size_t i : orders[static_cast<size_t>(round)]) {
      stats[i] = trainers[i]->train_step(compute_digest);
    }
    if (after_round) after_round(round, stats);
  }
}

}  // namespace actmem
