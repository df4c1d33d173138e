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
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "config/config.h"

namespace {

using namespace vramswap::config;

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr uint64_t kTiB = uint64_t{1} << 40;
constexpr uint64_t kCard = 80 * kGiB;

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
  EXPECT_EQ(names, (std::vector<std::string>{"VRAMSWAP_LIMIT", "VRAMSWAP_LOG", "VRAMSWAP_STATS_FILE"}));
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
          ? "unknown variable " + std::string(c.key) +
                "; known variables are VRAMSWAP_LIMIT, VRAMSWAP_LOG, VRAMSWAP_STATS_FILE"
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
                    UnknownCase{"VRAMSWAP_", ""}, UnknownCase{"VRAMSWAP_HORIZON", ""}));

TEST(UnknownKeys, AreReportedWithKnownKeysStillApplied) {
  ParseResult r = parse({{"VRAMSWAP_LIMT", "8GiB"}, {"VRAMSWAP_LOG", "debug"}, {"VRAMSWAP_VERIFY", "1"}});
  EXPECT_TRUE(r.ok());
  ASSERT_EQ(r.warnings.size(), 2u);
  EXPECT_EQ(r.warnings[0], "unknown variable VRAMSWAP_LIMT; did you mean VRAMSWAP_LIMIT?");
  EXPECT_TRUE(r.warnings[1].starts_with("unknown variable VRAMSWAP_VERIFY;"));
  EXPECT_EQ(r.config.log_level, LogLevel::kDebug);
  EXPECT_EQ(r.config.resolve_limit(kCard), kCard) << "a misspelt limit is not applied";
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
  EXPECT_EQ(apply(c, "VRAMSWAP_VERIFY", "1"),
            std::optional<std::string>(
                "unknown variable VRAMSWAP_VERIFY; known variables are VRAMSWAP_LIMIT, VRAMSWAP_LOG, "
                "VRAMSWAP_STATS_FILE"));
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

TEST(FromEnvironment, ReadsVramswapVariables) {
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
  EXPECT_EQ(got, (std::vector<std::string>{"VRAMSWAP_LIMIT=0 (default)", "VRAMSWAP_LOG=warn (default)",
                                            "VRAMSWAP_STATS_FILE= (default)"}));
}

TEST(Describe, MentionsEveryKeyAndMarksWhatWasSet) {
  ParseResult r = parse({{"VRAMSWAP_LIMIT", "16 GiB"}, {"VRAMSWAP_STATS_FILE", "/tmp/s.json"}});
  ASSERT_TRUE(r.ok());
  std::vector<std::string> got = lines(describe(r.config));
  ASSERT_EQ(got.size(), keys().size());
  for (size_t i = 0; i < keys().size(); ++i) EXPECT_TRUE(got[i].starts_with(std::string(keys()[i].name) + "="));
  EXPECT_EQ(got[0], "VRAMSWAP_LIMIT=16GiB (set; default: 0)");
  EXPECT_EQ(got[1], "VRAMSWAP_LOG=warn (default)");
  EXPECT_EQ(got[2], "VRAMSWAP_STATS_FILE=/tmp/s.json (set; default: unset)");
}

TEST(Describe, ValuesParseBackToTheSameConfig) {
  ParseResult r = parse({{"VRAMSWAP_LIMIT", "33.339%"}, {"VRAMSWAP_LOG", "DEBUG"}, {"VRAMSWAP_STATS_FILE", "s.json"}});
  ASSERT_TRUE(r.ok());
  std::map<std::string, std::string> env;
  for (const std::string& line : lines(describe(r.config))) {
    size_t eq = line.find('='), note = line.rfind(" (");
    env[line.substr(0, eq)] = line.substr(eq + 1, note - eq - 1);
  }
  EXPECT_EQ(env["VRAMSWAP_LIMIT"], "33.33%");
  EXPECT_EQ(env["VRAMSWAP_LOG"], "debug");
  ParseResult again = parse(env);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again.config, r.config);
}

// --- markdown_table(): the README's table ---

TEST(MarkdownTable, HasAHeaderAndOneRowPerKey) {
  std::vector<std::string> got = lines(markdown_table());
  ASSERT_EQ(got.size(), 2 + keys().size());
  EXPECT_EQ(got[0], "| variable | default | accepted | meaning |");
  EXPECT_EQ(got[1], "| --- | --- | --- | --- |");
  for (size_t i = 0; i < keys().size(); ++i) {
    const std::string& row = got[2 + i];
    EXPECT_TRUE(row.starts_with("| `" + std::string(keys()[i].name) + "` | ")) << row;
    // Four cells: five unescaped '|' (the enum's "a|b" must not split a cell).
    size_t bars = 0;
    for (size_t j = 0; j < row.size(); ++j) bars += row[j] == '|' && (j == 0 || row[j - 1] != '\\');
    EXPECT_EQ(bars, 5u) << row;
    EXPECT_NE(row.find(std::string(keys()[i].doc)), std::string::npos) << row;
  }
}

TEST(MarkdownTable, RowsShowDefaultAndAcceptedForm) {
  std::vector<std::string> got = lines(markdown_table());
  ASSERT_EQ(got.size(), 5u);
  EXPECT_TRUE(got[2].starts_with("| `VRAMSWAP_LIMIT` | `0` | a size such as 8GiB, 512MiB, 1073741824 or a "
                                 "percentage of the card such as 80% | "))
      << got[2];
  EXPECT_TRUE(got[3].starts_with("| `VRAMSWAP_LOG` | `warn` | one of off, error, warn, info, debug | ")) << got[3];
  EXPECT_TRUE(got[4].starts_with("| `VRAMSWAP_STATS_FILE` | unset | a file path (empty: none) | ")) << got[4];
}

}  // namespace
