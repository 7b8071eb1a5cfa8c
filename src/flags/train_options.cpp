// train_options.cpp — CLI11 bindings for the training flags (the model's are model_flags.cpp's),
// the flag groups put together, the thread count and TrainOptions::finalize.
#include "actmem/flags/train_options.h"

#include "actmem/flags/megatron_compat.h"
#include "actmem/parallel/distributed.h"
#include "flag_groups.h"

#include "actmem/base/blas.h"
#include "actmem/base/environment.h"
#include "actmem/config/activation_plan.h"
#include "actmem/data/tokenizer.h"

#include <CLI/CLI.hpp>

#include <ATen/Parallel.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <thread>

namespace actmem {

namespace {
// CLI11's own checks accept "inf" as a positive number and let integers wrap or saturate; these
// say what is expected and refuse both.
// A finite number above zero, or at least zero.
CLI::Validator finite_number(bool zero_allowed) {
  const std::string expected = zero_allowed ? "a non-negative number" : "a positive number";
  return CLI::Validator(
      [zero_allowed, expected](std::string& text) -> std::string {
        double v = 0.0;
        if (!CLI::detail::lexical_cast(text, v) || !std::isfinite(v) || v < 0.0 ||
            (v == 0.0 && !zero_allowed)) {
          return "expected " + expected + ", got '" + text + "'";
        }
        return {};
      },
      zero_allowed ? "NONNEGATIVE" : "POSITIVE");
}
}  // namespace

const CLI::Validator& positive_number_validator() {
  static const CLI::Validator positive = finite_number(false);
  return positive;
}

namespace flags_detail {
const CLI::Validator& non_negative_number_validator() {
  static const CLI::Validator non_negative = finite_number(true);
  return non_negative;
}
}  // namespace flags_detail

CLI::Validator integer_in_range(int64_t lo, int64_t hi) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        int64_t v = 0;
        const char* last = text.data() + text.size();
        const auto [end, ec] = std::from_chars(text.data(), last, v);
        if (ec == std::errc() && end != last) return "expected an integer, got '" + text + "'";
        if (ec == std::errc() && v >= lo && v <= hi) return {};
        if (ec != std::errc::result_out_of_range && hi == kMax && (lo == 0 || lo == 1)) {
          return std::string(lo == 1 ? "expected a positive number, got '"
                                     : "expected a non-negative number, got '") +
                 text + "'";
        }
        return "expected an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
               "], got '" + text + "'";
      },
      "INT in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
}

using namespace flags_detail;  // NOLINT: this layer's own flag groups (flag_groups.h)

namespace {
const CLI::Validator& kPositive = positive_number_validator();
const CLI::Validator& kNonNegative = non_negative_number_validator();

void add_optimizer_flags(CLI::App& app, TrainOptions& o) {
  auto& t = o.training;
  // Data parallelism's gradient reduction (docs/parallelism.md, "Data parallelism").
  app.add_flag("--overlap-grad-reduce", t.overlap_grad_reduce,
               "Reduce data-parallel gradients in buckets that start during the last backward");
  app.add_option_function<int64_t>(
         "--ddp-bucket-size", [&t](const int64_t& n) { t.ddp_bucket_size = n; },
         "Elements per gradient bucket with --overlap-grad-reduce (default max(40M, 1M x d))")
      ->check(integer_in_range(1, kMaxInt));
  app.add_flag("--use-distributed-optimizer", t.use_distributed_optimizer,
               "Shard the optimizer state (AdamW's moments, fp32 main parameters) over the "
               "data-parallel ranks");
  app.add_option("--global-batch-size", t.global_batch_size,
                 "Samples per optimizer step (a multiple of --micro-batch-size)")
      ->capture_default_str()
      ->check(integer_in_range(1, kMaxInt));
  app.add_option("--lr", t.lr, "Peak learning rate")->capture_default_str()->check(kPositive);
  app.add_option("--min-lr", t.min_lr, "Learning rate at the end of decay")
      ->capture_default_str()
      ->check(kNonNegative);
  // The schedule as Megatron's get_optimizer_param_scheduler builds it (counted in samples;
  // docs/train.md, "Learning-rate schedule").
  app.add_option("--lr-warmup-iters", t.lr_warmup_iters,
                 "Linear warmup steps (iteration-based runs)")
      ->capture_default_str()
      ->check(integer_in_range(0, kMaxInt));
  app.add_option("--lr-warmup-samples", t.lr_warmup_samples,
                 "Linear warmup samples (with --train-samples)")
      ->capture_default_str()
      ->check(integer_in_range(0, int64_t{1} << 62));
  app.add_option_function<double>(
         "--lr-warmup-fraction", [&t](const double& v) { t.lr_warmup_fraction = v; },
         "Warmup as a fraction of the decay (instead of --lr-warmup-iters/-samples)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--lr-warmup-init", t.lr_warmup_init, "Learning rate the warmup starts from")
      ->capture_default_str()
      ->check(kNonNegative);
  app.add_option_function<int64_t>(
         "--lr-decay-iters", [&t](const int64_t& v) { t.lr_decay_iters = v; },
         "Iterations over which the rate decays to --min-lr (default --train-iters)")
      ->check(integer_in_range(1, kMaxInt));
  app.add_option_function<int64_t>(
         "--lr-decay-samples", [&t](const int64_t& v) { t.lr_decay_samples = v; },
         "Samples over which the rate decays to --min-lr (default --train-samples)")
      ->check(integer_in_range(1, int64_t{1} << 62));
  app.add_option("--lr-decay-style", t.lr_decay_style, "constant, linear or cosine")
      ->capture_default_str()
      ->check(CLI::IsMember({"constant", "linear", "cosine"}));
  app.add_option("--weight-decay", t.weight_decay, "AdamW weight decay")
      ->capture_default_str()
      ->check(kNonNegative);
  app.add_option("--adam-beta1", t.adam_beta1, "AdamW beta1")->capture_default_str();
  app.add_option("--adam-beta2", t.adam_beta2, "AdamW beta2")->capture_default_str();
  app.add_option("--adam-eps", t.adam_eps, "AdamW epsilon")
      ->capture_default_str()
      ->check(kPositive);
  app.add_option_function<double>(
         "--decoupled-lr", [&t](const double& v) { t.decoupled_lr = v; },
         "Peak learning rate of the word embedding and output layer (Megatron's; the same "
         "warmup and decay as --lr)")
      ->check(CLI::NonNegativeNumber);
  app.add_option_function<double>(
         "--decoupled-min-lr", [&t](const double& v) { t.decoupled_min_lr = v; },
         "Their final learning rate (default --min-lr; applies with --decoupled-lr)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--calculate-per-token-loss", t.calculate_per_token_loss,
               "Gradients of the loss summed over tokens, divided by the step's tokens over every "
               "micro-batch and data-parallel rank (Megatron's per-token loss; the default "
               "averages each micro-batch's token mean)");
  app.add_option("--clip-grad", t.clip_grad, "Global gradient-norm clip (0 = off)")
      ->capture_default_str()
      ->check(kNonNegative);
  // Mixed precision (docs/mixed-precision.md).
  app.add_flag_function(
      "--accumulate-allreduce-grads-in-fp32",
      [&t](int64_t) { t.accumulate_allreduce_grads_in_fp32 = true; },
      "Accumulate and reduce gradients in fp32 main-grad buffers (on with --bf16 unless "
      "--grad-reduce-in-bf16)");
  app.add_flag("--grad-reduce-in-bf16", t.grad_reduce_in_bf16,
               "With --bf16: accumulate and reduce gradients in bf16 main-grad buffers "
               "(Megatron's; halves their memory and the reduction's bytes)");
  app.add_option_function<double>(
         "--loss-scale", [&t](const double& v) { t.loss_scale = v; },
         "Constant loss scale (16-bit runs; default: dynamic with --fp16, none with --bf16)")
      ->check(kPositive);
  auto dynamic = [&o](const char* flag) { return [&o, flag] { o.dynamic_scaling_flag = flag; }; };
  app.add_option("--initial-loss-scale", t.initial_loss_scale, "Dynamic loss scale: start value")
      ->capture_default_str()
      ->check(kPositive)
      ->each([f = dynamic("--initial-loss-scale")](const std::string&) { f(); });
  app.add_option("--min-loss-scale", t.min_loss_scale, "Dynamic loss scale: lower bound")
      ->capture_default_str()
      ->check(kPositive)
      ->each([f = dynamic("--min-loss-scale")](const std::string&) { f(); });
  app.add_option("--loss-scale-window", t.loss_scale_window,
                 "Dynamic loss scale: steps without overflow before it doubles")
      ->capture_default_str()
      ->check(integer_in_range(1, kMaxInt))
      ->each([f = dynamic("--loss-scale-window")](const std::string&) { f(); });
  app.add_option("--hysteresis", t.hysteresis,
                 "Dynamic loss scale: overflows tolerated before it halves")
      ->capture_default_str()
      ->check(integer_in_range(1, kMaxInt))
      ->each([f = dynamic("--hysteresis")](const std::string&) { f(); });
}

void add_schedule_flags(CLI::App& app, TrainOptions& o) {
  auto& t = o.training;
  // A train flag only: plan and compare measure one global batch (--global-batch-size).
  app.add_option("--step-batch-size-schedule", t.step_batch_size_schedule,
                 "Megatron's step-wise global batch size: \"THRESHOLD:BS THRESHOLD:BS ...\", "
                 "thresholds in tokens consumed, K/M/B/T suffixes (\"0:256 250B:512\"); "
                 "instead of --global-batch-size (docs/train.md)");
  app.add_option("--train-iters", t.train_iters, "Optimizer steps")
      ->capture_default_str()
      ->check(integer_in_range(1, kMaxInt))
      ->each([&o](const std::string&) { o.train_iters_given = true; });
  app.add_option_function<int64_t>(
         "--train-samples", [&t](const int64_t& v) { t.train_samples = v; },
         "Train on this many samples (iterations = samples / global batch; the schedule then "
         "counts samples: --lr-warmup-samples, --lr-decay-samples)")
      ->check(integer_in_range(1, int64_t{1} << 62));
  app.add_option("--eval-interval", t.eval_interval, "Validate every N steps (0 = never)")
      ->capture_default_str()
      ->check(integer_in_range(0, kMaxInt));
  app.add_option("--eval-iters", t.eval_iters, "Validation micro-batches")
      ->capture_default_str()
      ->check(integer_in_range(1, kMaxInt));
  app.add_flag("--log-throughput", t.log_throughput,
               "Add the model's TFLOP/s per rank to each progress line (Megatron's "
               "num_floating_point_operations; recompute not counted)");
  app.add_option("--log-interval", t.log_interval, "Progress line every N steps")
      ->capture_default_str()
      ->check(integer_in_range(1, kMaxInt));
}

void add_data_flags(CLI::App& app, TrainOptions& o) {
  auto& t = o.training;
  app.add_option("--data", t.data_path, "Text file to train on (default: built-in corpus)");
  app.add_option("--data-path", t.data_paths,
                 "Megatron indexed dataset(s): PREFIX (PREFIX.bin + PREFIX.idx), or weight-prefix "
                 "pairs for a blend (0.3 A 0.7 B)")
      ->expected(1, -1);
  app.add_option("--tokenizer-type", t.tokenizer_type,
                 "Tokenizer the --data-path data was made with: ByteTokenizer, "
                 "SentencePieceTokenizer (Megatron's spellings GPTSentencePieceTokenizer and "
                 "Llama2Tokenizer too), GPT2BPETokenizer (--vocab-file, --merge-file), "
                 "TikTokenizer (--tokenizer-model V.json), HuggingFaceTokenizer (--tokenizer-model "
                 "DIR, a local byte-level BPE tokenizer.json) or NullTokenizer with --vocab-size "
                 "(sets the vocabulary)")
      ->check(CLI::IsMember({"ByteTokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                             "Llama2Tokenizer", "GPT2BPETokenizer", "TikTokenizer",
                             "HuggingFaceTokenizer", "NullTokenizer"}));
  app.add_option("--tokenizer-model", t.tokenizer_model,
                 "SentencePiece model file (M.model), TikTokenizer's vocabulary (V.json) or "
                 "HuggingFaceTokenizer's directory (tokenizer.json)");
  app.add_option("--tiktoken-pattern", t.tiktoken_pattern,
                 "TikTokenizer's pre-tokenizing pattern (default v2; Megatron reads it for no "
                 "other tokenizer)")
      ->check(CLI::IsMember({"v1", "v2"}));
  app.add_option("--tiktoken-num-special-tokens", t.tiktoken_num_special_tokens,
                 "TikTokenizer's special ids before the vocabulary's")
      ->capture_default_str()
      ->check(integer_in_range(7, kMaxInt));
  app.add_option("--tokenizer-special-tokens", t.special_tokens,
                 "TikTokenizer's special tokens (default <unk> <s> </s> <mask> <pad> <cls> <sep>)")
      ->expected(1, -1);
  app.add_option("--vocab-file", t.vocab_file,
                 "GPT2BPETokenizer's vocab.json (with --merge-file; without --tokenizer-type they "
                 "choose GPT2BPETokenizer, pretrain_gpt.py's default)");
  app.add_option("--merge-file", t.merge_file, "GPT2BPETokenizer's merges.txt (with --vocab-file)");
  app.add_option(
         "--make-vocab-size-divisible-by", t.make_vocab_size_divisible_by,
         "Pad the tokenizer's vocabulary to a multiple of this (times the tensor-parallel size)")
      ->capture_default_str()
      ->check(integer_in_range(1, 1 << 20));
  app.add_option(
      "--data-cache-path", t.data_cache_path,
      "Where --data-path caches its sample indices (default: PREFIX/cache/GPTDataset_indices; "
      "--mock-data caches only here)");
  app.add_flag(
      "--mock-data", t.mock_data,
      "Train on Megatron's MockGPTDataset: 100000 generated documents [1, 2, ..., L-1, eod] "
      "with lengths from numpy's default_rng(0), the same samples Megatron's --mock-data "
      "gives (needs --tokenizer-type; --split is 1,1,1 as in Megatron)");
  app.add_option("--split", t.split,
                 "train,validation[,test] weights (Megatron's default; --data-path cuts its "
                 "sequences as Megatron does, --data and the built-in corpus their tokens)")
      ->capture_default_str();
}

void add_runtime_flags(CLI::App& app, TrainOptions& o) {
  auto& t = o.training;
  app.add_option("--device", t.device, "cpu or cuda[:i]")->capture_default_str();
  app.add_option("--device-memory-limit", o.device_memory_limit_gib,
                 "Device memory limit in GiB (CPU; default: physical memory)")
      ->check(kPositive);
  app.add_option(
         "--threads", o.threads,
         "Intra-op CPU threads, at most the cores available (default: OMP_NUM_THREADS when set, "
         "else one per core; `actmem launch` sets it to the cores / its workers)")
      ->check(integer_in_range(1, 1 << 20));
}

void add_output_flags(CLI::App& app, TrainOptions& o) {
  app.add_option("--log-json", o.log_json,
                 "Write the run's configuration, then one JSON object per iteration, to FILE "
                 "('-': standard output)");
  app.add_option("--trace", o.trace,
                 "Write a Chrome trace (Perfetto) of iteration 2: compute and copy streams");
  // Megatron's TensorBoard scalars under its tag names (docs/train.md, "TensorBoard").
  auto& tb = o.tensorboard;
  app.add_option("--tensorboard-dir", tb.dir,
                 "Write TensorBoard event files to DIR (the last rank, as Megatron)");
  app.add_option("--tensorboard-log-interval", tb.log_interval,
                 "TensorBoard scalars every N iterations")
      ->capture_default_str()
      ->check(integer_in_range(1, kMaxInt));
  app.add_option("--tensorboard-queue-size", tb.queue_size,
                 "Events buffered before the event file is flushed")
      ->capture_default_str()
      ->check(integer_in_range(1, kMaxInt));
  app.add_flag("--log-timers-to-tensorboard", tb.log_timers,
               "Also iteration-time (seconds per iteration, on log iterations)");
  app.add_flag("--log-validation-ppl-to-tensorboard", tb.log_validation_ppl,
               "Also the validation perplexity");
  app.add_flag("--log-world-size-to-tensorboard", tb.log_world_size, "Also the world size");
  app.add_flag("--log-memory-to-tensorboard", tb.log_memory,
               "Also the allocator's mem-reserved-bytes, mem-allocated-bytes, "
               "mem-max-allocated-bytes and mem-allocated-count (the last rank's)");
  app.add_flag("!--no-log-loss-scale-to-tensorboard,!--disable-log-loss-scale-to-tensorboard",
               tb.log_loss_scale, "Leave out loss-scale");
  app.add_option("--pipeline-plot", o.pipeline_plot,
                 "With pipeline parallelism: write the last step's schedule (every stage's "
                 "forwards and backwards on one time axis) as SVG to FILE");
}
void add_checkpoint_flags(CLI::App& app, TrainOptions& o) {
  auto& t = o.training;
  // Checkpoints in Megatron's layout (docs/checkpoints.md).
  app.add_option("--save", t.save, "Directory to save checkpoints in (iter_NNNNNNN/mp_rank_RR/)");
  app.add_option("--save-interval", t.save_interval,
                 "Save every N iterations (default: only at the end and on an exit signal)")
      ->check(integer_in_range(1, kMaxInt));
  app.add_option("--load", t.load, "Resume from the latest checkpoint in this directory");
  app.add_flag("--no-load-optim", t.no_load_optim,
               "Do not load the optimizer state (the learning-rate schedule restarts)");
  app.add_flag("--no-load-rng", t.no_load_rng, "Do not load the random states");
  app.add_flag("--finetune", t.finetune,
               "Load the model weights only; iteration 0, fresh optimizer and random states");
  app.add_flag("--override-opt_param-scheduler", t.override_opt_param_scheduler,
               "Use this run's learning-rate settings where the checkpoint's differ");
  app.add_flag("--exit-signal-handler", t.exit_signal_handler,
               "On SIGTERM or SIGINT: finish the step, save (with --save) and exit");
  app.add_option_function<int64_t>(
         "--exit-interval", [&t](const int64_t& v) { t.exit_interval = v; },
         "Save (with --save) and exit after an iteration that is a multiple of N")
      ->check(integer_in_range(1, kMaxInt));
  app.add_option_function<double>(
         "--exit-duration-in-mins", [&t](const double& v) { t.exit_duration_in_mins = v; },
         "Save (with --save) and exit after the iteration that ends this many minutes after the "
         "program started (fractions allowed)")
      ->check(kNonNegative);
}
}  // namespace

void add_distributed_timeout_flag(CLI::App& app, double& minutes) {
  app.add_option("--distributed-timeout-minutes", minutes,
                 "How long a collective (and the rendezvous) waits for a peer before the run "
                 "fails, in minutes (Megatron's default 10; fractions allowed)")
      ->capture_default_str()
      ->check(kPositive);
}

void add_flags(CLI::App& app, TrainOptions& o, unsigned groups) {
  if (groups & kShapeFlags) add_shape_flags(app, o);
  if (groups & kParallelFlags) add_parallel_flags(app, o);
  if (groups & kMoEFlags) add_moe_flags(app, o);
  if (groups & kRecomputeFlags) add_recompute_flags(app, o);
  if (groups & kOffloadFlags) add_offload_flags(app, o);
  if (groups & kOptimizerFlags) add_optimizer_flags(app, o);
  if (groups & kScheduleFlags) add_schedule_flags(app, o);
  if (groups & kDataFlags) add_data_flags(app, o);
  if (groups & kRuntimeFlags) add_runtime_flags(app, o);
  if (groups & kOutputFlags) add_output_flags(app, o);
  if (groups & kCheckpointFlags) add_checkpoint_flags(app, o);
  if (groups & kDistributedFlags) add_distributed_timeout_flag(app, o.distributed_timeout_minutes);
  if (groups & kCompatFlags) add_megatron_compat_flags(app, o.megatron_compat_given);
}

void add_model_flags(CLI::App& app, TrainOptions& o) {
  add_flags(app, o, kModelFlags);
}
void add_training_flags(CLI::App& app, TrainOptions& o) {
  add_flags(app, o, kTrainingFlags);
}

int apply_thread_count(int threads) {
  const int cores = available_cores();
  TORCH_CHECK(threads <= cores, "actmem: --threads ", threads, " exceeds the ", cores,
              " core(s) this process may run on; more threads than cores only slow the step "
              "(give at most ",
              cores, ")");
  int n = threads > 0 ? threads : cores;
  if (threads <= 0) {
    // Without --threads: OMP_NUM_THREADS when set (as PyTorch reads it; `actmem launch` sets it
    // to the cores / its workers), at most the cores.
    if (const char* env = std::getenv("OMP_NUM_THREADS"); env != nullptr && *env != '\0') {
      char* end = nullptr;
      const long v = std::strtol(env, &end, 10);
      TORCH_CHECK(end != env && *end == '\0' && v >= 1,
                  "actmem: OMP_NUM_THREADS must be a "
                  "positive integer (or unset), got '",
                  env, "'");
      n = static_cast<int>(std::min<long>(v, cores));
    }
  }
  at::set_num_threads(n);
  return n;
}

namespace {
// The seed's rule for core_attn recompute under a fused kernel (Megatron's warning in
// TransformerConfig.__post_init__, megatron/core/transformer/transformer_config.py, its words).
// Megatron warns whenever core_attn is recomputed, whatever the backend; actmem warns only when
// the kernel is flash, since on the unfused path core_attn recompute is what removes the s x s
// tensors (docs/memory-model.md, "Attention backends", measures what it buys under each).
void warn_core_attn_recompute_with_flash(const TransformerConfig& model,
                                         const ActivationPlan& plan) {
  if (!model.flash_attention()) return;
  const bool core_attn =
      std::any_of(plan.layers.begin(), plan.layers.end(),
                  [](const LayerPlan& l) { return l.recomputes(RecomputeModule::kCoreAttn); });
  if (!core_attn) return;
  TORCH_WARN(
      "If you are using transformer_engine as the transformer implementation, the "
      "core_attn is from transformer_engine and may be the fused version. For fused "
      "attention, you have no need to set 'core_attn' to recompute. Please check that the "
      "core_attn recompute is really needed. (actmem: the attention kernel is flash, which "
      "keeps no s x s tensors; core_attn recompute saves only its logsumexp, 4 a s b "
      "bytes per layer)");
}

// Carries the model's switches (norm, SwiGLU, query groups, biases, positions) into the model.
void finalize_model_switches(TrainOptions& o) {
  TransformerConfig& model = o.model;
  model.normalization = o.normalization_flag;
  model.gated_linear_unit = o.swiglu;
  if (o.group_query_attention) {
    // Megatron's --num-query-groups defaults to 1 (multi-query attention) under the switch.
    if (model.num_query_groups == 0) model.num_query_groups = 1;
  } else {
    TORCH_CHECK(model.num_query_groups == 0,
                "--num-query-groups needs --group-query-attention "
                "(Megatron ignores it without the switch; here it is refused rather than "
                "ignored)");
  }
  if (o.swiglu && model.ffn_hidden_size == 0) {
    // Megatron's validate_args: SwiGLU's two fc1 halves keep the parameters of a 4h GeLU MLP,
    // rounded down to a multiple of 64 (its TransformerConfig alone would take 4h).
    model.ffn_hidden_size = 4 * model.hidden_size * 2 / 3 / 64 * 64;
    TORCH_CHECK(model.ffn_hidden_size > 0,
                "--swiglu without --ffn-hidden-size takes Megatron's "
                "int(8h/3/64) x 64, which is 0 for --hidden-size ",
                model.hidden_size, "; give --ffn-hidden-size");
  }
  if (model.sequence_parallel && model.tensor_model_parallel_size == 1) {
    // Megatron's validate_args: sequence parallelism without tensor parallelism is switched off.
    TORCH_WARN("Disabling sequence parallelism because tensor model parallelism is disabled");
    model.sequence_parallel = false;
  }
  model.add_bias_linear = !o.disable_bias_linear;
  model.untie_embeddings_and_output_weights = o.untie;
  // --use-rotary-position-embeddings is Megatron's deprecated spelling of the type rope; the
  // type given by name wins (a preset's RoPE is turned off with
  // --position-embedding-type learned_absolute).
  model.position_embedding_type = !o.position_embedding_type.empty() ? o.position_embedding_type
                                  : o.use_rope                       ? "rope"
                                                                     : "learned_absolute";
  // Megatron's validate_args (arguments.py), the same RuntimeError text.
  TORCH_CHECK(!o.no_position_embedding || model.position_embedding_type == "rope",
              "--no-position-embedding is deprecated, use --position-embedding-type");
}

// Sets up the tokenizer the flags name and the vocabulary it gives (Megatron's build_tokenizer).
void finalize_tokenizer_flags(TrainOptions& o) {
  TransformerConfig& model = o.model;
  TrainingConfig& training = o.training;
  if (!training.vocab_file.empty() || !training.merge_file.empty()) {
    // pretrain_gpt.py's default tokenizer (args_defaults={'tokenizer_type': 'GPT2BPETokenizer'}).
    if (training.tokenizer_type.empty()) training.tokenizer_type = "GPT2BPETokenizer";
    // Absolute, so the checkpoint's args name files `generate` finds from any directory.
    for (std::string* f : {&training.vocab_file, &training.merge_file}) {
      if (!f->empty()) *f = std::filesystem::absolute(*f).string();
    }
  }
  // Megatron reads the tiktoken settings for TikTokenizer only (build_tokenizer); elsewhere they
  // are named in the notice of accepted flags (check_megatron_compat_flags).
  const bool tiktoken = training.tokenizer_type == "TikTokenizer";
  if (training.tokenizer_type == "NullTokenizer") {
    // Megatron's NullTokenizer is --vocab-size ids (the last one ends documents), padded as any
    // tokenizer's vocabulary is (vocab_size_with_padding).
    TORCH_CHECK(o.vocab_size_given,
                "--tokenizer-type NullTokenizer needs --vocab-size (Megatron's "
                "NullTokenizer has that many ids, the last ending each document)");
  } else if (!training.tokenizer_type.empty() && !tiktoken) {
    // (TikTokenizer's size is --vocab-size, default 2^17, as in Megatron's build_tokenizer.)
    TORCH_CHECK(!o.vocab_size_given,
                "--vocab-size and --tokenizer-type are exclusive: the "
                "tokenizer sets the vocabulary (padded by --make-vocab-size-divisible-by)");
  } else if (!tiktoken) {
    TORCH_CHECK(training.tokenizer_model.empty(),
                "--tokenizer-model needs --tokenizer-type SentencePieceTokenizer, TikTokenizer "
                "or HuggingFaceTokenizer");
  }
  if (!training.tokenizer_type.empty()) {
    // Absolute, so the checkpoint's args name a file `generate` finds from any directory.
    if (!training.tokenizer_model.empty()) {
      training.tokenizer_model = std::filesystem::absolute(training.tokenizer_model).string();
    }
    TokenizerSpec spec;
    spec.type = training.tokenizer_type;
    spec.model = training.tokenizer_model;
    spec.vocab_file = training.vocab_file;
    spec.merge_file = training.merge_file;
    spec.vocab_size = o.vocab_size_given ? model.vocab_size : 0;
    if (tiktoken) {
      spec.tiktoken_pattern = training.tiktoken_pattern;
      spec.tiktoken_num_special_tokens = training.tiktoken_num_special_tokens;
      spec.special_tokens = training.special_tokens;
    }
    const auto tokenizer = make_tokenizer(spec);
    training.tokenizer_vocab_size = tokenizer->vocab_size();
    training.eod_id = tokenizer->eod();
    model.vocab_size =
        padded_vocab_size(tokenizer->vocab_size(), training.make_vocab_size_divisible_by,
                          model.tensor_model_parallel_size);
  }
}
}  // namespace

void TrainOptions::finalize() {
  TORCH_CHECK(!checkpoint_activations,
              "--checkpoint-activations is no longer valid, use "
              "--recompute-activations, or, for more control, --recompute-granularity and "
              "--recompute-method.");
  if (recompute_activations) model.recompute_granularity = "selective";
  // A clear error now, not at the rendezvous.
  distributed_timeout_from_minutes(distributed_timeout_minutes);
  // Megatron's flags without a counterpart: refused with their reasons, or noted
  // (megatron_compat.h).
  no_effect_notices = check_megatron_compat_flags(megatron_compat_given, *this);
  if (model.attention_backend == "fused") {
    // TransformerEngine's cuDNN attention: the same softmax(QK^T / sqrt(d)) V as every backend.
    model.attention_backend = "auto";
    no_effect_notices.push_back(
        "--attention-backend fused: Transformer Engine's cuDNN kernel of "
        "the same attention; actmem picks its kernel as with auto");
  }
  // Megatron's validate_args: a run is iteration-based or sample-based (arguments.py).
  TORCH_CHECK(!(training.train_samples && train_iters_given),
              "expected sample-based training: give --train-samples or --train-iters, not both");
  finalize_model_switches(*this);
  if (device_memory_limit_gib > 0.0) {
    training.device_memory_limit =
        static_cast<int64_t>(std::llround(device_memory_limit_gib * 1024.0 * 1024.0 * 1024.0));
    TORCH_CHECK(training.device_memory_limit > 0, "--device-memory-limit ", device_memory_limit_gib,
                " GiB rounds to 0 bytes; give at least one byte");
  }
  TORCH_CHECK(dynamic_scaling_flag.empty() || training.dynamic_loss_scale(model),
              dynamic_scaling_flag,
              " applies to dynamic loss scaling, which runs with --fp16 "
              "and no --loss-scale");
  finalize_tokenizer_flags(*this);
  // The model's flags resolved into its plan, which validates them (Note [One plan]).
  const ActivationPlan plan = make_activation_plan(model);
  training.validate(model);
  warn_core_attn_recompute_with_flash(model, plan);
  // A setting that would do nothing is refused, as --offload-modules without the switch is
  // (after the values' own checks, whose messages say more).
  TORCH_CHECK(offload_setting_flag.empty() || offload_planned_later ||
                  model.cpu_offloading_num_layers > 0 || model.fine_grained_activation_offloading,
              offload_setting_flag,
              " applies to activation offloading, which is off: add "
              "--fine-grained-activation-offloading --offload-modules ... or "
              "--cpu-offloading-num-layers K");
  TORCH_CHECK(pipeline_plot.empty() || model.pipeline_model_parallel_size > 1,
              "--pipeline-plot draws a pipeline's schedule: it needs "
              "--pipeline-model-parallel-size > 1");
}

}  // namespace actmem
