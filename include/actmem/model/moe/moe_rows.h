// moe_rows.h — how many rows an MoE layer's experts compute in one micro-batch, from the
// configuration or from a routing the router measured: what the exact predictor (the MoE part's
// saved bytes) and the memory pre-check count the experts' activations by.
#pragma once

#include "actmem/config/config.h"

#include <cstdint>
#include <optional>
#include <vector>

namespace actmem {

/// An MoE layer (Note [What an MoE layer saves] in moe_part.cpp): every byte depends on the
/// number of rows N the experts compute, not on which expert computes which. Dropless routing
/// computes N = s*b*topk rows and padded capacity E*capacity rows whatever the router decides, so
/// both are exact up front; capacity without padding computes what fits under each expert's
/// capacity, which the router decides: pass its per-layer counts as a routing
/// (MoEStats::routing(), one entry per MoE layer; the trainer records them). With expert
/// parallelism a rank's experts compute the rows every rank routed to them, which the routing
/// decides even when dropless (padded capacity stays exact up front: each rank sends each expert
/// its capacity), and the rank's own routed rows (what its dispatcher keeps indices of) differ
/// from them: the entry records both. Without the routing where it is needed, throws.
struct MoELayerRouting {
  MoELayerRouting(std::vector<int64_t> rows = {}, int64_t dispatched = -1)  // NOLINT: implicit
      : expert_rows(std::move(rows)), dispatched_rows(dispatched) {}
  /// Rows each of this rank's experts computed (all experts without expert parallelism).
  std::vector<int64_t> expert_rows;
  /// Rows this rank's router sent to the experts (its permuted tokens); -1: the sum of
  /// expert_rows (the same rows without expert parallelism).
  int64_t dispatched_rows = -1;
};
using MoERouting = std::vector<MoELayerRouting>;

/// Routed experts' rows at a balanced routing (each expert k T / E of the T tokens a router sees,
/// from every rank that routes to it, rounded up, at most the capacity bound), one entry per MoE
/// layer, for predict_activation_bytes() on a model that cannot run here; empty for a dense model
/// or padded capacity (whose rows do not depend on the routing).
MoERouting balanced_moe_routing(const TransformerConfig& config);

/// Rows the experts of MoE layer `moe_index` (0-based among the MoE layers) on this rank compute
/// in one micro-batch: the routing's sum when given, else moe_max_expert_rows() where that is
/// exact (dropless without expert parallelism, padded), else nullopt.
std::optional<int64_t> moe_expert_rows(const TransformerConfig& config, size_t moe_index,
                                       const MoERouting* routing = nullptr);
/// The most rows one MoE layer's experts on one rank can compute in one micro-batch: s*b*topk
/// dropless, E*min(capacity, s*b) padded, min(s*b*topk, E*min(capacity, s*b)) with dropping;
/// with expert parallelism e its L = E/e experts see e ranks' tokens: e*s*b*min(topk, L)
/// dropless, L*e*min(capacity, s*b) padded, the smaller of the two with dropping.
int64_t moe_max_expert_rows(const TransformerConfig& config);
/// The most rows one rank's router sends to the experts in one micro-batch (its own tokens):
/// moe_max_expert_rows() without expert parallelism; exact when dropless or padded.
int64_t moe_max_routed_rows(const TransformerConfig& config);

/// MoE layer `moe_index`'s entry in `routing`, or null when it has none.
const MoELayerRouting* moe_layer_routing(const MoERouting* routing, size_t moe_index);
/// The tokens one rank's router sees: s*b, or s*b/t with sequence parallelism (which MoE under
/// tensor parallelism requires).
int64_t moe_router_tokens(const TransformerConfig& config);

}  // namespace actmem
