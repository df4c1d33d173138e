// JsonWriter. See json_writer.h.
#include "stats/json_writer.h"

#include <cassert>
#include <cstdio>

namespace vramswap::stats {

std::string JsonWriter::quote(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 2);
  out += '"';
  for (char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  out += '"';
  return out;
}

void JsonWriter::separator() {
  if (has_items_.empty()) {
    assert(out_.empty() && "one top-level value per document");
    return;
  }
  if (has_items_.back()) out_ += ',';
  has_items_.back() = true;
}

void JsonWriter::key(std::string_view name) {
  assert(!has_items_.empty() && "a key needs an enclosing object");
  separator();
  out_ += quote(name);
  out_ += ':';
}

JsonWriter& JsonWriter::begin_object() {
  separator();
  out_ += '{';
  has_items_.push_back(false);
  return *this;
}

JsonWriter& JsonWriter::begin_object(std::string_view name) {
  key(name);
  out_ += '{';
  has_items_.push_back(false);
  return *this;
}

JsonWriter& JsonWriter::end_object() {
  assert(!has_items_.empty());
  has_items_.pop_back();
  out_ += '}';
  return *this;
}

JsonWriter& JsonWriter::begin_array() {
  separator();
  out_ += '[';
  has_items_.push_back(false);
  return *this;
}

JsonWriter& JsonWriter::begin_array(std::string_view name) {
  key(name);
  out_ += '[';
  has_items_.push_back(false);
  return *this;
}

JsonWriter& JsonWriter::end_array() {
  assert(!has_items_.empty());
  has_items_.pop_back();
  out_ += ']';
  return *this;
}

JsonWriter& JsonWriter::field(std::string_view name, uint64_t value) {
  key(name);
  out_ += std::to_string(value);
  return *this;
}

JsonWriter& JsonWriter::field(std::string_view name, int64_t value) {
  key(name);
  out_ += std::to_string(value);
  return *this;
}

JsonWriter& JsonWriter::field(std::string_view name, bool value) {
  key(name);
  out_ += value ? "true" : "false";
  return *this;
}

JsonWriter& JsonWriter::field(std::string_view name, std::string_view value) {
  key(name);
  out_ += quote(value);
  return *this;
}

}  // namespace vramswap::stats
