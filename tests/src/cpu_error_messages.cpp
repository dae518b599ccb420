// Error messages are formed without iostreams (detail::concat): numbers read the same whatever the
// global locale, and as `<<` prints them in the classic one (integers, bool as 0 or 1, floating
// point as %g, pointers in hex).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <locale>
#include <sstream>
#include <string>

#include "ringattn/error.hpp"

namespace {

// What a user's locale may set, and iostreams would apply: thousands grouped by ',' and ';' as
// the decimal point.
struct Grouping : std::numpunct<char> {
  char do_decimal_point() const override { return ';'; }
  char do_thousands_sep() const override { return ','; }
  std::string do_grouping() const override { return "\3"; }
};

// Restores the global locale whatever the test's outcome.
struct GlobalLocale {
  std::locale previous;
  explicit GlobalLocale(const std::locale& locale) : previous(std::locale::global(locale)) {}
  ~GlobalLocale() { std::locale::global(previous); }
};

template <typename T>
std::string classic(const T& value) {
  std::ostringstream out;
  out.imbue(std::locale::classic());
  out << value;
  return out.str();
}

TEST(ErrorMessages, IgnoreTheGlobalLocale) {
  std::string message;
  {
    GlobalLocale grouping(std::locale(std::locale::classic(), new Grouping));
    try {
      ringattn::detail::fail("f", "head_dim ", 1024, ", scale ", 0.125, ", count ",
                             std::size_t{1234567}, ", ", -5LL, ", flag ", true);
    } catch (const ringattn::Error& e) {
      message = e.what();
    }
  }
  EXPECT_EQ(message, "f: head_dim 1024, scale 0.125, count 1234567, -5, flag 1");
}

TEST(ErrorMessages, NumbersReadAsTheClassicStreamPrintsThem) {
  using ringattn::detail::concat;
  const double doubles[] = {0.1, 1e-5, 0.125, 3.0, 123456789.0, 1e20, -2.5e-300,
                            std::numeric_limits<double>::infinity(), -0.0, 1.0 / 3.0};
  for (const double x : doubles) EXPECT_EQ(concat(x), classic(x)) << "double " << x;
  EXPECT_EQ(concat(0.1f), classic(0.1f));
  EXPECT_EQ(concat(std::numeric_limits<std::int64_t>::min()),
            classic(std::numeric_limits<std::int64_t>::min()));
  EXPECT_EQ(concat(std::numeric_limits<std::uint64_t>::max()),
            classic(std::numeric_limits<std::uint64_t>::max()));
  int object = 0;
  const void* pointer = &object;
  EXPECT_EQ(concat(pointer), classic(pointer));
  EXPECT_EQ(concat(static_cast<const void*>(nullptr)), classic(static_cast<const void*>(nullptr)));
  EXPECT_EQ(concat('x', std::string("y"), std::string_view("z"), "w", false), "xyzw0");
}

}  // namespace
