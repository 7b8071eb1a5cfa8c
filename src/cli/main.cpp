// main.cpp — the `actmem` command line. Library code throws; only this file turns errors into
// messages on stderr and exit codes.
#include "actmem/process.h"
#include "commands.h"

#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>

#include <iostream>

namespace {
// First line of an error message, without libtorch's "Exception raised from" context.
std::string first_line(const std::string& text) {
  const auto nl = text.find('\n');
  return nl == std::string::npos ? text : text.substr(0, nl);
}
}  // namespace

int main(int argc, char** argv) {
  actmem::ensure_passive_openmp_wait(argv);
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
      actmem::cli::add_launch_command(app),
      actmem::cli::add_dist_check_command(app),
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    for (const auto& command : commands) {
      const int rc = command();
      if (rc >= 0) return rc;
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
