// JsonWriter: builds one JSON document in a string, in the order the caller writes it.
//
// It is deliberately small: objects, arrays, unsigned and signed integers, booleans and
// strings, which is all vramswap's statistics need. Keys are written in call order, so a
// document's layout is fixed by the code that writes it (stable, diffable output, and
// tests can rely on it). Strings are escaped per RFC 8259: quote, backslash and control
// characters; other bytes (UTF-8 included) pass through unchanged.
//
// Invariant: the nesting stack mirrors the open objects and arrays; str() is valid JSON
// once every begin_* has its end_*. Misuse (a key inside an array, a bare value inside an
// object, an unbalanced end) is a programming error caught by assert in debug builds.
//
// Thread safety: none; a writer belongs to one thread (quote() is pure).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace vramswap::stats {

class JsonWriter {
 public:
  // Objects and arrays. The keyed forms open a member of the enclosing object; the bare
  // forms open the document or an element of the enclosing array.
  JsonWriter& begin_object();
  JsonWriter& begin_object(std::string_view key);
  JsonWriter& end_object();
  JsonWriter& begin_array();
  JsonWriter& begin_array(std::string_view key);
  JsonWriter& end_array();

  // Members of the enclosing object.
  JsonWriter& field(std::string_view key, uint64_t value);
  JsonWriter& field(std::string_view key, int64_t value);
  JsonWriter& field(std::string_view key, int value) { return field(key, static_cast<int64_t>(value)); }
  JsonWriter& field(std::string_view key, bool value);
  JsonWriter& field(std::string_view key, std::string_view value);
  JsonWriter& field(std::string_view key, const char* value) { return field(key, std::string_view(value)); }

  // The document so far.
  const std::string& str() const { return out_; }

  // `text` as a JSON string literal, quotes included. Thread-safe: pure.
  static std::string quote(std::string_view text);

 private:
  void separator();
  void key(std::string_view name);

  std::string out_;
  // One entry per open container: true when it already holds a member or element.
  std::vector<bool> has_items_;
};

}  // namespace vramswap::stats
