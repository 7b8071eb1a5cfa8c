// strategy.h — one activation strategy as a typed value: which modules are recomputed, whether
// and how whole layers are, which fine-grained groups and how many layers are offloaded. The
// planner and the analytic planner enumerate these, `compare` parses them from its grammar, and
// apply() turns one into Megatron's flags on a TransformerConfig, which make_activation_plan()
// resolves and validates like any other flags. Module names come from the tables in
// activation_plan.h only.
#pragma once

#include "actmem/config/activation_plan.h"
#include "actmem/config/config.h"

#include <cstdint>
#include <string>
#include <vector>

namespace actmem {

struct Strategy {
  std::vector<RecomputeModule> recompute_modules;        // selective recompute (empty: none)
  RecomputeMethod full_method = RecomputeMethod::kNone;  // full recompute (kNone: none)
  int64_t full_layers = 0;                               // full recompute's --recompute-num-layers
  std::vector<OffloadModule> offload_modules;  // fine-grained offload groups (empty: none)
  int64_t offload_layers = 0;                  // layer-level offload of the first K layers

  bool plain() const {
    return recompute_modules.empty() && full_method == RecomputeMethod::kNone &&
           offload_modules.empty() && offload_layers == 0;
  }
  bool recomputes(RecomputeModule m) const;
  bool offloads(OffloadModule g) const;
  /// Short name: "plain", "selective core_attn+mlp", "full block 2", "offload attn_norm",
  /// "selective core_attn, offload mlp_norm", "layer offload 1".
  std::string name() const;
  /// The same in parse_strategy()'s grammar ("selective-core_attn+mlp,offload-mlp_norm"), which
  /// `compare --strategies` takes: parse_strategy(spec()) == *this.
  std::string spec() const;
  /// Megatron's command-line flags, ready to paste ("" for plain).
  std::string flags() const;
  /// `base` with its recompute and offload flags replaced by this strategy's.
  TransformerConfig apply(const TransformerConfig& base) const;
  bool operator==(const Strategy& o) const;
};

/// Module names joined by `sep` ("core_attn+mlp").
std::string join_names(const std::vector<RecomputeModule>& modules, const std::string& sep);
std::string join_names(const std::vector<OffloadModule>& groups, const std::string& sep);

/// `compare`'s grammar, parts joined by ",": plain | selective (Megatron's default module) |
/// selective-MOD[+MOD...] | full-uniform-N | full-block-N | offload-GROUP[+GROUP...] |
/// layer-offload-K. Throws naming the part and what was expected; whether the strategy applies
/// to a model is make_activation_plan()'s to say.
Strategy parse_strategy(const std::string& text);

}  // namespace actmem
