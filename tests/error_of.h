#pragma once
// The message of the exception a call throws, for the tests that check an error's text.
#include <gtest/gtest.h>

#include <exception>
#include <string>

#include "core/error.h"

namespace conduit::test {

// The message of the E thrown by f; a test failure (and "") when f throws nothing or something else.
template <class E = Error, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw the wrong exception type: " << e.what();
    return "";
  }
  ADD_FAILURE() << "did not throw";
  return "";
}

}  // namespace conduit::test
