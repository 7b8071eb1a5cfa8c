// offload_schedule.cpp — warmup and margin, the in-flight cap, the prefetch order.
#include "actmem/offload_schedule.h"

namespace actmem {

bool OffloadSchedule::offloads(size_t index, bool requested) const {
  if (!requested) return false;
  // Warmup offloads everything; afterwards the decisions of the warmup step hold, by position
  // (a group beyond the warmup's count offloads).
  return warmup_ || index >= decisions_.size() || decisions_[index];
}

void OffloadSchedule::end_warmup(const std::vector<GroupInfo>& groups) {
  if (!warmup_) return;
  warmup_ = false;  // Note [Offload warmup and margin]
  decisions_.assign(groups.size(), true);
  std::map<std::string, size_t> last;
  for (size_t i = 0; i < groups.size(); ++i) {
    if (groups[i].kind == GroupKind::kModule) last[groups[i].name] = i;
  }
  for (const auto& [name, i] : last) decisions_[i] = false;
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
    if (g == nullptr || g->kind != self->kind) continue;
    // Module groups skip those that moved nothing; a layer group reloads the layer before.
    if (module && !(g->committed && g->offloads && g->has_entries)) continue;
    return g->offloads && g->committed ? i : -1;
  }
  return -1;
}

}  // namespace actmem
