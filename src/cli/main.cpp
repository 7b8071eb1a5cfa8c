// main.cpp — the `actmem` command line. Library code throws; only this file turns errors into
// messages on stderr and exit codes.
#include "actmem/base/blas.h"
#include "commands.h"

#include <c10/util/Exception.h>
#include <CLI/CLI.hpp>

#include <iostream>
#include <string>
#include <vector>

namespace {
// First line of an error message, without libtorch's "Exception raised from" context.
std::string first_line(const std::string& text) {
  const auto nl = text.find('\n');
  return nl == std::string::npos ? text : text.substr(0, nl);
}

// An actmem error's message: its lines up to libtorch's context ("Exception raised from ..."),
// so a message that lists several things (every refused flag) keeps a line each.
std::string message_lines(const std::string& text) {
  const auto context = text.find("\nException raised from");
  return context == std::string::npos ? text : text.substr(0, context);
}

// A collective that failed (Gloo or NCCL, through c10d): the message without the library's
// "[file.cc:line] " prefix, and what it means for a run under `actmem launch`.
std::string collective_failure(const std::string& text) {
  std::string msg = first_line(text);
  const size_t close = msg.find("] ");
  if (!msg.empty() && msg[0] == '[' && close != std::string::npos && close < 200) {
    msg = msg.substr(close + 2);
  }
  return "actmem: a collective with the other ranks failed: " + msg +
         " (a peer rank failed, hung or went away; a hung one holds a collective for "
         "--distributed-timeout-minutes)";
}
}  // namespace

int main(int argc, char** argv) {
  actmem::set_reproducible_blas();  // before any product (Note [Reproducible products])
  CLI::App app{"actmem: train transformers on libtorch with managed activation memory"};
  app.set_help_all_flag("--help-all", "Show help for every subcommand");
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return "error: " + std::string(e.what()) + " (run with --help for usage)\n";
  });
  const std::vector<actmem::cli::Runner> commands = actmem::cli::add_commands(app);
  try {
    actmem::cli::parse_command_line(app, std::vector<std::string>(argv + 1, argv + argc));
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const c10::Error& e) {
    std::cerr << "error: " << first_line(e.msg()) << std::endl;
    return 1;
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
  } catch (const c10::DistBackendError& e) {
    std::cerr << "error: " << collective_failure(e.msg()) << std::endl;
    return 1;
  } catch (const c10::Error& e) {
    std::cerr << "error: " << message_lines(e.msg()) << std::endl;
    return 1;
  } catch (const std::exception& e) {
    // Gloo reports a failed transfer as its own exception ("[gloo/transport/...cc:N] ...").
    const std::string what = e.what();
    const bool gloo = what.rfind('[', 0) == 0 && what.find("gloo") < what.find("] ");
    std::cerr << "error: " << (gloo ? collective_failure(what) : first_line(what)) << std::endl;
    return 1;
  }
  return 0;
}
