// fuzz_jsonl.cpp — `actmem preprocess` over a JSON-lines file: the input becomes the --input
// file, tokenized with the byte-level tokenizer into a .bin/.idx pair, which is then read back.
// A malformed line must end the command with c10::Error naming the line.
#include "../src/cli/commands.h"
#include "actmem/data/indexed_dataset.h"
#include "fuzz_util.h"

#include <CLI/CLI.hpp>

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  actmem::fuzz::silence_warnings();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input = actmem::fuzz::scratch("docs.jsonl");
  const std::string out = actmem::fuzz::scratch("out");
  actmem::fuzz::write_file(input, data, size);
  CLI::App app;
  const std::vector<actmem::cli::Runner> commands = actmem::cli::add_commands(app);
  try {
    actmem::cli::parse_command_line(
        app, {"preprocess", "--input", input, "--output-prefix", out, "--tokenizer-type",
              "ByteTokenizer", "--append-eod", "--workers", "1"});
    for (const auto& command : commands) {
      if (command() >= 0) break;
    }
    const actmem::IndexedDataset written(out + "_text_document");
    std::vector<int64_t> tokens;
    for (int64_t i = 0; i < written.num_sequences(); ++i) {
      tokens.clear();
      written.read(i, 0, written.sequence_length(i), tokens);
    }
  } catch (const c10::Error&) {
    // a clear refusal
  }
  return 0;
}
