// commands.h — the subcommands of the `actmem` program. Each registers its flags on a CLI11
// subcommand and returns a runner that may throw; main() turns errors into exit codes.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace CLI {
class App;
}
namespace actmem {
struct TransformerConfig;
}

namespace actmem::cli {

using Runner = std::function<int()>;

/// The default model of compare and plan (4 layers, h 128, s 256, b 4): large enough for the
/// strategies to differ visibly, about 10 s for compare's default strategies.
void set_demo_model(TransformerConfig& model);

Runner add_train_command(CLI::App& app);
Runner add_estimate_command(CLI::App& app);
Runner add_inspect_command(CLI::App& app);
Runner add_compare_command(CLI::App& app);
Runner add_plan_command(CLI::App& app);
Runner add_launch_command(CLI::App& app);
/// The words after launch's "--", exactly as given: main takes them out of the command line
/// before CLI11 parses it, which would split a list-looking word such as [0,1,1] at its commas.
std::vector<std::string>& launch_worker_command();
Runner add_dist_check_command(CLI::App& app);
Runner add_preprocess_command(CLI::App& app);
Runner add_generate_command(CLI::App& app);

/// Every subcommand above on `app`, in main's order (each runner returns -1 unless its command
/// was chosen).
std::vector<Runner> add_commands(CLI::App& app);
/// Parses the words after the program name as main() does: launch's worker command taken out
/// after "--", a preset expanded into its flags, the last occurrence of each flag kept (Note
/// [Last value wins] in command_line.cpp). Throws CLI::ParseError, and c10::Error for an unknown
/// preset.
void parse_command_line(CLI::App& app, std::vector<std::string> given);

}  // namespace actmem::cli
