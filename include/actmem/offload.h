// offload.h — CPU offload of saved activations: a copy engine, a host buffer pool, and offload
// groups whose saved tensors move to host memory after their forward and come back ahead of their
// backward (layer-level offload as Megatron's cpu_offloading_num_layers; fine-grained module
// groups, as Megatron's fine_grained_activation_offload.py, build on the same pieces).
//
// On a CPU-only build "device" memory is the tracked allocator and "host" memory is allocated
// outside it (reported separately); the copy engine runs each direction on its own worker thread,
// optionally capped to a bandwidth to emulate a PCIe link (docs/offload.md, "Copy engine").
// On CUDA (builds with ACTMEM_WITH_CUDA) the same worker issues each copy on its own c10 CUDA
// stream, ordered after the compute stream's work by an event, from and to pinned host buffers
// (Note [CUDA copy engine] in offload.cpp).
#pragma once

#include "actmem/saved_tensor_hooks.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

namespace actmem {

/// Completion of queued work (the role of a CUDA event). Copyable; copies share the state.
class CopyEvent {
 public:
  CopyEvent();
  /// Blocks until the work completed; rethrows an error the work raised.
  void wait() const;
  bool ready() const;
  void mark_done(std::exception_ptr error = nullptr) const;

 private:
  struct State {
    std::mutex mutex;
    std::condition_variable cv;
    bool done = false;
    std::exception_ptr error;
  };
  std::shared_ptr<State> state_;
};

/// One copy direction: a worker thread running jobs in FIFO order (the role of a CUDA stream).
/// For a CUDA device the worker issues each copy on a dedicated CUDA stream and completes the
/// job's event once the copy has finished on the GPU.
class CopyStream {
 public:
  /// bytes_per_second = 0 means uncapped.
  CopyStream(std::string name, double bytes_per_second, c10::Device device = c10::kCPU);
  ~CopyStream();
  CopyStream(const CopyStream&) = delete;
  CopyStream& operator=(const CopyStream&) = delete;
  /// Queues dst.copy_(src) after `after` (if given) has completed; dst and src stay alive until
  /// the copy is done (record_stream's role); `on_done` runs on the worker after the copy.
  /// On CUDA the copy is also ordered after the work queued so far on the calling thread's
  /// current stream (which produced src, or last used dst's memory).
  /// Returns the event that completes with it.
  CopyEvent copy_async(at::Tensor dst, at::Tensor src, const CopyEvent* after = nullptr,
                       std::function<void()> on_done = nullptr, bool order_after_caller = true);
  /// A [bytes] uint8 buffer on `device` for a copy this stream will write, which the calling
  /// thread's stream reads afterwards: on CUDA allocated from this stream's pool and recorded as
  /// used by the caller's stream (so its block is not reused before that stream is done with it),
  /// so the copy need not wait for the caller's queued work (order_after_caller = false).
  at::Tensor empty_for_copy(int64_t bytes, const c10::Device& device);
  /// Seconds spent copying (including the bandwidth cap's waits) since construction.
  double busy_seconds() const { return static_cast<double>(busy_ns_.load()) * 1e-9; }
  /// Test hook: extra random delay, up to this many microseconds, before each copy.
  void set_jitter_us(int max_us) { jitter_us_ = max_us; }

 private:
  struct CudaState;  // the CUDA stream; null on CPU
  struct Job {
    at::Tensor dst, src;
    CopyEvent event;
    std::shared_ptr<CopyEvent> after;
    std::function<void()> on_done;
    std::shared_ptr<void> producer_event;  // CUDA: recorded on the caller's stream
  };
  void run();
  void copy(Job& job);
  std::string name_;
  double bytes_per_second_;
  c10::Device device_;
  std::unique_ptr<CudaState> cuda_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stop_ = false;
  std::atomic<int64_t> busy_ns_{0};
  std::atomic<int> jitter_us_{0};
  std::thread worker_;
};

/// Host buffers reused across iterations, keyed by byte size. Memory comes from the system
/// allocator directly, never from the tracked device allocator; pinned (page-locked, through
/// libtorch's pinned-memory allocator) for a CUDA device, so copies are true async DMA.
class HostPool {
 public:
  explicit HostPool(bool pinned = false) : pinned_(pinned) {}
  ~HostPool();
  bool pinned() const { return pinned_; }
  /// A [bytes] uint8 host tensor (from the free list when one of that size is free).
  at::Tensor acquire(int64_t bytes);
  /// Returns a buffer acquired here; throws for a foreign tensor.
  void release(const at::Tensor& buffer);
  int64_t bytes_in_use() const { return in_use_.load(); }
  int64_t peak_bytes_in_use() const { return peak_.load(); }
  int64_t bytes_allocated() const { return allocated_.load(); }  // held by the pool in total
  int64_t allocations() const { return allocations_.load(); }    // system allocations so far
  void reset_peak() { peak_.store(in_use_.load()); }

 private:
  bool pinned_;
  std::mutex mutex_;
  std::map<int64_t, std::vector<at::Tensor>> free_;
  std::unordered_set<const void*> owned_;
  std::atomic<int64_t> in_use_{0}, peak_{0}, allocated_{0}, allocations_{0};
};

/// Per-step offload measurements.
struct OffloadStats {
  int64_t offloaded_bytes = 0;   // device bytes copied to host this step
  double wait_s = 0.0;           // time compute waited for reloads (and for the in-flight cap)
  double d2h_busy_s = 0.0;       // copy-engine time this step, each direction
  double h2d_busy_s = 0.0;
};

/// Bytes and tensors offloaded per group name in the warmup iteration, after the margin rule.
struct OffloadSummaryRow {
  std::string name;
  int64_t bytes = 0;
  int64_t tensors = 0;
};

/// Offloads the tensors autograd saves inside groups (Megatron's fine-grained offload,
/// megatron/core/pipeline_parallel/fine_grained_activation_offload.py, and layer-level offload,
/// cpu_offloading_num_layers, on one mechanism). A group is opened by start_group(), sees
/// the tensors saved while a CaptureScope of it is alive, and is committed by commit(): its
/// device-to-host copies are queued then. In backward, on_commit_backward() waits for the
/// group's reload (and only there) and on_start_backward() prefetches the group before it.
/// The first step is the warmup: every group offloads and its bytes are recorded; from the
/// second step on the margin rule keeps, for each group name, the group the backward reaches
/// first on the device (it would be reloaded right away), and the decisions stay fixed.
/// Saved tensors below min_elements, parameters and registered exclusions stay on the device.
class ActivationOffloader final : public SavedTensorHook {
 public:
  /// max_inflight < 0: no cap; otherwise at most that many groups of one name may have copies
  /// in flight before compute waits for the oldest. `device`: where the activations live
  /// (CPU, or a CUDA device in builds with ACTMEM_WITH_CUDA).
  ActivationOffloader(int64_t min_elements, double bytes_per_second, int max_inflight = -1,
                      c10::Device device = c10::kCPU);
  ~ActivationOffloader() override;

  /// Storages never offloaded (parameters, model buffers, the batch). Persistent.
  void exclude(const at::Tensor& t);
  /// Storages not offloaded in the current forward (e.g. outputs that output-discarding
  /// recompute frees anyway). Cleared by begin_forward().
  void exclude_this_forward(const at::Tensor& t);

  /// Opens group `name` of this forward; returns its index (forward order from 0).
  int start_group(const std::string& name, bool apply_margin = true);
  /// Routes saved tensors into group `index` while alive.
  class CaptureScope {
   public:
    CaptureScope(ActivationOffloader& owner, int index);
    ~CaptureScope();
    CaptureScope(const CaptureScope&) = delete;
    CaptureScope& operator=(const CaptureScope&) = delete;

   private:
    ActivationOffloader& owner_;
    int previous_;
    SavedTensorHooksGuard hooks_;
  };
  /// Queues the group's device-to-host copies (if the group offloads). `forced` tensors' device
  /// storage is freed as soon as its copy finished, even if other references to it remain (the
  /// caller guarantees nothing reads them in forward any more).
  void commit(int index, const std::vector<at::Tensor>& forced = {});
  /// Backward, before the group's module: waits for the group's reload (starting it if needed).
  void on_commit_backward(int index);
  /// Backward, after the group's module: prefetches the closest earlier offloaded group.
  void on_start_backward(int index);

  /// Layer-level convenience: start_group + CaptureScope, commit on destruction.
  class GroupScope {
   public:
    GroupScope(ActivationOffloader& owner, int index);
    ~GroupScope();
    int index() const { return index_; }

   private:
    ActivationOffloader& owner_;
    int index_;
    CaptureScope capture_;
  };
  std::unique_ptr<GroupScope> group(const std::string& name = "layer");
  /// Starts reloading group `index` (no-op if it did not offload or is already reloading).
  void prefetch(int index);

  /// Call at the start of each step: forgets the previous step's groups, resets the stats.
  void begin_step();
  /// Call at the end of each step; the first call ends the warmup: the margin rule fixes which
  /// groups offload from now on and the summary is computed.
  void end_step();
  /// Call at the start of each forward: group numbering restarts at 0.
  void begin_forward();
  bool in_warmup() const { return warmup_; }
  /// Per-name offloaded bytes of the warmup step, after the margin rule (empty until then).
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
  /// Blocks until both copy streams have finished everything queued so far.
  void wait_idle();
  HostPool& pool() { return pool_; }
  CopyStream& d2h() { return d2h_; }
  CopyStream& h2d() { return h2d_; }

  std::shared_ptr<PackedTensor> pack(const at::Tensor& tensor) override;

  /// An offloaded storage: resident -> offloading -> offloaded -> reloading -> reloaded, each
  /// transition checked (Note [Offload state machine] in offload.cpp).
  enum class State { kResident, kOffloading, kOffloaded, kReloading, kReloaded };
  struct Entry;
  struct Group;

 private:
  void wait_reloaded(Entry& entry);
  void wait_group(int index);
  void release_forced(bool wait);
  std::vector<std::shared_ptr<Entry>> pending_release_;  // forced tensors awaiting their copy
  int64_t min_elements_;
  int max_inflight_;
  c10::Device device_;
  HostPool pool_;
  CopyStream d2h_, h2d_;
  // Weak, so a freed excluded storage cannot exclude a new one allocated at its address.
  std::map<const void*, c10::weak_intrusive_ptr<c10::StorageImpl>> excluded_, excluded_forward_;
  std::vector<std::shared_ptr<Group>> groups_;
  // This forward's entries by storage. The weak storage pointer guards against a new storage
  // allocated at a freed one's address being mistaken for it.
  std::map<const void*, std::pair<c10::weak_intrusive_ptr<c10::StorageImpl>, std::weak_ptr<Entry>>>
      by_storage_;
  std::map<std::string, std::deque<CopyEvent>> inflight_;
  int current_ = -1;  // group capturing saved tensors
  bool warmup_ = true;
  std::vector<bool> decisions_;  // per forward-order index, fixed after warmup
  std::vector<OffloadSummaryRow> summary_;
  mutable std::mutex mutex_;
  int64_t offloaded_bytes_ = 0;
  KeptTensor largest_kept_;
  std::atomic<int64_t> wait_ns_{0};
  double d2h_busy_at_step_ = 0, h2d_busy_at_step_ = 0;
};

const char* to_string(ActivationOffloader::State s);

/// Identity on x; its backward calls on_start_backward(index) (Megatron's group start).
at::Tensor offload_group_start(ActivationOffloader& offloader, const at::Tensor& x, int index);
/// Identity on y; its forward commits group `index` (forced tensors released after their copy),
/// its backward calls on_commit_backward(index) (Megatron's group commit).
at::Tensor offload_group_commit(ActivationOffloader& offloader, const at::Tensor& y, int index,
                                const std::vector<at::Tensor>& forced = {});

}  // namespace actmem
