// sentencepiece_helper.cpp — actmem-sentencepiece: libsentencepiece in a process of its own, for
// the SentencePieceTokenizer (tokenizer.cpp) and `actmem preprocess --vocab-size`.
//
// Note [SentencePiece beside libtorch]
// Debian's libsentencepiece carries its own copy of protobuf and exports its symbols; libtorch
// loads the system libprotobuf. Linked into one program, the first loaded wins the symbol
// lookups of both and the program crashes before main (libprotobuf's static registration calls
// libsentencepiece's MergeFromImpl). dlopen(RTLD_LOCAL | RTLD_DEEPBIND) separates the two but
// breaks libstdc++'s copy-relocated streams (std::cerr) in the library. So SentencePiece runs
// here, in a small process that links no libtorch, and actmem talks to it over two pipes:
//
//   actmem-sentencepiece train ARGS...   SentencePieceTrainer::Train("ARGS..."), exit 0 or 1
//   actmem-sentencepiece serve MODEL     requests on stdin, replies on stdout (native endian):
//     'I'                       -> i32 piece count, i32 </s> id
//     'E' u32 n, n bytes        -> u32 k, k x i32 ids
//     'D' u32 k, k x i32 ids    -> u32 n, n bytes (control pieces skipped)
//   A failed request answers u32 0xFFFFFFFF, u32 n, n bytes of error text.
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <cstdint>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

namespace {

bool read_exact(void* p, size_t n) { return std::fread(p, 1, n, stdin) == n; }
void write_exact(const void* p, size_t n) { std::fwrite(p, 1, n, stdout); }
void put_u32(uint32_t v) { write_exact(&v, 4); }

void fail(const std::string& msg) {
  put_u32(0xFFFFFFFFu);
  put_u32(static_cast<uint32_t>(msg.size()));
  write_exact(msg.data(), msg.size());
}

int serve(const std::string& model) {
  sentencepiece::SentencePieceProcessor sp;
  const auto loaded = sp.Load(model);
  char op = 0;
  while (read_exact(&op, 1)) {
    if (!loaded.ok()) {
      fail(loaded.ToString());
    } else if (op == 'I') {
      const int32_t info[2] = {sp.GetPieceSize(), sp.eos_id()};
      write_exact(info, sizeof(info));
    } else if (op == 'E') {
      uint32_t n = 0;
      if (!read_exact(&n, 4)) return 1;
      std::string text(n, '\0');
      if (n > 0 && !read_exact(text.data(), n)) return 1;
      std::vector<int> ids;
      const auto st = sp.Encode(text, &ids);
      if (!st.ok()) {
        fail(st.ToString());
      } else {
        put_u32(static_cast<uint32_t>(ids.size()));
        write_exact(ids.data(), ids.size() * sizeof(int));
      }
    } else if (op == 'D') {
      uint32_t k = 0;
      if (!read_exact(&k, 4)) return 1;
      std::vector<int> ids(k);
      if (k > 0 && !read_exact(ids.data(), k * sizeof(int))) return 1;
      std::vector<int> kept;
      for (const int id : ids) {
        if (id >= 0 && id < sp.GetPieceSize() && !sp.IsControl(id)) kept.push_back(id);
      }
      std::string text;
      const auto st = sp.Decode(kept, &text);
      if (!st.ok()) {
        fail(st.ToString());
      } else {
        put_u32(static_cast<uint32_t>(text.size()));
        write_exact(text.data(), text.size());
      }
    } else {
      return 2;  // a protocol error: the caller sees the pipe close
    }
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "serve" && argc == 3) return serve(argv[2]);
  if (mode == "train" && argc >= 3) {
    std::string args;
    for (int i = 2; i < argc; ++i) args += (i > 2 ? " " : "") + std::string(argv[i]);
    const auto st = sentencepiece::SentencePieceTrainer::Train(args);
    if (!st.ok()) {
      std::cerr << st.ToString() << "\n";
      return 1;
    }
    return 0;
  }
  std::cerr << "usage: actmem-sentencepiece train ARGS... | serve MODEL (used by actmem)\n";
  return 2;
}
