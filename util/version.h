// The project's version (CMakeLists.txt's project VERSION) and the git revision it was built from
// (`git rev-parse --short HEAD` at build time; "unknown" outside a git checkout, or what
// -DKARAKV_GIT_REVISION= says). Shown by --version and by karakvd's karakv_build_info metric.
#pragma once

#include <string>

namespace karakv {

const char* version();       // "0.1.0"
const char* git_revision();  // "76019d8", or "unknown"
// What `<program> --version` prints: "<program> 0.1.0 (git 76019d8)\n".
std::string version_line(const std::string& program);

}  // namespace karakv
