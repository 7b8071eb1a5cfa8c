// step_rounds.h — several trainers timed against each other in the same rounds: what `compare`,
// the planner's profile and `plan --verify` measure step-time ratios with.
//
// Note [Honest step ratios]
// A strategy's step time is only comparable with the plain step's when both ran under the same
// conditions. So: the first rounds are not timed (allocator and thread-pool warm-up, offload's
// warmup); in every timed round each strategy runs one step, in an order rotated from round to
// round (no strategy always runs first, or always after the same one); a strategy's ratio is the
// median over rounds of its time divided by the plain step's time *in the same round*, so drift
// of the machine cancels. `compare` prints the range of those per-round ratios beside it and warns
// when too few rounds or a plain step that varies a lot cannot carry the digits.
#pragma once

#include "actmem/trainer.h"

#include <functional>
#include <vector>

namespace actmem {

/// Runs `rounds` rounds of one training step of every trainer, in an order rotated by one each
/// round, and after each round calls `after_round(round, stats)` with every trainer's stats in
/// trainer order. `compute_digest` as in Trainer::train_step.
void run_rotated_rounds(const std::vector<Trainer*>& trainers, int rounds, bool compute_digest,
                        const std::function<void(int round, const std::vector<IterationStats>&)>&
                            after_round);

}  // namespace actmem
