// Buffer checks of the XLA FFI handlers (ffi.cc), whose failures name the
// shapes and dtypes involved.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jax_ring {

namespace ffi = xla::ffi;

// "(2, 128, 8, 192)"
template <typename Dims>
inline std::string Shape(const Dims& dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) {
    s += (i ? ", " : "") + std::to_string(dims[i]);
  }
  return s + ")";
}

inline std::string Shape(const ffi::AnyBuffer& x) {
  return Shape(x.dimensions());
}

// The dims of `x` as a vector, with `lead` in front.
inline std::vector<int64_t> DimsOf(const ffi::AnyBuffer& x,
                                   std::vector<int64_t> lead = {}) {
  for (int64_t d : x.dimensions()) lead.push_back(d);
  return lead;
}

inline ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("jax_ring cuDNN attention: " + what);
}

inline const char* DtypeName(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::BF16: return "bfloat16";
    case ffi::F16: return "float16";
    case ffi::F32: return "float32";
    default: return "of another dtype";
  }
}

// `x` (`name`) must have shape `dims` (`legend` names its axes) and `dtype`.
inline ffi::Error Expect(const char* name, const ffi::AnyBuffer& x,
                         const std::vector<int64_t>& dims, const char* legend,
                         ffi::DataType dtype) {
  if (x.dimensions() == ffi::Span<const int64_t>(dims) &&
      x.element_type() == dtype) {
    return ffi::Error::Success();
  }
  return Invalid(std::string(name) + " " + Shape(x) + " " +
                 DtypeName(x.element_type()) + " must be " + Shape(dims) +
                 " " + legend + " " + DtypeName(dtype));
}

// The first of `checks` that failed, else success.
inline ffi::Error FirstFailure(std::initializer_list<ffi::Error> checks) {
  for (const ffi::Error& e : checks) {
    if (e.failure()) return e;
  }
  return ffi::Error::Success();
}

}  // namespace jax_ring
