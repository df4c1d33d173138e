// Sizes in bytes as people write them ("8GiB", "512 MiB", "1.5G") and as vramswap prints them.
//
// Grammar: <digits>[.<digits>][ ][unit], no sign, no other spaces. Units are case-insensitive
// and all 1024-based: B, K/KB/KiB, M/MB/MiB, G/GB/GiB, T/TB/TiB ("KB" is accepted as a
// synonym of "KiB", never as 1000). A fraction is exact and rounded down to whole bytes
// ("0.1KiB" is 102 bytes). A value that does not fit in uint64_t is refused, never wrapped.
//
// This library stands alone (it is also linked into the emulator, src/sim): it depends on
// nothing else of the project.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace vramswap {

// Why parse_size_detailed() refused a text.
enum class SizeError {
  kNone,      // parsed
  kSyntax,    // not of the form <number>[ ][unit]
  kOverflow,  // well formed, but more than UINT64_MAX bytes
};

struct SizeParse {
  uint64_t bytes = 0;  // valid when error == kNone
  SizeError error = SizeError::kSyntax;
};

// Parses a size (see the grammar above), telling a malformed text from an overflowing one
// so that an error message can say which. Thread-safe: pure.
SizeParse parse_size_detailed(std::string_view text);

// Parses a size; nullopt for an empty, malformed, negative or overflowing text.
// Thread-safe: pure.
std::optional<uint64_t> parse_size(std::string_view text);

// Formats a byte count for people: "512 B" below 1 KiB (exact), otherwise the largest
// unit up to TiB that is at most the value, with up to two decimals rounded down and
// trailing zeros dropped ("1.5 GiB", "1023.99 MiB", "2 KiB"). The result is accepted by
// parse_size(), which gives back at most the original value. Thread-safe: pure.
std::string format_size(uint64_t bytes);

// A pointer as "%p" prints it ("0x7f..."; "(nil)" for null), for messages naming a block.
// Thread-safe: pure.
std::string format_pointer(const void* p);

// A number in hexadecimal with "0x" ("0x1f"), for handles and addresses held as integers.
// Thread-safe: pure.
std::string format_hex(uint64_t v);

// `v` rounded up to a multiple of `to` (> 0; no overflow check: the callers' values are
// sizes far below UINT64_MAX). Thread-safe: pure.
constexpr uint64_t round_up(uint64_t v, uint64_t to) { return (v + to - 1) / to * to; }

}  // namespace vramswap
