// test_recompute.cpp — checkpoint and CheckpointWithoutOutput mechanisms, and every recompute
// strategy of the model: bitwise exactness against the plain run over several optimizer steps,
// re-execution counts, chunk layouts and the memory each strategy saves.
#include "actmem/memory/memory_model.h"
#include "actmem/memory/memory_tracker.h"
#include "actmem/model/activation_bytes.h"
#include "actmem/model/model.h"
#include "actmem/recompute/recompute.h"
#include "actmem/recompute/rng.h"
#include "actmem/train/trainer.h"
#include "exactness.h"
#include "fixtures.h"
#include "test_util.h"

#include <ATen/CPUGeneratorImpl.h>

namespace actmem {
namespace {

using actmem::testing::bitwise_equal;
using actmem::testing::expect_error_containing;
using actmem::testing::gradcheck;
using actmem::testing::selective;

at::Tensor cpu_state() {
  return at::detail::getDefaultCPUGenerator().get_state();
}

// ---- checkpoint (CheckpointFunction) ----------------------------------------------------------

TEST(Checkpoint, AddsLikeMegatronsTest) {  // test_checkpoint
  const at::Tensor a = at::ones({16}).requires_grad_(true);
  const at::Tensor b = (2 * at::ones({16})).requires_grad_(true);
  const auto out =
      checkpoint([](const TensorList& in) { return TensorList{in[0] + in[1]}; }, false, {a, b});
  EXPECT_TRUE(at::equal(out[0], 3 * at::ones({16})));
  out[0].sum().backward();
  EXPECT_TRUE(at::equal(a.grad(), at::ones({16})));
  EXPECT_TRUE(at::equal(b.grad(), at::ones({16})));
}

// A function with dropout and a parameter, to compare with and without checkpointing.
struct DropoutBlock {
  at::Tensor w = at::randn({8, 8}).requires_grad_(true);
  TensorList operator()(const TensorList& in) const {
    const at::Tensor h = at::tanh(at::matmul(in[0], w));
    return {apply_dropout(h, 0.3, true) * in[1], at::gelu(h)};
  }
};

TEST(Checkpoint, BitwiseEqualToPlainWithDropoutAndLeavesTheAmbientStream) {
  DropoutBlock f;
  const at::Tensor x0 = at::randn({6, 8}), y0 = at::randn({6, 8});
  auto run = [&](bool ckpt) {
    const at::Tensor x = x0.clone().requires_grad_(true), y = y0.clone().requires_grad_(true);
    f.w.mutable_grad() = at::Tensor();
    at::manual_seed(77);
    const TensorList out = ckpt ? checkpoint(std::ref(f), false, {x, y}) : f({x, y});
    (out[0].sum() + 2 * out[1].sum()).backward();
    at::randn({3});  // the ambient stream continues exactly where the forward left it
    return std::vector<at::Tensor>{out[0], out[1], x.grad(), y.grad(), f.w.grad(), cpu_state()};
  };
  recompute_counters().reset();
  const auto plain = run(false);
  const auto ckpt = run(true);
  EXPECT_EQ(recompute_counters().checkpoints.load(), 1);
  EXPECT_EQ(recompute_counters().recomputes.load(), 1);
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(bitwise_equal(plain[i], ckpt[i])) << i;
}

TEST(Checkpoint, RefusesAutogradGrad) {
  const at::Tensor x = at::randn({4}).requires_grad_(true);
  const auto out =
      checkpoint([](const TensorList& in) { return TensorList{in[0] * 2}; }, false, {x});
  expect_error_containing([&] { torch::autograd::grad({out[0].sum()}, {x}); },
                          "not compatible with torch::autograd::grad()");
}

TEST(Checkpoint, RunsDirectlyWithoutGradAndNeedsAGradInput) {
  recompute_counters().reset();
  {
    at::NoGradGuard no_grad;
    const auto out = checkpoint([](const TensorList& in) { return TensorList{in[0] + 1}; }, false,
                                {at::zeros({2}).requires_grad_(true)});
    EXPECT_FALSE(out[0].requires_grad());
  }
  EXPECT_EQ(recompute_counters().checkpoints.load(), 0);
  expect_error_containing(
      [] { checkpoint([](const TensorList& in) { return in; }, false, {at::zeros({2})}); },
      "no input requires grad");
}

TEST(Checkpoint, FlagsAreSetDuringForwardAndReplayOnly) {
  std::vector<std::pair<bool, bool>> seen;  // (is_checkpointing, is_recomputing) per call
  const at::Tensor x = at::randn({3}).requires_grad_(true);
  EXPECT_FALSE(is_checkpointing());
  const auto out = checkpoint(
      [&](const TensorList& in) {
        seen.emplace_back(is_checkpointing(), is_recomputing());
        return TensorList{in[0] * in[0]};
      },
      false, {x});
  EXPECT_FALSE(is_checkpointing());
  out[0].sum().backward();
  EXPECT_FALSE(is_checkpointing());
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[0], std::make_pair(true, false));  // forward
  EXPECT_EQ(seen[1], std::make_pair(true, true));   // replay in backward
}

TEST(Checkpoint, FiniteDifferenceGradCheckInDouble) {
  const at::Tensor w = at::randn({4, 4}, at::kDouble);
  gradcheck(
      [&](const std::vector<at::Tensor>& in) {
        return checkpoint(
            [&](const TensorList& t) { return TensorList{at::tanh(at::matmul(t[0], w)) * t[1]}; },
            false, {in[0], in[1]})[0];
      },
      {at::randn({3, 4}, at::kDouble), at::randn({3, 4}, at::kDouble)});
}

TEST(Checkpoint, InputGradientsKeepTheLayoutThePlainGraphGivesThem) {
  // Note [Checkpoint input gradients keep their layout]: attention's key is built from a part
  // shared by every head (MLA's RoPE key part, expanded), so its gradient is summed over the
  // heads outside the checkpoint. bmm's backward hands the key a transposed gradient; had the
  // checkpoint returned its leaf's .grad (copied into the key's contiguous strides), that sum
  // would add in another order than the plain graph's.
  const int64_t s = 128, b = 2, a = 8, d = 48, shared = 16;
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor q = at::randn({b * a, s, d}, opts),
                   nope0 = at::randn({s, b, a, d - shared}, opts);
  const at::Tensor part0 = at::randn({s, b, 1, shared}, opts);
  auto scores = [&](const at::Tensor& k) {  // q k^T with k [s, b, a, d] read as [b*a, d, s]
    return at::bmm(q, k.reshape({s, b * a, d}).permute({1, 2, 0}));
  };
  const at::Tensor grad_out = at::randn({b * a, s, s}, opts);
  auto run = [&](int mode) {  // 0 plain, 1 checkpoint, 2 output-discarding checkpoint
    const at::Tensor part = part0.clone().requires_grad_(true);
    const at::Tensor nope = nope0.clone().requires_grad_(true);
    const at::Tensor k = at::cat({nope, part.expand({s, b, a, shared})}, -1);
    at::Tensor out;
    CheckpointWithoutOutput discard;
    if (mode == 0) out = scores(k);
    if (mode == 1)
      out = checkpoint([&](const TensorList& in) { return TensorList{scores(in[0])}; }, false,
                       {k})[0];
    if (mode == 2)
      out = discard.checkpoint([&](const TensorList& in) { return TensorList{scores(in[0])}; },
                               {k})[0];
    out.backward(grad_out);
    return part.grad();
  };
  const at::Tensor plain = run(0);
  EXPECT_TRUE(bitwise_equal(plain, run(1)));
  EXPECT_TRUE(bitwise_equal(plain, run(2)));
}

// ---- CheckpointWithoutOutput ------------------------------------------------------------------

TEST(CheckpointWithoutOutput, MatchesPlainLikeMegatronsTest) {  // test_checkpoint_without_output
  const at::Tensor x0 = at::randn({64, 32});
  auto run = [&](bool discard) {
    const at::Tensor x = x0.clone().requires_grad_(true);
    CheckpointWithoutOutput ckpt;
    const at::Tensor y =
        discard ? ckpt.checkpoint([](const TensorList& in) { return TensorList{at::gelu(in[0])}; },
                                  {x})[0]
                : at::gelu(x);
    const at::Tensor z = y * x;
    if (discard) ckpt.discard_output_and_register_recompute(z);
    z.sum().backward();
    return std::make_pair(z.detach(), x.grad());
  };
  const auto plain = run(false), discarded = run(true);
  EXPECT_TRUE(bitwise_equal(plain.first, discarded.first));
  EXPECT_TRUE(bitwise_equal(plain.second, discarded.second));
}

TEST(CheckpointWithoutOutput, FreesTheStorageAndReattachesItForEveryView) {
  auto& mem = device_memory(at::kCPU);
  const at::Tensor x = at::randn({16, 64}).requires_grad_(true);
  const at::Tensor w = at::randn({64}).requires_grad_(true);
  recompute_counters().reset();
  CheckpointWithoutOutput ckpt;
  const at::Tensor y =
      ckpt.checkpoint([](const TensorList& in) { return TensorList{at::sigmoid(in[0])}; }, {x})[0];
  const int64_t y_bytes = y.numel() * 4;
  // A consumer that saves views of a reshape of y (Megatron's view-sharing regression test).
  const auto parts = y.reshape({4, 4, 64}).split(2, 0);
  const at::Tensor z = (parts[0] * w).sum() + (parts[1] * w * 2).sum();
  const auto version = y._version();
  const int64_t before = mem.current_bytes();
  ckpt.discard_output_and_register_recompute(z);
  EXPECT_EQ(y.storage().nbytes(), 0u);
  EXPECT_EQ(before - mem.current_bytes(), y_bytes);  // really freed
  EXPECT_EQ(recompute_counters().discarded_outputs.load(), 1);
  z.backward();
  EXPECT_EQ(recompute_counters().output_recomputes.load(), 1);
  EXPECT_EQ(y._version(), version);
  EXPECT_EQ(y.storage().nbytes(), static_cast<size_t>(y_bytes));
  EXPECT_TRUE(at::equal(y, at::sigmoid(x.detach())));  // the original tensor sees the data
  // Gradients equal the plain computation's.
  const at::Tensor x2 = x.detach().clone().requires_grad_(true);
  const at::Tensor w2 = w.detach().clone().requires_grad_(true);
  const auto p2 = at::sigmoid(x2).reshape({4, 4, 64}).split(2, 0);
  ((p2[0] * w2).sum() + (p2[1] * w2 * 2).sum()).backward();
  EXPECT_TRUE(bitwise_equal(x.grad(), x2.grad()));
  EXPECT_TRUE(bitwise_equal(w.grad(), w2.grad()));
}

TEST(CheckpointWithoutOutput, RecomputesInItsOwnBackwardWhenNeverDiscarded) {
  const at::Tensor x = at::randn({8}).requires_grad_(true);
  CheckpointWithoutOutput ckpt;
  const at::Tensor y =
      ckpt.checkpoint([](const TensorList& in) { return TensorList{in[0].exp()}; }, {x})[0];
  (y * 3).sum().backward();
  EXPECT_TRUE(at::allclose(x.grad(), 3 * x.detach().exp()));
  expect_error_containing([&] { ckpt.checkpoint([](const TensorList& in) { return in; }, {x}); },
                          "already holds a checkpoint");
}

TEST(CheckpointWithoutOutput, RefusesAutogradGrad) {
  const at::Tensor x = at::randn({8}).requires_grad_(true);
  CheckpointWithoutOutput ckpt;
  const at::Tensor y =
      ckpt.checkpoint([](const TensorList& in) { return TensorList{in[0].exp()}; }, {x})[0];
  const at::Tensor z = y * 2;
  ckpt.discard_output_and_register_recompute(z);
  expect_error_containing([&] { torch::autograd::grad({z.sum()}, {x}); },
                          "not compatible with torch::autograd::grad()");
}

TEST(CheckpointWithoutOutput, FiniteDifferenceGradCheckInDouble) {
  gradcheck(
      [](const std::vector<at::Tensor>& in) {
        CheckpointWithoutOutput ckpt;  // the state lives on in the graph
        const at::Tensor y =
            ckpt.checkpoint([](const TensorList& t) { return TensorList{at::sin(t[0]) * t[1]}; },
                            {in[0], in[1]})[0];
        const at::Tensor z = y * in[0];
        ckpt.discard_output_and_register_recompute(z);
        return z;
      },
      {at::randn({5}, at::kDouble), at::randn({5}, at::kDouble)});
}

// ---- the model's strategies -------------------------------------------------------------------

using actmem::testing::small_model;

struct Strategy {
  const char* name;
  void (*apply)(TransformerConfig&);
};
inline void PrintTo(const Strategy& s, std::ostream* os) {
  *os << s.name;
}

void full(TransformerConfig& c, const char* method, int64_t n) {
  c.recompute_granularity = "full";
  c.recompute_method = method;
  c.recompute_num_layers = n;
}

const Strategy kStrategies[] = {
    {"FullUniform2Divides", [](TransformerConfig& c) { full(c, "uniform", 2); }},
    {"FullUniform3DoesNotDivide", [](TransformerConfig& c) { full(c, "uniform", 3); }},
    {"FullUniform1", [](TransformerConfig& c) { full(c, "uniform", 1); }},
    {"FullBlock2", [](TransformerConfig& c) { full(c, "block", 2); }},
    {"FullBlockAll", [](TransformerConfig& c) { full(c, "block", 4); }},
    {"SelectiveCoreAttn", [](TransformerConfig& c) { selective(c, {"core_attn"}); }},
    {"SelectiveMlp", [](TransformerConfig& c) { selective(c, {"mlp"}); }},
    {"SelectiveLayernorm", [](TransformerConfig& c) { selective(c, {"layernorm"}); }},
    {"SelectiveAll",
     [](TransformerConfig& c) {
       selective(c, {"core_attn", "mlp", "layernorm"});
     }},
    {"SelectiveAllRmsSwigluRope",
     [](TransformerConfig& c) {
       c.normalization = "RMSNorm";
       c.gated_linear_unit = true;
       c.position_embedding_type = "rope";
       selective(c, {"core_attn", "mlp", "layernorm"});
     }},
    // Grouped-query attention: 2 key/value groups of the 4 heads ("Gqa"; with RoPE in "Rope").
    {"FullUniform1Gqa", [](TransformerConfig& c) { full(c, "uniform", 1); }},
    {"FullBlock2Gqa", [](TransformerConfig& c) { full(c, "block", 2); }},
    {"SelectiveCoreAttnGqa", [](TransformerConfig& c) { selective(c, {"core_attn"}); }},
    {"SelectiveAllGqaRope",
     [](TransformerConfig& c) {
       selective(c, {"core_attn", "mlp", "layernorm"});
     }},
    // The flash kernel ("Flash": --attention-backend flash, no attention dropout, hidden dropout
    // on), also with grouped-query attention and RoPE.
    {"FullUniform1Flash", [](TransformerConfig& c) { full(c, "uniform", 1); }},
    {"FullBlock2Flash", [](TransformerConfig& c) { full(c, "block", 2); }},
    {"SelectiveCoreAttnFlash", [](TransformerConfig& c) { selective(c, {"core_attn"}); }},
    {"SelectiveCoreAttnFlashGqa", [](TransformerConfig& c) { selective(c, {"core_attn"}); }},
    {"SelectiveAllFlashGqaRope",
     [](TransformerConfig& c) {
       selective(c, {"core_attn", "mlp", "layernorm"});
     }},
};

class RecomputeExactness : public ::testing::TestWithParam<std::tuple<Strategy, const char*>> {};

TEST_P(RecomputeExactness, BitwiseEqualToPlainOverThreeSteps) {
  const Strategy& strategy = std::get<0>(GetParam());
  TransformerConfig base = small_model();
  TrainingConfig t;
  actmem::testing::set_precision(base, t, std::get<1>(GetParam()));
  if (std::string(strategy.name).find("Rope") != std::string::npos) {
    base.normalization = "RMSNorm";
    base.gated_linear_unit = true;
    base.position_embedding_type = "rope";
  }
  if (std::string(strategy.name).find("Gqa") != std::string::npos) base.num_query_groups = 2;
  if (std::string(strategy.name).find("Flash") != std::string::npos) {
    base.attention_dropout = 0.0;
    base.attention_backend = "flash";
    ASSERT_GT(base.hidden_dropout, 0.0);
  }
  TransformerConfig strat = base;
  strategy.apply(strat);
  t.global_batch_size = 4;  // two micro-batches per step
  t.train_iters = 3;
  t.eval_interval = 0;
  Trainer other(strat, t);
  recompute_counters().reset();
  actmem::testing::expect_bitwise_equal_to_plain(base, t, other, 3);
  // The strategy really recomputed something (otherwise this test could not fail).
  EXPECT_GT(recompute_counters().recomputes.load() + recompute_counters().output_recomputes.load(),
            0);
}

INSTANTIATE_TEST_SUITE_P(Strategies, RecomputeExactness,
                         ::testing::Combine(::testing::ValuesIn(kStrategies),
                                            ::testing::ValuesIn(actmem::testing::kPrecisions)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).name) + "_" +
                                  std::get<1>(info.param);
                         });

struct Counts {
  int64_t layer, core, mlp, norm, checkpoints, output_recomputes;
};

Counts count_one_step(void (*apply)(TransformerConfig&)) {
  TransformerConfig c = small_model();
  if (apply) apply(c);
  TrainingConfig t;
  t.eval_interval = 0;
  Trainer trainer(c, t);
  forward_counters().reset();
  recompute_counters().reset();
  trainer.train_step(false);
  auto& f = forward_counters();
  auto& r = recompute_counters();
  return {f.layer.load(), f.core_attention.load(), f.mlp.load(),
          f.norm.load(),  r.checkpoints.load(),    r.output_recomputes.load()};
}

TEST(RecomputeCounts, ForwardReExecutionsPerStrategy) {
  // 4 layers; norms: 2 per layer + the final norm.
  auto c = count_one_step(nullptr);
  EXPECT_EQ(c.layer, 4);
  EXPECT_EQ(c.core, 4);
  EXPECT_EQ(c.norm, 9);
  EXPECT_EQ(c.checkpoints, 0);
  c = count_one_step([](TransformerConfig& m) { full(m, "uniform", 3); });  // chunks [0,3) [3,4)
  EXPECT_EQ(c.checkpoints, 2);
  EXPECT_EQ(c.layer, 8);
  EXPECT_EQ(c.mlp, 8);
  EXPECT_EQ(c.norm, 17);
  c = count_one_step([](TransformerConfig& m) { full(m, "block", 2); });  // layers 0 and 1
  EXPECT_EQ(c.checkpoints, 2);
  EXPECT_EQ(c.layer, 6);
  c = count_one_step([](TransformerConfig& m) { selective(m, {"core_attn"}); });
  EXPECT_EQ(c.layer, 4);
  EXPECT_EQ(c.core, 8);
  EXPECT_EQ(c.mlp, 4);
  c = count_one_step([](TransformerConfig& m) { selective(m, {"mlp"}); });
  EXPECT_EQ(c.core, 4);
  EXPECT_EQ(c.mlp, 8);
  c = count_one_step([](TransformerConfig& m) { selective(m, {"layernorm"}); });
  EXPECT_EQ(c.norm, 17);
  EXPECT_EQ(c.output_recomputes, 8);
  EXPECT_EQ(c.checkpoints, 0);
}

TEST(RecomputeCounts, EvalAndNoGradNeverRecompute) {
  TransformerConfig c = small_model();
  selective(c, {"core_attn", "mlp", "layernorm"});
  GPTModel model(c);
  const at::Tensor tokens = at::randint(0, 256, {2, c.seq_length}, at::kLong);
  recompute_counters().reset();
  model.eval();
  model.forward(tokens, tokens).backward();  // eval with grad: no checkpoints
  model.train();
  {
    at::NoGradGuard no_grad;
    model.forward(tokens, tokens);
  }
  EXPECT_EQ(recompute_counters().checkpoints.load(), 0);
  EXPECT_EQ(recompute_counters().discarded_outputs.load(), 0);
  TransformerConfig f = small_model();
  full(f, "uniform", 1);
  GPTModel full_model(f);
  full_model.eval();
  full_model.forward(tokens, tokens).backward();
  EXPECT_EQ(recompute_counters().checkpoints.load(), 0);
}

TEST(RecomputeChunks, UniformClampsAndBlockTakesTheFirstLayers) {
  using Chunks = std::vector<CheckpointChunk>;
  auto chunks = [](const TransformerConfig& c) { return make_activation_plan(c).chunks; };
  TransformerConfig c;
  c.num_layers = 16;
  full(c, "uniform", 5);
  EXPECT_EQ(chunks(c), (Chunks{{0, 5}, {5, 10}, {10, 15}, {15, 16}}));
  c.num_layers = 5;
  full(c, "uniform", 3);  // Megatron issue #2294
  EXPECT_EQ(chunks(c), (Chunks{{0, 3}, {3, 5}}));
  c.num_layers = 4;
  full(c, "block", 2);
  EXPECT_EQ(chunks(c), (Chunks{{0, 1}, {1, 2}}));
  c.recompute_granularity = "selective";
  c.recompute_method.clear();
  c.recompute_num_layers.reset();
  EXPECT_TRUE(chunks(c).empty());
}

// ---- memory ----------------------------------------------------------------------------------

int64_t activation_bytes(void (*apply)(TransformerConfig&), const TransformerConfig& base,
                         int64_t* peak = nullptr) {
  TransformerConfig c = base;
  if (apply) apply(c);
  TrainingConfig t;
  t.eval_interval = 0;
  Trainer trainer(c, t);
  trainer.train_step(false);
  const auto st = trainer.train_step(false);
  if (peak) *peak = st.activation_peak_bytes;
  return st.activation_bytes;
}

TransformerConfig memory_model() {
  return actmem::testing::shaped_model(4, 64, 4, 0, 64, 2);
}

// A checkpoint's random-state snapshot: the CPU generator and the three tracker streams' states.
const int64_t kSnapshotSlack = checkpoint_snapshot_bytes();

TEST(RecomputeMemory, SelectiveCoreAttnSavesNoSquareTensor) {
  const auto m = memory_model();
  const int64_t L = m.num_layers, a = m.num_attention_heads, s = m.seq_length,
                b = m.micro_batch_size;
  const int64_t plain = activation_bytes(nullptr, m);
  const int64_t core =
      activation_bytes([](TransformerConfig& c) { selective(c, {"core_attn"}); }, m);
  // fp32 softmax output + 1-byte dropout mask + fp32 dropped probabilities, per layer.
  const int64_t square = L * 9 * a * s * s * b;
  EXPECT_LE(plain - core, square);
  EXPECT_GE(plain - core, square - L * kSnapshotSlack);
}

TEST(RecomputeMemory, SelectiveLayernormFreesBothNormOutputs) {
  const auto m = memory_model();
  const int64_t sbh = m.seq_length * m.micro_batch_size * m.hidden_size;
  const int64_t plain = activation_bytes(nullptr, m);
  const int64_t ln = activation_bytes([](TransformerConfig& c) { selective(c, {"layernorm"}); }, m);
  EXPECT_LE(plain - ln, m.num_layers * 2 * sbh * 4);
  EXPECT_GE(plain - ln, m.num_layers * 2 * (sbh * 4 - kSnapshotSlack));
}

TEST(RecomputeMemory, FullRecomputeKeepsOneInputPerChunk) {
  const auto m = memory_model();
  const int64_t L = m.num_layers, sbh = m.seq_length * m.micro_batch_size * m.hidden_size;
  int64_t peak1 = 0;
  const int64_t plain = activation_bytes(nullptr, m);
  const int64_t one_chunk =
      activation_bytes([](TransformerConfig& c) { full(c, "uniform", 4); }, m);
  const int64_t per_layer =
      activation_bytes([](TransformerConfig& c) { full(c, "uniform", 1); }, m, &peak1);
  // L chunks keep L inputs, one chunk keeps one: (L - 1) more [s, b, h] fp32 inputs.
  EXPECT_GE(per_layer - one_chunk, (L - 1) * sbh * 4);
  EXPECT_LE(per_layer - one_chunk, (L - 1) * (sbh * 4 + kSnapshotSlack));
  // Everything a layer saves is gone but its input: plain holds L layers' worth more.
  const int64_t layer_saved = (plain - one_chunk) / L;
  EXPECT_GT(layer_saved, 10 * sbh * 4);
  // At the backward peak, one chunk (here one layer) is rebuilt on top of the kept inputs.
  EXPECT_LT(peak1 - per_layer, 2 * layer_saved);
  EXPECT_GT(peak1 - per_layer, layer_saved / 2);
}

}  // namespace
}  // namespace actmem
