// test_mla.cpp — multi-latent attention: Megatron's validation rules and parameter names, the
// attention against an independent per-token reference (decoupled RoPE, YaRN tables and softmax
// scale from their formulas), every recompute and offload strategy bitwise equal to the plain run,
// and the exact predictor and the estimate's terms against the tracker and the ledger.
#include "actmem/base/compat.h"
#include "actmem/config/activation_plan.h"
#include "actmem/memory/ledger.h"
#include "actmem/memory/memory_model.h"
#include "actmem/model/activation_bytes.h"
#include "actmem/model/mla/mla.h"
#include "actmem/model/model.h"
#include "actmem/recompute/recompute.h"
#include "actmem/train/checkpoint.h"
#include "actmem/train/trainer.h"
#include "exactness.h"
#include "fixtures.h"
#include "test_util.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <map>

namespace {

using actmem::GPTModel;
using actmem::Trainer;
using actmem::TrainingConfig;
using actmem::TransformerConfig;
using actmem::testing::expect_error_containing;
using actmem::testing::offload;
using actmem::testing::selective;

// small_model (4 layers, h 32, 4 heads, s 24, b 2) with DeepSeek-style MLA: compressed queries,
// normed latents, RMSNorm, YaRN with a factor > 1 (so the tables differ from plain RoPE).
TransformerConfig mla_model() {
  TransformerConfig c = actmem::testing::small_model();
  c.multi_latent_attention = true;
  c.q_lora_rank = 16;
  c.kv_lora_rank = 12;
  c.qk_head_dim = 8;
  c.qk_pos_emb_head_dim = 4;
  c.v_head_dim = 6;
  c.qk_layernorm = true;
  c.normalization = "RMSNorm";
  c.rotary_scaling_factor = 4.0;
  c.mscale = 1.0;
  c.mscale_all_dim = 0.5;
  return c;
}

// ---- validation --------------------------------------------------------------------------------

TEST(MLAConfig, MegatronsRulesWithItsMessages) {
  auto refused = [](const std::function<void(TransformerConfig&)>& edit,
                    const std::string& needle) {
    TransformerConfig c = mla_model();
    edit(c);
    expect_error_containing([&] { c.validate(); }, needle);
  };
  EXPECT_NO_THROW(mla_model().validate());
  refused(
      [](TransformerConfig& c) {
        c.multi_latent_attention = false;
        c.q_lora_rank.reset();
        c.qk_layernorm = false;
        selective(c, {"mla_up_proj"});
      },
      "mla_up_proj in recompute_modules is only supported with multi_latent_attention.");
  refused(
      [](TransformerConfig& c) {
        c.multi_latent_attention = false;
        c.q_lora_rank.reset();
        c.qk_layernorm = false;
        c.rope_type = "yarn";
      },
      "Common attention only support rope_type=\"rope\", but got yarn.");
  refused([](TransformerConfig& c) { c.rope_type = "ntk"; },
          "Unsupported RoPE type: ntk, supported types are 'rope' and 'yarn'");
  refused(
      [](TransformerConfig& c) {
        c.multi_latent_attention = false;
        c.qk_layernorm = false;
      },
      "q_lora_rank needs --multi-latent-attention");
  refused([](TransformerConfig& c) { c.q_lora_rank = 0; }, "q_lora_rank must be positive");
  refused([](TransformerConfig& c) { c.kv_lora_rank = 0; }, "kv_lora_rank must be positive");
  refused([](TransformerConfig& c) { c.qk_pos_emb_head_dim = 3; },
          "qk_pos_emb_head_dim must be even");
  refused([](TransformerConfig& c) { c.rotary_scaling_factor = 0.0; },
          "rotary_scaling_factor must be a positive number");
  // Tensor parallelism splits the heads (Note [MLA under tensor parallelism]); the heads must
  // divide among the ranks.
  refused([](TransformerConfig& c) { c.tensor_model_parallel_size = 3; },
          "num_attention_heads (4) must be divisible by tensor_model_parallel_size (3)");
  // MLA sizes its heads itself: h need not be a multiple of the heads.
  TransformerConfig odd = mla_model();
  odd.num_attention_heads = 3;
  EXPECT_NO_THROW(odd.validate());
  // The command line: the flags reach the config.
  const auto r = actmem::testing::run_actmem(
      "train --num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
      "--micro-batch-size 1 --train-iters 1 --multi-latent-attention --kv-lora-rank 8 "
      "--qk-head-dim 4 --qk-pos-emb-head-dim 5");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.stderr_text.find("qk_pos_emb_head_dim must be even"), std::string::npos)
      << r.stderr_text;
}

// ---- the module --------------------------------------------------------------------------------

// count_parameters from the configuration alone (the MLA part's LayerPart::parameters) against
// the model GPTModel builds: with and without the query latent, the latent norms, LayerNorm's
// biases and an MoE layer.
TEST(MLAModel, ParametersCountedFromTheConfigurationAsTheModelBuildsThem) {
  std::vector<std::pair<const char*, TransformerConfig>> configs;
  configs.emplace_back("q_lora", mla_model());
  TransformerConfig plain = mla_model();
  plain.q_lora_rank.reset();
  plain.qk_layernorm = false;
  configs.emplace_back("no_q_lora", plain);
  TransformerConfig layernorm = mla_model();
  layernorm.normalization = "LayerNorm";
  configs.emplace_back("layernorm", layernorm);
  TransformerConfig moe = mla_model();
  moe.num_moe_experts = 4;
  moe.moe_layer_freq = "[0,1,0,1]";
  configs.emplace_back("moe", moe);
  for (const auto& [name, c] : configs) {
    GPTModel model(c);
    const actmem::ParameterCount n = actmem::count_parameters(c);
    EXPECT_EQ(n.total, model.num_parameters()) << name;
    EXPECT_EQ(n.on_rank, static_cast<double>(model.num_parameters())) << name;
  }
}

TEST(MLAModel, MegatronsParameterNamesAndShapes) {
  GPTModel with_q(mla_model());
  std::map<std::string, std::vector<int64_t>> names;
  for (const auto& p : with_q.named_parameters()) {
    if (p.key().rfind("decoder.layers.0.self_attention.", 0) == 0) {
      names[p.key().substr(std::string("decoder.layers.0.self_attention.").size())] =
          p.value().sizes().vec();
    }
  }
  const std::map<std::string, std::vector<int64_t>> expected = {
      {"linear_proj.weight", {32, 4 * 6}},
      {"linear_proj.bias", {32}},
      {"linear_q_down_proj.weight", {16, 32}},
      {"linear_q_up_proj.weight", {4 * 12, 16}},
      {"linear_kv_down_proj.weight", {12 + 4, 32}},
      {"linear_kv_up_proj.weight", {4 * (8 + 6), 12}},
      {"q_layernorm.weight", {16}},
      {"kv_layernorm.weight", {12}},
  };
  EXPECT_EQ(names, expected);
  TransformerConfig c = mla_model();
  c.q_lora_rank.reset();
  c.qk_layernorm = false;
  GPTModel without_q(c);
  std::vector<std::string> attn;
  for (const auto& p : without_q.named_parameters()) {
    if (p.key().rfind("decoder.layers.0.self_attention.", 0) == 0) attn.push_back(p.key());
  }
  EXPECT_EQ(attn,
            (std::vector<std::string>{"decoder.layers.0.self_attention.linear_proj.weight",
                                      "decoder.layers.0.self_attention.linear_proj.bias",
                                      "decoder.layers.0.self_attention.linear_q_proj.weight",
                                      "decoder.layers.0.self_attention.linear_kv_down_proj.weight",
                                      "decoder.layers.0.self_attention.linear_kv_up_proj.weight"}));
}

// YaRN's frequencies and concentration factor, written from their definition (Peng et al. 2023,
// as Megatron's YarnRotaryEmbedding computes them with beta_fast 32, beta_slow 1 and 4096
// original positions).
std::pair<std::vector<double>, double> yarn_reference(const TransformerConfig& c) {
  const int64_t d = c.qk_pos_emb_head_dim;
  const double base = c.rotary_base, factor = c.rotary_scaling_factor;
  auto dim_for = [&](double rotations) {
    return d * std::log(4096.0 / (rotations * 2 * M_PI)) / (2 * std::log(base));
  };
  const double lo = std::max(std::floor(dim_for(32.0)), 0.0);
  double hi = std::min(std::ceil(dim_for(1.0)), static_cast<double>(d - 1));
  if (lo == hi) hi += 0.001;
  std::vector<double> inv(static_cast<size_t>(d / 2));
  for (int64_t i = 0; i < d / 2; ++i) {
    const double extrapolated = std::pow(base, -2.0 * static_cast<double>(i) / d);
    const double ramp = std::clamp((static_cast<double>(i) - lo) / (hi - lo), 0.0, 1.0);
    // The low dims (ramp 0) keep their frequency, the high ones (ramp 1) are interpolated.
    inv[static_cast<size_t>(i)] = extrapolated * (1.0 - ramp) + extrapolated / factor * ramp;
  }
  auto mscale = [&](double m) { return factor <= 1 ? 1.0 : 0.1 * m * std::log(factor) + 1.0; };
  return {inv, mscale(c.mscale) / mscale(c.mscale_all_dim)};
}

TEST(MLAModel, AttentionEqualsAnIndependentPerTokenReference) {
  for (int variant = 0; variant < 3; ++variant) {
    TransformerConfig c = mla_model();
    c.attention_dropout = 0.0;
    c.hidden_dropout = 0.0;
    if (variant == 1) {  // no query compression, no latent norms, plain RoPE
      c.q_lora_rank.reset();
      c.qk_layernorm = false;
      c.rope_type = "rope";
    }
    if (variant == 2) c.normalization = "LayerNorm";  // LayerNorm latents, YaRN
    GPTModel model(c, at::kDouble);
    model.eval();
    auto& mla = *model.decoder->layers[1]->mixer_as<actmem::MLASelfAttention>();
    const int64_t s = c.seq_length, b = 2, a = c.num_attention_heads, h = c.hidden_size;
    const int64_t qk = c.qk_head_dim, dr = c.qk_pos_emb_head_dim, dv = c.v_head_dim;
    const at::Tensor x = at::randn({s, b, h}, at::TensorOptions().dtype(at::kDouble));
    at::Tensor y;
    {
      at::NoGradGuard no_grad;
      actmem::LayerContext ctx{model.rope(), model.attention_mask(), nullptr};
      y = mla.forward(x, ctx).first;
    }
    // Frequencies and the factor multiplying cos and sin.
    std::vector<double> inv(static_cast<size_t>(dr / 2));
    double conc = 1.0;
    if (c.resolved_rope_type() == "yarn") {
      std::tie(inv, conc) = yarn_reference(c);
    } else {
      for (int64_t i = 0; i < dr / 2; ++i)
        inv[static_cast<size_t>(i)] = std::pow(c.rotary_base, -2.0 * i / dr);
    }
    auto norm = [&](const at::Tensor& v, const at::Tensor& w, const at::Tensor& bias) {
      if (c.normalization == "RMSNorm")
        return v / at::sqrt(v.pow(2).mean() + c.layernorm_epsilon) * w;
      const at::Tensor centred = v - v.mean();
      return centred / at::sqrt(centred.pow(2).mean() + c.layernorm_epsilon) * w + bias;
    };
    // RoPE on one head's rotary part at position p: de-interleave (even features, then odd), then
    // rotate each pair (i, i + dr/2) by p * inv[i], scaled by the concentration factor.
    auto rope = [&](const at::Tensor& part, int64_t p) {
      const at::Tensor de = at::cat({part.slice(0, 0, dr, 2), part.slice(0, 1, dr, 2)});
      at::Tensor out = at::empty_like(de);
      for (int64_t i = 0; i < dr / 2; ++i) {
        const double th = static_cast<double>(p) * inv[static_cast<size_t>(i)];
        const double cs = std::cos(th) * conc, sn = std::sin(th) * conc;
        out[i] = de[i] * cs - de[i + dr / 2] * sn;
        out[i + dr / 2] = de[i + dr / 2] * cs + de[i] * sn;
      }
      return out;
    };
    const double m = c.rotary_scaling_factor <= 1
                         ? 1.0
                         : 0.1 * c.mscale_all_dim * std::log(c.rotary_scaling_factor) + 1.0;
    const double scale = m * m / std::sqrt(static_cast<double>(qk + dr));
    for (int64_t bi = 0; bi < b; ++bi) {
      std::vector<at::Tensor> qs, ks, vs;  // per position: [a, qk + dr], [a, qk + dr], [a, dv]
      for (int64_t p = 0; p < s; ++p) {
        const at::Tensor xt = x[p][bi];
        at::Tensor q;
        if (mla.linear_q_proj) {
          q = at::matmul(mla.linear_q_proj->weight, xt);
        } else {
          at::Tensor lat = at::matmul(mla.linear_q_down_proj->weight, xt);
          if (mla.q_layernorm) lat = norm(lat, mla.q_layernorm->weight, mla.q_layernorm->bias);
          q = at::matmul(mla.linear_q_up_proj->weight, lat);
        }
        q = q.view({a, qk + dr});
        const at::Tensor kv_all = at::matmul(mla.linear_kv_down_proj->weight, xt);
        at::Tensor lat = kv_all.slice(0, 0, c.kv_lora_rank);
        if (mla.kv_layernorm) lat = norm(lat, mla.kv_layernorm->weight, mla.kv_layernorm->bias);
        const at::Tensor kv = at::matmul(mla.linear_kv_up_proj->weight, lat).view({a, qk + dv});
        const at::Tensor k_rot = rope(kv_all.slice(0, c.kv_lora_rank), p);  // shared by every head
        std::vector<at::Tensor> qh, kh;
        for (int64_t hd = 0; hd < a; ++hd) {
          qh.push_back(at::cat({q[hd].slice(0, 0, qk), rope(q[hd].slice(0, qk), p)}));
          kh.push_back(at::cat({kv[hd].slice(0, 0, qk), k_rot}));
        }
        qs.push_back(at::stack(qh));
        ks.push_back(at::stack(kh));
        vs.push_back(kv.slice(1, qk));
      }
      for (int64_t p = 0; p < s; ++p) {
        std::vector<at::Tensor> heads;
        for (int64_t hd = 0; hd < a; ++hd) {
          std::vector<at::Tensor> scores;
          for (int64_t j = 0; j <= p; ++j) scores.push_back(at::dot(qs[p][hd], ks[j][hd]) * scale);
          const at::Tensor w = at::softmax(at::stack(scores), 0);
          at::Tensor ctx = at::zeros({dv}, x.options());
          for (int64_t j = 0; j <= p; ++j) ctx = ctx + w[j] * vs[j][hd];
          heads.push_back(ctx);
        }
        const at::Tensor expect = at::matmul(mla.linear_proj->weight, at::cat(heads));
        EXPECT_TRUE(at::allclose(y[p][bi], expect, 1e-10, 1e-12))
            << "variant " << variant << " position " << p << " batch " << bi << ": max difference "
            << (y[p][bi] - expect).abs().max().item<double>();
      }
    }
  }
}

TEST(MLAModel, YarnTablesAndSoftmaxScaleFollowTheirFormulas) {
  TransformerConfig c = mla_model();
  c.rotary_scaling_factor = 40.0;  // DeepSeek-V2's factor
  c.mscale = 0.707;
  c.mscale_all_dim = 0.707;
  c.max_position_embeddings = 64;
  GPTModel model(c, at::kDouble);
  const auto [inv, conc] = yarn_reference(c);
  EXPECT_DOUBLE_EQ(conc, 1.0);  // mscale == mscale_all_dim cancel
  const at::Tensor cos = model.rope()->cos, sin = model.rope()->sin;  // [S, 1, 1, dr]
  ASSERT_EQ(cos.size(0), 64);
  for (int64_t p : {0, 1, 17, 63}) {
    for (int64_t i = 0; i < c.qk_pos_emb_head_dim; ++i) {
      const double th =
          static_cast<double>(p) * inv[static_cast<size_t>(i % (c.qk_pos_emb_head_dim / 2))];
      EXPECT_NEAR(cos[p][0][0][i].item<double>(), std::cos(th) * conc, 1e-12) << p << " " << i;
      EXPECT_NEAR(sin[p][0][0][i].item<double>(), std::sin(th) * conc, 1e-12) << p << " " << i;
    }
  }
  // A factor > 1 interpolates the high dims: some frequency differs from plain RoPE.
  EXPECT_LT(inv.back(), std::pow(c.rotary_base,
                                 -2.0 * (c.qk_pos_emb_head_dim / 2 - 1) / c.qk_pos_emb_head_dim));
  const double m = 0.1 * 0.707 * std::log(40.0) + 1.0;
  EXPECT_DOUBLE_EQ(model.decoder->layers[0]->mixer_as<actmem::MLASelfAttention>()->softmax_scale(),
                   m * m / std::sqrt(12.0));
}

// ---- exactness ---------------------------------------------------------------------------------

using Case = actmem::testing::ConfigEdit;
void PrintTo(const Case& v, std::ostream* os) {
  *os << v.name;
}

const Case kMLAVariants[] = {
    {"DeepSeek",
     [](TransformerConfig& c) {
       c.gated_linear_unit = true;
       c.add_bias_linear = false;
       c.position_embedding_type = "rope";
     }},
    {"NoQLoraLayerNormRope",
     [](TransformerConfig& c) {
       c.q_lora_rank.reset();
       c.qk_layernorm = false;
       c.normalization = "LayerNorm";
       c.rope_type = "rope";
     }},
    {"WithMoE",
     [](TransformerConfig& c) {
       c.add_bias_linear = false;
       c.num_moe_experts = 4;
       c.moe_ffn_hidden_size = 24;
       c.moe_aux_loss_coeff = 1e-2;
       c.moe_grouped_gemm = true;
       c.moe_layer_freq = "[0,1,1,1]";
       c.moe_shared_expert_intermediate_size = 16;
     }},
};

const Case kMLAStrategies[] = {
    {"RecomputeCoreAttn", [](TransformerConfig& c) { selective(c, {"core_attn"}); }},
    {"RecomputeMlaUpProj", [](TransformerConfig& c) { selective(c, {"mla_up_proj"}); }},
    {"RecomputeMlaUpProjCoreAttn",
     [](TransformerConfig& c) {
       selective(c, {"mla_up_proj", "core_attn"});
     }},
    {"RecomputeLayernormMlaUpProj",
     [](TransformerConfig& c) {
       selective(c, {"layernorm", "mla_up_proj"});
     }},
    {"RecomputeEverySelective",
     [](TransformerConfig& c) {
       if (c.num_moe_experts > 0) {
         selective(c,
                   {"core_attn", "layernorm", "mla_up_proj", "mlp", "moe_act", "shared_experts"});
       } else {
         selective(c, {"core_attn", "layernorm", "mla_up_proj", "mlp"});
       }
     }},
    {"FullUniform2",
     [](TransformerConfig& c) {
       c.recompute_granularity = "full";
       c.recompute_method = "uniform";
       c.recompute_num_layers = 2;
     }},
    {"OffloadQkvLinear", [](TransformerConfig& c) { offload(c, {"qkv_linear"}); }},
    {"OffloadAttnNormCoreAttnAttnProj",
     [](TransformerConfig& c) {
       offload(c, {"attn_norm", "core_attn", "attn_proj"});
     }},
    {"OffloadQkvLinearRecomputeMlaUpProj",
     [](TransformerConfig& c) {
       // The checkpoint's inputs are offloaded with the group: the hook's replay reloads them.
       offload(c, {"qkv_linear"});
       selective(c, {"mla_up_proj"});
     }},
    {"OffloadCoreAttnRecomputeMlaUpProj",
     [](TransformerConfig& c) {
       // q, k, v are freed by the recompute, so core_attn's group does not copy them.
       offload(c, {"core_attn", "attn_proj"});
       selective(c, {"mla_up_proj"});
     }},
    {"OffloadAllRecomputeLayernormMlaUpProj",
     [](TransformerConfig& c) {
       if (c.num_moe_experts > 0) {
         offload(c, {"attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1",
                     "moe_act"});
         selective(c, {"layernorm", "mla_up_proj", "moe_act"});
       } else {
         offload(c, {"attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"});
         selective(c, {"layernorm", "mla_up_proj"});
       }
     }},
    {"LayerOffload2",
     [](TransformerConfig& c) {
       c.cpu_offloading_num_layers = 2;
       c.min_offloaded_tensor_size = 64;
     }},
};

class MLAExactness : public ::testing::TestWithParam<actmem::testing::ExactnessCase> {};

TEST_P(MLAExactness, BitwiseEqualToPlainOverThreeSteps) {
  actmem::testing::expect_strategy_exact(mla_model(), GetParam());
}

// 16 bits on the DeepSeek variant (the others repeat the same paths).
INSTANTIATE_TEST_SUITE_P(Strategies, MLAExactness,
                         ::testing::ValuesIn(actmem::testing::exactness_cases(kMLAVariants,
                                                                              kMLAStrategies,
                                                                              {"DeepSeek"})),
                         actmem::testing::exactness_case_name);

TEST(MLARecompute, UpProjectionReplaysOncePerLayerAndFreesQkv) {
  auto run = [](void (*apply)(TransformerConfig&)) {
    TransformerConfig c = mla_model();
    apply(c);
    TrainingConfig t;
    t.eval_interval = 0;
    Trainer trainer(c, t);
    actmem::forward_counters().reset();
    actmem::recompute_counters().reset();
    const auto st = trainer.train_step(false);
    return std::make_tuple(actmem::recompute_counters().output_recomputes.load(),
                           actmem::forward_counters().core_attention.load(), st.activation_bytes);
  };
  const auto plain = run([](TransformerConfig&) {});
  const auto up = run([](TransformerConfig& c) { selective(c, {"mla_up_proj"}); });
  EXPECT_EQ(std::get<0>(plain), 0);
  EXPECT_EQ(std::get<0>(up), 4);                   // one output-discarding replay per layer
  EXPECT_EQ(std::get<1>(up), std::get<1>(plain));  // core attention is not replayed
  // q, k, v (T a (2(qk + pos) + v) elements per layer) are gone; the checkpoint adds one random
  // state snapshot per layer.
  const TransformerConfig c = mla_model();
  const int64_t qkv = c.seq_length * c.micro_batch_size * c.num_attention_heads *
                      (2 * c.mla_q_head_dim() + c.v_head_dim) * 4;
  EXPECT_EQ(std::get<2>(plain) - std::get<2>(up), 4 * (qkv - actmem::checkpoint_snapshot_bytes()));
}

// ---- memory ------------------------------------------------------------------------------------

class MLAPredictor : public ::testing::TestWithParam<std::tuple<Case, const char*>> {};

TEST_P(MLAPredictor, ExactAgainstTheTrackerAndTheLedgerPerModule) {
  const std::pair<const char*, void (*)(TransformerConfig&)> policies[] = {
      {"plain", [](TransformerConfig&) {}},
      {"core_attn", [](TransformerConfig& c) { selective(c, {"core_attn"}); }},
      {"mla_up_proj", [](TransformerConfig& c) { selective(c, {"mla_up_proj"}); }},
      {"mla_up_proj+core_attn",
       [](TransformerConfig& c) {
         selective(c, {"mla_up_proj", "core_attn"});
       }},
      {"layernorm+mla_up_proj",
       [](TransformerConfig& c) {
         selective(c, {"layernorm", "mla_up_proj"});
       }},
      {"no attention dropout", [](TransformerConfig& c) { c.attention_dropout = 0.0; }},
      {"full block 2",
       [](TransformerConfig& c) {
         c.recompute_granularity = "full";
         c.recompute_method = "block";
         c.recompute_num_layers = 2;
       }},
  };
  for (const auto& [policy, apply] : policies) {
    TransformerConfig c = mla_model();
    actmem::testing::set_precision(c, std::get<1>(GetParam()));
    std::get<0>(GetParam()).apply(c);
    apply(c);
    actmem::testing::expect_predictor_matches_tracker(c, policy);
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, MLAPredictor,
                         ::testing::Combine(::testing::ValuesIn(kMLAVariants),
                                            ::testing::ValuesIn(actmem::testing::kPrecisions)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).name) + "_" +
                                  std::get<1>(info.param);
                         });

TEST(MLAPredictor, StepPeakBoundCoversMLAModels) {
  for (int i = 0; i < 3; ++i) {
    TransformerConfig c = mla_model();
    kMLAVariants[i].apply(c);
    if (i == 0) actmem::testing::set_precision(c, "bf16");
    TrainingConfig t;
    t.eval_interval = 0;
    Trainer trainer(c, t);
    int64_t peak = 0;
    for (int step = 0; step < 2; ++step)
      peak = std::max(peak, trainer.train_step(false).peak_device_bytes);
    EXPECT_GE(actmem::predict_step_peak_bound(c), static_cast<double>(peak))
        << kMLAVariants[i].name;
  }
}

TEST(MLAEstimate, TermsEqualThePredictorsAttentionModulesAtBf16) {
  // paper_mla_attention_bytes is what the exact predictor counts under self_attention at 16 bits
  // (RMSNorm latents, dropout on), with and without query compression and latent norms.
  for (int variant = 0; variant < 3; ++variant) {
    TransformerConfig c = mla_model();
    actmem::testing::set_precision(c, "bf16");
    if (variant == 1) c.qk_layernorm = false;
    if (variant == 2) c.q_lora_rank.reset(), c.qk_layernorm = false;
    actmem::PaperShape m;
    m.s = static_cast<double>(c.seq_length), m.b = static_cast<double>(c.micro_batch_size);
    m.h = static_cast<double>(c.hidden_size), m.a = static_cast<double>(c.num_attention_heads);
    m.mla.q_lora = static_cast<double>(c.q_lora_rank.value_or(0));
    m.mla.kv_lora = static_cast<double>(c.kv_lora_rank);
    m.mla.qk = static_cast<double>(c.qk_head_dim),
    m.mla.pos = static_cast<double>(c.qk_pos_emb_head_dim);
    m.mla.v = static_cast<double>(c.v_head_dim), m.mla.qk_layernorm = c.qk_layernorm;
    const actmem::MLAAttentionBytes estimate = actmem::paper_mla_attention_bytes(m);
    for (const char* policy : {"none", "mla_up_proj"}) {
      TransformerConfig cp = c;
      if (std::string(policy) == "mla_up_proj") selective(cp, {"mla_up_proj"});
      const auto predicted = actmem::predict_activation_bytes(cp, 2, false);  // no snapshots
      int64_t attn = 0;
      for (const auto& [module, bytes] : predicted.by_module) {
        if (module.rfind("decoder.layers.0.self_attention.", 0) == 0) attn += bytes;
      }
      const double expect =
          std::string(policy) == "none" ? estimate.none() : estimate.none() - estimate.qkv;
      EXPECT_EQ(static_cast<double>(attn), expect) << "variant " << variant << " " << policy;
    }
  }
  // The command: MLA's terms replace the paper's attention terms in the per-layer figure.
  const std::string model =
      "estimate --json --seq-length 4096 --micro-batch-size 1 --hidden-size 2048 "
      "--num-attention-heads 16 --num-layers 4 --ffn-hidden-size 8192 --vocab-size 32000 "
      "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --no-sequence-parallel";
  const auto dense = actmem::testing::run_actmem(model);
  const auto mla = actmem::testing::run_actmem(
      model +
      " --multi-latent-attention --q-lora-rank 512 --kv-lora-rank 256 --qk-head-dim 128 "
      "--qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm");
  ASSERT_EQ(dense.exit_code, 0) << dense.stderr_text;
  ASSERT_EQ(mla.exit_code, 0) << mla.stderr_text;
  const auto jd = nlohmann::json::parse(dense.output), jm = nlohmann::json::parse(mla.output);
  const double sbh = 4096.0 * 2048, sb = 4096.0, as2b = 16.0 * 4096 * 4096;
  const double latents =
      2 * sbh + 2 * sb * 512 * 2 + 4 * sb + 2 * sb * (256 + 64) + 2 * sb * 256 + 4 * sb;
  const double qkv = 2 * sb * 16 * (2 * 192 + 128), context = 2 * sb * 16 * 128;
  EXPECT_DOUBLE_EQ(jm["mla"]["terms"]["latents"].get<double>(), latents);
  EXPECT_DOUBLE_EQ(jm["mla"]["attention_bytes"]["none"].get<double>(),
                   latents + qkv + 5 * as2b + context);
  EXPECT_DOUBLE_EQ(
      jm["per_layer_bytes"]["none"].get<double>() - jd["per_layer_bytes"]["none"].get<double>(),
      latents + qkv + context - 10 * sbh);
  const auto bad = actmem::testing::run_actmem("estimate --q-lora-rank 64");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.stderr_text.find("q_lora_rank needs --multi-latent-attention"), std::string::npos)
      << bad.stderr_text;
}

TEST(MLAEstimate, WeightCountEqualsTheModelsParameters) {
  // Megatron's compute_weight_and_optimizer_memory counts attention (MLA's projections and latent
  // norms), dense MLPs, MoE layers (router, routed and shared experts, the shared gate), norms and
  // embeddings; without biases that is every parameter the model has.
  for (int variant = 0; variant < 3; ++variant) {
    TransformerConfig c = mla_model();
    c.add_bias_linear = false;
    c.position_embedding_type = "rope";
    c.untie_embeddings_and_output_weights = true;
    c.gated_linear_unit = true;
    if (variant == 0) {  // MLA with MoE layers
      c.num_moe_experts = 4;
      c.moe_ffn_hidden_size = 24;
      c.moe_layer_freq = "[0,1,1,1]";
      c.moe_shared_expert_intermediate_size = 16;
      c.moe_shared_expert_gate = true;
    }
    if (variant == 1) {  // no query compression, LayerNorm latents
      c.q_lora_rank.reset();
      c.normalization = "LayerNorm";
      c.gated_linear_unit = false;
    }
    if (variant == 2) {  // standard attention
      c.multi_latent_attention = false;
      c.q_lora_rank.reset();
      c.qk_layernorm = false;
      c.normalization = "LayerNorm";
    }
    GPTModel model(c);
    actmem::PaperShape m;
    m.h = static_cast<double>(c.hidden_size), m.a = static_cast<double>(c.num_attention_heads);
    m.L = static_cast<double>(c.num_layers), m.ffn = static_cast<double>(c.ffn());
    m.v = static_cast<double>(c.vocab_size), m.swiglu = c.gated_linear_unit;
    m.untied = c.untie_embeddings_and_output_weights, m.rmsnorm = c.use_rmsnorm();
    if (c.multi_latent_attention) {
      m.mla.q_lora = static_cast<double>(c.q_lora_rank.value_or(0));
      m.mla.kv_lora = static_cast<double>(c.kv_lora_rank);
      m.mla.qk = static_cast<double>(c.qk_head_dim),
      m.mla.pos = static_cast<double>(c.qk_pos_emb_head_dim);
      m.mla.v = static_cast<double>(c.v_head_dim), m.mla.qk_layernorm = true;
    }
    if (c.is_moe()) {
      m.moe.experts = 4, m.moe.topk = 2, m.moe.ffn = 24, m.moe.shared_ffn = 16;
      m.moe.shared_gate = true, m.moe.layers = 3;
    }
    const actmem::WeightMemory w = actmem::megatron_weight_and_optimizer_memory(m);
    EXPECT_EQ(w.parameters, static_cast<double>(model.num_parameters())) << "variant " << variant;
    EXPECT_EQ(w.parameters_on_rank, w.parameters) << "variant " << variant;  // t = p = 1
    if (c.is_moe()) {
      // Active: two of the four experts per MoE layer; the routed experts are 3 x 4 x 3h f.
      EXPECT_EQ(w.parameters - w.active_parameters, 3.0 * 2 * 3 * 32 * 24);
      EXPECT_EQ(w.expert_parameters_on_rank, 3.0 * 4 * 3 * 32 * 24);
      m.moe.ep = 2;  // each expert-parallel rank holds half the routed experts
      m.d = 2;
      EXPECT_EQ(actmem::megatron_weight_and_optimizer_memory(m).expert_parameters_on_rank,
                w.expert_parameters_on_rank / 2);
    }
  }
}

TEST(MLAEstimate, DeepSeekV3CountsItsPublishedParameters) {
  // DeepSeek-V3 (arXiv 2412.19437): 61 layers, the first 3 dense, 256 routed experts top-8 plus
  // one shared, MLA; "671B total parameters, of which 37B are activated for each token" (the
  // multi-token-prediction module apart).
  const auto r = actmem::testing::run_actmem(
      "estimate --json --seq-length 4096 --micro-batch-size 1 --hidden-size 7168 "
      "--num-attention-heads 128 --num-layers 61 --ffn-hidden-size 18432 --vocab-size 129280 "
      "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --no-sequence-parallel "
      "--swiglu --untie-embeddings-and-output-weights --normalization RMSNorm --num-experts 256 "
      "--moe-router-topk 8 --moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048 "
      "--moe-layer-freq '([0]*3+[1]*58)' --multi-latent-attention --q-lora-rank 1536 "
      "--kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 "
      "--qk-layernorm --expert-model-parallel-size 64 --data-parallel-size 64 "
      "--disable-bias-linear");  // Megatron's shared experts have no biases
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto w = nlohmann::json::parse(r.output)["weights_and_optimizer"];
  EXPECT_NEAR(w["parameters"].get<double>() / 1e9, 671.0, 0.5);
  EXPECT_NEAR(w["active_parameters"].get<double>() / 1e9, 37.0, 1.0);
  EXPECT_EQ(nlohmann::json::parse(r.output)["moe"]["moe_layers"].get<double>(), 58);
  // Expert parallelism 64 leaves 4 of the 256 experts per layer on a rank.
  EXPECT_DOUBLE_EQ(w["expert_parameters_on_rank"].get<double>(), 58.0 * 4 * 3 * 7168 * 2048);
}

// ---- commands
// -------------------------------------------------------------------------------------

TEST(MLACli, CompareAddsTheUpProjectionAndTrainDescribesTheAttention) {
  const std::string model =
      "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size "
      "2 "
      "--multi-latent-attention --kv-lora-rank 8 --qk-head-dim 4 --qk-pos-emb-head-dim 4 "
      "--v-head-dim 4";
  const auto cmp =
      actmem::testing::run_actmem("compare " + model + " --iters 1 --warmup 0 --svg ''");
  ASSERT_EQ(cmp.exit_code, 0) << cmp.output;
  for (const char* name : {"selective-mla_up_proj ", "selective-core_attn+mla_up_proj "}) {
    const size_t at = cmp.output.find(name);
    ASSERT_NE(at, std::string::npos) << name << "\n" << cmp.output;
    const std::string line = cmp.output.substr(at, cmp.output.find('\n', at) - at);
    EXPECT_EQ(line.substr(line.size() - 3), "yes") << line;  // bitwise equal to plain
  }
  const auto train = actmem::testing::run_actmem("train " + model + " --train-iters 1");
  ASSERT_EQ(train.exit_code, 0) << train.output;
  EXPECT_NE(
      train.output.find("MLA: q_lora_rank none, kv_lora_rank 8, head dims qk 4 + rope 4, v 4, "
                        "yarn (factor 1)"),
      std::string::npos)
      << train.output;
}

// ---- checkpoints
// ----------------------------------------------------------------------------------

TEST(MLACheckpoint, ResumesBitwiseAndRefusesStandardAttention) {
  TransformerConfig c = mla_model();
  TrainingConfig t;
  t.eval_interval = 0;
  const std::string dir = actmem::testing::fresh_temp_dir("mla_ckpt");
  Trainer through(c, t), first(c, t);
  for (int i = 0; i < 2; ++i) {
    through.train_step();
    first.train_step();
  }
  first.save_checkpoint(dir);
  Trainer resumed(c, t);
  resumed.load_checkpoint(dir);
  actmem::testing::expect_bitwise_equal_training(through, resumed, 2);
  TransformerConfig standard = actmem::testing::small_model();
  Trainer other(standard, t);
  expect_error_containing([&] { other.load_checkpoint(dir); }, "multi-latent");
  TransformerConfig other_rank = c;
  other_rank.kv_lora_rank = 10;
  Trainer narrower(other_rank, t);
  expect_error_containing([&] { narrower.load_checkpoint(dir); }, "kv_lora_rank");
  // Inference rebuilds the MLA model (YaRN factor and all) from the checkpoint's args.
  const actmem::LoadedModel loaded = actmem::load_model_for_inference(dir);
  ASSERT_TRUE(loaded.model->decoder->layers[0]->mixer_as<actmem::MLASelfAttention>());
  first.model().eval();
  at::NoGradGuard g;
  const at::Tensor tokens = at::randint(0, 256, {2, 24}, at::kLong);
  EXPECT_TRUE(
      actmem::testing::bitwise_equal(first.model().logits(tokens), loaded.model->logits(tokens)));
}

}  // namespace
