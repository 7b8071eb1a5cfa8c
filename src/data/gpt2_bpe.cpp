// gpt2_bpe.cpp — Megatron's GPT2BPETokenizer (--vocab-file vocab.json --merge-file merges.txt):
// GPT-2's byte-level BPE as Hugging Face's GPT-2 tokenizer applies it (the one Megatron's
// megatron/core/tokenizers builds for GPT2BPETokenizer from these two files), run by
// byte_level_bpe.cpp:
//   - "<|endoftext|>" in the text is the end-of-document id (an added token: never split);
//   - the rest is cut by GPT-2's pattern (a ByteLevel pre-tokenizer with use_regex)
//       's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//   - each piece is merged by merges.txt's ranks and looked up in vocab.json.
#include "actmem/data/tokenizer.h"
#include "byte_level_bpe.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <sstream>

namespace actmem {

namespace bpe {
const char* const kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
}  // namespace bpe

std::unique_ptr<Tokenizer> make_gpt2_bpe_tokenizer(const std::string& vocab_file,
                                                   const std::string& merge_file) {
  TORCH_CHECK(!vocab_file.empty() && !merge_file.empty(),
              "actmem: --tokenizer-type GPT2BPETokenizer needs --vocab-file (vocab.json) and "
              "--merge-file (merges.txt)");
  bpe::ByteLevelBpeSpec spec;
  spec.type = "GPT2BPETokenizer";
  nlohmann::json vocab;
  try {
    vocab = nlohmann::json::parse(
        bpe::read_tokenizer_file(vocab_file, "GPT2BPETokenizer", "--vocab-file"));
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "actmem: GPT2BPETokenizer: --vocab-file ", vocab_file,
                " is not JSON: ", e.what());
  }
  TORCH_CHECK(vocab.is_object() && !vocab.empty(), "actmem: GPT2BPETokenizer: --vocab-file ",
              vocab_file, " must be a JSON object {token: id}");
  std::vector<bool> used(vocab.size(), false);
  for (const auto& [token, id] : vocab.items()) {
    TORCH_CHECK(id.is_number_integer() && id.get<int64_t>() >= 0 &&
                    id.get<int64_t>() < static_cast<int64_t>(vocab.size()),
                "actmem: GPT2BPETokenizer: --vocab-file ", vocab_file, " maps '", token, "' to ",
                id.dump(), "; ids must be integers in [0, ", vocab.size(), ")");
    const auto i = id.get<int64_t>();
    TORCH_CHECK(!used[static_cast<size_t>(i)], "actmem: GPT2BPETokenizer: --vocab-file ",
                vocab_file, " gives id ", i, " to two tokens");
    used[static_cast<size_t>(i)] = true;
    spec.vocab.emplace(token, i);
  }
  spec.vocab_size = static_cast<int64_t>(spec.vocab.size());
  const auto eod = spec.vocab.find("<|endoftext|>");
  TORCH_CHECK(eod != spec.vocab.end(), "actmem: GPT2BPETokenizer: --vocab-file ", vocab_file,
              " has no <|endoftext|>, the token that ends documents");
  spec.eod = eod->second;
  spec.added.push_back({"<|endoftext|>", spec.eod, false});
  std::istringstream merges(
      bpe::read_tokenizer_file(merge_file, "GPT2BPETokenizer", "--merge-file"));
  std::string line;
  int64_t line_no = 0;
  while (std::getline(merges, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line.rfind("#version", 0) == 0) continue;
    const size_t space = line.find(' ');
    TORCH_CHECK(space != std::string::npos && space > 0 && space + 1 < line.size() &&
                    line.find(' ', space + 1) == std::string::npos,
                "actmem: GPT2BPETokenizer: --merge-file ", merge_file, " line ", line_no,
                " is not a pair 'a b': '", line, "'");
    spec.merges.emplace_back(line.substr(0, space), line.substr(space + 1));
  }
  TORCH_CHECK(!spec.merges.empty(), "actmem: GPT2BPETokenizer: --merge-file ", merge_file,
              " has no merges");
  bpe::PreTokenizerStep step;
  step.kind = bpe::PreTokenizerStep::kByteLevel;
  step.pattern = std::make_shared<const text::PieceRegex>(bpe::kGpt2Pattern);
  spec.steps.push_back(step);
  return bpe::make_byte_level_bpe(std::move(spec));
}

}  // namespace actmem
