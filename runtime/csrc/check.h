// check(condition, parts...): TORCH_CHECK's contract without torch's headers, for the host
// extensions that include pybind11 alone (adamw.cpp, tier_io.cpp): a false condition throws
// std::runtime_error, which pybind11 raises as RuntimeError, its text the parts concatenated.
#pragma once

#include <sstream>
#include <stdexcept>

namespace megatrain {

template <typename... Parts>
void check(bool ok, const Parts&... parts) {
  if (!ok) {
    std::ostringstream text;
    (text << ... << parts);
    throw std::runtime_error(text.str());
  }
}

}  // namespace megatrain
