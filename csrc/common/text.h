// Message text for errors, built without iostreams.
//
// NOTE: std::ostringstream formats numbers through the locale machinery. Where a toolchain links
// its own copy of libstdc++ into the extension while the process has already loaded the shared
// one, the two copies' locale facets mix and `<< int` crashes (seen on the GPU machine: every
// error message segfaulted instead of raising). Text formats with snprintf into a std::string,
// which has no global state to mix.
#pragma once

#include <cstdio>
#include <string>
#include <type_traits>

namespace ep_plugin {

class Text {
 public:
  Text& operator<<(const std::string& value) { return append(value.data(), value.size()); }
  Text& operator<<(const char* value) {
    return value ? append(value, std::char_traits<char>::length(value)) : append("(null)", 6);
  }
  Text& operator<<(char value) { return append(&value, 1); }
  Text& operator<<(bool value) { return value ? append("true", 4) : append("false", 5); }
  Text& operator<<(double value) { return format("%g", value); }
  Text& operator<<(const void* value) { return format("%p", value); }

  template <typename Integer, typename std::enable_if<std::is_integral<Integer>::value, int>::type = 0>
  Text& operator<<(Integer value) {
    if (std::is_signed<Integer>::value) return format("%lld", static_cast<long long>(value));
    return format("%llu", static_cast<unsigned long long>(value));
  }

  const std::string& str() const { return text_; }

 private:
  Text& append(const char* data, size_t size) {
    text_.append(data, size);
    return *this;
  }

  template <typename Value>
  Text& format(const char* spec, Value value) {
    char buffer[64];
    const int size = std::snprintf(buffer, sizeof(buffer), spec, value);
    return size > 0 ? append(buffer, static_cast<size_t>(size) < sizeof(buffer) ? size : sizeof(buffer) - 1) : *this;
  }

  std::string text_;
};

}  // namespace ep_plugin
