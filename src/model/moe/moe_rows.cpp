// moe_rows.cpp — the MoE experts' rows (moe_rows.h).
#include "actmem/model/moe/moe_rows.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <numeric>

namespace actmem {

MoERouting balanced_moe_routing(const TransformerConfig& c) {
  MoERouting routing;
  if (!c.is_moe() || c.moe_pad_expert_input_to_capacity) return routing;
  const int64_t t = c.tensor_model_parallel_size, e = c.expert_model_parallel_size;
  const int64_t T = c.sequence_parallel ? c.seq_length * c.micro_batch_size / t
                                        : c.seq_length * c.micro_batch_size;
  const int64_t k = c.moe_router_topk, E = c.num_moe_experts;
  int64_t rows = (e * t * T * k + E - 1) / E;  // per local expert, rounded up
  if (c.moe_expert_capacity_factor) {  // each routing rank sends an expert at most its capacity
    rows = std::min(rows, e * t * moe_expert_capacity(T, k, E, *c.moe_expert_capacity_factor));
  }
  for (const bool is_moe : c.moe_layers()) {
    if (is_moe) routing.emplace_back(std::vector<int64_t>(static_cast<size_t>(E / e), rows), T * k);
  }
  return routing;
}

const MoELayerRouting* moe_layer_routing(const MoERouting* routing, size_t moe_index) {
  if (routing == nullptr || moe_index >= routing->size() ||
      (*routing)[moe_index].expert_rows.empty()) {
    return nullptr;
  }
  return &(*routing)[moe_index];
}

int64_t moe_router_tokens(const TransformerConfig& c) {
  const int64_t T = c.seq_length * c.micro_batch_size;
  return c.sequence_parallel ? T / c.tensor_model_parallel_size : T;
}

int64_t moe_max_routed_rows(const TransformerConfig& c) {
  const int64_t T = moe_router_tokens(c), E = c.num_moe_experts;
  const int64_t k = c.moe_router_topk;
  if (!c.moe_expert_capacity_factor) return T * k;
  const int64_t cap = std::min(moe_expert_capacity(T, k, E, *c.moe_expert_capacity_factor), T);
  return c.moe_pad_expert_input_to_capacity ? E * cap : std::min(T * k, E * cap);
}

int64_t moe_max_expert_rows(const TransformerConfig& c) {
  // This rank's L = E/e experts (its slice of them) compute the rows of the t x e ranks whose
  // routers send to them: every tensor rank's (the dispatchers gather over the expert tensor-
  // parallel group) of every expert rank.
  const int64_t e = c.expert_model_parallel_size, sources = e * c.tensor_model_parallel_size;
  if (sources == 1) return moe_max_routed_rows(c);
  const int64_t T = moe_router_tokens(c), E = c.num_moe_experts, L = E / e;
  const int64_t k = c.moe_router_topk;
  const int64_t dropless = sources * T * std::min(k, L);
  if (!c.moe_expert_capacity_factor) return dropless;
  const int64_t cap = std::min(moe_expert_capacity(T, k, E, *c.moe_expert_capacity_factor), T);
  return c.moe_pad_expert_input_to_capacity ? L * sources * cap
                                            : std::min(dropless, L * sources * cap);
}

std::optional<int64_t> moe_expert_rows(const TransformerConfig& c, size_t moe_index,
                                       const MoERouting* routing) {
  if (const auto* r = moe_layer_routing(routing, moe_index)) {
    return std::accumulate(r->expert_rows.begin(), r->expert_rows.end(), int64_t{0});
  }
  // Padded to capacity the count does not depend on the routing; dropless neither, unless
  // expert parallelism brings other ranks' tokens (tensor ranks bring all of theirs: each
  // routes every token to k of the E experts, all of them local).
  if (c.moe_pad_expert_input_to_capacity ||
      (!c.moe_expert_capacity_factor && c.expert_model_parallel_size == 1)) {
    return moe_max_expert_rows(c);
  }
  return std::nullopt;
}

}  // namespace actmem
