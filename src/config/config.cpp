// The VRAMSWAP_* table and what is derived from it. See config.h.
#include "config.h"

#include <algorithm>
#include <cctype>
#include <iterator>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

extern char** environ;

namespace vramswap::config {
namespace {

constexpr std::string_view kPrefix = "VRAMSWAP_";

// Field access for a row of type kType bound to the Config member kField. Instantiated
// once per row; the static_asserts keep a row's type and its field's C++ type together.
template <KeyType kType, auto kField>
struct Binding {
  template <typename T>
  struct MemberType;
  template <typename T>
  struct MemberType<T Config::*> {
    using type = T;
  };
  using Field = typename MemberType<decltype(kField)>::type;

  static_assert(kType != KeyType::kSize || std::is_same_v<Field, uint64_t>, "a size row needs a uint64_t field");
  static_assert(kType != KeyType::kCount || std::is_same_v<Field, uint64_t>, "a count row needs a uint64_t field");
  static_assert(kType != KeyType::kSizeOrPercent || std::is_same_v<Field, SizeOrPercent>,
                "a size-or-percent row needs a SizeOrPercent field");
  static_assert(kType != KeyType::kBool || std::is_same_v<Field, bool>, "a bool row needs a bool field");
  static_assert(kType != KeyType::kEnum || std::is_enum_v<Field>, "an enum row needs an enum field");
  static_assert(kType != KeyType::kPath || std::is_same_v<Field, std::string>, "a path row needs a std::string field");
  static_assert(kType != KeyType::kOptionalSize || std::is_same_v<Field, std::optional<uint64_t>>,
                "an optional size row needs a std::optional<uint64_t> field");

  static auto parse_value(const KeySpec& spec, std::string_view text) {
    if constexpr (kType == KeyType::kSize) return parse_size_value(text, spec.range);
    else if constexpr (kType == KeyType::kCount) return parse_count(text, spec.range);
    else if constexpr (kType == KeyType::kSizeOrPercent) return parse_size_or_percent(text);
    else if constexpr (kType == KeyType::kBool) return parse_bool(text);
    else if constexpr (kType == KeyType::kEnum) return parse_enum(text, spec.range);
    else if constexpr (kType == KeyType::kOptionalSize) return parse_optional_size(text, spec.range);
    else return parse_path(text);
  }

  static bool set(Config& config, const KeySpec& spec, std::string_view text, std::string& reason) {
    auto parsed = parse_value(spec, text);
    if (!parsed.value) {
      reason = std::move(parsed.reason);
      return false;
    }
    if constexpr (kType == KeyType::kEnum) config.*kField = static_cast<Field>(*parsed.value);
    else config.*kField = std::move(*parsed.value);
    return true;
  }

  static std::string show(const Config& config, const KeySpec& spec) {
    const Field& v = config.*kField;
    if constexpr (kType == KeyType::kSize) return size_text(v);
    else if constexpr (kType == KeyType::kCount) return std::to_string(v);
    else if constexpr (kType == KeyType::kSizeOrPercent) return size_or_percent_text(v);
    else if constexpr (kType == KeyType::kBool) return v ? "1" : "0";
    else if constexpr (kType == KeyType::kEnum) return std::string(enum_word(spec.range, static_cast<size_t>(v)));
    else if constexpr (kType == KeyType::kOptionalSize) return optional_size_text(v);
    else return v;
  }

  static bool same(const Config& a, const Config& b) { return a.*kField == b.*kField; }
};

template <KeyType kType, auto kField>
constexpr KeySpec key(std::string_view name, TakesEffect takes_effect, std::string_view default_value,
                      std::string_view range, std::string_view doc) {
  using B = Binding<kType, kField>;
  return KeySpec{name, kType, takes_effect, default_value, range, doc, &B::set, &B::show, &B::same};
}

constexpr TakesEffect kAtOnce = TakesEffect::kAtOnce;
constexpr TakesEffect kAtCreation = TakesEffect::kBeforeFirstAllocation;

// The table. One row per key: type and field, name, when a change takes effect, default (as
// a user writes it; "" is unset), range (see KeyType), and the one-line doc the README and
// the settings dump show.
constexpr KeySpec kKeys[] = {
    key<KeyType::kSizeOrPercent, &Config::limit>(
        "VRAMSWAP_LIMIT", kAtCreation, "0", "the card",
        "Device memory vramswap may use on each GPU: the card behaves as if it had only this much. "
        "0 or unset: the whole card; more than the card: the whole card."),
    key<KeyType::kSizeOrPercent, &Config::soft_limit>(
        "VRAMSWAP_SOFT_LIMIT", kAtCreation, "90%", "the limit",
        "Resident device memory without a host copy above which cold blocks are copied to host memory in "
        "the background, ahead of need; their pages are given up, with no wait, only when an allocation needs "
        "them. 100%, 0 or at least the limit: no background copies, cold blocks are evicted only when an "
        "allocation would pass VRAMSWAP_LIMIT."),
    key<KeyType::kOptionalSize, &Config::host_limit>(
        "VRAMSWAP_HOST_LIMIT", kAtCreation, "", "2MiB..",
        "Pinned host memory that each device's eviction tier may hold; when it is full, eviction stops and "
        "allocations past the limit fail, unless VRAMSWAP_DISK_DIR names a disk tier (which also takes blocks "
        "larger than this limit). Unset: half of the host's "
        "memory (or of the cgroup's limit)."),
    key<KeyType::kPath, &Config::disk_dir>(
        "VRAMSWAP_DISK_DIR", kAtCreation, "", "directory",
        "A directory for the disk tier: when the pinned host tier is full, evicted blocks needed furthest "
        "away move on to one file there (created unlinked, mode 0600, so nothing is left behind), and come "
        "back through pinned memory when needed: read ahead of use, and written ahead of need while the "
        "pinned tier runs short, on threads of its own. Unset: no disk tier (eviction stops when the host "
        "tier is full)."),
    key<KeyType::kOptionalSize, &Config::disk_limit>(
        "VRAMSWAP_DISK_LIMIT", kAtCreation, "", "4KiB..",
        "The most file space each device's disk tier may hold. Unset: what the filesystem holds (a full "
        "filesystem is found when space is reserved, before a block leaves the host)."),
    key<KeyType::kEnum, &Config::disk_io>(
        "VRAMSWAP_DISK_IO", kAtCreation, "threads", "threads|cufile",
        "How the disk tier reads and writes its file. threads: pread/pwrite on two threads of its own; "
        "cufile: stream-ordered cuFileReadAsync/cuFileWriteAsync on two CUDA streams of its own, through "
        "libcufile.so.0 (NVIDIA's GPUDirect Storage library) loaded at run time, so that the I/O is CUDA work "
        "in stream order, waited for through events (and timed by cudasim's disk engine); where the library cannot be loaded or its "
        "driver opened, a warning says why and the tier uses threads."),
    key<KeyType::kSize, &Config::min_offload_bytes>(
        "VRAMSWAP_MIN_OFFLOAD_BYTES", kAtOnce, "64KiB", "",
        "Allocations at least this large made inside an offload scope are tagged (offloadable: under "
        "pressure they are placed so that evicting them frees pages; below half a page, tagged blocks saved one "
        "after another share pages); smaller ones stay in the ordinary pool. Measured on an H100 (tests/gpu/"
        "copy_cost.py), a pinned copy costs a fixed 3-4 us plus its bytes at 56-64 GB/s: copies of 4 KiB to "
        "64 KiB all take 3-5 us, so below 64KiB a block moves fewer bytes for the same time; above it the "
        "time grows with the bytes, reaching twice the fixed cost at 150-230 KiB. 64KiB keeps the saved tensors "
        "of small models offloadable (a 4-layer GPT at batch 16 saves 64-512 KiB tensors; a higher default "
        "would leave them on the device) at up to ~3x a large copy's cost per byte, and leaves out the "
        "smallest (normalization statistics, masks). Raise it where the copy engines, not memory, limit."),
    key<KeyType::kCount, &Config::horizon>(
        "VRAMSWAP_HORIZON", kAtCreation, "4", "0..1024",
        "How many of the blocks backward needs next are prefetched ahead of it and evicted only when nothing else can be; 0: no "
        "prefetch, an evicted block is fetched when it is unpacked."),
    key<KeyType::kEnum, &Config::plan>(
        "VRAMSWAP_PLAN", kAtCreation, "auto", "auto|off",
        "auto: each training step is recorded, and from the first step that repeats the one before, its "
        "plan is followed: the blocks that must leave are copied out as soon as they are cold and fetched "
        "back as early as memory allows (a step that differs runs under the watermarks; an allocation the "
        "plan left short evicts and waits as it would without one); off: only the watermarks and the "
        "prefetch window decide."),
    key<KeyType::kBool, &Config::verify>(
        "VRAMSWAP_VERIFY", kAtCreation, "0", "",
        "Checksum each block when it is evicted and check it when it is restored; a mismatch is an error "
        "naming the block. Costs a host pass over every copy."),
    key<KeyType::kEnum, &Config::log_level>(
        "VRAMSWAP_LOG", kAtOnce, "warn", "off|error|warn|info|debug",
        "What vramswap writes to stderr; info also prints the effective settings at startup; debug also "
        "logs, one line each, every allocation and free, each block's cold mark, copies out and back, "
        "eviction and unpack outcome, and each step's plan decision (followed, recorded, diverged, the "
        "plan made)."),
    key<KeyType::kPath, &Config::stats_file>(
        "VRAMSWAP_STATS_FILE", kAtOnce, "", "",
        "Statistics are written to this file as JSON when the process exits; unset: no file. {pid} in the "
        "path is the process id, {rank} the RANK variable of distributed launchers (0 when unset), so that each "
        "process of a distributed run writes its own file (e.g. stats-{rank}.json)."),
};

// Optimal string alignment distance (Levenshtein plus adjacent transpositions), ignoring case.
size_t edit_distance(std::string_view a, std::string_view b) {
  auto up = [](char c) { return std::toupper(static_cast<unsigned char>(c)); };
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t cost = up(a[i - 1]) == up(b[j - 1]) ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && up(a[i - 1]) == up(b[j - 2]) && up(a[i - 2]) == up(b[j - 1]))
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[a.size()][b.size()];
}

bool starts_with_prefix_ignoring_case(std::string_view name) {
  if (name.size() < kPrefix.size()) return false;
  for (size_t i = 0; i < kPrefix.size(); ++i)
    if (std::toupper(static_cast<unsigned char>(name[i])) != kPrefix[i]) return false;
  return true;
}

std::string unknown_key_message(std::string_view key) {
  std::string msg = "unknown variable " + std::string(key);
  if (std::optional<std::string_view> near = closest_key(key)) {
    msg += "; did you mean " + std::string(*near) + "?";
    return msg;
  }
  msg += "; known variables are ";
  for (size_t i = 0; i < std::size(kKeys); ++i) {
    if (i > 0) msg += ", ";
    msg += kKeys[i].name;
  }
  return msg;
}

std::string invalid_value_message(const KeySpec& spec, std::string_view value, const std::string& reason) {
  std::string msg = std::string(spec.name) + "='" + std::string(value) + "' is not valid";
  if (!reason.empty()) msg += " (" + reason + ")";
  return msg + ": expected " + accepted_form(spec.type, spec.range);
}

std::optional<std::string> set_key(Config& config, const KeySpec& spec, std::string_view value) {
  std::string reason;
  if (spec.set(config, spec, value, reason)) return std::nullopt;
  return invalid_value_message(spec, value, reason);
}

// Note [VRAMSWAP_CONF]
// ~~~~~~~~~~~~~~~~~~~~
// Every key of the table in one variable, in the style of PYTORCH_CUDA_ALLOC_CONF:
// "limit:8GiB,horizon:4". An item's key is a table key with or without the VRAMSWAP_
// prefix, in any case; its value is checked as that key's. Items are separated by commas;
// a value that holds a comma or a colon (a directory path) is given in double quotes, which
// run to the next double quote ('disk_dir:"/data/a,b"'); a double quote anywhere else is an
// error, so no value is read two ways. A key may be given once: a second item for it is an
// error naming both, where the last would otherwise win unseen. A key also set as its own
// variable takes that variable's value (parse() applies the items first; the Python
// package's check applies variables in name order, VRAMSWAP_CONF first), and a valid
// VRAMSWAP_CONF set through vramswap_configure clears a refused value of each key it names.
// Every item that cannot be applied is an error that names VRAMSWAP_CONF, the whole value
// and the item.

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

struct ConfItem {
  std::string_view text;   // the item as given, trimmed
  std::string key;         // the table key it names (prefixed, upper case); "" when none
  std::string_view value;  // trimmed, without its quotes
  std::string error;       // why the item cannot be read (before its value is checked)
};

// VRAMSWAP_CONF's items: split at commas outside double quotes, empty items skipped.
std::vector<ConfItem> split_conf(std::string_view value) {
  std::vector<ConfItem> items;
  size_t begin = 0;
  bool quoted = false;
  for (size_t i = 0; i <= value.size(); ++i) {
    if (i < value.size() && value[i] == '"') quoted = !quoted;
    if (i < value.size() && (quoted || value[i] != ',')) continue;
    ConfItem item;
    item.text = trim(value.substr(begin, i - begin));
    begin = i + 1;
    if (item.text.empty()) continue;
    const size_t colon = item.text.find(':');
    if (colon == std::string_view::npos || item.text.substr(0, colon).find('"') != std::string_view::npos) {
      item.error = "item '" + std::string(item.text) + "' is not key:value; expected items such as limit:8GiB,horizon:4";
      items.push_back(std::move(item));
      continue;
    }
    item.key = std::string(trim(item.text.substr(0, colon)));
    for (char& c : item.key) c = char(std::toupper(static_cast<unsigned char>(c)));
    if (!starts_with_prefix_ignoring_case(item.key)) item.key = std::string(kPrefix) + item.key;
    item.value = trim(item.text.substr(colon + 1));
    const size_t quotes = size_t(std::count(item.value.begin(), item.value.end(), '"'));
    if (quotes != 0) {
      if (quotes == 2 && item.value.size() >= 2 && item.value.front() == '"' && item.value.back() == '"') {
        item.value = item.value.substr(1, item.value.size() - 2);
      } else {
        item.error = "item '" + std::string(item.text) +
                     "': a double quote may only enclose a whole value, from just after the colon to "
                     "the next double quote (as in disk_dir:\"/data/a,b\")";
      }
    }
    items.push_back(std::move(item));
  }
  if (quoted && !items.empty() && items.back().error.empty()) {
    items.back().error = "item '" + std::string(items.back().text) + "': a double quote is not closed";
  }
  return items;
}

std::vector<std::string> apply_conf(Config& config, std::string_view value) {
  std::vector<std::string> errors;
  const std::string whole = std::string(kConfKey) + "='" + std::string(value) + "' is not valid: ";
  std::map<std::string, std::string_view> seen;  // key -> the item that gave it
  for (const ConfItem& item : split_conf(value)) {
    if (!item.error.empty()) {
      errors.push_back(whole + item.error);
      continue;
    }
    const std::string& name = item.key;
    const KeySpec* spec = find_key(name);
    if (spec == nullptr) {
      std::string msg = whole + "item '" + std::string(item.text) + "': ";
      if (is_python_key(name) || name == kConfKey) {
        msg += name + " is not a setting of the library; set it as a variable of its own";
      } else if (std::optional<std::string_view> near = closest_key(name)) {
        std::string shown(near->substr(kPrefix.size()));
        for (char& c : shown) c = char(std::tolower(static_cast<unsigned char>(c)));
        msg += "unknown key; did you mean " + shown + "?";
      } else {
        msg += "unknown key; keys are those of the table, with or without VRAMSWAP_ (limit, horizon, ...)";
      }
      errors.push_back(std::move(msg));
      continue;
    }
    if (auto [it, fresh] = seen.emplace(name, item.text); !fresh) {
      errors.push_back(whole + "item '" + std::string(item.text) + "': " + name + " is given twice (also as '" +
                       std::string(it->second) + "'); give each key once");
      continue;
    }
    if (std::optional<std::string> error = set_key(config, *spec, item.value))
      errors.push_back(whole + "item '" + std::string(item.text) + "': " + *error);
  }
  return errors;
}

// A Markdown table cell: '|' would end the cell, a newline the row.
std::string cell(std::string_view text) {
  std::string out;
  for (char c : text) {
    if (c == '|') out += "\\|";
    else if (c == '\n') out += ' ';
    else out += c;
  }
  return out;
}

}  // namespace

Config::Config() {
  for (const KeySpec& spec : kKeys) {
    std::string unused;
    // A default the table cannot parse would leave the field value-initialized; the
    // table's tests apply every default, so that cannot ship.
    spec.set(*this, spec, spec.default_value, unused);
  }
}

uint64_t Config::resolve_limit(uint64_t card_bytes) const {
  if (limit.kind == SizeOrPercent::Kind::kBytes && limit.bytes == 0) return card_bytes;
  return std::min(limit.of(card_bytes), card_bytes);
}

uint64_t Config::resolve_soft_limit(uint64_t limit_bytes) const {
  if (soft_limit.kind == SizeOrPercent::Kind::kBytes && soft_limit.bytes == 0) return 0;
  const uint64_t soft = soft_limit.of(limit_bytes);
  if (soft >= limit_bytes) return 0;
  return std::max<uint64_t>(soft, 1);
}

std::span<const KeySpec> keys() { return kKeys; }

const KeySpec* find_key(std::string_view name) {
  for (const KeySpec& spec : kKeys)
    if (spec.name == name) return &spec;
  return nullptr;
}

std::optional<std::string_view> closest_key(std::string_view name) {
  std::string candidate(name);
  if (!starts_with_prefix_ignoring_case(candidate)) candidate = std::string(kPrefix) + candidate;
  const KeySpec* best = nullptr;
  size_t best_distance = SIZE_MAX;
  for (const KeySpec& spec : kKeys) {
    size_t d = edit_distance(candidate, spec.name);
    if (d < best_distance) best = &spec, best_distance = d;
  }
  // A typo is a small share of the part after the prefix: up to a third of it (at least 1).
  const size_t suffix = best->name.size() - kPrefix.size();
  if (best_distance > std::max<size_t>(1, (suffix + 2) / 3)) return std::nullopt;
  return best->name;
}

bool is_python_key(std::string_view name) {
  for (std::string_view k : kPythonKeys)
    if (k == name) return true;
  return false;
}

ParseResult parse(const std::map<std::string, std::string>& env) {
  ParseResult result;
  if (auto conf = env.find(std::string(kConfKey)); conf != env.end())  // first: variables win
    for (std::string& error : apply_conf(result.config, conf->second)) result.errors.push_back(std::move(error));
  for (const auto& [key, value] : env) {
    if (!key.starts_with(kPrefix) || is_python_key(key) || key == kConfKey) continue;
    const KeySpec* spec = find_key(key);
    if (!spec) {
      result.warnings.push_back(unknown_key_message(key));
      continue;
    }
    if (std::optional<std::string> error = set_key(result.config, *spec, value))
      result.errors.push_back(std::move(*error));
  }
  return result;
}

std::optional<std::string> apply(Config& config, std::string_view key, std::string_view value) {
  if (key == kConfKey) {
    Config next = config;
    std::vector<std::string> errors = apply_conf(next, value);
    if (errors.empty()) {
      config = std::move(next);
      return std::nullopt;
    }
    std::string joined = errors.front();
    for (size_t i = 1; i < errors.size(); ++i) joined += "; " + errors[i].substr(errors[i].find(": ") + 2);
    return joined;
  }
  const KeySpec* spec = find_key(key);
  if (!spec) return unknown_key_message(key);
  return set_key(config, *spec, value);
}

std::vector<std::string> keys_in_conf(std::string_view value) {
  std::vector<std::string> keys;
  for (const ConfItem& item : split_conf(value))
    if (item.error.empty() && find_key(item.key) != nullptr) keys.push_back(item.key);
  return keys;
}

ParseResult from_environment() {
  std::map<std::string, std::string> env;
  for (char** entry = environ; entry && *entry; ++entry) {
    std::string_view text(*entry);
    if (!text.starts_with(kPrefix)) continue;
    size_t eq = text.find('=');
    if (eq == std::string_view::npos) continue;
    env.emplace(text.substr(0, eq), text.substr(eq + 1));
  }
  return parse(env);
}

std::string describe(const Config& config) {
  static const Config defaults;
  std::string out;
  for (const KeySpec& spec : kKeys) {
    out += std::string(spec.name) + "=" + spec.show(config, spec);
    if (spec.same(config, defaults)) {
      out += " (default)\n";
    } else {
      out += " (set; default: ";
      out += spec.default_value.empty() ? std::string("unset") : std::string(spec.default_value);
      out += ")\n";
    }
  }
  return out;
}

std::string markdown_table() {
  std::string out =
      "| variable | default | accepted | takes effect | meaning |\n| --- | --- | --- | --- | --- |\n";
  for (const KeySpec& spec : kKeys) {
    out += "| `" + std::string(spec.name) + "` | ";
    out += spec.default_value.empty() ? std::string("unset") : "`" + cell(spec.default_value) + "`";
    out += " | " + cell(accepted_form(spec.type, spec.range)) + " | ";
    out += spec.takes_effect == TakesEffect::kAtOnce ? "at once" : "before the first allocation";
    out += " | " + cell(spec.doc) + " |\n";
  }
  return out;
}

}  // namespace vramswap::config
