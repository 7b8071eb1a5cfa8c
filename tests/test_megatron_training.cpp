// Megatron's training flags that change the step's numbers or its log: --log-throughput's FLOPs
// (num_floating_point_operations), --calculate-per-token-loss on every layout, --decoupled-lr and
// the weight decay's exemptions.
#include "actmem/train/mixed_precision.h"
#include "actmem/train/optimizer.h"
#include "actmem/train/throughput.h"
#include "actmem/train/trainer.h"
#include "fixtures.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

namespace actmem {
namespace {

TransformerConfig flops_base() {
  TransformerConfig c = testing::shaped_model(4, 64, 4, 256, 32, 1);
  c.kv_channels_arg = 16;
  c.vocab_size = 512;  // padded
  return c;
}

TEST(Throughput, ModelFlopsAreMegatronsNumFloatingPointOperations) {
  // Expected: Megatron's own num_floating_point_operations(args, 6)
  // (megatron/training/training.py at d98e8a64dd, run on these arguments).
  TransformerConfig dense = flops_base();
  EXPECT_DOUBLE_EQ(megatron_model_flops(dense, 6), 273678336.0);
  TransformerConfig gqa = flops_base();  // --group-query-attention --num-query-groups 2 --swiglu
  gqa.num_query_groups = 2;
  gqa.gated_linear_unit = true;
  gqa.kv_channels_arg = 24;
  EXPECT_DOUBLE_EQ(megatron_model_flops(gqa, 6), 363331584.0);
  TransformerConfig moe = flops_base();
  moe.num_moe_experts = 8;
  moe.moe_layer_freq = "[1,0,1,1]";
  moe.moe_router_topk = 2;
  moe.moe_ffn_hidden_size = 96;
  moe.moe_shared_expert_intermediate_size = 128;
  moe.gated_linear_unit = true;
  EXPECT_DOUBLE_EQ(megatron_model_flops(moe, 6), 391643136.0);
  TransformerConfig mla = flops_base();
  mla.multi_latent_attention = true;
  mla.kv_lora_rank = 32;
  mla.qk_head_dim = 16;
  mla.qk_pos_emb_head_dim = 8;
  mla.v_head_dim = 16;
  EXPECT_DOUBLE_EQ(megatron_model_flops(mla, 6), 278544384.0);
  mla.q_lora_rank = 48;
  EXPECT_DOUBLE_EQ(megatron_model_flops(mla, 6), 285843456.0);
  TransformerConfig gdn = flops_base();
  gdn.experimental_attention_variant = "gdn";
  gdn.linear_attention_freq = "2";
  gdn.linear_key_head_dim = 16;
  gdn.linear_value_head_dim = 16;
  gdn.linear_num_key_heads = 2;
  gdn.linear_num_value_heads = 4;
  gdn.linear_conv_kernel_dim = 4;
  EXPECT_DOUBLE_EQ(megatron_model_flops(gdn, 6), 280756224.0);
  TransformerConfig gate = flops_base();
  gate.attention_output_gate = true;
  EXPECT_DOUBLE_EQ(megatron_model_flops(gate, 6), 292552704.0);
  // Recompute is not counted: the same model FLOPs under any plan.
  dense.recompute_granularity = "full";
  dense.recompute_method = "uniform";
  dense.recompute_num_layers = 1;
  EXPECT_DOUBLE_EQ(megatron_model_flops(dense, 6), 273678336.0);
  testing::expect_error_containing([&] { megatron_model_flops(dense, 0); }, "positive batch");
}

TEST(Throughput, LogThroughputAddsTheTflopsToTheLogLine) {
  const auto r = testing::run_actmem(
      "train --num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
      "--micro-batch-size 2 --threads 1 --eval-interval 0 --train-iters 4 --log-interval 2 "
      "--log-throughput");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("| throughput per rank (TFLOP/s/rank): "), std::string::npos) << r.output;
}

// The losses and gradient norms of a run's JSON log.
struct Curve {
  std::vector<double> loss, grad_norm;
};
Curve train_curve(const std::string& args, const std::string& log) {
  const auto r = testing::run_actmem(args + " --log-json " + log);
  EXPECT_EQ(r.exit_code, 0) << args << "\n" << r.output;
  Curve c;
  for (const auto& it : testing::read_json_log(log).iterations) {
    if (!it.contains("loss")) continue;
    c.loss.push_back(it["loss"].get<double>());
    c.grad_norm.push_back(it["grad_norm"].get<double>());
  }
  return c;
}

void expect_close(const Curve& a, const Curve& b, const std::string& what) {
  ASSERT_EQ(a.loss.size(), b.loss.size()) << what;
  ASSERT_FALSE(a.loss.empty()) << what;
  for (size_t i = 0; i < a.loss.size(); ++i) {
    EXPECT_NEAR(a.loss[i], b.loss[i], 1e-5 * std::abs(b.loss[i])) << what << " step " << i;
    EXPECT_NEAR(a.grad_norm[i], b.grad_norm[i], 1e-4 * std::abs(b.grad_norm[i]))
        << what << " step " << i;
  }
}

TEST(PerTokenLoss, TrainsTheDefaultsModelOnEveryLayoutAndRecomputesBitwise) {
  // Every micro-batch holds the same B s loss tokens here, so the global token mean's gradients
  // are the default's (the mean of micro-batch means) up to rounding: Megatron's two modes agree
  // then, on one process and on every parallel layout, with the clip on (--clip-grad 1).
  const std::string dir = testing::fresh_temp_dir("per_token_loss");
  const std::string model =
      " train --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 12 "
      "--micro-batch-size 3 --global-batch-size 12 --threads 1 --eval-interval 0 "
      "--train-iters 3 --clip-grad 1 --lr 1e-2 ";
  const std::string no_dropout = "--attention-dropout 0 --hidden-dropout 0 ";
  const Curve reference = train_curve(model + no_dropout, dir + "/default.jsonl");
  const std::string per_token = no_dropout + "--calculate-per-token-loss ";
  const Curve one = train_curve(model + per_token, dir + "/one.jsonl");
  expect_close(one, reference, "one process");
  // 36 tokens per micro-batch (not a power of two): the sum divided by the step's tokens rounds
  // differently from the mean of means, so the two modes are not bitwise equal.
  EXPECT_NE(one.grad_norm, reference.grad_norm) << "the per-token loss took the default's path";
  for (const std::string layout :
       {"--nproc-per-node 2 --" + model + per_token,
        "--nproc-per-node 2 --" + model + per_token +
            "--tensor-model-parallel-size 2 "
            "--sequence-parallel",
        "--nproc-per-node 2 --" + model + per_token + "--pipeline-model-parallel-size 2",
        "--nproc-per-node 2 --" + model + per_token +
            "--use-distributed-optimizer "
            "--overlap-grad-reduce"}) {
    expect_close(train_curve("launch " + layout, dir + "/layout.jsonl"), reference, layout);
  }
  // MoE: the auxiliary loss keeps its weight.
  const std::string moe = "--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01 ";
  expect_close(
      train_curve(model + no_dropout + moe + "--calculate-per-token-loss", dir + "/moe.jsonl"),
      train_curve(model + no_dropout + moe, dir + "/moe_default.jsonl"), "MoE");
  // Exactness: with dropout on, recompute under the per-token loss is bitwise the plain run.
  const std::string pt = model + "--calculate-per-token-loss ";
  const Curve plain = train_curve(pt, dir + "/plain.jsonl");
  const Curve recompute = train_curve(
      pt + "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
      dir + "/recompute.jsonl");
  EXPECT_EQ(recompute.loss, plain.loss);
  EXPECT_EQ(recompute.grad_norm, plain.grad_norm);
  std::filesystem::remove_all(dir);
}

TEST(DecoupledLr, TheGroupFollowsMegatronsScheduleFromItsOwnRates) {
  // Megatron's OptimizerParamScheduler (megatron/core/optimizer_param_scheduler.py at
  // d98e8a64dd, run on two parameter groups, the second with max_lr 5e-4 and min_lr 4.5e-5):
  // --lr 1e-3 --min-lr 1e-5 --lr-warmup-iters 2 --lr-decay-iters 10 cosine, global batch 4.
  TrainingConfig t;
  t.global_batch_size = 4;
  t.train_iters = 12;
  t.lr = 1e-3;
  t.min_lr = 1e-5;
  t.lr_warmup_iters = 2;
  t.lr_decay_iters = 10;
  t.lr_decay_style = "cosine";
  t.decoupled_lr = 5e-4;
  t.decoupled_min_lr = 4.5e-5;
  TransformerConfig model;
  model.micro_batch_size = 1;
  t.validate(model);
  OptimizerParamScheduler scheduler(t, GlobalBatchSchedule(4));
  const std::vector<std::pair<double, double>> want = {
      {0.0, 0.0},
      {0.0005, 0.00025},
      {0.001, 0.0005},
      {0.000962320368593087, 0.00048268259364631777},
      {0.000855017856687341, 0.0004333667927199396},
      {0.0006944282990207195, 0.00035956048086305796},
      {0.000505, 0.0002725},
      {0.0003155717009792806, 0.0001854395191369421},
      {0.000154982143312659, 0.00011163320728006045},
      {4.7679631406913064e-05, 6.231740635368228e-05},
      {1e-05, 4.5e-05},
      {1e-05, 4.5e-05}};
  for (size_t k = 0; k < want.size(); ++k) {
    EXPECT_DOUBLE_EQ(scheduler.next_lr(), want[k].first) << "step " << k + 1;
    ASSERT_TRUE(scheduler.next_decoupled_lr().has_value());
    EXPECT_DOUBLE_EQ(*scheduler.next_decoupled_lr(), want[k].second) << "step " << k + 1;
    scheduler.step(4);
  }
  // Without --decoupled-min-lr the group ends at --min-lr (its param group has no min_lr).
  t.decoupled_min_lr.reset();
  EXPECT_DOUBLE_EQ(
      OptimizerParamScheduler(t, GlobalBatchSchedule(4)).lr_at(12, *t.decoupled_lr, t.min_lr),
      1e-5);
  t.decoupled_lr.reset();
  t.decoupled_min_lr = 1e-5;
  testing::expect_error_containing([&] { t.validate(model); },
                                   "--decoupled-min-lr applies with --decoupled-lr");
}

TEST(DecoupledLr, OnlyTheWordEmbeddingAndOutputLayerTakeIt) {
  // A decoupled rate of 0 leaves exactly the word embedding and the (untied) output layer where
  // they started, at fp32 and at bf16 (the main parameters); a decoupled rate equal to --lr
  // trains bitwise as without one (the groups change no number).
  for (const char* precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    TransformerConfig c = testing::small_model();
    c.untie_embeddings_and_output_weights = true;
    testing::set_precision(c, precision);
    TrainingConfig t;
    t.eval_interval = 0;
    t.train_iters = 3;
    t.lr = 1e-2;
    TrainingConfig frozen = t;
    frozen.decoupled_lr = 0.0;
    frozen.decoupled_min_lr = 0.0;
    Trainer a(c, frozen);
    const at::Tensor emb = a.model().word_embeddings.detach().clone();
    const at::Tensor out = a.model().output_weight.detach().clone();
    const at::Tensor pos = a.model().position_embeddings.detach().clone();
    for (int i = 0; i < 3; ++i) a.train_step(false);
    EXPECT_TRUE(at::equal(a.model().word_embeddings, emb));
    EXPECT_TRUE(at::equal(a.model().output_weight, out));
    EXPECT_FALSE(at::equal(a.model().position_embeddings, pos));  // not in the group
    TrainingConfig same = t;
    same.decoupled_lr = t.lr;
    Trainer b(c, same), plain(c, t);
    for (int i = 0; i < 3; ++i) {
      const auto sb = b.train_step(true), sp = plain.train_step(true);
      EXPECT_EQ(sb.loss, sp.loss) << i;
      EXPECT_EQ(sb.grad_digest, sp.grad_digest) << i;
      EXPECT_EQ(*sb.decoupled_lr, sp.lr) << i;
    }
    EXPECT_TRUE(at::equal(b.model().word_embeddings, plain.model().word_embeddings));
  }
}

TEST(WeightDecay, OneDimensionalParametersAreExemptAsInMegatron) {
  // Megatron's get_standard_config_overrides (megatron/core/optimizer/__init__.py): wd_mult 0 for
  // every parameter of one dimension and every "*.bias". One step from the same start with
  // --weight-decay 0.5 and with 0: the 1-D parameters (biases, normalization weights) end bitwise
  // equal; every matrix differs by AdamW's decoupled decay, lr x wd x its starting value
  // (torch's AdamW multiplies by 1 - lr x wd before the update; the update is the same).
  for (const char* precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    TransformerConfig c = testing::small_model();
    testing::set_precision(c, precision);
    TrainingConfig t;
    t.eval_interval = 0;
    t.train_iters = 3;
    t.lr = 1e-2;
    t.lr_decay_style = "constant";
    TrainingConfig decayed = t, plain = t;
    decayed.weight_decay = 0.5;
    plain.weight_decay = 0.0;
    Trainer a(c, decayed), b(c, plain);
    // At bf16 the fp32 main parameters the optimizer steps (bf16 rounding would hide the decay).
    auto params = [](Trainer& tr) {
      return tr.mixed_precision() ? tr.mixed_precision()->main_params()
                                  : tr.model().ordered_parameters();
    };
    std::vector<at::Tensor> start;
    for (const auto& p : params(a)) start.push_back(p.detach().clone());
    const auto sa = a.train_step(true), sb = b.train_step(true);
    ASSERT_EQ(sa.grad_digest, sb.grad_digest);  // the same start, the same gradients
    const auto pa = params(a), pb = params(b);
    int64_t exempt = 0, decayed_matrices = 0;
    for (size_t i = 0; i < pa.size(); ++i) {
      if (pa[i].dim() == 1) {
        EXPECT_TRUE(at::equal(pa[i], pb[i])) << "1-D parameter " << i;
        ++exempt;
        continue;
      }
      const at::Tensor diff = pb[i] - pa[i];
      const at::Tensor want = start[i] * (t.lr * 0.5);
      const double scale = want.abs().max().item<double>();
      EXPECT_LE((diff - want).abs().max().item<double>(), 1e-3 * scale) << "matrix " << i;
      EXPECT_FALSE(at::equal(pa[i], pb[i])) << "matrix " << i;
      ++decayed_matrices;
    }
    EXPECT_GT(exempt, 0);
    EXPECT_GT(decayed_matrices, 0);
  }
}

TEST(GradReduceInBf16, MainGradsStayInBf16AndTrainTheSameModelClosely) {
  // Megatron's --grad-reduce-in-bf16 (arguments.py: with --bf16 it turns
  // accumulate_allreduce_grads_in_fp32 off): gradients accumulate and reduce in bf16 buffers.
  const std::string dir = testing::fresh_temp_dir("grad_reduce_bf16");
  const std::string model =
      " train --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
      "--micro-batch-size 2 --global-batch-size 8 --threads 1 --eval-interval 0 --train-iters 3 "
      "--bf16 --lr 1e-2 ";
  auto r = testing::run_actmem(model + "--grad-reduce-in-bf16");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("gradients accumulated in bf16"), std::string::npos) << r.output;
  // Close to fp32 buffers (bf16 sums round to 8 bits), on one process and two data-parallel ranks.
  const Curve fp32 = train_curve(model, dir + "/fp32.jsonl");
  const Curve bf16 = train_curve(model + "--grad-reduce-in-bf16", dir + "/bf16.jsonl");
  const Curve dp = train_curve("launch --nproc-per-node 2 --" + model + "--grad-reduce-in-bf16",
                               dir + "/dp.jsonl");
  ASSERT_EQ(bf16.loss.size(), 3u);
  EXPECT_NE(bf16.grad_norm, fp32.grad_norm);  // the buffers' type changed the numbers
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_NEAR(bf16.loss[i], fp32.loss[i], 2e-2 * fp32.loss[i]) << i;
    EXPECT_NEAR(bf16.grad_norm[i], fp32.grad_norm[i], 5e-2 * fp32.grad_norm[i]) << i;
    EXPECT_NEAR(dp.loss[i], bf16.loss[i], 2e-2 * bf16.loss[i]) << i;
  }
  // Exactness under it: full recompute with dropout on is bitwise the plain run.
  const Curve recompute = train_curve(model +
                                          "--grad-reduce-in-bf16 --recompute-granularity full "
                                          "--recompute-method uniform --recompute-num-layers 1",
                                      dir + "/recompute.jsonl");
  EXPECT_EQ(recompute.loss, bf16.loss);
  EXPECT_EQ(recompute.grad_norm, bf16.grad_norm);
  r = testing::run_actmem(model.substr(0, model.find("--bf16")) + "--grad-reduce-in-bf16");
  EXPECT_NE(r.stderr_text.find("--grad-reduce-in-bf16 applies to --bf16"), std::string::npos)
      << r.output;
  r = testing::run_actmem(model + "--grad-reduce-in-bf16 --accumulate-allreduce-grads-in-fp32");
  EXPECT_NE(r.stderr_text.find("contradict each other"), std::string::npos) << r.output;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace actmem
