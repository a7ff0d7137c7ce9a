// Values of the Jinja engine (jinja.h): Python's values as Jinja2 sees them, with Python's printing,
// equality, ordering and truth. Internal to data/tokenizer.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace forge::data::jinja {

enum class Kind { undefined, none, boolean, integer, floating, string, list, tuple, dict, ns, function };

struct Value;
struct Args;
using List = std::vector<Value>;
using Function = std::function<Value(Args&)>;

// A dict keeps its keys in insertion order (Python's); keys are strings (what chat templates use).
struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  const Value* find(std::string_view key) const;
  void set(const std::string& key, Value value);
};

struct Value {
  Kind kind = Kind::undefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;               // a string; an undefined value's name (for its error)
  std::shared_ptr<List> list;  // list, tuple
  std::shared_ptr<Dict> dict;  // dict, namespace
  std::shared_ptr<Function> fn;

  static Value undefined(std::string name = {});
  static Value none();
  static Value boolean(bool v);
  static Value integer(int64_t v);
  static Value floating(double v);
  static Value string(std::string v);
  static Value make_list(List items, Kind kind = Kind::list);
  static Value make_dict(Kind kind = Kind::dict);
  static Value function(Function f);
  static Value from_json(const nlohmann::ordered_json& j);

  bool is_undefined() const { return kind == Kind::undefined; }
  bool is_number() const { return kind == Kind::integer || kind == Kind::floating || kind == Kind::boolean; }
  bool is_sequence() const { return kind == Kind::list || kind == Kind::tuple; }
  bool is_mapping() const { return kind == Kind::dict || kind == Kind::ns; }
  double number() const { return kind == Kind::floating ? f : kind == Kind::boolean ? (b ? 1 : 0) : i; }
  bool truthy() const;
  const char* type_name() const;
};

struct Args {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keywords;
  // The i-th positional argument, else the keyword `name`, else `fallback`.
  Value get(size_t i, std::string_view name, Value fallback = Value::undefined()) const;
};

// Python's str() and repr(); json.dumps (ensure_ascii=False) with an indent (< 0: none) and separators.
std::string to_str(const Value& v);
std::string to_repr(const Value& v);
std::string py_float(double v);
std::string to_json(const Value& v, int indent, const std::string& item_sep, const std::string& key_sep,
                    bool sort_keys);
bool equal(const Value& a, const Value& b);
// a < b as Python orders them; throws (via the caller's message) on types Python cannot order.
bool less(const Value& a, const Value& b, bool& comparable);

// UTF-8 code points (Python indexes strings by them).
std::vector<std::string> code_points(std::string_view s);
bool is_space(std::string_view code_point);

}  // namespace forge::data::jinja
