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
//   A request cut short ends the helper (exit 1), an unknown one too (exit 2): actmem sees the
//   pipe close. The serving loop is actmem::spm::Server (sentencepiece_serve.h).
#include "sentencepiece_serve.h"

#include <sentencepiece_trainer.h>

#include <cstdio>
#include <iostream>
#include <string>

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "serve" && argc == 3) return actmem::spm::Server(argv[2]).serve(stdin, stdout);
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
