// Turns MPI return codes into ringattn::Error with MPI's own description.
#pragma once

#include <mpi.h>

#include "ringattn/error.hpp"

namespace ringattn::detail {

inline void check_mpi(int code, const char* call, const char* where) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) text[0] = '\0';
  fail_as(ErrorKind::library, where, call, " failed with MPI error ", code, " (", text, ")");
}

}  // namespace ringattn::detail

// MPI's default handler aborts; communicators used by ringattn set MPI_ERRORS_RETURN so that
// this check sees the code and throws instead.
#define RINGATTN_MPI_CHECK(call) ::ringattn::detail::check_mpi((call), #call, __func__)
