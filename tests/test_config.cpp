// test_config.cpp — one test per TransformerConfig / TrainingConfig validation message.
#include "actmem/config/activation_plan.h"
#include "actmem/config/config.h"
#include "actmem/train/optimizer.h"
#include "actmem/train/trainer.h"
#include "test_util.h"

#include <functional>

namespace actmem {
namespace {

using actmem::testing::expect_error_containing;

struct ConfigCase {
  const char* name;
  std::function<void(TransformerConfig&)> mutate;
  const char* message;
};
inline void PrintTo(const ConfigCase& c, std::ostream* os) {
  *os << c.name;
}

class ConfigValidation : public ::testing::TestWithParam<ConfigCase> {};

TEST_P(ConfigValidation, RejectsWithClearMessage) {
  TransformerConfig c;
  c.validate();  // the default is valid
  GetParam().mutate(c);
  expect_error_containing([&] { c.validate(); }, GetParam().message);
}

INSTANTIATE_TEST_SUITE_P(
    AllMessages, ConfigValidation,
    ::testing::Values(
        ConfigCase{"num_layers", [](auto& c) { c.num_layers = 0; }, "num_layers must be positive, got 0"},
        ConfigCase{"hidden_size", [](auto& c) { c.hidden_size = -8; }, "hidden_size must be positive"},
        ConfigCase{"heads", [](auto& c) { c.num_attention_heads = 0; }, "num_attention_heads must be positive"},
        ConfigCase{"heads_divide", [](auto& c) { c.num_attention_heads = 3; }, "num_attention_heads (3) must divide hidden_size (128)"},
        ConfigCase{"ffn", [](auto& c) { c.ffn_hidden_size = -1; }, "ffn_hidden_size must be positive"},
        ConfigCase{"seq", [](auto& c) { c.seq_length = 0; }, "seq_length must be positive"},
        ConfigCase{"maxpos_neg", [](auto& c) { c.max_position_embeddings = -2; }, "max_position_embeddings must be positive"},
        ConfigCase{"maxpos_short", [](auto& c) { c.max_position_embeddings = 64; }, "max_position_embeddings (64) must be at least seq_length (128)"},
        ConfigCase{"micro_batch", [](auto& c) { c.micro_batch_size = 0; }, "micro_batch_size must be positive"},
        ConfigCase{"vocab", [](auto& c) { c.vocab_size = 0; }, "vocab_size must be positive"},
        ConfigCase{"attn_dropout_high", [](auto& c) { c.attention_dropout = 1.0; }, "attention_dropout must be in [0, 1), got 1"},
        ConfigCase{"attn_dropout_neg", [](auto& c) { c.attention_dropout = -0.1; }, "attention_dropout must be in [0, 1)"},
        ConfigCase{"hidden_dropout", [](auto& c) { c.hidden_dropout = 1.5; }, "hidden_dropout must be in [0, 1)"},
        ConfigCase{"normalization", [](auto& c) { c.normalization = "BatchNorm"; }, "normalization must be \"LayerNorm\" or \"RMSNorm\", got \"BatchNorm\""},
        ConfigCase{"eps", [](auto& c) { c.layernorm_epsilon = 0.0; }, "layernorm_epsilon must be positive"},
        ConfigCase{"position", [](auto& c) { c.position_embedding_type = "alibi"; }, "position_embedding_type must be"},
        ConfigCase{"rope_odd", [](auto& c) { c.position_embedding_type = "rope"; c.hidden_size = 12; c.num_attention_heads = 4; }, "rope needs an even head dimension"},
        ConfigCase{"rotary_base", [](auto& c) { c.rotary_base = 0.0; }, "rotary_base must be positive"},
        ConfigCase{"init_std", [](auto& c) { c.init_method_std = 0.0; }, "init_method_std must be positive"},
        ConfigCase{"tp_zero", [](auto& c) { c.tensor_model_parallel_size = 0; }, "tensor_model_parallel_size must be positive, got 0"},
        ConfigCase{"tp_heads", [](auto& c) { c.tensor_model_parallel_size = 3; c.num_attention_heads = 4; }, "num_attention_heads (4) must be divisible by tensor_model_parallel_size (3)"},
        ConfigCase{"tp_ffn", [](auto& c) { c.tensor_model_parallel_size = 2; c.ffn_hidden_size = 101; }, "ffn_hidden_size (101) must be divisible by tensor_model_parallel_size (2)"},
        ConfigCase{"sp_seq", [](auto& c) { c.tensor_model_parallel_size = 2; c.sequence_parallel = true; c.seq_length = 127; c.max_position_embeddings = 128; }, "sequence_parallel needs seq_length (127) divisible by tensor_model_parallel_size (2)"},
        ConfigCase{"distribute_sp", [](auto& c) { c.tensor_model_parallel_size = 2; c.sequence_parallel = true; c.recompute_granularity = "full"; c.recompute_method = "uniform"; c.recompute_num_layers = 1; c.distribute_saved_activations = true; }, "distribute_saved_activations: 1 must be false when sequence parallel is enabled: 1"},
        ConfigCase{"distribute_selective", [](auto& c) { c.tensor_model_parallel_size = 2; c.recompute_granularity = "selective"; c.distribute_saved_activations = true; }, "distribute_saved_activations requires recompute_granularity full with a recompute_method"},
        ConfigCase{"pp", [](auto& c) { c.num_layers = 4; c.pipeline_model_parallel_size = 3; }, "Number of layers should be divisible by the pipeline-model-parallel size (num_layers 4, pipeline size 3)"},
        ConfigCase{"sp", [](auto& c) { c.sequence_parallel = true; }, "sequence_parallel requires tensor_model_parallel_size > 1"},
        // Grouped-query attention: whole groups of heads, Megatron's tensor-parallel rule (its
        // message), and its other half (fewer groups than ranks) refused as not implemented.
        ConfigCase{"gqa_groups", [](auto& c) { c.num_query_groups = 3; }, "num_query_groups (3) must divide num_attention_heads (4)"},
        ConfigCase{"gqa_tp", [](auto& c) { c.num_attention_heads = 12; c.hidden_size = 132; c.num_query_groups = 6; c.tensor_model_parallel_size = 4; }, "num_query_groups (6) must be a multiple or divisor of tensor_model_parallel_size (4)."},
        ConfigCase{"gqa_tp_divisor", [](auto& c) { c.num_query_groups = 1; c.tensor_model_parallel_size = 2; }, "num_query_groups (1) smaller than tensor_model_parallel_size (2) is not implemented"},
        ConfigCase{"attn_backend", [](auto& c) { c.attention_backend = "sdpa"; }, "attention_backend must be one of flash, fused, unfused, local, auto (Megatron's AttnBackend), got \"sdpa\""},
        ConfigCase{"attn_backend_fused", [](auto& c) { c.attention_backend = "fused"; }, "attention_backend fused is TransformerEngine's cuDNN attention in Megatron"},
        ConfigCase{"flash_attn_dropout", [](auto& c) { c.attention_backend = "flash"; }, "attention_backend flash: the flash kernel cannot drop attention probabilities (attention_dropout 0.1); set --attention-dropout 0"},
        ConfigCase{"flash_mla", [](auto& c) { c.attention_backend = "flash"; c.attention_dropout = 0.0; c.multi_latent_attention = true; }, "attention_backend flash: multi-latent attention runs on the unfused path only"},
        ConfigCase{"gqa_mla", [](auto& c) { c.num_query_groups = 2; c.multi_latent_attention = true; }, "Group query attention is mutually exclusive with multi latent attention."},
        // Megatron's recompute rules (TransformerConfig.__post_init__), one message each.
        ConfigCase{"granularity", [](auto& c) { c.recompute_granularity = "partial"; }, "recompute_granularity: partial must be \"full\" or \"selective\"."},
        ConfigCase{"method", [](auto& c) { c.recompute_granularity = "full"; c.recompute_method = "random"; c.recompute_num_layers = 1; }, "recompute_method: random must be \"block\" or \"uniform\"."},
        ConfigCase{"full_needs_method", [](auto& c) { c.recompute_granularity = "full"; c.recompute_num_layers = 1; }, "Using recompute_granularity: full so recompute_method must be \"block\" or \"uniform\""},
        ConfigCase{"full_needs_num_layers", [](auto& c) { c.recompute_granularity = "full"; c.recompute_method = "uniform"; }, "recompute_num_layers must be between 1 and num_layers_per_pipeline_rank: 2, got none"},
        ConfigCase{"full_num_layers_range", [](auto& c) { c.recompute_granularity = "full"; c.recompute_method = "block"; c.recompute_num_layers = 3; }, "must be between 1 and num_layers_per_pipeline_rank: 2, got 3"},
        ConfigCase{"full_num_layers_zero", [](auto& c) { c.recompute_granularity = "full"; c.recompute_method = "uniform"; c.recompute_num_layers = 0; }, "got 0"},
        ConfigCase{"selective_num_layers", [](auto& c) { c.recompute_granularity = "selective"; c.recompute_num_layers = 1; }, "recompute_num_layers must be None."},
        ConfigCase{"selective_method", [](auto& c) { c.recompute_granularity = "selective"; c.recompute_method = "uniform"; }, "recompute method is not yet supported for selective recomputing granularity"},
        ConfigCase{"distribute_tp", [](auto& c) { c.recompute_granularity = "full"; c.recompute_method = "uniform"; c.recompute_num_layers = 1; c.distribute_saved_activations = true; }, "distribute_saved_activations requires tensor_model_parallel_size > 1"},
        ConfigCase{"invalid_module", [](auto& c) { c.recompute_granularity = "selective"; c.recompute_modules = std::vector<std::string>{"core_attn", "attention"}; }, "Invalid choices for recompute_modules: {'attention'}. Allowed modules are:"},
        ConfigCase{"moe_act", [](auto& c) { c.recompute_granularity = "selective"; c.recompute_modules = std::vector<std::string>{"moe_act"}; }, "moe_act in recompute_modules is only supported with moe_grouped_gemm."},
        ConfigCase{"mla_up_proj", [](auto& c) { c.recompute_granularity = "selective"; c.recompute_modules = std::vector<std::string>{"mla_up_proj"}; }, "mla_up_proj in recompute_modules is only supported with multi_latent_attention."},
        ConfigCase{"gdn_norm_out", [](auto& c) { c.recompute_granularity = "selective"; c.recompute_modules = std::vector<std::string>{"gdn_norm_out"}; }, "gdn_norm_out in recompute_modules is only supported with experimental_attention_variant='gdn' or 'gdn2'."},
        ConfigCase{"moe_dense", [](auto& c) { c.recompute_granularity = "selective"; c.recompute_modules = std::vector<std::string>{"moe"}; }, "need MoE layers, and this model is dense"},
        ConfigCase{"shared_experts_dense", [](auto& c) { c.recompute_granularity = "selective"; c.recompute_modules = std::vector<std::string>{"shared_experts"}; }, "need MoE layers"},
        ConfigCase{"modules_without_selective", [](auto& c) { c.recompute_modules = std::vector<std::string>{"mlp"}; }, "recompute_modules only applies to recompute_granularity selective"}),
    [](const auto& info) { return std::string(info.param.name); });

struct TrainingCase {
  const char* name;
  std::function<void(TrainingConfig&)> mutate;
  const char* message;
};
inline void PrintTo(const TrainingCase& c, std::ostream* os) {
  *os << c.name;
}

class TrainingValidation : public ::testing::TestWithParam<TrainingCase> {};

TEST_P(TrainingValidation, RejectsWithClearMessage) {
  TransformerConfig model;
  TrainingConfig t;
  t.validate(model);
  GetParam().mutate(t);
  expect_error_containing([&] { t.validate(model); }, GetParam().message);
}

INSTANTIATE_TEST_SUITE_P(
    AllMessages, TrainingValidation,
    ::testing::Values(
        TrainingCase{"gbs_neg", [](auto& t) { t.global_batch_size = -1; },
                     "global_batch_size must be positive"},
        TrainingCase{"gbs_multiple", [](auto& t) { t.global_batch_size = 12; },
                     "global_batch_size (12) must be a multiple of micro_batch_size (8)"},
        TrainingCase{"iters", [](auto& t) { t.train_iters = 0; }, "train_iters must be positive"},
        TrainingCase{"lr", [](auto& t) { t.lr = 0.0; }, "lr must be positive"},
        TrainingCase{"min_lr", [](auto& t) { t.min_lr = 1.0; }, "min_lr must be in [0, lr]"},
        TrainingCase{"warmup", [](auto& t) { t.lr_warmup_iters = -1; },
                     "lr_warmup_iters must be >= 0"},
        TrainingCase{"decay", [](auto& t) { t.lr_decay_style = "step"; },
                     "lr_decay_style must be constant, linear or cosine"},
        TrainingCase{"wd", [](auto& t) { t.weight_decay = -1; }, "weight_decay must be >= 0"},
        TrainingCase{"beta", [](auto& t) { t.adam_beta2 = 1.0; },
                     "adam_beta1 and adam_beta2 must be in [0, 1)"},
        TrainingCase{"eps", [](auto& t) { t.adam_eps = 0.0; }, "adam_eps must be positive"},
        TrainingCase{"clip", [](auto& t) { t.clip_grad = -1.0; }, "clip_grad must be >= 0"},
        TrainingCase{"eval_interval", [](auto& t) { t.eval_interval = -1; },
                     "eval_interval must be >= 0"},
        TrainingCase{"eval_iters", [](auto& t) { t.eval_iters = 0; },
                     "eval_iters must be positive"},
        TrainingCase{"log_interval", [](auto& t) { t.log_interval = 0; },
                     "log_interval must be positive"},
        TrainingCase{"device", [](auto& t) { t.device = "tpu"; },
                     "device must be cpu, cuda or cuda:N, got \"tpu\""},
        TrainingCase{"device_index", [](auto& t) { t.device = "cuda:x"; },
                     "device must be cpu, cuda or cuda:N"},
        TrainingCase{"mem_limit", [](auto& t) { t.device_memory_limit = -5; },
                     "device_memory_limit must be >= 0"},
        // Megatron's validate_args: the schedule's flags are of the run's kind.
        TrainingCase{"samples_decay_iters",
                     [](auto& t) {
                       t.train_samples = 64;
                       t.lr_decay_iters = 4;
                     },
                     "expected sample-based learning rate decay"},
        TrainingCase{"samples_warmup_iters",
                     [](auto& t) {
                       t.train_samples = 64;
                       t.lr_warmup_iters = 2;
                     },
                     "expected sample-based learning rate warmup"},
        TrainingCase{"samples_fraction",
                     [](auto& t) {
                       t.train_samples = 64;
                       t.lr_warmup_samples = 8;
                       t.lr_warmup_fraction = 0.1;
                     },
                     "can only specify one of lr-warmup-fraction and lr-warmup-samples"},
        TrainingCase{"iters_decay_samples", [](auto& t) { t.lr_decay_samples = 40; },
                     "expected iteration-based learning rate decay"},
        TrainingCase{"iters_warmup_samples", [](auto& t) { t.lr_warmup_samples = 8; },
                     "expected iteration-based learning rate warmup"},
        TrainingCase{"iters_fraction",
                     [](auto& t) {
                       t.lr_warmup_iters = 2;
                       t.lr_warmup_fraction = 0.1;
                     },
                     "can only specify one of lr-warmup-fraction and lr-warmup-iters"},
        TrainingCase{"warmup_init", [](auto& t) { t.lr_warmup_init = 1.0; },
                     "--lr-warmup-init must be in [0, lr]"}),
    [](const auto& info) { return std::string(info.param.name); });

// The learning rate of each step, as Megatron's OptimizerParamScheduler
// (megatron/core/optimizer_param_scheduler.py at d98e8a64dd) gives it with the steps its
// get_optimizer_param_scheduler (megatron/training/training.py) computes: the expected values
// were printed by that code, run on CPU, stepping the scheduler by the global batch (4) after
// each step and reading the learning rate each step ran with.
TEST(TrainingConfig, LearningRatesAreMegatronsOptimizerParamScheduler) {
  auto lrs = [](const TrainingConfig& base) {
    TrainingConfig t = base;
    t.global_batch_size = 4;
    t.lr = 1e-3;
    t.min_lr = 1e-4;
    t.resolve_train_iters(GlobalBatchSchedule(4));
    TransformerConfig model;
    model.micro_batch_size = 1;
    t.validate(model);
    const OptimizerParamScheduler scheduler(t, GlobalBatchSchedule(4));
    std::vector<double> out;
    for (int64_t k = 1; k <= t.train_iters; ++k) out.push_back(scheduler.lr_at(k));
    return out;
  };
  auto expect = [](const std::vector<double>& got, const std::vector<double>& want) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) EXPECT_DOUBLE_EQ(got[i], want[i]) << "step " << i + 1;
  };
  // --train-iters 12 --lr-warmup-iters 3 --lr-decay-iters 10, cosine: iteration 1 runs at lr 0
  // (the warmup starts at --lr-warmup-init), and min_lr after the decay's end.
  TrainingConfig a;
  a.train_iters = 12;
  a.lr_warmup_iters = 3;
  a.lr_decay_iters = 10;
  a.lr_decay_style = "cosine";
  expect(lrs(a), {0, 0.00033333333333333332, 0.00066666666666666664, 0.001, 0.00095543599055608857,
                  0.00083057041083643018, 0.00065013442028034147, 0.00044986557971965854,
                  0.00026942958916356994, 0.00014456400944391144, 0.0001, 0.0001});
  // --train-samples 50 (12 iterations of 4) --lr-warmup-samples 10 --lr-decay-samples 40,
  // linear.
  TrainingConfig b;
  b.train_samples = 50;
  b.lr_warmup_samples = 10;
  b.lr_decay_samples = 40;
  b.lr_decay_style = "linear";
  expect(lrs(b), {0, 0.00040000000000000002, 0.00080000000000000004, 0.00094000000000000008,
                  0.00082000000000000009, 0.0007000000000000001, 0.00058, 0.00046000000000000001,
                  0.00034000000000000002, 0.00021999999999999998, 0.0001, 0.0001});
  // --train-iters 12 --lr-warmup-fraction 0.1 (4.8 samples of a decay over the run's 48)
  // --lr-warmup-init 1e-5, cosine.
  TrainingConfig c;
  c.train_iters = 12;
  c.lr_warmup_fraction = 0.1;
  c.lr_warmup_init = 1e-5;
  c.lr_decay_style = "cosine";
  expect(lrs(c), {1.0000000000000001e-05, 0.00083499999999999991, 0.00098787019176092058,
                  0.00093971143170299754, 0.00085880873704093021, 0.00075195963109020805,
                  0.00062814167995011881, 0.00049775818864364655, 0.00037176410528237962,
                  0.00026074557564105728, 0.00017403048486417852, 0.00011890471945803});
  // OptimizerParamScheduler's assert lr_warmup_steps < lr_decay_steps, with the flags named.
  TrainingConfig d;
  d.train_iters = 3;
  d.lr_warmup_iters = 3;
  expect_error_containing([&] { lrs(d); }, "must end before the decay does");
  TrainingConfig e;
  e.train_samples = 3;
  expect_error_containing([&] { lrs(e); }, "--train-samples 3 is less than one global batch (4");
}

TEST(TrainingConfig, SampleBasedRunsFromTheCommandLine) {
  // Megatron's update_train_iters: 22 samples of 4 per step are 5 iterations (the last partial
  // batch is not run); the schedule counts samples.
  const std::string model =
      "train --num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
      "--micro-batch-size 2 --global-batch-size 4 --threads 1 --eval-interval 0 --log-interval 1 ";
  auto r = actmem::testing::run_actmem(model +
                                       "--train-samples 22 --lr-warmup-samples 4 "
                                       "--lr-decay-samples 16 --lr 1e-3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("iter 5/5 |"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("iter 6/"), std::string::npos) << r.output;
  r = actmem::testing::run_actmem(model + "--train-samples 22 --train-iters 5");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.stderr_text.find("expected sample-based training"), std::string::npos) << r.output;
  r = actmem::testing::run_actmem(model + "--train-iters 5 --lr-decay-samples 16");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.stderr_text.find("expected iteration-based learning rate decay"), std::string::npos)
      << r.output;
}

TEST(TrainingConfig, PartialActivationCheckpointsNeedAPipelineAndBlockRecompute) {
  // --num-microbatches-with-partial-activation-checkpoints picks, per micro-batch of a pipeline
  // schedule, between the block plan and every layer checkpointed: refused where it would change
  // nothing (Megatron's mcore GPT ignores it everywhere) or meet offload (not implemented).
  TransformerConfig model;
  TrainingConfig t;
  t.num_microbatches_with_partial_activation_checkpoints = 1;
  expect_error_containing([&] { t.validate(model); }, "applies to the pipeline schedules");
  model.pipeline_model_parallel_size = 2;
  expect_error_containing([&] { t.validate(model); },
                          "needs --recompute-granularity full --recompute-method block");
  model.recompute_granularity = "full";
  model.recompute_method = "uniform";
  model.recompute_num_layers = 1;
  expect_error_containing([&] { t.validate(model); },
                          "needs --recompute-granularity full --recompute-method block");
  model.recompute_method = "block";
  t.validate(model);
  model.fine_grained_activation_offloading = true;
  expect_error_containing([&] { t.validate(model); },
                          "together with activation offload is not implemented");
  model.fine_grained_activation_offloading = false;
  t.num_microbatches_with_partial_activation_checkpoints = -1;
  expect_error_containing([&] { t.validate(model); }, "must be >= 0, got -1");
}

TEST(TransformerConfig, RecomputeDefaultsFollowMegatron) {
  // The plan is the resolved form of the recompute flags (Note [One plan]).
  TransformerConfig c;
  auto recomputes = [&c](RecomputeModule m) { return make_activation_plan(c).recomputes(m); };
  EXPECT_FALSE(recomputes(RecomputeModule::kCoreAttn));  // no granularity: nothing recomputed
  c.recompute_granularity = "selective";
  c.validate();
  EXPECT_TRUE(
      recomputes(RecomputeModule::kCoreAttn));  // recompute_modules defaults to {"core_attn"}
  EXPECT_FALSE(recomputes(RecomputeModule::kMlp));
  c.recompute_modules = std::vector<std::string>{"mlp", "layernorm"};
  c.validate();
  EXPECT_FALSE(recomputes(RecomputeModule::kCoreAttn));
  EXPECT_TRUE(recomputes(RecomputeModule::kLayernorm));
  c.recompute_modules.reset();
  c.recompute_granularity = "full";
  c.recompute_method = "uniform";
  c.recompute_num_layers = 2;
  c.validate();
  EXPECT_TRUE(make_activation_plan(c).full_recompute());
  EXPECT_FALSE(recomputes(RecomputeModule::kCoreAttn));
}

TEST(TransformerConfig, DefaultsResolve) {
  TransformerConfig c;
  EXPECT_EQ(c.ffn(), 4 * c.hidden_size);
  EXPECT_EQ(c.max_positions(), c.seq_length);
  c.ffn_hidden_size = 300;
  c.max_position_embeddings = 512;
  EXPECT_EQ(c.ffn(), 300);
  EXPECT_EQ(c.max_positions(), 512);
  EXPECT_EQ(c.kv_channels(), c.hidden_size / c.num_attention_heads);
}

}  // namespace
}  // namespace actmem
