// fuzz_tokenizer_files.cpp — the files the byte-level BPE tokenizers read (docs/tokenizers.md):
// the first byte chooses the format, the rest is the file.
//   even: a tokenizer.json (HuggingFaceTokenizer; its tokenizer_config.json names <|endoftext|>)
//   odd:  a TikTokenizer vocabulary file (JSON list of {rank, token_bytes, token_str})
// A tokenizer that loads must tokenize a fixed text without crashing, every id inside its
// vocabulary (or the post-processor's), and decode it again.
#include "actmem/data/tokenizer.h"
#include "fuzz_util.h"

#include <fstream>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool tiktoken = (data[0] & 1) != 0;
  static const std::string text =
      "The quick brown fox, it's 12345 caf\xc3\xa9 e\xcc\x81 \xe6\x97\xa5\xe6\x9c\xac "
      "<|endoftext|> <s>  \n\n\t x \xf0\x9f\x99\x82 \xff";
  try {
    std::unique_ptr<actmem::Tokenizer> tok;
    if (tiktoken) {
      const std::string file = actmem::fuzz::scratch("vocab.json");
      actmem::fuzz::write_file(file, data + 1, size - 1);
      actmem::TokenizerSpec spec;
      spec.type = "TikTokenizer";
      spec.model = file;
      spec.vocab_size = 1000 + 300;  // the file's first 300 tokens
      tok = actmem::make_tokenizer(spec);
    } else {
      actmem::fuzz::write_file(actmem::fuzz::scratch("tokenizer.json"), data + 1, size - 1);
      std::ofstream(actmem::fuzz::scratch("tokenizer_config.json"))
          << R"({"eos_token": "<|endoftext|>"})";
      tok = actmem::make_hugging_face_tokenizer(actmem::fuzz::scratch_dir());
    }
    const auto ids = tok->tokenize(text);
    if (!tiktoken) {
      for (const int64_t id : ids) {
        if (id < 0) std::abort();  // ids index the embedding
      }
    } else {
      for (const int64_t id : ids) {
        if (id < 0 || id >= tok->vocab_size()) std::abort();
      }
    }
    (void)tok->detokenize(ids);
  } catch (const c10::Error&) {
    // a clear refusal
  }
  return 0;
}
