// config.h: the VRAMSWAP_* table and everything derived from it: parse() of a key/value
// map (valid, invalid, overflowing, unknown), apply() as vramswap_configure() uses it,
// resolve_limit(), describe() and markdown_table().
//
// Decisions these tests pin down:
//   - VRAMSWAP_LIMIT=0 (or 0GiB, or unset) is the whole card; "0%" is an error, since a
//     card with no memory is never what was meant and "0" already says "no limit".
//   - "100%" is the whole card, "101%" an error; a byte limit above the card is the card.
//   - A non-zero value that rounds down to nothing ("0.5B", "0.001%") is an error, not 0.
//   - VRAMSWAP_STATS_FILE= (empty) means no file, so vramswap_configure can switch it off.
//   - An empty VRAMSWAP_LIMIT or VRAMSWAP_LOG is an error (not "unset").
//   - VRAMSWAP_SOFT_LIMIT is a share of the resolved limit; 0, 100% or a size at or above
//     the limit all mean "no soft eviction" (resolve_soft_limit() gives 0).
//   - VRAMSWAP_HOST_LIMIT= (empty) is unset: the host tier's own default. Below 2MiB (0
//     included) is an error, so that 0 can never be read as "the default" by accident.
//   - VRAMSWAP_MIN_OFFLOAD_BYTES=0 is allowed: every allocation made in a scope is tagged.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include "config/config.h"

namespace {

using namespace vramswap::config;

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr uint64_t kTiB = uint64_t{1} << 40;
constexpr uint64_t kCard = 80 * kGiB;

// Every key of the table, in its order: the list an unknown key's warning ends with.
constexpr const char* kKnownKeys =
    "VRAMSWAP_LIMIT, VRAMSWAP_SOFT_LIMIT, VRAMSWAP_HOST_LIMIT, VRAMSWAP_DISK_DIR, VRAMSWAP_DISK_LIMIT, "
    "VRAMSWAP_DISK_IO, "
    "VRAMSWAP_MIN_OFFLOAD_BYTES, VRAMSWAP_HORIZON, VRAMSWAP_PLAN, VRAMSWAP_VERIFY, VRAMSWAP_LOG, VRAMSWAP_STATS_FILE";

constexpr const char* kLimitForm =
    "expected a size such as 8GiB, 512MiB, 1073741824 or a percentage of the card such as 80%";

ParseResult parse_one(const std::string& key, const std::string& value) { return parse({{key, value}}); }

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// --- the table itself ---

TEST(Table, HasTheKeysOfThisReleaseAndNoOthers) {
  std::vector<std::string> names;
  for (const KeySpec& spec : keys()) names.emplace_back(spec.name);
  EXPECT_EQ(names, (std::vector<std::string>{"VRAMSWAP_LIMIT", "VRAMSWAP_SOFT_LIMIT", "VRAMSWAP_HOST_LIMIT",
                                              "VRAMSWAP_DISK_DIR", "VRAMSWAP_DISK_LIMIT", "VRAMSWAP_DISK_IO", "VRAMSWAP_MIN_OFFLOAD_BYTES", "VRAMSWAP_HORIZON", "VRAMSWAP_PLAN",
                                              "VRAMSWAP_VERIFY", "VRAMSWAP_LOG", "VRAMSWAP_STATS_FILE"}));
}

TEST(Table, RowsAreWellFormed) {
  std::set<std::string_view> seen;
  for (const KeySpec& spec : keys()) {
    SCOPED_TRACE(std::string(spec.name));
    EXPECT_TRUE(spec.name.starts_with("VRAMSWAP_"));
    EXPECT_TRUE(seen.insert(spec.name).second) << "duplicate row";
    EXPECT_FALSE(spec.doc.empty());
    EXPECT_EQ(spec.doc.find('\n'), std::string_view::npos) << "the doc is one line";
    EXPECT_NE(spec.set, nullptr);
    EXPECT_NE(spec.show, nullptr);
    EXPECT_NE(spec.same, nullptr);
    EXPECT_EQ(find_key(spec.name), &spec);
  }
}

TEST(Table, EveryDefaultIsAcceptedAndIsWhatConfigHolds) {
  const Config defaults;
  for (const KeySpec& spec : keys()) {
    SCOPED_TRACE(std::string(spec.name));
    Config c;
    EXPECT_EQ(apply(c, spec.name, spec.default_value), std::nullopt);
    EXPECT_TRUE(spec.same(c, defaults));
    EXPECT_EQ(spec.show(defaults, spec), spec.default_value);
  }
}

TEST(Table, DefaultsAreTheDocumentedOnes) {
  const Config c;
  EXPECT_EQ(c.limit.kind, SizeOrPercent::Kind::kBytes);
  EXPECT_EQ(c.limit.bytes, 0u);
  EXPECT_EQ(c.resolve_limit(kCard), kCard);
  EXPECT_EQ(c.log_level, LogLevel::kWarn);
  EXPECT_EQ(c.stats_file, "");
  EXPECT_EQ(c.soft_limit.kind, SizeOrPercent::Kind::kPercent);
  EXPECT_EQ(c.soft_limit.basis_points, 9000u);
  EXPECT_EQ(c.resolve_soft_limit(100 * kMiB), 90 * kMiB);
  EXPECT_EQ(c.host_limit, std::nullopt);
  EXPECT_EQ(c.min_offload_bytes, 64 * 1024u);
  EXPECT_EQ(c.horizon, 4u);
  EXPECT_FALSE(c.verify);
}

// --- parse(): valid values ---

struct LimitCase {
  const char* text;
  uint64_t resolved;  // on an 80 GiB card
};

void PrintTo(const LimitCase& c, std::ostream* os) { *os << '"' << c.text << '"'; }

class ValidLimit : public testing::TestWithParam<LimitCase> {};

TEST_P(ValidLimit, ResolvesAgainstTheCard) {
  ParseResult r = parse_one("VRAMSWAP_LIMIT", GetParam().text);
  ASSERT_TRUE(r.ok()) << r.errors.front();
  EXPECT_TRUE(r.warnings.empty());
  EXPECT_EQ(r.config.resolve_limit(kCard), GetParam().resolved);
}

INSTANTIATE_TEST_SUITE_P(
    Sizes, ValidLimit,
    testing::Values(LimitCase{"16GiB", 16 * kGiB}, LimitCase{"16 GiB", 16 * kGiB}, LimitCase{"16gb", 16 * kGiB},
                    LimitCase{"16G", 16 * kGiB}, LimitCase{"512MiB", 512 * kMiB}, LimitCase{"512M", 512 * kMiB},
                    LimitCase{"2048KiB", 2 * kMiB}, LimitCase{"2048K", 2 * kMiB}, LimitCase{"1073741824", kGiB},
                    LimitCase{"1073741824B", kGiB}, LimitCase{"1.5GiB", kGiB + kGiB / 2},
                    LimitCase{"0.0625TiB", 64 * kGiB}, LimitCase{"1B", 1}));

INSTANTIATE_TEST_SUITE_P(Percentages, ValidLimit,
                         testing::Values(LimitCase{"80%", 64 * kGiB}, LimitCase{"100%", kCard},
                                         LimitCase{"50 %", 40 * kGiB}, LimitCase{"12.5%", 10 * kGiB},
                                         LimitCase{"0.01%", kCard / 10000}));

// 0 in any unit means no limit; more than the card is the card.
INSTANTIATE_TEST_SUITE_P(WholeCard, ValidLimit,
                         testing::Values(LimitCase{"0", kCard}, LimitCase{"0GiB", kCard}, LimitCase{"0.0B", kCard},
                                         LimitCase{"1TiB", kCard}, LimitCase{"18446744073709551615", kCard}));

TEST(ResolveLimit, PercentagesRoundDownAndNeverExceedTheCard) {
  Config c;
  ASSERT_EQ(apply(c, "VRAMSWAP_LIMIT", "33.33%"), std::nullopt);
  EXPECT_EQ(c.resolve_limit(1000), 333u);
  EXPECT_EQ(c.resolve_limit(0), 0u);
  ASSERT_EQ(apply(c, "VRAMSWAP_LIMIT", "100%"), std::nullopt);
  EXPECT_EQ(c.resolve_limit(UINT64_MAX), UINT64_MAX);
  ASSERT_EQ(apply(c, "VRAMSWAP_LIMIT", "8GiB"), std::nullopt);
  EXPECT_EQ(c.resolve_limit(4 * kGiB), 4 * kGiB);
  EXPECT_EQ(c.resolve_limit(16 * kGiB), 8 * kGiB);
}

struct SoftLimitCase {
  const char* text;
  uint64_t limit;     // the device's resolved limit
  uint64_t resolved;  // resolve_soft_limit(limit); 0 = no soft eviction
};

void PrintTo(const SoftLimitCase& c, std::ostream* os) { *os << '"' << c.text << "\" of " << c.limit; }

class ValidSoftLimit : public testing::TestWithParam<SoftLimitCase> {};

TEST_P(ValidSoftLimit, ResolvesAgainstTheLimit) {
  ParseResult r = parse_one("VRAMSWAP_SOFT_LIMIT", GetParam().text);
  ASSERT_TRUE(r.ok()) << r.errors.front();
  EXPECT_TRUE(r.warnings.empty());
  EXPECT_EQ(r.config.resolve_soft_limit(GetParam().limit), GetParam().resolved);
}

INSTANTIATE_TEST_SUITE_P(
    ShareOfTheLimit, ValidSoftLimit,
    testing::Values(SoftLimitCase{"90%", 100 * kMiB, 90 * kMiB}, SoftLimitCase{"90%", 64 * kMiB, 60397977},
                    SoftLimitCase{"50 %", 64 * kMiB, 32 * kMiB}, SoftLimitCase{"12.5%", kCard, 10 * kGiB},
                    SoftLimitCase{"99.99%", 10000, 9999}));
INSTANTIATE_TEST_SUITE_P(Sizes, ValidSoftLimit,
                         testing::Values(SoftLimitCase{"32MiB", 64 * kMiB, 32 * kMiB},
                                         SoftLimitCase{"1", 64 * kMiB, 1},
                                         SoftLimitCase{"64MiB", 64 * kMiB + 1, 64 * kMiB}));
// 100%, 0, and a size at or above the limit: eviction only at the hard limit.
INSTANTIATE_TEST_SUITE_P(NoSoftEviction, ValidSoftLimit,
                         testing::Values(SoftLimitCase{"100%", 64 * kMiB, 0}, SoftLimitCase{"0", 64 * kMiB, 0},
                                         SoftLimitCase{"0MiB", 64 * kMiB, 0}, SoftLimitCase{"64MiB", 64 * kMiB, 0},
                                         SoftLimitCase{"1TiB", 64 * kMiB, 0}, SoftLimitCase{"90%", 0, 0}));
// A percentage of a tiny limit that rounds down to nothing is still a soft limit (1 byte),
// never "none".
INSTANTIATE_TEST_SUITE_P(TinyLimit, ValidSoftLimit, testing::Values(SoftLimitCase{"0.01%", 9999, 1}));

struct SizeCase {
  const char* key;
  const char* text;
  uint64_t bytes;
};

void PrintTo(const SizeCase& c, std::ostream* os) { *os << c.key << "='" << c.text << "'"; }

class ValidSize : public testing::TestWithParam<SizeCase> {};

TEST_P(ValidSize, IsAccepted) {
  const SizeCase& c = GetParam();
  ParseResult r = parse_one(c.key, c.text);
  ASSERT_TRUE(r.ok()) << r.errors.front();
  if (std::string(c.key) == "VRAMSWAP_HOST_LIMIT")
    EXPECT_EQ(r.config.host_limit, std::optional<uint64_t>(c.bytes));
  else
    EXPECT_EQ(r.config.min_offload_bytes, c.bytes);
}

INSTANTIATE_TEST_SUITE_P(
    MinOffloadBytes, ValidSize,
    testing::Values(SizeCase{"VRAMSWAP_MIN_OFFLOAD_BYTES", "1MiB", kMiB},
                    SizeCase{"VRAMSWAP_MIN_OFFLOAD_BYTES", "512 KiB", 512 * 1024},
                    SizeCase{"VRAMSWAP_MIN_OFFLOAD_BYTES", "4096", 4096},
                    SizeCase{"VRAMSWAP_MIN_OFFLOAD_BYTES", "0", 0},
                    SizeCase{"VRAMSWAP_MIN_OFFLOAD_BYTES", "1TiB", uint64_t{1} << 40}));
INSTANTIATE_TEST_SUITE_P(HostLimit, ValidSize,
                         testing::Values(SizeCase{"VRAMSWAP_HOST_LIMIT", "8GiB", 8 * kGiB},
                                         SizeCase{"VRAMSWAP_HOST_LIMIT", "2MiB", 2 * kMiB},
                                         SizeCase{"VRAMSWAP_HOST_LIMIT", "2097152", 2 * kMiB},
                                         SizeCase{"VRAMSWAP_HOST_LIMIT", "1.5 TiB", 3 * (uint64_t{1} << 39)}));

TEST(HostLimit, EmptyIsUnsetAndAppliesTheHostTiersDefault) {
  ParseResult r = parse_one("VRAMSWAP_HOST_LIMIT", "");
  ASSERT_TRUE(r.ok()) << r.errors.front();
  EXPECT_EQ(r.config.host_limit, std::nullopt);
  EXPECT_EQ(r.config, Config());
  // vramswap_configure can set it and unset it again.
  Config c;
  ASSERT_EQ(apply(c, "VRAMSWAP_HOST_LIMIT", "16GiB"), std::nullopt);
  EXPECT_EQ(c.host_limit, std::optional<uint64_t>(16 * kGiB));
  ASSERT_EQ(apply(c, "VRAMSWAP_HOST_LIMIT", ""), std::nullopt);
  EXPECT_EQ(c.host_limit, std::nullopt);
}

class ValidHorizon : public testing::TestWithParam<std::pair<const char*, uint64_t>> {};

TEST_P(ValidHorizon, IsAccepted) {
  ParseResult r = parse_one("VRAMSWAP_HORIZON", GetParam().first);
  ASSERT_TRUE(r.ok()) << r.errors.front();
  EXPECT_EQ(r.config.horizon, GetParam().second);
}

INSTANTIATE_TEST_SUITE_P(ZeroTo1024, ValidHorizon,
                         testing::Values(std::pair{"0", uint64_t{0}}, std::pair{"1", uint64_t{1}},
                                         std::pair{"4", uint64_t{4}}, std::pair{"1024", uint64_t{1024}},
                                         std::pair{"0004", uint64_t{4}}));

class ValidVerify : public testing::TestWithParam<std::pair<const char*, bool>> {};

TEST_P(ValidVerify, IsAccepted) {
  ParseResult r = parse_one("VRAMSWAP_VERIFY", GetParam().first);
  ASSERT_TRUE(r.ok()) << r.errors.front();
  EXPECT_EQ(r.config.verify, GetParam().second);
}

INSTANTIATE_TEST_SUITE_P(Words, ValidVerify,
                         testing::Values(std::pair{"1", true}, std::pair{"0", false}, std::pair{"true", true},
                                         std::pair{"FALSE", false}, std::pair{"yes", true}, std::pair{"no", false},
                                         std::pair{"On", true}, std::pair{"off", false}));

class ValidLogLevel : public testing::TestWithParam<std::pair<const char*, LogLevel>> {};

TEST_P(ValidLogLevel, IsAcceptedInAnyCase) {
  ParseResult r = parse_one("VRAMSWAP_LOG", GetParam().first);
  ASSERT_TRUE(r.ok()) << r.errors.front();
  EXPECT_EQ(r.config.log_level, GetParam().second);
}

INSTANTIATE_TEST_SUITE_P(
    EveryLevel, ValidLogLevel,
    testing::Values(std::pair{"off", LogLevel::kOff}, std::pair{"error", LogLevel::kError},
                    std::pair{"warn", LogLevel::kWarn}, std::pair{"info", LogLevel::kInfo},
                    std::pair{"debug", LogLevel::kDebug}, std::pair{"INFO", LogLevel::kInfo},
                    std::pair{"Debug", LogLevel::kDebug}));

TEST(StatsFile, IsAnyPathAndEmptyMeansNone) {
  EXPECT_EQ(parse_one("VRAMSWAP_STATS_FILE", "/tmp/run 1/stats.json").config.stats_file, "/tmp/run 1/stats.json");
  EXPECT_EQ(parse_one("VRAMSWAP_STATS_FILE", "stats.json").config.stats_file, "stats.json");
  ParseResult empty = parse_one("VRAMSWAP_STATS_FILE", "");
  EXPECT_TRUE(empty.ok());
  EXPECT_EQ(empty.config.stats_file, "");
}

TEST(Parse, SeveralKeysTogether) {
  ParseResult r = parse({{"VRAMSWAP_LIMIT", "80%"}, {"VRAMSWAP_LOG", "info"}, {"VRAMSWAP_STATS_FILE", "/tmp/s.json"}});
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r.warnings.empty());
  EXPECT_EQ(r.config.resolve_limit(100 * kGiB), 80 * kGiB);
  EXPECT_EQ(r.config.log_level, LogLevel::kInfo);
  EXPECT_EQ(r.config.stats_file, "/tmp/s.json");
}

TEST(Parse, EmptyMapGivesTheDefaults) {
  ParseResult r = parse({});
  EXPECT_TRUE(r.ok());
  EXPECT_TRUE(r.warnings.empty());
  EXPECT_EQ(r.config, Config());
}

TEST(Parse, KeysWithoutThePrefixAreIgnored) {
  ParseResult r = parse({{"PATH", "/usr/bin"},
                         {"CUDASIM_DEVICE_MEMORY", "12XB"},
                         {"vramswap_limit", "garbage"},
                         {"VRAMSWAPLIMIT", "1GiB"},
                         {"XVRAMSWAP_LIMIT", "1GiB"}});
  EXPECT_TRUE(r.ok());
  EXPECT_TRUE(r.warnings.empty());
  EXPECT_EQ(r.config, Config());
}

// --- parse(): invalid values ---

struct InvalidCase {
  const char* key;
  const char* value;
  const char* message;  // the whole error
};

void PrintTo(const InvalidCase& c, std::ostream* os) { *os << c.key << "='" << c.value << "'"; }

class InvalidValue : public testing::TestWithParam<InvalidCase> {};

TEST_P(InvalidValue, IsAnErrorNamingTheVariableTheValueAndTheAcceptedForm) {
  const InvalidCase& c = GetParam();
  ParseResult r = parse_one(c.key, c.value);
  ASSERT_EQ(r.errors.size(), 1u);
  EXPECT_EQ(r.errors[0], c.message);
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.config, Config()) << "a refused value leaves the default";
  // vramswap_configure gives the same message.
  Config c2;
  EXPECT_EQ(apply(c2, c.key, c.value), std::optional<std::string>(c.message));
  EXPECT_EQ(c2, Config());
}

std::string limit_error(const std::string& value, const std::string& reason = "") {
  return "VRAMSWAP_LIMIT='" + value + "' is not valid" + (reason.empty() ? "" : " (" + reason + ")") + ": " +
         kLimitForm;
}

// Owns the message strings of the cases below.
const std::vector<std::string>& limit_messages() {
  static const std::vector<std::string> m = {
      limit_error("12XB"),
      limit_error(""),
      limit_error("-1"),
      limit_error("-10%"),
      limit_error("abc"),
      limit_error("8 GiB "),
      limit_error("1e9"),
      limit_error("80%%"),
      limit_error("101%", "more than 100%"),
      limit_error("0%", "a percentage must be more than 0%"),
      limit_error("0.001%", "rounds down to 0%; the smallest percentage is 0.01%"),
      limit_error("0.5B", "rounds down to 0 bytes"),
      limit_error("99999999999999999999", "too large: more than 2^64 - 1 bytes"),
      limit_error("16777216TiB", "too large: more than 2^64 - 1 bytes"),
      limit_error("18446744073709551616B", "too large: more than 2^64 - 1 bytes"),
  };
  return m;
}

INSTANTIATE_TEST_SUITE_P(
    Limit, InvalidValue,
    testing::Values(InvalidCase{"VRAMSWAP_LIMIT", "12XB", limit_messages()[0].c_str()},
                    InvalidCase{"VRAMSWAP_LIMIT", "", limit_messages()[1].c_str()},
                    InvalidCase{"VRAMSWAP_LIMIT", "-1", limit_messages()[2].c_str()},
                    InvalidCase{"VRAMSWAP_LIMIT", "-10%", limit_messages()[3].c_str()},
                    InvalidCase{"VRAMSWAP_LIMIT", "abc", limit_messages()[4].c_str()},
                    InvalidCase{"VRAMSWAP_LIMIT", "8 GiB ", limit_messages()[5].c_str()},
                    InvalidCase{"VRAMSWAP_LIMIT", "1e9", limit_messages()[6].c_str()},
                    InvalidCase{"VRAMSWAP_LIMIT", "80%%", limit_messages()[7].c_str()},
                    InvalidCase{"VRAMSWAP_LIMIT", "101%", limit_messages()[8].c_str()},
                    InvalidCase{"VRAMSWAP_LIMIT", "0%", limit_messages()[9].c_str()},
                    InvalidCase{"VRAMSWAP_LIMIT", "0.001%", limit_messages()[10].c_str()},
                    InvalidCase{"VRAMSWAP_LIMIT", "0.5B", limit_messages()[11].c_str()},
                    InvalidCase{"VRAMSWAP_LIMIT", "99999999999999999999", limit_messages()[12].c_str()},
                    InvalidCase{"VRAMSWAP_LIMIT", "16777216TiB", limit_messages()[13].c_str()},
                    InvalidCase{"VRAMSWAP_LIMIT", "18446744073709551616B", limit_messages()[14].c_str()}));

INSTANTIATE_TEST_SUITE_P(
    Log, InvalidValue,
    testing::Values(
        InvalidCase{"VRAMSWAP_LOG", "verbose",
                    "VRAMSWAP_LOG='verbose' is not valid: expected one of off, error, warn, info, debug"},
        InvalidCase{"VRAMSWAP_LOG", "", "VRAMSWAP_LOG='' is not valid: expected one of off, error, warn, info, debug"},
        InvalidCase{"VRAMSWAP_LOG", "3",
                    "VRAMSWAP_LOG='3' is not valid: expected one of off, error, warn, info, debug"},
        InvalidCase{"VRAMSWAP_LOG", "warn ",
                    "VRAMSWAP_LOG='warn ' is not valid: expected one of off, error, warn, info, debug"}));

INSTANTIATE_TEST_SUITE_P(
    Plan, InvalidValue,
    testing::Values(InvalidCase{"VRAMSWAP_PLAN", "on", "VRAMSWAP_PLAN='on' is not valid: expected one of auto, off"},
                    InvalidCase{"VRAMSWAP_PLAN", "", "VRAMSWAP_PLAN='' is not valid: expected one of auto, off"}));

INSTANTIATE_TEST_SUITE_P(
    SoftLimit, InvalidValue,
    testing::Values(
        InvalidCase{"VRAMSWAP_SOFT_LIMIT", "",
                    "VRAMSWAP_SOFT_LIMIT='' is not valid: expected a size such as 8GiB, 512MiB, 1073741824 or a "
                    "percentage of the limit such as 80%"},
        InvalidCase{"VRAMSWAP_SOFT_LIMIT", "120%",
                    "VRAMSWAP_SOFT_LIMIT='120%' is not valid (more than 100%): expected a size such as 8GiB, 512MiB, "
                    "1073741824 or a percentage of the limit such as 80%"},
        InvalidCase{"VRAMSWAP_SOFT_LIMIT", "0%",
                    "VRAMSWAP_SOFT_LIMIT='0%' is not valid (a percentage must be more than 0%): expected a size such "
                    "as 8GiB, 512MiB, 1073741824 or a percentage of the limit such as 80%"},
        InvalidCase{"VRAMSWAP_SOFT_LIMIT", "ninety",
                    "VRAMSWAP_SOFT_LIMIT='ninety' is not valid: expected a size such as 8GiB, 512MiB, 1073741824 or a "
                    "percentage of the limit such as 80%"}));

INSTANTIATE_TEST_SUITE_P(
    HostLimit, InvalidValue,
    testing::Values(
        InvalidCase{"VRAMSWAP_HOST_LIMIT", "0",
                    "VRAMSWAP_HOST_LIMIT='0' is not valid (out of range): expected a size such as 8GiB, 512MiB or "
                    "1073741824 of at least 2MiB (empty: the default)"},
        InvalidCase{"VRAMSWAP_HOST_LIMIT", "1MiB",
                    "VRAMSWAP_HOST_LIMIT='1MiB' is not valid (out of range): expected a size such as 8GiB, 512MiB or "
                    "1073741824 of at least 2MiB (empty: the default)"},
        InvalidCase{"VRAMSWAP_HOST_LIMIT", "50%",
                    "VRAMSWAP_HOST_LIMIT='50%' is not valid: expected a size such as 8GiB, 512MiB or 1073741824 of at "
                    "least 2MiB (empty: the default)"},
        InvalidCase{"VRAMSWAP_HOST_LIMIT", "16777216TiB",
                    "VRAMSWAP_HOST_LIMIT='16777216TiB' is not valid (too large: more than 2^64 - 1 bytes): expected "
                    "a size such as 8GiB, 512MiB or 1073741824 of at least 2MiB (empty: the default)"},
        InvalidCase{"VRAMSWAP_HOST_LIMIT", " ",
                    "VRAMSWAP_HOST_LIMIT=' ' is not valid: expected a size such as 8GiB, 512MiB or 1073741824 of at "
                    "least 2MiB (empty: the default)"}));

INSTANTIATE_TEST_SUITE_P(
    MinOffloadBytes, InvalidValue,
    testing::Values(
        InvalidCase{"VRAMSWAP_MIN_OFFLOAD_BYTES", "",
                    "VRAMSWAP_MIN_OFFLOAD_BYTES='' is not valid: expected a size such as 8GiB, 512MiB or 1073741824"},
        InvalidCase{"VRAMSWAP_MIN_OFFLOAD_BYTES", "1e6",
                    "VRAMSWAP_MIN_OFFLOAD_BYTES='1e6' is not valid: expected a size such as 8GiB, 512MiB or "
                    "1073741824"},
        InvalidCase{"VRAMSWAP_MIN_OFFLOAD_BYTES", "-1",
                    "VRAMSWAP_MIN_OFFLOAD_BYTES='-1' is not valid: expected a size such as 8GiB, 512MiB or "
                    "1073741824"},
        InvalidCase{"VRAMSWAP_MIN_OFFLOAD_BYTES", "10%",
                    "VRAMSWAP_MIN_OFFLOAD_BYTES='10%' is not valid: expected a size such as 8GiB, 512MiB or "
                    "1073741824"}));

INSTANTIATE_TEST_SUITE_P(
    Horizon, InvalidValue,
    testing::Values(
        InvalidCase{"VRAMSWAP_HORIZON", "1025",
                    "VRAMSWAP_HORIZON='1025' is not valid (out of range): expected an integer of at most 1024"},
        InvalidCase{"VRAMSWAP_HORIZON", "-1",
                    "VRAMSWAP_HORIZON='-1' is not valid: expected an integer of at most 1024"},
        InvalidCase{"VRAMSWAP_HORIZON", "", "VRAMSWAP_HORIZON='' is not valid: expected an integer of at most 1024"},
        InvalidCase{"VRAMSWAP_HORIZON", "2.5",
                    "VRAMSWAP_HORIZON='2.5' is not valid: expected an integer of at most 1024"},
        InvalidCase{"VRAMSWAP_HORIZON", "four",
                    "VRAMSWAP_HORIZON='four' is not valid: expected an integer of at most 1024"},
        InvalidCase{"VRAMSWAP_HORIZON", "99999999999999999999",
                    "VRAMSWAP_HORIZON='99999999999999999999' is not valid (too large: more than 2^64 - 1): expected "
                    "an integer of at most 1024"}));

INSTANTIATE_TEST_SUITE_P(
    Verify, InvalidValue,
    testing::Values(
        InvalidCase{"VRAMSWAP_VERIFY", "2",
                    "VRAMSWAP_VERIFY='2' is not valid: expected 1, 0, true, false, yes, no, on or off"},
        InvalidCase{"VRAMSWAP_VERIFY", "",
                    "VRAMSWAP_VERIFY='' is not valid: expected 1, 0, true, false, yes, no, on or off"},
        InvalidCase{"VRAMSWAP_VERIFY", "enabled",
                    "VRAMSWAP_VERIFY='enabled' is not valid: expected 1, 0, true, false, yes, no, on or off"}));

TEST(InvalidValues, TheIssueExampleMessageIsExact) {
  ParseResult r = parse_one("VRAMSWAP_LIMIT", "12XB");
  ASSERT_EQ(r.errors.size(), 1u);
  EXPECT_EQ(r.errors[0],
            "VRAMSWAP_LIMIT='12XB' is not valid: expected a size such as 8GiB, 512MiB, 1073741824 or a percentage "
            "of the card such as 80%");
}

TEST(InvalidValues, EachBadKeyIsReportedAndGoodKeysStillApply) {
  ParseResult r = parse({{"VRAMSWAP_LIMIT", "12XB"}, {"VRAMSWAP_LOG", "loud"}, {"VRAMSWAP_STATS_FILE", "/tmp/x.json"}});
  ASSERT_EQ(r.errors.size(), 2u);
  EXPECT_TRUE(r.errors[0].starts_with("VRAMSWAP_LIMIT='12XB' is not valid"));
  EXPECT_TRUE(r.errors[1].starts_with("VRAMSWAP_LOG='loud' is not valid"));
  EXPECT_EQ(r.config.stats_file, "/tmp/x.json");
  EXPECT_EQ(r.config.log_level, LogLevel::kWarn);
}

// --- unknown keys ---

struct UnknownCase {
  const char* key;
  const char* suggestion;  // "" = none close enough
};

void PrintTo(const UnknownCase& c, std::ostream* os) { *os << c.key; }

class UnknownKey : public testing::TestWithParam<UnknownCase> {};

TEST_P(UnknownKey, IsAWarningWithTheClosestKey) {
  const UnknownCase& c = GetParam();
  ParseResult r = parse_one(c.key, "1");
  EXPECT_TRUE(r.ok()) << "an unknown variable does not stop the program";
  ASSERT_EQ(r.warnings.size(), 1u);
  const std::string expected =
      std::string(c.suggestion).empty()
          ? "unknown variable " + std::string(c.key) + "; known variables are " + kKnownKeys
          : "unknown variable " + std::string(c.key) + "; did you mean " + c.suggestion + "?";
  EXPECT_EQ(r.warnings[0], expected);
  EXPECT_EQ(r.config, Config());
}

INSTANTIATE_TEST_SUITE_P(
    Typos, UnknownKey,
    testing::Values(UnknownCase{"VRAMSWAP_LIMT", "VRAMSWAP_LIMIT"}, UnknownCase{"VRAMSWAP_LIMTI", "VRAMSWAP_LIMIT"},
                    UnknownCase{"VRAMSWAP_LIMITS", "VRAMSWAP_LIMIT"}, UnknownCase{"VRAMSWAP_limit", "VRAMSWAP_LIMIT"},
                    UnknownCase{"VRAMSWAP_LOGS", "VRAMSWAP_LOG"}, UnknownCase{"VRAMSWAP_LOF", "VRAMSWAP_LOG"},
                    UnknownCase{"VRAMSWAP_STATS", ""}, UnknownCase{"VRAMSWAP_STAT_FILE", "VRAMSWAP_STATS_FILE"},
                    UnknownCase{"VRAMSWAP_STATSFILE", "VRAMSWAP_STATS_FILE"},
                    UnknownCase{"VRAMSWAP_STATS_FIEL", "VRAMSWAP_STATS_FILE"}, UnknownCase{"VRAMSWAP_FOO", ""},
                    UnknownCase{"VRAMSWAP_", ""}, UnknownCase{"VRAMSWAP_SPILL_DIR", ""},
                    UnknownCase{"VRAMSWAP_SOFTLIMIT", "VRAMSWAP_SOFT_LIMIT"},
                    UnknownCase{"VRAMSWAP_SOFT_LIMT", "VRAMSWAP_SOFT_LIMIT"},
                    UnknownCase{"VRAMSWAP_HOST_LIMITS", "VRAMSWAP_HOST_LIMIT"},
                    UnknownCase{"VRAMSWAP_MIN_OFFLOAD", "VRAMSWAP_MIN_OFFLOAD_BYTES"},
                    UnknownCase{"VRAMSWAP_MIN_OFFLOAD_BYTE", "VRAMSWAP_MIN_OFFLOAD_BYTES"},
                    UnknownCase{"VRAMSWAP_HORIZN", "VRAMSWAP_HORIZON"},
                    UnknownCase{"VRAMSWAP_VERFIY", "VRAMSWAP_VERIFY"}));

TEST(UnknownKeys, AreReportedWithKnownKeysStillApplied) {
  ParseResult r = parse({{"VRAMSWAP_LIMT", "8GiB"}, {"VRAMSWAP_LOG", "debug"}, {"VRAMSWAP_SPILL_DIR", "/tmp"}});
  EXPECT_TRUE(r.ok());
  ASSERT_EQ(r.warnings.size(), 2u);
  EXPECT_EQ(r.warnings[0], "unknown variable VRAMSWAP_LIMT; did you mean VRAMSWAP_LIMIT?");
  EXPECT_TRUE(r.warnings[1].starts_with("unknown variable VRAMSWAP_SPILL_DIR;"));
  EXPECT_EQ(r.config.log_level, LogLevel::kDebug);
  EXPECT_EQ(r.config.resolve_limit(kCard), kCard) << "a misspelt limit is not applied";
}

TEST(PythonKeys, AreNeitherParsedNorWarnedAbout) {
  ParseResult r = parse({{"VRAMSWAP_TORCH_DEVICE", "cpu-sim"}, {"VRAMSWAP_LIBRARY", "/x/libvramswap.so"},
                         {"VRAMSWAP_CACHE_DIR", "/x"}, {"VRAMSWAP_LOG", "info"}});
  EXPECT_TRUE(r.ok());
  EXPECT_TRUE(r.warnings.empty()) << r.warnings.front();
  EXPECT_EQ(r.config.log_level, LogLevel::kInfo);
  Config c;
  EXPECT_TRUE(apply(c, "VRAMSWAP_TORCH_DEVICE", "cpu-sim").has_value()) << "not a library setting";
}

TEST(ClosestKey, SuppliesTheMissingPrefixAndIgnoresCase) {
  EXPECT_EQ(closest_key("limit"), std::optional<std::string_view>("VRAMSWAP_LIMIT"));
  EXPECT_EQ(closest_key("LOG"), std::optional<std::string_view>("VRAMSWAP_LOG"));
  EXPECT_EQ(closest_key("stats_file"), std::optional<std::string_view>("VRAMSWAP_STATS_FILE"));
  EXPECT_EQ(closest_key("vramswap_log"), std::optional<std::string_view>("VRAMSWAP_LOG"));
  EXPECT_EQ(closest_key("VRAMSWAP_LIMIT"), std::optional<std::string_view>("VRAMSWAP_LIMIT"));
  EXPECT_EQ(closest_key("VRAMSWAP_COMPLETELY_DIFFERENT"), std::nullopt);
  EXPECT_EQ(closest_key(""), std::nullopt);
}

// --- apply(), as vramswap_configure() uses it ---

TEST(Apply, SetsOneKeyAndLeavesTheOthers) {
  Config c;
  ASSERT_EQ(apply(c, "VRAMSWAP_LOG", "debug"), std::nullopt);
  ASSERT_EQ(apply(c, "VRAMSWAP_LIMIT", "75%"), std::nullopt);
  EXPECT_EQ(c.log_level, LogLevel::kDebug);
  EXPECT_EQ(c.resolve_limit(kCard), 60 * kGiB);
  EXPECT_EQ(c.stats_file, "");
  ASSERT_EQ(apply(c, "VRAMSWAP_STATS_FILE", "/tmp/a.json"), std::nullopt);
  ASSERT_EQ(apply(c, "VRAMSWAP_STATS_FILE", ""), std::nullopt);
  EXPECT_EQ(c.stats_file, "") << "an empty path switches the file off";
}

TEST(Apply, UnknownKeyIsAnErrorWithASuggestion) {
  Config c;
  EXPECT_EQ(apply(c, "VRAMSWAP_LIMT", "8GiB"),
            std::optional<std::string>("unknown variable VRAMSWAP_LIMT; did you mean VRAMSWAP_LIMIT?"));
  EXPECT_EQ(apply(c, "limit", "8GiB"),
            std::optional<std::string>("unknown variable limit; did you mean VRAMSWAP_LIMIT?"));
  EXPECT_EQ(apply(c, "VRAMSWAP_SPILL_DIR", "/tmp"),
            std::optional<std::string>(std::string("unknown variable VRAMSWAP_SPILL_DIR; known variables are ") +
                                       kKnownKeys));
  EXPECT_TRUE(apply(c, "", "1").has_value());
  EXPECT_EQ(c, Config());
}

TEST(Apply, RefusedValueLeavesThePreviousValue) {
  Config c;
  ASSERT_EQ(apply(c, "VRAMSWAP_LIMIT", "8GiB"), std::nullopt);
  EXPECT_TRUE(apply(c, "VRAMSWAP_LIMIT", "8XB").has_value());
  EXPECT_EQ(c.resolve_limit(kCard), 8 * kGiB);
}

// --- from_environment(): the only function that reads the process ---

// Takes every VRAMSWAP_* variable out of the process's environment for the scope and puts
// them back after, so that what the test sets is all from_environment() sees, whatever the
// shell that runs the suite has set.
class EnvironmentWithoutVramswap {
 public:
  EnvironmentWithoutVramswap() {
    for (char** e = environ; *e != nullptr; ++e) {
      std::string entry(*e);
      if (entry.starts_with("VRAMSWAP_")) {
        size_t eq = entry.find('=');
        saved_.emplace_back(entry.substr(0, eq), eq == std::string::npos ? "" : entry.substr(eq + 1));
      }
    }
    for (const auto& [name, value] : saved_) unsetenv(name.c_str());
  }
  ~EnvironmentWithoutVramswap() {
    for (const auto& [name, value] : saved_) setenv(name.c_str(), value.c_str(), 1);
  }
  EnvironmentWithoutVramswap(const EnvironmentWithoutVramswap&) = delete;
  EnvironmentWithoutVramswap& operator=(const EnvironmentWithoutVramswap&) = delete;

 private:
  std::vector<std::pair<std::string, std::string>> saved_;
};

TEST(FromEnvironment, ReadsVramswapVariables) {
  EnvironmentWithoutVramswap clean;
  ASSERT_EQ(setenv("VRAMSWAP_LOG", "error", 1), 0);
  ASSERT_EQ(setenv("VRAMSWAP_LIMIT", "12XB", 1), 0);
  ASSERT_EQ(setenv("VRAMSWAP_LOGG", "x", 1), 0);
  ParseResult r = from_environment();
  unsetenv("VRAMSWAP_LOG");
  unsetenv("VRAMSWAP_LIMIT");
  unsetenv("VRAMSWAP_LOGG");
  EXPECT_EQ(r.config.log_level, LogLevel::kError);
  ASSERT_EQ(r.errors.size(), 1u);
  EXPECT_TRUE(r.errors[0].starts_with("VRAMSWAP_LIMIT='12XB' is not valid"));
  ASSERT_EQ(r.warnings.size(), 1u);
  EXPECT_EQ(r.warnings[0], "unknown variable VRAMSWAP_LOGG; did you mean VRAMSWAP_LOG?");
}

// --- describe(): the VRAMSWAP_LOG=info dump ---

TEST(Describe, OneLinePerKeyAllDefault) {
  std::vector<std::string> got = lines(describe(Config()));
  EXPECT_EQ(got, (std::vector<std::string>{"VRAMSWAP_LIMIT=0 (default)", "VRAMSWAP_SOFT_LIMIT=90% (default)",
                                            "VRAMSWAP_HOST_LIMIT= (default)",
                                            "VRAMSWAP_DISK_DIR= (default)",
                                            "VRAMSWAP_DISK_LIMIT= (default)",
                                            "VRAMSWAP_DISK_IO=threads (default)",
                                            "VRAMSWAP_MIN_OFFLOAD_BYTES=64KiB (default)",
                                            "VRAMSWAP_HORIZON=4 (default)", "VRAMSWAP_PLAN=auto (default)",
                                            "VRAMSWAP_VERIFY=0 (default)",
                                            "VRAMSWAP_LOG=warn (default)", "VRAMSWAP_STATS_FILE= (default)"}));
}

TEST(Describe, MentionsEveryKeyAndMarksWhatWasSet) {
  ParseResult r = parse({{"VRAMSWAP_LIMIT", "16 GiB"},
                         {"VRAMSWAP_STATS_FILE", "/tmp/s.json"},
                         {"VRAMSWAP_HOST_LIMIT", "32GiB"},
                         {"VRAMSWAP_VERIFY", "yes"}});
  ASSERT_TRUE(r.ok());
  std::vector<std::string> got = lines(describe(r.config));
  ASSERT_EQ(got.size(), keys().size());
  for (size_t i = 0; i < keys().size(); ++i) EXPECT_TRUE(got[i].starts_with(std::string(keys()[i].name) + "="));
  EXPECT_EQ(got, (std::vector<std::string>{
                     "VRAMSWAP_LIMIT=16GiB (set; default: 0)", "VRAMSWAP_SOFT_LIMIT=90% (default)",
                     "VRAMSWAP_HOST_LIMIT=32GiB (set; default: unset)", "VRAMSWAP_DISK_DIR= (default)",
                     "VRAMSWAP_DISK_LIMIT= (default)", "VRAMSWAP_DISK_IO=threads (default)",
                     "VRAMSWAP_MIN_OFFLOAD_BYTES=64KiB (default)",
                     "VRAMSWAP_HORIZON=4 (default)", "VRAMSWAP_PLAN=auto (default)",
                     "VRAMSWAP_VERIFY=1 (set; default: 0)",
                     "VRAMSWAP_LOG=warn (default)", "VRAMSWAP_STATS_FILE=/tmp/s.json (set; default: unset)"}));
}

TEST(Describe, ValuesParseBackToTheSameConfig) {
  ParseResult r = parse({{"VRAMSWAP_LIMIT", "33.339%"},
                         {"VRAMSWAP_LOG", "DEBUG"},
                         {"VRAMSWAP_STATS_FILE", "s.json"},
                         {"VRAMSWAP_SOFT_LIMIT", "75.5%"},
                         {"VRAMSWAP_HOST_LIMIT", "3072MiB"},
                         {"VRAMSWAP_MIN_OFFLOAD_BYTES", "524288"},
                         {"VRAMSWAP_HORIZON", "16"},
                         {"VRAMSWAP_PLAN", "OFF"},
                         {"VRAMSWAP_VERIFY", "on"}});
  ASSERT_TRUE(r.ok());
  std::map<std::string, std::string> env;
  for (const std::string& line : lines(describe(r.config))) {
    size_t eq = line.find('='), note = line.rfind(" (");
    env[line.substr(0, eq)] = line.substr(eq + 1, note - eq - 1);
  }
  EXPECT_EQ(env["VRAMSWAP_LIMIT"], "33.33%");
  EXPECT_EQ(env["VRAMSWAP_LOG"], "debug");
  EXPECT_EQ(env["VRAMSWAP_SOFT_LIMIT"], "75.5%");
  EXPECT_EQ(env["VRAMSWAP_HOST_LIMIT"], "3GiB");
  EXPECT_EQ(env["VRAMSWAP_MIN_OFFLOAD_BYTES"], "512KiB");
  EXPECT_EQ(env["VRAMSWAP_HORIZON"], "16");
  EXPECT_EQ(env["VRAMSWAP_PLAN"], "off");
  EXPECT_EQ(env["VRAMSWAP_VERIFY"], "1");
  ParseResult again = parse(env);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again.config, r.config);
}

// --- markdown_table(): the README's table ---

TEST(MarkdownTable, HasAHeaderAndOneRowPerKey) {
  std::vector<std::string> got = lines(markdown_table());
  ASSERT_EQ(got.size(), 2 + keys().size());
  EXPECT_EQ(got[0], "| variable | default | accepted | takes effect | meaning |");
  EXPECT_EQ(got[1], "| --- | --- | --- | --- | --- |");
  for (size_t i = 0; i < keys().size(); ++i) {
    const std::string& row = got[2 + i];
    EXPECT_TRUE(row.starts_with("| `" + std::string(keys()[i].name) + "` | ")) << row;
    // Five cells: six unescaped '|' (the enum's "a|b" must not split a cell).
    size_t bars = 0;
    for (size_t j = 0; j < row.size(); ++j) bars += row[j] == '|' && (j == 0 || row[j - 1] != '\\');
    EXPECT_EQ(bars, 6u) << row;
    const char* when = keys()[i].takes_effect == TakesEffect::kAtOnce ? " | at once | " : " | before the first allocation | ";
    EXPECT_NE(row.find(when), std::string::npos) << row;
    EXPECT_NE(row.find(std::string(keys()[i].doc)), std::string::npos) << row;
  }
}

TEST(MarkdownTable, RowsShowDefaultAndAcceptedForm) {
  std::vector<std::string> got = lines(markdown_table());
  ASSERT_EQ(got.size(), 14u);
  const char* starts[] = {
      "| `VRAMSWAP_LIMIT` | `0` | a size such as 8GiB, 512MiB, 1073741824 or a percentage of the card such as 80% | ",
      "| `VRAMSWAP_SOFT_LIMIT` | `90%` | a size such as 8GiB, 512MiB, 1073741824 or a percentage of the limit such "
      "as 80% | ",
      "| `VRAMSWAP_HOST_LIMIT` | unset | a size such as 8GiB, 512MiB or 1073741824 of at least 2MiB (empty: the "
      "default) | ",
      "| `VRAMSWAP_DISK_DIR` | unset | a directory path (empty: none) | ",
      "| `VRAMSWAP_DISK_LIMIT` | unset | a size such as 8GiB, 512MiB or 1073741824 of at least 4KiB (empty: the "
      "default) | ",
      "| `VRAMSWAP_DISK_IO` | `threads` | one of threads, cufile | ",
      "| `VRAMSWAP_MIN_OFFLOAD_BYTES` | `64KiB` | a size such as 8GiB, 512MiB or 1073741824 | ",
      "| `VRAMSWAP_HORIZON` | `4` | an integer of at most 1024 | ",
      "| `VRAMSWAP_PLAN` | `auto` | one of auto, off | ",
      "| `VRAMSWAP_VERIFY` | `0` | 1, 0, true, false, yes, no, on or off | ",
      "| `VRAMSWAP_LOG` | `warn` | one of off, error, warn, info, debug | ",
      "| `VRAMSWAP_STATS_FILE` | unset | a file path (empty: none) | ",
  };
  for (size_t i = 0; i < std::size(starts); ++i) EXPECT_TRUE(got[2 + i].starts_with(starts[i])) << got[2 + i];
}

}  // namespace

// --- VRAMSWAP_CONF (Note [VRAMSWAP_CONF]) ---

namespace vramswap::config {
namespace {

TEST(Conf, SetsEveryKeyItNames) {
  ParseResult r = parse({{"VRAMSWAP_CONF", "limit:8GiB,horizon:2, LOG : info ,VRAMSWAP_STATS_FILE:/tmp/s.json"}});
  ASSERT_TRUE(r.ok()) << r.errors.front();
  EXPECT_EQ(r.config.resolve_limit(80 * kGiB), 8 * kGiB);
  EXPECT_EQ(r.config.horizon, 2u);
  EXPECT_EQ(r.config.log_level, LogLevel::kInfo);
  EXPECT_EQ(r.config.stats_file, "/tmp/s.json");
  EXPECT_TRUE(r.warnings.empty());
}

TEST(Conf, AVariableOfItsOwnWins) {
  ParseResult r = parse({{"VRAMSWAP_CONF", "limit:8GiB,horizon:2"}, {"VRAMSWAP_LIMIT", "4GiB"}});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r.config.resolve_limit(80 * kGiB), 4 * kGiB);
  EXPECT_EQ(r.config.horizon, 2u);
}

TEST(Conf, EachBadItemIsAnErrorNamingTheVariableTheValueAndTheItem) {
  const std::string value = "limit:lots,limt:8GiB,horizon,torch_device:cpu-sim,horizon:3";
  ParseResult r = parse({{"VRAMSWAP_CONF", value}});
  ASSERT_EQ(r.errors.size(), 4u);
  const std::string head = "VRAMSWAP_CONF='" + value + "' is not valid: ";
  for (const std::string& e : r.errors) EXPECT_TRUE(e.starts_with(head)) << e;
  EXPECT_NE(r.errors[0].find("item 'limit:lots': VRAMSWAP_LIMIT='lots' is not valid"), std::string::npos) << r.errors[0];
  EXPECT_NE(r.errors[0].find("expected a size"), std::string::npos) << r.errors[0];
  EXPECT_NE(r.errors[1].find("item 'limt:8GiB': unknown key; did you mean limit?"), std::string::npos) << r.errors[1];
  EXPECT_NE(r.errors[2].find("item 'horizon' is not key:value"), std::string::npos) << r.errors[2];
  EXPECT_NE(r.errors[3].find("VRAMSWAP_TORCH_DEVICE is not a setting of the library"), std::string::npos)
      << r.errors[3];
  EXPECT_EQ(r.config.horizon, 3u) << "the good items still apply";
}

TEST(Conf, ApplyTakesAllItemsOrNone) {
  Config c;
  EXPECT_EQ(apply(c, "VRAMSWAP_CONF", "horizon:6,log:debug"), std::nullopt);
  EXPECT_EQ(c.horizon, 6u);
  EXPECT_EQ(c.log_level, LogLevel::kDebug);
  std::optional<std::string> error = apply(c, "VRAMSWAP_CONF", "horizon:1,log:loud");
  ASSERT_TRUE(error.has_value());
  EXPECT_TRUE(error->starts_with("VRAMSWAP_CONF='horizon:1,log:loud' is not valid: item 'log:loud'")) << *error;
  EXPECT_EQ(c.horizon, 6u) << "nothing applied";
}

// A key given twice would silently take the last value; it is an error naming both items.
TEST(Conf, AKeyGivenTwiceIsAnErrorNamingBothItems) {
  const std::string value = "limit:1GiB,horizon:2,VRAMSWAP_LIMIT:2GiB";
  ParseResult r = parse({{"VRAMSWAP_CONF", value}});
  ASSERT_EQ(r.errors.size(), 1u);
  EXPECT_EQ(r.errors[0], "VRAMSWAP_CONF='" + value + "' is not valid: item 'VRAMSWAP_LIMIT:2GiB': "
                         "VRAMSWAP_LIMIT is given twice (also as 'limit:1GiB'); give each key once");
  Config c;
  EXPECT_TRUE(apply(c, "VRAMSWAP_CONF", "horizon:3, HORIZON:3").has_value()) << "even with the same value";
  EXPECT_EQ(c.horizon, Config().horizon);
}

// A value holding a comma (a directory path) is given in double quotes, which run to the
// next double quote; a double quote anywhere else is an error.
TEST(Conf, ADoubleQuotedValueMayHoldCommasAndColons) {
  ParseResult r = parse({{"VRAMSWAP_CONF", "disk_dir:\"/data/a,b:c\", stats_file : \" /tmp/x,y.json\" ,horizon:2"}});
  ASSERT_TRUE(r.ok()) << r.errors.front();
  EXPECT_EQ(r.config.disk_dir, "/data/a,b:c");
  EXPECT_EQ(r.config.stats_file, " /tmp/x,y.json") << "inside the quotes, spaces are the value's";
  EXPECT_EQ(r.config.horizon, 2u);
  for (const std::string value : {"disk_dir:\"/data/a,horizon:2", "stats_file:/tmp/a\"b\"", "stats_file:\"/a\"b"}) {
    ParseResult bad = parse({{"VRAMSWAP_CONF", value}});
    ASSERT_EQ(bad.errors.size(), 1u) << value;
    EXPECT_NE(bad.errors[0].find("double quote"), std::string::npos) << bad.errors[0];
    EXPECT_TRUE(bad.errors[0].starts_with("VRAMSWAP_CONF='" + value + "' is not valid: item '")) << bad.errors[0];
  }
}

// What vramswap_configure("VRAMSWAP_CONF", ...) clears: the keys its items set.
TEST(Conf, KeysInConfAreTheTableKeysItsItemsName) {
  EXPECT_EQ(keys_in_conf("limit:8GiB, Horizon:2,VRAMSWAP_LOG:info,disk_dir:\"/a,b\""),
            (std::vector<std::string>{"VRAMSWAP_LIMIT", "VRAMSWAP_HORIZON", "VRAMSWAP_LOG", "VRAMSWAP_DISK_DIR"}));
  EXPECT_TRUE(keys_in_conf("").empty());
}

}  // namespace
}  // namespace vramswap::config
