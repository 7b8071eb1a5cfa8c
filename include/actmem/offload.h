// offload.h — CPU offload of saved activations: a copy engine, a host buffer pool, and offload
// groups whose saved tensors move to host memory after their forward and come back ahead of their
// backward (layer-level offload, seed §8; fine-grained module groups build on the same pieces).
//
// On a CPU-only build "device" memory is the tracked allocator and "host" memory is allocated
// outside it (reported separately); the copy engine runs each direction on its own worker thread,
// optionally capped to a bandwidth to emulate a PCIe link (design.md, "The CPU stand-in").
#pragma once

#include "actmem/saved_tensor_hooks.h"

#include <ATen/core/Tensor.h>

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
class CopyStream {
 public:
  /// bytes_per_second = 0 means uncapped.
  CopyStream(std::string name, double bytes_per_second);
  ~CopyStream();
  CopyStream(const CopyStream&) = delete;
  CopyStream& operator=(const CopyStream&) = delete;
  /// Queues dst.copy_(src) after `after` (if given) has completed; dst and src stay alive until
  /// the copy is done (record_stream's role); `on_done` runs on the worker after the copy.
  /// Returns the event that completes with it.
  CopyEvent copy_async(at::Tensor dst, at::Tensor src, const CopyEvent* after = nullptr,
                       std::function<void()> on_done = nullptr);
  /// Seconds spent copying (including the bandwidth cap's waits) since construction.
  double busy_seconds() const { return static_cast<double>(busy_ns_.load()) * 1e-9; }
  /// Test hook: extra random delay, up to this many microseconds, before each copy.
  void set_jitter_us(int max_us) { jitter_us_ = max_us; }

 private:
  struct Job {
    at::Tensor dst, src;
    CopyEvent event;
    std::shared_ptr<CopyEvent> after;
    std::function<void()> on_done;
  };
  void run();
  std::string name_;
  double bytes_per_second_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stop_ = false;
  std::atomic<int64_t> busy_ns_{0};
  std::atomic<int> jitter_us_{0};
  std::thread worker_;
};

/// Host buffers reused across iterations, keyed by byte size. Memory comes from the system
/// allocator directly, never from the tracked device allocator.
class HostPool {
 public:
  ~HostPool();
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
  std::mutex mutex_;
  std::map<int64_t, std::vector<at::Tensor>> free_;
  std::unordered_set<const void*> owned_;
  std::atomic<int64_t> in_use_{0}, peak_{0}, allocated_{0}, allocations_{0};
};

/// Per-step offload measurements.
struct OffloadStats {
  int64_t offloaded_bytes = 0;   // device bytes copied to host this step
  double wait_s = 0.0;           // time compute waited for reloads (and for offloads to finish)
  double d2h_busy_s = 0.0;       // copy-engine time this step, each direction
  double h2d_busy_s = 0.0;
};

/// Offloads the tensors autograd saves inside groups. Usage per forward:
///   { auto g = offloader.group("layer 0"); ...run the layer... }   // commit: D2H starts
/// and from a gradient hook ahead of the group's backward, offloader.prefetch(...).
/// Saved tensors below min_elements, parameters and registered exclusions stay on the device.
class ActivationOffloader final : public SavedTensorHook {
 public:
  ActivationOffloader(int64_t min_elements, double bytes_per_second);
  ~ActivationOffloader() override;

  /// Storages never offloaded (parameters, model buffers, the batch).
  void exclude(const at::Tensor& t);

  class GroupScope {
   public:
    GroupScope(ActivationOffloader& owner, int index);
    ~GroupScope();  // commits the group: queues its device-to-host copies
    GroupScope(const GroupScope&) = delete;
    GroupScope& operator=(const GroupScope&) = delete;
    int index() const { return index_; }

   private:
    ActivationOffloader& owner_;
    int index_;
    SavedTensorHooksGuard hooks_;
  };
  /// Opens the next group of this forward (groups are numbered from 0 in forward order).
  std::unique_ptr<GroupScope> group();
  /// Starts reloading group `index` (no-op if it is resident or already reloading).
  void prefetch(int index);
  /// Call at the start of each step: forgets the previous step's groups and resets the stats.
  void begin_step();
  /// Call at the start of each forward: group numbering restarts at 0 (the previous micro-batch's
  /// backward has finished, so its groups are no longer needed by index).
  void begin_forward();
  OffloadStats stats() const;
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
  friend class GroupScope;
  void commit(int index);
  void wait_reloaded(Entry& entry);
  int64_t min_elements_;
  HostPool pool_;
  CopyStream d2h_, h2d_;
  std::unordered_set<const void*> excluded_;
  std::vector<std::shared_ptr<Group>> groups_;
  int current_ = -1;  // group whose forward is running
  mutable std::mutex mutex_;
  int64_t offloaded_bytes_ = 0;
  std::atomic<int64_t> wait_ns_{0};
  double d2h_busy_at_step_ = 0, h2d_busy_at_step_ = 0;
};

const char* to_string(ActivationOffloader::State s);

}  // namespace actmem
