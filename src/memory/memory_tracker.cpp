// memory_tracker.cpp — the tracking CPU allocator and the CUDA statistics reader.
#include "actmem/memory/memory_tracker.h"

#include "actmem/base/compat.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <malloc.h>

#include <unistd.h>
#include <atomic>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace actmem {

namespace {

// Note [Tracking allocator layout]
// Every block is [kHeader bytes | user bytes]; the header stores the user size, so the deleter
// (which only receives the user pointer, as raw_deallocate requires) can subtract exactly what
// was added. kHeader equals c10's 64-byte alignment so user pointers stay 64-byte aligned.
constexpr size_t kHeader = 64;

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_window_peak{0};
std::atomic<int64_t> g_capacity{0};
std::atomic<int64_t> g_count{0};
std::atomic<int64_t> g_live{0};         // allocations alive
std::atomic<int64_t> g_small_bytes{0};  // bytes of the blocks below kCacheMin in use

void raise_to(std::atomic<int64_t>& peak, int64_t value) {
  int64_t seen = peak.load(std::memory_order_relaxed);
  while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

// Note [Caching the tracked CPU allocator's blocks]
// libtorch's CPU allocator hands every tensor to malloc. A step whose tensor sizes change from
// step to step (an MoE layer's per-expert rows follow the routing) fragments glibc's heap: on
// the 2-layer, 4-expert, top-2 model the process grew by 2.9 MB per step for the first 60 steps
// and was still growing after 600 (RSS 300 -> 635 MB, while the live bytes stayed at 43 MiB), and
// every step page-faulted ~4.5 MB of fresh heap, which made the MoE step's time noisy (a plain
// step against an identical plain step: 0.81 to 1.32 per round). A GPU caching allocator does
// not do this, and neither do we: blocks of kCacheMin bytes and more are rounded up to a size
// class (four per doubling, so at most 25% larger; HostPool's classes) and kept on a free list
// of that class when freed, for the next request of the class. The reserved bytes are then
// bounded by the most each class ever held at once, and the steady step allocates nothing new.
// The counted bytes (current, peak, the capacity check) stay the requested sizes: what a tensor
// needs, as CUDA's allocated-bytes statistics count it. When the system refuses a block the
// cached ones are returned to it and the request is tried once more.
constexpr size_t kCacheMin = 4096;

struct BlockCache {
  std::mutex mutex;
  std::unordered_map<size_t, std::vector<void*>> free;  // by block size (the class)
  int64_t cached = 0;                                   // bytes on the free lists
  int64_t reserved = 0;                                 // bytes of every block the cache manages
};

BlockCache& block_cache() {
  static auto* cache = new BlockCache();  // never destroyed: tensors may outlive static teardown
  return *cache;
}

size_t block_size(size_t n) {
  const size_t want = n + kHeader;
  return want < kCacheMin ? want : static_cast<size_t>(size_class(static_cast<int64_t>(want)));
}

// Frees every cached block; returns the bytes released.
int64_t release_cached() {
  BlockCache& cache = block_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  const int64_t released = cache.cached;
  for (auto& [size, list] : cache.free) {
    for (void* p : list) std::free(p);
  }
  cache.free.clear();
  cache.reserved -= cache.cached;
  cache.cached = 0;
  return released;
}

void* allocate_block(size_t n) {
  const size_t size = block_size(n);
  if (size >= kCacheMin) {
    BlockCache& cache = block_cache();
    std::lock_guard<std::mutex> lock(cache.mutex);
    const auto it = cache.free.find(size);
    if (it != cache.free.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      cache.cached -= static_cast<int64_t>(size);
      return p;
    }
  }
  void* base = nullptr;
  if (posix_memalign(&base, kHeader, size) != 0 || base == nullptr) {
    base = nullptr;
    if (release_cached() > 0 && posix_memalign(&base, kHeader, size) != 0) base = nullptr;
  }
  if (base != nullptr && size >= kCacheMin) {
    BlockCache& cache = block_cache();
    std::lock_guard<std::mutex> lock(cache.mutex);
    cache.reserved += static_cast<int64_t>(size);
  }
  return base;
}

void tracked_free(void* data) {
  if (data == nullptr) return;
  char* base = static_cast<char*>(data) - kHeader;
  const size_t n = *reinterpret_cast<size_t*>(base);
  g_current.fetch_sub(static_cast<int64_t>(n), std::memory_order_relaxed);
  g_live.fetch_sub(1, std::memory_order_relaxed);
  const size_t size = block_size(n);
  if (size < kCacheMin) {
    g_small_bytes.fetch_sub(static_cast<int64_t>(size), std::memory_order_relaxed);
    std::free(base);
    return;
  }
  BlockCache& cache = block_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  cache.free[size].push_back(base);
  cache.cached += static_cast<int64_t>(size);
}

struct TrackingCpuAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    const c10::Device cpu(c10::DeviceType::CPU);
    if (n == 0) return {nullptr, nullptr, &tracked_free, cpu};
    const auto bytes = static_cast<int64_t>(n);
    // Commit the bytes only when they fit, so racing allocations near the cap are judged on
    // the real total and a refused allocation never shows up in the peak.
    const int64_t cap = g_capacity.load(std::memory_order_relaxed);
    int64_t seen = g_current.load(std::memory_order_relaxed);
    int64_t now = 0;
    do {
      now = seen + bytes;
      TORCH_CHECK(cap <= 0 || now <= cap, "actmem: out of device memory: tried to allocate ", bytes,
                  " bytes with ", seen, " of ", cap,
                  " bytes in use (raise --device-memory-limit or shrink the model or batch)");
    } while (!g_current.compare_exchange_weak(seen, now, std::memory_order_relaxed));
    void* base = allocate_block(n);
    if (base == nullptr) {
      g_current.fetch_sub(bytes, std::memory_order_relaxed);
      TORCH_CHECK(false, "actmem: out of memory: the system refused an allocation of ", bytes,
                  " bytes");
    }
    *static_cast<size_t*>(base) = n;
    g_count.fetch_add(1, std::memory_order_relaxed);
    g_live.fetch_add(1, std::memory_order_relaxed);
    if (block_size(n) < kCacheMin) {
      g_small_bytes.fetch_add(static_cast<int64_t>(block_size(n)), std::memory_order_relaxed);
    }
    raise_to(g_peak, now);
    raise_to(g_window_peak, now);
    void* data = static_cast<char*>(base) + kHeader;
    return {data, data, &tracked_free, cpu};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &tracked_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

TrackingCpuAllocator g_allocator;

class CpuMemory final : public DeviceMemory {
 public:
  int64_t current_bytes() const override { return g_current.load(); }
  int64_t peak_bytes() const override { return g_peak.load(); }
  void reset_peak() override { g_peak.store(g_current.load()); }
  int64_t window_peak_bytes() const override { return g_window_peak.load(); }
  void reset_window_peak() override { g_window_peak.store(g_current.load()); }
  void set_capacity(int64_t bytes) override {
    TORCH_CHECK(bytes >= 0, "actmem::DeviceMemory::set_capacity: expected bytes >= 0, got ", bytes);
    g_capacity.store(bytes);
  }
  int64_t capacity() const override { return g_capacity.load(); }
  int64_t allocation_count() const override { return g_count.load(); }
  int64_t live_allocations() const override { return g_live.load(); }
  int64_t reserved_bytes() const override {
    return g_small_bytes.load() + cpu_block_cache_stats().reserved;
  }
};

class CudaMemory final : public DeviceMemory {
 public:
  explicit CudaMemory(int device) : device_(device) {}
  int64_t current_bytes() const override {
    return compat::cuda_memory_stats(device_).allocated_current;
  }
  int64_t peak_bytes() const override { return compat::cuda_memory_stats(device_).allocated_peak; }
  void reset_peak() override { compat::cuda_reset_peak(device_); }
  int64_t window_peak_bytes() const override { return -1; }
  void reset_window_peak() override {}
  void set_capacity(int64_t) override {}
  int64_t capacity() const override { return 0; }
  int64_t allocation_count() const override { return -1; }
  int64_t live_allocations() const override {
    return compat::cuda_memory_stats(device_).allocations_current;
  }
  int64_t reserved_bytes() const override {
    return compat::cuda_memory_stats(device_).reserved_current;
  }

 private:
  int device_;
};

std::once_flag g_install_once;

}  // namespace

void install_memory_tracker() {
  std::call_once(g_install_once, [] {
    // Note [Host malloc as a caching allocator]
    // glibc serves blocks above 32 MiB (the [b, a, s, s] attention tensors of the 4 x 512 model
    // are 32 MiB) with mmap and returns them on free, so every step page-faults them in again;
    // a GPU caching allocator keeps such blocks. Keeping freed memory in the heap makes the
    // steady-state step fault-free (4 x 512 step: 1.96 s -> 1.68 s) and step-time ratios reflect
    // compute, not page faults. Counted bytes are unaffected: they are the requested sizes.
    // Sizes that change from step to step still fragmented the heap; the tracked allocator's
    // own block cache handles those (Note [Caching the tracked CPU allocator's blocks]).
    mallopt(M_MMAP_MAX, 0);
    mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
    c10::SetCPUAllocator(&g_allocator, /*priority=*/100);
  });
}

DeviceMemory& device_memory(const c10::Device& device) {
  if (device.is_cpu()) {
    install_memory_tracker();
    static CpuMemory cpu;
    return cpu;
  }
  TORCH_CHECK(device.is_cuda(), "actmem::device_memory: expected a cpu or cuda device, got ",
              device.str());
  TORCH_CHECK(compat::cuda_available(), "actmem::device_memory: ", device.str(),
              " requested but this build has no usable CUDA device");
  static std::mutex mutex;
  static std::vector<std::unique_ptr<CudaMemory>> per_device;
  std::lock_guard<std::mutex> lock(mutex);
  const int index = device.has_index() ? device.index() : 0;
  if (static_cast<int>(per_device.size()) <= index) per_device.resize(index + 1);
  if (!per_device[index]) per_device[index] = std::make_unique<CudaMemory>(index);
  return *per_device[index];
}

void synchronize_device(const c10::Device& device) {
  if (device.is_cuda()) compat::cuda_synchronize(device.has_index() ? device.index() : 0);
}

int64_t size_class(int64_t bytes) {
  TORCH_CHECK(bytes > 0, "actmem::size_class: expected a positive size, got ", bytes);
  if (bytes <= 4096) return 4096;
  const int n = 63 - __builtin_clzll(static_cast<unsigned long long>(bytes - 1));  // 2^n < bytes
  const int64_t step = int64_t{1} << (n - 2);
  return (bytes + step - 1) / step * step;
}

CpuBlockCacheStats cpu_block_cache_stats() {
  BlockCache& cache = block_cache();
  std::lock_guard<std::mutex> lock(cache.mutex);
  return {cache.reserved, cache.cached};
}

int64_t release_cached_cpu_blocks() {
  return release_cached();
}

int64_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
}

// ---- timeline ---------------------------------------------------------------------------------

MemoryTimeline::MemoryTimeline(DeviceMemory& memory)
    : memory_(memory), start_(std::chrono::steady_clock::now()) {
  memory_.reset_window_peak();
}

void MemoryTimeline::mark(const std::string& label) {
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  entries_.push_back({label, t, memory_.current_bytes(), memory_.window_peak_bytes()});
  memory_.reset_window_peak();
}

void MemoryTimeline::clear() {
  entries_.clear();
  start_ = std::chrono::steady_clock::now();
  memory_.reset_window_peak();
}

namespace {
// Backward hooks run on the autograd engine's threads, so the active timeline is a process-wide
// pointer rather than thread-local; one training step at a time sets it.
std::atomic<MemoryTimeline*> g_active_timeline{nullptr};
}  // namespace

MemoryTimeline* active_timeline() {
  return g_active_timeline.load();
}

void timeline_mark(const std::string& label) {
  if (MemoryTimeline* timeline = g_active_timeline.load()) timeline->mark(label);
}

TimelineScope::TimelineScope(MemoryTimeline& timeline)
    : previous_(g_active_timeline.exchange(&timeline)) {}

TimelineScope::~TimelineScope() {
  g_active_timeline.store(previous_);
}

}  // namespace actmem
