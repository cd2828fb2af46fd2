// Command-line parsing shared by karakvd and the karakv CLI: Abseil's flags, with the conventions
// scripts expect of a command line: --help (--helpfull, --helpshort, ...) prints the usage on
// stdout and exits 0, --version prints version_line(program) and exits 0.
#pragma once

#include <string>
#include <vector>

#include "absl/flags/usage_config.h"

namespace karakv {

// Like absl::ParseCommandLine: returns the positional arguments (argv[0] first). `usage` keeps
// whatever the caller set (which files' flags --help lists); its version_string is replaced.
// Call absl::SetProgramUsageMessage first.
std::vector<char*> parse_command_line(int argc, char** argv, const std::string& program,
                                      absl::FlagsUsageConfig usage = {});

}  // namespace karakv
