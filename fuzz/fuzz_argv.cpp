// fuzz_argv.cpp — the command line: the input's lines are the words after the program name.
// Every subcommand's flags are parsed as main() parses them (presets expanded, the last
// occurrence of a flag kept); when the words are a train command line, train's options are then
// finalized, which applies every validation rule of the model and training configuration
// (Megatron's among them). A bad command line must throw CLI::ParseError or c10::Error; the
// commands themselves are not run.
#include "../src/cli/commands.h"
#include "actmem/flags/train_options.h"
#include "fuzz_util.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  actmem::fuzz::silence_warnings();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 4096) return 0;
  std::vector<std::string> words(1);
  for (size_t i = 0; i < size; ++i) {
    if (data[i] == '\n') {
      words.emplace_back();
    } else {
      words.back().push_back(static_cast<char>(data[i]));
    }
  }
  try {
    CLI::App app;
    const std::vector<actmem::cli::Runner> commands = actmem::cli::add_commands(app);
    actmem::cli::parse_command_line(app, words);
  } catch (const CLI::ParseError&) {
  } catch (const c10::Error&) {
  }
  if (!words.empty() && words[0] == "train") {
    try {
      // train's flags alone, bound to options this target can finalize.
      CLI::App app;
      actmem::TrainOptions options;
      actmem::add_flags(app, options, actmem::kModelFlags | actmem::kTrainingFlags);
      std::vector<std::string> args(words.begin() + 1, words.end());
      std::reverse(args.begin(), args.end());
      app.parse(args);
      options.finalize();
    } catch (const CLI::ParseError&) {
    } catch (const c10::Error&) {
    }
  }
  return 0;
}
