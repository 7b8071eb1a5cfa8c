// generate_cmd.cpp — `actmem generate`: text from a saved checkpoint, with a KV cache.
#include "actmem/base/output_file.h"
#include "actmem/base/report.h"
#include "actmem/data/tokenizer.h"
#include "actmem/flags/train_options.h"
#include "actmem/model/model.h"
#include "actmem/train/checkpoint.h"
#include "actmem/train/generate.h"
#include "commands.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <iomanip>
#include <iostream>
#include <memory>

namespace actmem::cli {

namespace {

struct GenerateOptions {
  std::string load;
  std::string prompt;
  SamplingOptions sampling;
  std::string tokenizer_type, tokenizer_model;  // default: what the checkpoint was trained with
  bool ignore_eod = false;
  std::string log_json;
  int threads = 0;
};

// The --log-json record of one generation.
void write_generation_record(OutputFile& log, const GenerateOptions& o, const LoadedModel& loaded,
                             const std::vector<int64_t>& prompt, const std::vector<int64_t>& made,
                             const std::string& text, double seconds, int64_t cache_bytes) {
  const nlohmann::json j = {{"checkpoint", loaded.path},
                            {"iteration", loaded.iteration},
                            {"prompt", o.prompt},
                            {"prompt_tokens", prompt},
                            {"tokens", made},
                            {"text", text},
                            {"seconds", seconds},
                            {"greedy", o.sampling.greedy},
                            {"temperature", o.sampling.temperature},
                            {"top_k", o.sampling.top_k},
                            {"top_p", o.sampling.top_p},
                            {"seed", o.sampling.seed},
                            {"kv_cache_bytes", cache_bytes}};
  log.write(j.dump() + "\n", "the generation record");
  log.close();
}

// The tokenizer the model was trained with (the checkpoint's args), unless the flags name one;
// an empty type: bytes.
TokenizerSpec generate_tokenizer_spec(const GenerateOptions& o, const nlohmann::json& args) {
  auto arg = [&args](const char* key) {
    return args.contains(key) && args[key].is_string() ? args[key].get<std::string>()
                                                       : std::string();
  };
  TokenizerSpec spec;
  spec.type = o.tokenizer_type;
  spec.model = o.tokenizer_model;
  if (spec.type.empty()) {
    spec.type = arg("tokenizer_type");
    if (spec.model.empty()) spec.model = arg("tokenizer_model");
    spec.vocab_file = arg("vocab_file");
    spec.merge_file = arg("merge_file");
    if (args.contains("tokenizer_vocab_size") && args["tokenizer_vocab_size"].is_number_integer()) {
      spec.vocab_size = args["tokenizer_vocab_size"].get<int64_t>();
    }
    if (spec.type == "TikTokenizer") {
      spec.tiktoken_pattern = arg("tiktoken_pattern");
      if (args.contains("tiktoken_num_special_tokens") &&
          args["tiktoken_num_special_tokens"].is_number_integer()) {
        spec.tiktoken_num_special_tokens = args["tiktoken_num_special_tokens"].get<int64_t>();
      }
      if (args.contains("special_tokens") && args["special_tokens"].is_array()) {
        for (const auto& t : args["special_tokens"]) {
          TORCH_CHECK(t.is_string(),
                      "actmem generate: the checkpoint's special_tokens must be "
                      "strings");
          spec.special_tokens.push_back(t.get<std::string>());
        }
      }
    }
  }
  return spec;
}

int run_generate(GenerateOptions& o) {
  TORCH_CHECK(!o.load.empty(), "actmem generate: --load DIR is required");
  TORCH_CHECK(!o.prompt.empty(), "actmem generate: --prompt TEXT is required");
  OutputFile log;
  if (!o.log_json.empty()) log = OutputFile({"--log-json", o.log_json});
  apply_thread_count(o.threads);
  const LoadedModel loaded = load_model_for_inference(o.load);
  const nlohmann::json args = nlohmann::json::parse(loaded.args_json);
  const TokenizerSpec spec = generate_tokenizer_spec(o, args);
  const std::string& type = spec.type;
  std::unique_ptr<Tokenizer> tokenizer;
  std::vector<int64_t> prompt;
  std::function<std::string(const std::vector<int64_t>&)> detokenize;
  if (type.empty()) {
    for (const unsigned char c : o.prompt) prompt.push_back(c);  // the byte corpus's tokens
    detokenize = [](const std::vector<int64_t>& ids) {
      std::string s;
      for (const int64_t id : ids) {
        if (id >= 0 && id < 256) s.push_back(static_cast<char>(id));
      }
      return s;
    };
  } else {
    tokenizer = make_tokenizer(spec);
    prompt = tokenizer->tokenize(o.prompt);
    if (!o.ignore_eod) o.sampling.stop_token = tokenizer->eod();
    o.sampling.vocab_size = tokenizer->vocab_size();  // never a padding id
    detokenize = [&tokenizer](const std::vector<int64_t>& ids) {
      return tokenizer->detokenize(ids);
    };
  }
  TORCH_CHECK(!prompt.empty(), "actmem generate: the prompt tokenizes to nothing");
  const auto& cfg = loaded.model->config();
  std::cerr << "actmem generate: " << loaded.path << " (iteration " << loaded.iteration << ", "
            << cfg.num_layers << " layers, hidden " << cfg.hidden_size << ", vocabulary "
            << cfg.vocab_size << ", " << cfg.precision() << ", "
            << (type.empty() ? std::string("byte tokens") : type) << ") | "
            << (o.sampling.greedy
                    ? std::string("greedy")
                    : "temperature " + c10::str(o.sampling.temperature) +
                          (o.sampling.top_k > 0 ? ", top-k " + std::to_string(o.sampling.top_k)
                                                : "") +
                          (o.sampling.top_p > 0 ? ", top-p " + c10::str(o.sampling.top_p) : "") +
                          ", seed " + std::to_string(o.sampling.seed))
            << "\n";
  // The text streams as it is made: what detokenizing prompt and new tokens together adds
  // beyond the prompt's own text (SentencePiece drops a leading space when decoding a piece
  // alone, so the continuation is never decoded by itself).
  std::cout << o.prompt << std::flush;
  std::vector<int64_t> all = prompt, made;
  const std::string base = detokenize(prompt);
  auto continuation = [&] {
    const std::string full = detokenize(all);
    return full.compare(0, base.size(), base) == 0 ? full.substr(base.size()) : detokenize(made);
  };
  std::string printed;
  const auto t0 = std::chrono::steady_clock::now();
  generate(*loaded.model, prompt, o.sampling, [&](int64_t token) {
    made.push_back(token);
    all.push_back(token);
    const std::string text = continuation();
    if (text.size() > printed.size() && text.compare(0, printed.size(), printed) == 0) {
      std::cout << text.substr(printed.size()) << std::flush;
      printed = text;
    }
  });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string text = continuation();
  if (text.size() > printed.size() && text.compare(0, printed.size(), printed) == 0) {
    std::cout << text.substr(printed.size());
  }
  std::cout << "\n";
  const int64_t cache_bytes = KVCache::bytes_for(*loaded.model);
  std::cerr << "generated " << made.size() << " tokens in " << std::fixed << std::setprecision(2)
            << seconds << " s (" << std::setprecision(1)
            << static_cast<double>(made.size()) / std::max(seconds, 1e-9) << " tokens/s, prompt "
            << prompt.size() << " tokens, KV cache "
            << format_bytes(static_cast<double>(cache_bytes)) << ")\n";
  if (log.is_open()) {
    write_generation_record(log, o, loaded, prompt, made, text, seconds, cache_bytes);
  }
  return 0;
}

}  // namespace

Runner add_generate_command(CLI::App& app) {
  auto o = std::make_shared<GenerateOptions>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate text from a checkpoint (--load DIR)");
  cmd->add_option("--load", o->load, "Checkpoint directory (its latest checkpoint)");
  cmd->add_option("--prompt", o->prompt, "Text to continue");
  cmd->add_option("--max-new-tokens", o->sampling.max_new_tokens, "Tokens to generate")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  cmd->add_flag("--greedy", o->sampling.greedy, "Always take the most likely token");
  cmd->add_option("--temperature", o->sampling.temperature, "Divide the logits by this")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--top-k", o->sampling.top_k, "Sample from the k most likely tokens (0: all)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--top-p", o->sampling.top_p,
                  "Sample from the most likely tokens that reach probability p (0: all)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--seed", o->sampling.seed, "Sampling seed")->capture_default_str();
  cmd->add_option("--tokenizer-type", o->tokenizer_type,
                  "Override the checkpoint's tokenizer: ByteTokenizer or SentencePieceTokenizer");
  cmd->add_option("--tokenizer-model", o->tokenizer_model, "SentencePiece model (override)");
  cmd->add_flag("--ignore-eod", o->ignore_eod, "Do not stop at the end-of-document token");
  cmd->add_option("--log-json", o->log_json, "Write the prompt, tokens, text and timing as JSON");
  cmd->add_option("--threads", o->threads, "Intra-op CPU threads (default: one per core)")
      ->check(CLI::Range(1, 1 << 20));
  return [o, cmd]() { return cmd->parsed() ? run_generate(*o) : -1; };
}

}  // namespace actmem::cli
