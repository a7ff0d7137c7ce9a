#include "forge/data/tokenizer/jinja_value.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>

namespace forge::data::jinja {

const Value* Dict::find(std::string_view key) const {
  for (const auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}

void Dict::set(const std::string& key, Value value) {
  for (auto& [k, v] : items)
    if (k == key) {
      v = std::move(value);
      return;
    }
  items.emplace_back(key, std::move(value));
}

Value Value::undefined(std::string name) {
  Value v;
  v.s = std::move(name);
  return v;
}
Value Value::none() {
  Value v;
  v.kind = Kind::none;
  return v;
}
Value Value::boolean(bool x) {
  Value v;
  v.kind = Kind::boolean, v.b = x;
  return v;
}
Value Value::integer(int64_t x) {
  Value v;
  v.kind = Kind::integer, v.i = x;
  return v;
}
Value Value::floating(double x) {
  Value v;
  v.kind = Kind::floating, v.f = x;
  return v;
}
Value Value::string(std::string x) {
  Value v;
  v.kind = Kind::string, v.s = std::move(x);
  return v;
}
Value Value::make_list(List items, Kind kind) {
  Value v;
  v.kind = kind, v.list = std::make_shared<List>(std::move(items));
  return v;
}
Value Value::make_dict(Kind kind) {
  Value v;
  v.kind = kind, v.dict = std::make_shared<Dict>();
  return v;
}
Value Value::function(Function f) {
  Value v;
  v.kind = Kind::function, v.fn = std::make_shared<Function>(std::move(f));
  return v;
}

Value Value::from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return none();
    case nlohmann::ordered_json::value_t::boolean:
      return boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned:
      return integer(static_cast<int64_t>(j.get<uint64_t>()));
    case nlohmann::ordered_json::value_t::number_float:
      return floating(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List items;
      for (const auto& e : j) items.push_back(from_json(e));
      return make_list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Value d = make_dict();
      for (const auto& [k, e] : j.items()) d.dict->items.emplace_back(k, from_json(e));
      return d;
    }
    default:
      return undefined();
  }
}

bool Value::truthy() const {
  switch (kind) {
    case Kind::undefined:
    case Kind::none:
      return false;
    case Kind::boolean:
      return b;
    case Kind::integer:
      return i != 0;
    case Kind::floating:
      return f != 0;
    case Kind::string:
      return !s.empty();
    case Kind::list:
    case Kind::tuple:
      return !list->empty();
    case Kind::dict:
      return !dict->items.empty();
    default:
      return true;
  }
}

const char* Value::type_name() const {
  switch (kind) {
    case Kind::undefined:
      return "undefined";
    case Kind::none:
      return "NoneType";
    case Kind::boolean:
      return "bool";
    case Kind::integer:
      return "int";
    case Kind::floating:
      return "float";
    case Kind::string:
      return "str";
    case Kind::list:
      return "list";
    case Kind::tuple:
      return "tuple";
    case Kind::dict:
      return "dict";
    case Kind::ns:
      return "Namespace";
    default:
      return "function";
  }
}

Value Args::get(size_t i, std::string_view name, Value fallback) const {
  if (i < positional.size()) return positional[i];
  for (const auto& [k, v] : keywords)
    if (k == name) return v;
  return fallback;
}

// Python's repr of a float: the shortest digits that read back, fixed between 1e-4 and 1e16, else
// scientific with a signed exponent of at least two digits.
std::string py_float(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v < 0 ? "-inf" : "inf";
  if (v == 0) return std::signbit(v) ? "-0.0" : "0.0";
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof(buf), std::fabs(v), std::chars_format::scientific);
  const std::string sci(buf, r.ptr);
  const size_t e = sci.find('e');
  std::string digits = sci.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int exp = std::stoi(sci.substr(e + 1));
  std::string out = v < 0 ? "-" : "";
  if (exp >= -4 && exp < 16) {
    if (exp >= 0) {
      const size_t point = static_cast<size_t>(exp) + 1;
      if (digits.size() <= point)
        out += fmt::format("{}{}.0", digits, std::string(point - digits.size(), '0'));
      else
        out += fmt::format("{}.{}", digits.substr(0, point), digits.substr(point));
    } else {
      out += fmt::format("0.{}{}", std::string(static_cast<size_t>(-exp - 1), '0'), digits);
    }
    return out;
  }
  out += digits.substr(0, 1);
  if (digits.size() > 1) out += fmt::format(".{}", digits.substr(1));
  return out + fmt::format("e{}{:02d}", exp < 0 ? '-' : '+', std::abs(exp));
}

std::vector<std::string> code_points(std::string_view s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    out.emplace_back(s.substr(i, std::min(n, s.size() - i)));
    i += n;
  }
  return out;
}

// Python's str.isspace() for one code point.
bool is_space(std::string_view cp) {
  static const char* const kSpaces[] = {
      " ",      "\t",     "\n",     "\r",     "\v",     "\f",     "\x1c",   "\x1d",   "\x1e",   "\x1f",
      "\u0085", "\u00a0", "\u1680", "\u2000", "\u2001", "\u2002", "\u2003", "\u2004", "\u2005", "\u2006",
      "\u2007", "\u2008", "\u2009", "\u200a", "\u2028", "\u2029", "\u202f", "\u205f", "\u3000"};
  for (const char* s : kSpaces)
    if (cp == s) return true;
  return false;
}

namespace {

std::string repr_string(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos, has_double = s.find('"') != std::string::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (c == quote || c == '\\')
      out += '\\', out += c;
    else if (c == '\n')
      out += "\\n";
    else if (c == '\r')
      out += "\\r";
    else if (c == '\t')
      out += "\\t";
    else if (u < 0x20 || u == 0x7f)
      out += fmt::format("\\x{:02x}", u);
    else
      out += c;
  }
  return out + quote;
}

void json_string(const std::string& s, std::string& out) {
  out += '"';
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (u < 0x20)
          out += fmt::format("\\u{:04x}", u);
        else
          out += c;
    }
  }
  out += '"';
}

void json_write(const Value& v, int indent, int level, const std::string& item_sep,
                const std::string& key_sep, bool sort_keys, std::string& out) {
  std::string newline, close;
  if (indent >= 0) {
    newline.assign(static_cast<size_t>(indent * (level + 1)) + 1, ' ');
    close.assign(static_cast<size_t>(indent * level) + 1, ' ');
    newline[0] = close[0] = '\n';
  }
  switch (v.kind) {
    case Kind::none:
      out += "null";
      return;
    case Kind::boolean:
      out += v.b ? "true" : "false";
      return;
    case Kind::integer:
      out += std::to_string(v.i);
      return;
    case Kind::floating:
      out += std::isnan(v.f) ? "NaN" : std::isinf(v.f) ? (v.f < 0 ? "-Infinity" : "Infinity") : py_float(v.f);
      return;
    case Kind::string:
      json_string(v.s, out);
      return;
    case Kind::list:
    case Kind::tuple: {
      if (v.list->empty()) {
        out += "[]";
        return;
      }
      out += "[" + newline;
      for (size_t i = 0; i < v.list->size(); ++i) {
        if (i > 0) out += item_sep + newline;
        json_write((*v.list)[i], indent, level + 1, item_sep, key_sep, sort_keys, out);
      }
      out += close + "]";
      return;
    }
    case Kind::dict:
    case Kind::ns: {
      if (v.dict->items.empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& item : v.dict->items) items.push_back(&item);
      if (sort_keys)
        std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
      out += "{" + newline;
      for (size_t i = 0; i < items.size(); ++i) {
        if (i > 0) out += item_sep + newline;
        json_string(items[i]->first, out);
        out += key_sep;
        json_write(items[i]->second, indent, level + 1, item_sep, key_sep, sort_keys, out);
      }
      out += close + "}";
      return;
    }
    default:
      throw std::invalid_argument(fmt::format("Object of type {} is not JSON serializable", v.type_name()));
  }
}

}  // namespace

std::string to_repr(const Value& v) {
  if (v.kind == Kind::string) return repr_string(v.s);
  return to_str(v);
}

std::string to_str(const Value& v) {
  switch (v.kind) {
    case Kind::undefined:
      return "";
    case Kind::none:
      return "None";
    case Kind::boolean:
      return v.b ? "True" : "False";
    case Kind::integer:
      return std::to_string(v.i);
    case Kind::floating:
      return py_float(v.f);
    case Kind::string:
      return v.s;
    case Kind::list:
    case Kind::tuple: {
      const bool tuple = v.kind == Kind::tuple;
      std::string out = tuple ? "(" : "[";
      for (size_t i = 0; i < v.list->size(); ++i) out += (i ? ", " : "") + to_repr((*v.list)[i]);
      if (tuple && v.list->size() == 1) out += ",";
      return out + (tuple ? ")" : "]");
    }
    case Kind::dict:
    case Kind::ns: {
      std::string out = v.kind == Kind::ns ? "<Namespace {" : "{";
      bool first = true;
      for (const auto& [k, e] : v.dict->items)
        out += (first ? "" : ", ") + repr_string(k) + ": " + to_repr(e), first = false;
      return out + (v.kind == Kind::ns ? "}>" : "}");
    }
    default:
      return "<function>";
  }
}

std::string to_json(const Value& v, int indent, const std::string& item_sep, const std::string& key_sep,
                    bool sort_keys) {
  std::string out;
  json_write(v, indent, 0, item_sep, key_sep, sort_keys, out);
  return out;
}

bool equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind != Kind::floating && b.kind != Kind::floating)
      return (a.kind == Kind::boolean ? a.b : a.i) == (b.kind == Kind::boolean ? b.b : b.i);
    return a.number() == b.number();
  }
  if (a.kind != b.kind) {
    if (a.is_sequence() && b.is_sequence()) return false;  // a list never equals a tuple
    return false;
  }
  switch (a.kind) {
    case Kind::undefined:
    case Kind::none:
      return true;
    case Kind::string:
      return a.s == b.s;
    case Kind::list:
    case Kind::tuple:
      if (a.list->size() != b.list->size()) return false;
      for (size_t i = 0; i < a.list->size(); ++i)
        if (!equal((*a.list)[i], (*b.list)[i])) return false;
      return true;
    case Kind::dict:
    case Kind::ns:
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& [k, v] : a.dict->items) {
        const Value* other = b.dict->find(k);
        if (!other || !equal(v, *other)) return false;
      }
      return a.kind == Kind::dict || a.dict == b.dict;
    default:
      return a.fn == b.fn;
  }
}

bool less(const Value& a, const Value& b, bool& comparable) {
  comparable = true;
  if (a.is_number() && b.is_number()) return a.number() < b.number();
  if (a.kind == Kind::string && b.kind == Kind::string) return a.s < b.s;  // UTF-8 bytes order as code points
  if (a.kind == b.kind && a.is_sequence()) {
    for (size_t i = 0; i < std::min(a.list->size(), b.list->size()); ++i) {
      if (equal((*a.list)[i], (*b.list)[i])) continue;
      return less((*a.list)[i], (*b.list)[i], comparable);
    }
    return a.list->size() < b.list->size();
  }
  comparable = false;
  return false;
}

}  // namespace forge::data::jinja
