// offload_schedule.h — the policy half of activation offload: which groups offload, how many
// copies may be in flight, and which group to reload next. The mechanism (entries, their states,
// the copies) is activation_offloader.h; TransformerEngine separates its OffloadSynchronizer
// from its offloaded tensors the same way. Knows nothing about tensors: it decides from group
// names, kinds and positions.
#pragma once

#include "actmem/offload/copy_engine.h"

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace actmem {

/// A module group (Megatron's fine-grained offload: one module's saved tensors) or a layer group
/// (layer-level offload: everything one layer saves).
enum class GroupKind : uint8_t { kModule, kLayer };

/// How a group's host buffers are reused between steps: a buffer of each tensor's exact size
/// (its size is the same every step), or of its size class (its size follows data the step
/// decides, as the MoE groups' follow the routing; copy_engine.h's HostPool).
enum class HostBuffers : uint8_t { kExact, kSizeClasses };

/// What the schedule knows of a group of the current forward.
struct GroupInfo {
  std::string name;
  GroupKind kind = GroupKind::kModule;
  HostBuffers buffers = HostBuffers::kExact;
  bool offloads = false;     // decided when the group opened
  bool committed = false;    // its device-to-host copies are queued
  bool has_entries = false;  // it captured at least one saved tensor
  int forward = 0;           // the forward it belongs to (the offloader's numbering in a step)
};

/// Where the backward is when the schedule is asked what to reload: at a group's commit (the
/// gradient of the group's output arrived: its backward begins) or at its start (the gradient
/// of its input is computed: its backward is done).
enum class BackwardPoint : uint8_t { kCommit, kStart };

class OffloadSchedule {
 public:
  /// max_inflight < 0: no cap; otherwise at most that many groups of one name may have copies
  /// in flight before compute waits for the oldest.
  explicit OffloadSchedule(int max_inflight = -1) : max_inflight_(max_inflight) {}

  /// Note [Offload warmup and margin]
  /// The first step is the warmup: every group that asks to offload does, so the bytes of each
  /// are known. At its end, for each name of module groups, the group the backward reaches
  /// first (the last one in forward order) is marked as the margin: it would be reloaded as soon
  /// as it finished offloading (Megatron's post_warmup_callback), so from then on it stays on the
  /// device in every forward whose own backward is the next computation (one process: every
  /// forward; the last pipeline stage under 1F1B). A forward followed by other micro-batches'
  /// work first offloads its margin too (Megatron's should_bulk_offload: the margin applies when
  /// the next backward chunk is this one). Layer groups have no margin (layer-level offload moves
  /// every layer it names). Decisions are fixed per model chunk by position in its forward.
  bool in_warmup() const { return warmup_; }
  /// Whether the group at position `index` of a forward of model chunk `chunk` offloads, given
  /// that it asks to; `backward_follows`: that forward's own backward comes next.
  bool offloads(int64_t chunk, size_t index, bool requested, bool backward_follows = true) const;
  /// Ends the warmup (first call only) with, per model chunk, the groups of its last forward in
  /// the warmup step, in order.
  void end_warmup(const std::map<int64_t, std::vector<GroupInfo>>& groups_per_chunk);

  /// In-flight cap: a group named `name` committed, its last copy completing with `last`.
  /// Returns the events compute must wait for now, oldest first, so that at most max_inflight
  /// groups of that name have copies in flight.
  std::vector<CopyEvent> admit(const std::string& name, const CopyEvent& last);
  /// A new forward: nothing of the previous one is in flight any more as far as the cap goes.
  void begin_forward() { inflight_.clear(); }

  /// Prefetch order: the group to start reloading when the backward reaches `point` of group
  /// `index`, or -1 (never a group of another forward). Module groups reload one group ahead when a
  /// module's backward is done (the closest earlier group that offloaded something); layer groups
  /// reload the layer before when a layer's backward begins, so its copy overlaps the whole layer's
  /// backward.
  int prefetch_target(int index, BackwardPoint point,
                      const std::function<const GroupInfo*(int)>& group) const;

 private:
  int max_inflight_;
  bool warmup_ = true;
  std::map<int64_t, std::vector<bool>> margin_;  // per chunk and forward position
  std::map<std::string, std::deque<CopyEvent>> inflight_;
};

}  // namespace actmem
