// offload_schedule.cpp — warmup and margin, the in-flight cap, the prefetch order.
#include "actmem/offload/offload_schedule.h"

namespace actmem {

bool OffloadSchedule::offloads(int64_t chunk, size_t index, bool requested,
                               bool backward_follows) const {
  if (!requested) return false;
  // Warmup offloads everything; afterwards only the margin stays, and only where the forward's
  // own backward comes next (a position beyond the warmup's count offloads).
  if (warmup_ || !backward_follows) return true;
  const auto it = margin_.find(chunk);
  return it == margin_.end() || index >= it->second.size() || !it->second[index];
}

void OffloadSchedule::end_warmup(
    const std::map<int64_t, std::vector<GroupInfo>>& groups_per_chunk) {
  if (!warmup_) return;
  warmup_ = false;  // Note [Offload warmup and margin]
  for (const auto& [chunk, groups] : groups_per_chunk) {
    std::vector<bool>& margin = margin_[chunk];
    margin.assign(groups.size(), false);
    std::map<std::string, size_t> last;
    for (size_t i = 0; i < groups.size(); ++i) {
      if (groups[i].kind == GroupKind::kModule) last[groups[i].name] = i;
    }
    for (const auto& [name, i] : last) margin[i] = true;
  }
}

std::vector<CopyEvent> OffloadSchedule::admit(const std::string& name, const CopyEvent& last) {
  std::vector<CopyEvent> wait;
  if (max_inflight_ < 0) return wait;
  auto& pending = inflight_[name];
  pending.push_back(last);
  while (static_cast<int>(pending.size()) > max_inflight_) {
    wait.push_back(pending.front());
    pending.pop_front();
  }
  return wait;
}

int OffloadSchedule::prefetch_target(int index, BackwardPoint point,
                                     const std::function<const GroupInfo*(int)>& group) const {
  const GroupInfo* self = group(index);
  if (self == nullptr) return -1;
  const bool module = self->kind == GroupKind::kModule;
  if (module != (point == BackwardPoint::kStart)) return -1;
  for (int i = index - 1; i >= 0; --i) {
    const GroupInfo* g = group(i);
    if (g == nullptr || g->forward != self->forward) break;  // another micro-batch's forward
    if (g->kind != self->kind) continue;
    // Module groups skip those that moved nothing; a layer group reloads the layer before.
    if (module && !(g->committed && g->offloads && g->has_entries)) continue;
    return g->offloads && g->committed ? i : -1;
  }
  return -1;
}

}  // namespace actmem
