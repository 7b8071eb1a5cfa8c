// Tests for the gated delta rule (gated_delta_rule.h): the recurrence against the rule written out
// by hand for one and two tokens, the chunked form against the recurrence (fp32, bf16, every
// chunk size, padding, strong decay), and both forms' gradients against finite differences.
#include "actmem/model/gdn/gated_delta_rule.h"

#include "actmem/memory/ledger.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace actmem {
namespace {

struct Inputs {
  at::Tensor q, k, v, g, beta;
};

// Random inputs as GatedDeltaNet makes them: L2-normalised q and k, g = -a softplus(x) <= 0,
// beta = sigmoid(x).
Inputs random_inputs(int64_t b, int64_t s, int64_t H, int64_t dk, int64_t dv,
                     at::ScalarType dtype = at::kFloat, double decay_scale = 1.0,
                     uint64_t seed = 7) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  auto normal = [&](std::vector<int64_t> sizes) {
    return at::randn(sizes, gen, at::TensorOptions().dtype(at::kDouble));
  };
  Inputs in;
  in.q = normal({b, s, H, dk});
  in.k = normal({b, s, H, dk});
  in.q = in.q / in.q.norm(2, -1, true);
  in.k = in.k / in.k.norm(2, -1, true);
  in.v = normal({b, s, H, dv});
  in.g = -decay_scale * at::softplus(normal({b, s, H}));
  in.beta = at::sigmoid(normal({b, s, H}));
  for (at::Tensor* t : {&in.q, &in.k, &in.v, &in.g, &in.beta}) *t = t->to(dtype);
  return in;
}

double dot_product(const at::Tensor& a, const at::Tensor& b) {
  return (a * b).sum().item<double>();
}

TEST(GatedDeltaRule, OneAndTwoTokensAsTheRuleWritesThem) {
  const Inputs in = random_inputs(1, 2, 1, 4, 3, at::kDouble);
  const double scale = 0.5;
  auto q = [&](int t) { return in.q[0][t][0]; };
  auto k = [&](int t) { return in.k[0][t][0]; };
  auto v = [&](int t) { return in.v[0][t][0]; };
  const double g2 = in.g[0][1][0].item<double>();
  const double b1 = in.beta[0][0][0].item<double>(), b2 = in.beta[0][1][0].item<double>();
  // S_1 = b1 k1 v1^T (the decay of an empty state changes nothing): o_1 = scale b1 (q1.k1) v1.
  const at::Tensor o1 = scale * b1 * dot_product(q(0), k(0)) * v(0);
  // S_2 = exp(g2)(I - b2 k2 k2^T) S_1 + b2 k2 v2^T:
  // o_2 = scale [exp(g2) b1 ((q2.k1) - b2 (q2.k2)(k2.k1)) v1 + b2 (q2.k2) v2].
  const at::Tensor o2 =
      scale *
      (std::exp(g2) * b1 *
           (dot_product(q(1), k(0)) - b2 * dot_product(q(1), k(1)) * dot_product(k(1), k(0))) *
           v(0) +
       b2 * dot_product(q(1), k(1)) * v(1));
  const at::Tensor expected = at::stack({o1, o2}).view({1, 2, 1, 3});
  EXPECT_TRUE(at::allclose(gated_delta_rule_recurrent(in.q, in.k, in.v, in.g, in.beta, scale),
                           expected, 1e-12, 1e-14));
  for (const int64_t chunk : {1, 2, 64}) {
    EXPECT_TRUE(
        at::allclose(gated_delta_rule_chunked(in.q, in.k, in.v, in.g, in.beta, scale, chunk),
                     expected, 1e-12, 1e-14))
        << "chunk " << chunk;
  }
}

// fp32: the chunked form equals the recurrence to 2e-5 (outputs up to about 0.3) for chunk sizes
// that divide s, that leave a padded last chunk, and that exceed s.
TEST(GatedDeltaRule, ChunkedEqualsTheRecurrenceInFp32) {
  const Inputs in = random_inputs(2, 100, 3, 16, 8);
  const double scale = 1.0 / std::sqrt(16.0);
  const at::Tensor ref = gated_delta_rule_recurrent(in.q, in.k, in.v, in.g, in.beta, scale);
  ASSERT_EQ(ref.scalar_type(), at::kFloat);
  EXPECT_GT(ref.abs().max().item<double>(), 0.1);
  for (const int64_t chunk : {1, 4, 25, 64, 100, 128}) {
    const at::Tensor o = gated_delta_rule_chunked(in.q, in.k, in.v, in.g, in.beta, scale, chunk);
    ASSERT_EQ(o.sizes(), ref.sizes());
    EXPECT_LT((o - ref).abs().max().item<double>(), 2e-5) << "chunk " << chunk;
  }
}

// bf16 inputs: both forms compute in fp32 and round their outputs to bf16, so each is within
// bf16's rounding (2^-8 relative) of the double-precision recurrence on the same inputs.
TEST(GatedDeltaRule, ChunkedAndRecurrentAreWithinBf16RoundingOfTheExactRule) {
  const Inputs in = random_inputs(1, 130, 2, 32, 16, at::kBFloat16);
  const double scale = 1.0 / std::sqrt(32.0);
  auto as_double = [](const at::Tensor& t) { return t.to(at::kDouble); };
  const at::Tensor exact =
      gated_delta_rule_recurrent(as_double(in.q), as_double(in.k), as_double(in.v), as_double(in.g),
                                 as_double(in.beta), scale);
  const at::Tensor recurrent = gated_delta_rule_recurrent(in.q, in.k, in.v, in.g, in.beta, scale);
  const at::Tensor chunked = gated_delta_rule_chunked(in.q, in.k, in.v, in.g, in.beta, scale);
  ASSERT_EQ(chunked.scalar_type(), at::kBFloat16);
  for (const at::Tensor& o : {recurrent, chunked}) {
    const at::Tensor err = (o.to(at::kDouble) - exact).abs();
    const at::Tensor bound = exact.abs() * std::ldexp(1.0, -8) + 1e-4;
    EXPECT_TRUE((err <= bound).all().item<bool>()) << (err - bound).max().item<double>();
  }
}

// A strong decay (g down to -60 per token): exp(G_i - G_j) above the diagonal would overflow to
// inf (and inf * 0 = NaN); the chunked form masks the exponent first.
TEST(GatedDeltaRule, StrongDecayStaysFinite) {
  const Inputs in = random_inputs(1, 96, 2, 8, 8, at::kFloat, /*decay_scale=*/30.0);
  EXPECT_LT(in.g.min().item<double>(), -40.0);
  const at::Tensor ref = gated_delta_rule_recurrent(in.q, in.k, in.v, in.g, in.beta, 0.35);
  const at::Tensor o = gated_delta_rule_chunked(in.q, in.k, in.v, in.g, in.beta, 0.35, 64);
  EXPECT_TRUE(o.isfinite().all().item<bool>());
  EXPECT_LT((o - ref).abs().max().item<double>(), 2e-5);
}

// Both forms' gradients (autograd through their ops) against central differences in double, for
// every input: q, k, v, g and beta, with a padded last chunk.
TEST(GatedDeltaRule, GradientsMatchFiniteDifferences) {
  Inputs in = random_inputs(1, 10, 2, 4, 3, at::kDouble);
  const double scale = 0.5;
  at::Generator gen = at::detail::createCPUGenerator(11);
  const at::Tensor w = at::randn({1, 10, 2, 3}, gen, at::TensorOptions().dtype(at::kDouble));
  for (const bool chunked : {false, true}) {
    SCOPED_TRACE(chunked ? "chunked" : "recurrent");
    auto loss = [&](const Inputs& x) {
      const at::Tensor o = chunked ? gated_delta_rule_chunked(x.q, x.k, x.v, x.g, x.beta, scale, 4)
                                   : gated_delta_rule_recurrent(x.q, x.k, x.v, x.g, x.beta, scale);
      return (o * w).sum();
    };
    Inputs leaf;
    for (auto [dst, src] : {std::pair{&leaf.q, &in.q},
                            {&leaf.k, &in.k},
                            {&leaf.v, &in.v},
                            {&leaf.g, &in.g},
                            {&leaf.beta, &in.beta}}) {
      *dst = src->clone().set_requires_grad(true);
    }
    loss(leaf).backward();
    const double eps = 1e-6;
    for (auto [name, member] : {std::pair{"q", &Inputs::q},
                                {"k", &Inputs::k},
                                {"v", &Inputs::v},
                                {"g", &Inputs::g},
                                {"beta", &Inputs::beta}}) {
      const at::Tensor analytic = (leaf.*member).grad();
      ASSERT_TRUE(analytic.defined()) << name;
      const at::Tensor flat = (in.*member).view(-1);
      double worst = 0;
      for (int64_t i = 0; i < flat.numel(); ++i) {
        const double x0 = flat[i].item<double>();
        flat[i] = x0 + eps;
        const double up = loss(in).item<double>();
        flat[i] = x0 - eps;
        const double down = loss(in).item<double>();
        flat[i] = x0;
        const double numeric = (up - down) / (2 * eps);
        worst = std::max(worst, std::abs(numeric - analytic.view(-1)[i].item<double>()));
      }
      EXPECT_LT(worst, 1e-7) << name;
    }
  }
}

// The one-node form keeps its five inputs and nothing else, and its gradients are bitwise those of
// autograd through the composed chunked form (its backward runs those ops again).
TEST(GatedDeltaRule, OneNodeKeepsItsInputsAndGivesTheSameGradients) {
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const Inputs in = random_inputs(2, 70, 3, 8, 4, dtype);
    const at::Tensor w = at::randn({2, 70, 3, 4}).to(dtype);
    std::vector<at::Tensor> grads[2];
    at::Tensor outs[2];
    int64_t kept = 0;
    for (const bool one_node : {false, true}) {
      // Non-leaf inputs, as inside a model (the ledger skips leaves that require grad:
      // parameters); the gradients are read on the leaves behind them.
      std::vector<at::Tensor> leaves, x;
      for (const at::Tensor& t : {in.q, in.k, in.v, in.g, in.beta}) {
        leaves.push_back(t.clone().set_requires_grad(true));
        x.push_back(leaves.back().clone());
      }
      ActivationLedger ledger;
      at::Tensor o;
      {
        LedgerScope scope(ledger);
        o = one_node ? gated_delta_rule(x[0], x[1], x[2], x[3], x[4], 0.3, 16)
                     : gated_delta_rule_chunked(x[0], x[1], x[2], x[3], x[4], 0.3, 16);
      }
      ledger.finalize();
      if (one_node) kept = ledger.total_bytes();
      (o.to(at::kFloat) * w.to(at::kFloat)).sum().backward();
      outs[one_node] = o;
      for (const at::Tensor& t : leaves) grads[one_node].push_back(t.grad());
    }
    EXPECT_TRUE(at::equal(outs[0], outs[1]));
    for (size_t i = 0; i < 5; ++i) EXPECT_TRUE(at::equal(grads[0][i], grads[1][i])) << i;
    int64_t inputs = 0;
    for (const at::Tensor& t : {in.q, in.k, in.v, in.g, in.beta}) inputs += t.nbytes();
    EXPECT_EQ(kept, inputs);
  }
}

TEST(GatedDeltaRule, RefusesMismatchedShapes) {
  const Inputs in = random_inputs(1, 8, 2, 4, 3);
  const at::Tensor bad_g = at::zeros({1, 8, 3});
  EXPECT_THROW(gated_delta_rule_chunked(in.q, in.k, in.v, bad_g, in.beta, 1.0), c10::Error);
  EXPECT_THROW(gated_delta_rule_recurrent(in.q, in.k.narrow(3, 0, 2), in.v, in.g, in.beta, 1.0),
               c10::Error);
  EXPECT_THROW(gated_delta_rule_chunked(in.q, in.k, in.v, in.g, in.beta, 1.0, 0), c10::Error);
  try {
    gated_delta_rule_chunked(in.q, in.k, in.v.squeeze(0), in.g, in.beta, 1.0);
    ADD_FAILURE() << "a 3-d v was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("gated_delta_rule_chunked"), std::string::npos);
  }
}

}  // namespace
}  // namespace actmem
