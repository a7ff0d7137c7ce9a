// A setting that is one of a few named values: an enum everywhere after parsing, its name only at the
// boundary (TOML, --set overrides, messages, the written config.toml). Code compares and switches on the
// enum; a string comparison of a validated value does not compile.
//
// Each enum used in a Choice names its values once, in a ChoiceTraits<E> specialisation (train/config.h),
// in the order they are listed to users.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "forge/core/error.h"

namespace forge::train {

template <typename E>
using ChoiceNames = std::vector<std::pair<E, std::string_view>>;

// Specialised per enum: static const ChoiceNames<E>& names().
template <typename E>
struct ChoiceTraits;

// The key table's type-erased view of a Choice (train/config.cpp reads and writes every key through it).
class ChoiceField {
 public:
  virtual std::string_view name() const = 0;
  virtual std::vector<std::string_view> names() const = 0;
  // Sets the value of that name; false (and unchanged) when none has it.
  virtual bool set(std::string_view name) = 0;

 protected:
  ChoiceField() = default;
  ChoiceField(const ChoiceField&) = default;
  ChoiceField& operator=(const ChoiceField&) = default;
  ~ChoiceField() = default;
};

template <typename E>
class Choice final : public ChoiceField {
 public:
  Choice(E value) : value_(value) {}  // NOLINT: implicit, as the enum it holds
  Choice(const Choice&) = default;
  Choice& operator=(const Choice&) = default;
  Choice& operator=(E value) {
    value_ = value;
    return *this;
  }
  // By name (code and tests that hold a name); an unknown name is an error listing the names.
  Choice& operator=(std::string_view name) {
    if (!set(name)) {
      std::string allowed;
      for (std::string_view n : names()) allowed += fmt::format("{}'{}'", allowed.empty() ? "" : ", ", n);
      fail("'{}' is not one of {}", name, allowed);
    }
    return *this;
  }
  Choice& operator=(const char* name) { return *this = std::string_view(name); }

  operator E() const { return value_; }  // NOLINT: compare and switch on the enum
  E value() const { return value_; }
  bool operator==(const Choice& other) const { return value_ == other.value_; }
  bool operator==(E value) const { return value_ == value; }

  std::string_view name() const override {
    for (const auto& [value, name] : ChoiceTraits<E>::names())
      if (value == value_) return name;
    return "?";
  }
  std::vector<std::string_view> names() const override {
    std::vector<std::string_view> out;
    for (const auto& entry : ChoiceTraits<E>::names()) out.push_back(entry.second);
    return out;
  }
  bool set(std::string_view name) override {
    for (const auto& [value, n] : ChoiceTraits<E>::names())
      if (n == name) {
        value_ = value;
        return true;
      }
    return false;
  }

 private:
  E value_;
};

}  // namespace forge::train
