// src/stats: the JSON writer (layout, escaping) and the logger (levels, prefixes, one
// write per message), linked statically as the plugin links them.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "stats/json_writer.h"
#include "stats/log.h"

namespace vramswap::stats {
namespace {

TEST(JsonWriter, KeysComeOutInTheOrderWritten) {
  JsonWriter json;
  json.begin_object()
      .field("b", uint64_t{2})
      .field("a", uint64_t{1})
      .field("neg", int64_t{-3})
      .field("yes", true)
      .field("s", "text");
  json.begin_array("list");
  json.begin_object().field("device", 0).end_object();
  json.begin_object().field("device", 1).end_object();
  json.end_array();
  json.begin_object("inner").end_object();
  json.begin_array("empty").end_array();
  json.end_object();
  EXPECT_EQ(json.str(),
            R"({"b":2,"a":1,"neg":-3,"yes":true,"s":"text","list":[{"device":0},{"device":1}],)"
            R"("inner":{},"empty":[]})");
}

TEST(JsonWriter, LargestIntegersAreExact) {
  JsonWriter json;
  json.begin_object().field("max", UINT64_MAX).field("min", INT64_MIN).end_object();
  EXPECT_EQ(json.str(), R"({"max":18446744073709551615,"min":-9223372036854775808})");
}

struct EscapeCase {
  const char* name;  // the CTest name of the case
  std::string in;
  std::string out;
};

class JsonEscape : public ::testing::TestWithParam<EscapeCase> {};

TEST_P(JsonEscape, QuotesPerRfc8259) { EXPECT_EQ(JsonWriter::quote(GetParam().in), GetParam().out); }

INSTANTIATE_TEST_SUITE_P(
    Cases, JsonEscape,
    ::testing::Values(EscapeCase{"empty", "", R"("")"}, EscapeCase{"plain", "plain", R"("plain")"},
                      EscapeCase{"quote", "a\"b", R"("a\"b")"}, EscapeCase{"backslash", "a\\b", R"("a\\b")"},
                      EscapeCase{"path", "/tmp/x y", R"("/tmp/x y")"},
                      EscapeCase{"newline_return_tab", "l1\nl2\r\t", R"("l1\nl2\r\t")"},
                      EscapeCase{"backspace_formfeed", "\b\f", R"("\b\f")"},
                      EscapeCase{"other_controls", std::string("\x01\x1f", 2), R"("\u0001\u001f")"},
                      EscapeCase{"utf8", "caf\xc3\xa9", "\"caf\xc3\xa9\""}),
    [](const ::testing::TestParamInfo<EscapeCase>& info) { return std::string(info.param.name); });

TEST(JsonWriter, KeysAreEscapedToo) {
  JsonWriter json;
  json.begin_object().field("a\"b", uint64_t{1}).end_object();
  EXPECT_EQ(json.str(), R"({"a\"b":1})");
}

// What log() writes to file descriptor 2 while `body` runs.
template <typename Body>
std::string captured_stderr(Body body) {
  char path[] = "/tmp/vramswap_log_XXXXXX";
  int fd = mkstemp(path);
  unlink(path);
  int saved = dup(2);
  dup2(fd, 2);
  body();
  dup2(saved, 2);
  close(saved);
  std::string out;
  char buf[4096];
  lseek(fd, 0, SEEK_SET);
  for (ssize_t n; (n = read(fd, buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
  close(fd);
  return out;
}

class Logger : public ::testing::Test {
 protected:
  void SetUp() override { saved_ = log_level(); }
  void TearDown() override { set_log_level(saved_); }
  LogLevel saved_{};
};

TEST_F(Logger, DefaultLevelIsWarn) {
  // The process starts at warn (VRAMSWAP_LOG's default) until someone sets it.
  EXPECT_EQ(saved_, LogLevel::kWarn);
}

TEST_F(Logger, PrefixesAndLevelWords) {
  set_log_level(LogLevel::kDebug);
  EXPECT_EQ(captured_stderr([] { log(LogLevel::kError, "bad %d", 1); }), "vramswap: error: bad 1\n");
  EXPECT_EQ(captured_stderr([] { log(LogLevel::kWarn, "careful"); }), "vramswap: warning: careful\n");
  EXPECT_EQ(captured_stderr([] { log(LogLevel::kInfo, "note"); }), "vramswap: note\n");
  EXPECT_EQ(captured_stderr([] { log(LogLevel::kDebug, "detail %s", "x"); }), "vramswap: detail x\n");
}

TEST_F(Logger, LevelFilters) {
  struct Row {
    LogLevel level;
    int lines;  // of one message at each of error, warn, info, debug
  };
  for (Row row : {Row{LogLevel::kOff, 0}, Row{LogLevel::kError, 1}, Row{LogLevel::kWarn, 2},
                  Row{LogLevel::kInfo, 3}, Row{LogLevel::kDebug, 4}}) {
    set_log_level(row.level);
    std::string out = captured_stderr([] {
      log(LogLevel::kError, "e");
      log(LogLevel::kWarn, "w");
      log(LogLevel::kInfo, "i");
      log(LogLevel::kDebug, "d");
      log(LogLevel::kOff, "never");
    });
    int lines = 0;
    for (char c : out) lines += c == '\n';
    EXPECT_EQ(lines, row.lines) << static_cast<int>(row.level) << ": " << out;
    EXPECT_EQ(out.find("never"), std::string::npos);
  }
}

TEST_F(Logger, EveryLineOfAMessageIsPrefixed) {
  set_log_level(LogLevel::kInfo);
  EXPECT_EQ(captured_stderr([] { log(LogLevel::kInfo, "settings:\nA=1\nB=2\n"); }),
            "vramswap: settings:\nvramswap: A=1\nvramswap: B=2\n");
}

TEST_F(Logger, LogAlwaysIgnoresTheLevel) {
  set_log_level(LogLevel::kOff);
  EXPECT_EQ(captured_stderr([] { log_always(LogLevel::kError, "stop"); }), "vramswap: error: stop\n");
}

TEST_F(Logger, LongMessagesAreCutAndStillEndTheLine) {
  set_log_level(LogLevel::kWarn);
  std::string big(10000, 'x');
  std::string out = captured_stderr([&] { log(LogLevel::kWarn, "%s", big.c_str()); });
  EXPECT_LT(out.size(), big.size());
  EXPECT_EQ(out.back(), '\n');
  EXPECT_NE(out.find("...\n"), std::string::npos);
}

}  // namespace
}  // namespace vramswap::stats
