// EXPECT_TRUE(throws_error_with([&] { ... }, {"part", ...})): the body must throw ringattn::Error
// whose message contains every part (and, when given, of the given kind). On failure the report
// shows the message that was thrown, or that none was.
#pragma once

#include <gtest/gtest.h>

#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

#include "ringattn/error.hpp"

namespace ringattn::test {

template <typename Body>
::testing::AssertionResult throws_error_with(Body&& body,
                                             std::initializer_list<std::string_view> parts,
                                             std::optional<ErrorKind> kind = std::nullopt) {
  try {
    body();
  } catch (const Error& error) {
    const std::string message = error.what();
    for (const std::string_view part : parts) {
      if (message.find(part) == std::string::npos) {
        return ::testing::AssertionFailure()
               << "the message lacks \"" << part << "\"; it is: " << message;
      }
    }
    if (kind && error.kind() != *kind) {
      return ::testing::AssertionFailure()
             << "the error kind is " << static_cast<int>(error.kind()) << ", expected "
             << static_cast<int>(*kind) << "; message: " << message;
    }
    return ::testing::AssertionSuccess() << message;
  }
  return ::testing::AssertionFailure() << "nothing was thrown";
}

}  // namespace ringattn::test
