// test_model.cpp — GPTModel against an independent composition of libtorch ops, finite-difference
// gradient checks in double, Megatron's parameter names, causality and dropout behaviour.
#include "actmem/model/activation_bytes.h"
#include "actmem/model/mlp/mlp.h"
#include "actmem/model/model.h"
#include "test_util.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <map>

namespace actmem {
namespace {

using actmem::testing::bitwise_equal;
using actmem::testing::gradcheck;

TransformerConfig small_config() {
  TransformerConfig c;
  c.num_layers = 2;
  c.hidden_size = 24;
  c.num_attention_heads = 3;
  c.ffn_hidden_size = 40;
  c.seq_length = 7;
  c.micro_batch_size = 2;
  c.vocab_size = 256;
  c.attention_dropout = 0.0;
  c.hidden_dropout = 0.0;
  return c;
}

std::map<std::string, at::Tensor> params_by_name(const GPTModel& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : m.named_parameters()) out[item.key()] = item.value();
  return out;
}

// ---- an independent reference: different ops, [b, a, s, d] layout, no module code -------------

at::Tensor ref_norm(const at::Tensor& x, const std::map<std::string, at::Tensor>& p,
                    const std::string& name, bool rms, double eps) {
  const at::Tensor& w = p.at(name + ".weight");
  if (rms) return x / at::sqrt((x * x).mean({-1}, true) + eps) * w;
  const at::Tensor mean = x.mean({-1}, true);
  const at::Tensor var = ((x - mean) * (x - mean)).mean({-1}, true);
  return (x - mean) / at::sqrt(var + eps) * w + p.at(name + ".bias");
}

at::Tensor ref_linear(const at::Tensor& x, const std::map<std::string, at::Tensor>& p,
                      const std::string& name, bool bias) {
  at::Tensor y = at::einsum("sbi,oi->sbo", {x, p.at(name + ".weight")});
  return bias ? y + p.at(name + ".bias") : y;
}

at::Tensor ref_rope(const at::Tensor& x, double base) {  // x: [b, a, s, d]
  const int64_t s = x.size(2), d = x.size(3);
  at::Tensor out = x.clone();
  for (int64_t pos = 0; pos < s; ++pos) {
    for (int64_t i = 0; i < d / 2; ++i) {
      const double theta = pos / std::pow(base, 2.0 * i / d);
      const at::Tensor x1 = x.select(2, pos).select(-1, i);
      const at::Tensor x2 = x.select(2, pos).select(-1, i + d / 2);
      out.select(2, pos).select(-1, i).copy_(x1 * std::cos(theta) - x2 * std::sin(theta));
      out.select(2, pos).select(-1, i + d / 2).copy_(x2 * std::cos(theta) + x1 * std::sin(theta));
    }
  }
  return out;
}

// Reference logits [s, b, v] for tokens [b, s], with dropout off.
at::Tensor reference_logits(const GPTModel& model, const at::Tensor& tokens) {
  const auto& c = model.config();
  const auto p = params_by_name(model);
  const int64_t b = tokens.size(0), s = tokens.size(1), h = c.hidden_size;
  const int64_t a = c.num_attention_heads, d = h / a;
  const bool bias = c.add_bias_linear;
  const at::Tensor onehot =
      at::one_hot(tokens, c.vocab_size).to(p.at("embedding.word_embeddings.weight").dtype());
  at::Tensor x = at::matmul(onehot, p.at("embedding.word_embeddings.weight"));  // [b, s, h]
  if (!c.use_rope())
    x = x + p.at("embedding.position_embeddings.weight").slice(0, 0, s).unsqueeze(0);
  x = x.permute({1, 0, 2});  // [s, b, h]
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string pre = "decoder.layers." + std::to_string(l) + ".";
    const at::Tensor ln1 =
        ref_norm(x, p, pre + "input_layernorm", c.use_rmsnorm(), c.layernorm_epsilon);
    const at::Tensor qkv =
        ref_linear(ln1, p, pre + "self_attention.linear_qkv", bias);  // [s, b, 3h]
    // Megatron's interleaving per key/value group: [s, b, G, (a/G + 2) d] -> the group's a/G
    // query heads, its key, its value; the key and value serve each of the group's query heads.
    const int64_t G = c.query_groups(), per = a / G;
    const at::Tensor qkv4 = qkv.reshape({s, b, G, (per + 2) * d});
    at::Tensor q = qkv4.slice(-1, 0, per * d).reshape({s, b, a, d}).permute({1, 2, 0, 3});
    at::Tensor k = qkv4.slice(-1, per * d, (per + 1) * d)
                       .repeat_interleave(per, 2)
                       .permute({1, 2, 0, 3});  // [b, a, s, d]
    const at::Tensor v = qkv4.slice(-1, (per + 1) * d, (per + 2) * d)
                             .repeat_interleave(per, 2)
                             .permute({1, 2, 0, 3});
    if (c.use_rope()) {
      q = ref_rope(q, c.rotary_base);
      k = ref_rope(k, c.rotary_base);
    }
    at::Tensor scores = at::einsum("basd,batd->bast", {q, k}) / std::sqrt(static_cast<double>(d));
    const at::Tensor future = at::arange(s).unsqueeze(0) > at::arange(s).unsqueeze(1);
    scores = at::where(future, at::full({}, -10000.0, scores.options()), scores);
    const at::Tensor e = at::exp(scores - std::get<0>(scores.max(-1, true)));
    const at::Tensor probs = e / e.sum({-1}, true);
    const at::Tensor ctx = at::einsum("bast,batd->sbad", {probs, v}).reshape({s, b, h});
    x = x + ref_linear(ctx, p, pre + "self_attention.linear_proj", bias);
    const at::Tensor ln2 =
        ref_norm(x, p, pre + "pre_mlp_layernorm", c.use_rmsnorm(), c.layernorm_epsilon);
    const at::Tensor fc1 = ref_linear(ln2, p, pre + "mlp.linear_fc1", bias);
    at::Tensor act;
    if (c.gated_linear_unit) {
      const int64_t f = c.ffn();
      const at::Tensor g = fc1.slice(-1, 0, f), u = fc1.slice(-1, f, 2 * f);
      act = g / (1 + at::exp(-g)) * u;
    } else {
      act = 0.5 * fc1 * (1 + at::erf(fc1 / std::sqrt(2.0)));
    }
    x = x + ref_linear(act, p, pre + "mlp.linear_fc2", bias);
  }
  x = ref_norm(x, p, "decoder.final_layernorm", c.use_rmsnorm(), c.layernorm_epsilon);
  const at::Tensor out_w = c.untie_embeddings_and_output_weights
                               ? p.at("output_layer.weight")
                               : p.at("embedding.word_embeddings.weight");
  return at::einsum("sbh,vh->sbv", {x, out_w});
}

at::Tensor reference_loss(const at::Tensor& logits, const at::Tensor& labels) {
  const at::Tensor flat = logits.reshape({-1, logits.size(-1)});
  const at::Tensor target = labels.t().reshape({-1});
  const at::Tensor lse = at::logsumexp(flat, {-1});
  return (lse - flat.gather(1, target.unsqueeze(1)).squeeze(1)).mean();
}

struct Variant {
  const char* name;
  void (*apply)(TransformerConfig&);
};
inline void PrintTo(const Variant& c, std::ostream* os) {
  *os << c.name;
}

class ModelNumerics : public ::testing::TestWithParam<Variant> {};

TEST_P(ModelNumerics, MatchesIndependentReferenceInDouble) {
  TransformerConfig c = small_config();
  GetParam().apply(c);
  GPTModel model(c, at::kDouble);
  model.eval();
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const at::Tensor tokens = at::randint(0, 256, {c.micro_batch_size, c.seq_length}, gen, at::kLong);
  const at::Tensor labels = at::randint(0, 256, {c.micro_batch_size, c.seq_length}, gen, at::kLong);
  const at::Tensor got = model.logits(tokens);
  const at::Tensor want = reference_logits(model, tokens);
  ASSERT_EQ(got.sizes(), (at::IntArrayRef{c.seq_length, c.micro_batch_size, c.vocab_size}));
  EXPECT_TRUE(at::allclose(got, want, 1e-9, 1e-10)) << (got - want).abs().max().item<double>();
  EXPECT_NEAR(model.forward(tokens, labels).item<double>(),
              reference_loss(want, labels).item<double>(), 1e-10);
}

TEST_P(ModelNumerics, GradientsMatchReferenceInDouble) {
  TransformerConfig c = small_config();
  GetParam().apply(c);
  GPTModel model(c, at::kDouble);
  model.eval();
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(6);
  const at::Tensor tokens = at::randint(0, 256, {c.micro_batch_size, c.seq_length}, gen, at::kLong);
  const at::Tensor labels = at::randint(0, 256, {c.micro_batch_size, c.seq_length}, gen, at::kLong);
  const auto params = model.ordered_parameters();
  const auto got = torch::autograd::grad({model.forward(tokens, labels)}, params);
  const auto want =
      torch::autograd::grad({reference_loss(reference_logits(model, tokens), labels)}, params);
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(at::allclose(got[i], want[i], 1e-8, 1e-11)) << "parameter " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Variants, ModelNumerics,
    ::testing::Values(
        // Without attention dropout, auto runs the flash kernel; "Unfused" the unfused path.
        Variant{"LayerNormGeLULearned", [](TransformerConfig&) {}},
        Variant{"LayerNormGeLULearnedUnfused",
                [](TransformerConfig& c) { c.attention_backend = "unfused"; }},
        Variant{"MultiQueryRope",
                [](TransformerConfig& c) {
                  c.num_query_groups = 1;
                  c.position_embedding_type = "rope";
                }},
        Variant{"MultiQueryRopeUnfused",
                [](TransformerConfig& c) {
                  c.num_query_groups = 1;
                  c.position_embedding_type = "rope";
                  c.attention_backend = "unfused";
                }},
        Variant{"RMSNormSwiGLURope",
                [](TransformerConfig& c) {
                  c.normalization = "RMSNorm";
                  c.gated_linear_unit = true;
                  c.position_embedding_type = "rope";
                }},
        Variant{"UntiedNoBias",
                [](TransformerConfig& c) {
                  c.untie_embeddings_and_output_weights = true;
                  c.add_bias_linear = false;
                }},
        Variant{"OddShapes",
                [](TransformerConfig& c) {
                  c.hidden_size = 15;
                  c.num_attention_heads = 5;
                  c.ffn_hidden_size = 17;
                  c.seq_length = 11;
                  c.micro_batch_size = 3;
                  c.num_layers = 3;
                }}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(GPTModel, ParameterNamesFollowMegatron) {
  TransformerConfig c = small_config();
  GPTModel model(c);
  std::vector<std::string> names;
  for (const auto& item : model.named_parameters()) names.push_back(item.key());
  const std::vector<std::string> layer0 = {"decoder.layers.0.input_layernorm.weight",
                                           "decoder.layers.0.input_layernorm.bias",
                                           "decoder.layers.0.self_attention.linear_qkv.weight",
                                           "decoder.layers.0.self_attention.linear_qkv.bias",
                                           "decoder.layers.0.self_attention.linear_proj.weight",
                                           "decoder.layers.0.self_attention.linear_proj.bias",
                                           "decoder.layers.0.pre_mlp_layernorm.weight",
                                           "decoder.layers.0.pre_mlp_layernorm.bias",
                                           "decoder.layers.0.mlp.linear_fc1.weight",
                                           "decoder.layers.0.mlp.linear_fc1.bias",
                                           "decoder.layers.0.mlp.linear_fc2.weight",
                                           "decoder.layers.0.mlp.linear_fc2.bias"};
  ASSERT_GE(names.size(), 2 + 2 * layer0.size() + 2);
  EXPECT_EQ(names[0], "embedding.word_embeddings.weight");
  EXPECT_EQ(names[1], "embedding.position_embeddings.weight");
  for (size_t i = 0; i < layer0.size(); ++i) EXPECT_EQ(names[2 + i], layer0[i]);
  EXPECT_EQ(names.back(), "decoder.final_layernorm.bias");
  // Tied output layer: no separate parameter; untied adds output_layer.weight.
  c.untie_embeddings_and_output_weights = true;
  GPTModel untied(c);
  EXPECT_EQ(untied.named_parameters().size(), model.named_parameters().size() + 1);
  EXPECT_TRUE(untied.named_parameters().contains("output_layer.weight"));
}

TEST(GPTModel, ParameterCountMatchesFormula) {
  TransformerConfig c = small_config();
  GPTModel model(c);
  const int64_t h = c.hidden_size, f = c.ffn(), v = c.vocab_size, s = c.seq_length;
  const int64_t per_layer = 4 * h /*norms*/ + 3 * h * h + 3 * h + h * h + h + h * f + f + f * h + h;
  EXPECT_EQ(model.num_parameters(), v * h + s * h + c.num_layers * per_layer + 2 * h);
}

TEST(GPTModel, GroupedQueryAttentionHasMegatronsFusedQkvShape) {
  // Megatron's linear_qkv for G groups: (a + 2G) d output rows, laid out per group as its a/G
  // query heads, then its key and its value head (Attention.get_query_key_value_tensors).
  TransformerConfig c = small_config();
  c.num_attention_heads = 4;  // head dim 6
  c.num_query_groups = 2;
  const int64_t a = c.num_attention_heads, d = c.kv_channels(), h = c.hidden_size;
  GPTModel model(c);
  const auto params = model.named_parameters();
  EXPECT_EQ(params["decoder.layers.0.self_attention.linear_qkv.weight"].sizes(),
            (std::vector<int64_t>{(a + 2 * 2) * d, h}));
  EXPECT_EQ(params["decoder.layers.0.self_attention.linear_qkv.bias"].sizes(),
            (std::vector<int64_t>{(a + 2 * 2) * d}));
  EXPECT_EQ(params["decoder.layers.0.self_attention.linear_proj.weight"].sizes(),
            (std::vector<int64_t>{h, h}));
  // The split: group g's query heads are rows [g (a/G + 2) d, g (a/G + 2) d + (a/G) d) of the
  // output, its key and value the next d rows each.
  const at::Tensor qkv = at::arange(1 * 1 * (a + 4) * d, at::kFloat).view({1, 1, (a + 4) * d});
  const auto [q, k, v] = split_qkv(qkv, a, 2, d);
  const int64_t per = (a / 2 + 2) * d;
  EXPECT_EQ(q.sizes(), (std::vector<int64_t>{1, 1, a, d}));
  EXPECT_EQ(k.sizes(), (std::vector<int64_t>{1, 1, 2, d}));
  EXPECT_EQ(q[0][0][a / 2][0].item<float>(), static_cast<float>(per));    // group 1's first q
  EXPECT_EQ(k[0][0][0][0].item<float>(), static_cast<float>(a / 2 * d));  // group 0's key
  EXPECT_EQ(v[0][0][1][0].item<float>(), static_cast<float>(per + (a / 2 + 1) * d));
  // Expanded for the products: head j reads group j / (a/G).
  const at::Tensor ke = expand_kv_heads(k, a);
  for (int64_t j = 0; j < a; ++j) EXPECT_TRUE(ke[0][0][j].equal(k[0][0][j / (a / 2)])) << j;
  // Fewer parameters than multi-head attention: 2 (a - G) d h weights and 2 (a - G) d biases
  // per layer.
  TransformerConfig mha = small_config();
  mha.num_attention_heads = 4;
  EXPECT_EQ(GPTModel(mha).num_parameters() - model.num_parameters(),
            c.num_layers * 2 * (a - 2) * d * (h + 1));
}

TEST(GPTModel, InitialisationIsAPureFunctionOfTheSeed) {
  TransformerConfig c = small_config();
  at::manual_seed(1);
  GPTModel a(c);
  at::manual_seed(2);  // the global generator does not matter
  GPTModel b(c);
  c.seed += 1;
  GPTModel d(c);
  const auto pa = a.ordered_parameters(), pb = b.ordered_parameters(), pd = d.ordered_parameters();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(bitwise_equal(pa[i], pb[i])) << i;
  EXPECT_FALSE(bitwise_equal(pa[0], pd[0]));
  // Megatron's scaled init for the residual projections: std / sqrt(2 L).
  const double proj_std =
      a.decoder->layers[0]->mixer_as<SelfAttention>()->linear_proj->weight.std().item<double>();
  const double qkv_std =
      a.decoder->layers[0]->mixer_as<SelfAttention>()->linear_qkv->weight.std().item<double>();
  EXPECT_NEAR(qkv_std, 0.02, 0.003);
  EXPECT_NEAR(proj_std, 0.02 / std::sqrt(2.0 * c.num_layers), 0.003);
}

TEST(GPTModel, IsCausal) {
  TransformerConfig c = small_config();
  c.position_embedding_type = "rope";
  GPTModel model(c, at::kDouble);
  model.eval();
  at::Tensor tokens = at::randint(0, 256, {2, c.seq_length}, at::kLong);
  const at::Tensor before = model.logits(tokens);
  tokens.select(1, 4).fill_(7);
  const at::Tensor after = model.logits(tokens);
  EXPECT_TRUE(
      at::equal(before.slice(0, 0, 4), after.slice(0, 0, 4)));  // earlier positions unchanged
  EXPECT_FALSE(at::allclose(before.slice(0, 4), after.slice(0, 4)));
}

TEST(GPTModel, DropoutFollowsTheGlobalGeneratorAndEvalDisablesIt) {
  TransformerConfig c = small_config();
  c.attention_dropout = 0.1;
  c.hidden_dropout = 0.1;
  GPTModel model(c);
  const at::Tensor tokens = at::randint(0, 256, {2, c.seq_length}, at::kLong);
  at::manual_seed(11);
  const at::Tensor a = model.forward(tokens, tokens);
  at::manual_seed(11);
  const at::Tensor b = model.forward(tokens, tokens);
  const at::Tensor d = model.forward(tokens, tokens);  // generator advanced
  EXPECT_TRUE(bitwise_equal(a, b));
  EXPECT_FALSE(bitwise_equal(a, d));
  model.eval();
  const auto& gen = at::detail::getDefaultCPUGenerator();
  const at::Tensor state = gen.get_state();
  const at::Tensor e1 = model.forward(tokens, tokens);
  const at::Tensor e2 = model.forward(tokens, tokens);
  EXPECT_TRUE(bitwise_equal(e1, e2));
  EXPECT_TRUE(bitwise_equal(gen.get_state(), state));  // eval draws no random numbers
}

TEST(Dropout, SavesAOneByteMaskAndScalesKeptElements) {
  at::manual_seed(3);
  const at::Tensor x = at::ones({10000}, at::kFloat).requires_grad_(true);
  const at::Tensor y = apply_dropout(x, 0.25, true);
  const double kept = (y != 0).to(at::kDouble).mean().item<double>();
  EXPECT_NEAR(kept, 0.75, 0.02);
  EXPECT_FLOAT_EQ(y.max().item<float>(), 1.0f / 0.75f);
  EXPECT_TRUE(bitwise_equal(apply_dropout(x, 0.25, false), x));
  EXPECT_TRUE(bitwise_equal(apply_dropout(x, 0.0, true), x));
}

// ---- finite-difference gradient checks of every module in double ------------------------------

TEST(GradCheck, Norms) {
  for (const char* kind : {"LayerNorm", "RMSNorm"}) {
    TransformerConfig c = small_config();
    c.hidden_size = 6;
    c.num_attention_heads = 2;
    c.normalization = kind;
    Norm norm(c, at::kDouble);
    at::NoGradGuard no_grad;
    norm.weight.normal_();
    if (norm.bias.defined()) norm.bias.normal_();
    at::AutoGradMode enable(true);
    gradcheck([&](const std::vector<at::Tensor>& in) { return norm.forward(in[0]); },
              {at::randn({3, 2, 6}, at::kDouble)});
  }
}

TEST(GradCheck, FusedRMSNormFunctionInputAndWeight) {
  gradcheck([](const std::vector<at::Tensor>& in) { return rms_norm(in[0], in[1], 1e-5); },
            {at::randn({3, 2, 7}, at::kDouble), at::randn({7}, at::kDouble)});
}

TEST(GradCheck, CoreAttention) {
  for (const char* backend : {"unfused", "flash"}) {
    SCOPED_TRACE(backend);
    TransformerConfig c = small_config();
    c.attention_dropout = 0.0;
    c.attention_backend = backend;
    CoreAttention attn(c);
    gradcheck(
        [&](const std::vector<at::Tensor>& in) {
          return attn.forward(in[0], in[1], in[2], make_causal_mask(5));
        },
        {at::randn({5, 2, 3, 4}, at::kDouble), at::randn({5, 2, 3, 4}, at::kDouble),
         at::randn({5, 2, 3, 4}, at::kDouble)});
    // Grouped-query attention: 3 query heads sharing one key/value head.
    gradcheck(
        [&](const std::vector<at::Tensor>& in) {
          return attn.forward(in[0], in[1], in[2], make_causal_mask(5));
        },
        {at::randn({5, 2, 3, 4}, at::kDouble), at::randn({5, 2, 1, 4}, at::kDouble),
         at::randn({5, 2, 1, 4}, at::kDouble)});
  }
}

// The two kernels compute one function: flash's output and gradients equal the unfused path's
// to rounding, with the query heads of a group reading the group's key and value in both.
TEST(CoreAttention, FlashEqualsUnfusedWithGroupedQueries) {
  TransformerConfig c = small_config();
  c.attention_dropout = 0.0;
  c.attention_backend = "unfused";
  CoreAttention unfused(c);
  c.attention_backend = "flash";
  CoreAttention flash(c);
  at::manual_seed(3);
  const int64_t s = 33, b = 2, a = 6, G = 2, d = 8;
  const at::Tensor q = at::randn({s, b, a, d}).requires_grad_();
  const at::Tensor k = at::randn({s, b, G, d}).requires_grad_();
  const at::Tensor v = at::randn({s, b, G, d}).requires_grad_();
  const at::Tensor w = at::randn({s, b, a * d});
  auto run = [&](CoreAttention& attn) {
    const at::Tensor out = attn.forward(q, k, v, make_causal_mask(s));
    auto grads = torch::autograd::grad({(out * w).sum()}, {q, k, v});
    return std::make_pair(out.detach(), grads);
  };
  const auto [out_u, grad_u] = run(unfused);
  const auto [out_f, grad_f] = run(flash);
  ASSERT_EQ(out_f.sizes(), (at::IntArrayRef{s, b, a * d}));
  EXPECT_TRUE(at::allclose(out_f, out_u, 1e-5, 1e-5)) << (out_f - out_u).abs().max().item<double>();
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(at::allclose(grad_f[i], grad_u[i], 1e-4, 1e-5))
        << "input " << i << ": " << (grad_f[i] - grad_u[i]).abs().max().item<double>();
  }
  // Swapping the two key/value groups changes flash's answer: the grouping is not ignored.
  const at::Tensor swapped = flash.forward(q, k.flip(2), v.flip(2), make_causal_mask(s));
  EXPECT_FALSE(at::allclose(swapped, out_f, 1e-3, 1e-3));
}

TEST(GradCheck, MLPGeLUAndSwiGLU) {
  for (bool gated : {false, true}) {
    TransformerConfig c = small_config();
    c.hidden_size = 6;
    c.num_attention_heads = 2;
    c.ffn_hidden_size = 5;
    c.gated_linear_unit = gated;
    MLP mlp(c, at::kDouble);
    {
      at::NoGradGuard no_grad;
      for (auto& p : mlp.parameters()) p.normal_();
    }
    gradcheck(
        [&](const std::vector<at::Tensor>& in) {
          auto [out, bias] = mlp.forward(in[0]);
          return out + bias;
        },
        {at::randn({3, 2, 6}, at::kDouble)});
  }
}

TEST(GradCheck, RotaryEmbedding) {
  TransformerConfig c = small_config();
  c.position_embedding_type = "rope";
  RotaryEmbedding rope(c, at::kDouble);
  gradcheck([&](const std::vector<at::Tensor>& in) { return rope.apply(in[0]); },
            {at::randn({5, 2, 3, 8}, at::kDouble)});
}

TEST(GradCheck, TransformerLayer) {
  TransformerConfig c = small_config();
  c.hidden_size = 8;
  c.num_attention_heads = 2;
  c.ffn_hidden_size = 6;
  TransformerLayer layer(c, layer_spec(c, 0), make_activation_plan(c).layers[0], 1, at::kDouble);
  layer.eval();
  {
    at::NoGradGuard no_grad;
    for (auto& p : layer.parameters()) p.normal_(0, 0.5);
  }
  gradcheck(
      [&](const std::vector<at::Tensor>& in) {
        return layer.forward(in[0], LayerContext{nullptr, make_causal_mask(4)});
      },
      {at::randn({4, 2, 8}, at::kDouble)});
}

}  // namespace
}  // namespace actmem
