// megatron_compat.h — Megatron's training flags that have no counterpart in actmem: accepted
// with one notice saying why they change nothing here (fused-kernel switches, Python and
// DataLoader knobs), or refused with the reason and what is missing (FP8, context parallelism,
// W&B, ...). The whole table, with the flags actmem implements, is docs/megatron-flags.md.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace CLI {
class App;
}

namespace actmem {

struct TrainOptions;

/// The flags as given: name and value ("" for a switch), in order.
using GivenFlags = std::vector<std::pair<std::string, std::string>>;

/// Adds the accepted and refused flags to `app`, recording each occurrence in `given`.
void add_megatron_compat_flags(CLI::App& app, GivenFlags& given);

/// Applies Megatron's own rules to what was given (e.g. --overlap-param-gather needs
/// --use-distributed-optimizer and --overlap-grad-reduce) and throws one error naming every
/// refused flag, a line each, with its reason. Returns the notice for the accepted ones ("" when
/// none): one line per flag, saying why it changes nothing here.
std::vector<std::string> check_megatron_compat_flags(const GivenFlags& given,
                                                     const TrainOptions& options);

}  // namespace actmem
