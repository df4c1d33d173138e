// The kinds of value a VRAMSWAP_* key can hold, and the grammar of each.
//
// Every parser here is pure and total: it returns the value, or no value and (when more
// can be said than "this is not the accepted form") a short reason. accepted_form() is the
// one description of each grammar; error messages and the README's table both use it, so
// what is documented is what is parsed. Fractions are rounded down everywhere, as in
// units.h. Internal to vramswap_config (config.h is the interface); tests use it directly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace vramswap::config {

// The type column of the table. The row's `range` text means, per type:
//   kSize           "lo..hi" in sizes (either side may be empty), or "" for any size
//   kSizeOrPercent  what a percentage is of ("the card")
//   kBool           unused
//   kEnum           the accepted words "a|b|c", in the order of the C++ enum's values
//   kPath           unused
//   kCount          "lo..hi" in integers (either side may be empty), or "" for any
//   kOptionalSize   as kSize; the value may also be empty, which leaves it unset (the
//                   consumer's own default applies)
enum class KeyType { kSize, kSizeOrPercent, kBool, kEnum, kPath, kCount, kOptionalSize };

// A size in bytes or a share of some whole (the card, for VRAMSWAP_LIMIT; the limit, for
// VRAMSWAP_SOFT_LIMIT).
struct SizeOrPercent {
  enum class Kind { kBytes, kPercent };
  static constexpr uint32_t kWholeBasisPoints = 10000;  // 100%

  Kind kind = Kind::kBytes;
  uint64_t bytes = 0;         // kind == kBytes
  uint32_t basis_points = 0;  // kind == kPercent: hundredths of a percent, 1..kWholeBasisPoints

  // The bytes this stands for out of `whole` bytes: `bytes`, or the percentage of `whole`
  // rounded down (exact, no overflow). Thread-safe: pure.
  uint64_t of(uint64_t whole) const;

  bool operator==(const SizeOrPercent&) const = default;
};

template <typename T>
struct Parsed {
  std::optional<T> value;
  std::string reason;  // when refused: why, if there is more to say than "not the accepted form"
};

// A size (units.h) within `range` ("lo..hi" in sizes, or ""). Thread-safe: pure.
Parsed<uint64_t> parse_size_value(std::string_view text, std::string_view range);

// "" (unset: nullopt) or a size within `range`, as parse_size_value(). Thread-safe: pure.
Parsed<std::optional<uint64_t>> parse_optional_size(std::string_view text, std::string_view range);

// A size (units.h) or a percentage "<number>[.<digits>][ ]%" from 0.01% to 100%; further
// decimals are rounded down, and a non-zero text that rounds down to nothing (0.001%,
// 0.5B) is refused rather than read as 0. Thread-safe: pure.
Parsed<SizeOrPercent> parse_size_or_percent(std::string_view text);

// 1/0, true/false, yes/no, on/off, case-insensitive. Thread-safe: pure.
Parsed<bool> parse_bool(std::string_view text);

// One of the words of `values` ("a|b|c"), case-insensitive; gives its position.
// Thread-safe: pure.
Parsed<size_t> parse_enum(std::string_view text, std::string_view values);

// The word at `index` of `values` ("a|b|c"); "" past the end. Thread-safe: pure.
std::string_view enum_word(std::string_view values, size_t index);

// Any text is a path; "" means no path (a way to switch a file off through
// vramswap_configure). Thread-safe: pure.
Parsed<std::string> parse_path(std::string_view text);

// A decimal integer within `range` ("lo..hi", or ""). Thread-safe: pure.
Parsed<uint64_t> parse_count(std::string_view text, std::string_view range);

// What a value of this type and range must look like, as the end of a sentence
// "expected <accepted_form>", e.g. "one of off, error, warn, info, debug".
// Thread-safe: pure.
std::string accepted_form(KeyType type, std::string_view range);

// How a value is written back so that its parser gives the same value: "16GiB", "80%",
// "12.5%", "1073741825", "" (an unset optional size). Thread-safe: pure.
std::string size_text(uint64_t bytes);
std::string size_or_percent_text(const SizeOrPercent& value);
std::string optional_size_text(const std::optional<uint64_t>& bytes);

}  // namespace vramswap::config
