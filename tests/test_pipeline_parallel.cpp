// test_pipeline_parallel.cpp — pipeline parallelism across real processes: 1F1B and the
// interleaved schedule train like one process, every recompute and offload strategy bitwise with
// the predictor per stage, MoE stages, Megatron's rules, and the schedules train records and plots.
#include "actmem/base/digest.h"
#include "actmem/model/activation_bytes.h"
#include "actmem/parallel/distributed.h"
#include "actmem/parallel/pipeline.h"
#include "actmem/parallel/tensor_parallel.h"
#include "actmem/recompute/rng.h"
#include "actmem/train/trainer.h"
#include "parallel_workers.h"
#include "rank_models.h"
#include "test_util.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace actmem {
namespace {

using actmem::testing::expect_error_containing;
using actmem::testing::rel;
using actmem::testing::run_workers;
using nlohmann::json;

// The ranks these tests start (Note [Ranks are the test binary] in parallel_workers.cpp).
using testing::base_config;
using testing::moe_config;
using testing::moe_strategies;
using testing::strategies;

// Pipeline parallelism: three steps per recompute and fine-grained offload strategy (layer-level
// offload is refused under pipeline parallelism, as in Megatron) without gradient clipping, so the
// parameters after them depend on the gradients alone (the reported norm is computed per stage and
// summed). Each rank reports its steps, its stage, and every parameter's digest under its
// single-process name (decoder.layers.<global index>...; the last stage's copy of a tied embedding
// as output_layer.weight).
// variant moe / moe_capacity: the MoE model of run_experts (dropless / capacity factor 1, whose
// predicted bytes follow each micro-batch's routing), its experts over `ep` ranks, under
// moe_strategies().
nlohmann::json run_pipeline(int t, int pp, int ep, bool dropout, int64_t global_batch,
                            const std::string& only, const std::string& variant,
                            std::optional<int64_t> first, std::optional<int64_t> last,
                            int64_t layers, int64_t vp) {
  nlohmann::json out;
  const bool moe = variant.rfind("moe", 0) == 0;
  auto all = moe ? moe_strategies() : strategies(false, variant.rfind("mla", 0) == 0);
  // With 3 layers per stage: uniform chunks [0, 2) [2, 3) on every stage (a clamped tail).
  all.emplace_back("full_uniform_2", [](TransformerConfig& c) {
    c.recompute_granularity = "full";
    c.recompute_method = "uniform";
    c.recompute_num_layers = 2;
  });
  if (!moe) {
    // Block 1 with --num-microbatches-with-partial-activation-checkpoints 1 (set below): per
    // window of a stage's outstanding forwards the first keeps block 1's bytes, the others
    // checkpoint every layer.
    all.emplace_back("full_block_1_partial_1", [](TransformerConfig& c) {
      c.recompute_granularity = "full";
      c.recompute_method = "block";
      c.recompute_num_layers = 1;
    });
  }
  // Offload beside selective recompute, each commit waiting for its copy (the in-flight cap 0).
  all.emplace_back("offload_fine_grained_selective", [moe](TransformerConfig& c) {
    c.fine_grained_activation_offloading = true;
    c.offload_modules = {"attn_norm", "qkv_linear", "mlp_norm"};
    c.min_offloaded_tensor_size = 0;
    c.fine_grained_offloading_max_inflight_offloads = 0;
    c.recompute_granularity = "selective";
    c.recompute_modules = {"core_attn", moe ? "moe_act" : "mlp", "layernorm"};
  });
  for (const auto& [name, mutate] : all) {
    if (!only.empty() && name != only) continue;
    if (name.rfind("offload_layers", 0) == 0 || (t == 1 && name.rfind("distribute_", 0) == 0))
      continue;
    TransformerConfig c =
        moe ? moe_config(t, ep, dropout, "alltoall", variant == "moe" ? "base" : "capacity")
            : base_config(t, false, dropout, variant);
    c.num_layers = layers;
    c.pipeline_model_parallel_size = pp;
    c.decoder_first_pipeline_num_layers = first;
    c.decoder_last_pipeline_num_layers = last;
    if (vp > 1) c.num_virtual_stages_per_pipeline_rank = vp;
    mutate(c);
    // With copies still in flight at a forward's end a stage can hold what the plain run holds
    // (the MoE groups are small; the dense run did so once under load too). Each commit waits
    // for its copy, so the tests' "holds less" does not depend on the copy thread's timing.
    if (c.fine_grained_activation_offloading) c.fine_grained_offloading_max_inflight_offloads = 0;
    // n counts a model chunk's (a stage's) layers: skip what fits no chunk.
    int64_t largest = 0;
    for (int64_t stage = 0; stage < pp; ++stage) {
      for (int64_t k = 0; k < c.virtual_pipeline_size(); ++k) {
        largest = std::max(largest, c.model_chunk_layers(stage, k).count);
      }
    }
    if (c.recompute_num_layers && *c.recompute_num_layers > largest) continue;
    actmem::TrainingConfig tc;
    tc.global_batch_size = global_batch;
    tc.eval_interval = 0;
    tc.clip_grad = 0.0;
    if (name == "full_block_1_partial_1")
      tc.num_microbatches_with_partial_activation_checkpoints = 1;
    actmem::Trainer trainer(c, tc);
    nlohmann::json r;
    for (int i = 0; i < 3; ++i) {
      const actmem::IterationStats st = trainer.train_step(true);
      r["steps"].push_back(
          {{"loss", st.loss},
           {"grad_norm", st.grad_norm},
           {"grad_digest", st.grad_digest},
           {"activation_bytes", st.activation_bytes},
           {"predicted_activation_bytes", st.predicted_activation_bytes},
           {"inflight_activation_bytes", st.inflight_activation_bytes},
           {"predicted_inflight_activation_bytes", st.predicted_inflight_activation_bytes},
           {"peak_device_bytes", st.peak_device_bytes},
           {"offloaded_bytes", st.offloaded_bytes},
           {"offload_wait_s", st.offload_wait_s},
           {"host_peak_bytes", st.host_peak_bytes}});
      if (moe) {
        r["steps"].back().update({{"load_balancing_loss", st.load_balancing_loss.value_or(-1.0)},
                                  {"z_loss", st.z_loss.value_or(-1.0)},
                                  {"routed", st.moe_routed_tokens},
                                  {"dropped", st.moe_dropped_tokens},
                                  {"imbalance", st.expert_load_imbalance}});
      }
    }
    // The trainer's up-front bound for this stage (Note [Memory pre-check] in
    // activation_bytes.cpp).
    const auto& pp_group = actmem::pipeline_parallel_group();
    const int64_t n_micro =
        tc.num_microbatches(c.micro_batch_size, actmem::data_parallel_group().size);
    if (vp > 1) {
      const actmem::PipelineMemory counts = actmem::pipeline_memory(
          actmem::interleaved_schedule(pp_group.rank, pp_group.size, vp, n_micro,
                                       c.microbatch_group_size()),
          pp_group.rank, pp_group.size, std::vector<int64_t>(static_cast<size_t>(vp), 0), 0);
      r["peak_bound"] = actmem::predict_step_peak_bound(c, 0, pp_group.rank, counts.max_in_flight,
                                                        counts.max_boundary_tensors + 2);
    } else {
      r["peak_bound"] = actmem::predict_step_peak_bound(
          c, 0, pp_group.rank,
          actmem::one_f_one_b_in_flight(pp_group.rank, pp_group.size, n_micro));
    }
    const actmem::GPTModel& model = trainer.model();
    for (const auto& item : model.named_parameters()) {
      // Model chunk c's block is registered as decoder (c = 0) or decoder_vp<c>; its layers are
      // numbered from 0 within the chunk.
      std::string key = item.key();
      int64_t chunk = 0;
      if (key.rfind("decoder_vp", 0) == 0) {
        const size_t dot = key.find('.');
        chunk = std::stoll(key.substr(10, dot - 10));
        key = "decoder" + key.substr(dot);
      }
      const std::string prefix = "decoder.layers.";
      if (key.rfind(prefix, 0) == 0) {
        const size_t dot = key.find('.', prefix.size());
        key = prefix +
              std::to_string(std::stoll(key.substr(prefix.size(), dot - prefix.size())) +
                             model.stage_layers(chunk).offset) +
              key.substr(dot);
      }
      actmem::Digest d;
      d.update(item.value());
      r["params"][key] = d.hex();
    }
    int64_t stage_layers = 0;
    for (int64_t k = 0; k < model.num_model_chunks(); ++k) {
      r["chunk_offsets"].push_back(model.stage_layers(k).offset);
      stage_layers += model.stage_layers(k).count;
    }
    r["stage_offset"] = model.stage_layers(0).offset;
    r["stage_layers"] = stage_layers;
    out[name] = r;
  }
  return {{"strategies", out},
          {"pp_rank", actmem::pipeline_parallel_group().rank},
          {"tp_rank", actmem::tensor_parallel_group().rank}};
}

// --rank pipeline DIR --tp T --pp P --global-batch G [--no-dropout] [--only S] [--variant V]
// [--first N] [--last N] [--layers L (4)] [--vp V]: t x p x d ranks.
ACTMEM_RANK_SCENARIO(pipeline, [](const testing::RankOptions& o, const TensorParallelGroup& g) {
  return run_pipeline(std::max(o.tp, 1), o.pp, o.ep, o.dropout, o.global_batch, o.only, o.variant,
                      o.first_layers, o.last_layers, o.layers, o.vp);
});

const json& pipeline_run(const json& rank, const std::string& strategy) {
  return rank["pipeline"]["strategies"][strategy];
}

// Every stage's parameter digests under their single-process names (stages of one tensor rank).
std::map<std::string, std::string> merged_parameters(const std::vector<json>& ranks,
                                                     const std::string& strategy, int tp_rank) {
  std::map<std::string, std::string> all;
  for (const auto& r : ranks) {
    if (r["pipeline"]["tp_rank"].get<int>() != tp_rank) continue;
    for (const auto& [name, digest] : pipeline_run(r, strategy)["params"].items()) {
      all[name] = digest.get<std::string>();
    }
  }
  return all;
}

// After the plain runs: with untied embeddings the stages' parameters, merged under their
// single-process names, equal one process's bitwise; with a tied one, its two copies (the first
// stage's word embedding, the last stage's output layer) agree with each other.
void expect_stages_hold_one_process_parameters(const std::vector<json>& ranks,
                                               const std::vector<json>& one, int tp, bool untied,
                                               const std::string& what) {
  for (int tp_rank = 0; tp_rank < tp; ++tp_rank) {
    const auto stages = merged_parameters(ranks, "plain", tp_rank);
    const auto single = merged_parameters(one, "plain", tp_rank);
    if (untied) {
      EXPECT_EQ(stages, single) << what << ": parameters after three steps";
    } else {
      EXPECT_EQ(stages.at("embedding.word_embeddings.weight"), stages.at("output_layer.weight"))
          << what;
      EXPECT_EQ(stages.size(), single.size() + 1) << what;
    }
  }
}

// One strategy's three pipelined steps on one stage: losses, gradient digests and parameters
// bitwise those of the plain run; one micro-batch's and the in-flight bytes equal to the
// predictor; the measured peak under the trainer's up-front bound.
void expect_strategy_equals_plain_and_predicted(const json& run, const json& plain,
                                                const std::string& what) {
  for (size_t i = 0; i < 3; ++i) {
    const json& st = run["steps"][i];
    EXPECT_EQ(st["loss"], plain["steps"][i]["loss"]) << what << " step " << i;
    EXPECT_EQ(st["grad_digest"], plain["steps"][i]["grad_digest"]) << what << " step " << i;
    EXPECT_EQ(st["activation_bytes"], st["predicted_activation_bytes"]) << what << " step " << i;
    EXPECT_EQ(st["inflight_activation_bytes"], st["predicted_inflight_activation_bytes"])
        << what << " step " << i;
    EXPECT_GE(run["peak_bound"].get<double>(), st["peak_device_bytes"].get<double>())
        << what << " step " << i << ": the up-front bound";
  }
  EXPECT_EQ(run["params"], plain["params"]) << what;
}

// A fine-grained offload strategy's three pipelined steps on one stage: losses, gradient digests
// and parameters bitwise the plain run's; bytes offloaded every step; the stage holds less than
// the plain run at the schedule's peak; the measured peak under the up-front bound. With the
// in-flight cap 0 (each commit waits for its copy) and every forward of the stage offloading
// alike (`uniform`: the margin applies to all of them or to none), one forward leaves exactly the
// predictor's bytes (which count no offload) less its share of the step's offloaded bytes
// (`forwards` per step); otherwise at least that (the largest forward is one keeping its margin).
void expect_offload_equals_plain(const json& run, const json& plain, const std::string& what,
                                 bool capped, bool uniform, int64_t forwards) {
  for (size_t i = 0; i < 3; ++i) {
    const json& st = run["steps"][i];
    const json& ref = plain["steps"][i];
    EXPECT_EQ(st["loss"], ref["loss"]) << what << " step " << i;
    EXPECT_EQ(st["grad_digest"], ref["grad_digest"]) << what << " step " << i;
    const int64_t offloaded = st["offloaded_bytes"].get<int64_t>();
    EXPECT_GT(offloaded, 0) << what << " step " << i;
    EXPECT_LT(st["inflight_activation_bytes"].get<int64_t>(),
              ref["inflight_activation_bytes"].get<int64_t>())
        << what << " step " << i;
    if (capped) {
      EXPECT_EQ(offloaded % forwards, 0) << what << " step " << i;
      const int64_t expected =
          st["predicted_activation_bytes"].get<int64_t>() - offloaded / forwards;
      if (uniform) {
        EXPECT_EQ(st["activation_bytes"].get<int64_t>(), expected) << what << " step " << i;
      } else {
        EXPECT_GE(st["activation_bytes"].get<int64_t>(), expected) << what << " step " << i;
      }
    }
    EXPECT_GE(run["peak_bound"].get<double>(), st["peak_device_bytes"].get<double>())
        << what << " step " << i << ": the up-front bound";
  }
  EXPECT_EQ(run["params"], plain["params"]) << what;
}

// One stage's strategies (run_pipeline) against its plain run: recompute strategies with
// expect_strategy_equals_plain_and_predicted, offload ones with expect_offload_equals_plain
// (`forwards` per step; `uniform`: every forward keeps its margin or none; `capped`: the capped
// strategy offloads the same bytes every forward, so its bytes per forward are checked). Returns
// the strategies that ran.
std::set<std::string> expect_stage_strategies_equal_plain(const json& rank, const std::string& what,
                                                          bool capped, bool uniform,
                                                          int64_t forwards) {
  const json& plain = pipeline_run(rank, "plain");
  std::set<std::string> names;
  for (const auto& [name, run] : rank["pipeline"]["strategies"].items()) {
    names.insert(name);
    if (name.rfind("offload_", 0) == 0) {
      expect_offload_equals_plain(run, plain, what + " " + name,
                                  capped && name == "offload_fine_grained_selective", uniform,
                                  forwards);
    } else {
      expect_strategy_equals_plain_and_predicted(run, plain, what + " " + name);
    }
  }
  return names;
}

// One stage's strategies under the interleaved schedule (two chunks, four micro-batches: eight
// forwards a step): every recompute strategy whose n fits the largest chunk (full_uniform_3 does
// not) and both fine-grained offload strategies. On the first stage no forward is followed by its
// own backward; on the last, some are (they keep their margin) and some not. `equal_chunks`:
// every chunk offloads the same bytes per forward.
void expect_interleaved_strategies_equal_plain(const json& rank, const std::string& what,
                                               bool equal_chunks) {
  const int stage = rank["pipeline"]["pp_rank"].get<int>();
  const std::set<std::string> names =
      expect_stage_strategies_equal_plain(rank, what, equal_chunks, stage == 0, 8);
  EXPECT_EQ(names,
            (std::set<std::string>{"plain", "full_uniform_1", "full_uniform_2", "full_block_2",
                                   "full_block_1_partial_1", "selective_core_attn", "selective_mlp",
                                   "selective_layernorm", "selective_all", "offload_fine_grained",
                                   "offload_fine_grained_selective"}))
      << what;
}

struct PipelineCase {
  int nproc, tp, pp;
  std::vector<std::string> extra;  // uneven split flags
  std::string what;
};

TEST(Pipeline, StagesTrainBitwiseLikeOneProcessWhenUntiedAndWithinToleranceWhenTied) {
  // Without dropout (each stage draws from seed + 100 x its pipeline rank, as in Megatron, so its
  // masks differ from one process's) and without clipping, a pipeline computes what one process
  // does in the same order: each stage runs its layers on the bits the previous one sent, the
  // gradients accumulate over the micro-batches in micro-batch order (1F1B runs backwards in
  // order), and the losses are summed in micro-batch order on the last stage. With untied
  // embeddings the losses and every parameter after three steps are bitwise equal. A tied
  // embedding is not: one process accumulates its two uses micro-batch by micro-batch (output
  // layer, then embedding, then the next micro-batch), the pipeline sums each stage's share of
  // all micro-batches and adds the two (Megatron's embedding all-reduce), so the last bits differ
  // (losses within 1e-5). The gradient norm is summed per stage in double before the root: 1e-6.
  const std::vector<PipelineCase> cases = {
      {2, 1, 2, {}, "pp 2"},
      {3, 1, 3, {"--first", "2"}, "pp 3, first stage 2 layers"},
      {2, 1, 2, {"--last", "3"}, "pp 2, last stage 3 layers"},
      {4, 2, 2, {}, "tp 2 x pp 2"},
  };
  for (const std::string variant : {"swiglu", "base"}) {
    const bool untied = variant == "swiglu";
    std::map<int, std::vector<json>> reference;  // per tensor-parallel size
    for (const auto& k : cases) {
      // The tied embedding's tolerance does not depend on the layout: one case of it is enough
      // (every layout is checked bitwise untied).
      if (!untied && k.what != cases.front().what) continue;
      if (!reference.count(k.tp)) {
        reference[k.tp] = run_workers(
            k.tp, {"pipeline", "--no-dropout", "--tp", std::to_string(k.tp), "--pp", "1",
                   "--global-batch", "16", "--only", "plain", "--variant", variant});
      }
      const auto& one = reference[k.tp];
      std::vector<std::string> args = {"pipeline",       "--no-dropout",
                                       "--tp",           std::to_string(k.tp),
                                       "--pp",           std::to_string(k.pp),
                                       "--global-batch", "16",
                                       "--only",         "plain",
                                       "--variant",      variant};
      args.insert(args.end(), k.extra.begin(), k.extra.end());
      const auto ranks = run_workers(k.nproc, args);
      ASSERT_EQ(ranks.size(), static_cast<size_t>(k.nproc)) << k.what;
      const std::string what = variant + ", " + k.what;
      for (const auto& r : ranks) {
        const int tp_rank = r["pipeline"]["tp_rank"].get<int>();
        const json& ref = pipeline_run(one[static_cast<size_t>(tp_rank)], "plain")["steps"];
        const json& steps = pipeline_run(r, "plain")["steps"];
        ASSERT_EQ(steps.size(), 3u);
        for (size_t i = 0; i < 3; ++i) {
          const double a = steps[i]["loss"].get<double>(), b = ref[i]["loss"].get<double>();
          if (untied) {
            EXPECT_EQ(a, b) << what << " rank " << r["rank"] << " step " << i;
          } else {
            EXPECT_LT(rel(a, b), 1e-5) << what << " step " << i;
          }
          EXPECT_LT(rel(steps[i]["grad_norm"].get<double>(), ref[i]["grad_norm"].get<double>()),
                    1e-6)
              << what << " step " << i;
          // The trainer's up-front bound covers the stage's measured peak (an uneven first
          // stage holds more than the whole model's one micro-batch: 3 x 2 layers of 4 here).
          EXPECT_GE(pipeline_run(r, "plain")["peak_bound"].get<double>(),
                    steps[i]["peak_device_bytes"].get<double>())
              << what << " rank " << r["rank"] << " step " << i;
        }
      }
      // Layers land where Megatron's split puts them.
      int64_t layers = 0;
      for (const auto& r : ranks) {
        if (r["pipeline"]["tp_rank"].get<int>() == 0)
          layers += pipeline_run(r, "plain")["stage_layers"].get<int64_t>();
      }
      EXPECT_EQ(layers, 4) << what;
      expect_stages_hold_one_process_parameters(ranks, one, k.tp, untied, what);
    }
  }
}

TEST(Pipeline, EveryRecomputeAndOffloadStrategyBitwiseEqualsPlainAndThePredictorHoldsPerStage) {
  // Dropout on, six layers and four micro-batches on two stages (and on tensor 2 x pipeline 2):
  // every recompute and fine-grained offload strategy gives each stage the plain run's losses,
  // gradient digests and final parameters bitwise, and each stage holds what the predictor says:
  // per micro-batch its layers' bytes (the received input is the first layer's norm input; the
  // embedding on the first stage, the head and loss on the last) plus the output about to be
  // sent; at once min(p - stage, 4) micro-batches (1F1B); less what offload moved
  // (expect_offload_equals_plain).
  for (const int tp : {1, 2}) {
    const auto ranks = run_workers(2 * tp, {"pipeline", "--tp", std::to_string(tp), "--pp", "2",
                                            "--layers", "6", "--global-batch", "16"});
    ASSERT_EQ(ranks.size(), static_cast<size_t>(2 * tp));
    for (const auto& r : ranks) {
      const int stage = r["pipeline"]["pp_rank"].get<int>();
      const std::string what = "tp " + std::to_string(tp) + " rank " + r["rank"].dump() +
                               " stage " + std::to_string(stage);
      const json& plain = pipeline_run(r, "plain");
      // 1F1B: every forward of a stage keeps its margin (the last stage) or none.
      const size_t strategies = expect_stage_strategies_equal_plain(r, what, true, true, 4).size();
      EXPECT_EQ(strategies, tp == 1 ? 12u : 14u) << what;  // distribute_* need t > 1
      // Partial activation checkpoints, one per window of min(p - stage, 4) outstanding
      // forwards: block 1 (one of the stage's three layers checkpointed) for the first of each
      // window, every layer checkpointed (as full uniform 1) for the others. The first stage
      // holds one micro-batch of each at its peak; the last (a window of one) block 1's only.
      const auto bytes = [&](const std::string& name, const char* key) {
        return pipeline_run(r, name)["steps"][0][key].get<int64_t>();
      };
      const int64_t partial = bytes("full_block_1_partial_1", "activation_bytes");
      EXPECT_GT(partial, bytes("full_uniform_1", "activation_bytes")) << what;
      if (stage == 0) {
        // Each term holds the output about to be sent once: uniform 1's in-flight less its one
        // micro-batch is what the second micro-batch adds.
        EXPECT_EQ(bytes("full_block_1_partial_1", "inflight_activation_bytes"),
                  partial + bytes("full_uniform_1", "inflight_activation_bytes") -
                      bytes("full_uniform_1", "activation_bytes"))
            << what;
      } else {
        EXPECT_EQ(bytes("full_block_1_partial_1", "inflight_activation_bytes"), partial) << what;
      }
      // The first stage holds two micro-batches at its peak, the last one.
      const json& st = plain["steps"][0];
      const int64_t per = st["activation_bytes"].get<int64_t>();
      const int64_t inflight = st["inflight_activation_bytes"].get<int64_t>();
      if (stage == 0) {
        EXPECT_GT(inflight, per + per / 2) << what;
      } else {
        EXPECT_EQ(inflight, per) << what;
      }
    }
  }
}

TEST(Pipeline, RulesFollowMegatron) {
  TransformerConfig c;
  c.num_layers = 6;
  c.pipeline_model_parallel_size = 4;
  expect_error_containing(
      [&] { c.validate(); },
      "Number of layers should be divisible by the pipeline-model-parallel size");
  // Uneven splits (Megatron's get_num_layers_to_build): 3 + 1 + 1 + 1.
  c.decoder_first_pipeline_num_layers = 3;
  c.decoder_last_pipeline_num_layers = 1;
  c.validate();
  std::vector<std::pair<int64_t, int64_t>> split;
  for (int64_t stage = 0; stage < 4; ++stage) {
    const auto l = c.pipeline_stage_layers(stage);
    split.emplace_back(l.offset, l.count);
  }
  EXPECT_EQ(split, (std::vector<std::pair<int64_t, int64_t>>{{0, 3}, {3, 1}, {4, 1}, {5, 1}}));
  c.decoder_first_pipeline_num_layers = 2;
  expect_error_containing([&] { c.validate(); },
                          "number of layers at middle stage: 3 must be divisible by the middle "
                          "pipeline model parallel size 2");
  c.pipeline_model_parallel_size = 2;
  c.decoder_first_pipeline_num_layers = 3;
  c.decoder_last_pipeline_num_layers = 2;
  expect_error_containing([&] { c.validate(); },
                          "Mismatch: 1 middle layers remaining but 0 middle PP stages available");
  c.decoder_first_pipeline_num_layers = 0;
  expect_error_containing([&] { c.validate(); },
                          "num_layers_in_first_pipeline_stage must be larger than 0");
  c.decoder_first_pipeline_num_layers.reset();
  c.decoder_last_pipeline_num_layers.reset();
  // Full recompute counts each stage's layers: 3 per stage; uniform chunks restart per stage,
  // block takes the first N of every stage, and N may not exceed a stage's layers.
  c.recompute_granularity = "full";
  c.recompute_method = "uniform";
  c.recompute_num_layers = 2;
  auto chunks = [&] {
    std::vector<std::pair<int64_t, int64_t>> out;
    for (const auto& k : make_activation_plan(c).chunks) out.emplace_back(k.start, k.end);
    return out;
  };
  EXPECT_EQ(chunks(), (std::vector<std::pair<int64_t, int64_t>>{{0, 2}, {2, 3}, {3, 5}, {5, 6}}));
  c.recompute_method = "block";
  EXPECT_EQ(chunks(), (std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {1, 2}, {3, 4}, {4, 5}}));
  c.recompute_num_layers = 4;
  expect_error_containing(
      [&] { c.validate(); },
      "recompute_num_layers must be between 1 and num_layers_per_pipeline_rank: 3");
  c.recompute_granularity.clear();
  c.recompute_method.clear();
  c.recompute_num_layers.reset();
  // Megatron's refusal, and what is not built yet, refused with a clear message.
  c.cpu_offloading_num_layers = 1;
  expect_error_containing(
      [&] { c.validate(); },
      "Currently there is no support for Pipeline parallelism with CPU offloading");
  c.cpu_offloading_num_layers = 0;
  // Fine-grained offload runs under pipeline parallelism (Note [Offload under pipeline
  // schedules]); its own rules still apply.
  c.fine_grained_activation_offloading = true;
  c.offload_modules = {"core_attn"};
  EXPECT_NO_THROW(c.validate());
  c.offload_modules = {"attn_proj"};
  expect_error_containing([&] { c.validate(); },
                          "attn_proj cannot be set to offload_modules alone");
  c.fine_grained_activation_offloading = false;
  c.offload_modules.clear();
  TrainingConfig t;
  t.save = "/tmp/never";
  EXPECT_NO_THROW(t.validate(c));  // one file per stage (CheckpointCli.PipelineResume...)
  // One process is not a pipeline.
  expect_error_containing(
      [&] { GPTModel model(c); },
      "pipeline_model_parallel_size is 2 but this process is in a pipeline of 1");
  const auto launch = actmem::testing::run_actmem(
      "launch --nproc-per-node 3 -- train --pipeline-model-parallel-size 2 --num-layers 2 "
      "--train-iters 1");
  EXPECT_NE(launch.exit_code, 0);
  EXPECT_NE(launch.output.find(
                "--pipeline-model-parallel-size 2 = 2; the launch must be a multiple of it"),
            std::string::npos)
      << launch.output;
}

TEST(Pipeline, TrainUnderLaunchLogsTheLastStagesLossAndValidates) {
  // `actmem train` with two stages: rank 0 (the first stage) logs the loss the last stage
  // computed, and validation runs the forward-only schedule.
  const auto ok = actmem::testing::run_actmem(
      "launch --nproc-per-node 2 -- train --pipeline-model-parallel-size 2 --num-layers 2 "
      "--hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
      "--global-batch-size 8 --train-iters 2 --eval-interval 2 --eval-iters 2");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_NE(ok.output.find("iter 2/2 | loss "), std::string::npos) << ok.output;
  EXPECT_NE(ok.output.find("validation loss"), std::string::npos) << ok.output;
  EXPECT_EQ(ok.output.find("loss 0.0000"), std::string::npos) << ok.output;
  // Each stage's measured bytes in flight equal the prediction.
  const std::regex stage(R"(stage (\d) ([0-9.]+ [KMG]?i?B) / ([0-9.]+ [KMG]?i?B))");
  int stages = 0;
  for (std::sregex_iterator it(ok.output.begin(), ok.output.end(), stage), end; it != end; ++it) {
    EXPECT_EQ((*it)[2], (*it)[3]) << "stage " << (*it)[1] << ": " << ok.output;
    ++stages;
  }
  EXPECT_EQ(stages, 2) << ok.output;
}

TEST(Pipeline, TrainRecordsTheOneFOneBScheduleEveryStageRanAndPlotsIt) {
  // Three stages, five micro-batches: stage r runs min(p - r - 1, M) warmup forwards, then one
  // forward and one backward alternating, then the remaining backwards (Megatron's
  // forward_backward_pipelining_without_interleaving); the sequence is written here from that
  // rule, not from the trainer. On one node the stages share a clock: stage r's forward of a
  // micro-batch starts after stage r - 1's ended (it needs the activation), its backward after
  // stage r + 1's backward ended (it needs the gradient).
  const std::string dir = ::testing::TempDir();
  const std::string log = dir + "pipeline_schedule.jsonl", svg = dir + "pipeline_schedule.svg";
  const int p = 3, M = 5;
  const auto r = actmem::testing::run_actmem(
      "launch --nproc-per-node 3 -- train --pipeline-model-parallel-size 3 --num-layers 3 "
      "--hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
      "--global-batch-size 10 --train-iters 2 --eval-interval 0 --log-json " +
      log + " --pipeline-plot " + svg);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto iterations = actmem::testing::read_json_log(log).iterations;
  ASSERT_EQ(iterations.size(), 2u);
  for (const auto& it : iterations) {
    const json& stages = it["pipeline_schedule_per_stage"];
    ASSERT_EQ(stages.size(), static_cast<size_t>(p));
    for (int s = 0; s < p; ++s) {
      const int warmup = std::min(p - s - 1, M);
      std::vector<std::string> expected;
      for (int m = 0; m < warmup; ++m) expected.push_back("F" + std::to_string(m));
      for (int i = 0; i < M - warmup; ++i) {
        expected.push_back("F" + std::to_string(warmup + i));
        expected.push_back("B" + std::to_string(i));
      }
      for (int m = M - warmup; m < M; ++m) expected.push_back("B" + std::to_string(m));
      std::vector<std::string> ran;
      double previous_end = 0.0;
      for (const auto& e : stages[static_cast<size_t>(s)]) {
        ran.push_back(e["op"].get<std::string>() + std::to_string(e["microbatch"].get<int>()));
        EXPECT_GE(e["start_s"].get<double>(), previous_end) << "stage " << s << " overlaps itself";
        EXPECT_GE(e["end_s"].get<double>(), e["start_s"].get<double>());
        previous_end = e["end_s"].get<double>();
      }
      EXPECT_EQ(ran, expected) << "stage " << s;
    }
    auto find = [&](int s, const std::string& op, int m) {
      for (const auto& e : stages[static_cast<size_t>(s)]) {
        if (e["op"] == op && e["microbatch"] == m) return e;
      }
      ADD_FAILURE() << "stage " << s << " has no " << op << m;
      return json();
    };
    for (int m = 0; m < M; ++m) {
      for (int s = 1; s < p; ++s) {
        EXPECT_GT(find(s, "F", m)["start_s"].get<double>(),
                  find(s - 1, "F", m)["end_s"].get<double>())
            << "F" << m << " on stage " << s << " began before stage " << s - 1 << " sent it";
        EXPECT_GT(find(s - 1, "B", m)["start_s"].get<double>(),
                  find(s, "B", m)["end_s"].get<double>())
            << "B" << m << " on stage " << s - 1 << " began before stage " << s
            << " sent its gradient";
      }
    }
  }
  // The plot holds every box of the last step, and each row's most micro-batches in flight.
  std::ifstream in(svg);
  const std::string plot((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto count = [&](const std::string& needle) {
    size_t n = 0;
    for (size_t at = plot.find(needle); at != std::string::npos; at = plot.find(needle, at + 1))
      ++n;
    return n;
  };
  EXPECT_EQ(count("data-op=\"F\""), static_cast<size_t>(p * M));
  EXPECT_EQ(count("data-op=\"B\""), static_cast<size_t>(p * M));
  for (int s = 0; s < p; ++s) {  // 3, 2 and 1: one row each
    EXPECT_EQ(count("at most " + std::to_string(std::min(p - s, M)) + " in flight"), 1u) << s;
  }
  // Without a pipeline there is no schedule to draw.
  const auto bad = actmem::testing::run_actmem(
      "train --num-layers 1 --hidden-size 32 "
      "--num-attention-heads 2 --seq-length 16 "
      "--train-iters 1 --pipeline-plot " +
      svg + ".x");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("--pipeline-plot draws a pipeline's schedule"), std::string::npos)
      << bad.output;
}

// ---- the interleaved schedule (virtual pipeline stages) ----------------------------------------

TEST(Pipeline, InterleavedTrainsBitwiseLikeOneProcessWhenUntied) {
  // Two model chunks per stage (the model cut into p v pieces dealt round-robin): without dropout
  // each chunk runs its layers on the bits the previous piece sent, every chunk's backwards run in
  // micro-batch order (so the gradients accumulate in the single process's order) and the last
  // chunk's losses are summed in micro-batch order: losses and every parameter after three steps
  // are bitwise equal to one process's with untied embeddings; the tied embedding (chunk 0 of
  // the first stage, the last chunk of the last) agrees within 1e-5 as under 1F1B.
  struct Interleaved {
    int nproc, tp, pp, vp, layers, batch;
    std::string what;
  };
  const std::vector<Interleaved> cases = {
      {2, 1, 2, 2, 8, 16, "pp 2 x vp 2, 8 layers"},
      {3, 1, 3, 2, 6, 24, "pp 3 x vp 2, 6 layers"},
      {4, 2, 2, 2, 4, 16, "tp 2 x pp 2 x vp 2, 4 layers"},
  };
  for (const auto& k : cases) {
    for (const std::string variant : {"swiglu", "base"}) {
      if (variant == "base" && k.pp != 2) continue;
      const bool untied = variant == "swiglu";
      auto args = [&](int pp, int vp) {
        std::vector<std::string> a = {"pipeline",       "--no-dropout",
                                      "--tp",           std::to_string(k.tp),
                                      "--pp",           std::to_string(pp),
                                      "--layers",       std::to_string(k.layers),
                                      "--global-batch", std::to_string(k.batch),
                                      "--only",         "plain",
                                      "--variant",      variant};
        if (vp > 1) a.insert(a.end(), {"--vp", std::to_string(vp)});
        return a;
      };
      const auto one = run_workers(k.tp, args(1, 1));
      const auto ranks = run_workers(k.nproc, args(k.pp, k.vp));
      ASSERT_EQ(ranks.size(), static_cast<size_t>(k.nproc)) << k.what;
      const std::string what = variant + ", " + k.what;
      for (const auto& r : ranks) {
        const int tp_rank = r["pipeline"]["tp_rank"].get<int>();
        const json& ref = pipeline_run(one[static_cast<size_t>(tp_rank)], "plain")["steps"];
        const json& run = pipeline_run(r, "plain");
        ASSERT_EQ(run["steps"].size(), 3u);
        // Chunk c of stage r starts at layer c L / v + r L / (p v).
        const int per_piece = k.layers / (k.pp * k.vp);
        const int stage = r["pipeline"]["pp_rank"].get<int>();
        for (int c = 0; c < k.vp; ++c) {
          EXPECT_EQ(run["chunk_offsets"][static_cast<size_t>(c)].get<int>(),
                    c * k.layers / k.vp + stage * per_piece)
              << what;
        }
        for (size_t i = 0; i < 3; ++i) {
          const json& st = run["steps"][i];
          const double a = st["loss"].get<double>(), b = ref[i]["loss"].get<double>();
          if (untied) {
            EXPECT_EQ(a, b) << what << " rank " << r["rank"] << " step " << i;
          } else {
            EXPECT_LT(rel(a, b), 1e-5) << what << " step " << i;
          }
          EXPECT_LT(rel(st["grad_norm"].get<double>(), ref[i]["grad_norm"].get<double>()), 1e-6)
              << what << " step " << i;
          EXPECT_EQ(st["inflight_activation_bytes"], st["predicted_inflight_activation_bytes"])
              << what << " rank " << r["rank"] << " step " << i;
          EXPECT_GE(run["peak_bound"].get<double>(), st["peak_device_bytes"].get<double>())
              << what << " rank " << r["rank"] << " step " << i << ": the up-front bound";
        }
      }
      expect_stages_hold_one_process_parameters(ranks, one, k.tp, untied, what);
    }
  }
}

TEST(Pipeline,
     InterleavedEveryRecomputeAndOffloadStrategyBitwiseEqualsPlainAndThePredictorHoldsPerStage) {
  // Dropout on, eight layers on two stages of two chunks (two layers per chunk), four
  // micro-batches: every recompute strategy whose n fits a chunk, and fine-grained offload with
  // and without selective recompute (expect_offload_equals_plain), gives each stage the plain
  // run's losses, gradient digests and parameters bitwise, and each stage holds what the
  // predictor says (per chunk's micro-batch its layers' bytes, counted over the schedule's steps
  // with the queued inputs and gradients); the first stage holds more than the last.
  const auto ranks = run_workers(2, {"pipeline", "--tp", "1", "--pp", "2", "--vp", "2", "--layers",
                                     "8", "--global-batch", "16"});
  ASSERT_EQ(ranks.size(), 2u);
  std::vector<int64_t> inflight(2);
  for (const auto& r : ranks) {
    const int stage = r["pipeline"]["pp_rank"].get<int>();
    expect_interleaved_strategies_equal_plain(r, "stage " + std::to_string(stage), true);
    inflight[static_cast<size_t>(stage)] =
        pipeline_run(r, "plain")["steps"][0]["inflight_activation_bytes"].get<int64_t>();
  }
  EXPECT_GT(inflight[0], inflight[1]);
}

TEST(Pipeline, InterleavedUnevenSplitTrainsBitwiseLikeOneProcessAndThePredictorHolds) {
  // Six layers on two stages of two model chunks with a first stage of 2 layers (Megatron's
  // uneven interleaved split: stage 0 holds layers 0 and 3, stage 1 layers 1-2 and 4-5). Without
  // dropout and with untied embeddings, against one process on the same global batch: losses and
  // every parameter after three steps bitwise equal. With dropout, every recompute strategy
  // whose n fits the largest chunk and fine-grained offload bitwise equal to the plain run, and
  // each stage holds what the predictor says over the schedule (chunks of different sizes).
  const auto one =
      run_workers(1, {"pipeline", "--no-dropout", "--tp", "1", "--pp", "1", "--layers", "6",
                      "--global-batch", "16", "--only", "plain", "--variant", "swiglu"});
  const auto ranks = run_workers(
      2, {"pipeline", "--no-dropout", "--tp", "1", "--pp", "2", "--vp", "2", "--first", "2",
          "--layers", "6", "--global-batch", "16", "--only", "plain", "--variant", "swiglu"});
  ASSERT_EQ(one.size(), 1u);
  ASSERT_EQ(ranks.size(), 2u);
  const json& ref = pipeline_run(one[0], "plain")["steps"];
  for (const auto& r : ranks) {
    const json& run = pipeline_run(r, "plain");
    const int stage = r["pipeline"]["pp_rank"].get<int>();
    EXPECT_EQ(run["chunk_offsets"], stage == 0 ? json::array({0, 3}) : json::array({1, 4}));
    EXPECT_EQ(run["stage_layers"].get<int64_t>(), stage == 0 ? 2 : 4);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(run["steps"][i]["loss"], ref[i]["loss"]) << "stage " << stage << " step " << i;
    }
  }
  expect_stages_hold_one_process_parameters(ranks, one, 1, true, "uneven interleaved");

  const auto strategies = run_workers(2, {"pipeline", "--tp", "1", "--pp", "2", "--vp", "2",
                                          "--first", "2", "--layers", "6", "--global-batch", "16"});
  ASSERT_EQ(strategies.size(), 2u);
  for (const auto& r : strategies) {
    // The chunks hold one and two layers: they offload different bytes per forward.
    expect_interleaved_strategies_equal_plain(
        r, "uneven interleaved stage " + r["pipeline"]["pp_rank"].dump(), false);
  }
}

TEST(Pipeline, MoEStagesTrainLikeOneProcessAndLogEveryStagesLayers) {
  // The MoE model (4 experts, top-2, capacity factor 1: tokens are dropped) without dropout on
  // one process and split into stages: the first step computes on bitwise the same parameters
  // and inputs, so its loss, the load-balancing and z-losses averaged over all four MoE layers
  // (each stage routed its own: the log gathers them, as Megatron's tracker reduces over the
  // pipeline group) and the routed and dropped token counts are equal; the later steps within
  // 1e-5 (the tied embedding's gradient is summed in another order, see above).
  const auto one =
      run_workers(1, {"pipeline", "--no-dropout", "--tp", "1", "--pp", "1", "--global-batch", "16",
                      "--only", "plain", "--variant", "moe_capacity"});
  ASSERT_EQ(one.size(), 1u);
  const json& ref = pipeline_run(one[0], "plain")["steps"];
  ASSERT_GT(ref[0]["dropped"].get<int64_t>(), 0) << "the case needs dropped tokens";
  for (const auto& [nproc, extra] :
       std::vector<std::pair<int, std::vector<std::string>>>{{2, {}}, {3, {"--first", "2"}}}) {
    std::vector<std::string> args = {
        "pipeline",       "--no-dropout", "--tp",   "1",     "--pp",      std::to_string(nproc),
        "--global-batch", "16",           "--only", "plain", "--variant", "moe_capacity"};
    args.insert(args.end(), extra.begin(), extra.end());
    const auto ranks = run_workers(nproc, args);
    ASSERT_EQ(ranks.size(), static_cast<size_t>(nproc));
    for (const auto& r : ranks) {
      const std::string what = "pp " + std::to_string(nproc) + " rank " + r["rank"].dump();
      const json& steps = pipeline_run(r, "plain")["steps"];
      ASSERT_EQ(steps.size(), 3u);
      for (const char* key : {"loss", "load_balancing_loss", "z_loss", "routed", "dropped"}) {
        EXPECT_EQ(steps[0][key], ref[0][key]) << what << " " << key;
      }
      for (size_t i = 1; i < 3; ++i) {
        for (const char* key : {"loss", "load_balancing_loss", "z_loss"}) {
          EXPECT_LT(rel(steps[i][key].get<double>(), ref[i][key].get<double>()), 1e-5)
              << what << " " << key << " step " << i;
        }
      }
    }
  }
}

TEST(Pipeline, MoEEveryStrategyBitwiseEqualsPlainAndThePredictorFollowsEachMicroBatchsRouting) {
  // Dropout on (expert dropout too), capacity factor 1 without padding: the experts' rows, and
  // so a micro-batch's bytes, follow its routing; the predictor counts each in-flight
  // micro-batch's own (Trainer::predicted_chunk_bytes). Under 1F1B on two stages, and under the
  // interleaved schedule with the experts split over two expert-parallel ranks (p 2 x e 2, data
  // parallel 2): every MoE recompute and fine-grained offload strategy gives each stage the plain
  // run's losses, gradient digests and parameters bitwise, and each stage holds what the predictor
  // says, per micro-batch and at the schedule's peak.
  struct Case {
    int nproc;
    std::vector<std::string> extra;
    std::string what;
    bool interleaved;
  };
  for (const Case& k :
       {Case{2, {}, "pp 2", false}, Case{4,
                                         {"--ep", "2", "--vp", "2", "--global-batch", "32"},
                                         "pp 2 x ep 2 interleaved",
                                         true}}) {
    std::vector<std::string> args = {
        "pipeline", "--tp", "1", "--pp", "2", "--variant", "moe_capacity", "--global-batch", "16"};
    args.insert(args.end(), k.extra.begin(), k.extra.end());
    const auto ranks = run_workers(k.nproc, args);
    ASSERT_EQ(ranks.size(), static_cast<size_t>(k.nproc)) << k.what;
    for (const auto& r : ranks) {
      const int stage = r["pipeline"]["pp_rank"].get<int>();
      const std::string what =
          k.what + " rank " + r["rank"].dump() + " stage " + std::to_string(stage);
      const json& plain = pipeline_run(r, "plain");
      // The capped strategy offloads dense tensors (the same bytes every forward): one forward
      // leaves the predictor's bytes for its routing less its share (see the dense test). The
      // strategies: moe_strategies() with full_uniform_2 (not under the interleaved schedule: one
      // layer per chunk) and offload beside selective core_attn, moe_act and layernorm recompute.
      const size_t strategies =
          expect_stage_strategies_equal_plain(r, what, true, !k.interleaved || stage == 0,
                                              k.interleaved ? 8 : 4)
              .size();
      EXPECT_EQ(strategies, k.interleaved ? 9u : 10u) << what;
      if (stage == 0) {
        const json& st = plain["steps"][0];
        EXPECT_GT(st["inflight_activation_bytes"].get<int64_t>(),
                  st["activation_bytes"].get<int64_t>())
            << what;
      }
    }
  }
}

TEST(Pipeline, OffloadSummaryHasARowPerStage) {
  // Megatron's "Activation Offload Summary (MB)" lists every rank: here each pipeline stage's
  // warmup-step offload, gathered to the printing rank. With one layer per stage the last stage
  // keeps its only layer's groups (the margin rule: its backward follows its forward at once);
  // the first stage offloads core_attn and attn_proj.
  const auto r = actmem::testing::run_actmem(
      "launch --nproc-per-node 2 -- train --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
      "--seq-length 64 --micro-batch-size 2 --global-batch-size 8 --pipeline-model-parallel-size 2 "
      "--train-iters 2 --eval-interval 0 --fine-grained-activation-offloading --offload-modules "
      "core_attn attn_proj --min-offloaded-tensor-size 1024");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::map<std::string, std::vector<double>> rows;
  std::istringstream lines(r.output);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("pp", 0) != 0) continue;
    std::istringstream fields(line);
    std::string label;
    fields >> label;
    for (double mb; fields >> mb;) rows[label].push_back(mb);
  }
  ASSERT_EQ(rows.size(), 2u) << r.output;
  ASSERT_EQ(rows["pp0"].size(), 3u) << r.output;  // core_attn, attn_proj, total
  EXPECT_GT(rows["pp0"][0], 0.0) << r.output;
  EXPECT_GT(rows["pp0"][1], 0.0) << r.output;
  EXPECT_NEAR(rows["pp0"][2], rows["pp0"][0] + rows["pp0"][1], 0.011) << r.output;  // rounding
  EXPECT_EQ(rows["pp1"], (std::vector<double>{0.0, 0.0, 0.0})) << r.output;
}

TEST(Pipeline, InterleavedRulesFollowMegatron) {
  TransformerConfig c;
  c.num_layers = 8;
  c.pipeline_model_parallel_size = 2;
  c.num_layers_per_virtual_pipeline_stage = 3;
  expect_error_containing([&] { c.validate(); },
                          "number of layers per pipeline stage must be "
                          "divisible number of layers per virtual pipeline stage");
  c.num_layers_per_virtual_pipeline_stage = 2;
  c.validate();
  EXPECT_EQ(c.virtual_pipeline_size(), 2);
  // Chunk c of rank r: layers c L / v + r L / (p v) onwards (Megatron's offsets with a vp_stage).
  EXPECT_EQ(c.model_chunk_layers(0, 0).offset, 0);
  EXPECT_EQ(c.model_chunk_layers(1, 0).offset, 2);
  EXPECT_EQ(c.model_chunk_layers(0, 1).offset, 4);
  EXPECT_EQ(c.model_chunk_layers(1, 1).offset, 6);
  c.num_virtual_stages_per_pipeline_rank = 2;
  expect_error_containing([&] { c.validate(); }, "No more than one of the following arguments");
  c.num_virtual_stages_per_pipeline_rank.reset();
  c.decoder_first_pipeline_num_layers = 2;
  expect_error_containing([&] { c.validate(); },
                          "please use --num-virtual-stages-per-pipeline-rank");
  {
    // Uneven and interleaved (Megatron's get_transformer_layer_offset with a vp_stage): 10 layers,
    // p 3, v 2, first stage 2 and last 4 layers. Each chunk takes 1/v of its stage's layers, one
    // round of chunks holds 2/2 + 4/2 + 4/2 = 5 layers: stage 0 holds 0 and 5, stage 1 1-2 and
    // 6-7, stage 2 3-4 and 8-9 (worked by hand from Megatron's formula).
    TransformerConfig u;
    u.num_layers = 10;
    u.pipeline_model_parallel_size = 3;
    u.num_virtual_stages_per_pipeline_rank = 2;
    u.decoder_first_pipeline_num_layers = 2;
    u.decoder_last_pipeline_num_layers = 4;
    u.validate();
    std::vector<std::pair<int64_t, int64_t>> chunks;
    for (int64_t stage = 0; stage < 3; ++stage) {
      for (int64_t chunk = 0; chunk < 2; ++chunk) {
        const auto l = u.model_chunk_layers(stage, chunk);
        chunks.emplace_back(l.offset, l.count);
      }
    }
    EXPECT_EQ(chunks, (std::vector<std::pair<int64_t, int64_t>>{
                          {0, 1}, {5, 1}, {1, 2}, {6, 2}, {3, 2}, {8, 2}}));
    // recompute_num_layers counts the largest chunk's layers (2 here).
    u.recompute_granularity = "full";
    u.recompute_method = "uniform";
    u.recompute_num_layers = 3;
    expect_error_containing([&] { u.validate(); }, "num_layers_per_pipeline_rank: 2, got 3");
    u.recompute_granularity.clear();
    u.recompute_method.clear();
    u.recompute_num_layers.reset();
    // Megatron's rules: the first and last stages' layers, and each middle stage's, divide by v.
    u.decoder_first_pipeline_num_layers = 3;
    u.decoder_last_pipeline_num_layers = 3;
    expect_error_containing([&] { u.validate(); },
                            "number of layers at first stage: 3 must be "
                            "divisible by virtual pipeline parallel degree 2");
    u.decoder_first_pipeline_num_layers = 2;
    expect_error_containing([&] { u.validate(); },
                            "number of layers at last stage: 3 must be "
                            "divisible by virtual pipeline parallel degree 2");
    u.num_layers = 9;
    u.decoder_last_pipeline_num_layers = 4;
    expect_error_containing([&] { u.validate(); },
                            "number of layers on each middle pipeline rank: "
                            "3 must be divisible by virtual pipeline parallel "
                            "degree 2");
  }
  c.decoder_first_pipeline_num_layers.reset();
  c.pipeline_model_parallel_size = 1;
  expect_error_containing([&] { c.validate(); },
                          "pipeline-model-parallel size should be greater than 1");
  c.pipeline_model_parallel_size = 2;
  // recompute_num_layers counts a chunk's layers (Megatron's TransformerBlock per chunk).
  c.recompute_granularity = "full";
  c.recompute_method = "block";
  c.recompute_num_layers = 3;
  expect_error_containing([&] { c.validate(); }, "num_layers_per_pipeline_rank: 2, got 3");
  c.recompute_num_layers = 2;
  c.validate();
  c.microbatch_group_size_per_vp_stage = 1;
  expect_error_containing([&] { c.validate(); }, "should range in [PP=2 , M]");
  // The micro-batches of a step: 4 micro-batches in groups of 3 leave a group of 1 < p.
  const auto bad = actmem::testing::run_actmem(
      "launch --nproc-per-node 2 -- train --pipeline-model-parallel-size 2 "
      "--num-virtual-stages-per-pipeline-rank 2 "
      "--num-layers 4 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
      "--micro-batch-size 2 --global-batch-size 8 "
      "--microbatch-group-size-per-virtual-pipeline-stage 3 --train-iters 1");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("should be 0, or larger than or equal to the pipeline-parallel size, "
                            "but it is 1"),
            std::string::npos)
      << bad.output;
}

TEST(Pipeline, TrainRecordsTheInterleavedScheduleAndValidates) {
  // Two stages of two chunks (--num-layers-per-virtual-pipeline-stage 1 of 4 layers), four
  // micro-batches in groups of p = 2: each stage's forwards follow Megatron's table (groups of
  // p micro-batches, chunk by chunk within a group; written here from that rule), its backwards
  // the same with the chunks mirrored, the first backward after 2 (p - r - 1) + (v - 1) p warmup
  // forwards and the steady state's first forward. Each
  // forward of chunk c on stage s starts after the piece before it ended: stage s - 1's chunk c,
  // or for the first stage the last stage's chunk c - 1.
  const std::string dir = ::testing::TempDir();
  const std::string log = dir + "interleaved.jsonl", svg = dir + "interleaved.svg";
  const int p = 2, v = 2, M = 4;
  const auto r = actmem::testing::run_actmem(
      "launch --nproc-per-node 2 -- train --pipeline-model-parallel-size 2 "
      "--num-layers-per-virtual-pipeline-stage 1 --num-layers 4 --hidden-size 32 "
      "--num-attention-heads 2 --seq-length 16 --micro-batch-size 2 --global-batch-size 8 "
      "--train-iters 2 --eval-interval 2 --eval-iters 3 --log-json " +
      log + " --pipeline-plot " + svg);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("validation loss"), std::string::npos) << r.output;
  const auto iterations = actmem::testing::read_json_log(log).iterations;
  ASSERT_EQ(iterations.size(), 2u);
  std::vector<std::pair<int, int>> table;  // (micro-batch, chunk)
  for (int first = 0; first < M; first += p) {
    for (int c = 0; c < v; ++c) {
      for (int m = first; m < std::min(first + p, M); ++m) table.emplace_back(m, c);
    }
  }
  for (const auto& it : iterations) {
    const json& stages = it["pipeline_schedule_per_stage"];
    ASSERT_EQ(stages.size(), static_cast<size_t>(p));
    EXPECT_EQ(it["inflight_activation_bytes_per_stage"],
              it["predicted_inflight_activation_bytes_per_stage"]);
    auto find = [&](int s, const std::string& op, int m, int c) {
      for (const auto& e : stages[static_cast<size_t>(s)]) {
        if (e["op"] == op && e["microbatch"] == m && e["chunk"] == c) return e;
      }
      ADD_FAILURE() << "stage " << s << " has no " << op << m << " of chunk " << c;
      return json();
    };
    for (int s = 0; s < p; ++s) {
      std::vector<std::pair<int, int>> fwd, bwd;
      int warmup = -1;
      for (const auto& e : stages[static_cast<size_t>(s)]) {
        const std::pair<int, int> mc{e["microbatch"].get<int>(), e["chunk"].get<int>()};
        if (e["op"] == "F") {
          fwd.push_back(mc);
        } else {
          if (warmup < 0) warmup = static_cast<int>(fwd.size());
          bwd.emplace_back(mc.first, v - 1 - mc.second);
        }
      }
      EXPECT_EQ(fwd, table) << "stage " << s;
      EXPECT_EQ(bwd, table) << "stage " << s;
      EXPECT_EQ(warmup, std::min(2 * (p - s - 1) + (v - 1) * p + 1, M * v)) << "stage " << s;
      for (const auto& [m, c] : table) {
        if (s == 0 && c == 0) continue;
        const json before = s > 0 ? find(s - 1, "F", m, c) : find(p - 1, "F", m, c - 1);
        EXPECT_GT(find(s, "F", m, c)["start_s"].get<double>(), before["end_s"].get<double>())
            << "F" << m << " chunk " << c << " on stage " << s
            << " began before its input was sent";
      }
    }
  }
  std::ifstream in(svg);
  const std::string plot((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t boxes = 0;
  for (size_t at = plot.find("data-op="); at != std::string::npos;
       at = plot.find("data-op=", at + 1))
    ++boxes;
  EXPECT_EQ(boxes, static_cast<size_t>(2 * p * M * v));
}

}  // namespace
}  // namespace actmem
