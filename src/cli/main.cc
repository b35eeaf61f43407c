// `conduit`: one binary for every subcommand (launch, bench, train, sim, ...).
#include <fcntl.h>
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "cli/launcher.h"
#include "cli/registry.h"
#include "core/env.h"
#include "core/error.h"
#include "core/log.h"
#include "core/malloc_tuning.h"
#include "net/mpi_transport.h"

namespace conduit::cli {
namespace {

struct Entry {
  int order;
  Setup setup;
};

std::vector<Entry>& entries() {
  static std::vector<Entry> e;
  return e;
}

int& exit_code() {
  static int code = 0;
  return code;
}

}  // namespace

bool register_command(int order, Setup setup) {
  entries().push_back({order, std::move(setup)});
  return true;
}

void set_exit_code(int code) { exit_code() = code; }

std::string gnuplot_quote(const std::string& text) {
  std::string out = "'";
  for (char c : text) {
    if (c == '\'')
      out += "''";
    else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f)
      out += ' ';
    else
      out += c;
  }
  return out + "'";
}

CLI::App* subcommand_group(CLI::App& app, const std::string& name, const std::string& description) {
  for (auto* sub : app.get_subcommands([](CLI::App*) { return true; }))
    if (sub->get_name() == name) return sub;
  auto* g = app.add_subcommand(name, description);
  g->require_subcommand(1);
  return g;
}

// Integers out of range are refused: CLI11 takes strtoll's clamped value (-99999999999999999999 became LLONG_MIN,
// which some commands use for "left out", and 99999999999999999999 was echoed back as 9223372036854775807); and so
// are leading zeros and 0x (CLI11 reads base 0: 010 was 8), and anything but digits after an optional minus sign
// (strtoll skipped leading blanks and took a '+': -n ' 2' and +2 were 2; an unsigned option wrapped -1 to 2^64 - 1).
// Floating-point options take decimal numbers only.
void refuse_malformed_numbers(CLI::App& app) {
  for (CLI::Option* o : app.get_options()) {
    const std::string type = o->get_type_name();
    if (type.find("FLOAT") != std::string::npos && o->get_items_expected_max() != 0) {
      // Numbers as a person writes them: CLI11 reads floats with strtod, which also took 0x10, leading blanks, a '+',
      // inf and nan (launch --timeout 0x10 was a 16 s deadline).
      o->check(CLI::Validator(
          [](std::string& s) {
            return !s.empty() && s[0] != '+' && is_decimal(s, true)
                       ? std::string()
                       : "'" + s + "': a decimal number (digits, an optional fraction and exponent; no blanks, '+', " +
                             "hexadecimal, inf or nan)";
          },
          ""));
      continue;
    }
    if (type.find("INT") == std::string::npos || o->get_type_size_max() == 0) continue;  // (a flag counts itself)
    const bool is_unsigned = type.find("UINT") != std::string::npos;
    o->check(CLI::Validator(
        [is_unsigned](std::string& s) {
          const size_t at = !s.empty() && s[0] == '-' ? 1 : 0;
          // (CLI11 reads integers in base 0: 010 was 8 and 0x10 16)
          if (at + 1 < s.size() && s[at] == '0' &&
              (std::isdigit(static_cast<unsigned char>(s[at + 1])) || std::strchr("xXbBoO", s[at + 1]) != nullptr))
            return "'" + s +
                   "': a decimal integer without leading zeros (0x and 0 prefixes read as hexadecimal and octal)";
          if (s.size() == at || s.find_first_not_of("0123456789", at) != std::string::npos || (is_unsigned && at == 1))
            return "'" + s + "': " + (is_unsigned ? "a whole number" : "an integer") +
                   " in decimal digits (no blanks, no '+'" + (is_unsigned ? ", not negative)" : ")");
          errno = 0;
          char* end = nullptr;
          bool least = false;  // (LLONG_MIN itself: some commands read it as "left out")
          if (is_unsigned)
            (void)std::strtoull(s.c_str(), &end, 0);
          else
            least = std::strtoll(s.c_str(), &end, 0) == std::numeric_limits<long long>::min();
          return errno == ERANGE || least
                     ? "an integer out of range: " + s +
                           (is_unsigned ? " (allowed: at most 18446744073709551615, or the option's own range)"
                                        : " (allowed: -9223372036854775807 to 9223372036854775807 at most, or the "
                                          "option's own range)")
                     : std::string();
        },
        ""));
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) refuse_malformed_numbers(*sub);
}

// The commands that run a program (`launch`, `cluster run`, `cluster exec` after its host) take it and its arguments
// from the first positional on, as torchrun and mpirun do, also without "--": that is put in front of it. Without it,
// an option meant for the program after its name went to the launcher (`conduit launch -n 2 prog --timeout 1` killed
// the job after 1 s). Returns argv's arguments, with "--" inserted where it was left out.
std::vector<std::string> mark_program_arguments(CLI::App& app, int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  CLI::App* cur = &app;
  std::string path;  // the subcommands so far, "cluster exec"
  int positionals = 0;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") break;  // marked already
    const auto named = cur->get_subcommands([&a](CLI::App* s) { return s->check_name(a); });
    if (!named.empty() && positionals == 0) {
      cur = named.front();
      path += (path.empty() ? "" : " ") + cur->get_name();
      continue;
    }
    if (a.size() > 1 && a[0] == '-') {
      const CLI::Option* o = cur->get_option_no_throw(a.substr(0, a.find('=')));
      if (o == nullptr && !(a.size() > 2 && a[1] != '-' && cur->get_option_no_throw(a.substr(0, 2)) != nullptr))
        break;  // an unknown option: refused as typed (not with a "--" the user never wrote beside it)
      // CLI11 takes the next argument for the value left out after '=' (`launch --master-addr= prog` said "master
      // address '--' cannot be resolved", the "--" put in front of prog).
      // (only where a value is required: a flag's `--overlap=` reads as the bare flag, as CLI11 takes it)
      if (o != nullptr && o->get_items_expected_min() > 0 && a.starts_with("--") && a.find('=') == a.size() - 1) {
        const std::string name = a.substr(0, a.size() - 1);
        throw ConfigError(fmt::format("{}option '{}' has no value after '='; allowed: {}=VALUE or {} VALUE",
                                      path.empty() ? "" : path + ": ", a, name, name));
      }
      if (o != nullptr && a.find('=') == std::string::npos) {
        // Its values: one always (-1 is a value), more while they do not look like options.
        const int most = o->get_items_expected_max();
        for (int v = 0; v < most && i + 1 < args.size() && (v == 0 || args[i + 1][0] != '-'); ++v) ++i;
      }
      continue;
    }
    const bool runs_program = path == "launch" || path == "cluster run" || path == "cluster exec";
    const int before = path == "cluster exec" ? 1 : 0;  // (its host)
    if (runs_program && positionals == before) {
      args.insert(args.begin() + std::ptrdiff_t(i), "--");
      break;
    }
    ++positionals;
  }
  return args;
}

// The arguments no command took (CLI11's own message lists them last first, and names no command).
void collect_leftovers(CLI::App* a, std::vector<std::string>& out) {
  for (const auto& s : a->remaining(false))
    if (s != "--") out.push_back(s);
  for (CLI::App* sub : a->get_subcommands()) collect_leftovers(sub, out);
}

CLI::App* deepest_command(CLI::App* a, std::string& path) {
  for (CLI::App* sub : a->get_subcommands()) {
    path += " " + sub->get_name();
    return deepest_command(sub, path);
  }
  return a;
}

// One line for arguments a command does not take, or a command group given no command or an unknown one: what was
// given, where, and what is allowed.
std::string parse_error_line(CLI::App& app, const CLI::ParseError& e, const std::vector<std::string>& given) {
  const bool extras = dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr;
  // (by its type and CLI11's own words, not by a word anywhere in it: a value typed "subcommand" was taken for one)
  const std::string_view what = e.what();
  const bool no_command = dynamic_cast<const CLI::RequiredError*>(&e) != nullptr &&
                          (what.rfind("A subcommand", 0) == 0 || what.rfind("Requires at least", 0) == 0);
  if (!extras && !no_command) return fmt::format("{} (see --help)", e.what());
  std::vector<std::string> left;
  collect_leftovers(&app, left);
  std::string path = "conduit";
  CLI::App* at = deepest_command(&app, path);
  // An unknown option is named first wherever the parse stopped (`conduit --bogus` said a command is required).
  for (const std::string& a : left)
    if (a.size() > 1 && a[0] == '-') {
      // One the command takes, left over: it was typed before the command's name, where its group does not take it
      // (`conduit cluster --name x down` said down had no --name).
      // (as typed: before the command's name and before any "--", after which it is an argument)
      const std::string name = a.substr(0, a.find('='));
      auto first = [&](const std::string& t) { return std::find(given.begin(), given.end(), t) - given.begin(); };
      const auto typed_at = first(a);
      if (at != &app && at->get_option_no_throw(name) != nullptr && typed_at < first(at->get_name()) &&
          typed_at < first("--"))
        return fmt::format(
            "{}: option '{}' was given before the command '{}'; allowed: the command's options after "
            "its name ({} {} ...)",
            path, name, at->get_name(), path, name);
      return fmt::format("{}: unknown option '{}'; allowed: the options `{} --help` lists", path, a, path);
    }
  if (no_command) {
    std::vector<std::string> names;
    // (hidden ones, of an empty group, left out)
    for (const CLI::App* s :
         at->get_subcommands([](const CLI::App* s) { return !s->get_name().empty() && !s->get_group().empty(); }))
      names.push_back(s->get_name());
    const std::string allowed = fmt::format("allowed: {}", fmt::join(names, ", "));
    if (!left.empty())  // (not an option: those were named above)
      return fmt::format("{}: '{}' is not one of its commands; {} (see {} --help)", path, left.front(), allowed, path);
    return fmt::format("{}: a command is required; {} (see {} --help)", path, allowed, path);
  }
  if (left.empty()) return fmt::format("{} (see --help)", e.what());
  // (options were named above, after the command typed last: CLI11 hands one its subcommand does not know to the
  // parent)
  return fmt::format("{}: unexpected argument{}: {} (see {} --help)", path, left.size() > 1 ? "s" : "",
                     fmt::join(left, " "), path);
}

}  // namespace conduit::cli

int main(int argc, char** argv) {
  using namespace conduit::cli;
  // A closed stdin, stdout or stderr (`>&-`, a daemon's) becomes /dev/null: left closed, the next descriptor opened
  // took its number (the launcher's signal pipe became stdout, the workers' output went into its read end, waited on
  // for room forever, and the launch never returned).
  for (int fd = 0; fd <= 2; ++fd)
    if (::fcntl(fd, F_GETFD) < 0 && errno == EBADF) ::open("/dev/null", O_RDWR);  // (the lowest free number: fd)
  CLI::App app{"Conduit: communication-efficient distributed deep learning"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "conduit 0.1.0");
  auto es = entries();
  std::stable_sort(es.begin(), es.end(), [](const Entry& a, const Entry& b) { return a.order < b.order; });
  for (auto& e : es) e.setup(app);
  refuse_malformed_numbers(app);
  // A bad CONDUIT_MALLOC_TUNING or CONDUIT_LOG_LEVEL is reported once the arguments are parsed, before any command
  // runs (CLI11 calls the main app's parse-complete callback ahead of the commands'): --help and --version, which
  // stop the parse before it, still answer (both failed on it).
  std::exception_ptr bad_environment;
  try {
    conduit::tune_malloc();  // before any large allocation: see core/malloc_tuning.h
    conduit::log_level_from_env();
  } catch (...) {
    bad_environment = std::current_exception();
  }
  app.parse_complete_callback([&bad_environment] {
    if (bad_environment) std::rethrow_exception(bad_environment);
  });
  try {
    std::vector<std::string> args = mark_program_arguments(app, argc, argv);
    std::reverse(args.begin(), args.end());  // (CLI11 takes them last first)
    app.name(argc > 0 ? argv[0] : "conduit");  // (what parse(argc, argv) names the usage lines with)
    app.parse(args);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // One line and exit code 2, as every other bad input (CLI11 prints two lines and its own codes, e.g. 104).
    std::string line;
    try {
      line = parse_error_line(app, e, std::vector<std::string>(argv + 1, argv + argc));
    } catch (const std::exception&) {
      line = fmt::format("{} (see --help)", e.what());
    }
    std::fprintf(stderr, "conduit: error: %s\n", line.c_str());
    return 2;
  } catch (const conduit::Error& e) {
    std::fprintf(stderr, "conduit: error: %s\n", e.what());
    conduit::net::mpi_exit_after_error(2);  // under mpirun: end the job, not wait for ranks that never come
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "conduit: error: %s\n", e.what());
    conduit::net::mpi_exit_after_error(1);
    return 1;
  }
  // Stopped by SIGINT, SIGTERM or SIGHUP while running workers: end by that signal too (after the workers are gone),
  // so that a shell loop or script running this stops as it would for any program (exit code 130 told bash the
  // signal was handled, and the loop went on). SIGQUIT keeps its exit code: raising it would dump core.
  const int sig = launcher_stop_signal();
  if (sig == SIGINT || sig == SIGTERM || sig == SIGHUP) {
    std::fflush(nullptr);
    std::signal(sig, SIG_DFL);
    std::raise(sig);
  }
  return exit_code();
}
