// train_cmd.cpp — `actmem train`: train a GPT model and log each iteration.
#include "actmem/base/blas.h"
#include "actmem/base/environment.h"
#include "actmem/base/output_file.h"
#include "actmem/base/report.h"
#include "actmem/flags/presets.h"
#include "actmem/flags/train_options.h"
#include "actmem/memory/memory_tracker.h"
#include "actmem/parallel/distributed.h"
#include "actmem/parallel/distributed_optimizer.h"
#include "actmem/parallel/grad_reducer.h"
#include "actmem/parallel/tensor_parallel.h"
#include "actmem/plan/planner.h"
#include "actmem/train/plot.h"
#include "actmem/train/tensorboard.h"
#include "actmem/train/throughput.h"
#include "actmem/train/trainer.h"
#include "commands.h"

#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>

namespace actmem::cli {

namespace {

// The recompute and offload settings as one line of the header: the model's plan.
std::string memory_settings(const ActivationPlan& plan, const TrainingConfig& t) {
  std::ostringstream os;
  os << "  " << plan.summary();
  if (plan.offloads()) {
    os << ", host link ";
    if (t.offload_bandwidth_gbps > 0) {
      os << t.offload_bandwidth_gbps << " GB/s";
    } else {
      os << "uncapped";
    }
  }
  return os.str();
}

// "bf16 (fp32 main parameters and gradients, softmax in fp32, loss in fp32)".
std::string precision_summary(const actmem::TransformerConfig& m, const actmem::TrainingConfig& t) {
  std::string s = m.precision();
  if (!(m.bf16 || m.fp16)) return s;
  s += std::string(" (fp32 main parameters, gradients accumulated in ") +
       (t.fp32_main_grads(m) ? "fp32" : m.precision()) +
       (m.attention_softmax_in_fp32 ? ", softmax in fp32" : "") + ", loss in fp32";
  if (t.loss_scale) {
    s += ", loss scale " + c10::str(*t.loss_scale);
  } else if (t.dynamic_loss_scale(m)) {
    s += ", dynamic loss scale from " + c10::str(t.initial_loss_scale) + " (window " +
         std::to_string(t.loss_scale_window) + ", hysteresis " + std::to_string(t.hysteresis) + ")";
  }
  if (!m.fp8.empty()) {
    // "FP8 GEMMs (hybrid, delayed scaling: history 1024, max, margin 0)".
    s += ", FP8 GEMMs (" + m.fp8 + ", " +
         (m.fp8_recipe == "delayed"
              ? "delayed scaling: history " + std::to_string(m.fp8_amax_history_len) + ", " +
                    m.fp8_amax_compute_algo + ", margin " + std::to_string(m.fp8_margin)
              : m.fp8_recipe + " scaling") +
         (m.fp8_wgrad ? "" : ", 16-bit weight gradients") + ")";
  }
  return s + ")";
}

// "  MoE: 4 experts, top-2 softmax, ... in layers 0 2\n", or "" for a dense model.
std::string moe_summary(const actmem::TransformerConfig& m) {
  if (!m.is_moe()) return "";
  std::ostringstream os;
  const std::vector<bool> layers = m.moe_layers();
  os << "  MoE: " << m.num_moe_experts << " experts of ffn " << m.moe_ffn() << ", top-"
     << m.moe_router_topk << " " << m.moe_router_score_function
     << (m.moe_router_pre_softmax ? " (pre-softmax)" : "") << ", "
     << (m.moe_grouped_gemm ? "grouped experts" : "one MLP per expert") << ", ";
  if (m.moe_expert_capacity_factor) {
    os << "capacity factor " << *m.moe_expert_capacity_factor << " (drop by "
       << m.moe_token_drop_policy << (m.moe_pad_expert_input_to_capacity ? ", padded" : "") << ")";
  } else {
    os << "dropless";
  }
  os << " | aux loss "
     << (m.moe_router_load_balancing_type == "aux_loss" && m.moe_aux_loss_coeff > 0
             ? "coeff " + c10::str(m.moe_aux_loss_coeff)
             : std::string("off"))
     << ", z-loss "
     << (m.moe_z_loss_coeff ? "coeff " + c10::str(*m.moe_z_loss_coeff) : std::string("off"));
  if (m.moe_shared_expert_intermediate_size) {
    os << " | shared experts ffn " << *m.moe_shared_expert_intermediate_size
       << (m.moe_shared_expert_gate ? " (gated)" : "");
  }
  if (m.moe_expert_dropout > 0) os << " | expert dropout " << m.moe_expert_dropout;
  if (m.expert_model_parallel_size > 1) {
    os << " | expert parallel " << m.expert_model_parallel_size << " ranks ("
       << m.num_moe_experts / m.expert_model_parallel_size << " experts each, "
       << m.moe_token_dispatcher_type << " dispatcher)";
  }
  os << " | MoE layers";
  for (size_t i = 0; i < layers.size(); ++i) {
    if (layers[i]) os << " " << i;
  }
  os << "\n";
  return os.str();
}

// "  MLA: q_lora_rank 512, kv_lora_rank 512, ...\n", or "" for standard attention.
std::string mla_summary(const actmem::TransformerConfig& m) {
  if (!m.multi_latent_attention) {
    // Standard attention's shape switches (Qwen3, Qwen3-Next), when any is on.
    std::vector<std::string> parts;
    if (m.kv_channels_arg) parts.push_back("heads of " + std::to_string(m.kv_channels()));
    if (m.qk_layernorm) parts.push_back("q/k norms");
    if (m.attention_output_gate) parts.push_back("output gate");
    if (m.model_rope() && m.rotary_percent < 1.0) {
      parts.push_back("RoPE on " + std::to_string(m.rotary_dim()) + " of " +
                      std::to_string(m.kv_channels()) + " features");
    }
    if (m.layernorm_zero_centered_gamma) parts.push_back("zero-centred norms");
    if (parts.empty()) return "";
    return "  attention: " + c10::Join(", ", parts) + "\n";
  }
  std::ostringstream os;
  os << "  MLA: q_lora_rank " << (m.q_lora_rank ? c10::str(*m.q_lora_rank) : std::string("none"))
     << ", kv_lora_rank " << m.kv_lora_rank << ", head dims qk " << m.qk_head_dim << " + rope "
     << m.qk_pos_emb_head_dim << ", v " << m.v_head_dim << ", " << m.resolved_rope_type()
     << (m.resolved_rope_type() == "yarn" ? " (factor " + c10::str(m.rotary_scaling_factor) + ")"
                                          : "")
     << (m.qk_layernorm ? ", latent norms" : "") << "\n";
  return os.str();
}

// The optimizer state per parameter element: AdamW's two fp32 moments, and at 16 bits the fp32
// main parameter.
int64_t optimizer_bytes_per_element(const actmem::TransformerConfig& m) {
  return m.bf16 || m.fp16 ? 12 : 8;
}

void print_header(std::ostream& out, const actmem::Trainer& trainer, const actmem::TrainOptions& o,
                  actmem::GPTModel& model, std::optional<int64_t> resumed) {
  const auto& m = o.model;
  const auto& t = o.training;
  const auto& corpus = trainer.corpus();
  const actmem::GlobalBatchSchedule& batches = trainer.batch_schedule();
  // Samples of one micro-batch on every data-parallel rank.
  const int64_t per_micro = m.micro_batch_size * actmem::data_parallel_group().size;
  out << "actmem train: " << m.num_layers << " layers, hidden " << m.hidden_size << ", "
      << m.num_attention_heads << " heads"
      << (m.grouped_query_attention() ? " in " + std::to_string(m.query_groups()) + " query groups"
                                      : std::string())
      << ", ffn " << m.ffn() << ", seq " << m.seq_length << ", micro-batch " << m.micro_batch_size
      << " x "
      << (batches.stepped() ? std::to_string(batches.entries().front().batch_size / per_micro) +
                                  " to " + std::to_string(batches.largest() / per_micro) +
                                  " micro-batches (the schedule below)"
                            : std::to_string(t.num_microbatches(
                                  m.micro_batch_size, actmem::data_parallel_group().size)) +
                                  " micro-batches")
      << (actmem::data_parallel_group().size > 1
              ? " on each of " + std::to_string(actmem::data_parallel_group().size) +
                    " data-parallel ranks"
              : std::string())
      << (trainer.grad_reducer() != nullptr
              ? " (gradients in " + std::to_string(trainer.grad_reducer()->buckets()) +
                    " buckets overlapping the last backward)"
              : std::string())
      << ", " << (m.gated_linear_unit ? "SwiGLU" : "GeLU") << ", " << m.normalization << ", "
      << (m.use_rope()            ? "RoPE"
          : m.learned_positions() ? "learned positions"
                                  : "no positions")
      << (m.multi_latent_attention ? ", multi-latent attention" : "") << "\n"
      << "  attention " << m.attention_summary() << "\n"
      << "  precision " << precision_summary(m, t) << "\n";
  if (batches.stepped()) {
    // StepBatchsizeNumMicroBatchesCalculator's log: each threshold in tokens and samples, with
    // its batch size and micro-batches per data-parallel rank.
    out << "  global batch size schedule (--step-batch-size-schedule, thresholds in tokens):";
    for (const auto& e : batches.entries()) {
      out << "\n    >= " << e.from_sample * m.seq_length << " tokens (" << e.from_sample
          << " samples) -> batch size " << e.batch_size << ", "
          << (e.batch_size % per_micro == 0 ? std::to_string(e.batch_size / per_micro)
                                            : std::string("not whole"))
          << " micro-batches";
    }
    out << "\n";
  }
  if (const actmem::OptimizerShards* shards = trainer.optimizer_shards()) {
    const int64_t per_element = optimizer_bytes_per_element(m);
    out << "  distributed optimizer: this rank holds the optimizer state of "
        << shards->owned_elements() << " of " << shards->total_elements() << " elements ("
        << actmem::format_bytes(static_cast<double>(shards->owned_elements() * per_element))
        << " instead of "
        << actmem::format_bytes(static_cast<double>(shards->total_elements() * per_element)) << ", "
        << shards->buckets() << (shards->buckets() == 1 ? " bucket" : " buckets") << ")\n";
  }
  if (const auto& n = t.num_microbatches_with_partial_activation_checkpoints) {
    out << "  partial activation checkpoints: the first " << *n << " forwards of each window of "
        << "a stage's outstanding micro-batches checkpoint " << *m.recompute_num_layers
        << (*m.recompute_num_layers == 1 ? " layer" : " layers") << ", the others every layer\n";
  }
  out << "  parameters " << model.num_parameters() << " | dropout attention " << m.attention_dropout
      << " hidden " << m.hidden_dropout << " | ";
  if (corpus.train.defined()) {
    out << "corpus " << corpus.source << " (" << corpus.train.numel() << " train / "
        << corpus.valid.numel() << " validation tokens"
        << (corpus.memory_mapped ? ", memory-mapped" : "") << ")";
  } else {
    out << "data " << corpus.source << " (" << corpus.documents << " documents, "
        << corpus.sequences << " sequences, " << corpus.tokens << " tokens; "
        << corpus.train_samples << " train / " << corpus.valid_samples << " validation samples, "
        << (corpus.memory_mapped ? "memory-mapped" : "generated") << ")";
  }
  out << " | device " << t.device << " | " << at::get_num_threads() << " threads\n"
      << mla_summary(m) << moe_summary(m) << memory_settings(model.plan(), t) << "\n"
      << "  " << actmem::runtime_summary() << "\n"
      << "  " << blas_report().summary() << "\n";
  if (m.tensor_model_parallel_size > 1) {
    out << "  tensor parallel " << m.tensor_model_parallel_size << " ranks"
        << (m.sequence_parallel ? " with sequence parallelism" : "") << " | parameters per rank "
        << model.num_parameters() << " | numbers below are "
        << "rank 0's; the JSON log has every rank's memory\n";
  }
  if (resumed) {
    out << "  loaded " << actmem::checkpoint_iteration_dir(t.load, *resumed)
        << (t.finetune ? " (weights only: --finetune)" : "")
        << (t.no_load_optim && !t.finetune ? " (without the optimizer)" : "")
        << (t.no_load_rng && !t.finetune ? " (without random states)" : "")
        << "; continuing at iteration " << trainer.iteration() + 1 << ", "
        << trainer.consumed_train_samples() << " samples consumed\n";
  }
}

// The first record of the JSON log: what produced it (Megatron's habit of logging its args).
nlohmann::json config_record(const TrainOptions& o, Trainer& trainer, int world_size) {
  nlohmann::json j = {{"record", "config"}, {"command", "train"}};
  j["runtime"] = runtime_info();
  j["runtime"]["device"] = o.training.device;
  j["runtime"]["world_size"] = world_size;
  j["model"] = to_json(o.model);
  j["activation_plan"] = trainer.model().plan().to_json();
  j["training"] = to_json(trainer.config());
  j["training"]["device_memory_limit"] = o.training.device_memory_limit;
  j["no_effect_flags"] = o.no_effect_notices;
  if (const actmem::OptimizerShards* shards = trainer.optimizer_shards()) {
    // Rank 0's piece (the others differ by a bucket's padding at most).
    j["distributed_optimizer"] = {
        {"owned_elements_rank0", shards->owned_elements()},
        {"total_elements", shards->total_elements()},
        {"buckets", shards->buckets()},
        {"state_bytes_rank0", shards->owned_elements() * optimizer_bytes_per_element(o.model)},
        {"state_bytes_replicated",
         shards->total_elements() * optimizer_bytes_per_element(o.model)}};
  }
  const auto& c = trainer.corpus();
  if (c.train.defined()) {
    j["corpus"] = {{"source", c.source},
                   {"train_tokens", c.train.numel()},
                   {"validation_tokens", c.valid.numel()},
                   {"memory_mapped", c.memory_mapped}};
  } else {
    j["corpus"] = {{"source", c.source},
                   {"documents", c.documents},
                   {"sequences", c.sequences},
                   {"tokens", c.tokens},
                   {"train_samples", c.train_samples},
                   {"validation_samples", c.valid_samples},
                   {"memory_mapped", c.memory_mapped}};
  }
  return j;
}

// Note [Train under a budget]
// `train --memory-budget B` runs the planner (planner.h) on this model first, in this process,
// and trains with the strategy it chooses: the same profiling and choice as `actmem plan
// --memory-budget B`, whose flags the header then shows. One process only: under launch every
// rank would profile on its own and could choose differently.
struct BudgetOptions {
  std::string budget;  // "" = train with the flags given
  std::string costs;   // the planner's cost cache (Note [Planner cost cache])
  double costs_speed_tolerance = actmem::kCostSpeedTolerance * 100;  // percent
  bool costs_speed_tolerance_given = false;
  int finalists = actmem::kDefaultFinalists;  // Note [Plan finalists] in planner.cpp
  bool finalists_given = false;
};

void plan_for_budget(actmem::TrainOptions& o, const BudgetOptions& b, int world_size) {
  const std::string& budget_text = b.budget;
  const int64_t budget = actmem::parse_memory_budget(budget_text);
  TORCH_CHECK(world_size == 1,
              "actmem train: --memory-budget plans on one process; under launch "
              "run `actmem plan --memory-budget ",
              budget_text,
              "` once and pass the flags it "
              "prints to train");
  const actmem::TransformerConfig& m = o.model;
  TORCH_CHECK(m.recompute_granularity.empty() && !m.moe_layer_recompute &&
                  m.cpu_offloading_num_layers == 0 && !m.fine_grained_activation_offloading,
              "actmem train: --memory-budget chooses the recompute and offload flags itself; "
              "drop --recompute-granularity, --cpu-offloading-num-layers and "
              "--fine-grained-activation-offloading, or drop --memory-budget");
  bool profiled = false;  // progress lines were printed: end them
  const actmem::MeasuredPlan plan = actmem::measured_plan(
      m, o.training,
      actmem::TimedRounds::until_sure(3, actmem::kMaxProfileRounds,
                                      actmem::kDefaultProfilePrecision),
      b.costs,
      [&profiled](const std::string& line) {
        profiled = true;
        std::cerr << "\rplanning: " << line << "            " << std::flush;
      },
      b.costs_speed_tolerance / 100);
  if (profiled) std::cerr << "\n";
  if (!plan.costs_note.empty()) std::cerr << "planning: " << plan.costs_note << "\n";
  actmem::PlanEstimate chosen = actmem::choose_plan(plan.front, budget);
  if (b.finalists > 0) {
    const std::vector<actmem::PlanEstimate> finalists = actmem::timed_finalists(
        m, o.training, plan.estimates, budget, b.finalists, actmem::kDefaultFinalistSteps,
        actmem::TimedRounds::until_sure(actmem::kDefaultFinalistSteps,
                                        actmem::kDefaultMaxTimedRounds,
                                        actmem::kDefaultRatioPrecision),
        [](const std::string& line) {
          std::cerr << "\rplanning: timing the finalists, " << line << "            " << std::flush;
        });
    if (!finalists.empty()) {
      std::cerr << "\n";
      chosen = finalists.front();
    }
  }
  std::cout << "planned for a memory budget of "
            << actmem::format_bytes(static_cast<double>(budget)) << ": " << chosen.strategy.name()
            << " (predicted peak " << actmem::format_bytes(static_cast<double>(chosen.peak_bytes))
            << ", step ratio " << std::fixed << std::setprecision(3) << chosen.planned_ratio()
            << std::defaultfloat
            << (chosen.confirmed_ratio > 0  ? " measured against the plain step"
                : chosen.finalist_ratio > 0 ? " measured among the finalists"
                                            : "")
            << ")" << (chosen.strategy.plain() ? "" : "; flags: " + chosen.strategy.flags())
            << "\n";
  const std::string note = actmem::copies_in_flight_note(m, chosen.strategy);
  if (!note.empty()) std::cerr << "planning: " << note << "\n";
  o.model = chosen.strategy.apply(m);
  o.model.validate();
}

// The launch is t x d ranks (Megatron's order: tensor-parallel peers adjacent); d, the
// data-parallel size, is implied, as in Megatron.
void check_launch_layout(const actmem::TransformerConfig& m, int world_size) {
  const int t = static_cast<int>(m.tensor_model_parallel_size);
  const int e = static_cast<int>(m.expert_model_parallel_size);
  const int p = static_cast<int>(m.pipeline_model_parallel_size);
  TORCH_CHECK(world_size % t == 0, "actmem train: ", world_size,
              " process(es) but "
              "--tensor-model-parallel-size ",
              t,
              "; the launch must be a multiple of it (t x the "
              "data-parallel size): use `actmem launch --nproc-per-node ",
              t,
              " -- train ...` or a "
              "multiple");
  TORCH_CHECK(world_size % (t * p) == 0, "actmem train: ", world_size,
              " process(es) "
              "but --tensor-model-parallel-size ",
              t, " x --pipeline-model-parallel-size ", p, " = ", t * p,
              "; the launch must be a multiple of it (t x p x the data-parallel "
              "size): use `actmem launch --nproc-per-node ",
              t * p, " -- train ...` or a multiple");
  // Expert parallelism is carved out of the data-parallel ranks (parallel_layout.h).
  TORCH_CHECK(world_size % (t * e) == 0, "actmem train: ", world_size,
              " process(es) "
              "but --tensor-model-parallel-size ",
              t, " x --expert-model-parallel-size ", e, " = ", t * e,
              "; the launch must be a multiple of it: use `actmem launch "
              "--nproc-per-node ",
              t * e, " -- train ...` or a multiple");
}

// --load: the latest checkpoint's iteration, or none (a warning when the directory has none).
std::optional<int64_t> load_if_asked(Trainer& trainer, const actmem::TrainingConfig& t,
                                     bool writer) {
  if (t.load.empty()) return std::nullopt;
  const std::optional<int64_t> resumed = trainer.load_checkpoint(
      t.load, {!t.no_load_optim, !t.no_load_rng, t.finetune, t.override_opt_param_scheduler});
  if (!resumed && writer) {
    std::cerr << "warning: " << t.load << " has no " << actmem::kLatestCheckpointFile
              << "; no checkpoint loaded, training from scratch\n";
  }
  return resumed;
}

// The closing lines: the losses, the time, each stage's activations and the schedule plot.
void print_summary(std::ostream& human, const actmem::TrainOptions& o, double first_loss,
                   double last_loss, std::optional<double> last_val, double total_time,
                   int64_t steps, const actmem::IterationStats& last_stats,
                   OutputFile& schedule_plot) {
  human << std::fixed << std::setprecision(4) << "done: loss " << first_loss << " -> " << last_loss;
  if (last_val) human << " | validation loss " << *last_val;
  human << std::setprecision(1) << " | " << total_time << " s in steps ("
        << 1e3 * total_time / static_cast<double>(steps) << " ms/step)\n";
  const auto& held = last_stats.inflight_activation_bytes_per_stage;
  if (!held.empty()) {
    // 1F1B keeps min(p - stage, micro-batches) micro-batches in flight, the interleaved schedule
    // more on the first stages (docs/parallelism.md).
    // The predictor counts no offload: offloaded bytes are what separates the two then.
    human << "activations in flight per pipeline stage (measured / predicted"
          << (o.model.fine_grained_activation_offloading ? " without offload" : "") << "):";
    for (size_t i = 0; i < held.size(); ++i) {
      human << (i ? "," : "") << " stage " << i << " "
            << actmem::format_bytes(static_cast<double>(held[i])) << " / "
            << actmem::format_bytes(static_cast<double>(
                   last_stats.predicted_inflight_activation_bytes_per_stage[i]));
    }
    human << "\n";
  }
  if (schedule_plot.is_open()) {
    schedule_plot.write(
        actmem::pipeline_schedule_svg(
            last_stats.pipeline_schedule_per_stage,
            "1F1B schedule of iteration " + std::to_string(last_stats.iteration) + ", " +
                std::to_string(o.model.pipeline_model_parallel_size) + " stages"),
        "the schedule plot");
    schedule_plot.close();
    human << "pipeline schedule: " << o.pipeline_plot << "\n";
  }
}

// Refuses an output file that is one of the run's inputs or another of its outputs.
void check_train_files(const actmem::TrainOptions& o, const BudgetOptions& budget) {
  // Note [Outputs never destroy inputs] (output_file.h).
  std::vector<actmem::NamedPath> inputs{{"--data", o.training.data_path}};
  for (const auto& p : o.training.data_paths) {
    inputs.push_back({"--data-path", p + ".bin"});
    inputs.push_back({"--data-path", p + ".idx"});
  }
  check_distinct_files(inputs, {{"--log-json", o.log_json},
                                {"--trace", o.trace},
                                {"--pipeline-plot", o.pipeline_plot},
                                {"--costs", budget.costs}});
}

// Refuses the planner's flags given without the --memory-budget (or --costs) they serve.
void check_train_budget_flags(const BudgetOptions& budget) {
  TORCH_CHECK(budget.costs.empty() || !budget.budget.empty(),
              "actmem train: --costs keeps the planner's costs for --memory-budget; give both");
  TORCH_CHECK(!budget.finalists_given || !budget.budget.empty(),
              "actmem train: --finalists chooses among strategies for --memory-budget; give both");
  TORCH_CHECK(!budget.costs_speed_tolerance_given || !budget.costs.empty(),
              "actmem train: --costs-speed-tolerance checks the costs kept in --costs; give both");
}

// Opens the files rank 0 (the writer) was asked to write: the JSON log, the trace, the plot.
void open_train_outputs(const actmem::TrainOptions& o, bool writer, OutputFile& log,
                        OutputFile& trace, OutputFile& schedule_plot) {
  if (writer && !o.log_json.empty()) log = OutputFile({"--log-json", o.log_json});
  if (writer && !o.trace.empty()) trace = OutputFile({"--trace", o.trace});
  if (writer && !o.pipeline_plot.empty()) {
    schedule_plot = OutputFile({"--pipeline-plot", o.pipeline_plot});
  }
}

// Prints the notice of the Megatron flags accepted without an effect.
void print_no_effect_notices(std::ostream& human, const actmem::TrainOptions& o) {
  // One notice for the Megatron flags accepted without an effect (megatron_compat.h).
  human << "  notice: " << o.no_effect_notices.size() << " Megatron flag"
        << (o.no_effect_notices.size() == 1 ? "" : "s") << " accepted with no effect here:\n";
  for (const auto& n : o.no_effect_notices) human << "    " << n << "\n";
}

// What write_train_tensorboard keeps from one iteration to the next.
struct TrainTensorBoardState {
  double last_logged_elapsed = 0.0;
  int64_t last_logged_iteration = 0;
  int64_t max_allocated = 0;  // --log-memory-to-tensorboard's mem-max-allocated-bytes
};

// Writes an iteration's TensorBoard scalars (training_log's and evaluate_and_print_results').
void write_train_tensorboard(actmem::EventFileWriter& tensorboard, const actmem::TrainOptions& o,
                             const actmem::Trainer& trainer, int world_size,
                             TrainTensorBoardState& state, const actmem::IterationStats& st) {
  const auto& tbo = o.tensorboard;
  auto add = [&](const std::string& tag, double v) {
    tensorboard.add_scalar(tag, v, st.iteration);
    tensorboard.add_scalar(tag + " vs samples", v, st.consumed_samples);
  };
  if (tbo.log_memory) {
    // Every step's peak (the trainer resets it when a step starts, and validation after the
    // step may have reset it again), logged or not.
    state.max_allocated = std::max({state.max_allocated, st.peak_device_bytes,
                                    actmem::device_memory(trainer.device()).peak_bytes()});
  }
  if (st.iteration % tbo.log_interval == 0) {
    add("learning-rate", trainer.next_learning_rate());
    add("batch-size", static_cast<double>(st.global_batch_size));
    add("lm loss", st.loss);
    if (tbo.log_loss_scale) add("loss-scale", st.loss_scale);
    if (tbo.log_world_size) add("world-size", world_size);
    add("grad-norm", st.grad_norm);
    if (tbo.log_memory) {
      // training_log's torch.cuda.memory_stats() scalars from this rank's allocator: on CPU
      // the tracking allocator's (memory_tracker.h); the all-time peak Megatron logs is the
      // running maximum of the step peaks above.
      const actmem::DeviceMemory& mem = actmem::device_memory(trainer.device());
      tensorboard.add_scalar("mem-reserved-bytes", static_cast<double>(mem.reserved_bytes()),
                             st.iteration);
      tensorboard.add_scalar("mem-allocated-bytes", static_cast<double>(mem.current_bytes()),
                             st.iteration);
      tensorboard.add_scalar("mem-max-allocated-bytes", static_cast<double>(state.max_allocated),
                             st.iteration);
      tensorboard.add_scalar("mem-allocated-count", static_cast<double>(mem.live_allocations()),
                             st.iteration);
    }
  }
  if (tbo.log_timers && st.iteration % trainer.config().log_interval == 0) {
    // Seconds per iteration since the last log iteration (validation and saves included).
    const double seconds = (st.elapsed_s - state.last_logged_elapsed) /
                           static_cast<double>(st.iteration - state.last_logged_iteration);
    tensorboard.add_scalar("iteration-time", seconds, st.iteration);
    if (trainer.config().log_throughput) {
      // Megatron's 'throughput' (TFLOP/s per GPU there, per rank here): the model FLOPs of
      // this step's global batch (num_floating_point_operations).
      const double step_flops = actmem::megatron_model_flops(o.model, st.global_batch_size);
      tensorboard.add_scalar("throughput", actmem::tflops_per_rank(step_flops, seconds, world_size),
                             st.iteration);
    }
    state.last_logged_elapsed = st.elapsed_s;
    state.last_logged_iteration = st.iteration;
  }
  if (st.val_loss) {
    add("lm loss validation", *st.val_loss);
    if (tbo.log_validation_ppl)
      add("lm loss validation ppl", std::exp(std::min(20.0, *st.val_loss)));
  }
}

// What the closing lines report of the steps run (print_summary).
struct TrainTotals {
  double first_loss = NAN, last_loss = NAN, total_time = 0.0;
  std::optional<double> last_val;
  int64_t steps = 0;
  actmem::IterationStats last_stats;  // the per-stage memory of the last step
};

// Adds a step to the totals.
void add_train_step_to_totals(TrainTotals& totals, const actmem::IterationStats& st) {
  if (std::isnan(totals.first_loss)) totals.first_loss = st.loss;
  totals.last_loss = st.loss;
  totals.total_time += st.step_time_s;
  ++totals.steps;
  if (st.val_loss) totals.last_val = st.val_loss;
  actmem::IterationStats& last_stats = totals.last_stats;
  last_stats.inflight_activation_bytes_per_stage = st.inflight_activation_bytes_per_stage;
  last_stats.predicted_inflight_activation_bytes_per_stage =
      st.predicted_inflight_activation_bytes_per_stage;
  last_stats.iteration = st.iteration;
  last_stats.pipeline_schedule_per_stage = st.pipeline_schedule_per_stage;
}

int run_train(actmem::TrainOptions& o, const BudgetOptions& budget) {
  // With --memory-budget (or --costs, which asks for it) the planner chooses the offload the
  // offload settings apply to; a --costs without the budget is refused below with its reason.
  o.offload_planned_later = !budget.budget.empty() || !budget.costs.empty();
  o.finalize();
  actmem::apply_thread_count(o.threads);
  check_train_files(o, budget);
  // Under `actmem launch`, rank 0 alone writes the JSON log, the trace and the progress.
  const actmem::DistEnv dist = actmem::dist_env_from_environment();
  check_train_budget_flags(budget);
  if (!budget.budget.empty()) plan_for_budget(o, budget, dist.world_size);
  check_launch_layout(o.model, dist.world_size);
  o.training.device = actmem::device_for_rank(o.training.device, dist);
  // Opened before anything else runs, so an unwritable path fails now, not after the work (and,
  // under launch, before rank 0 joins its peers).
  const bool writer = dist.rank == 0;
  OutputFile log, trace, schedule_plot;
  open_train_outputs(o, writer, log, trace, schedule_plot);
  const auto& m = o.model;
  const actmem::TensorParallelSession tp_session(
      dist, c10::Device(o.training.device), static_cast<int>(m.tensor_model_parallel_size),
      static_cast<int>(m.expert_model_parallel_size),
      static_cast<int>(m.pipeline_model_parallel_size),
      distributed_timeout_from_minutes(o.distributed_timeout_minutes));
  // Every rank computes the digests when rank 0 logs them (they are gathered collectively).
  const bool digests = !o.log_json.empty();
  actmem::Trainer trainer(o.model, o.training);
  // With the JSON log on standard output, everything meant for people goes to stderr.
  std::ostream& human = log.is_stdout() ? std::cerr : std::cout;
  const std::optional<int64_t> resumed = load_if_asked(trainer, o.training, writer);
  if (writer) print_header(human, trainer, o, trainer.model(), resumed);
  if (writer && !o.no_effect_notices.empty()) print_no_effect_notices(human, o);
  if (log.is_open()) {
    log.write(config_record(o, trainer, dist.world_size).dump() + "\n", "the config record");
  }
  // Megatron's TensorBoard writer: on the last rank (_set_tensorboard_writer), the scalars of
  // training_log and evaluate_and_print_results under their tag names.
  std::unique_ptr<actmem::EventFileWriter> tensorboard;
  const auto& tbo = o.tensorboard;
  if (!tbo.dir.empty() && dist.rank == dist.world_size - 1) {
    tensorboard = std::make_unique<actmem::EventFileWriter>(tbo.dir, tbo.queue_size);
  }
  TrainTensorBoardState tensorboard_state;
  tensorboard_state.last_logged_iteration = trainer.iteration();
  TrainTotals totals;
  Trainer::RunOutput out;
  std::optional<actmem::ExitSignalHandler> signals;
  if (o.training.exit_signal_handler) {
    signals.emplace();
    out.exit_signals = &*signals;
  }
  if (writer) {
    out.progress = &human;
    out.warnings = &std::cerr;
    if (trace.is_open()) out.trace = &trace;
  }
  const int stopped_by = trainer.run(
      out,
      [&](const actmem::IterationStats& st) {
        if (tensorboard) {
          write_train_tensorboard(*tensorboard, o, trainer, dist.world_size, tensorboard_state, st);
        }
        add_train_step_to_totals(totals, st);
        if (log.is_open()) {
          // Whole lines only (Note [Whole records or nothing]).
          log.write(actmem::to_json(st).dump() + "\n", "iteration " + std::to_string(st.iteration));
        }
      },
      /*compute_digest=*/digests);
  (void)stopped_by;  // run() reported it; Megatron exits with status 0 after a signal, too
  log.close();
  if (tensorboard) tensorboard->flush();
  if (!writer) return 0;
  if (totals.steps == 0) {
    human << "done: nothing to train (iteration " << trainer.iteration() << " of --train-iters "
          << trainer.config().train_iters << ")\n";
    return 0;
  }
  print_summary(human, o, totals.first_loss, totals.last_loss, totals.last_val, totals.total_time,
                totals.steps, totals.last_stats, schedule_plot);
  if (!o.log_json.empty() && !log.is_stdout()) human << "JSON log: " << o.log_json << "\n";
  return 0;
}

}  // namespace

Runner add_train_command(CLI::App& app) {
  auto options = std::make_shared<TrainOptions>();
  CLI::App* cmd = app.add_subcommand("train", "Train a GPT model and log each iteration");
  // Expanded into its flags before parsing (src/cli/main.cpp); the option documents and checks
  // the name. The published shapes do not train on a CPU: give smaller sizes after it.
  add_preset_option(*cmd, options->preset,
                    "the flags of a named model (Megatron's flags of its published shape), which "
                    "the flags given replace (e.g. smaller sizes for a CPU run)");
  add_model_flags(*cmd, *options);
  add_training_flags(*cmd, *options);
  auto budget = std::make_shared<BudgetOptions>();
  cmd->add_option("--memory-budget", budget->budget,
                  "plan the recompute and offload flags for this many device bytes first "
                  "(as `actmem plan`; 8GiB, 7.5G, 900MiB)");
  cmd->add_option("--costs", budget->costs,
                  "with --memory-budget: the planner's cost file (as `actmem plan --costs`): "
                  "reused when it holds this model's costs, else written");
  CLI::Option* finalists = cmd->add_option(
      "--finalists", budget->finalists,
      "with --memory-budget: time this many fastest-predicted strategies that fit "
      "side by side and train the one measured fastest (0: the prediction's choice)");
  finalists->capture_default_str()->check(CLI::Range(0, 64));
  CLI::Option* tolerance =
      cmd->add_option(
             "--costs-speed-tolerance", budget->costs_speed_tolerance,
             "with --costs: percent the plain step may have moved since the profile before "
             "it is profiled again (0: not checked)")
          ->capture_default_str()
          ->check(CLI::Range(0.0, 1000.0));
  return [options, budget, cmd, tolerance, finalists]() {
    budget->costs_speed_tolerance_given = tolerance->count() > 0;
    budget->finalists_given = finalists->count() > 0;
    return cmd->parsed() ? run_train(*options, *budget) : -1;
  };
}

}  // namespace actmem::cli
