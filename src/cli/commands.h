// commands.h — the subcommands of the `actmem` program. Each registers its flags on a CLI11
// subcommand and returns a runner that may throw; main() turns errors into exit codes.
#pragma once

#include <functional>

namespace CLI {
class App;
}

namespace actmem::cli {

using Runner = std::function<int()>;

Runner add_train_command(CLI::App& app);
Runner add_estimate_command(CLI::App& app);
Runner add_inspect_command(CLI::App& app);
Runner add_compare_command(CLI::App& app);
Runner add_plan_command(CLI::App& app);
Runner add_launch_command(CLI::App& app);
Runner add_dist_check_command(CLI::App& app);
Runner add_preprocess_command(CLI::App& app);
Runner add_generate_command(CLI::App& app);

}  // namespace actmem::cli
