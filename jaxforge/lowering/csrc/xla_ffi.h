// The XLA FFI API for jaxforge's handlers, and what they share: nvcc's front end and the host
// compiler flag benign patterns in the XLA headers (a missing return after an exhaustive switch,
// always_inline on templates), which are kept out of each build's warnings here, once.
#pragma once

#include <cstdint>
#include <string>

#pragma nv_diagnostic push
#pragma nv_diag_suppress 940, 2473
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wreturn-type"
#include "xla/ffi/api/ffi.h"
#pragma GCC diagnostic pop
#pragma nv_diagnostic pop

namespace jaxforge {

// "(d0, d1, ...)", for error messages that name the shape they refuse.
inline std::string ShapeString(xla::ffi::Span<const int64_t> dims) {
  std::string out = "(";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + ")";
}

}  // namespace jaxforge
