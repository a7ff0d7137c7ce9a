// The Jinja engine of jinja.h: the template is cut into text and tags (with Jinja2's whitespace rules as
// transformers configures them), the tags' tokens parsed into statements and expressions, and the tree
// evaluated over scopes (a for loop's body gets a fresh scope each iteration, as in Jinja2; if does not).
#include "forge/data/tokenizer/jinja.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <map>
#include <optional>
#include <stdexcept>
#include <unordered_map>

#include "forge/core/error.h"
#include "forge/data/tokenizer/jinja_value.h"

namespace forge::data::jinja {
namespace {

// An error at a line of the template; render() and parse() turn it into forge::Error naming the template.
struct LineError : std::runtime_error {
  LineError(int line, const std::string& what) : std::runtime_error(what), line(line) {}
  int line;
};

[[noreturn]] void error_at(int line, const std::string& message) { throw LineError(line, message); }

// ---- Lexing.

enum class Tok { name, string, integer, floating, op, end };

struct Token {
  Tok type = Tok::end;
  std::string text;
  int64_t i = 0;
  double f = 0;
  int line = 0;
};

enum class SegmentKind { text, output, statement };

struct Segment {
  SegmentKind kind = SegmentKind::text;
  std::string text;           // text
  std::vector<Token> tokens;  // output, statement (ending with an end token)
  int line = 1;
};

bool is_name_start(char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_'; }
bool is_name_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

class Lexer {
 public:
  Lexer(std::string_view src) : src_(src) {}

  std::vector<Segment> run() {
    std::vector<Segment> out;
    size_t pos = 0;
    bool strip_next = false, trim_next = false;
    while (pos <= src_.size()) {
      const size_t tag = find_tag(pos);
      std::string text(src_.substr(pos, tag - pos));
      const int text_line = line_at(pos);
      if (strip_next) {
        size_t k = 0;
        while (k < text.size() && std::isspace(static_cast<unsigned char>(text[k]))) ++k;
        text.erase(0, k);
      } else if (trim_next && !text.empty() && text[0] == '\n') {
        text.erase(0, 1);
      }
      strip_next = trim_next = false;
      if (tag == src_.size()) {
        push_text(out, std::move(text), text_line);
        break;
      }
      const char kind = src_[tag + 1];  // '{', '%' or '#'
      const char modifier = tag + 2 < src_.size() ? src_[tag + 2] : '\0';
      const bool block = kind == '%' || kind == '#';
      if (modifier == '-') {
        while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
      } else if (block && modifier != '+') {
        // lstrip_blocks: spaces and tabs from the start of the line to a block or comment tag.
        size_t k = tag;
        while (k > pos && (src_[k - 1] == ' ' || src_[k - 1] == '\t')) --k;
        if (k == 0 || src_[k - 1] == '\n') text.erase(text.size() - std::min(text.size(), tag - k));
      }
      push_text(out, std::move(text), text_line);
      const int line = line_at(tag);
      size_t at = tag + 2 + (modifier == '-' || modifier == '+' ? 1 : 0);
      if (kind == '#') {
        const size_t close = src_.find("#}", at);
        if (close == std::string_view::npos) error_at(line, "a comment is not closed ('#}')");
        strip_next = close > at && src_[close - 1] == '-';
        trim_next = !strip_next;
        pos = close + 2;
        continue;
      }
      Segment seg;
      seg.kind = kind == '{' ? SegmentKind::output : SegmentKind::statement;
      seg.line = line;
      const char closer = kind == '{' ? '}' : '%';
      bool minus = false;
      pos = lex_tag(at, closer, seg.tokens, minus);
      strip_next = minus;
      trim_next = !minus && kind == '%';
      if (seg.kind == SegmentKind::statement && seg.tokens.size() == 2 && seg.tokens[0].type == Tok::name &&
          seg.tokens[0].text == "raw") {
        pos = raw_block(pos, line, out, strip_next, trim_next);
        continue;
      }
      out.push_back(std::move(seg));
    }
    return out;
  }

 private:
  void push_text(std::vector<Segment>& out, std::string text, int line) {
    if (text.empty()) return;
    Segment seg;
    seg.kind = SegmentKind::text, seg.text = std::move(text), seg.line = line;
    out.push_back(std::move(seg));
  }

  int line_at(size_t pos) {
    while (counted_ < pos && counted_ < src_.size()) line_ += src_[counted_++] == '\n';
    return line_;
  }

  size_t find_tag(size_t pos) const {
    for (size_t k = pos; k + 1 < src_.size(); ++k)
      if (src_[k] == '{' && (src_[k + 1] == '{' || src_[k + 1] == '%' || src_[k + 1] == '#')) return k;
    return src_.size();
  }

  // {% raw %}...{% endraw %}: the text between as it is (the endraw tag's own whitespace control applies).
  size_t raw_block(size_t pos, int line, std::vector<Segment>& out, bool& strip_next, bool& trim_next) {
    for (size_t k = src_.find("{%", pos); k != std::string_view::npos; k = src_.find("{%", k + 2)) {
      size_t a = k + 2;
      const bool minus = a < src_.size() && src_[a] == '-';
      if (minus || (a < src_.size() && src_[a] == '+')) ++a;
      while (a < src_.size() && std::isspace(static_cast<unsigned char>(src_[a]))) ++a;
      if (src_.substr(a, 6) != "endraw") continue;
      std::string text(src_.substr(pos, k - pos));
      if (strip_next) {
        size_t s = 0;
        while (s < text.size() && std::isspace(static_cast<unsigned char>(text[s]))) ++s;
        text.erase(0, s);
      } else if (trim_next && !text.empty() && text[0] == '\n') {
        text.erase(0, 1);
      }
      if (minus)
        while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
      push_text(out, std::move(text), line);
      std::vector<Token> tokens;
      bool close_minus = false;
      const size_t end = lex_tag(a, '%', tokens, close_minus);
      if (tokens.size() != 2) error_at(line_at(k), "endraw takes nothing");
      strip_next = close_minus, trim_next = !close_minus;
      return end;
    }
    error_at(line, "a raw block is not closed ('{% endraw %}')");
  }

  // Tokens from `at` to the tag's closer ("}}" or "%}", optionally "-}}" / "-%}"); returns the position after
  // it.
  size_t lex_tag(size_t at, char closer, std::vector<Token>& tokens, bool& minus) {
    size_t k = at;
    int depth = 0;  // open brackets: a '}' inside a dict literal does not close the tag
    while (true) {
      while (k < src_.size() && std::isspace(static_cast<unsigned char>(src_[k]))) ++k;
      const int line = line_at(k);
      if (k >= src_.size()) error_at(line, fmt::format("a tag is not closed ('{}}}')", closer));
      const char c = src_[k];
      if (depth == 0 && c == '-' && src_.substr(k + 1, 2) == std::string{closer, '}'}) {
        minus = true;
        tokens.push_back(Token{Tok::end, "", 0, 0, line});
        return k + 3;
      }
      if (depth == 0 && c == closer && k + 1 < src_.size() && src_[k + 1] == '}') {
        tokens.push_back(Token{Tok::end, "", 0, 0, line});
        return k + 2;
      }
      Token t;
      t.line = line;
      if (is_name_start(c)) {
        size_t e = k;
        while (e < src_.size() && is_name_char(src_[e])) ++e;
        t.type = Tok::name, t.text = std::string(src_.substr(k, e - k));
        k = e;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        size_t e = k;
        bool is_float = false;
        while (e < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        if (e + 1 < src_.size() && src_[e] == '.' && std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
          is_float = true, ++e;
          while (e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e]))) ++e;
        }
        if (e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
          size_t x = e + 1;
          if (x < src_.size() && (src_[x] == '+' || src_[x] == '-')) ++x;
          if (x < src_.size() && std::isdigit(static_cast<unsigned char>(src_[x]))) {
            is_float = true, e = x;
            while (e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e]))) ++e;
          }
        }
        std::string digits(src_.substr(k, e - k));
        digits.erase(std::remove(digits.begin(), digits.end(), '_'), digits.end());
        if (is_float)
          t.type = Tok::floating, t.f = std::stod(digits);
        else
          t.type = Tok::integer, t.i = std::stoll(digits);
        k = e;
      } else if (c == '\'' || c == '"') {
        t.type = Tok::string;
        k = lex_string(k, t.text, line);
      } else {
        static const char* const kOps[] = {"**", "//", "==", "!=", "<=", ">=", "+", "-", "*",
                                           "/",  "%",  "~",  "<",  ">",  "=",  ".", ",", ":",
                                           "(",  ")",  "[",  "]",  "{",  "}",  "|"};
        bool found = false;
        for (const char* op : kOps)
          if (src_.substr(k, std::char_traits<char>::length(op)) == op) {
            t.type = Tok::op, t.text = op, k += t.text.size(), found = true;
            depth += (t.text == "(" || t.text == "[" || t.text == "{") -
                     (t.text == ")" || t.text == "]" || t.text == "}");
            break;
          }
        if (!found) error_at(line, fmt::format("unexpected character '{}'", c));
      }
      tokens.push_back(std::move(t));
    }
  }

  size_t lex_string(size_t k, std::string& out, int line) {
    const char quote = src_[k++];
    while (k < src_.size() && src_[k] != quote) {
      char c = src_[k++];
      if (c == '\\' && k < src_.size()) {
        const char e = src_[k++];
        switch (e) {
          case 'n':
            out += '\n';
            break;
          case 't':
            out += '\t';
            break;
          case 'r':
            out += '\r';
            break;
          case '0':
            out += '\0';
            break;
          case '\\':
          case '\'':
          case '"':
            out += e;
            break;
          case 'u':
          case 'x': {
            const size_t n = e == 'u' ? 4 : 2;
            const uint32_t cp =
                static_cast<uint32_t>(std::stoul(std::string(src_.substr(k, n)), nullptr, 16));
            k += n;
            append_utf8(cp, out);
            break;
          }
          case '\n':
            break;
          default:
            out += '\\', out += e;
        }
      } else {
        out += c;
      }
    }
    if (k >= src_.size()) error_at(line, "a string is not closed");
    return k + 1;
  }

  static void append_utf8(uint32_t cp, std::string& out) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6)), out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xE0 | (cp >> 12)), out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  std::string_view src_;
  size_t counted_ = 0;
  int line_ = 1;
};

// ---- Syntax trees.

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

enum class ExprKind {
  literal,
  name,
  attr,
  item,
  slice,
  call,
  filter,
  test,
  unary,
  binary,
  compare,
  and_,
  or_,
  not_,
  cond,
  list,
  tuple,
  dict
};

struct Expr {
  ExprKind kind;
  int line = 0;
  Value value;                // literal
  std::string name;           // name, attr, filter, test, unary / binary operator
  std::vector<ExprPtr> args;  // operands; call: callee first; filter / test: subject first
  std::vector<std::pair<std::string, ExprPtr>> keywords;  // call, filter, test
  std::vector<std::string> ops;                           // compare: one per operand after the first
  bool negated = false;                                   // test
  bool has[3] = {false, false, false};                    // slice: which of start, stop, step are given
};

enum class NodeKind { text, output, if_, for_, set, set_block, macro, break_, continue_, generation };

struct Node;
using Body = std::vector<std::unique_ptr<Node>>;

struct Node {
  NodeKind kind;
  int line = 0;
  std::string text;                  // text; set_block / macro: the name
  std::vector<std::string> targets;  // for / set: names (set: "ns.attr" for a namespace attribute)
  std::vector<ExprPtr> exprs;        // output: 1; if: the conditions; for: iterable [, filter]; set: value
  std::vector<Body> bodies;          // if: one per condition [+ else]; for: body [+ else]; others: body
  std::vector<std::pair<std::string, ExprPtr>> params;  // macro: name, default (may be null)
};

// ---- Parsing.

class Parser {
 public:
  explicit Parser(std::vector<Segment> segments) : segs_(std::move(segments)) {}

  Body parse() {
    Body body = parse_body({});
    if (seg_ < segs_.size())
      error_at(segs_[seg_].line, fmt::format("unexpected '{}'", segs_[seg_].tokens[0].text));
    return body;
  }

 private:
  // Statements until one whose keyword is in `stops` (left unconsumed), or the end.
  Body parse_body(const std::vector<std::string>& stops) {
    Body body;
    while (seg_ < segs_.size()) {
      Segment& s = segs_[seg_];
      if (s.kind == SegmentKind::text) {
        auto n = std::make_unique<Node>();
        n->kind = NodeKind::text, n->text = s.text, n->line = s.line;
        body.push_back(std::move(n));
        ++seg_;
        continue;
      }
      toks_ = &s.tokens, pos_ = 0;
      if (s.kind == SegmentKind::output) {
        auto n = std::make_unique<Node>();
        n->kind = NodeKind::output, n->line = s.line;
        n->exprs.push_back(parse_tuple_expr());
        expect_end();
        body.push_back(std::move(n));
        ++seg_;
        continue;
      }
      const Token& kw = peek();
      if (kw.type != Tok::name) error_at(kw.line, "a statement must start with a keyword");
      if (std::find(stops.begin(), stops.end(), kw.text) != stops.end()) return body;
      body.push_back(parse_statement());
    }
    if (!stops.empty())
      error_at(segs_.empty() ? 1 : segs_.back().line, fmt::format("missing '{{% {} %}}'", stops.back()));
    return body;
  }

  // Enters the statement segment at seg_ (its keyword consumed by the caller's check).
  void begin(const char* keyword) {
    toks_ = &segs_[seg_].tokens, pos_ = 0;
    const Token& t = next();
    if (t.type != Tok::name || t.text != keyword) error_at(t.line, fmt::format("expected '{}'", keyword));
  }
  void finish() {
    expect_end();
    ++seg_;
  }

  std::unique_ptr<Node> parse_statement() {
    const Token kw = next();
    auto n = std::make_unique<Node>();
    n->line = kw.line;
    const std::string& k = kw.text;
    if (k == "if") {
      n->kind = NodeKind::if_;
      n->exprs.push_back(parse_expression());
      finish();
      n->bodies.push_back(parse_body({"elif", "else", "endif"}));
      while (true) {
        toks_ = &segs_[seg_].tokens, pos_ = 0;
        const std::string word = next().text;
        if (word == "elif") {
          n->exprs.push_back(parse_expression());
          finish();
          n->bodies.push_back(parse_body({"elif", "else", "endif"}));
        } else if (word == "else") {
          finish();
          n->bodies.push_back(parse_body({"endif"}));
          begin("endif");
          finish();
          break;
        } else {
          finish();
          break;
        }
      }
    } else if (k == "for") {
      n->kind = NodeKind::for_;
      n->targets = parse_targets(false);
      const Token& in = next();
      if (in.type != Tok::name || in.text != "in") error_at(in.line, "expected 'in' in a for statement");
      n->exprs.push_back(parse_or_tuple_without_if());
      if (accept_name("if")) n->exprs.push_back(parse_expression());
      if (accept_name("recursive")) error_at(n->line, "recursive loops are not supported");
      finish();
      n->bodies.push_back(parse_body({"else", "endfor"}));
      toks_ = &segs_[seg_].tokens, pos_ = 0;
      if (next().text == "else") {
        finish();
        n->bodies.push_back(parse_body({"endfor"}));
        begin("endfor");
      }
      finish();
    } else if (k == "set") {
      n->targets = parse_targets(true);
      if (accept_op("=")) {
        n->kind = NodeKind::set;
        n->exprs.push_back(parse_tuple_expr());
        finish();
      } else {
        if (n->targets.size() != 1 || n->targets[0].find('.') != std::string::npos)
          error_at(n->line, "a set block assigns one name");
        n->kind = NodeKind::set_block;
        if (accept_op("|")) error_at(n->line, "filtered set blocks are not supported");
        finish();
        n->bodies.push_back(parse_body({"endset"}));
        begin("endset");
        finish();
      }
    } else if (k == "macro") {
      n->kind = NodeKind::macro;
      n->text = expect_name();
      expect_op("(");
      while (!accept_op(")")) {
        if (!n->params.empty()) expect_op(",");
        if (accept_op(")")) break;
        std::string name = expect_name();
        ExprPtr fallback;
        if (accept_op("=")) fallback = parse_expression();
        n->params.emplace_back(std::move(name), std::move(fallback));
      }
      finish();
      n->bodies.push_back(parse_body({"endmacro"}));
      begin("endmacro");
      finish();
    } else if (k == "break" || k == "continue") {
      n->kind = k == "break" ? NodeKind::break_ : NodeKind::continue_;
      finish();
    } else if (k == "generation") {
      n->kind = NodeKind::generation;
      finish();
      n->bodies.push_back(parse_body({"endgeneration"}));
      begin("endgeneration");
      finish();
    } else {
      error_at(kw.line, fmt::format("unsupported statement '{}'", k));
    }
    return n;
  }

  // for: a name or names separated by commas (optionally in parentheses); set: the same, or ns.attr.
  std::vector<std::string> parse_targets(bool allow_attr) {
    std::vector<std::string> names;
    const bool paren = accept_op("(");
    do {
      std::string name = expect_name();
      if (allow_attr && accept_op(".")) name += "." + expect_name();
      names.push_back(std::move(name));
    } while (accept_op(","));
    if (paren) expect_op(")");
    return names;
  }

  // ---- Expressions (Jinja2's precedence).
  // An element, or elements separated by commas as a tuple (a trailing comma allowed).
  ExprPtr parse_tuple_of(ExprPtr (Parser::*element)()) {
    ExprPtr first = (this->*element)();
    if (!is_op(",")) return first;
    auto t = make(ExprKind::tuple, first->line);
    t->args.push_back(std::move(first));
    while (accept_op(",") && !at_end()) t->args.push_back((this->*element)());
    return t;
  }
  ExprPtr parse_tuple_expr() { return parse_tuple_of(&Parser::parse_expression); }
  // A for loop's iterable: no conditional expression (its `if` filters the loop).
  ExprPtr parse_or_tuple_without_if() { return parse_tuple_of(&Parser::parse_or); }

  ExprPtr parse_expression() {
    ExprPtr e = parse_or();
    while (accept_name("if")) {
      auto c = make(ExprKind::cond, e->line);
      ExprPtr condition = parse_or();
      ExprPtr otherwise;
      if (accept_name("else")) otherwise = parse_expression();
      c->args.push_back(std::move(e));
      c->args.push_back(std::move(condition));
      if (otherwise) c->args.push_back(std::move(otherwise));
      e = std::move(c);
    }
    return e;
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (accept_name("or")) left = binary(ExprKind::or_, "or", std::move(left), parse_and());
    return left;
  }
  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (accept_name("and")) left = binary(ExprKind::and_, "and", std::move(left), parse_not());
    return left;
  }
  ExprPtr parse_not() {
    if (is_name("not")) {
      const int line = next().line;
      auto n = make(ExprKind::not_, line);
      n->args.push_back(parse_not());
      return n;
    }
    return parse_compare();
  }
  ExprPtr parse_compare() {
    ExprPtr first = parse_math1();
    std::unique_ptr<Expr> cmp;
    while (true) {
      std::string op;
      if (is_op("==") || is_op("!=") || is_op("<") || is_op(">") || is_op("<=") || is_op(">="))
        op = next().text;
      else if (accept_name("in"))
        op = "in";
      else if (is_name("not") && pos_ + 1 < toks_->size() && (*toks_)[pos_ + 1].type == Tok::name &&
               (*toks_)[pos_ + 1].text == "in")
        pos_ += 2, op = "not in";
      else
        break;
      if (!cmp) {
        cmp = make(ExprKind::compare, first->line);
        cmp->args.push_back(std::move(first));
      }
      cmp->ops.push_back(op);
      cmp->args.push_back(parse_math1());
    }
    return cmp ? std::move(cmp) : std::move(first);
  }
  // A left-associative level of binary operators over the next level's operands.
  ExprPtr parse_level(std::initializer_list<const char*> ops, ExprPtr (Parser::*operand)()) {
    ExprPtr left = (this->*operand)();
    while (true) {
      const char* hit = nullptr;
      for (const char* op : ops)
        if (is_op(op)) hit = op;
      if (!hit) return left;
      next();
      left = binary(ExprKind::binary, hit, std::move(left), (this->*operand)());
    }
  }
  ExprPtr parse_math1() { return parse_level({"+", "-"}, &Parser::parse_concat); }
  ExprPtr parse_concat() { return parse_level({"~"}, &Parser::parse_math2); }
  ExprPtr parse_math2() { return parse_level({"*", "/", "//", "%"}, &Parser::parse_pow); }
  ExprPtr parse_pow() { return parse_level({"**"}, &Parser::parse_operand); }
  ExprPtr parse_operand() { return parse_unary(true); }
  ExprPtr parse_unary(bool with_filter) {
    ExprPtr node;
    if (is_op("-") || is_op("+")) {
      const Token t = next();
      node = make(ExprKind::unary, t.line);
      node->name = t.text;
      node->args.push_back(parse_unary(false));
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary() {
    const Token t = next();
    if (t.type == Tok::string) {
      std::string s = t.text;
      while (peek().type == Tok::string) s += next().text;  // adjacent literals join
      auto e = make(ExprKind::literal, t.line);
      e->value = Value::string(std::move(s));
      return e;
    }
    if (t.type == Tok::integer || t.type == Tok::floating) {
      auto e = make(ExprKind::literal, t.line);
      e->value = t.type == Tok::integer ? Value::integer(t.i) : Value::floating(t.f);
      return e;
    }
    if (t.type == Tok::name) {
      auto e = make(ExprKind::literal, t.line);
      if (t.text == "true" || t.text == "True") {
        e->value = Value::boolean(true);
        return e;
      }
      if (t.text == "false" || t.text == "False") {
        e->value = Value::boolean(false);
        return e;
      }
      if (t.text == "none" || t.text == "None") {
        e->value = Value::none();
        return e;
      }
      e->kind = ExprKind::name, e->name = t.text;
      return e;
    }
    if (t.type == Tok::op && t.text == "(") {
      if (accept_op(")")) return make(ExprKind::tuple, t.line);
      ExprPtr first = parse_expression();
      if (accept_op(")")) return first;
      auto tuple = make(ExprKind::tuple, t.line);
      tuple->args.push_back(std::move(first));
      while (accept_op(",")) {
        if (is_op(")")) break;
        tuple->args.push_back(parse_expression());
      }
      expect_op(")");
      return tuple;
    }
    if (t.type == Tok::op && t.text == "[") {
      auto list = make(ExprKind::list, t.line);
      while (!accept_op("]")) {
        if (!list->args.empty()) expect_op(",");
        if (accept_op("]")) break;
        list->args.push_back(parse_expression());
      }
      return list;
    }
    if (t.type == Tok::op && t.text == "{") {
      auto dict = make(ExprKind::dict, t.line);
      while (!accept_op("}")) {
        if (!dict->args.empty()) expect_op(",");
        if (accept_op("}")) break;
        dict->args.push_back(parse_expression());
        expect_op(":");
        dict->args.push_back(parse_expression());
      }
      return dict;
    }
    error_at(t.line, t.type == Tok::end ? "unexpected end of tag" : fmt::format("unexpected '{}'", t.text));
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      if (accept_op(".")) {
        const Token t = next();
        auto e = make(ExprKind::attr, t.line);
        if (t.type == Tok::name) {
          e->name = t.text;
        } else if (t.type == Tok::integer) {
          e->kind = ExprKind::item;
          auto key = make(ExprKind::literal, t.line);
          key->value = Value::integer(t.i);
          e->args.push_back(std::move(node));
          e->args.push_back(std::move(key));
          node = std::move(e);
          continue;
        } else {
          error_at(t.line, "expected an attribute name after '.'");
        }
        e->args.push_back(std::move(node));
        node = std::move(e);
      } else if (is_op("[")) {
        const int line = next().line;
        ExprPtr parts[3];
        bool has[3] = {false, false, false};
        bool slice = false;
        for (int p = 0; p < 3; ++p) {
          if (!is_op(":") && !is_op("]")) parts[p] = parse_expression(), has[p] = true;
          if (p < 2 && accept_op(":")) {
            slice = true;
            continue;
          }
          break;
        }
        expect_op("]");
        auto e = make(slice ? ExprKind::slice : ExprKind::item, line);
        e->args.push_back(std::move(node));
        for (int p = 0; p < 3; ++p) e->args.push_back(std::move(parts[p])), e->has[p] = has[p];
        if (!slice) e->args.resize(2);
        if (!slice && !has[0]) error_at(line, "an empty subscript");
        node = std::move(e);
      } else if (is_op("(")) {
        const int line = next().line;
        auto e = make(ExprKind::call, line);
        e->args.push_back(std::move(node));
        parse_call_args(*e);
        node = std::move(e);
      } else {
        return node;
      }
    }
  }

  // After '(' up to and with ')': positional then keyword arguments.
  void parse_call_args(Expr& e) {
    bool first = true;
    while (!accept_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (accept_op(")")) break;
      if (peek().type == Tok::name && pos_ + 1 < toks_->size() && (*toks_)[pos_ + 1].type == Tok::op &&
          (*toks_)[pos_ + 1].text == "=") {
        std::string name = next().text;
        next();
        e.keywords.emplace_back(std::move(name), parse_expression());
      } else {
        if (!e.keywords.empty()) error_at(peek().line, "a positional argument after a keyword argument");
        e.args.push_back(parse_expression());
      }
    }
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (is_op("|")) {
        const int line = next().line;
        auto f = make(ExprKind::filter, line);
        f->name = expect_name();
        while (accept_op(".")) f->name += "." + expect_name();
        f->args.push_back(std::move(node));
        if (accept_op("(")) parse_call_args(*f);
        node = std::move(f);
      } else if (is_name("is")) {
        const int line = next().line;
        auto t = make(ExprKind::test, line);
        t->negated = accept_name("not");
        const Token name = next();
        if (name.type != Tok::name) error_at(line, "expected a test name after 'is'");
        t->name = name.text;
        t->args.push_back(std::move(node));
        if (accept_op("(")) {
          parse_call_args(*t);
        } else if (!at_end() &&
                   (peek().type == Tok::string || peek().type == Tok::integer ||
                    peek().type == Tok::floating || (peek().type == Tok::name && !is_keyword(peek().text)) ||
                    is_op("(") || is_op("[") || is_op("{"))) {
          t->args.push_back(parse_primary());  // one argument without parentheses: `is divisibleby 3`
          t->args.back() = parse_postfix(std::move(t->args.back()));
        }
        node = std::move(t);
      } else if (is_op("(")) {
        const int line = next().line;
        auto e = make(ExprKind::call, line);
        e->args.push_back(std::move(node));
        parse_call_args(*e);
        node = std::move(e);
      } else {
        return node;
      }
    }
  }

  static bool is_keyword(const std::string& w) {
    return w == "and" || w == "or" || w == "not" || w == "in" || w == "is" || w == "if" || w == "else";
  }

  // ---- Token helpers.
  const Token& peek() const { return (*toks_)[pos_]; }
  const Token& next() {
    const Token& t = (*toks_)[pos_];
    if (t.type != Tok::end) ++pos_;
    return t;
  }
  bool at_end() const { return peek().type == Tok::end; }
  bool is_op(const char* op) const { return peek().type == Tok::op && peek().text == op; }
  bool is_name(const char* name) const { return peek().type == Tok::name && peek().text == name; }
  bool accept_op(const char* op) {
    if (!is_op(op)) return false;
    ++pos_;
    return true;
  }
  bool accept_name(const char* name) {
    if (!is_name(name)) return false;
    ++pos_;
    return true;
  }
  void expect_op(const char* op) {
    if (!accept_op(op))
      error_at(peek().line,
               fmt::format("expected '{}', found '{}'", op, at_end() ? "end of tag" : peek().text));
  }
  std::string expect_name() {
    const Token& t = next();
    if (t.type != Tok::name) error_at(t.line, fmt::format("expected a name, found '{}'", t.text));
    return t.text;
  }
  void expect_end() {
    if (!at_end()) error_at(peek().line, fmt::format("unexpected '{}'", peek().text));
  }
  static ExprPtr make(ExprKind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind, e->line = line;
    return e;
  }
  static ExprPtr binary(ExprKind kind, const std::string& op, ExprPtr a, ExprPtr b) {
    auto e = make(kind, a->line);
    e->name = op;
    e->args.push_back(std::move(a));
    e->args.push_back(std::move(b));
    return e;
  }

  std::vector<Segment> segs_;
  size_t seg_ = 0;
  std::vector<Token>* toks_ = nullptr;
  size_t pos_ = 0;
};

}  // namespace

struct Template::Impl {
  std::string name;
  Body body;
};

namespace {
enum class Flow { normal, break_, continue_ };

[[noreturn]] void undefined_error(int line, const Value& v) {
  error_at(line, v.s.empty() ? std::string("a value is undefined") : v.s);
}

Value undefined_attr(const Value& obj, const std::string& name) {
  return Value::undefined(fmt::format("'{} object' has no attribute '{}'", obj.type_name(), name));
}

std::string ascii_upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}
std::string ascii_lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Python's str.strip / lstrip / rstrip: whitespace, or any code point of `chars`.
std::string strip(const std::string& s, const Value& chars, bool left, bool right) {
  const std::vector<std::string> cps = code_points(s);
  const std::vector<std::string> set =
      chars.kind == Kind::string ? code_points(chars.s) : std::vector<std::string>{};
  auto drop = [&](const std::string& cp) {
    return chars.kind == Kind::string ? std::find(set.begin(), set.end(), cp) != set.end() : is_space(cp);
  };
  size_t a = 0, b = cps.size();
  if (left)
    while (a < b && drop(cps[a])) ++a;
  if (right)
    while (b > a && drop(cps[b - 1])) --b;
  std::string out;
  for (size_t i = a; i < b; ++i) out += cps[i];
  return out;
}

// Python's str.split(sep=None, maxsplit=-1).
Value split(const std::string& s, const Value& sep, int64_t maxsplit, int line) {
  List parts;
  if (sep.kind != Kind::string) {
    const std::vector<std::string> cps = code_points(s);
    size_t i = 0;
    while (i < cps.size()) {
      while (i < cps.size() && is_space(cps[i])) ++i;
      if (i == cps.size()) break;
      if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
        std::string rest;
        for (size_t k = i; k < cps.size(); ++k) rest += cps[k];
        while (!rest.empty()) {  // the remainder keeps its inner whitespace, loses its trailing
          const std::vector<std::string> r = code_points(rest);
          if (!is_space(r.back())) break;
          rest.resize(rest.size() - r.back().size());
        }
        parts.push_back(Value::string(rest));
        break;
      }
      std::string word;
      while (i < cps.size() && !is_space(cps[i])) word += cps[i++];
      parts.push_back(Value::string(word));
    }
    return Value::make_list(std::move(parts));
  }
  if (sep.s.empty()) error_at(line, "empty separator");
  size_t at = 0;
  while (true) {
    const size_t hit = s.find(sep.s, at);
    if (hit == std::string::npos || (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit)) {
      parts.push_back(Value::string(s.substr(at)));
      break;
    }
    parts.push_back(Value::string(s.substr(at, hit - at)));
    at = hit + sep.s.size();
  }
  return Value::make_list(std::move(parts));
}

std::string replace_all(std::string s, const std::string& from, const std::string& to, int64_t count) {
  if (from.empty()) return s;
  std::string out;
  size_t at = 0;
  for (int64_t n = 0; count < 0 || n < count; ++n) {
    const size_t hit = s.find(from, at);
    if (hit == std::string::npos) break;
    out += s.substr(at, hit - at) + to;
    at = hit + from.size();
  }
  return out + s.substr(at);
}

std::string title_case(const std::string& s) {
  std::string out = s;
  bool start = true;
  for (char& c : out) {
    const bool alpha = std::isalpha(static_cast<unsigned char>(c));
    c = static_cast<char>(alpha ? (start ? std::toupper(static_cast<unsigned char>(c))
                                         : std::tolower(static_cast<unsigned char>(c)))
                                : c);
    start = !alpha;
  }
  return out;
}

std::string capitalize(const std::string& s) {
  std::string out = ascii_lower(s);
  if (!out.empty()) out[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(out[0])));
  return out;
}

// Python's floor division and modulo.
int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }
int64_t floor_mod(int64_t a, int64_t b) { return a - floor_div(a, b) * b; }

class Renderer {
 public:
  Renderer(const Template::Impl& t, const nlohmann::ordered_json& context, int64_t now) : t_(t), now_(now) {
    scopes_.push_back(std::make_shared<Scope>());
    Scope& globals = *scopes_.back();
    add_globals(globals);
    for (const auto& [k, v] : context.items()) globals[k] = Value::from_json(v);
    scopes_.push_back(std::make_shared<Scope>());  // the template's own assignments
  }

  Rendered run() {
    render(t_.body);
    return Rendered{std::move(out_), std::move(generation_)};
  }

 private:
  using Scope = std::unordered_map<std::string, Value>;

  void add_globals(Scope& g) {
    g["range"] = Value::function([](Args& a) {
      int64_t start = 0, stop = 0, step = 1;
      auto integer = [&](size_t i) {
        if (a.positional[i].kind != Kind::integer && a.positional[i].kind != Kind::boolean)
          throw std::invalid_argument("range() takes integers");
        return a.positional[i].kind == Kind::boolean ? static_cast<int64_t>(a.positional[i].b)
                                                     : a.positional[i].i;
      };
      if (a.positional.size() == 1) {
        stop = integer(0);
      } else if (a.positional.size() == 2 || a.positional.size() == 3) {
        start = integer(0), stop = integer(1);
        if (a.positional.size() == 3) step = integer(2);
      } else {
        throw std::invalid_argument("range() takes 1 to 3 arguments");
      }
      if (step == 0) throw std::invalid_argument("range() arg 3 must not be zero");
      List items;
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        items.push_back(Value::integer(i));
        if (items.size() > 10'000'000) throw std::invalid_argument("range() too long");
      }
      return Value::make_list(std::move(items));
    });
    auto make_mapping = [](Kind kind) {
      return [kind](Args& a) {
        Value d = Value::make_dict(kind);
        for (const Value& p : a.positional) {
          if (!p.is_mapping()) throw std::invalid_argument("takes a mapping or keyword arguments");
          for (const auto& [k, v] : p.dict->items) d.dict->set(k, v);
        }
        for (const auto& [k, v] : a.keywords) d.dict->set(k, v);
        return d;
      };
    };
    g["namespace"] = Value::function(make_mapping(Kind::ns));
    g["dict"] = Value::function(make_mapping(Kind::dict));
    g["raise_exception"] = Value::function([](Args& a) -> Value {
      throw std::runtime_error("raise_exception: " + to_str(a.get(0, "message")));
    });
    g["strftime_now"] = Value::function([fixed = now_](Args& a) {
      const std::string format = to_str(a.get(0, "format"));
      const std::time_t now = fixed > 0 ? static_cast<std::time_t>(fixed) : std::time(nullptr);
      std::tm local{};
      if (fixed > 0)
        gmtime_r(&now, &local);
      else
        localtime_r(&now, &local);
      char buf[256];
      const size_t n = std::strftime(buf, sizeof(buf), format.c_str(), &local);
      return Value::string(std::string(buf, n));
    });
  }

  // ---- Statements.
  Flow render(const Body& body) {
    for (const auto& node : body) {
      const Flow flow = render(*node);
      if (flow != Flow::normal) return flow;
    }
    return Flow::normal;
  }

  Flow render(const Node& n) {
    switch (n.kind) {
      case NodeKind::text:
        out_ += n.text;
        return Flow::normal;
      case NodeKind::output: {
        const Value v = eval(*n.exprs[0]);
        out_ += to_str(v);
        return Flow::normal;
      }
      case NodeKind::if_:
        for (size_t i = 0; i < n.bodies.size(); ++i)
          if (i >= n.exprs.size() || eval(*n.exprs[i]).truthy()) return render(n.bodies[i]);
        return Flow::normal;
      case NodeKind::for_:
        return render_for(n);
      case NodeKind::set:
        assign(n.targets, eval(*n.exprs[0]), n.line);
        return Flow::normal;
      case NodeKind::set_block: {
        std::string saved = std::move(out_);
        out_.clear();
        render(n.bodies[0]);
        std::string text = std::move(out_);
        out_ = std::move(saved);
        assign(n.targets, Value::string(std::move(text)), n.line);
        return Flow::normal;
      }
      case NodeKind::macro:
        define_macro(n);
        return Flow::normal;
      case NodeKind::break_:
        if (loops_ == 0) error_at(n.line, "break outside a loop");
        return Flow::break_;
      case NodeKind::continue_:
        if (loops_ == 0) error_at(n.line, "continue outside a loop");
        return Flow::continue_;
      case NodeKind::generation: {
        const size_t begin = out_.size();
        const Flow flow = render(n.bodies[0]);
        generation_.emplace_back(begin, out_.size());
        return flow;
      }
    }
    return Flow::normal;
  }

  void assign(const std::vector<std::string>& targets, const Value& v, int line) {
    if (targets.size() == 1) return assign_one(targets[0], v, line);
    if (!v.is_sequence() && v.kind != Kind::string)
      error_at(line, fmt::format("cannot unpack a {}", v.type_name()));
    const List items = iterate(v, line);
    if (items.size() != targets.size())
      error_at(line, fmt::format("{} values to unpack into {} names", items.size(), targets.size()));
    for (size_t i = 0; i < targets.size(); ++i) assign_one(targets[i], items[i], line);
  }

  void assign_one(const std::string& target, const Value& v, int line) {
    const size_t dot = target.find('.');
    if (dot == std::string::npos) {
      (*scopes_.back())[target] = v;
      return;
    }
    const Value ns = lookup(target.substr(0, dot));
    if (ns.kind != Kind::ns)
      error_at(line,
               fmt::format("cannot assign attribute on non-namespace object '{}'", target.substr(0, dot)));
    ns.dict->set(target.substr(dot + 1), v);
  }

  Flow render_for(const Node& n) {
    const Value iterable = eval(*n.exprs[0]);
    if (iterable.kind == Kind::none || iterable.kind == Kind::boolean || iterable.is_number() ||
        iterable.kind == Kind::function)
      error_at(n.line, fmt::format("'{}' object is not iterable", iterable.type_name()));
    List items = iterate(iterable, n.line);
    if (n.exprs.size() > 1) {  // the loop's filter, with the targets bound
      List kept;
      for (const Value& item : items) {
        scopes_.push_back(std::make_shared<Scope>());
        assign(n.targets, item, n.line);
        const bool keep = eval(*n.exprs[1]).truthy();
        scopes_.pop_back();
        if (keep) kept.push_back(item);
      }
      items = std::move(kept);
    }
    const int64_t length = static_cast<int64_t>(items.size());
    ++loops_;
    Flow result = Flow::normal;
    for (int64_t i = 0; i < length; ++i) {
      scopes_.push_back(std::make_shared<Scope>());
      Value loop = Value::make_dict();
      Dict& d = *loop.dict;
      d.set("index", Value::integer(i + 1)), d.set("index0", Value::integer(i));
      d.set("revindex", Value::integer(length - i)), d.set("revindex0", Value::integer(length - i - 1));
      d.set("first", Value::boolean(i == 0)), d.set("last", Value::boolean(i == length - 1));
      d.set("length", Value::integer(length));
      d.set("depth", Value::integer(1)), d.set("depth0", Value::integer(0));
      d.set("previtem", i > 0 ? items[i - 1] : Value::undefined("there is no previous item"));
      d.set("nextitem", i + 1 < length ? items[i + 1] : Value::undefined("there is no next item"));
      d.set("cycle", Value::function([i](Args& a) {
              if (a.positional.empty()) throw std::invalid_argument("no items for cycling given");
              return a.positional[static_cast<size_t>(i) % a.positional.size()];
            }));
      (*scopes_.back())["loop"] = loop;
      assign(n.targets, items[i], n.line);
      const Flow flow = render(n.bodies[0]);
      scopes_.pop_back();
      if (flow == Flow::break_) break;
    }
    --loops_;
    if (length == 0 && n.bodies.size() > 1) {
      scopes_.push_back(std::make_shared<Scope>());
      result = render(n.bodies[1]);
      scopes_.pop_back();
    }
    return result;
  }

  void define_macro(const Node& n) {
    const Node* node = &n;
    (*scopes_.back())[n.text] = Value::function([this, node](Args& a) {
      auto scope = std::make_shared<Scope>();
      for (size_t p = 0; p < node->params.size(); ++p) {
        const auto& [name, fallback] = node->params[p];
        Value v = a.get(p, name);
        if (v.is_undefined() && fallback) v = eval(*fallback);
        (*scope)[name] = v;
      }
      if (a.positional.size() > node->params.size())
        throw std::invalid_argument(
            fmt::format("macro '{}' takes {} arguments", node->text, node->params.size()));
      std::vector<std::shared_ptr<Scope>> saved = {scopes_[0], scopes_[1], scope};
      std::swap(saved, scopes_);
      std::string out = std::move(out_);
      out_.clear();
      const int loops = loops_;
      loops_ = 0;
      render(node->bodies[0]);
      loops_ = loops;
      std::swap(out, out_);
      std::swap(saved, scopes_);
      return Value::string(std::move(out));
    });
  }

  Value lookup(const std::string& name) const {
    for (size_t i = scopes_.size(); i-- > 0;) {
      const auto it = scopes_[i]->find(name);
      if (it != scopes_[i]->end()) return it->second;
    }
    return Value::undefined(fmt::format("'{}' is undefined", name));
  }

  // ---- Expressions.
  List iterate(const Value& v, int line) const {
    switch (v.kind) {
      case Kind::undefined:
        return {};
      case Kind::list:
      case Kind::tuple:
        return *v.list;
      case Kind::dict:
      case Kind::ns: {
        List keys;
        for (const auto& [k, e] : v.dict->items) keys.push_back(Value::string(k));
        return keys;
      }
      case Kind::string: {
        List chars;
        for (std::string& cp : code_points(v.s)) chars.push_back(Value::string(std::move(cp)));
        return chars;
      }
      default:
        error_at(line, fmt::format("'{}' object is not iterable", v.type_name()));
    }
  }

  Value eval(const Expr& e) {
    try {
      return eval_inner(e);
    } catch (const LineError&) {
      throw;
    } catch (const std::invalid_argument& x) {
      error_at(e.line, x.what());
    } catch (const std::runtime_error& x) {  // raise_exception
      error_at(e.line, x.what());
    }
  }

  Value eval_inner(const Expr& e) {
    switch (e.kind) {
      case ExprKind::literal:
        return e.value;
      case ExprKind::name:
        return lookup(e.name);
      case ExprKind::attr:
        return getattr(eval(*e.args[0]), e.name, e.line);
      case ExprKind::item:
        return getitem(eval(*e.args[0]), eval(*e.args[1]), e.line);
      case ExprKind::slice:
        return slice(e);
      case ExprKind::call: {
        const Value callee = eval(*e.args[0]);
        if (callee.is_undefined()) undefined_error(e.line, callee);
        if (callee.kind != Kind::function)
          error_at(e.line, fmt::format("'{}' object is not callable", callee.type_name()));
        Args a = args_of(e, 1);
        return (*callee.fn)(a);
      }
      case ExprKind::filter: {
        Args a = args_of(e, 1);
        return filter(e.name, eval(*e.args[0]), a, e.line);
      }
      case ExprKind::test: {
        Args a = args_of(e, 1);
        return Value::boolean(test(e.name, eval(*e.args[0]), a, e.line) != e.negated);
      }
      case ExprKind::unary: {
        const Value v = eval(*e.args[0]);
        if (!v.is_number())
          error_at(e.line, fmt::format("bad operand type for unary {}: '{}'", e.name, v.type_name()));
        if (e.name == "+") return v;
        return v.kind == Kind::floating ? Value::floating(-v.f)
                                        : Value::integer(-(v.kind == Kind::boolean ? v.b : v.i));
      }
      case ExprKind::binary:
        return binary(e.name, eval(*e.args[0]), eval(*e.args[1]), e.line);
      case ExprKind::compare: {
        Value left = eval(*e.args[0]);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value right = eval(*e.args[i + 1]);
          if (!compare(e.ops[i], left, right, e.line)) return Value::boolean(false);
          left = std::move(right);
        }
        return Value::boolean(true);
      }
      case ExprKind::and_: {
        Value left = eval(*e.args[0]);
        return left.truthy() ? eval(*e.args[1]) : left;
      }
      case ExprKind::or_: {
        Value left = eval(*e.args[0]);
        return left.truthy() ? left : eval(*e.args[1]);
      }
      case ExprKind::not_:
        return Value::boolean(!eval(*e.args[0]).truthy());
      case ExprKind::cond:
        if (eval(*e.args[1]).truthy()) return eval(*e.args[0]);
        return e.args.size() > 2 ? eval(*e.args[2])
                                 : Value::undefined("the condition was false and there is no else");
      case ExprKind::list:
      case ExprKind::tuple: {
        List items;
        for (const auto& a : e.args) items.push_back(eval(*a));
        return Value::make_list(std::move(items), e.kind == ExprKind::list ? Kind::list : Kind::tuple);
      }
      case ExprKind::dict: {
        Value d = Value::make_dict();
        for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
          const Value key = eval(*e.args[i]);
          if (key.kind != Kind::string) error_at(e.line, "dict keys must be strings");
          d.dict->set(key.s, eval(*e.args[i + 1]));
        }
        return d;
      }
    }
    return Value::undefined();
  }

  Args args_of(const Expr& e, size_t first) {
    Args a;
    for (size_t i = first; i < e.args.size(); ++i) a.positional.push_back(eval(*e.args[i]));
    for (const auto& [k, v] : e.keywords) a.keywords.emplace_back(k, eval(*v));
    return a;
  }

  Value binary(const std::string& op, const Value& a, const Value& b, int line) {
    if (op == "~") return Value::string(to_str(a) + to_str(b));
    if (a.is_undefined()) undefined_error(line, a);
    if (b.is_undefined()) undefined_error(line, b);
    auto mismatch = [&]() -> Value {
      error_at(line, fmt::format("unsupported operand type(s) for {}: '{}' and '{}'", op, a.type_name(),
                                 b.type_name()));
    };
    if (a.is_number() && b.is_number()) {
      const bool ints = a.kind != Kind::floating && b.kind != Kind::floating;
      const int64_t x = a.kind == Kind::boolean ? a.b : a.i, y = b.kind == Kind::boolean ? b.b : b.i;
      const double p = a.number(), q = b.number();
      if (op == "+") return ints ? Value::integer(x + y) : Value::floating(p + q);
      if (op == "-") return ints ? Value::integer(x - y) : Value::floating(p - q);
      if (op == "*") return ints ? Value::integer(x * y) : Value::floating(p * q);
      if ((op == "/" || op == "//" || op == "%") && q == 0) error_at(line, "division by zero");
      if (op == "/") return Value::floating(p / q);
      if (op == "//") return ints ? Value::integer(floor_div(x, y)) : Value::floating(std::floor(p / q));
      if (op == "%")
        return ints ? Value::integer(floor_mod(x, y)) : Value::floating(p - std::floor(p / q) * q);
      if (op == "**") {
        if (ints && y >= 0) {
          int64_t r = 1;
          for (int64_t k = 0; k < y; ++k) r *= x;
          return Value::integer(r);
        }
        return Value::floating(std::pow(p, q));
      }
    }
    if (op == "+" && a.kind == Kind::string && b.kind == Kind::string) return Value::string(a.s + b.s);
    if (op == "+" && a.is_sequence() && a.kind == b.kind) {
      List items = *a.list;
      items.insert(items.end(), b.list->begin(), b.list->end());
      return Value::make_list(std::move(items), a.kind);
    }
    if (op == "*" && (a.kind == Kind::string || a.is_sequence()) &&
        (b.kind == Kind::integer || b.kind == Kind::boolean)) {
      const int64_t n = b.kind == Kind::boolean ? b.b : b.i;
      if (a.kind == Kind::string) {
        std::string s;
        for (int64_t k = 0; k < n; ++k) s += a.s;
        return Value::string(std::move(s));
      }
      List items;
      for (int64_t k = 0; k < n; ++k) items.insert(items.end(), a.list->begin(), a.list->end());
      return Value::make_list(std::move(items), a.kind);
    }
    return mismatch();
  }

  bool compare(const std::string& op, const Value& a, const Value& b, int line) {
    if (op == "==") return equal(a, b);
    if (op == "!=") return !equal(a, b);
    if (op == "in" || op == "not in") return contains(b, a, line) == (op == "in");
    bool comparable = false;
    const bool lt = less(a, b, comparable), gt = comparable && less(b, a, comparable);
    if (!comparable)
      error_at(line, fmt::format("'{}' not supported between instances of '{}' and '{}'", op, a.type_name(),
                                 b.type_name()));
    if (op == "<") return lt;
    if (op == ">") return gt;
    if (op == "<=") return !gt;
    return !lt;  // >=
  }

  bool contains(const Value& container, const Value& item, int line) {
    switch (container.kind) {
      case Kind::undefined:
        return false;
      case Kind::string:
        if (item.kind != Kind::string)
          error_at(line,
                   fmt::format("'in <string>' requires string as left operand, not {}", item.type_name()));
        return container.s.find(item.s) != std::string::npos;
      case Kind::list:
      case Kind::tuple:
        return std::any_of(container.list->begin(), container.list->end(),
                           [&](const Value& v) { return equal(v, item); });
      case Kind::dict:
      case Kind::ns:
        return item.kind == Kind::string && container.dict->find(item.s) != nullptr;
      default:
        error_at(line, fmt::format("argument of type '{}' is not iterable", container.type_name()));
    }
  }

  Value getattr(const Value& obj, const std::string& name, int line) {
    if (obj.is_undefined()) undefined_error(line, obj);
    if (obj.kind == Kind::dict) {
      if (name == "items" || name == "keys" || name == "values" || name == "get")
        return dict_method(obj, name);
      if (const Value* v = obj.dict->find(name)) return *v;
      return undefined_attr(obj, name);
    }
    if (obj.kind == Kind::ns) {
      if (const Value* v = obj.dict->find(name)) return *v;
      return undefined_attr(obj, name);
    }
    if (obj.kind == Kind::string) {
      Value m = string_method(obj.s, name);
      return m.is_undefined() ? undefined_attr(obj, name) : m;
    }
    return undefined_attr(obj, name);
  }

  Value getitem(const Value& obj, const Value& key, int line) {
    if (obj.is_undefined()) undefined_error(line, obj);
    if ((obj.is_sequence() || obj.kind == Kind::string) &&
        (key.kind == Kind::integer || key.kind == Kind::boolean)) {
      const List items = obj.kind == Kind::string ? iterate(obj, line) : *obj.list;
      int64_t i = key.kind == Kind::boolean ? key.b : key.i;
      if (i < 0) i += static_cast<int64_t>(items.size());
      if (i < 0 || i >= static_cast<int64_t>(items.size()))
        return Value::undefined(fmt::format("'{} object' has no element {}", obj.type_name(), key.i));
      return items[static_cast<size_t>(i)];
    }
    if (obj.is_mapping() && key.kind == Kind::string) {
      if (const Value* v = obj.dict->find(key.s)) return *v;
    }
    if (key.kind == Kind::string) return getattr(obj, key.s, line);
    return Value::undefined(fmt::format("'{} object' has no element {}", obj.type_name(), to_repr(key)));
  }

  Value slice(const Expr& e) {
    const Value obj = eval(*e.args[0]);
    if (obj.is_undefined()) undefined_error(e.line, obj);
    if (!obj.is_sequence() && obj.kind != Kind::string)
      error_at(e.line, fmt::format("'{}' object is not subscriptable", obj.type_name()));
    const List items = iterate(obj, e.line);
    const int64_t n = static_cast<int64_t>(items.size());
    int64_t part[3] = {0, 0, 1};
    bool given[3] = {false, false, false};
    for (int p = 0; p < 3; ++p) {
      if (!e.has[p]) continue;
      const Value v = eval(*e.args[1 + p]);
      if (v.kind == Kind::none) continue;
      if (v.kind != Kind::integer) error_at(e.line, "slice indices must be integers or None");
      part[p] = v.i, given[p] = true;
    }
    const int64_t step = part[2];
    if (step == 0) error_at(e.line, "slice step cannot be zero");
    auto clamp = [&](int64_t i, bool is_given, int64_t fallback) {
      if (!is_given) return fallback;
      if (i < 0) i += n;
      if (step > 0) return std::clamp<int64_t>(i, 0, n);
      return std::clamp<int64_t>(i, -1, n - 1);
    };
    const int64_t start = clamp(part[0], given[0], step > 0 ? 0 : n - 1);
    const int64_t stop = clamp(part[1], given[1], step > 0 ? n : -1);
    List out;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step)
      out.push_back(items[static_cast<size_t>(i)]);
    if (obj.kind == Kind::string) {
      std::string s;
      for (const Value& c : out) s += c.s;
      return Value::string(std::move(s));
    }
    return Value::make_list(std::move(out), obj.kind);
  }

  static Value dict_method(const Value& obj, const std::string& name) {
    return Value::function([obj, name](Args& a) {
      List out;
      if (name == "get") {
        const Value key = a.get(0, "key");
        const Value* v = key.kind == Kind::string ? obj.dict->find(key.s) : nullptr;
        return v ? *v : a.get(1, "default", Value::none());
      }
      for (const auto& [k, v] : obj.dict->items) {
        if (name == "items")
          out.push_back(Value::make_list({Value::string(k), v}, Kind::tuple));
        else
          out.push_back(name == "keys" ? Value::string(k) : v);
      }
      return Value::make_list(std::move(out));
    });
  }

  static Value string_method(const std::string& s, const std::string& name) {
    auto method = [&](auto f) { return Value::function([s, f](Args& a) { return f(s, a); }); };
    if (name == "strip" || name == "lstrip" || name == "rstrip")
      return Value::function([s, name](Args& a) {
        return Value::string(strip(s, a.get(0, "chars"), name != "rstrip", name != "lstrip"));
      });
    if (name == "split")
      return method([](const std::string& t, Args& a) {
        const Value max = a.get(1, "maxsplit", Value::integer(-1));
        return split(t, a.get(0, "sep"), max.i, 0);
      });
    if (name == "startswith" || name == "endswith")
      return Value::function([s, name](Args& a) {
        const Value p = a.get(0, "prefix");
        List options = p.is_sequence() ? *p.list : List{p};
        for (const Value& o : options) {
          if (o.kind != Kind::string)
            throw std::invalid_argument(name + " takes a string or a tuple of strings");
          const bool hit = name == "startswith" ? s.compare(0, o.s.size(), o.s) == 0
                                                : s.size() >= o.s.size() &&
                                                      s.compare(s.size() - o.s.size(), o.s.size(), o.s) == 0;
          if (hit) return Value::boolean(true);
        }
        return Value::boolean(false);
      });
    if (name == "upper")
      return method([](const std::string& t, Args&) { return Value::string(ascii_upper(t)); });
    if (name == "lower")
      return method([](const std::string& t, Args&) { return Value::string(ascii_lower(t)); });
    if (name == "title")
      return method([](const std::string& t, Args&) { return Value::string(title_case(t)); });
    if (name == "capitalize")
      return method([](const std::string& t, Args&) { return Value::string(capitalize(t)); });
    if (name == "replace")
      return method([](const std::string& t, Args& a) {
        return Value::string(replace_all(t, to_str(a.get(0, "old")), to_str(a.get(1, "new")),
                                         a.get(2, "count", Value::integer(-1)).i));
      });
    if (name == "find" || name == "count")
      return Value::function([s, name](Args& a) {
        const std::string sub = to_str(a.get(0, "sub"));
        if (name == "find") {
          const size_t at = s.find(sub);
          return Value::integer(
              at == std::string::npos ? -1 : static_cast<int64_t>(code_points(s.substr(0, at)).size()));
        }
        int64_t n = 0;
        for (size_t at = s.find(sub); at != std::string::npos && !sub.empty();
             at = s.find(sub, at + sub.size()))
          ++n;
        return Value::integer(n);
      });
    if (name == "join")
      return method([](const std::string& t, Args& a) {
        const Value items = a.get(0, "iterable");
        std::string out;
        if (items.is_sequence())
          for (size_t i = 0; i < items.list->size(); ++i) out += (i ? t : "") + to_str((*items.list)[i]);
        return Value::string(out);
      });
    if (name == "isdigit" || name == "isspace" || name == "isalpha")
      return Value::function([s, name](Args&) {
        if (s.empty()) return Value::boolean(false);
        for (const std::string& cp : code_points(s)) {
          const auto c = static_cast<unsigned char>(cp[0]);
          const bool ok = name == "isspace"
                              ? is_space(cp)
                              : cp.size() == 1 && (name == "isdigit" ? std::isdigit(c) : std::isalpha(c));
          if (!ok) return Value::boolean(false);
        }
        return Value::boolean(true);
      });
    return Value::undefined();
  }

  Value filter(const std::string& name, const Value& v, Args& a, int line) {
    auto need_defined = [&] {
      if (v.is_undefined()) undefined_error(line, v);
    };
    if (name == "length" || name == "count") {
      if (v.kind == Kind::string) return Value::integer(static_cast<int64_t>(code_points(v.s).size()));
      if (v.is_sequence()) return Value::integer(static_cast<int64_t>(v.list->size()));
      if (v.is_mapping()) return Value::integer(static_cast<int64_t>(v.dict->items.size()));
      if (v.is_undefined()) return Value::integer(0);
      error_at(line, fmt::format("object of type '{}' has no len()", v.type_name()));
    }
    if (name == "trim") return Value::string(strip(to_str(v), a.get(0, "chars"), true, true));
    if (name == "tojson") {
      need_defined();
      const Value indent = a.get(1, "indent"), separators = a.get(2, "separators"),
                  sort = a.get(3, "sort_keys");
      const int width = indent.kind == Kind::integer ? static_cast<int>(indent.i) : -1;
      std::string item_sep = width >= 0 ? "," : ", ", key_sep = ": ";
      if (separators.is_sequence() && separators.list->size() == 2)
        item_sep = to_str((*separators.list)[0]), key_sep = to_str((*separators.list)[1]);
      try {
        return Value::string(to_json(v, width, item_sep, key_sep, sort.truthy()));
      } catch (const std::invalid_argument& e) {
        error_at(line, e.what());
      }
    }
    if (name == "upper") return Value::string(ascii_upper(to_str(v)));
    if (name == "lower") return Value::string(ascii_lower(to_str(v)));
    if (name == "capitalize") return Value::string(capitalize(to_str(v)));
    if (name == "title") return Value::string(title_case(to_str(v)));
    if (name == "string") return Value::string(to_str(v));
    if (name == "safe" || name == "e" || name == "escape") {
      if (name != "safe") error_at(line, "autoescaping filters are not supported");
      return v;
    }
    if (name == "first" || name == "last") {
      need_defined();
      const List items = iterate(v, line);
      if (items.empty()) return Value::undefined(fmt::format("No {} item, sequence was empty.", name));
      return name == "first" ? items.front() : items.back();
    }
    if (name == "default" || name == "d") {
      const bool boolean = a.get(1, "boolean").truthy();
      if (v.is_undefined() || (boolean && !v.truthy())) return a.get(0, "default_value", Value::string(""));
      return v;
    }
    if (name == "join") {
      const Value sep = a.get(0, "d", Value::string("")), attribute = a.get(1, "attribute");
      std::string out;
      const List items = iterate(v, line);
      for (size_t i = 0; i < items.size(); ++i) {
        const Value item = attribute.is_undefined() ? items[i] : getitem(items[i], attribute, line);
        out += (i ? to_str(sep) : "") + to_str(item);
      }
      return Value::string(out);
    }
    if (name == "list") {
      need_defined();
      return Value::make_list(iterate(v, line));
    }
    if (name == "items") {
      if (v.is_undefined()) return Value::make_list({});
      if (!v.is_mapping()) error_at(line, fmt::format("items: expected a mapping, got {}", v.type_name()));
      Args none;
      return (*dict_method(v, "items").fn)(none);
    }
    if (name == "int" || name == "float") {
      const Value fallback = a.get(0, "default", name == "int" ? Value::integer(0) : Value::floating(0));
      double x = 0;
      if (v.is_number()) {
        x = v.number();
      } else if (v.kind == Kind::string) {
        try {
          size_t used = 0;
          const std::string t = strip(v.s, Value::undefined(), true, true);
          x = std::stod(t, &used);
          if (used != t.size()) return fallback;
        } catch (const std::exception&) {
          return fallback;
        }
      } else {
        return fallback;
      }
      return name == "int" ? Value::integer(static_cast<int64_t>(x)) : Value::floating(x);
    }
    if (name == "abs") {
      if (!v.is_number()) error_at(line, fmt::format("bad operand type for abs(): '{}'", v.type_name()));
      return v.kind == Kind::floating ? Value::floating(std::fabs(v.f))
                                      : Value::integer(std::llabs(v.kind == Kind::boolean ? v.b : v.i));
    }
    if (name == "round") {
      if (!v.is_number()) error_at(line, "round: expected a number");
      const int64_t precision = a.get(0, "precision", Value::integer(0)).i;
      const std::string method = to_str(a.get(1, "method", Value::string("common")));
      const double scale = std::pow(10.0, static_cast<double>(precision)), x = v.number() * scale;
      const double r = method == "ceil"    ? std::ceil(x)
                       : method == "floor" ? std::floor(x)
                                           : std::nearbyint(x);
      return Value::floating(r / scale);
    }
    if (name == "replace") {
      const Value count = a.get(2, "count");
      return Value::string(replace_all(to_str(v), to_str(a.get(0, "old")), to_str(a.get(1, "new")),
                                       count.kind == Kind::integer ? count.i : -1));
    }
    if (name == "reverse") {
      need_defined();
      List items = iterate(v, line);
      std::reverse(items.begin(), items.end());
      if (v.kind != Kind::string) return Value::make_list(std::move(items));
      std::string s;
      for (const Value& c : items) s += c.s;
      return Value::string(s);
    }
    if (name == "unique") {
      List out;
      for (const Value& item : iterate(v, line))
        if (std::none_of(out.begin(), out.end(), [&](const Value& o) { return equal(o, item); }))
          out.push_back(item);
      return Value::make_list(std::move(out));
    }
    if (name == "sort") {
      List items = iterate(v, line);
      const bool reverse = a.get(0, "reverse").truthy();
      const Value attribute = a.get(2, "attribute");
      auto key = [&](const Value& x) { return attribute.is_undefined() ? x : getitem(x, attribute, line); };
      std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
        bool comparable = false;
        const bool r = reverse ? less(key(y), key(x), comparable) : less(key(x), key(y), comparable);
        if (!comparable) error_at(line, "sort: values that cannot be ordered");
        return r;
      });
      return Value::make_list(std::move(items));
    }
    if (name == "map") {
      List out;
      const Value attribute = a.get(99, "attribute");
      for (const Value& item : iterate(v, line)) {
        if (!attribute.is_undefined()) {
          Value got = getitem(item, attribute, line);
          if (got.is_undefined()) got = a.get(99, "default", got);
          out.push_back(got);
        } else {
          if (a.positional.empty()) error_at(line, "map: a filter name or attribute= is required");
          Args rest;
          rest.positional.assign(a.positional.begin() + 1, a.positional.end());
          rest.keywords = a.keywords;
          out.push_back(filter(to_str(a.positional[0]), item, rest, line));
        }
      }
      return Value::make_list(std::move(out));
    }
    if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
      const bool attr = name == "selectattr" || name == "rejectattr", keep = name[0] == 's';
      const size_t first = attr ? 1 : 0;
      List out;
      for (const Value& item : iterate(v, line)) {
        const Value subject = attr ? getitem(item, a.get(0, "attribute"), line) : item;
        bool pass = false;
        if (a.positional.size() <= first) {
          pass = subject.truthy();
        } else {
          Args rest;
          rest.positional.assign(a.positional.begin() + static_cast<long>(first) + 1, a.positional.end());
          pass = test(to_str(a.positional[first]), subject, rest, line);
        }
        if (pass == keep) out.push_back(item);
      }
      return Value::make_list(std::move(out));
    }
    if (name == "sum") {
      const Value attribute = a.get(0, "attribute");
      Value total = a.get(1, "start", Value::integer(0));
      for (const Value& item : iterate(v, line))
        total = binary("+", total, attribute.is_undefined() ? item : getitem(item, attribute, line), line);
      return total;
    }
    if (name == "min" || name == "max") {
      const List items = iterate(v, line);
      if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
      Value best = items[0];
      for (const Value& item : items) {
        bool comparable = false;
        if (name == "min" ? less(item, best, comparable) : less(best, item, comparable)) best = item;
      }
      return best;
    }
    if (name == "indent") {
      const Value width = a.get(0, "width", Value::integer(4));
      const bool first = a.get(1, "first").truthy(), blank = a.get(2, "blank").truthy();
      const std::string pad = width.kind == Kind::string
                                  ? width.s
                                  : std::string(static_cast<size_t>(std::max<int64_t>(0, width.i)), ' ');
      std::string s = to_str(v) + "\n";
      std::vector<std::string> lines;
      size_t at = 0;
      while (at < s.size()) {
        size_t end = s.find_first_of("\r\n", at);
        if (end == std::string::npos) end = s.size();
        lines.push_back(s.substr(at, end - at));
        at = end + (s.compare(end, 2, "\r\n") == 0 ? 2 : 1);
      }
      std::string out;
      for (size_t i = 0; i < lines.size(); ++i) {
        if (i == 0) {
          out = lines[0];
          continue;
        }
        out += "\n" + ((blank || !lines[i].empty()) ? pad : "") + lines[i];
      }
      return Value::string(first ? pad + out : out);
    }
    error_at(line, fmt::format("unsupported filter '{}'", name));
  }

  bool test(const std::string& name, const Value& v, Args& a, int line) {
    const Value arg = a.get(0, "other");
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return v.kind == Kind::none;
    if (name == "boolean") return v.kind == Kind::boolean;
    if (name == "true") return v.kind == Kind::boolean && v.b;
    if (name == "false") return v.kind == Kind::boolean && !v.b;
    if (name == "integer") return v.kind == Kind::integer;
    if (name == "float") return v.kind == Kind::floating;
    if (name == "number") return v.is_number();
    if (name == "string") return v.kind == Kind::string;
    if (name == "mapping") return v.kind == Kind::dict;
    if (name == "iterable")
      return v.is_sequence() || v.is_mapping() || v.kind == Kind::string || v.is_undefined();
    if (name == "sequence") return v.is_sequence() || v.kind == Kind::dict || v.kind == Kind::string;
    if (name == "callable") return v.kind == Kind::function;
    if (name == "lower") return v.kind == Kind::string && ascii_lower(v.s) == v.s;
    if (name == "upper") return v.kind == Kind::string && ascii_upper(v.s) == v.s;
    if (name == "even" || name == "odd") {
      if (v.kind != Kind::integer) error_at(line, fmt::format("test '{}' needs an integer", name));
      return (floor_mod(v.i, 2) == 0) == (name == "even");
    }
    if (name == "divisibleby") {
      const Value n = a.get(0, "num");
      if (v.kind != Kind::integer || n.kind != Kind::integer || n.i == 0)
        error_at(line, "divisibleby needs nonzero integers");
      return floor_mod(v.i, n.i) == 0;
    }
    if (name == "eq" || name == "equalto" || name == "==") return equal(v, arg);
    if (name == "ne" || name == "!=") return !equal(v, arg);
    if (name == "in") return contains(a.get(0, "seq"), v, line);
    if (name == "sameas") return equal(v, arg) && v.kind == arg.kind;
    for (const auto& [word, op] : std::vector<std::pair<std::string, std::string>>{
             {"lt", "<"}, {"le", "<="}, {"gt", ">"}, {"ge", ">="}, {"lessthan", "<"}, {"greaterthan", ">"}})
      if (name == word || name == op) return compare(op, v, arg, line);
    error_at(line, fmt::format("unsupported test '{}'", name));
  }

  const Template::Impl& t_;
  int64_t now_ = 0;
  std::vector<std::shared_ptr<Scope>> scopes_;
  std::string out_;
  std::vector<std::pair<size_t, size_t>> generation_;
  int loops_ = 0;
};
}  // namespace

}  // namespace forge::data::jinja

namespace forge::data::jinja {

Template::Template(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;
Template::~Template() = default;

Template Template::parse(std::string_view source, std::string_view name) {
  // Jinja2 drops one newline at the end of a template (keep_trailing_newline off).
  if (source.size() >= 2 && source.substr(source.size() - 2) == "\r\n")
    source.remove_suffix(2);
  else if (!source.empty() && source.back() == '\n')
    source.remove_suffix(1);
  auto impl = std::make_unique<Impl>();
  impl->name = std::string(name);
  try {
    impl->body = Parser(Lexer(source).run()).parse();
  } catch (const LineError& e) {
    fail("{}: line {}: {}", name, e.line, e.what());
  }
  return Template(std::move(impl));
}

Rendered Template::render(const nlohmann::ordered_json& context, int64_t now) const {
  if (!context.is_object()) fail("{}: the template's variables must be a JSON object", impl_->name);
  try {
    return Renderer(*impl_, context, now).run();
  } catch (const LineError& e) {
    fail("{}: line {}: {}", impl_->name, e.line, e.what());
  } catch (const std::runtime_error& e) {
    fail("{}: {}", impl_->name, e.what());
  } catch (const std::invalid_argument& e) {
    fail("{}: {}", impl_->name, e.what());
  }
}

}  // namespace forge::data::jinja
