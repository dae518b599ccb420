// The command-line checks every ringattn tool shares: validators whose messages name the option,
// its value and what it takes; a parse that names unknown arguments before missing ones; output
// files checked writable at startup; sizes checked against the host's memory before anything is
// allocated. Header-only: each tools/<name>.cpp is a program of its own.
#pragma once

#include <fcntl.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "ringattn/error.hpp"

namespace ringattn::tools {

inline constexpr std::int64_t kNoLimit = std::numeric_limits<std::int64_t>::max();

namespace detail {

// `text` as a whole number in [lo, hi]: from_chars refuses blanks, a "+" and the overflow that
// CLI11's own conversion lets through (it clamps 99999999999999999999 to the largest int64).
template <typename T>
bool whole_number_in(std::string_view text, T lo, T hi) {
  T value{};
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  return error == std::errc{} && end == text.data() + text.size() && value >= lo && value <= hi;
}

inline std::string range_text(std::int64_t lo, std::int64_t hi) {
  if (hi == kNoLimit) return ringattn::detail::concat(">= ", lo);
  return ringattn::detail::concat("from ", lo, " to ", hi);
}

// How the help names a range: INT:POSITIVE, INT:NONNEGATIVE, INT:in [1, 1048576].
inline std::string range_name(std::int64_t lo, std::int64_t hi) {
  if (hi == kNoLimit && (lo == 0 || lo == 1)) return lo == 1 ? "POSITIVE" : "NONNEGATIVE";
  if (hi == kNoLimit) return ringattn::detail::concat(">= ", lo);
  return ringattn::detail::concat("in [", lo, ", ", hi, "]");
}

}  // namespace detail

// A whole number from lo to hi: "--cases: got '0', expected a whole number >= 1".
inline CLI::Validator whole_number(std::int64_t lo, std::int64_t hi = kNoLimit) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        if (detail::whole_number_in(text, lo, hi)) return {};
        return "got '" + text + "', expected a whole number " + detail::range_text(lo, hi);
      },
      detail::range_name(lo, hi));
}

// A seed: any whole number that fits 64 bits unsigned (CLI11 would take -1 as 2^64 - 1).
inline CLI::Validator seed_number() {
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  return CLI::Validator(
      [](std::string& text) -> std::string {
        if (detail::whole_number_in<std::uint64_t>(text, 0, kMax)) return {};
        return "got '" + text + "', expected a whole number from 0 to " + std::to_string(kMax);
      },
      "NONNEGATIVE");
}

// Comma-separated whole numbers, each from lo to hi, at least one:
// "--seqlens: got '512,0', expected comma-separated whole numbers from 1 to 2147483647".
inline CLI::Validator whole_number_list(std::int64_t lo, std::int64_t hi = kNoLimit) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        std::string_view rest = text;
        bool ok = true;
        while (ok) {
          const std::size_t comma = rest.find(',');
          ok = detail::whole_number_in(rest.substr(0, comma), lo, hi);
          if (comma == std::string_view::npos) break;
          rest.remove_prefix(comma + 1);
        }
        if (ok) return {};
        return "got '" + text + "', expected comma-separated whole numbers " +
               detail::range_text(lo, hi);
      },
      "LIST " + detail::range_name(lo, hi));
}

// A finite number above 0 (CLI::PositiveNumber takes nan and prints its range as 1.8e308 digits).
inline CLI::Validator positive_real() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        double value = 0.0;
        const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
        if (error == std::errc{} && end == text.data() + text.size() && std::isfinite(value) &&
            value > 0) {
          return {};
        }
        return "got '" + text + "', expected a finite number > 0";
      },
      "POSITIVE");
}

// What parsing a command line gave: run (exit_code < 0), print help (0) or refuse it (2).
struct CommandLine {
  std::vector<std::string> args;  // argv as given, argv[0] first
  int exit_code = -1;
  std::string text;         // the help when exit_code is 0, the error when it is 2
  int cli11_exit_code = 0;  // CLI11's own status of the error (ringattn-train exits with it)
};

// Parses without printing. CLI11 checks for missing options and subcommands before it reports
// arguments it does not know ("--bogus" would read "A subcommand is required"): those come first.
inline CommandLine parse_command_line(CLI::App& app, int argc, char** argv) {
  CommandLine line;
  line.args.assign(argv, argv + argc);
  try {
    try {
      app.parse(argc, argv);
    } catch (const CLI::RequiredError&) {
      if (!app.remaining().empty()) throw CLI::ExtrasError(app.remaining());
      throw;
    }
  } catch (const CLI::CallForHelp&) {
    line.exit_code = 0;
    line.text = app.help();
  } catch (const CLI::CallForAllHelp&) {
    line.exit_code = 0;
    line.text = app.help("", CLI::AppFormatMode::All);
  } catch (const CLI::ParseError& error) {
    line.exit_code = 2;
    line.text = error.what();
    line.cli11_exit_code = error.get_exit_code();
  }
  return line;
}

// For a tool of one process: prints the help (stdout) or the error (stderr, after `tool`) that
// parse_command_line found and returns the exit status.
inline int finish_command_line(const CommandLine& line, const char* tool) {
  if (line.exit_code == 0) {
    std::fputs(line.text.c_str(), stdout);
  } else {
    std::fprintf(stderr, "%s: %s\nRun with --help for more information.\n", tool,
                 line.text.c_str());
  }
  return line.exit_code;
}

// "" when this process can write `path`, else "OPTION 'PATH' cannot be written: REASON". An
// existing file is opened for appending (its contents stay); a file this creates is removed
// again. A tool that writes its results at the end checks here, before it starts.
inline std::string unwritable(std::string_view option, const std::string& path) {
  if (path.empty()) return {};
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  const bool created = fd >= 0;
  if (fd < 0 && errno == EEXIST) fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  if (fd < 0) {
    return ringattn::detail::concat(option, " '", path,
                                    "' cannot be written: ", std::strerror(errno));
  }
  ::close(fd);
  if (created) ::unlink(path.c_str());
  return {};
}

// This machine's physical memory in bytes; 0 when the system does not say.
inline double host_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page_bytes = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page_bytes > 0 ? static_cast<double>(pages) * static_cast<double>(page_bytes)
                                     : 0.0;
}

// "" when `bytes` fit in the host's memory, else "SETTING needs at least N GiB of host memory
// (WHAT); this machine has M GiB". The sizes are computed in double, which no product of the
// options can overflow, so an absurd setting is refused before any int64 size is formed.
inline std::string host_memory_shortfall(const std::string& setting, double bytes,
                                         const std::string& what) {
  const double have = host_memory_bytes();
  if (have == 0.0 || bytes <= have) return {};
  char text[160];
  std::snprintf(text, sizeof(text), " needs at least %.4g GiB of host memory (", bytes / 0x1p30);
  char tail[64];
  std::snprintf(tail, sizeof(tail), "); this machine has %.1f GiB", have / 0x1p30);
  return setting + text + what + tail;
}

}  // namespace ringattn::tools
