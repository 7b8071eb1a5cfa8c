// presets.cpp — named models as command lines, and the paper's view of the model the flags
// describe.
#include "actmem/flags/presets.h"

#include "actmem/parallel/pipeline.h"
#include "actmem/train/training_setup.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <limits>
#include <map>
#include <sstream>

namespace actmem {

namespace {
// Korthikanti et al. 2022, Table 3: s = 2048, V = 51200, ffn = 4h (Megatron's default), TP 8 with
// sequence parallelism; 175B and 530B with the interleaved schedule's 3 chunks per stage.
std::string table3(int64_t b, int64_t h, int64_t a, int64_t L, int64_t p, int64_t chunks) {
  std::ostringstream os;
  os << "--seq-length 2048 --micro-batch-size " << b << " --hidden-size " << h
     << " --num-attention-heads " << a << " --num-layers " << L << " --vocab-size 51200 "
     << "--tensor-model-parallel-size 8 --sequence-parallel --pipeline-model-parallel-size " << p;
  if (chunks > 1) os << " --num-virtual-stages-per-pipeline-rank " << chunks;
  return os.str();
}

#define LLAMA_STYLE                                                                         \
  "--normalization RMSNorm --swiglu --use-rotary-position-embeddings --rotary-base 500000 " \
  "--untie-embeddings-and-output-weights --disable-bias-linear"

// Llama 3 and Mixtral train without dropout (Megatron's examples/llama/train_llama3_8b_h100_fp8.sh
// and examples/mixtral/train_mixtral_8x7b_distributed.sh pass these two flags), so auto runs
// the flash kernel for them (Note [Attention backends] in config.cpp).
#define NO_DROPOUT "--attention-dropout 0 --hidden-dropout 0"

const std::map<std::string, std::string>& presets() {
  static const std::map<std::string, std::string> table = {
      // The 7B worked example of docs/memory-model.md (Llama-style: SwiGLU with ffn 14336,
      // untied embeddings, vocabulary 32000), TP 2 with SP, PP 2: 16 layers per stage.
      {"7b",
       "--seq-length 4096 --micro-batch-size 2 --hidden-size 4096 --num-attention-heads 32 "
       "--num-layers 32 --ffn-hidden-size 14336 --vocab-size 32000 --swiglu "
       "--untie-embeddings-and-output-weights --tensor-model-parallel-size 2 "
       "--sequence-parallel --pipeline-model-parallel-size 2"},
      {"22b", table3(4, 6144, 64, 48, 1, 1)},
      {"175b", table3(1, 12288, 96, 96, 8, 3)},
      {"530b", table3(1, 20480, 128, 105, 35, 3)},
      {"1t", table3(1, 25600, 160, 128, 64, 1)},
      // Open models at their published shapes, one rank (give the layout: --tensor-model-
      // parallel-size --sequence-parallel --pipeline-model-parallel-size ...).
      // Llama 3 8B and 70B (Meta's model cards and config.json: RMSNorm, SwiGLU, RoPE base
      // 500000, untied, no biases, grouped-query attention with 8 key/value heads, vocabulary
      // 128256, 8192-token context).
      {"llama3-8b",
       "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 "
       "--group-query-attention --num-query-groups 8 --ffn-hidden-size 14336 "
       "--vocab-size 128256 " LLAMA_STYLE " " NO_DROPOUT " --seq-length 8192 --micro-batch-size 1"},
      {"llama3-70b",
       "--num-layers 80 --hidden-size 8192 --num-attention-heads 64 "
       "--group-query-attention --num-query-groups 8 --ffn-hidden-size 28672 "
       "--vocab-size 128256 " LLAMA_STYLE " " NO_DROPOUT " --seq-length 8192 --micro-batch-size 1"},
      // Mixtral 8x7B (Jiang et al. 2024, arXiv 2401.04088, and its config.json): the Mistral 7B
      // shape with 8 experts of ffn 14336 on every layer, top-2, RoPE base 1e6, vocabulary 32000.
      // Grouped experts as Megatron's examples/mixtral/train_mixtral_8x7b_distributed.sh runs
      // them (--moe-grouped-gemm; moe_act recompute and the expert offload groups need it).
      {"mixtral-8x7b",
       "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 "
       "--group-query-attention --num-query-groups 8 --ffn-hidden-size 14336 "
       "--num-experts 8 --moe-router-topk 2 --moe-grouped-gemm --vocab-size 32000 --normalization "
       "RMSNorm --swiglu --use-rotary-position-embeddings --rotary-base 1000000 "
       "--untie-embeddings-and-output-weights --disable-bias-linear " NO_DROPOUT " "
       "--seq-length 4096 --micro-batch-size 1"},
      // DeepSeek-V3 (arXiv 2412.19437, Table and §4.2): 61 layers, the first 3 dense, MLA
      // (query rank 1536, key/value rank 512, heads of 128 + 64 RoPE and 128 values), 256
      // routed experts of ffn 2048 top-8 and one shared, vocabulary 129280 (the multi-token
      // prediction module apart); grouped experts, as for Mixtral.
      {"deepseek-v3",
       "--num-layers 61 --hidden-size 7168 --num-attention-heads 128 "
       "--ffn-hidden-size 18432 --vocab-size 129280 --normalization RMSNorm "
       "--swiglu --untie-embeddings-and-output-weights --disable-bias-linear "
       "--multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 "
       "--qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm "
       "--num-experts 256 --moe-router-topk 8 --moe-ffn-hidden-size 2048 --moe-grouped-gemm "
       "--moe-shared-expert-intermediate-size 2048 --moe-layer-freq "
       "([0]*3+[1]*58) --seq-length 4096 --micro-batch-size 1"},
      // Qwen3-Next-80B-A3B (Qwen team, 2025: its config.json and model card): 48 layers of h
      // 2048, every 4th full attention (16 heads of 256 in 2 key/value groups, q/k norms, the
      // output gate, RoPE base 1e7 on a quarter of each head), the other three Gated DeltaNet
      // (16 key heads and 32 value heads of 128, a kernel-4 convolution); every MLP 512 routed
      // experts of ffn 512 top-10 and a gated shared expert of 512; zero-centred RMSNorm
      // (eps 1e-6), untied, vocabulary 151936, no dropout, aux-loss 1e-3.
      {"qwen3-next-80b-a3b",
       "--num-layers 48 --hidden-size 2048 --num-attention-heads 16 --kv-channels 256 "
       "--group-query-attention --num-query-groups 2 --qk-layernorm --attention-output-gate "
       "--position-embedding-type rope --rotary-base 10000000 --rotary-percent 0.25 "
       "--experimental-attention-variant gdn --linear-attention-freq 4 "
       "--linear-conv-kernel-dim 4 --linear-key-head-dim 128 --linear-value-head-dim 128 "
       "--linear-num-key-heads 16 --linear-num-value-heads 32 "
       "--num-experts 512 --moe-router-topk 10 --moe-ffn-hidden-size 512 --moe-grouped-gemm "
       "--moe-shared-expert-intermediate-size 512 --moe-shared-expert-gate "
       "--moe-aux-loss-coeff 1e-3 --ffn-hidden-size 5120 --normalization RMSNorm "
       "--apply-layernorm-1p --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights "
       "--disable-bias-linear --vocab-size 151936 " NO_DROPOUT " --seq-length 4096 "
       "--micro-batch-size 1"},
  };
  return table;
}

std::vector<std::string> words(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

const char* const kSizeFlags[] = {"--num-layers", "--hidden-size",      "--num-attention-heads",
                                  "--seq-length", "--micro-batch-size", "--vocab-size"};
}  // namespace

std::vector<std::string> model_preset_names() {
  std::vector<std::string> names;
  for (const auto& [name, _] : presets()) names.push_back(name);
  return names;
}

std::vector<std::string> model_preset_arguments(const std::string& name) {
  const auto it = presets().find(name);
  TORCH_CHECK(it != presets().end(), "actmem::model_preset_arguments: unknown preset '", name,
              "'; known: ", c10::Join(", ", model_preset_names()));
  return words(it->second);
}

std::vector<std::string> expand_model_preset(std::vector<std::string> args) {
  if (args.empty() || (args[0] != "estimate" && args[0] != "plan" && args[0] != "train")) {
    return args;
  }
  const auto end = std::find(args.begin(), args.end(), "--");
  std::optional<std::string> name;
  bool size_given = false;
  for (auto it = args.begin() + 1; it != end; ++it) {
    if (*it == "--preset" && it + 1 != end) name = *(it + 1);
    if (it->rfind("--preset=", 0) == 0) name = it->substr(9);
    for (const char* flag : kSizeFlags) {
      if (*it == flag || it->rfind(std::string(flag) + "=", 0) == 0) size_given = true;
    }
  }
  if (!name && args[0] == "estimate" && !size_given) {
    name = "7b";
    args.insert(end, {"--preset", "7b"});  // `end` is invalid from here on
  }
  if (!name || !presets().count(*name)) return args;
  const auto given_end = std::find(args.begin(), args.end(), "--");
  std::vector<std::string> flags = model_preset_arguments(*name);
  // Two spellings of one setting: one given replaces the preset's other (Megatron refuses both).
  const std::vector<std::string> chunks = {"--num-layers-per-virtual-pipeline-stage",
                                           "--num-virtual-stages-per-pipeline-rank"};
  const bool chunks_given = std::any_of(args.begin() + 1, given_end, [&](const std::string& a) {
    return std::any_of(chunks.begin(), chunks.end(),
                       [&](const std::string& c) { return a == c || a.rfind(c + "=", 0) == 0; });
  });
  for (size_t i = 0; chunks_given && i < flags.size();) {
    if (std::find(chunks.begin(), chunks.end(), flags[i]) != chunks.end()) {
      flags.erase(flags.begin() + i, flags.begin() + i + 2);
    } else {
      ++i;
    }
  }
  args.insert(args.begin() + 1, flags.begin(), flags.end());
  return args;
}

CLI::Option* add_preset_option(CLI::App& app, std::string& preset, const std::string& help) {
  return app.add_option("--preset", preset, help + ": " + c10::Join(", ", model_preset_names()))
      ->check(CLI::Validator(
          [](std::string& name) -> std::string {
            if (presets().count(name)) return {};
            return "unknown preset '" + name + "'; known: " + c10::Join(", ", model_preset_names());
          },
          "PRESET"));
}

void add_described_layout_flags(CLI::App& app, TrainOptions& o, DescribedLayout& layout,
                                bool optimizer_flags_registered) {
  constexpr int64_t kMaxInt = std::numeric_limits<int64_t>::max();
  app.add_option("--data-parallel-size", layout.data_parallel_size,
                 "d: data-parallel ranks (the launch's in train; divides the optimizer state "
                 "with --use-distributed-optimizer)")
      ->capture_default_str()
      ->check(integer_in_range(1, int64_t{1} << 40));
  app.add_option_function<int64_t>(
         "--num-microbatches", [&layout](const int64_t& m) { layout.num_microbatches = m; },
         "micro-batches per step (or --global-batch-size; default: as many as the schedule "
         "keeps in flight)")
      ->check(integer_in_range(1, kMaxInt));
  app.add_option_function<int64_t>(
         "--expert-tensor-parallel-size",
         [&layout](const int64_t& n) { layout.expert_tensor_parallel_size = n; },
         "MoE: each expert split this many ways (default t; train does not implement it)")
      ->check(integer_in_range(1, 1 << 20));
  if (optimizer_flags_registered) return;
  app.add_option("--global-batch-size", o.training.global_batch_size,
                 "samples per optimizer step (a multiple of micro-batch size x d)")
      ->check(integer_in_range(1, kMaxInt));
  app.add_flag("--use-distributed-optimizer", o.training.use_distributed_optimizer,
               "optimizer state sharded over the data-parallel ranks (6 + 12/d bytes/param)");
}

PaperShape describe_model(TrainOptions& o, const DescribedLayout& layout, const char* api) {
  TransformerConfig& c = o.model;
  TrainingConfig& t = o.training;
  const int64_t d = layout.data_parallel_size;
  TORCH_CHECK(!(layout.num_microbatches && t.global_batch_size > 0), api,
              ": give "
              "--num-microbatches or --global-batch-size, not both");
  if (layout.num_microbatches)
    t.global_batch_size = *layout.num_microbatches * c.micro_batch_size * d;
  o.finalize();
  // What the paper's formulas describe: stages of equal layers, Megatron's default groups.
  TORCH_CHECK(!c.decoder_first_pipeline_num_layers && !c.decoder_last_pipeline_num_layers, api,
              ": the paper's formulas describe pipeline stages of equal layers; "
              "--decoder-first/last-pipeline-num-layers are not modelled");
  TORCH_CHECK(!c.microbatch_group_size_per_vp_stage, api,
              ": the interleaved schedule is "
              "modelled with Megatron's default groups of p micro-batches; "
              "--microbatch-group-size-per-virtual-pipeline-stage is not");
  if (t.global_batch_size > 0) check_batch_layout(c, t, d);
  PaperShape m = paper_shape(c);
  m.d = static_cast<double>(d);
  m.distributed_optimizer = t.use_distributed_optimizer;
  if (t.global_batch_size > 0) {
    m.num_microbatches = static_cast<double>(t.num_microbatches(c.micro_batch_size, d));
  }
  if (m.is_moe()) {
    const int64_t etp = layout.expert_tensor_parallel_size.value_or(c.tensor_model_parallel_size);
    m.moe.etp = static_cast<double>(etp);
    // Megatron's expert layout: etp x ep ranks carve each t x d group of a pipeline stage.
    TORCH_CHECK((c.tensor_model_parallel_size * d) % (etp * c.expert_model_parallel_size) == 0, api,
                ": world_size (t x d x p = ",
                c.tensor_model_parallel_size * d * c.pipeline_model_parallel_size,
                ") is not divisible by "
                "expert_tensor_model_pipeline_parallel size (",
                etp * c.expert_model_parallel_size * c.pipeline_model_parallel_size, ")");
  } else {
    TORCH_CHECK(!layout.expert_tensor_parallel_size, api,
                ": --expert-tensor-parallel-size needs "
                "--num-experts");
  }
  return m;
}

TrainOptions preset_options(const std::string& name) {
  TrainOptions o;
  CLI::App app;
  add_flags(app, o, kShapeFlags | kParallelFlags | kMoEFlags);
  std::vector<std::string> args = model_preset_arguments(name);
  std::reverse(args.begin(), args.end());  // CLI11 takes its argument list reversed
  app.parse(args);
  o.finalize();
  return o;
}

PaperShape paper_preset(const std::string& name) {
  return paper_shape(preset_options(name).model);
}

}  // namespace actmem
