#pragma once
// Subcommands of `conduit` register themselves from their own file, so areas do not edit one another's code:
//   static const bool kRegistered = conduit::cli::register_command(100, [](CLI::App& app) { ... });
// The setup function adds a subcommand to `app` and its callback. A callback reports its exit code with
// set_exit_code(); conduit::Error escaping a callback prints "conduit: error: <message>" and exits with 2.
#include <CLI/CLI.hpp>
#include <functional>
#include <string>

namespace conduit::cli {

using Setup = std::function<void(CLI::App& app)>;

// `order` sorts the subcommands in --help (launch 10, train 20, bench 30, cluster 40, sweep 50, fl 60, sim 70).
bool register_command(int order, Setup setup);
void set_exit_code(int code);
// The subcommand `name` of `app`, created on first use: lets several files add children to one group
// (`conduit bench coll` and `conduit bench compress` live in different areas).
CLI::App* subcommand_group(CLI::App& app, const std::string& name, const std::string& description);
// `text` as a gnuplot single-quoted string, for the scripts the plotting commands write: nothing inside is expanded
// ('' is a quote; in double quotes gnuplot runs `backquoted` commands), control characters become spaces.
std::string gnuplot_quote(const std::string& text);
// ConfigError unless a given --timeout (opt counted) is a finite number of seconds from 0.001 to 10^6.
void check_timeout_flag(const CLI::Option* opt, double v);
// The ranks on this host: LOCAL_WORLD_SIZE (`conduit launch`, torchrun), else mpirun's OMPI_COMM_WORLD_LOCAL_SIZE,
// else 1.
long long ranks_on_this_host();

}  // namespace conduit::cli
