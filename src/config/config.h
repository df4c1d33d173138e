// vramswap's configuration: one table of VRAMSWAP_* keys, and everything derived from it.
//
// Each row of the table (config.cpp, kKeys) is {name, type, default, range, doc} plus the
// Config field it sets. The parser, vramswap_configure()'s apply(), the VRAMSWAP_LOG=info
// dump (describe()) and the README's table (markdown_table()) all read that table, so a
// key cannot be parsed without being documented or documented without being parsed.
// Adding a key: a field in Config, one row in kKeys.
//
// Invariants: Config() holds exactly the table's defaults; a value that is refused leaves
// the field as it was; parsing is a pure function of a key/value map (only
// from_environment() reads the process). Errors are returned, never thrown.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "values.h"

namespace vramswap::config {

// VRAMSWAP_LOG. The values are in the order of the row's accepted words.
enum class LogLevel { kOff, kError, kWarn, kInfo, kDebug };

// VRAMSWAP_PLAN, in the order of the row's accepted words.
enum class PlanMode { kAuto, kOff };

// VRAMSWAP_DISK_IO, in the order of the row's accepted words.
enum class DiskIo { kThreads, kCuFile };

// The parsed settings. Every field is set by its row of the table; no default is written
// here, Config() takes them from the table.
struct Config {
  // The table's defaults. Thread-safe.
  Config();

  SizeOrPercent limit;                 // VRAMSWAP_LIMIT; 0 bytes = the whole card
  SizeOrPercent soft_limit;            // VRAMSWAP_SOFT_LIMIT; of the limit; 0 bytes = none
  std::optional<uint64_t> host_limit;  // VRAMSWAP_HOST_LIMIT; unset = the host tier's default
  std::string disk_dir;                // VRAMSWAP_DISK_DIR; "" = no disk tier
  std::optional<uint64_t> disk_limit;  // VRAMSWAP_DISK_LIMIT; unset = what the filesystem holds
  DiskIo disk_io{};                    // VRAMSWAP_DISK_IO
  uint64_t min_offload_bytes{};        // VRAMSWAP_MIN_OFFLOAD_BYTES
  uint64_t horizon{};                  // VRAMSWAP_HORIZON
  bool verify{};                       // VRAMSWAP_VERIFY
  PlanMode plan{};                     // VRAMSWAP_PLAN
  LogLevel log_level{};                // VRAMSWAP_LOG
  std::string stats_file;              // VRAMSWAP_STATS_FILE; "" = none

  // The device memory vramswap may use on a card of `card_bytes`: the whole card when the
  // limit is 0, a percentage of it rounded down, or the byte limit capped at the card
  // (a limit cannot add memory). Thread-safe: pure.
  uint64_t resolve_limit(uint64_t card_bytes) const;

  // The soft watermark for a device whose resolved limit is `limit_bytes`, as
  // residency::EngineOptions::soft_limit_bytes takes it: 0 (no soft eviction) when the
  // soft limit is 0 bytes or reaches the limit (100%, or a size at or above it); otherwise
  // a percentage of the limit rounded down (at least 1 byte) or the byte value.
  // Thread-safe: pure.
  uint64_t resolve_soft_limit(uint64_t limit_bytes) const;

  bool operator==(const Config&) const = default;
};

// One row of the table. `set` and `show` are how the row reaches its Config field; rows
// are made by the table's key<>() helper, which checks that the field fits the type.
// When a change of a key takes effect (the table's "takes effect" column).
enum class TakesEffect {
  kAtOnce,                   // read at each use: vramswap_configure changes it at any time
  kBeforeFirstAllocation,    // becomes the options of each device's pool and engine when they
                             // are created: refused once any pool exists (unless unchanged)
};

struct KeySpec {
  std::string_view name;           // "VRAMSWAP_..."
  KeyType type;
  TakesEffect takes_effect;
  std::string_view default_value;  // as a user would write it; "" = unset
  std::string_view range;          // per type, see KeyType in values.h
  std::string_view doc;            // one line, for the README and the settings dump

  // Parses `value` into the field; false (the field unchanged, `reason` possibly set) if refused.
  bool (*set)(Config& config, const KeySpec& spec, std::string_view value, std::string& reason);
  // The field's value as text that `set` accepts and turns back into the same value.
  std::string (*show)(const Config& config, const KeySpec& spec);
  // Whether two configs agree on this row's field.
  bool (*same)(const Config& a, const Config& b);
};

// VRAMSWAP_* variables that the Python package reads and the library does not (where to
// find the libraries, the torch extensions' cache, the CPU-emulation switch, the path of
// vramswap.install()): parse() neither parses nor warns about them; vramswap_configure
// refuses them as unknown.
inline constexpr std::string_view kPythonKeys[] = {
    "VRAMSWAP_TORCH_DEVICE", "VRAMSWAP_LIBRARY", "VRAMSWAP_CUDASIM_DIR", "VRAMSWAP_CACHE_DIR",
    "VRAMSWAP_TORCH_EXT", "VRAMSWAP_TORCH_EXT_CUDA"};
bool is_python_key(std::string_view name);

// Every key of the table in one variable, "limit:8GiB,horizon:4" (Note [VRAMSWAP_CONF] in
// config.cpp: commas inside a double-quoted value, each key once); a variable of its own
// wins over the same key there.
inline constexpr std::string_view kConfKey = "VRAMSWAP_CONF";

// The table, in the order the README lists it. Thread-safe: immutable.
std::span<const KeySpec> keys();

// The row named exactly `name`, or nullptr. Thread-safe: pure.
const KeySpec* find_key(std::string_view name);

// The known key nearest to `name` (edit distance, ignoring case, transpositions cost 1;
// a missing "VRAMSWAP_" prefix is supplied), if near enough to be a likely typo.
// Thread-safe: pure.
std::optional<std::string_view> closest_key(std::string_view name);

struct ParseResult {
  Config config;                      // defaults, with every accepted value applied
  std::vector<std::string> errors;    // refused values: the caller must not start
  std::vector<std::string> warnings;  // unknown VRAMSWAP_* keys
  bool ok() const { return errors.empty(); }
};

// Reads every VRAMSWAP_* entry of `env` (other keys are ignored), VRAMSWAP_CONF's items
// first, so that a key's own variable wins. A refused value is an
// error "VRAMSWAP_X='v' is not valid (why): expected <accepted form>" and leaves that key's
// default; an unknown VRAMSWAP_* key is a warning naming the closest known key, or
// listing the known keys if none is close. Messages are in key order.
// Thread-safe: pure.
ParseResult parse(const std::map<std::string, std::string>& env);

// Sets one key, as vramswap_configure() does: the same keys and validation as parse(),
// but an unknown key is an error; VRAMSWAP_CONF sets each of its items, all or none. Returns the error message, or nullopt on success; on
// error `config` is unchanged. Not thread-safe for concurrent calls on one Config.
std::optional<std::string> apply(Config& config, std::string_view key, std::string_view value);

// The table keys (prefixed, upper case) that VRAMSWAP_CONF's `value` has readable items
// for, in item order: what a valid vramswap_configure("VRAMSWAP_CONF", value) sets, so
// what it clears a refused environment value of. Thread-safe: pure.
std::vector<std::string> keys_in_conf(std::string_view value);

// parse() of the process environment. Thread-safe except against concurrent
// setenv/putenv/unsetenv (it reads `environ`).
ParseResult from_environment();

// The effective settings, one line per key in table order, as NAME=value and whether it
// is the default: "VRAMSWAP_LOG=info (set; default: warn)", "VRAMSWAP_LIMIT=0 (default)".
// Thread-safe: pure.
std::string describe(const Config& config);

// The README's configuration table: a Markdown table with the header
// "| variable | default | accepted | meaning |" and one row per key. Thread-safe: pure.
std::string markdown_table();

}  // namespace vramswap::config
