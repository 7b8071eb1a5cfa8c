// test_memory_tracker.cpp — the tracking allocator's accounting is exact.
#include "actmem/memory_tracker.h"
#include "test_util.h"

#include <c10/core/CPUAllocator.h>

#include <thread>

namespace actmem {
namespace {

using actmem::testing::expect_error_containing;

DeviceMemory& cpu() { return device_memory(c10::Device(c10::kCPU)); }

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
      for (int i = 0; i < 500; ++i) at::Tensor x = at::empty({(t + 1) * 37 + i}, at::kFloat);
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
