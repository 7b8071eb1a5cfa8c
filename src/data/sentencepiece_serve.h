// sentencepiece_serve.h — the serving side of actmem-sentencepiece's pipe protocol (Note
// [SentencePiece beside libtorch] in sentencepiece_helper.cpp), apart from the process's stdin and
// stdout so the fuzz target fuzz/fuzz_sentencepiece_serve.cpp drives it with any bytes. Links
// libsentencepiece, never libtorch.
#pragma once

#include <cstdio>
#include <memory>
#include <string>

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace actmem::spm {

/// Answers requests (the protocol in sentencepiece_helper.cpp) with one loaded model.
class Server {
 public:
  /// Loads `model_path`; a model that does not load answers every request with its error.
  explicit Server(const std::string& model_path);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  /// Reads requests from `in` and writes the replies to `out` until the end of `in`. Returns 0
  /// there, 1 for a request cut short, 2 for an unknown request (the caller sees the pipe close).
  /// A length field allocates no more than the bytes that actually came, plus one chunk.
  int serve(std::FILE* in, std::FILE* out);

 private:
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
  std::string load_error_;  // empty when the model loaded
};

}  // namespace actmem::spm
