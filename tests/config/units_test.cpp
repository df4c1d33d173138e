// units.h: every unit spelling, fractions (exact, rounded down), what is refused, overflow,
// and format_size()'s output and its round trip through parse_size().
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "config/units.h"

namespace {

using vramswap::format_pointer;
using vramswap::format_size;
using vramswap::parse_size;
using vramswap::parse_size_detailed;
using vramswap::SizeError;
using vramswap::SizeParse;

constexpr uint64_t kKiB = uint64_t{1} << 10;
constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr uint64_t kTiB = uint64_t{1} << 40;

struct SizeCase {
  const char* text;
  uint64_t bytes;
};

void PrintTo(const SizeCase& c, std::ostream* os) { *os << '"' << c.text << '"'; }

class ParseSizeValid : public testing::TestWithParam<SizeCase> {};

TEST_P(ParseSizeValid, GivesExactBytes) {
  const SizeCase& c = GetParam();
  SizeParse p = parse_size_detailed(c.text);
  EXPECT_EQ(p.error, SizeError::kNone) << c.text;
  EXPECT_EQ(p.bytes, c.bytes) << c.text;
  EXPECT_EQ(parse_size(c.text), std::optional<uint64_t>(c.bytes)) << c.text;
}

INSTANTIATE_TEST_SUITE_P(
    EveryUnit, ParseSizeValid,
    testing::Values(SizeCase{"0", 0}, SizeCase{"1", 1}, SizeCase{"1073741824", kGiB}, SizeCase{"512B", 512},
                    SizeCase{"512b", 512}, SizeCase{"1K", kKiB}, SizeCase{"1k", kKiB}, SizeCase{"2KB", 2 * kKiB},
                    SizeCase{"2kb", 2 * kKiB}, SizeCase{"3KiB", 3 * kKiB}, SizeCase{"3kib", 3 * kKiB},
                    SizeCase{"1M", kMiB}, SizeCase{"1MB", kMiB}, SizeCase{"512MiB", 512 * kMiB},
                    SizeCase{"512mib", 512 * kMiB}, SizeCase{"1G", kGiB}, SizeCase{"8GB", 8 * kGiB},
                    SizeCase{"8GiB", 8 * kGiB}, SizeCase{"8gIb", 8 * kGiB}, SizeCase{"1T", kTiB},
                    SizeCase{"1TB", kTiB}, SizeCase{"2TiB", 2 * kTiB}, SizeCase{"007M", 7 * kMiB}));

INSTANTIATE_TEST_SUITE_P(
    SpaceBeforeUnit, ParseSizeValid,
    testing::Values(SizeCase{"1 B", 1}, SizeCase{"16 GiB", 16 * kGiB}, SizeCase{"1.5 GiB", kGiB + kGiB / 2},
                    SizeCase{"4 k", 4 * kKiB}));

// Fractions are exact (no floating point) and rounded down to whole bytes.
INSTANTIATE_TEST_SUITE_P(
    Fractions, ParseSizeValid,
    testing::Values(SizeCase{"1.5GiB", kGiB + kGiB / 2}, SizeCase{"0.5KiB", 512}, SizeCase{"0.1KiB", 102},
                    SizeCase{"0.25M", kMiB / 4}, SizeCase{"1.5", 1}, SizeCase{"0.9B", 0},
                    SizeCase{"2.0T", 2 * kTiB}, SizeCase{"0.999999999999999999999999KiB", 1023},
                    SizeCase{"0.0000000000001TiB", 0}, SizeCase{"0.000000000001TiB", 1},
                    SizeCase{"15.99999999999999999999TiB", 16 * kTiB - 1}));

// The largest values that still fit in 64 bits.
INSTANTIATE_TEST_SUITE_P(
    Limits, ParseSizeValid,
    testing::Values(SizeCase{"18446744073709551615", UINT64_MAX}, SizeCase{"18446744073709551615B", UINT64_MAX},
                    SizeCase{"16777215TiB", 16777215 * kTiB}, SizeCase{"17179869183GiB", 17179869183 * kGiB},
                    SizeCase{"16777215.999999999999TiB", 16777215 * kTiB + (kTiB - 2)}));

class ParseSizeMalformed : public testing::TestWithParam<const char*> {};

TEST_P(ParseSizeMalformed, IsASyntaxError) {
  EXPECT_EQ(parse_size_detailed(GetParam()).error, SizeError::kSyntax);
  EXPECT_FALSE(parse_size(GetParam()).has_value());
}

INSTANTIATE_TEST_SUITE_P(Refused, ParseSizeMalformed,
                         testing::Values("", " ", "GiB", "-1", "-1GiB", "+1", "12XB", "1XB", "1 XB", "8PiB",
                                         "8 ", " 8", "8  GiB", "8\tGiB", "8GiB ", "1.", ".5G", "1.5.2G", "1,5G",
                                         "1e9", "0x10", "1_000", "1GiBs", "1 G B", "1Gi", "1iB", "one",
                                         "99999999999999999999XB"));

class ParseSizeOverflow : public testing::TestWithParam<const char*> {};

TEST_P(ParseSizeOverflow, IsAnOverflowError) {
  EXPECT_EQ(parse_size_detailed(GetParam()).error, SizeError::kOverflow);
  EXPECT_FALSE(parse_size(GetParam()).has_value());
}

INSTANTIATE_TEST_SUITE_P(Refused, ParseSizeOverflow,
                         testing::Values("18446744073709551616", "99999999999999999999", "16777216TiB",
                                         "16777216 TiB", "17179869184GiB", "17592186044416M",
                                         "18014398509481984K", "16777216.5TiB", "18446744073709551616.0B"));

TEST(FormatSize, BytesBelowOneKiBAreExact) {
  EXPECT_EQ(format_size(0), "0 B");
  EXPECT_EQ(format_size(1), "1 B");
  EXPECT_EQ(format_size(512), "512 B");
  EXPECT_EQ(format_size(1023), "1023 B");
}

TEST(FormatSize, LargerValuesUseTheLargestUnitWithTwoDecimalsRoundedDown) {
  EXPECT_EQ(format_size(kKiB), "1 KiB");
  EXPECT_EQ(format_size(1536), "1.5 KiB");
  EXPECT_EQ(format_size(kGiB + kGiB / 2), "1.5 GiB");
  EXPECT_EQ(format_size(kGiB + kGiB / 16), "1.06 GiB");  // 1.0625: rounded down
  EXPECT_EQ(format_size(kGiB + kGiB / 20), "1.04 GiB");  // kGiB / 20 is just under 0.05 GiB
  EXPECT_EQ(format_size(kGiB + kGiB / 50 + 1), "1.02 GiB");
  EXPECT_EQ(format_size(kGiB - 1), "1023.99 MiB");
  EXPECT_EQ(format_size(16 * kGiB), "16 GiB");
  EXPECT_EQ(format_size(3 * kTiB), "3 TiB");
  EXPECT_EQ(format_size(5000 * kTiB), "5000 TiB");
  EXPECT_EQ(format_size(UINT64_MAX), "16777215.99 TiB");
}

TEST(FormatSize, OutputParsesBackToAtMostTheValue) {
  for (uint64_t v : {uint64_t{0}, uint64_t{1}, uint64_t{1023}, uint64_t{1024}, uint64_t{1025}, uint64_t{123456789},
                     kGiB - 1, 80 * kGiB + 12345, kTiB + 1, UINT64_MAX}) {
    std::optional<uint64_t> back = parse_size(format_size(v));
    ASSERT_TRUE(back.has_value()) << format_size(v);
    EXPECT_LE(*back, v) << format_size(v);
    // Two decimals of the printed unit: the loss is under 1% of that unit.
    EXPECT_LT(v - *back, v < kKiB ? uint64_t{1} : (v / 100) + 1) << format_size(v);
  }
}

TEST(FormatPointer, PrintsAsPercentP) {
  EXPECT_EQ("0x7f0012345600", format_pointer(reinterpret_cast<void*>(uintptr_t{0x7f0012345600})));
  EXPECT_EQ("(nil)", format_pointer(nullptr));
}

}  // namespace
