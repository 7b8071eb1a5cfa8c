// memory_tracker.h — exact device-memory accounting and a timeline of bytes at named points.
//
// On CPU, "device memory" is every byte allocated through libtorch's CPU allocator, which
// install() replaces with a tracking allocator (c10::SetCPUAllocator; docs/memory-tracker.md):
// each block carries its size in a small header before the pointer, so frees are exact and
// raw_allocate/raw_deallocate work.
// On CUDA the same interface reads the caching allocator's allocated-bytes statistics.
// Host-side offload buffers (copy_engine.h) are allocated outside this allocator on purpose.
#pragma once

#include <c10/core/Device.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace actmem {

/// Current and peak bytes of one device. All methods are thread-safe.
class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  /// Bytes held right now.
  virtual int64_t current_bytes() const = 0;
  /// Highest current_bytes() since the last reset_peak() (or since start).
  virtual int64_t peak_bytes() const = 0;
  /// Sets the peak to the current value.
  virtual void reset_peak() = 0;
  /// Highest current_bytes() since the last reset_window_peak(); independent of peak_bytes(),
  /// so a timeline can measure between its marks without disturbing an outer peak measurement.
  /// Returns -1 where the backend cannot track a second peak (CUDA).
  virtual int64_t window_peak_bytes() const = 0;
  virtual void reset_window_peak() = 0;
  /// Limit on current_bytes(); an allocation beyond it throws a c10::Error that says so.
  /// 0 means unlimited. Only the CPU backend enforces it.
  virtual void set_capacity(int64_t bytes) = 0;
  virtual int64_t capacity() const = 0;
  /// Number of allocations since start (CPU only; -1 elsewhere).
  virtual int64_t allocation_count() const = 0;
  /// Allocations alive right now (CUDA's allocation.all.current).
  virtual int64_t live_allocations() const = 0;
  /// Bytes the allocator holds from the system, in use or cached for reuse (CUDA's
  /// reserved_bytes.all.current; on CPU the blocks of the tracked allocator, with their headers
  /// and size-class rounding: Note [Caching the tracked CPU allocator's blocks]).
  virtual int64_t reserved_bytes() const = 0;
};

/// Installs the tracking CPU allocator (idempotent; call before creating tensors whose bytes
/// should count). Tensors allocated earlier keep their old deleter and are simply not counted.
void install_memory_tracker();

/// The block size a request of `bytes` rounds up to: four classes per doubling ((2^n, 2^(n+1)]
/// rounds up to a multiple of 2^(n-2), so at most 25% more than asked), 4 KiB at least. The
/// tracked CPU allocator's cached blocks and the offload host pool (copy_engine.h) use it.
int64_t size_class(int64_t bytes);

/// The tracked CPU allocator keeps freed blocks of 4 KiB and more for reuse, by size class
/// (Note [Caching the tracked CPU allocator's blocks] in memory_tracker.cpp), as a GPU caching
/// allocator does. `reserved`: bytes of every block it manages (in use or free); `cached`: of
/// those, the bytes free for reuse. Neither counts in DeviceMemory's current or peak bytes.
struct CpuBlockCacheStats {
  int64_t reserved = 0;
  int64_t cached = 0;
};
CpuBlockCacheStats cpu_block_cache_stats();
/// Returns every cached (free) block to the system; returns the bytes released.
int64_t release_cached_cpu_blocks();

/// The accounting for `device`; installs the CPU tracker on first use. Throws for CUDA when
/// this build has no CUDA support, and for other device types.
DeviceMemory& device_memory(const c10::Device& device);

/// Waits until queued work on `device` has finished (no-op on CPU), so the byte counts are final.
void synchronize_device(const c10::Device& device);

/// Physical memory of this machine in bytes.
int64_t physical_memory_bytes();

/// Device bytes recorded at named points of a step: forward and backward of each layer, etc.
class MemoryTimeline {
 public:
  struct Entry {
    std::string label;
    double time_s;          // seconds since the timeline was started
    int64_t current_bytes;  // bytes held at the mark
    int64_t peak_bytes;     // highest bytes since the previous mark (-1 when unavailable)
  };

  explicit MemoryTimeline(DeviceMemory& memory);
  /// Records the bytes held now and the window peak since the previous mark.
  void mark(const std::string& label);
  const std::vector<Entry>& entries() const { return entries_; }
  std::chrono::steady_clock::time_point start_time() const { return start_; }
  void clear();

 private:
  DeviceMemory& memory_;
  std::chrono::steady_clock::time_point start_;
  std::vector<Entry> entries_;
};

/// The timeline the model reports into while a TimelineScope is alive (nullptr otherwise);
/// layers call timeline_mark(), which is a no-op without one. Process-wide, because backward
/// hooks run on the autograd engine's threads: one step at a time may record.
MemoryTimeline* active_timeline();
void timeline_mark(const std::string& label);

/// Makes `timeline` the active one until destroyed, then restores the previous one.
class TimelineScope {
 public:
  explicit TimelineScope(MemoryTimeline& timeline);
  ~TimelineScope();
  TimelineScope(const TimelineScope&) = delete;
  TimelineScope& operator=(const TimelineScope&) = delete;

 private:
  MemoryTimeline* previous_;
};

}  // namespace actmem
