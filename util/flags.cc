#include "util/flags.h"

#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "absl/flags/internal/parse.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/usage.h"
#include "util/version.h"

namespace karakv {

std::vector<char*> parse_command_line(int argc, char** argv, const std::string& program,
                                      absl::FlagsUsageConfig usage) {
  usage.version_string = [program] { return version_line(program); };
  absl::SetFlagsUsageConfig(usage);
  // absl::ParseCommandLine handles the usage flags itself and exits 1 after --help (Abseil
  // 20220623). Parse without that, then handle them here: a request for help that was answered is
  // a success. Unknown flags and bad values still exit 1 with Abseil's message, as before.
  namespace fi = absl::flags_internal;
  std::vector<char*> args =
      fi::ParseCommandLineImpl(argc, argv, fi::ArgvListAction::kRemoveParsedArgs,
                               fi::UsageFlagsAction::kIgnoreUsage, fi::OnUndefinedFlag::kAbortIfUndefined);
  const int handled = fi::HandleUsageFlags(std::cout, absl::ProgramUsageMessage());
  if (handled >= 0) {
    std::cout.flush();
    std::exit(0);
  }
  return args;
}

}  // namespace karakv
