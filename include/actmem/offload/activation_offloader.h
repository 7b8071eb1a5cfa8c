// activation_offloader.h — the mechanism of activation offload: saved tensors captured in groups,
// each device storage an entry with a checked state machine, copies on the copy engine
// (copy_engine.h), decisions from the schedule (offload_schedule.h). Megatron's fine-grained
// offload (megatron/core/pipeline_parallel/fine_grained_activation_offload.py) and layer-level
// offload (cpu_offloading_num_layers) on one mechanism.
//
// A model uses it through one object per group, OffloadRegion (Megatron's
// FineGrainedActivationOffloadingInterface, used as a context manager around each group):
//
//   OffloadRegion region(offloader, "qkv_linear");   // inert without an offloader or grad
//   at::Tensor x = region.enter(input);             // capture what the module saves from here
//   at::Tensor y = region.commit(module(x));        // queue the group's copies to the host
//
// In backward the gradient reaching the commit waits for the group's reload, and the schedule
// prefetches the next group backward will need (Note [Offload warmup and margin] in
// offload_schedule.h for which groups offload at all).
#pragma once

#include "actmem/base/report.h"
#include "actmem/config/activation_plan.h"
#include "actmem/offload/copy_engine.h"
#include "actmem/offload/offload_schedule.h"
#include "actmem/recompute/saved_tensor_hooks.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace actmem {

/// Note [Offload state machine]
/// One entry per device storage saved in a group (views of one storage share it, so a storage is
/// copied once, and a storage saved again by a later group of the same forward reuses the entry).
/// Its states, and the only transitions allowed (each checked under the entry's mutex):
///   resident   -> offloading  commit(): D2H copy queued; the copy job holds the device bytes
///   offloading -> offloaded   D2H worker, after the copy: its reference to the device bytes is
///                             dropped; a forced tensor's storage is then freed by the compute
///                             thread at its next offload call, even if other references remain
///                             (the worker never touches a storage the compute thread may free)
///   offloading -> reloading   prefetch before the D2H finished: the H2D job waits for the
///   offloaded  -> reloading   offload event first, so a reload never reads a half-written buffer
///                             (Megatron's race, Megatron-LM issue #7398, fixed)
///   reloading  -> reloaded    H2D worker, after the copy: the host buffer returns to the pool
/// An unpack in any state other than resident or reloaded waits (offload_wait_s counts it).
enum class OffloadState : uint8_t { kResident, kOffloading, kOffloaded, kReloading, kReloaded };
inline constexpr std::array<std::pair<OffloadState, OffloadState>, 5> kOffloadTransitions = {{
    {OffloadState::kResident, OffloadState::kOffloading},
    {OffloadState::kOffloading, OffloadState::kOffloaded},
    {OffloadState::kOffloading, OffloadState::kReloading},
    {OffloadState::kOffloaded, OffloadState::kReloading},
    {OffloadState::kReloading, OffloadState::kReloaded},
}};
const char* to_string(OffloadState s);
/// True when kOffloadTransitions holds from -> to.
bool is_legal_transition(OffloadState from, OffloadState to);

/// Note [Offload under pipeline schedules]
/// Under a pipeline schedule several forwards (micro-batches, model chunks) await their backward
/// at once, and a backward often follows other micro-batches' work instead of its own forward.
/// The offloader numbers groups across the step, each group knowing its forward, so a backward
/// reloads and prefetches within its own micro-batch. The trainer knows the schedule as data
/// (pipeline_compute_order in pipeline.h) and tells the offloader two things Megatron infers
/// from its staged chunk queue (PipelineOffloadManager's VPP staging and front_backward_chunk):
/// whether a forward's own backward comes next (then the margin stays on the device), and, at
/// the start of each computation followed by a backward of another micro-batch, to reload that
/// backward's first groups (Megatron's pre_reload_last_layer), so the copy overlaps the
/// computation in between.

/// Per-step offload measurements.
struct OffloadStats {
  int64_t offloaded_bytes = 0;  // device bytes copied to host this step
  double wait_s = 0.0;          // time compute waited for reloads (and for the in-flight cap)
  double d2h_busy_s = 0.0;      // copy-engine time this step, each direction
  double h2d_busy_s = 0.0;
};

class ActivationOffloader;

/// One group of a forward, from its input to its output (see the file comment). Inert, and
/// every method the identity, when the offloader is null or grad mode is off (evaluation).
class OffloadRegion {
 public:
  /// Opens group `name` of `kind`; `offload` false opens a group that keeps its tensors (a
  /// layer beyond the offloaded ones still marks where its backward begins, for the prefetch).
  OffloadRegion(ActivationOffloader* offloader, std::string name,
                GroupKind kind = GroupKind::kModule, bool offload = true,
                HostBuffers buffers = HostBuffers::kExact);
  /// Opens fine-grained group `group` (its name in kOffloadModuleNames).
  OffloadRegion(ActivationOffloader* offloader, OffloadModule group,
                HostBuffers buffers = HostBuffers::kExact);
  /// Ends capturing and, if commit() was not reached (an exception), commits without the
  /// output's backward hook.
  ~OffloadRegion();
  OffloadRegion(const OffloadRegion&) = delete;
  OffloadRegion& operator=(const OffloadRegion&) = delete;

  /// The group's input: returns x through the group's start (whose backward tells the schedule
  /// this group's backward is done) and starts capturing what autograd saves.
  at::Tensor enter(const at::Tensor& x);
  /// Stops capturing before the commit (a norm whose group commits after the bias-dropout-add).
  void end_capture();
  /// The group's output: stops capturing, queues the group's copies to the host and returns y
  /// through the group's commit (whose backward waits for the reload). `forced` tensors' device
  /// storage is freed as soon as their copy finished, even if references remain: the caller
  /// guarantees nothing reads them in forward any more.
  at::Tensor commit(const at::Tensor& y, const std::vector<at::Tensor>& forced = {});
  bool active() const { return index_ >= 0; }

 private:
  ActivationOffloader* offloader_ = nullptr;
  int index_ = -1;
  bool committed_ = false;
  std::optional<SavedTensorHooksGuard> hooks_;
  int previous_ = -1;  // the group capturing before enter()
};

/// Offloads the tensors autograd saves inside groups to host memory and brings them back ahead of
/// their backward. Saved tensors below min_elements, parameters and registered exclusions stay on
/// the device. Thread-safe where the copy workers meet the compute thread.
class ActivationOffloader final : public SavedTensorHook {
 public:
  /// max_inflight < 0: no cap (OffloadSchedule). `device`: where the activations live (CPU, or
  /// a CUDA device in builds with ACTMEM_WITH_CUDA).
  ActivationOffloader(int64_t min_elements, double bytes_per_second, int max_inflight = -1,
                      c10::Device device = c10::kCPU);
  ~ActivationOffloader() override;

  /// Storages never offloaded (parameters, model buffers, the batch). Persistent.
  void exclude(const at::Tensor& t);
  /// Storages not offloaded in the current forward (e.g. outputs that output-discarding
  /// recompute frees anyway). Cleared by begin_forward().
  void exclude_this_forward(const at::Tensor& t);

  /// Call at the start of each step: resets the stats.
  void begin_step();
  /// Call at the end of each step; the first call ends the warmup (Note [Offload warmup and
  /// margin]) and computes the summary.
  void end_step();
  /// Call before each training forward; returns its number in this step. `chunk`: the model
  /// chunk it runs (the margin's decisions are per chunk); `backward_follows`: whether its own
  /// backward is the next computation (Note [Offload warmup and margin]). Several forwards may
  /// await their backward at once (Note [Offload under pipeline schedules]).
  int begin_forward(int64_t chunk = 0, bool backward_follows = true);
  /// Starts reloading what forward `forward`'s backward reads first (its last offloaded group of
  /// each kind), so a backward that follows other work does not begin with a blocking reload.
  void prefetch_backward_start(int forward);
  bool in_warmup() const;
  /// Per-name offloaded bytes of one micro-batch (each chunk's last forward of the warmup step),
  /// after the margin rule (empty until then).
  const std::vector<OffloadSummaryRow>& summary() const { return summary_; }
  OffloadStats stats() const;
  /// The largest tensor saved inside a group this step that stayed on the device because it
  /// has fewer than min_elements elements (numel 0 when there was none): what to name when an
  /// offload moves nothing.
  struct KeptTensor {
    int64_t numel = 0;
    std::vector<int64_t> shape;
    std::string dtype;
    std::string group;
  };
  KeptTensor largest_below_threshold() const;
  int64_t min_elements() const { return min_elements_; }
  /// Starts reloading group `index` (no-op if it did not offload or is already reloading).
  void prefetch(int index);
  /// Blocks until both copy streams have finished everything queued so far.
  void wait_idle();
  HostPool& pool() { return pool_; }
  /// Whether the MoE groups (expert_fc1, moe_act), whose sizes follow the routing, take host
  /// buffers by size class (HostPool::acquire; default) or by exact size.
  /// Whether groups opened with HostBuffers::kSizeClasses reuse buffers by size class (the
  /// default) or take exact sizes (bench_moe compares the two).
  void set_size_classes(bool on) { size_classes_ = on; }
  CopyStream& d2h() { return d2h_; }
  CopyStream& h2d() { return h2d_; }

  std::shared_ptr<PackedTensor> pack(const at::Tensor& tensor) override;

  struct Entry;
  struct Group;
  struct Handle;  // what autograd nodes hold (Note [Offloader handle] in the .cpp)

 private:
  friend class OffloadRegion;
  friend struct OffloadBackward;
  bool size_classes_ = true;
  int open_group(const std::string& name, GroupKind kind, bool offload, HostBuffers buffers);
  void commit(int index, const std::vector<at::Tensor>& forced);
  void on_commit_backward(int index);
  void on_start_backward(int index);
  void wait_reloaded(Entry& entry);
  void wait_group(int index);
  void release_forced(bool wait);
  const GroupInfo* group_info(int index) const;  // caller holds mutex_
  /// Group `index` when it is committed and offloads, else null.
  std::shared_ptr<Group> offloaded_group(int index) const;

  std::vector<std::shared_ptr<Entry>> pending_release_;  // forced tensors awaiting their copy
  int64_t min_elements_;
  c10::Device device_;
  HostPool pool_;
  CopyStream d2h_, h2d_;
  OffloadSchedule schedule_;
  c10::intrusive_ptr<Handle> handle_;
  // Weak, so a freed excluded storage cannot exclude a new one allocated at its address.
  std::map<const void*, c10::weak_intrusive_ptr<c10::StorageImpl>> excluded_, excluded_forward_;
  // This step's groups, every forward's (numbered across the step: autograd nodes hold the index).
  std::vector<std::shared_ptr<Group>> groups_;
  struct ForwardInfo {
    int64_t chunk = 0;
    bool backward_follows = true;
    size_t first_group = 0;
  };
  std::vector<ForwardInfo> forwards_;  // this step's forwards, in order
  /// [begin, end) of forward f's groups in groups_; caller holds mutex_.
  std::pair<size_t, size_t> forward_groups(size_t f) const;
  // This forward's entries by storage. The weak storage pointer guards against a new storage
  // allocated at a freed one's address being mistaken for it.
  std::map<const void*, std::pair<c10::weak_intrusive_ptr<c10::StorageImpl>, std::weak_ptr<Entry>>>
      by_storage_;
  int current_ = -1;  // group capturing saved tensors
  std::vector<OffloadSummaryRow> summary_;
  mutable std::mutex mutex_;
  int64_t offloaded_bytes_ = 0;
  KeptTensor largest_kept_;
  std::atomic<int64_t> wait_ns_{0};
  double d2h_busy_at_step_ = 0, h2d_busy_at_step_ = 0;
};

}  // namespace actmem
