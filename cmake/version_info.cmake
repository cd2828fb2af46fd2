# cmake -DIN=... -DOUT=... -DKARAKV_VERSION=... [-DKARAKV_REVISION=...] -DSOURCE_DIR=... -P version_info.cmake
# Writes OUT from IN with the version and the git revision: KARAKV_REVISION when given, else
# `git rev-parse --short HEAD` of SOURCE_DIR, else "unknown" (a source tree without .git, or no git).
# configure_file leaves OUT untouched when its content would not change.
if(NOT KARAKV_REVISION)
  execute_process(COMMAND git -C ${SOURCE_DIR} rev-parse --short HEAD
                  OUTPUT_VARIABLE KARAKV_REVISION OUTPUT_STRIP_TRAILING_WHITESPACE
                  RESULT_VARIABLE git_result ERROR_QUIET)
  if(NOT git_result EQUAL 0 OR KARAKV_REVISION STREQUAL "")
    set(KARAKV_REVISION "unknown")
  endif()
endif()
configure_file(${IN} ${OUT} @ONLY)
