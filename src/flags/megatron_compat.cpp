// megatron_compat.cpp — accepted and refused Megatron flags (megatron_compat.h).
#include "actmem/flags/megatron_compat.h"

#include "actmem/flags/train_options.h"

#include <c10/util/Exception.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <sstream>

namespace actmem {

namespace {

// A flag of Megatron's arguments.py (megatron/training/arguments.py and the config dataclasses
// it is generated from) that actmem does not implement. Exactly one of `no_effect` (accepted: why
// it changes nothing here) and `refused` (why it cannot run, what is missing) is set, unless
// `by_value` decides per value (check_megatron_compat_flags).
struct CompatFlag {
  const char* name;
  int nargs;  // 0: a switch; otherwise the values it takes
  const char* no_effect;
  const char* refused;
  std::vector<std::string> choices = {};  // Megatron's choices, when it has them
  bool by_value = false;
};

const std::vector<CompatFlag>& compat_flags() {
  static const char* kFusion =
      "chooses whether a fused kernel computes the same function; actmem's CPU kernels have no "
      "such switch";
  static const char* kFp8Params =
      "keeps the GEMMs' weights as FP8 tensors (and all-gathers them in FP8); actmem's FP8 "
      "quantizes 16-bit weights at each GEMM and does not hold FP8 parameters yet";
  static const char* kWandb =
      "Weights & Biases logs to a service over the network, which actmem does not do; "
      "--log-json writes the same scalars to a file";
  static const std::vector<CompatFlag> flags = {
      {"--use-mcore-models", 0,
       "deprecated in Megatron and ignored there too (mcore models are "
       "its default)",
       nullptr},
      {"--no-masked-softmax-fusion", 0, kFusion, nullptr},
      {"--no-bias-gelu-fusion", 0, kFusion, nullptr},
      {"--no-bias-swiglu-fusion", 0, kFusion, nullptr},
      {"--no-bias-dropout-fusion", 0, kFusion, nullptr},
      {"--no-rope-fusion", 0, kFusion, nullptr},
      {"--no-gradient-accumulation-fusion", 0, kFusion, nullptr},
      {"--no-persist-layer-norm", 0, kFusion, nullptr},
      {"--cross-entropy-loss-fusion", 0, kFusion, nullptr},
      {"--use-flash-attn", 0,
       "defined but read nowhere in Megatron; --attention-backend chooses "
       "the kernel",
       nullptr},
      {"--manual-gc", 0,
       "controls Python's garbage collector; actmem frees tensors when their "
       "last reference goes",
       nullptr},
      {"--manual-gc-interval", 1, "controls Python's garbage collector (see --manual-gc)", nullptr},
      {"--no-manual-gc-eval", 0, "controls Python's garbage collector (see --manual-gc)", nullptr},
      {"--num-workers", 1,
       "sets the PyTorch DataLoader's worker processes; actmem reads samples "
       "from the memory-mapped dataset in the training process",
       nullptr},
      {"--no-mmap-bin-files", 0,
       "reads the .bin with file reads instead of a memory map: the "
       "same bytes; actmem always maps it",
       nullptr},
      {"--no-create-attention-mask-in-dataloader", 0,
       "skips the data loader's causal mask; actmem's attention is causal without one", nullptr},
      {"--empty-unused-memory-level",
       1,
       "returns the CUDA caching allocator's free blocks to the "
       "driver; actmem's memory on CPU is its tracking "
       "allocator's",
       nullptr,
       {"0", "1", "2"}},
      {"--overlap-param-gather", 0,
       "overlaps the distributed optimizer's parameter all-gather "
       "with the next forward on CUDA streams: the same parameters "
       "arrive; actmem gathers after the step",
       nullptr},
      {"--rampup-batch-size", 3,
       "deprecated in Megatron and ignored there (its batch-size "
       "calculator no longer reads it)",
       nullptr},
      {"--profile", 0,
       "starts the CUDA profiler (nsys) for a range of steps; actmem's --trace "
       "writes a Chrome trace of one step",
       nullptr},
      {"--profile-step-start", 1, "see --profile", nullptr},
      {"--profile-step-end", 1, "see --profile", nullptr},
      {"--context-parallel-size", 1, nullptr, nullptr, {}, true},
      {"--ckpt-format",
       1,
       nullptr,
       nullptr,
       {"torch", "torch_dist", "torch_dcp", "fsdp_dtensor"},
       true},
      {"--fp8-param-gather", 0, nullptr, kFp8Params},
      {"--fp4-param-gather", 0, nullptr, kFp8Params},
      {"--wandb-project", 1, nullptr, kWandb},
      {"--wandb-exp-name", 1, nullptr, kWandb},
      {"--wandb-save-dir", 1, nullptr, kWandb},
      {"--wandb-entity", 1, nullptr, kWandb},
  };
  return flags;
}

bool given(const GivenFlags& flags, const std::string& name) {
  return std::any_of(flags.begin(), flags.end(), [&](const auto& f) { return f.first == name; });
}

}  // namespace

void add_megatron_compat_flags(CLI::App& app, GivenFlags& flags) {
  for (const CompatFlag& f : compat_flags()) {
    const std::string name = f.name;
    // The class and its reason ("see docs" for a flag classed by its value).
    const std::string help =
        std::string("Megatron's; ") + (f.refused     ? std::string("refused here: ") + f.refused
                                       : f.no_effect ? std::string("no effect here: ") + f.no_effect
                                                     : std::string("see docs/megatron-flags.md"));
    if (f.nargs == 0) {
      app.add_flag_callback(
             name, [&flags, name] { flags.emplace_back(name, ""); }, help)
          ->group("Megatron flags without an effect here");
      continue;
    }
    auto* opt = app.add_option_function<std::vector<std::string>>(
        name,
        [&flags, name](const std::vector<std::string>& values) {
          std::string joined;
          for (const auto& v : values) joined += (joined.empty() ? "" : " ") + v;
          flags.emplace_back(name, joined);
        },
        help);
    opt->expected(f.nargs)->group("Megatron flags without an effect here");
    if (!f.choices.empty()) opt->check(CLI::IsMember(f.choices));
  }
}

std::vector<std::string> check_megatron_compat_flags(const GivenFlags& flags,
                                                     const TrainOptions& o) {
  std::vector<std::string> notices, refusals;
  for (const auto& flag : flags) {
    // Named, not a structured binding: clang 14 (the sanitizer build) cannot capture one.
    const std::string& name = flag.first;
    const std::string& value = flag.second;
    const auto it = std::find_if(compat_flags().begin(), compat_flags().end(),
                                 [&](const CompatFlag& f) { return name == f.name; });
    TORCH_CHECK(it != compat_flags().end(), "actmem: unknown compatibility flag ", name);
    const std::string shown = value.empty() ? name : name + " " + value;
    const char* refused = it->refused;
    std::string no_effect = it->no_effect ? it->no_effect : "";
    if (name == "--context-parallel-size") {
      int64_t cp = 0;
      std::istringstream in(value);
      TORCH_CHECK(in >> cp && in.eof() && cp >= 1,
                  "--context-parallel-size must be a positive "
                  "integer, got '",
                  value, "'");
      if (cp == 1) {
        no_effect = "is Megatron's default: no context parallelism";
      } else {
        refused =
            "context parallelism (each rank holding a slice of the sequence, ring attention "
            "between them) is not implemented in actmem; use tensor, sequence, pipeline, "
            "data or expert parallelism";
      }
    } else if (name == "--ckpt-format") {
      if (value == "torch") {
        no_effect =
            "is the layout actmem writes and reads (iter_NNNNNNN/mp_rank_RR/"
            "model_optim_rng.pt)";
      } else if (value == "torch_dist") {
        no_effect =
            "asks for Megatron's distributed checkpoint (torch.distributed.checkpoint "
            "shards); actmem writes Megatron's torch layout instead, which Megatron "
            "loads with --ckpt-format torch";
      } else {
        refused = value == "torch_dcp" ? "needs --use-torch-fsdp2 in Megatron; actmem has no FSDP"
                                       : "needs --use-megatron-fsdp in Megatron; actmem has no "
                                         "FSDP";
      }
    }
    if (refused != nullptr) {
      refusals.push_back(shown + ": " + refused);
    } else {
      notices.push_back(shown + ": " + no_effect);
    }
  }
  // TikTokenizer's settings with another tokenizer: Megatron's build_tokenizer reads them for
  // TikTokenizer only.
  if (o.training.tokenizer_type != "TikTokenizer") {
    const std::string why = "is read by Megatron only for --tokenizer-type TikTokenizer";
    const auto& t = o.training;
    if (!t.tiktoken_pattern.empty())
      notices.push_back("--tiktoken-pattern " + t.tiktoken_pattern + ": " + why);
    if (t.tiktoken_num_special_tokens != 1000) {
      notices.push_back("--tiktoken-num-special-tokens " +
                        std::to_string(t.tiktoken_num_special_tokens) + ": " + why);
    }
    if (!t.special_tokens.empty()) notices.push_back("--tokenizer-special-tokens: " + why);
  }
  // Megatron's validate_args on what is accepted (arguments.py).
  if (given(flags, "--overlap-param-gather")) {
    TORCH_CHECK(o.training.use_distributed_optimizer,
                "--overlap-param-gather only supported with "
                "distributed optimizer, megatron fsdp, or dist_muon");
    TORCH_CHECK(o.training.overlap_grad_reduce,
                "Must use --overlap-param-gather with --overlap-grad-reduce");
  }
  if (!refusals.empty()) {
    std::ostringstream msg;
    msg << "actmem train: " << refusals.size() << " Megatron flag"
        << (refusals.size() == 1 ? " asks" : "s ask") << " for what actmem does not implement:";
    for (const auto& r : refusals) msg << "\n  " << r;
    TORCH_CHECK(false, msg.str());
  }
  // One line per flag; a flag given twice is named once.
  std::vector<std::string> unique;
  for (const auto& n : notices) {
    if (std::find(unique.begin(), unique.end(), n) == unique.end()) unique.push_back(n);
  }
  return unique;
}

}  // namespace actmem
