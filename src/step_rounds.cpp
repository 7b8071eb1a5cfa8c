// step_rounds.cpp — rotated rounds of training steps (Note [Honest step ratios] in step_rounds.h).
#include "actmem/step_rounds.h"

namespace actmem {

void run_rotated_rounds(const std::vector<Trainer*>& trainers, int rounds, bool compute_digest,
                        const std::function<void(int round, const std::vector<IterationStats>&)>&
                            after_round) {
  const size_t n = trainers.size();
  std::vector<IterationStats> stats(n);
  for (int round = 0; round < rounds; ++round) {
    for (size_t k = 0; k < n; ++k) {
      const size_t i = (k + static_cast<size_t>(round)) % n;
      stats[i] = trainers[i]->train_step(compute_digest);
    }
    if (after_round) after_round(round, stats);
  }
}

}  // namespace actmem
