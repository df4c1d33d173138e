// Size parsing and formatting. See units.h.
#include "units.h"

#include <array>
#include <cctype>
#include <cstdio>
#include <vector>

namespace vramswap {
namespace {

struct Unit {
  std::string_view name;  // lower case
  unsigned shift;         // bytes = number << shift
};

constexpr std::array kUnits = {
    Unit{"", 0},    Unit{"b", 0},    Unit{"k", 10},  Unit{"kb", 10},  Unit{"kib", 10},
    Unit{"m", 20},  Unit{"mb", 20},  Unit{"mib", 20}, Unit{"g", 30},  Unit{"gb", 30},
    Unit{"gib", 30}, Unit{"t", 40},  Unit{"tb", 40},  Unit{"tib", 40},
};

// The units format_size() prints, by shift / 10.
constexpr std::array<std::string_view, 5> kPrintedUnits = {"B", "KiB", "MiB", "GiB", "TiB"};

bool is_digit(char c) { return c >= '0' && c <= '9'; }

std::optional<unsigned> unit_shift(std::string_view unit) {
  std::string lower;
  for (char c : unit) lower += char(std::tolower(static_cast<unsigned char>(c)));
  for (const Unit& u : kUnits)
    if (u.name == lower) return u.shift;
  return std::nullopt;
}

// floor(0.<digits> * 2^shift), exactly: the decimal fraction is doubled `shift` times and
// each carry out of it is a bit of the result. Below 2^shift.
uint64_t scaled_fraction(std::string_view digits, unsigned shift) {
  std::vector<unsigned char> frac(digits.begin(), digits.end());
  for (auto& d : frac) d = static_cast<unsigned char>(d - '0');
  uint64_t result = 0;
  for (unsigned bit = 0; bit < shift; ++bit) {
    unsigned carry = 0;
    for (size_t j = frac.size(); j-- > 0;) {
      unsigned twice = frac[j] * 2u + carry;
      frac[j] = static_cast<unsigned char>(twice % 10);
      carry = twice / 10;
    }
    result = result * 2 + carry;
  }
  return result;
}

}  // namespace

SizeParse parse_size_detailed(std::string_view text) {
  size_t i = 0;
  while (i < text.size() && is_digit(text[i])) ++i;
  std::string_view whole = text.substr(0, i);
  if (whole.empty()) return {};
  std::string_view fraction;
  if (i < text.size() && text[i] == '.') {
    size_t start = ++i;
    while (i < text.size() && is_digit(text[i])) ++i;
    fraction = text.substr(start, i - start);
    if (fraction.empty()) return {};
  }
  std::string_view unit = text.substr(i);
  if (!unit.empty() && unit.front() == ' ') {
    unit.remove_prefix(1);
    if (unit.empty()) return {};  // "8 " has a space but no unit
  }
  std::optional<unsigned> shift = unit_shift(unit);
  if (!shift) return {};

  uint64_t number = 0;
  for (char c : whole) {
    uint64_t digit = uint64_t(c - '0');
    if (number > (UINT64_MAX - digit) / 10) return {0, SizeError::kOverflow};
    number = number * 10 + digit;
  }
  if (number > (UINT64_MAX >> *shift)) return {0, SizeError::kOverflow};
  // The fraction adds less than 2^shift to a multiple of 2^shift: no carry, no overflow.
  return {(number << *shift) + scaled_fraction(fraction, *shift), SizeError::kNone};
}

std::optional<uint64_t> parse_size(std::string_view text) {
  SizeParse p = parse_size_detailed(text);
  if (p.error != SizeError::kNone) return std::nullopt;
  return p.bytes;
}

std::string format_size(uint64_t bytes) {
  unsigned index = 0;
  while (index + 1 < kPrintedUnits.size() && bytes >= (uint64_t{1} << (10 * (index + 1)))) ++index;
  const unsigned shift = 10 * index;
  std::string out = std::to_string(bytes >> shift);
  if (shift > 0) {
    const uint64_t rest = bytes & ((uint64_t{1} << shift) - 1);
    const uint64_t hundredths = (rest * 100) >> shift;  // rest < 2^40: no overflow
    if (hundredths != 0) {
      out += '.';
      out += char('0' + hundredths / 10);
      if (hundredths % 10 != 0) out += char('0' + hundredths % 10);
    }
  }
  out += ' ';
  out += kPrintedUnits[index];
  return out;
}

std::string format_pointer(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}

std::string format_hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace vramswap
