// Starting a child process for a test: it dies with the test process (PR_SET_PDEATHSIG), so a test
// that crashes leaves nothing running.
#pragma once

#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <string>
#include <vector>

namespace karakv::testing {

// Forks and runs args[0] (searched in PATH) with `args`; the child's pid.
inline pid_t spawn_child(std::vector<std::string> args) {
  const pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execvp(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

}  // namespace karakv::testing
