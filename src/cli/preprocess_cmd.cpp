// preprocess_cmd.cpp — `actmem preprocess`: JSON lines to Megatron's indexed dataset, as
// Megatron-LM's tools/preprocess_data.py (one document per line, PREFIX_KEY_document.bin/.idx),
// optionally training a SentencePiece model on the input first.
#include "actmem/base/report.h"
#include "actmem/data/data.h"
#include "actmem/data/indexed_dataset.h"
#include "actmem/data/tokenizer.h"
#include "commands.h"

#include <c10/util/Exception.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <memory>
#include <sstream>
#include <thread>

namespace actmem::cli {

namespace {

struct PreprocessOptions {
  std::string input;
  bool builtin = false;
  std::vector<std::string> json_keys{"text"};
  std::string output_prefix;
  std::string tokenizer_type;
  std::string tokenizer_model;
  std::string vocab_file, merge_file;  // GPT2BPETokenizer's
  // > 0: train a SentencePiece model of this size first; TikTokenizer's size (Megatron's meaning)
  int64_t vocab_size = 0;
  std::string tiktoken_pattern;  // TikTokenizer's
  int64_t tiktoken_num_special_tokens = 1000;
  std::vector<std::string> special_tokens;
  bool append_eod = false;
  int workers = 1;
};

// Reads documents one JSON line at a time (or the built-in corpus's paragraphs).
class DocumentReader {
 public:
  explicit DocumentReader(const PreprocessOptions& o) : keys_(o.json_keys) {
    if (o.builtin) {
      const std::string text = builtin_corpus();
      size_t start = 0;
      while (start < text.size()) {
        size_t end = text.find("\n\n", start);
        if (end == std::string::npos) end = text.size();
        if (end > start) builtin_.push_back(text.substr(start, end - start));
        start = end + 2;
      }
      total_bytes_ = static_cast<int64_t>(text.size());
    } else {
      in_.open(o.input, std::ios::binary);
      TORCH_CHECK(in_, "actmem preprocess: cannot open --input ", o.input);
      std::error_code ec;
      total_bytes_ = static_cast<int64_t>(std::filesystem::file_size(o.input, ec));
      if (ec) total_bytes_ = 0;
      name_ = o.input;
    }
  }
  /// The next document's text per key; false at the end.
  bool next(std::vector<std::string>& texts) {
    texts.assign(keys_.size(), std::string());
    if (!name_.empty()) {
      std::string line;
      while (std::getline(in_, line)) {
        ++line_no_;
        read_bytes_ += static_cast<int64_t>(line.size()) + 1;
        if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank line
        nlohmann::json j;
        try {
          j = nlohmann::json::parse(line);
        } catch (const nlohmann::json::exception& e) {
          TORCH_CHECK(false, "actmem preprocess: ", name_, " line ", line_no_,
                      " is not valid JSON: ", e.what());
        }
        for (size_t k = 0; k < keys_.size(); ++k) {
          TORCH_CHECK(j.is_object() && j.contains(keys_[k]) && j[keys_[k]].is_string(),
                      "actmem preprocess: ", name_, " line ", line_no_, " has no string '",
                      keys_[k], "' (--json-keys)");
          texts[k] = j[keys_[k]].get<std::string>();
        }
        return true;
      }
      return false;
    }
    if (next_builtin_ >= builtin_.size()) return false;
    read_bytes_ += static_cast<int64_t>(builtin_[next_builtin_].size()) + 2;
    for (auto& t : texts) t = builtin_[next_builtin_];
    ++next_builtin_;
    return true;
  }
  int64_t read_bytes() const { return std::min(read_bytes_, total_bytes_); }
  int64_t total_bytes() const { return total_bytes_; }

 private:
  std::vector<std::string> keys_;
  std::ifstream in_;
  std::string name_;
  int64_t line_no_ = 0;
  std::vector<std::string> builtin_;
  size_t next_builtin_ = 0;
  int64_t read_bytes_ = 0, total_bytes_ = 0;
};

void progress_line(std::ostream& err, const DocumentReader& reader, int64_t docs, int64_t tokens,
                   double seconds, bool final) {
  const double frac = reader.total_bytes() > 0 ? static_cast<double>(reader.read_bytes()) /
                                                     static_cast<double>(reader.total_bytes())
                                               : 1.0;
  const int width = 30;
  const int filled = static_cast<int>(frac * width);
  err << "\rpreprocess [" << std::string(static_cast<size_t>(filled), '#')
      << std::string(static_cast<size_t>(width - filled), ' ') << "] " << std::fixed
      << std::setprecision(1) << 100.0 * frac << "% | " << docs << " documents | " << tokens
      << " tokens | " << std::setprecision(2)
      << static_cast<double>(reader.read_bytes()) / 1e6 / std::max(seconds, 1e-9) << " MB/s";
  if (!final && frac > 0.0 && frac < 1.0) {
    err << " | ETA " << format_duration(seconds * (1.0 - frac) / frac);
  }
  err << (final ? "\n" : "   ") << std::flush;
}

// --vocab-size: a SentencePiece model trained on the input's text (every key of every document,
// as lines); the tokenizer the rest of the run uses.
void train_tokenizer_model(PreprocessOptions& o, const std::function<double()>& seconds) {
  TORCH_CHECK(o.tokenizer_type == "SentencePieceTokenizer" && o.tokenizer_model.empty(),
              "actmem preprocess: --vocab-size trains a SentencePiece model on the input; it "
              "needs --tokenizer-type SentencePieceTokenizer and no --tokenizer-model");
  // The training text: every key's text of every document, as lines.
  const std::string text_path = o.output_prefix + ".sp_train.txt";
  {
    std::ofstream text(text_path, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(text, "actmem preprocess: cannot write ", text_path);
    DocumentReader reader(o);
    std::vector<std::string> texts;
    while (reader.next(texts)) {
      for (const auto& t : texts) text << t << "\n";
    }
  }
  std::cerr << "preprocess: training a SentencePiece model of " << o.vocab_size
            << " pieces on the input ... " << std::flush;
  train_sentencepiece(text_path, o.output_prefix, o.vocab_size, o.workers);
  std::remove(text_path.c_str());
  o.tokenizer_model = o.output_prefix + ".model";
  std::cerr << "wrote " << o.tokenizer_model << " (" << std::fixed << std::setprecision(1)
            << seconds() << " s)\n";
}

// Each document's token ids per key, tokenized by the workers (one tokenizer each: a
// SentencePiece tokenizer is a helper process, so workers that shared one would wait for each
// other), in the documents' order.
std::vector<std::vector<std::vector<int64_t>>> tokenize_in_parallel(
    const std::vector<std::vector<std::string>>& chunk,
    const std::vector<std::unique_ptr<Tokenizer>>& tokenizers, bool append_eod) {
  std::vector<std::vector<std::vector<int64_t>>> ids(chunk.size());
  const int64_t eod = tokenizers[0]->eod();
  auto work = [&](size_t worker, size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      for (const auto& t : chunk[i]) {
        std::vector<int64_t> v = tokenizers[worker]->tokenize(t);
        if (!v.empty() && append_eod) v.push_back(eod);
        ids[i].push_back(std::move(v));
      }
    }
  };
  const size_t n = chunk.size(), w = tokenizers.size();
  std::vector<std::thread> threads;
  for (size_t k = 1; k < w && k < n; ++k) threads.emplace_back(work, k, n * k / w, n * (k + 1) / w);
  work(0, 0, w > 1 && n > 1 ? n / w : n);
  for (auto& t : threads) t.join();
  return ids;
}

int run_preprocess(PreprocessOptions& o) {
  TORCH_CHECK(o.builtin != !o.input.empty(),
              "actmem preprocess: give --input FILE.jsonl or "
              "--builtin-corpus (one of them)");
  TORCH_CHECK(!o.output_prefix.empty(), "actmem preprocess: --output-prefix is required");
  TORCH_CHECK(o.workers >= 1, "actmem preprocess: --workers must be at least 1");
  TORCH_CHECK(!o.json_keys.empty(), "actmem preprocess: --json-keys needs at least one key");
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  auto seconds = [&t0] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  std::error_code ec;
  const auto parent = std::filesystem::path(o.output_prefix).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);

  const bool tiktoken = o.tokenizer_type == "TikTokenizer";
  if (o.vocab_size > 0 && !tiktoken) train_tokenizer_model(o, seconds);
  TORCH_CHECK(!o.tokenizer_type.empty(),
              "actmem preprocess: --tokenizer-type is required (ByteTokenizer, "
              "SentencePieceTokenizer, GPT2BPETokenizer, TikTokenizer or HuggingFaceTokenizer)");
  TokenizerSpec spec;
  spec.type = o.tokenizer_type;
  spec.model = o.tokenizer_model;
  spec.vocab_file = o.vocab_file;
  spec.merge_file = o.merge_file;
  if (tiktoken) {
    spec.vocab_size = o.vocab_size;
    spec.tiktoken_pattern = o.tiktoken_pattern;
    spec.tiktoken_num_special_tokens = o.tiktoken_num_special_tokens;
    spec.special_tokens = o.special_tokens;
  }
  // One tokenizer per worker: a SentencePiece tokenizer is a helper process, so workers that
  // shared one would wait for each other.
  std::vector<std::unique_ptr<Tokenizer>> tokenizers;
  for (int k = 0; k < o.workers; ++k) {
    tokenizers.push_back(make_tokenizer(spec));
  }
  const Tokenizer* tok = tokenizers[0].get();
  const int code = optimal_dtype_code(tok->vocab_size());
  std::vector<std::unique_ptr<IndexedDatasetBuilder>> builders;
  std::vector<std::string> prefixes;
  for (const auto& key : o.json_keys) {
    prefixes.push_back(o.output_prefix + "_" + key + "_document");
    builders.push_back(std::make_unique<IndexedDatasetBuilder>(prefixes.back(), code));
  }

  DocumentReader reader(o);
  int64_t docs = 0, tokens = 0, empty = 0;
  std::vector<int64_t> written(builders.size(), 0);
  auto last_report = Clock::now();
  constexpr size_t kChunk = 1024;  // documents tokenized in parallel, written in order
  std::vector<std::vector<std::string>> chunk;
  std::vector<std::vector<std::vector<int64_t>>> ids;
  bool more = true;
  while (more) {
    chunk.clear();
    std::vector<std::string> texts;
    while (chunk.size() < kChunk && (more = reader.next(texts))) chunk.push_back(texts);
    ids = tokenize_in_parallel(chunk, tokenizers, o.append_eod);
    const size_t n = chunk.size();
    for (size_t i = 0; i < n; ++i) {
      for (size_t k = 0; k < builders.size(); ++k) {
        // An empty document is written as Megatron's preprocess_data.py writes it: a document
        // with no sequence (add_document with no lengths). GPTDataset indexes sequences, so it
        // contributes no sample.
        if (ids[i][k].empty()) {
          ++empty;
        } else {
          builders[k]->add_item(ids[i][k]);
          ++written[k];
        }
        builders[k]->end_document();
        tokens += static_cast<int64_t>(ids[i][k].size());
      }
      ++docs;
    }
    if (Clock::now() - last_report > std::chrono::milliseconds(500)) {
      progress_line(std::cerr, reader, docs, tokens, seconds(), false);
      last_report = Clock::now();
    }
  }
  progress_line(std::cerr, reader, docs, tokens, seconds(), true);
  for (size_t k = 0; k < builders.size(); ++k) {
    TORCH_CHECK(written[k] > 0, "actmem preprocess: the input holds no non-empty '", o.json_keys[k],
                "' document");
  }
  for (auto& b : builders) b->finalize();
  for (size_t k = 0; k < prefixes.size(); ++k) {
    const auto& p = prefixes[k];
    std::cout << "wrote " << p << ".bin and " << p << ".idx: " << docs << " documents, "
              << written[k] << " sequences, " << tok->type() << " (vocabulary " << tok->vocab_size()
              << (o.append_eod ? ", <eod> " + std::to_string(tok->eod()) + " appended" : "")
              << "), tokens stored as " << (code == kUInt16 ? "uint16" : "int32") << "\n";
  }
  if (empty > 0) {
    std::cout << empty
              << " empty document(s) written without a sequence (as Megatron's "
                 "preprocess_data.py writes them; they yield no sample)\n";
  }
  return 0;
}

}  // namespace

Runner add_preprocess_command(CLI::App& app) {
  auto o = std::make_shared<PreprocessOptions>();
  CLI::App* cmd = app.add_subcommand(
      "preprocess",
      "Tokenize JSON lines into Megatron's indexed dataset (PREFIX_KEY_document.bin/.idx)");
  cmd->add_option("--input", o->input, "JSON lines, one document per line");
  cmd->add_flag("--builtin-corpus", o->builtin,
                "Use the built-in corpus (one document per paragraph) instead of --input");
  cmd->add_option("--json-keys", o->json_keys, "Keys of the text to tokenize (default: text)")
      ->expected(1, -1);
  cmd->add_option("--output-prefix", o->output_prefix,
                  "Output files: PREFIX_KEY_document.bin/.idx");
  cmd->add_option("--tokenizer-type", o->tokenizer_type,
                  "ByteTokenizer, SentencePieceTokenizer, GPT2BPETokenizer, TikTokenizer or "
                  "HuggingFaceTokenizer")
      ->check(CLI::IsMember({"ByteTokenizer", "SentencePieceTokenizer", "GPT2BPETokenizer",
                             "TikTokenizer", "HuggingFaceTokenizer"}));
  cmd->add_option("--tokenizer-model", o->tokenizer_model,
                  "SentencePiece model file (M.model), TikTokenizer's V.json or "
                  "HuggingFaceTokenizer's directory");
  cmd->add_option("--tiktoken-pattern", o->tiktoken_pattern, "TikTokenizer's pattern (default v2)")
      ->check(CLI::IsMember({"v1", "v2"}));
  cmd->add_option("--tiktoken-num-special-tokens", o->tiktoken_num_special_tokens,
                  "TikTokenizer's special ids")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{7}, int64_t{1} << 30));
  cmd->add_option("--tokenizer-special-tokens", o->special_tokens, "TikTokenizer's special tokens")
      ->expected(1, -1);
  cmd->add_option("--vocab-file", o->vocab_file, "GPT2BPETokenizer's vocab.json");
  cmd->add_option("--merge-file", o->merge_file, "GPT2BPETokenizer's merges.txt");
  cmd->add_option(
         "--vocab-size", o->vocab_size,
         "Train a SentencePiece model of this many pieces on the input first (PREFIX.model); "
         "with TikTokenizer, its vocabulary size (default 2^17)")
      ->check(CLI::Range(int64_t{8}, int64_t{1} << 24));
  cmd->add_flag("--append-eod", o->append_eod, "Append the end-of-document token to each document");
  cmd->add_option("--workers", o->workers, "Tokenizer threads")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  return [o, cmd]() { return cmd->parsed() ? run_preprocess(*o) : -1; };
}

}  // namespace actmem::cli
