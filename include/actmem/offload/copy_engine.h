// copy_engine.h — the copy engine of activation offload: asynchronous copies on a device-to-host
// and a host-to-device stream, events to wait on, and a pool of host buffers.
//
// On a CPU-only build "device" memory is the tracked allocator and "host" memory is allocated
// outside it (reported separately); each stream is a worker thread, optionally capped to a
// bandwidth to emulate a PCIe link (docs/offload.md, "Copy engine"). On CUDA (builds with
// ACTMEM_WITH_CUDA) the same worker issues each copy on its own c10 CUDA stream, ordered after
// the compute stream's work by an event, from and to pinned host buffers (Note [CUDA copy
// engine] in copy_engine.cpp). Nothing here knows about autograd or activations.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
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
  /// A [bytes] uint8 host tensor (from the free list when one of that size is free). With
  /// size_classes the buffer is taken from, and returns to, the size class of `bytes`
  /// (size_class()), so tensors whose sizes change from step to step (MoE routing) still reuse
  /// buffers, at most 25% larger than asked.
  at::Tensor acquire(int64_t bytes, bool size_classes = false);
  /// The buffer size `bytes` rounds up to with size classes: four classes per doubling.
  static int64_t size_class(int64_t bytes);
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

}  // namespace actmem
