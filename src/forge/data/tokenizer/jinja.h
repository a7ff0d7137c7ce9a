// A Jinja template engine for Hugging Face chat templates (tokenizer_config.json's `chat_template`).
//
// transformers renders a chat template with Python's Jinja2 (an immutable sandbox, trim_blocks and
// lstrip_blocks on, the loop controls and its {% generation %} extension, its own tojson and the globals
// raise_exception and strftime_now). This engine renders what those templates use, with Jinja2's semantics:
// statements if/elif/else, for (tuple targets, an inline `if`, else, loop.index/index0/first/last/length/
// revindex/revindex0/previtem/nextitem/cycle, break and continue), set (names, tuples, namespace attributes,
// blocks), macros, raw, generation, whitespace control (`-`, trim_blocks, lstrip_blocks, `+`) and comments;
// expressions with Python's values (none, booleans, integers, floats, strings, lists, tuples, dicts in
// insertion order), arithmetic, `~`, comparisons, in / not in, and / or / not, conditional expressions,
// subscripts and slices, attribute lookup (attribute first, then item, as Jinja2's getattr), string and dict
// methods, the filters and tests those templates use, and Jinja2's undefined (printed empty, false, empty
// when iterated; an error when its attribute is read). Values print as Python's str() prints them and tojson
// writes Python's json.dumps (ensure_ascii off, as transformers sets it).
//
// Not a general Jinja: no template inheritance, includes, imports or call blocks, no autoescape. A construct
// outside what is listed is refused when the template is parsed, in one line naming the template and the
// line, never rendered differently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace forge::data::jinja {

struct Rendered {
  std::string text;
  // [begin, end) byte offsets into text of what each {% generation %} block rendered, in order.
  std::vector<std::pair<size_t, size_t>> generation;
};

class Template {
 public:
  // Throws forge::Error "<name>: line N: ..." for a template it cannot parse.
  static Template parse(std::string_view source, std::string_view name);

  // context: the template's variables (an object; dicts keep their key order). strftime_now formats the
  // current local time, or with now > 0 that time (seconds since the epoch) in UTC, for renderings that
  // must not change from day to day. Throws forge::Error naming the template and the line for
  // raise_exception and for errors at run time (an undefined variable's attribute, a type mismatch, ...).
  Rendered render(const nlohmann::ordered_json& context, int64_t now = 0) const;

  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;
  ~Template();

  struct Impl;

 private:
  explicit Template(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace forge::data::jinja
