// main.cpp — the `actmem` command line. Library code throws; only this file turns errors into
// messages on stderr and exit codes.
#include "actmem/base/blas.h"
#include "actmem/flags/presets.h"
#include "commands.h"

#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>

#include <algorithm>
#include <iostream>
#include <set>
#include <string>
#include <vector>

namespace {
// First line of an error message, without libtorch's "Exception raised from" context.
std::string first_line(const std::string& text) {
  const auto nl = text.find('\n');
  return nl == std::string::npos ? text : text.substr(0, nl);
}

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

int main(int argc, char** argv) {
  actmem::set_reproducible_blas();  // before any product (Note [Reproducible products])
  CLI::App app{"actmem: train transformers on libtorch with managed activation memory"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Show help for every subcommand");
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return "error: " + std::string(e.what()) + " (run with --help for usage)\n";
  });
  const std::vector<actmem::cli::Runner> commands = {
      actmem::cli::add_train_command(app),
      actmem::cli::add_estimate_command(app),
      actmem::cli::add_inspect_command(app),
      actmem::cli::add_compare_command(app),
      actmem::cli::add_plan_command(app),
      actmem::cli::add_launch_command(app),
      actmem::cli::add_dist_check_command(app),
      actmem::cli::add_preprocess_command(app),
      actmem::cli::add_generate_command(app),
  };
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) sub->fallthrough();
  try {
    // A preset stands for its flags, ahead of the command's own (Note [Presets are command lines]
    // in flags/presets.h), before the last of each flag is kept.
    std::vector<std::string> given(argv + 1, argv + argc);
    if (!given.empty() && given[0] == "launch") {
      const auto dashes = std::find(given.begin(), given.end(), "--");
      if (dashes != given.end()) {
        actmem::cli::launch_worker_command().assign(dashes + 1, given.end());
        given.erase(dashes, given.end());
      }
    }
    std::vector<std::string> args = last_occurrence_wins(actmem::expand_model_preset(given));
    std::reverse(args.begin(), args.end());  // CLI11 takes its argument list reversed
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    for (const auto& command : commands) {
      const int rc = command();
      if (rc < 0) continue;
      // A table or report that did not reach its destination (a full disk behind a redirect,
      // /dev/full) is a failure, not a silent success.
      std::cout.flush();
      TORCH_CHECK(!std::cout.fail(), "actmem: writing to standard output failed");
      return rc;
    }
  } catch (const c10::Error& e) {
    std::cerr << "error: " << first_line(e.msg()) << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << first_line(e.what()) << std::endl;
    return 1;
  }
  return 0;
}
