// tokenizer.cpp — the byte-level and SentencePiece tokenizers (tokenizer.h).
#include "actmem/data/tokenizer.h"

#include "actmem/base/output_file.h"
#include "sentencepiece_client.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <mutex>

extern char** environ;

namespace actmem {

namespace {

// SentencePiece runs in actmem-sentencepiece, a process of its own (Note [SentencePiece beside
// libtorch] in sentencepiece_helper.cpp). The first of these that exists is used.
std::string sentencepiece_helper() {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("ACTMEM_SENTENCEPIECE_HELPER")) candidates.emplace_back(env);
#ifdef ACTMEM_SENTENCEPIECE_HELPER_BUILD
  candidates.emplace_back(ACTMEM_SENTENCEPIECE_HELPER_BUILD);
#endif
#ifdef ACTMEM_SENTENCEPIECE_HELPER_INSTALL
  candidates.emplace_back(ACTMEM_SENTENCEPIECE_HELPER_INSTALL);
#endif
  for (const auto& c : candidates) {
    if (::access(c.c_str(), X_OK) == 0) return c;
  }
  return "actmem-sentencepiece";  // from PATH
}

// A child process with pipes to its stdin and stdout (and its stderr to `err_fd` when >= 0).
struct Child {
  pid_t pid = -1;
  int in = -1, out = -1, err = -1;
};

Child spawn_helper(const std::vector<std::string>& args, bool capture_stderr) {
  int to_child[2], from_child[2], err_pipe[2] = {-1, -1};
  TORCH_CHECK(::pipe2(to_child, O_CLOEXEC) == 0 && ::pipe2(from_child, O_CLOEXEC) == 0 &&
                  (!capture_stderr || ::pipe2(err_pipe, O_CLOEXEC) == 0),
              "actmem: cannot create pipes for actmem-sentencepiece: ", std::strerror(errno));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, to_child[0], 0);
  posix_spawn_file_actions_adddup2(&actions, from_child[1], 1);
  if (capture_stderr) posix_spawn_file_actions_adddup2(&actions, err_pipe[1], 2);
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  Child c;
  const int rc = ::posix_spawnp(&c.pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(to_child[0]);
  ::close(from_child[1]);
  if (capture_stderr) ::close(err_pipe[1]);
  if (rc != 0) {
    ::close(to_child[1]);
    ::close(from_child[0]);
    if (capture_stderr) ::close(err_pipe[0]);
    TORCH_CHECK(false, "actmem: cannot start ", args[0],
                " (SentencePiece runs in it; it is built "
                "and installed with actmem): ",
                std::strerror(rc));
  }
  c.in = to_child[1];
  c.out = from_child[0];
  c.err = err_pipe[0];
  return c;
}

// Writes all of `p`; a helper that went away is an error, not a SIGPIPE for this process.
bool write_all(int fd, const void* p, size_t n) {
  sigset_t block, old;
  sigemptyset(&block);
  sigaddset(&block, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &block, &old);
  const bool ok = write_fully(fd, p, n) == 0;
  if (!ok) {
    const timespec zero{0, 0};
    sigtimedwait(&block, nullptr, &zero);  // the pending SIGPIPE, if any
  }
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  return ok;
}

bool read_all(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t r = ::read(fd, c, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

}  // namespace

namespace spm {

Client::Info Client::info(const std::string& model) {
  const char op = 'I';
  uint32_t status = 0;
  TORCH_CHECK(write_all(to_, &op, 1) && read_all(from_, &status, 4),
              "actmem: actmem-sentencepiece did not answer (is it installed?)");
  if (status == 0xFFFFFFFFu) {
    const std::string err = read_error();
    TORCH_CHECK(false, "actmem: cannot load the SentencePiece model ", model, ": ", err);
  }
  Info answer;
  answer.pieces = static_cast<int32_t>(status);
  TORCH_CHECK(read_all(from_, &answer.eos, 4), "actmem: actmem-sentencepiece went away");
  TORCH_CHECK(answer.pieces > 0 && answer.eos >= -1 && answer.eos < answer.pieces,
              "actmem: actmem-sentencepiece answered ", answer.pieces, " pieces with </s> id ",
              answer.eos, " for ", model, " (expected a positive count and an id below it)");
  return answer;
}

std::vector<int32_t> Client::encode(const std::string& text, int32_t pieces) {
  TORCH_CHECK(text.size() < 0xFFFFFFFFu, "actmem: a document of ", text.size(),
              " bytes is too "
              "long for the SentencePiece helper");
  const uint32_t n = static_cast<uint32_t>(text.size());
  uint32_t k = 0;
  TORCH_CHECK(write_all(to_, "E", 1) && write_all(to_, &n, 4) && write_all(to_, text.data(), n) &&
                  read_all(from_, &k, 4),
              "actmem: actmem-sentencepiece went away while encoding");
  if (k == 0xFFFFFFFFu) {
    const std::string err = read_error();
    TORCH_CHECK(false, "actmem: SentencePiece could not encode a text: ", err);
  }
  TORCH_CHECK(k <= kMaxIdsPerByte * (uint64_t{n} + 1), "actmem: actmem-sentencepiece answered ", k,
              " ids for a text of ", n, " bytes (at most ", kMaxIdsPerByte,
              " per byte are possible): the helper is broken");
  std::vector<int32_t> ids(k);
  TORCH_CHECK(read_all(from_, ids.data(), 4 * static_cast<size_t>(k)),
              "actmem: actmem-sentencepiece went away while encoding");
  for (const int32_t id : ids) {
    TORCH_CHECK(id >= 0 && id < pieces, "actmem: actmem-sentencepiece answered id ", id,
                " for a model of ", pieces, " pieces: the helper is broken");
  }
  return ids;
}

std::string Client::decode(const std::vector<int32_t>& ids) {
  TORCH_CHECK(ids.size() < 0x40000000u, "actmem: ", ids.size(),
              " ids are too many to decode at "
              "once");
  const uint32_t k = static_cast<uint32_t>(ids.size());
  uint32_t n = 0;
  TORCH_CHECK(write_all(to_, "D", 1) && write_all(to_, &k, 4) &&
                  write_all(to_, ids.data(), 4 * ids.size()) && read_all(from_, &n, 4),
              "actmem: actmem-sentencepiece went away while decoding");
  if (n == 0xFFFFFFFFu) {
    const std::string err = read_error();
    TORCH_CHECK(false, "actmem: SentencePiece could not decode: ", err);
  }
  TORCH_CHECK(n <= kMaxBytesPerPiece * (uint64_t{k} + 1), "actmem: actmem-sentencepiece answered ",
              n, " bytes for ", k, " ids (at most ", kMaxBytesPerPiece,
              " per piece are expected): the helper is broken");
  std::string text(n, '\0');
  TORCH_CHECK(n == 0 || read_all(from_, text.data(), n),
              "actmem: actmem-sentencepiece went away while decoding");
  return text;
}

std::string Client::read_error() {
  uint32_t n = 0;
  if (!read_all(from_, &n, 4) || n > (1u << 20)) return "(no message)";
  std::string msg(n, '\0');
  if (n > 0 && !read_all(from_, msg.data(), n)) return "(no message)";
  return msg;
}

}  // namespace spm

namespace {

class ByteLevelTokenizer final : public Tokenizer {
 public:
  std::string type() const override { return "ByteTokenizer"; }
  int64_t vocab_size() const override { return 257; }
  int64_t eod() const override { return 256; }
  std::vector<int64_t> tokenize(const std::string& text) const override {
    std::vector<int64_t> ids(text.size());
    for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }
  std::string detokenize(const std::vector<int64_t>& ids) const override {
    std::string out;
    for (const int64_t id : ids) {
      if (id >= 0 && id < 256) out.push_back(static_cast<char>(id));
      if (id == eod()) out.push_back('\n');
    }
    return out;
  }
};

class NullTokenizer final : public Tokenizer {
 public:
  explicit NullTokenizer(int64_t vocab_size) : vocab_(vocab_size) {
    TORCH_CHECK(vocab_size >= 1, "actmem: NullTokenizer needs a positive --vocab-size, got ",
                vocab_size);
  }
  std::string type() const override { return "NullTokenizer"; }
  int64_t vocab_size() const override { return vocab_; }
  int64_t eod() const override { return vocab_ - 1; }
  std::vector<int64_t> tokenize(const std::string& text) const override {
    // Megatron's: [int(x) for x in text.split(' ')], each id inside the vocabulary.
    std::vector<int64_t> ids;
    size_t start = 0;
    while (start <= text.size()) {
      const size_t end = std::min(text.find(' ', start), text.size());
      const std::string word = text.substr(start, end - start);
      int64_t id = -1;
      const auto [p, ec] = std::from_chars(word.data(), word.data() + word.size(), id);
      TORCH_CHECK(ec == std::errc() && p == word.data() + word.size() && id >= 0 && id < vocab_,
                  "actmem: NullTokenizer reads ids written in decimal below ", vocab_,
                  ", separated by spaces; got '", word, "'");
      ids.push_back(id);
      start = end + 1;
    }
    return ids;
  }
  std::string detokenize(const std::vector<int64_t>& ids) const override {
    std::string out;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i > 0) out.push_back(' ');
      out += std::to_string(ids[i]);
    }
    return out;
  }

 private:
  int64_t vocab_;
};

class SentencePieceTokenizer final : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& path) {
    TORCH_CHECK(!path.empty(),
                "actmem: --tokenizer-type SentencePieceTokenizer needs "
                "--tokenizer-model M.model");
    TORCH_CHECK(::access(path.c_str(), R_OK) == 0, "actmem: cannot read the SentencePiece model ",
                path, ": ", std::strerror(errno));
    child_ = spawn_helper({sentencepiece_helper(), "serve", path}, false);
    client_ = spm::Client(child_.in, child_.out);
    const spm::Client::Info info = client_.info(path);
    vocab_ = info.pieces;
    eod_ = info.eos;
    TORCH_CHECK(eod_ >= 0, "actmem: the SentencePiece model ", path,
                " has no </s> piece to end "
                "documents with");
  }
  ~SentencePieceTokenizer() override {
    ::close(child_.in);  // the helper sees end of input and exits
    ::close(child_.out);
    int status = 0;
    ::waitpid(child_.pid, &status, 0);
  }
  SentencePieceTokenizer(const SentencePieceTokenizer&) = delete;
  SentencePieceTokenizer& operator=(const SentencePieceTokenizer&) = delete;
  std::string type() const override { return "SentencePieceTokenizer"; }
  int64_t vocab_size() const override { return vocab_; }
  int64_t eod() const override { return eod_; }
  std::vector<int64_t> tokenize(const std::string& text) const override {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::vector<int32_t> ids = client_.encode(text, static_cast<int32_t>(vocab_));
    return std::vector<int64_t>(ids.begin(), ids.end());
  }
  std::string detokenize(const std::vector<int64_t>& ids) const override {
    std::string out;
    std::vector<int32_t> piece;
    auto flush = [&] {
      if (piece.empty()) return;
      out += decode(piece);
      piece.clear();
    };
    for (const int64_t id : ids) {
      if (id == eod_) {
        flush();
        out.push_back('\n');
      } else if (id >= 0 && id < vocab_) {
        piece.push_back(static_cast<int32_t>(id));
      }
    }
    flush();
    return out;
  }

 private:
  std::string decode(const std::vector<int32_t>& ids) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return client_.decode(ids);
  }
  Child child_;
  mutable spm::Client client_{-1, -1};
  int64_t vocab_ = 0, eod_ = 0;
  mutable std::mutex mutex_;
};

}  // namespace

std::unique_ptr<Tokenizer> make_null_tokenizer(int64_t vocab_size) {
  return std::make_unique<NullTokenizer>(vocab_size);
}

std::unique_ptr<Tokenizer> make_tokenizer(const TokenizerSpec& spec) {
  const std::string& type = spec.type;
  const bool sentencepiece = type == "SentencePieceTokenizer" ||
                             type == "GPTSentencePieceTokenizer" || type == "Llama2Tokenizer";
  const bool modeled = sentencepiece || type == "TikTokenizer" || type == "HuggingFaceTokenizer";
  TORCH_CHECK(spec.model.empty() || modeled,
              "actmem: --tokenizer-model applies to SentencePieceTokenizer, TikTokenizer and "
              "HuggingFaceTokenizer, not ",
              type);
  TORCH_CHECK((spec.tiktoken_pattern.empty() && spec.special_tokens.empty() &&
               spec.tiktoken_num_special_tokens == 1000) ||
                  type == "TikTokenizer",
              "actmem: --tiktoken-pattern, --tiktoken-num-special-tokens and "
              "--tokenizer-special-tokens are TikTokenizer's, not ",
              type, "'s");
  TORCH_CHECK((spec.vocab_file.empty() && spec.merge_file.empty()) || type == "GPT2BPETokenizer",
              "actmem: --vocab-file and --merge-file are GPT2BPETokenizer's files, not ", type,
              "'s");
  if (type == "ByteTokenizer") return std::make_unique<ByteLevelTokenizer>();
  if (sentencepiece) return std::make_unique<SentencePieceTokenizer>(spec.model);
  if (type == "GPT2BPETokenizer") return make_gpt2_bpe_tokenizer(spec.vocab_file, spec.merge_file);
  if (type == "TikTokenizer") return make_tiktoken_tokenizer(spec);
  if (type == "HuggingFaceTokenizer") return make_hugging_face_tokenizer(spec.model);
  if (type == "NullTokenizer") {
    TORCH_CHECK(spec.vocab_size > 0, "actmem: --tokenizer-type NullTokenizer needs --vocab-size");
    return make_null_tokenizer(spec.vocab_size);
  }
  TORCH_CHECK(false, "actmem: unknown --tokenizer-type '", type,
              "'; expected ByteTokenizer, SentencePieceTokenizer (or Megatron's "
              "GPTSentencePieceTokenizer, Llama2Tokenizer), GPT2BPETokenizer, TikTokenizer, "
              "HuggingFaceTokenizer or NullTokenizer");
}

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& type, const std::string& model_path) {
  TokenizerSpec spec;
  spec.type = type;
  spec.model = model_path;
  return make_tokenizer(spec);
}

int64_t padded_vocab_size(int64_t vocab_size, int64_t divisible_by, int64_t tp_size) {
  TORCH_CHECK(vocab_size > 0 && divisible_by > 0 && tp_size > 0,
              "actmem::padded_vocab_size: "
              "expected positive sizes, got ",
              vocab_size, ", ", divisible_by, ", ", tp_size);
  const int64_t multiple = divisible_by * tp_size;
  return (vocab_size + multiple - 1) / multiple * multiple;
}

void train_sentencepiece(const std::string& input, const std::string& model_prefix,
                         int64_t vocab_size, int threads) {
  TORCH_CHECK(vocab_size >= 8, "actmem: --vocab-size ", vocab_size,
              " is too small for a "
              "SentencePiece model");
  // --minloglevel quiets SentencePiece's informational lines; its errors come back on stderr.
  Child c =
      spawn_helper({sentencepiece_helper(), "train", "--input=" + input,
                    "--model_prefix=" + model_prefix, "--vocab_size=" + std::to_string(vocab_size),
                    "--num_threads=" + std::to_string(std::max(1, threads)),
                    "--character_coverage=1.0", "--minloglevel=2"},
                   /*capture_stderr=*/true);
  ::close(c.in);
  std::string err, out;
  char buf[4096];
  for (ssize_t r; (r = ::read(c.err, buf, sizeof(buf))) != 0;) {
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) break;
    err.append(buf, static_cast<size_t>(r));
  }
  ::close(c.err);
  ::close(c.out);
  int status = 0;
  ::waitpid(c.pid, &status, 0);
  // Keep SentencePiece's error lines, not its log of the command it ran.
  std::string kept;
  for (size_t pos = 0; pos < err.size();) {
    size_t end = err.find('\n', pos);
    if (end == std::string::npos) end = err.size();
    const std::string line = err.substr(pos, end - pos);
    if (!line.empty() && line.find("LOG(INFO)") == std::string::npos)
      kept += (kept.empty() ? "" : "; ") + line;
    pos = end + 1;
  }
  err = kept;
  TORCH_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0,
              "actmem: training a SentencePiece "
              "model of ",
              vocab_size, " pieces on ", input, " failed: ",
              err.empty() ? std::string("actmem-sentencepiece exited abnormally") : err);
}

}  // namespace actmem
