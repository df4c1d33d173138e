// values.h: the grammar of each key type, including those no row uses yet (ranged
// sizes), so a future row starts from a tested parser; accepted_form() and the text forms
// that parse back to the same value.
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <string>

#include "config/units.h"
#include "config/values.h"

namespace {

using namespace vramswap::config;
using vramswap::parse_size;

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;

SizeOrPercent bytes(uint64_t b) { return {SizeOrPercent::Kind::kBytes, b, 0}; }
SizeOrPercent percent(uint32_t basis_points) { return {SizeOrPercent::Kind::kPercent, 0, basis_points}; }

TEST(SizeOrPercentValue, AcceptsSizesAndPercentages) {
  EXPECT_EQ(parse_size_or_percent("8GiB").value, bytes(8 * kGiB));
  EXPECT_EQ(parse_size_or_percent("0").value, bytes(0));
  EXPECT_EQ(parse_size_or_percent("80%").value, percent(8000));
  EXPECT_EQ(parse_size_or_percent("80 %").value, percent(8000));
  EXPECT_EQ(parse_size_or_percent("100%").value, percent(10000));
  EXPECT_EQ(parse_size_or_percent("12.5%").value, percent(1250));
  EXPECT_EQ(parse_size_or_percent("0.01%").value, percent(1));
  EXPECT_EQ(parse_size_or_percent("33.339%").value, percent(3333));  // rounded down
  EXPECT_EQ(parse_size_or_percent("100.00%").value, percent(10000));
}

TEST(SizeOrPercentValue, RefusesPercentagesOutsideZeroToHundredWithAReason) {
  for (const char* text : {"101%", "100.01%", "1000%", "99999999999999999999%"}) {
    Parsed<SizeOrPercent> p = parse_size_or_percent(text);
    EXPECT_FALSE(p.value) << text;
    EXPECT_EQ(p.reason, "more than 100%") << text;
  }
  EXPECT_EQ(parse_size_or_percent("0%").reason, "a percentage must be more than 0%");
  EXPECT_EQ(parse_size_or_percent("0.001%").reason, "rounds down to 0%; the smallest percentage is 0.01%");
  EXPECT_EQ(parse_size_or_percent("0.5B").reason, "rounds down to 0 bytes");
  EXPECT_EQ(parse_size_or_percent("16777216TiB").reason, "too large: more than 2^64 - 1 bytes");
}

// A size that means something but rounds down to nothing is refused, never taken as 0
// (for VRAMSWAP_MIN_OFFLOAD_BYTES, 0 would tag every allocation in a scope).
TEST(SizeValue, RefusesANonZeroValueThatRoundsDownToZeroBytes) {
  for (const char* text : {"0.5", "0.5B", "0.0001KiB"}) {
    Parsed<uint64_t> p = parse_size_value(text, "");
    EXPECT_FALSE(p.value) << text;
    EXPECT_EQ(p.reason, "rounds down to 0 bytes") << text;
  }
  EXPECT_EQ(parse_size_value("0", "").value, uint64_t{0});
  EXPECT_EQ(parse_size_value("0.0KiB", "").value, uint64_t{0});
}

TEST(SizeOrPercentValue, RefusesMalformedTextWithoutAReason) {
  for (const char* text : {"", "%", " %", "80%%", "-5%", "80  %", "8.%", ".5%", "5.x%", "%80", "80% ", "1e2%",
                           "12XB", "GiB"}) {
    Parsed<SizeOrPercent> p = parse_size_or_percent(text);
    EXPECT_FALSE(p.value) << text;
    EXPECT_EQ(p.reason, "") << text;
  }
}

TEST(SizeOrPercentValue, OfResolvesExactlyAndRoundsDown) {
  EXPECT_EQ(bytes(5 * kGiB).of(80 * kGiB), 5 * kGiB);
  EXPECT_EQ(percent(8000).of(80 * kGiB), 64 * kGiB);
  EXPECT_EQ(percent(10000).of(UINT64_MAX), UINT64_MAX);  // no overflow on the largest whole
  EXPECT_EQ(percent(5000).of(UINT64_MAX), UINT64_MAX / 2);
  EXPECT_EQ(percent(3333).of(100), 33u);
  EXPECT_EQ(percent(1).of(9999), 0u);
}

TEST(SizeValue, HonoursTheRange) {
  EXPECT_EQ(parse_size_value("1MiB", "").value, kMiB);
  EXPECT_EQ(parse_size_value("64MiB", "64MiB..1TiB").value, 64 * kMiB);
  EXPECT_EQ(parse_size_value("1TiB", "64MiB..1TiB").value, uint64_t{1} << 40);
  EXPECT_EQ(parse_size_value("63MiB", "64MiB..1TiB").reason, "out of range");
  EXPECT_EQ(parse_size_value("2TiB", "64MiB..1TiB").reason, "out of range");
  EXPECT_EQ(parse_size_value("1B", "..1KiB").value, 1u);
  EXPECT_EQ(parse_size_value("1", "64MiB..").reason, "out of range");
  EXPECT_FALSE(parse_size_value("1KiB", "1KiB-2KiB").value);  // a malformed range accepts nothing
  EXPECT_EQ(accepted_form(KeyType::kSize, "64MiB..1TiB"),
            "a size such as 8GiB, 512MiB or 1073741824 from 64MiB to 1TiB");
  EXPECT_EQ(accepted_form(KeyType::kSize, "4KiB.."), "a size such as 8GiB, 512MiB or 1073741824 of at least 4KiB");
}

TEST(OptionalSizeValue, EmptyIsUnsetAndAnythingElseIsARangedSize) {
  Parsed<std::optional<uint64_t>> unset = parse_optional_size("", "2MiB..");
  ASSERT_TRUE(unset.value.has_value());
  EXPECT_EQ(*unset.value, std::nullopt);
  EXPECT_EQ(parse_optional_size("8GiB", "2MiB..").value, std::optional<std::optional<uint64_t>>(8 * kGiB));
  EXPECT_EQ(parse_optional_size("2MiB", "2MiB..").value, std::optional<std::optional<uint64_t>>(2 * kMiB));
  EXPECT_EQ(parse_optional_size("1MiB", "2MiB..").reason, "out of range");
  EXPECT_EQ(parse_optional_size("0", "2MiB..").reason, "out of range");
  EXPECT_EQ(parse_optional_size("16777216TiB", "").reason, "too large: more than 2^64 - 1 bytes");
  for (const char* bad : {" ", "8 GiB ", "50%", "-1", "x"}) EXPECT_FALSE(parse_optional_size(bad, "").value) << bad;
  EXPECT_FALSE(parse_optional_size("", "2MiB-4MiB").value);  // a malformed range accepts nothing
  EXPECT_EQ(accepted_form(KeyType::kOptionalSize, "2MiB.."),
            "a size such as 8GiB, 512MiB or 1073741824 of at least 2MiB (empty: the default)");
  EXPECT_EQ(optional_size_text(std::nullopt), "");
  EXPECT_EQ(optional_size_text(3 * kGiB), "3GiB");
}

TEST(CountValue, AcceptsIntegersInRange) {
  EXPECT_EQ(parse_count("0", "").value, 0u);
  EXPECT_EQ(parse_count("18446744073709551615", "").value, UINT64_MAX);
  EXPECT_EQ(parse_count("18446744073709551616", "").reason, "too large: more than 2^64 - 1");
  EXPECT_EQ(parse_count("8", "1..64").value, 8u);
  EXPECT_EQ(parse_count("0", "1..64").reason, "out of range");
  EXPECT_EQ(parse_count("65", "1..64").reason, "out of range");
  for (const char* bad : {"", "-1", "+1", "1.5", "8 ", "0x8", "eight"}) EXPECT_FALSE(parse_count(bad, "").value) << bad;
  EXPECT_EQ(accepted_form(KeyType::kCount, "1..64"), "an integer from 1 to 64");
  EXPECT_EQ(accepted_form(KeyType::kCount, ""), "a non-negative integer");
}

TEST(BoolValue, AcceptsTheUsualWordsInAnyCase) {
  for (const char* yes : {"1", "true", "TRUE", "yes", "Yes", "on", "ON"}) EXPECT_EQ(parse_bool(yes).value, true) << yes;
  for (const char* no : {"0", "false", "False", "no", "NO", "off", "Off"}) EXPECT_EQ(parse_bool(no).value, false) << no;
  for (const char* bad : {"", "2", "y", "enable", "true ", "-1"}) EXPECT_FALSE(parse_bool(bad).value) << bad;
}

TEST(EnumValue, GivesThePositionOfTheWord) {
  constexpr std::string_view kWords = "off|error|warn|info|debug";
  EXPECT_EQ(parse_enum("off", kWords).value, 0u);
  EXPECT_EQ(parse_enum("WARN", kWords).value, 2u);
  EXPECT_EQ(parse_enum("debug", kWords).value, 4u);
  for (const char* bad : {"", "verbose", "warning", "de bug", "off|error", "|"})
    EXPECT_FALSE(parse_enum(bad, kWords).value) << bad;
  EXPECT_EQ(enum_word(kWords, 0), "off");
  EXPECT_EQ(enum_word(kWords, 4), "debug");
  EXPECT_EQ(enum_word(kWords, 5), "");
  EXPECT_EQ(accepted_form(KeyType::kEnum, kWords), "one of off, error, warn, info, debug");
}

TEST(PathValue, AnyTextAndEmptyMeansNone) {
  EXPECT_EQ(parse_path("/tmp/stats.json").value, "/tmp/stats.json");
  EXPECT_EQ(parse_path("relative dir/with space.json").value, "relative dir/with space.json");
  EXPECT_EQ(parse_path("").value, "");
}

TEST(TextForms, ParseBackToTheSameValue) {
  for (uint64_t v : {uint64_t{0}, uint64_t{1}, uint64_t{512}, uint64_t{1024}, 3 * kMiB, 16 * kGiB, kGiB + 1,
                     uint64_t{5} << 40, UINT64_MAX}) {
    EXPECT_EQ(parse_size(size_text(v)), std::optional<uint64_t>(v)) << size_text(v);
  }
  EXPECT_EQ(size_text(16 * kGiB), "16GiB");
  EXPECT_EQ(size_text(1536), "1536");  // 1.5 KiB: whole bytes, not a whole number of KiB
  EXPECT_EQ(size_text(kGiB + 1), "1073741825");
  for (SizeOrPercent v : {bytes(0), bytes(8 * kGiB), percent(8000), percent(1250), percent(1), percent(3333),
                          percent(10000)}) {
    EXPECT_EQ(parse_size_or_percent(size_or_percent_text(v)).value, v) << size_or_percent_text(v);
  }
  EXPECT_EQ(size_or_percent_text(percent(1250)), "12.5%");
  EXPECT_EQ(size_or_percent_text(percent(5)), "0.05%");
}

}  // namespace
