// test_offload.cpp — copy engine, host pool, the offload state machine under random delays, and
// layer-level offload: bitwise exactness, memory drop, host pool reuse.
#include "actmem/base/compat.h"
#include "actmem/memory/memory_tracker.h"
#include "actmem/offload/activation_offloader.h"
#include "actmem/train/trainer.h"
#include "exactness.h"
#include "fixtures.h"
#include "test_util.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <fstream>
#include <functional>
#include <set>

namespace actmem {
namespace {

using actmem::testing::bitwise_equal;
using actmem::testing::expect_error_containing;

TEST(CopyStream, CopiesInOrderAndHonoursTheBandwidthCap) {
  CopyStream stream("test", 100e6);            // 100 MB/s
  const at::Tensor src = at::randn({250000});  // 1 MB
  at::Tensor a = at::empty_like(src), b = at::empty_like(src);
  const auto t0 = std::chrono::steady_clock::now();
  const CopyEvent ea = stream.copy_async(a, src);
  const CopyEvent eb = stream.copy_async(b, a, &ea);
  eb.wait();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_TRUE(ea.ready());
  EXPECT_TRUE(bitwise_equal(b, src));
  EXPECT_GE(s, 0.019);  // two 1 MB copies at 100 MB/s
  EXPECT_GE(stream.busy_seconds(), 0.019);
  expect_error_containing([&] { stream.copy_async(at::empty({3}), src); },
                          "destination has 12 bytes");
}

TEST(HostPool, ReusesBuffersAndStaysOutsideDeviceMemory) {
  auto& mem = device_memory(at::kCPU);
  HostPool pool;
  const int64_t device_before = mem.current_bytes();
  at::Tensor a = pool.acquire(4096), b = pool.acquire(4096);
  EXPECT_EQ(mem.current_bytes(), device_before);  // host bytes are not device bytes
  EXPECT_EQ(pool.bytes_in_use(), 8192);
  pool.release(a);
  at::Tensor c = pool.acquire(4096);
  EXPECT_EQ(c.data_ptr(), a.data_ptr());  // reused, not allocated
  EXPECT_EQ(pool.allocations(), 2);
  EXPECT_EQ(pool.peak_bytes_in_use(), 8192);
  expect_error_containing([&] { pool.release(at::empty({4096}, at::kByte)); },
                          "does not belong to this pool");
}

TEST(HostPool, SizeClassesReuseABufferForNearbySizes) {
  // Four classes per doubling: 5000..5120 bytes share the 5120 class, 5121 takes the next.
  EXPECT_EQ(HostPool::size_class(100), 4096);
  EXPECT_EQ(HostPool::size_class(4097), 5120);
  EXPECT_EQ(HostPool::size_class(5120), 5120);
  EXPECT_EQ(HostPool::size_class(5121), 6144);
  EXPECT_EQ(HostPool::size_class(8192), 8192);
  EXPECT_EQ(HostPool::size_class(1000001), 1048576);
  for (int64_t bytes = 4097; bytes < 300000; bytes += 997) {
    const int64_t c = HostPool::size_class(bytes);
    EXPECT_GE(c, bytes);
    EXPECT_LE(static_cast<double>(c), 1.25 * static_cast<double>(bytes)) << bytes;
  }
  HostPool pool;
  at::Tensor a = pool.acquire(5000, /*size_classes=*/true);
  EXPECT_EQ(a.numel(), 5000);
  a.fill_(7);
  pool.release(a);
  at::Tensor b = pool.acquire(5100, true);  // another size, the same class: the same buffer
  EXPECT_EQ(b.numel(), 5100);
  EXPECT_EQ(b.data_ptr(), a.data_ptr());
  EXPECT_EQ(pool.allocations(), 1);
  EXPECT_EQ(pool.bytes_in_use(), 5120);
  pool.release(b);
  EXPECT_EQ(pool.bytes_in_use(), 0);
  // Exact sizes do not mix with the classes.
  at::Tensor c = pool.acquire(5100);
  EXPECT_NE(c.data_ptr(), a.data_ptr());
  EXPECT_EQ(pool.allocations(), 2);
}

TEST(OffloadSchedule, MarginPerChunkOnlyWhereTheOwnBackwardFollowsAndPrefetchStaysInItsForward) {
  // Note [Offload warmup and margin]: after the warmup, the last group of each module name in a
  // chunk's forward stays on the device, but only in a forward whose own backward comes next;
  // decisions are per model chunk (chunk 1 here has one layer more). Layer groups keep no margin.
  auto group = [](const char* name, GroupKind kind = GroupKind::kModule) {
    GroupInfo g;
    g.name = name;
    g.kind = kind;
    return g;
  };
  OffloadSchedule schedule;
  EXPECT_TRUE(schedule.in_warmup());
  EXPECT_TRUE(schedule.offloads(0, 1, true, true));  // the warmup offloads everything asked
  EXPECT_FALSE(schedule.offloads(0, 1, false, true));
  schedule.end_warmup({{0, {group("qkv"), group("mlp"), group("qkv"), group("mlp")}},
                       {1,
                        {group("qkv"), group("mlp"), group("qkv"), group("mlp"), group("qkv"),
                         group("mlp"), group("layer", GroupKind::kLayer)}}});
  EXPECT_FALSE(schedule.in_warmup());
  std::vector<bool> chunk0, chunk1, chunk0_far;
  for (size_t i = 0; i < 4; ++i) chunk0.push_back(schedule.offloads(0, i, true, true));
  for (size_t i = 0; i < 7; ++i) chunk1.push_back(schedule.offloads(1, i, true, true));
  for (size_t i = 0; i < 4; ++i) chunk0_far.push_back(schedule.offloads(0, i, true, false));
  EXPECT_EQ(chunk0, (std::vector<bool>{true, true, false, false}));
  EXPECT_EQ(chunk1, (std::vector<bool>{true, true, true, true, false, false, true}));
  EXPECT_EQ(chunk0_far, (std::vector<bool>{true, true, true, true}));
  EXPECT_TRUE(schedule.offloads(0, 9, true, true));  // beyond the warmup's count
  EXPECT_TRUE(schedule.offloads(5, 2, true, true));  // a chunk the warmup never saw
  EXPECT_FALSE(schedule.offloads(0, 0, false, false));

  // Prefetch: module groups one group ahead within their own forward, never across into the
  // previous micro-batch's forward.
  std::vector<GroupInfo> groups;
  for (int f = 0; f < 2; ++f) {
    for (const char* name : {"qkv", "mlp"}) {
      GroupInfo g = group(name);
      g.forward = f;
      g.offloads = g.committed = g.has_entries = true;
      groups.push_back(g);
    }
  }
  auto at = [&](int i) -> const GroupInfo* {
    return i >= 0 && i < static_cast<int>(groups.size()) ? &groups[static_cast<size_t>(i)]
                                                         : nullptr;
  };
  EXPECT_EQ(schedule.prefetch_target(3, BackwardPoint::kStart, at), 2);
  EXPECT_EQ(schedule.prefetch_target(2, BackwardPoint::kStart, at), -1);  // forward 1's first
  EXPECT_EQ(schedule.prefetch_target(1, BackwardPoint::kStart, at), 0);
  EXPECT_EQ(schedule.prefetch_target(3, BackwardPoint::kCommit, at), -1);  // modules: at start
}

TEST(ActivationOffloader, StateMachineSurvivesRandomDelaysAndAnImmediateReload) {
  // Offload, then reload at once while the D2H copy is still delayed: the reload must wait for
  // the offload (Megatron's race, Megatron-LM issue #7398), and the data must come back intact.
  ActivationOffloader off(/*min_elements=*/1, /*bytes_per_second=*/200e6);
  off.d2h().set_jitter_us(3000);
  off.h2d().set_jitter_us(3000);
  for (int round = 0; round < 20; ++round) {
    off.begin_step();
    off.begin_forward();
    const at::Tensor x = at::randn({64, 64}).requires_grad_(true);
    at::Tensor y;
    {
      OffloadRegion group(&off, "layer", GroupKind::kLayer);
      const at::Tensor xs = group.enter(x);
      y = group.commit((xs.sin() * xs.cos()).sum());  // sin and cos inputs are saved and offloaded
    }
    if (round % 2 == 0) off.prefetch(0);  // prefetch while the offload may still be running
    y.backward();
    const at::Tensor xd = x.detach();
    EXPECT_TRUE(at::allclose(x.grad(), xd.cos() * xd.cos() - xd.sin() * xd.sin())) << round;
    EXPECT_GT(off.stats().offloaded_bytes, 0);
  }
}

using actmem::testing::offload_model;

class LayerOffloadExactness : public ::testing::TestWithParam<std::tuple<int, const char*>> {};

TEST_P(LayerOffloadExactness, BitwiseEqualToPlainOverThreeSteps) {
  TransformerConfig base = offload_model();
  TrainingConfig t;
  actmem::testing::set_precision(base, t, std::get<1>(GetParam()));
  TransformerConfig off = base;
  off.cpu_offloading_num_layers = std::get<0>(GetParam());
  t.global_batch_size = 4;  // two micro-batches
  t.eval_interval = 0;
  TrainingConfig capped = t;
  capped.offload_bandwidth_gbps = 0.5;  // slow link: reloads are waited for
  Trainer offloaded(off, capped);
  offloaded.offloader()->d2h().set_jitter_us(500);
  offloaded.offloader()->h2d().set_jitter_us(500);
  actmem::testing::expect_bitwise_equal_to_plain(
      base, t, offloaded, 3, [](const IterationStats& b) { EXPECT_GT(b.offloaded_bytes, 0); });
}

INSTANTIATE_TEST_SUITE_P(K, LayerOffloadExactness,
                         ::testing::Combine(::testing::Values(1, 2, 3),
                                            ::testing::ValuesIn(actmem::testing::kPrecisions)),
                         [](const auto& info) {
                           return std::to_string(std::get<0>(info.param)) + "_" +
                                  std::get<1>(info.param);
                         });

TEST(LayerOffloadMemory, PeakDropsByTheOffloadedBytesAndThePoolStopsGrowing) {
  TransformerConfig base = offload_model();
  base.num_layers = 6;
  base.hidden_size = 64;
  base.seq_length = 64;
  TransformerConfig off = base;
  off.cpu_offloading_num_layers = 2;
  // Compute waits for each group's copy at its commit, so the measured peak does not depend on
  // how fast the copy threads run under a loaded machine (ctest -j).
  off.fine_grained_offloading_max_inflight_offloads = 0;
  TrainingConfig t;
  t.eval_interval = 0;
  Trainer plain(base, t), offloaded(off, t);
  IterationStats a, b;
  int64_t allocations_after_first = 0;
  for (int step = 1; step <= 4; ++step) {
    a = plain.train_step(false);
    b = offloaded.train_step(false);
    if (step == 1) allocations_after_first = offloaded.offloader()->pool().allocations();
  }
  EXPECT_EQ(offloaded.offloader()->pool().allocations(), allocations_after_first);
  EXPECT_GT(b.host_peak_bytes, 0);
  // Megatron's criterion: the peak drops by the offloaded bytes within 30% (and 20 MiB).
  const double drop = static_cast<double>(a.activation_peak_bytes - b.activation_peak_bytes);
  const double off_bytes = static_cast<double>(b.offloaded_bytes);
  EXPECT_NEAR(drop, off_bytes, std::min(0.3 * off_bytes, 20.0 * (1 << 20)))
      << "plain peak " << a.activation_peak_bytes << " offload peak " << b.activation_peak_bytes;
  EXPECT_GE(b.offload_wait_s, 0.0);
}

TEST(LayerOffload, ValidationFollowsMegatron) {
  TransformerConfig c = offload_model();
  c.cpu_offloading_num_layers = 4;
  expect_error_containing([&] { c.validate(); },
                          "CPU offloading can be done only for layers less than 4");
  c.cpu_offloading_num_layers = -1;
  expect_error_containing([&] { c.validate(); },
                          "CPU offloading can be done only for layers less than 4");
  c.cpu_offloading_num_layers = 1;
  c.recompute_granularity = "selective";
  expect_error_containing([&] { c.validate(); },
                          "CPU offloading does not work when activation recomputation is enabled");
  c.recompute_granularity = "";
  c.min_offloaded_tensor_size = -1;
  expect_error_containing([&] { c.validate(); }, "min_offloaded_tensor_size must be >= 0");
  // The in-flight cap applies to layer-level offload too (our extension; Megatron's is a
  // fine-grained setting): checked, and part of the plan.
  c.min_offloaded_tensor_size = 0;
  c.fine_grained_offloading_max_inflight_offloads = -2;
  expect_error_containing([&] { c.validate(); },
                          "fine_grained_offloading_max_inflight_offloads must be >= 0");
  c.fine_grained_offloading_max_inflight_offloads = 0;
  const ActivationPlan plan = make_activation_plan(c);
  EXPECT_EQ(plan.max_inflight_offloads, 0);
  EXPECT_NE(plan.summary().find("the first 1 layer(s), at most 0 in flight"), std::string::npos)
      << plan.summary();
}

}  // namespace
}  // namespace actmem

namespace actmem {
namespace {

struct FineGrained {
  const char* name;
  std::vector<std::string> modules;
  std::vector<std::string> recompute;  // selective targets, empty = none
};
inline void PrintTo(const FineGrained& f, std::ostream* os) {
  *os << f.name;
}

class FineGrainedExactness : public ::testing::TestWithParam<std::tuple<FineGrained, const char*>> {
};

TEST_P(FineGrainedExactness, BitwiseEqualToPlainOverThreeSteps) {
  const FineGrained& param = std::get<0>(GetParam());
  TransformerConfig base = offload_model();
  TrainingConfig t;
  actmem::testing::set_precision(base, t, std::get<1>(GetParam()));
  if (std::string(param.name).rfind("Flash", 0) == 0) {
    // The flash kernel keeps its output and logsumexp inside the core_attn group.
    base.attention_dropout = 0.0;
    base.attention_backend = "flash";
  }
  TransformerConfig off = base;
  off.fine_grained_activation_offloading = true;
  off.offload_modules = param.modules;
  if (!param.recompute.empty()) {
    base.recompute_granularity = off.recompute_granularity = "selective";
    base.recompute_modules = off.recompute_modules = param.recompute;
  }
  t.global_batch_size = 4;
  t.eval_interval = 0;
  Trainer offloaded(off, t);
  actmem::testing::expect_bitwise_equal_to_plain(base, t, offloaded, 3);
  EXPECT_GT(offloaded.offloader()->stats().offloaded_bytes, 0);
}

INSTANTIATE_TEST_SUITE_P(
    Modules, FineGrainedExactness,
    ::testing::Combine(
        ::testing::Values(
            FineGrained{"AttnNorm", {"attn_norm"}, {}},
            FineGrained{"QkvLinear", {"qkv_linear"}, {}},
            FineGrained{"CoreAttn", {"core_attn"}, {}},
            FineGrained{"CoreAttnAttnProj", {"core_attn", "attn_proj"}, {}},
            FineGrained{"MlpNorm", {"mlp_norm"}, {}},
            FineGrained{
                "All", {"attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"}, {}},
            FineGrained{"WithSelectiveRecompute",
                        {"attn_norm", "qkv_linear", "mlp_norm"},
                        {"core_attn", "mlp", "layernorm"}},
            FineGrained{"FlashCoreAttnAttnProj", {"core_attn", "attn_proj"}, {}},
            FineGrained{
                "FlashAll", {"attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"}, {}}),
        ::testing::ValuesIn(actmem::testing::kPrecisions)),
    [](const auto& info) {
      return std::string(std::get<0>(info.param).name) + "_" + std::get<1>(info.param);
    });

}  // namespace
}  // namespace actmem

namespace actmem {
namespace {

TEST(FineGrainedMemory, PeakDropsByTheSummaryBytesAfterWarmupAndThePoolStopsGrowing) {
  TransformerConfig base = offload_model();
  base.hidden_size = 64;
  base.seq_length = 64;
  TransformerConfig off = base;
  off.fine_grained_activation_offloading = true;
  off.offload_modules = {"attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"};
  off.min_offloaded_tensor_size = 1024;
  off.fine_grained_offloading_max_inflight_offloads = 0;  // deterministic memory (see above)
  TrainingConfig t;
  t.eval_interval = 0;
  Trainer plain(base, t), offloaded(off, t);
  IterationStats a, b;
  int64_t allocations_after_first = 0;
  for (int step = 1; step <= 4; ++step) {
    a = plain.train_step(false);
    b = offloaded.train_step(false);
    if (step == 1) {
      allocations_after_first = offloaded.offloader()->pool().allocations();
      EXPECT_FALSE(offloaded.offloader()->in_warmup());
    }
  }
  EXPECT_EQ(offloaded.offloader()->pool().allocations(), allocations_after_first);
  const auto& summary = offloaded.offloader()->summary();
  ASSERT_EQ(summary.size(), 5u);
  int64_t summary_bytes = 0;
  for (const auto& row : summary) summary_bytes += row.bytes;
  EXPECT_EQ(b.offloaded_bytes, summary_bytes);  // the margin rule fixed after warmup
  const double drop = static_cast<double>(a.activation_peak_bytes - b.activation_peak_bytes);
  EXPECT_NEAR(drop, static_cast<double>(summary_bytes),
              std::min(0.3 * static_cast<double>(summary_bytes), 20.0 * (1 << 20)));
}

TEST(FineGrained, ValidationMessages) {
  auto with = [](std::vector<std::string> modules) {
    TransformerConfig c = offload_model();
    c.fine_grained_activation_offloading = true;
    c.offload_modules = std::move(modules);
    return c;
  };
  expect_error_containing([&] { with({}).validate(); }, "offload_modules must name at least one");
  expect_error_containing(
      [&] {
        with({"core_attn", "fc9"}).validate();
      },
      "Invalid choices for offload_modules: {'fc9'}");
  expect_error_containing([&] { with({"attn_proj"}).validate(); },
                          "attn_proj cannot be set to offload_modules alone without core_attn");
  expect_error_containing([&] { with({"moe_act"}).validate(); }, "need MoE layers");
  auto both = with({"core_attn"});
  both.recompute_granularity = "selective";
  expect_error_containing([&] { both.validate(); },
                          "core_attn cannot be both offloaded and recomputed");
  auto layer = with({"core_attn"});
  layer.cpu_offloading_num_layers = 1;
  expect_error_containing([&] { layer.validate(); }, "cannot be enabled with cpu_offloading");
  auto full = with({"core_attn"});
  full.recompute_granularity = "full";
  full.recompute_method = "uniform";
  full.recompute_num_layers = 1;
  expect_error_containing([&] { full.validate(); }, "selective recompute only");
  TransformerConfig stray = offload_model();
  stray.offload_modules = {"core_attn"};
  expect_error_containing([&] { stray.validate(); }, "offload_modules only applies with");
}

TEST(FineGrained, TraceHasComputeAndBothCopyStreams) {
  const std::string trace = ::testing::TempDir() + "offload_trace.json";
  const auto r = actmem::testing::run_actmem(
      "train --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
      "--micro-batch-size 2 --train-iters 2 --eval-interval 0 --fine-grained-activation-offloading "
      "--offload-modules core_attn attn_proj --min-offloaded-tensor-size 1024 --trace " +
      trace);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("Activation Offload Summary (MB)"), std::string::npos) << r.output;
  std::ifstream in(trace);
  const auto j = nlohmann::json::parse(in);
  std::set<std::string> tracks;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "X") tracks.insert(e["cat"].get<std::string>());
  }
  EXPECT_EQ(tracks, (std::set<std::string>{"compute", "d2h", "h2d"}));
}

// ---- the CUDA copy engine (builds with CUDA; skipped without a CUDA device) ------------------

#ifdef ACTMEM_WITH_CUDA
TEST(CudaCopyEngine, RoundTripIsOrderedAfterComputeThroughPinnedBuffers) {
  if (!compat::cuda_available()) GTEST_SKIP() << "no CUDA device";
  const at::Device cuda("cuda:0");
  CopyStream d2h("d2h", 0, cuda), h2d("h2d", 0, cuda);
  HostPool pool(/*pinned=*/true);
  for (int round = 0; round < 10; ++round) {
    // Kernels queued on the compute stream produce src; the copy must see their final result.
    at::Tensor src = at::zeros({1 << 22}, at::TensorOptions().device(cuda));
    for (int i = 0; i < 50; ++i) src.add_(1.0);
    const at::Tensor bytes = src.view(at::kByte);
    at::Tensor host = pool.acquire(static_cast<int64_t>(src.nbytes()));
    EXPECT_TRUE(host.is_pinned());
    const CopyEvent off = d2h.copy_async(host, bytes);
    at::Tensor back = at::empty({static_cast<int64_t>(src.nbytes())},
                                at::TensorOptions().dtype(at::kByte).device(cuda));
    const CopyEvent on = h2d.copy_async(back, host, &off);  // never before the offload finished
    on.wait();
    EXPECT_TRUE(off.ready());
    EXPECT_TRUE(at::all(host.view(at::kFloat) == 50.0).item<bool>()) << "round " << round;
    EXPECT_TRUE(bitwise_equal(back.view(at::kFloat), src)) << "round " << round;
    pool.release(host);
  }
  EXPECT_EQ(pool.allocations(), 1);  // one pinned buffer, reused every round
}

TEST(CudaOffload, FineGrainedAndLayerLevelAreBitwiseEqualToPlainOnCuda) {
  if (!compat::cuda_available()) GTEST_SKIP() << "no CUDA device";
  auto config = [](const std::function<void(TransformerConfig&)>& apply) {
    TransformerConfig c;
    c.num_layers = 4;
    c.hidden_size = 128;
    c.num_attention_heads = 4;
    c.seq_length = 128;
    c.micro_batch_size = 4;
    c.min_offloaded_tensor_size = 0;
    if (apply) apply(c);
    return c;
  };
  TrainingConfig t;
  t.device = "cuda";
  t.eval_interval = 0;
  t.global_batch_size = 8;
  for (const auto& apply : std::vector<std::function<void(TransformerConfig&)>>{
           [](TransformerConfig& c) {
             c.fine_grained_activation_offloading = true;
             c.offload_modules = {"attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"};
           },
           [](TransformerConfig& c) { c.cpu_offloading_num_layers = 2; }}) {
    Trainer plain(config(nullptr), t), offload(config(apply), t);
    actmem::testing::expect_bitwise_equal_training(plain, offload, 3, [](const IterationStats& st) {
      EXPECT_GT(st.offloaded_bytes, 0);
      EXPECT_GT(st.host_peak_bytes, 0);
    });
  }
}
#endif

}  // namespace
}  // namespace actmem
