// tokenizer.h — the tokenizers `actmem preprocess`, `train --data-path` and `generate` share:
// text <-> token ids, the vocabulary size the model is built with, and the end-of-document id.
//
//   ByteTokenizer            ids 0..255 are the bytes of UTF-8 text, 256 is <eod> (vocab 257)
//   SentencePieceTokenizer   a SentencePiece model (--tokenizer-model M.model), through
//                            libsentencepiece; <eod> is the model's </s>
//   GPT2BPETokenizer         GPT-2's byte-level BPE from --vocab-file vocab.json and
//                            --merge-file merges.txt (gpt2_bpe.cpp); <eod> is <|endoftext|>
//   NullTokenizer            --vocab-size ids written in decimal; <eod> is the last id
//   TikTokenizer             Megatron's tiktoken tokenizer from --tokenizer-model V.json
//                            (tiktoken.cpp); <eod> is </s>
//   HuggingFaceTokenizer     a local byte-level BPE tokenizer.json (--tokenizer-model DIR,
//                            hf_tokenizer.cpp); <eod> is tokenizer_config.json's eos_token
//
// The model's embedding table is the vocabulary padded as Megatron pads it
// (--make-vocab-size-divisible-by, times the tensor-parallel size).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace actmem {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  /// "ByteTokenizer" or "SentencePieceTokenizer".
  virtual std::string type() const = 0;
  /// Ids in use (before padding).
  virtual int64_t vocab_size() const = 0;
  /// The end-of-document id appended by `preprocess --append-eod`.
  virtual int64_t eod() const = 0;
  virtual std::vector<int64_t> tokenize(const std::string& text) const = 0;
  /// Text of `ids`; ids it does not know (padding) are skipped, <eod> becomes "\n".
  virtual std::string detokenize(const std::vector<int64_t>& ids) const = 0;
};

/// What builds a tokenizer: Megatron's --tokenizer-type and the file(s) or size it reads.
struct TokenizerSpec {
  std::string type;
  std::string model;       // --tokenizer-model (SentencePiece, TikTokenizer, HuggingFaceTokenizer)
  std::string vocab_file;  // --vocab-file (GPT2BPETokenizer)
  std::string merge_file;  // --merge-file (GPT2BPETokenizer)
  int64_t vocab_size = 0;  // --vocab-size (NullTokenizer; TikTokenizer's, 0: 2^17)
  // TikTokenizer's --tiktoken-pattern (empty: v2), --tiktoken-num-special-tokens and
  // --tokenizer-special-tokens (empty: Megatron's seven).
  std::string tiktoken_pattern;
  int64_t tiktoken_num_special_tokens = 1000;
  std::vector<std::string> special_tokens;
};
/// The tokenizer `spec` names; throws naming the flag a type lacks or has no use for.
std::unique_ptr<Tokenizer> make_tokenizer(const TokenizerSpec& spec);

/// The tokenizer of `type`; SentencePieceTokenizer needs `model_path`. Throws naming the type
/// or the file when either is unusable.
/// Megatron's SentencePiece spellings (SentencePieceTokenizer, GPTSentencePieceTokenizer,
/// Llama2Tokenizer: build_tokenizer's SP_TOKENIZERS) all make the SentencePiece tokenizer.
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& type, const std::string& model_path);

/// Megatron's NullTokenizer of `vocab_size` ids (null_tokenizer.py): end-of-document is the last
/// id, vocab_size - 1; a text is its ids written in decimal, separated by spaces.
std::unique_ptr<Tokenizer> make_null_tokenizer(int64_t vocab_size);

/// Megatron's GPT2BPETokenizer: GPT-2's byte-level BPE as Hugging Face's GPT-2 tokenizer runs it
/// from `vocab_file` (JSON {token: id}) and `merge_file` (merges in rank order); the vocabulary
/// is vocab.json's entries, <eod> is <|endoftext|>. Throws naming a file that is unusable.
std::unique_ptr<Tokenizer> make_gpt2_bpe_tokenizer(const std::string& vocab_file,
                                                   const std::string& merge_file);

/// Megatron's TikTokenizer (TikTokenTokenizer): spec.model is the vocabulary file; see
/// TokenizerSpec for the rest. Throws naming the flag or the file entry that is unusable.
std::unique_ptr<Tokenizer> make_tiktoken_tokenizer(const TokenizerSpec& spec);

/// Megatron's HuggingFaceTokenizer from a local directory holding tokenizer.json (or the file
/// itself), for byte-level BPE tokenizers; throws naming what tokenizer.json holds that actmem
/// does not read.
std::unique_ptr<Tokenizer> make_hugging_face_tokenizer(const std::string& model);

/// Megatron's _vocab_size_with_padding: the smallest multiple of divisible_by * tp_size that
/// holds vocab_size.
int64_t padded_vocab_size(int64_t vocab_size, int64_t divisible_by, int64_t tp_size);

/// Trains a SentencePiece model (unigram, as SentencePiece's default) on the text of `input`
/// (one document per line) and writes MODEL_PREFIX.model and .vocab. Throws with the library's
/// message when training fails.
void train_sentencepiece(const std::string& input, const std::string& model_prefix,
                         int64_t vocab_size, int threads);

}  // namespace actmem
