// command_line.cpp — the `actmem` command line as main() parses it, shared with the argv fuzz
// target (fuzz/fuzz_argv.cpp) so that what is fuzzed is what users run.
#include "actmem/flags/presets.h"
#include "commands.h"

#include <CLI/CLI.hpp>

#include <c10/util/Exception.h>

#include <algorithm>
#include <set>

namespace actmem::cli {
namespace {

// Note [Last value wins]
// Megatron parses its flags with argparse, where a repeated flag takes its last value, and launch
// scripts rely on it (`$BASE_ARGS $OVERRIDES`). CLI11 refuses a repeated scalar and concatenates a
// repeated list, so before parsing, every earlier occurrence of a long option is dropped with its
// values (the tokens up to the next "--name"). Parsing stops at a bare "--": what follows belongs
// to the command `actmem launch` starts, which applies the same rule itself.
std::vector<std::string> last_occurrence_wins(std::vector<std::string> args) {
  const auto is_option = [](const std::string& a) { return a.size() > 2 && a.rfind("--", 0) == 0; };
  const auto name_of = [](const std::string& a) { return a.substr(0, a.find('=')); };
  const size_t end = std::find(args.begin(), args.end(), "--") - args.begin();
  std::vector<bool> drop(args.size(), false);
  std::set<std::string> seen;
  for (size_t i = end; i-- > 0;) {
    if (!is_option(args[i])) continue;
    if (seen.insert(name_of(args[i])).second) continue;
    // An earlier occurrence: drop it and its values.
    for (size_t j = i; j < end && (j == i || !is_option(args[j])); ++j) drop[j] = true;
  }
  std::vector<std::string> kept;
  for (size_t i = 0; i < args.size(); ++i) {
    if (!drop[i]) kept.push_back(args[i]);
  }
  return kept;
}

}  // namespace

std::vector<Runner> add_commands(CLI::App& app) {
  app.require_subcommand(1);
  std::vector<Runner> commands = {
      add_train_command(app),      add_estimate_command(app),   add_inspect_command(app),
      add_compare_command(app),    add_plan_command(app),       add_launch_command(app),
      add_dist_check_command(app), add_preprocess_command(app), add_generate_command(app),
  };
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) sub->fallthrough();
  return commands;
}

// Note [torchrun's command line]
// torchrun takes the script and its flags after its own, without a "--": `torchrun
// --nproc_per_node 8 pretrain_gpt.py --num-layers 96 ...`, the form of Megatron's example scripts.
// Every flag of `actmem launch` takes one value, so the first word after them is the command:
// what follows is the workers'. Megatron's GPT script, pretrain_gpt.py (any directory), stands for
// `train`; another Python script is not something actmem runs.
void split_launch_command(std::vector<std::string>& given) {
  const auto dashes = std::find(given.begin(), given.end(), "--");
  if (dashes != given.end()) {
    launch_worker_command().assign(dashes + 1, given.end());
    given.erase(dashes, given.end());
    return;
  }
  size_t i = 1;
  while (i < given.size() && given[i].rfind("--", 0) == 0 && given[i] != "--help" &&
         given[i] != "-h") {
    i += given[i].find('=') == std::string::npos ? 2 : 1;
  }
  if (i >= given.size() || given[i] == "--help" || given[i] == "-h") return;
  std::vector<std::string> command(given.begin() + static_cast<std::ptrdiff_t>(i), given.end());
  const std::string& script = command[0];
  const bool python = script.size() > 3 && script.compare(script.size() - 3, 3, ".py") == 0;
  if (python) {
    const std::string base = script.substr(script.rfind('/') + 1);
    TORCH_CHECK(base == "pretrain_gpt.py", "actmem launch: ", script,
                " is a Python script; "
                "actmem runs its own commands (train, inspect, dist-check, ...), and Megatron's "
                "pretrain_gpt.py stands for train");
    command[0] = "train";
  }
  launch_worker_command() = std::move(command);
  given.resize(i);
}

void parse_command_line(CLI::App& app, std::vector<std::string> given) {
  if (!given.empty() && given[0] == "launch") split_launch_command(given);
  // A preset stands for its flags, ahead of the command's own (Note [Presets are command lines]
  // in flags/presets.h), before the last of each flag is kept.
  std::vector<std::string> args = last_occurrence_wins(expand_model_preset(given));
  std::reverse(args.begin(), args.end());  // CLI11 takes its argument list reversed
  app.parse(args);
}

}  // namespace actmem::cli
