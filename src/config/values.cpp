// Value grammars of the configuration table. See values.h.
#include "values.h"

#include <array>
#include <cctype>

#include "units.h"

namespace vramswap::config {
namespace {

struct Bounds {
  uint64_t lo = 0;
  uint64_t hi = UINT64_MAX;
};

bool is_digit(char c) { return c >= '0' && c <= '9'; }

bool equals_ignoring_case(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(b[i])))
      return false;
  return true;
}

bool has_nonzero_digit(std::string_view text) {
  for (char c : text)
    if (c >= '1' && c <= '9') return true;
  return false;
}

// Decimal digits only, no sign; nullopt for anything else or for overflow (`overflow` says
// which).
std::optional<uint64_t> parse_decimal(std::string_view text, bool* overflow) {
  *overflow = false;
  if (text.empty()) return std::nullopt;
  uint64_t value = 0;
  for (char c : text) {
    if (!is_digit(c)) return std::nullopt;
    uint64_t digit = uint64_t(c - '0');
    if (value > (UINT64_MAX - digit) / 10) {
      *overflow = true;
      return std::nullopt;
    }
    value = value * 10 + digit;
  }
  return value;
}

// "lo..hi" with either side empty; each side read by `read`. nullopt if malformed, which
// is a mistake in the table (the table's tests parse every row's range).
template <typename Read>
std::optional<Bounds> parse_bounds(std::string_view range, Read read) {
  Bounds b;
  if (range.empty()) return b;
  size_t dots = range.find("..");
  if (dots == std::string_view::npos) return std::nullopt;
  std::string_view lo = range.substr(0, dots), hi = range.substr(dots + 2);
  if (!lo.empty()) {
    std::optional<uint64_t> v = read(lo);
    if (!v) return std::nullopt;
    b.lo = *v;
  }
  if (!hi.empty()) {
    std::optional<uint64_t> v = read(hi);
    if (!v) return std::nullopt;
    b.hi = *v;
  }
  if (b.lo > b.hi) return std::nullopt;
  return b;
}

std::optional<Bounds> size_bounds(std::string_view range) {
  return parse_bounds(range, [](std::string_view s) { return parse_size(s); });
}

std::optional<Bounds> count_bounds(std::string_view range) {
  return parse_bounds(range, [](std::string_view s) {
    bool overflow;
    return parse_decimal(s, &overflow);
  });
}

// " from LO to HI", " of at least LO", " of at most HI" or "".
template <typename Show>
std::string bounds_phrase(const Bounds& b, Show show) {
  const bool has_lo = b.lo != 0, has_hi = b.hi != UINT64_MAX;
  if (has_lo && has_hi) return " from " + show(b.lo) + " to " + show(b.hi);
  if (has_lo) return " of at least " + show(b.lo);
  if (has_hi) return " of at most " + show(b.hi);
  return "";
}

constexpr std::string_view kMalformedRange = "the configuration table's range for this key is malformed";
constexpr std::string_view kOutOfRange = "out of range";

constexpr std::array<std::string_view, 4> kTrueWords = {"1", "true", "yes", "on"};
constexpr std::array<std::string_view, 4> kFalseWords = {"0", "false", "no", "off"};

// A percentage as basis points, or a reason; `text` is what precedes the '%'.
Parsed<SizeOrPercent> parse_percent(std::string_view text) {
  Parsed<SizeOrPercent> out;
  if (!text.empty() && text.back() == ' ') text.remove_suffix(1);
  size_t dot = text.find('.');
  std::string_view whole = text.substr(0, dot);
  std::string_view fraction = dot == std::string_view::npos ? std::string_view{} : text.substr(dot + 1);
  bool overflow;
  std::optional<uint64_t> number = parse_decimal(whole, &overflow);
  if (overflow) {
    out.reason = "more than 100%";
    return out;
  }
  if (!number) return out;
  if (dot != std::string_view::npos &&
      (fraction.empty() || fraction.find_first_not_of("0123456789") != std::string_view::npos))
    return out;
  if (*number > 100) {
    out.reason = "more than 100%";
    return out;
  }
  uint64_t basis_points = *number * 100;
  if (fraction.size() >= 1) basis_points += uint64_t(fraction[0] - '0') * 10;
  if (fraction.size() >= 2) basis_points += uint64_t(fraction[1] - '0');
  if (basis_points > SizeOrPercent::kWholeBasisPoints) {
    out.reason = "more than 100%";
    return out;
  }
  if (basis_points == 0) {
    out.reason = has_nonzero_digit(text) ? "rounds down to 0%; the smallest percentage is 0.01%"
                                         : "a percentage must be more than 0%";
    return out;
  }
  out.value = SizeOrPercent{SizeOrPercent::Kind::kPercent, 0, static_cast<uint32_t>(basis_points)};
  return out;
}

}  // namespace

uint64_t SizeOrPercent::of(uint64_t whole) const {
  if (kind == Kind::kBytes) return bytes;
  // whole * bp / 10000 without overflow: split whole = q * 10000 + r.
  const uint64_t q = whole / kWholeBasisPoints, r = whole % kWholeBasisPoints;
  return q * basis_points + r * basis_points / kWholeBasisPoints;
}

Parsed<uint64_t> parse_size_value(std::string_view text, std::string_view range) {
  Parsed<uint64_t> out;
  std::optional<Bounds> bounds = size_bounds(range);
  if (!bounds) {
    out.reason = kMalformedRange;
    return out;
  }
  SizeParse p = parse_size_detailed(text);
  if (p.error == SizeError::kOverflow) out.reason = "too large: more than 2^64 - 1 bytes";
  if (p.error != SizeError::kNone) return out;
  if (p.bytes == 0 && has_nonzero_digit(text)) {  // "0.1" means something, never "0 bytes"
    out.reason = "rounds down to 0 bytes";
    return out;
  }
  if (p.bytes < bounds->lo || p.bytes > bounds->hi) {
    out.reason = kOutOfRange;
    return out;
  }
  out.value = p.bytes;
  return out;
}

Parsed<std::optional<uint64_t>> parse_optional_size(std::string_view text, std::string_view range) {
  Parsed<std::optional<uint64_t>> out;
  if (text.empty()) {
    if (size_bounds(range)) out.value.emplace();  // set, to "unset"
    else out.reason = kMalformedRange;
    return out;
  }
  Parsed<uint64_t> size = parse_size_value(text, range);
  if (size.value) out.value.emplace(*size.value);
  else out.reason = std::move(size.reason);
  return out;
}

Parsed<SizeOrPercent> parse_size_or_percent(std::string_view text) {
  if (!text.empty() && text.back() == '%') return parse_percent(text.substr(0, text.size() - 1));
  Parsed<SizeOrPercent> out;
  Parsed<uint64_t> size = parse_size_value(text, "");
  if (!size.value) {
    out.reason = std::move(size.reason);
    return out;
  }
  out.value = SizeOrPercent{SizeOrPercent::Kind::kBytes, *size.value, 0};
  return out;
}

Parsed<bool> parse_bool(std::string_view text) {
  Parsed<bool> out;
  for (std::string_view w : kTrueWords)
    if (equals_ignoring_case(text, w)) out.value = true;
  for (std::string_view w : kFalseWords)
    if (equals_ignoring_case(text, w)) out.value = false;
  return out;
}

std::string_view enum_word(std::string_view values, size_t index) {
  for (size_t i = 0;; ++i) {
    size_t bar = values.find('|');
    if (i == index) return values.substr(0, bar);
    if (bar == std::string_view::npos) return {};
    values.remove_prefix(bar + 1);
  }
}

Parsed<size_t> parse_enum(std::string_view text, std::string_view values) {
  Parsed<size_t> out;
  for (size_t i = 0;; ++i) {
    size_t bar = values.find('|');
    if (equals_ignoring_case(text, values.substr(0, bar))) {
      if (!text.empty()) out.value = i;
      return out;
    }
    if (bar == std::string_view::npos) return out;
    values.remove_prefix(bar + 1);
  }
}

Parsed<std::string> parse_path(std::string_view text) { return {std::string(text), {}}; }

Parsed<uint64_t> parse_count(std::string_view text, std::string_view range) {
  Parsed<uint64_t> out;
  std::optional<Bounds> bounds = count_bounds(range);
  if (!bounds) {
    out.reason = kMalformedRange;
    return out;
  }
  bool overflow;
  std::optional<uint64_t> n = parse_decimal(text, &overflow);
  if (overflow) out.reason = "too large: more than 2^64 - 1";
  if (!n) return out;
  if (*n < bounds->lo || *n > bounds->hi) {
    out.reason = kOutOfRange;
    return out;
  }
  out.value = n;
  return out;
}

std::string accepted_form(KeyType type, std::string_view range) {
  switch (type) {
    case KeyType::kSize: {
      std::string s = "a size such as 8GiB, 512MiB or 1073741824";
      if (std::optional<Bounds> b = size_bounds(range)) s += bounds_phrase(*b, size_text);
      return s;
    }
    case KeyType::kOptionalSize:
      return accepted_form(KeyType::kSize, range) + " (empty: the default)";
    case KeyType::kSizeOrPercent:
      return "a size such as 8GiB, 512MiB, 1073741824 or a percentage of " + std::string(range) +
             " such as 80%";
    case KeyType::kBool:
      return "1, 0, true, false, yes, no, on or off";
    case KeyType::kEnum: {
      std::string s = "one of ";
      for (size_t i = 0; !enum_word(range, i).empty(); ++i) {
        if (i > 0) s += ", ";
        s += enum_word(range, i);
      }
      return s;
    }
    case KeyType::kPath:  // range: what the path names ("" for a file)
      return "a " + std::string(range.empty() ? "file" : range) + " path (empty: none)";
    case KeyType::kCount: {
      std::optional<Bounds> b = count_bounds(range);
      if (b && (b->lo != 0 || b->hi != UINT64_MAX))
        return "an integer" + bounds_phrase(*b, [](uint64_t v) { return std::to_string(v); });
      return "a non-negative integer";
    }
  }
  return "";
}

std::string size_text(uint64_t bytes) {
  static constexpr std::array<std::pair<unsigned, std::string_view>, 4> kExactUnits = {
      {{40, "TiB"}, {30, "GiB"}, {20, "MiB"}, {10, "KiB"}}};
  if (bytes != 0)
    for (const auto& [shift, unit] : kExactUnits)
      if (bytes % (uint64_t{1} << shift) == 0) return std::to_string(bytes >> shift) + std::string(unit);
  return std::to_string(bytes);
}

std::string optional_size_text(const std::optional<uint64_t>& bytes) { return bytes ? size_text(*bytes) : ""; }

std::string size_or_percent_text(const SizeOrPercent& value) {
  if (value.kind == SizeOrPercent::Kind::kBytes) return size_text(value.bytes);
  std::string s = std::to_string(value.basis_points / 100);
  const uint32_t hundredths = value.basis_points % 100;
  if (hundredths != 0) {
    s += '.';
    s += char('0' + hundredths / 10);
    if (hundredths % 10 != 0) s += char('0' + hundredths % 10);
  }
  return s + "%";
}

}  // namespace vramswap::config
