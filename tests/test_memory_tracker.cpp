// test_memory_tracker.cpp — the tracking allocator's accounting is exact.
#include "actmem/memory/memory_tracker.h"
#include "test_util.h"

#include <c10/core/CPUAllocator.h>

#include <thread>

namespace actmem {
namespace {

using actmem::testing::expect_error_containing;

DeviceMemory& cpu() {
  return device_memory(c10::Device(c10::kCPU));
}

TEST(MemoryTracker, CountsKnownAllocationsExactly) {
  auto& mem = cpu();
  const int64_t base = mem.current_bytes();
  {
    at::Tensor a = at::empty({1000}, at::kFloat);
    EXPECT_EQ(mem.current_bytes() - base, 4000);
    at::Tensor b = at::empty({3, 5, 7}, at::kDouble);
    EXPECT_EQ(mem.current_bytes() - base, 4000 + 3 * 5 * 7 * 8);
    at::Tensor view = b.select(0, 1);  // views allocate nothing
    EXPECT_EQ(mem.current_bytes() - base, 4000 + 840);
    a.reset();
    EXPECT_EQ(mem.current_bytes() - base, 840);
  }
  EXPECT_EQ(mem.current_bytes(), base);
}

TEST(MemoryTracker, LiveAllocationsAndReservedBytesFollowTheBlocks) {
  // --log-memory-to-tensorboard's mem-allocated-count and mem-reserved-bytes: a tensor is one
  // live allocation until freed; its block (the request plus the 64-byte header, below 4 KiB as
  // is, above it rounded to its size class) is reserved while in use, and a cached block stays
  // reserved after the free until it is released.
  auto& mem = cpu();
  release_cached_cpu_blocks();
  const int64_t live = mem.live_allocations(), reserved = mem.reserved_bytes();
  {
    at::Tensor small = at::empty({100}, at::kFloat);  // 400 + 64 bytes
    EXPECT_EQ(mem.live_allocations() - live, 1);
    EXPECT_EQ(mem.reserved_bytes() - reserved, 464);
    at::Tensor big = at::empty({10000}, at::kFloat);  // 40,000 + 64 -> the 40,960 class
    EXPECT_EQ(mem.live_allocations() - live, 2);
    EXPECT_EQ(mem.reserved_bytes() - reserved, 464 + 40960);
    at::Tensor view = big.select(0, 3);  // a view allocates nothing
    EXPECT_EQ(mem.live_allocations() - live, 2);
  }
  EXPECT_EQ(mem.live_allocations(), live);
  EXPECT_EQ(mem.reserved_bytes() - reserved, 40960);  // the big block, cached
  release_cached_cpu_blocks();
  EXPECT_EQ(mem.reserved_bytes(), reserved);
}

TEST(MemoryTracker, PeakAndResetPeak) {
  auto& mem = cpu();
  mem.reset_peak();
  const int64_t base = mem.current_bytes();
  EXPECT_EQ(mem.peak_bytes(), base);
  {
    at::Tensor big = at::empty({1 << 20}, at::kByte);
    at::Tensor small = at::empty({100}, at::kByte);
  }
  EXPECT_EQ(mem.current_bytes(), base);
  EXPECT_EQ(mem.peak_bytes() - base, (1 << 20) + 100);
  mem.reset_peak();
  EXPECT_EQ(mem.peak_bytes(), base);
}

TEST(MemoryTracker, WindowPeakIsIndependentOfPeak) {
  auto& mem = cpu();
  mem.reset_peak();
  const int64_t base = mem.current_bytes();
  { at::Tensor t = at::empty({4096}, at::kByte); }
  mem.reset_window_peak();
  { at::Tensor t = at::empty({1024}, at::kByte); }
  EXPECT_EQ(mem.window_peak_bytes() - base, 1024);
  EXPECT_EQ(mem.peak_bytes() - base, 4096);
}

TEST(MemoryTracker, RawAllocateAndZeroBytes) {
  auto& mem = cpu();
  const int64_t base = mem.current_bytes();
  c10::Allocator* alloc = c10::GetCPUAllocator();
  ASSERT_NE(alloc->raw_deleter(), nullptr);
  void* p = alloc->raw_allocate(12345);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);  // c10's alignment is kept
  EXPECT_EQ(mem.current_bytes() - base, 12345);
  alloc->raw_deallocate(p);
  EXPECT_EQ(mem.current_bytes(), base);
  { at::Tensor empty = at::empty({0}, at::kFloat); }
  EXPECT_EQ(mem.current_bytes(), base);
}

TEST(MemoryTracker, ConcurrentAllocationsBalance) {
  auto& mem = cpu();
  const int64_t base = mem.current_bytes();
  const int64_t count_before = mem.allocation_count();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t] {
      // From 148 bytes to ~16 KiB: through malloc and through the block cache (4 KiB and up).
      for (int i = 0; i < 500; ++i) at::Tensor x = at::empty({(t + 1) * 37 + 8 * i}, at::kFloat);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mem.current_bytes(), base);
  EXPECT_GE(mem.allocation_count() - count_before, 2000);
}

TEST(MemoryTracker, CapacityThrowsAClearErrorAndLeavesCountsIntact) {
  auto& mem = cpu();
  const int64_t base = mem.current_bytes();
  mem.set_capacity(base + 1000);
  expect_error_containing([] { at::empty({1000}, at::kFloat); }, "out of device memory");
  EXPECT_EQ(mem.current_bytes(), base);
  at::Tensor fits = at::empty({250}, at::kFloat);  // exactly 1000 bytes
  EXPECT_EQ(mem.current_bytes(), base + 1000);
  fits.reset();
  mem.set_capacity(0);
  expect_error_containing([&] { mem.set_capacity(-1); }, "expected bytes >= 0");
}

TEST(MemoryTracker, FreedBlocksAreReusedBySizeClassAndCountAtTheirRequestedSize) {
  // Note [Caching the tracked CPU allocator's blocks]: 40,000 and 40,400 bytes (plus the 64-byte
  // header) both round up to the 40,960-byte class, so the second tensor gets the first's block
  // (the most recently freed of its class) while the counts stay the requested bytes.
  auto& mem = cpu();
  EXPECT_EQ(size_class(40000 + 64), 40960);
  EXPECT_EQ(size_class(40400 + 64), 40960);
  EXPECT_EQ(size_class(40960 + 1), 49152);
  const int64_t base = mem.current_bytes();
  void* first = nullptr;
  {
    at::Tensor a = at::empty({10000}, at::kFloat);
    first = a.data_ptr();
    EXPECT_EQ(mem.current_bytes() - base, 40000);
  }
  const CpuBlockCacheStats freed = cpu_block_cache_stats();
  EXPECT_GE(freed.cached, 40960);
  at::Tensor b = at::empty({10100}, at::kFloat);
  EXPECT_EQ(b.data_ptr(), first);
  EXPECT_EQ(mem.current_bytes() - base, 40400);
  EXPECT_EQ(cpu_block_cache_stats().cached, freed.cached - 40960);
  at::Tensor c = at::empty({10241}, at::kFloat);  // 40,964 bytes: the next class, a new block
  EXPECT_NE(c.data_ptr(), first);
  b.reset();
  c.reset();
  EXPECT_EQ(mem.current_bytes(), base);
  EXPECT_GE(release_cached_cpu_blocks(), 40960 + 49152);
  EXPECT_EQ(cpu_block_cache_stats().cached, 0);
  expect_error_containing([] { size_class(0); }, "expected a positive size");
}

TEST(MemoryTracker, CudaIsAClearErrorWithoutCuda) {
#ifdef ACTMEM_WITH_CUDA
  GTEST_SKIP() << "CUDA build";
#else
  expect_error_containing([] { device_memory(c10::Device(c10::kCUDA, 0)); },
                          "this build has no usable CUDA device");
#endif
}

TEST(MemoryTimeline, RecordsBytesAndWindowPeaksAtMarks) {
  auto& mem = cpu();
  MemoryTimeline timeline(mem);
  const int64_t base = mem.current_bytes();
  {
    TimelineScope scope(timeline);
    ASSERT_EQ(active_timeline(), &timeline);
    at::Tensor a = at::empty({1000}, at::kByte);
    timeline_mark("after a");
    { at::Tensor tmp = at::empty({5000}, at::kByte); }
    timeline_mark("after tmp");
  }
  EXPECT_EQ(active_timeline(), nullptr);
  timeline_mark("ignored");  // no active timeline: no-op
  ASSERT_EQ(timeline.entries().size(), 2u);
  EXPECT_EQ(timeline.entries()[0].label, "after a");
  EXPECT_EQ(timeline.entries()[0].current_bytes - base, 1000);
  EXPECT_EQ(timeline.entries()[1].current_bytes - base, 1000);
  EXPECT_EQ(timeline.entries()[1].peak_bytes - base, 6000);
  EXPECT_LE(timeline.entries()[0].time_s, timeline.entries()[1].time_s);
}

TEST(PhysicalMemory, IsPlausible) {
  EXPECT_GT(physical_memory_bytes(), int64_t{256} << 20);
}

}  // namespace
}  // namespace actmem
