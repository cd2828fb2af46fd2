#include "util/version.h"

#include "absl/strings/str_cat.h"
#include "karakv_version_info.h"  // generated at build time (cmake/version_info.cmake)

namespace karakv {

const char* version() { return KARAKV_VERSION_STRING; }
const char* git_revision() { return KARAKV_GIT_REVISION_STRING; }
std::string version_line(const std::string& program) {
  return absl::StrCat(program, " ", version(), " (git ", git_revision(), ")\n");
}

}  // namespace karakv
