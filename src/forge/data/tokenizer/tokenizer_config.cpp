// Builds a Tokenizer from tokenizer.json, accepting exactly the components forge implements (see
// docs/formats.md) and rejecting everything else with one line naming the file and the component.
#include <algorithm>
#include <array>
#include <cctype>
#include <unordered_set>

#include "forge/core/error.h"
#include "forge/data/tokenizer/tokenizer_impl.h"
#include "forge/data/tokenizer/tokenizer_text.h"

namespace forge::data {
namespace {

using nlohmann::json;
using namespace tokenizer_detail;

class Parser {
 public:
  explicit Parser(std::string_view source) : source_(source) {}

  [[noreturn]] void error(std::string_view component, std::string_view message) const {
    fail("{}: {}: {}", source_, component, message);
  }

  const json& object(const json& parent, const std::string& key, const std::string& component) const {
    const auto it = parent.find(key);
    if (it == parent.end()) error(component, fmt::format("missing '{}'", key));
    if (!it->is_object()) error(component + "." + key, "must be an object");
    return *it;
  }

  bool boolean(const json& obj, const char* key, bool fallback, const std::string& component) const {
    const auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) return fallback;
    if (!it->is_boolean()) error(component + "." + key, "must be true or false");
    return it->get<bool>();
  }

  std::string string(const json& obj, const char* key, const std::string& component) const {
    const auto it = obj.find(key);
    if (it == obj.end()) error(component, fmt::format("missing '{}'", key));
    if (!it->is_string()) error(component + "." + key, "must be a string");
    return it->get<std::string>();
  }

  std::optional<std::string> optional_string(const json& obj, const char* key,
                                             const std::string& component) const {
    const auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) return std::nullopt;
    if (!it->is_string()) error(component + "." + key, "must be a string or null");
    return it->get<std::string>();
  }

  int32_t id(const json& value, const std::string& component) const {
    if (!value.is_number_integer() || value.get<int64_t>() < 0 || value.get<int64_t>() > INT32_MAX)
      error(component, fmt::format("id {} is not an integer in [0, 2^31)", value.dump()));
    return static_cast<int32_t>(value.get<int64_t>());
  }

  std::string type(const json& obj, const std::string& component) const {
    if (!obj.is_object()) error(component, "must be an object or null");
    return string(obj, "type", component);
  }

  std::string_view source() const { return source_; }

 private:
  std::string source_;
};

void check_utf8_string(const Parser& p, const std::string& s, const std::string& component) {
  if (tokenizer_text::find_invalid_utf8(s) != std::string::npos) p.error(component, "contains invalid UTF-8");
}

std::unique_ptr<BpeModel> parse_model(const Parser& p, const json& model) {
  const std::string component = "model";
  if (!model.is_object()) p.error(component, "must be an object");
  if (const auto it = model.find("type"); it != model.end()) {
    if (!it->is_string() || it->get<std::string>() != "BPE")
      p.error(component, fmt::format("type {} is not supported (forge implements BPE only)", it->dump()));
  } else if (!model.contains("merges")) {
    p.error(component, "has no 'type' and is not a BPE model (no 'merges')");
  }
  if (const auto it = model.find("dropout"); it != model.end() && !it->is_null()) {
    if (!it->is_number() || it->get<double>() != 0.0)
      p.error(component + ".dropout",
              fmt::format("BPE dropout {} is not supported (must be null)", it->dump()));
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const auto value = p.optional_string(model, key, component);
    if (value && !value->empty())
      p.error(component + "." + key, fmt::format("'{}' is not supported (must be null or empty)", *value));
  }
  BpeModelConfig config;
  config.byte_fallback = p.boolean(model, "byte_fallback", false, component);
  config.unk_token = p.optional_string(model, "unk_token", component);
  config.fuse_unk = p.boolean(model, "fuse_unk", false, component);
  config.ignore_merges = p.boolean(model, "ignore_merges", false, component);
  const json& vocab = p.object(model, "vocab", component);
  config.vocab.reserve(vocab.size());
  for (const auto& [token, value] : vocab.items()) {
    check_utf8_string(p, token, component + ".vocab");
    config.vocab.emplace(token, p.id(value, fmt::format("{}.vocab['{}']", component, token)));
  }
  const auto merges_it = model.find("merges");
  if (merges_it == model.end() || !merges_it->is_array()) p.error(component + ".merges", "must be an array");
  config.merges.reserve(merges_it->size());
  // All merges in one form: "a b" strings or ["a", "b"] pairs (the reference reads no mixture).
  const bool legacy_form = !merges_it->empty() && (*merges_it)[0].is_string();
  for (size_t i = 0; i < merges_it->size(); ++i) {
    const json& m = (*merges_it)[i];
    const std::string where = fmt::format("{}.merges[{}]", component, i);
    if (m.is_string() != legacy_form) p.error(where, "mixes \"a b\" strings and [\"a\", \"b\"] pairs");
    if (m.is_string()) {
      // The legacy form "a b"; lines starting with "#version" are skipped, as by the reference.
      const std::string line = m.get<std::string>();
      if (line.rfind("#version", 0) == 0) continue;
      const size_t space = line.find(' ');
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos)
        p.error(where, fmt::format("'{}' is not two tokens separated by one space", line));
      config.merges.emplace_back(line.substr(0, space), line.substr(space + 1));
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      config.merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
    } else {
      p.error(where, fmt::format("{} is neither \"a b\" nor [\"a\", \"b\"]", m.dump()));
    }
  }
  return std::make_unique<BpeModel>(std::move(config), fmt::format("{}: {}", p.source(), component));
}

// A {"String": ...} or {"Regex": ...} pattern. The reference compiles a String as the regular expression
// of its escaped text; a non-empty one is kept as a literal for the normalizers and decoders to find
// directly (the same matches), and an empty one matches between all characters.
struct Pattern {
  std::optional<std::string> literal;
  std::shared_ptr<TokenizerRegex> regex;
};

Pattern parse_pattern(const Parser& p, const json& parent, const std::string& component) {
  const json& pattern = p.object(parent, "pattern", component);
  const std::string where = component + ".pattern";
  if (pattern.size() != 1 || !(pattern.contains("Regex") || pattern.contains("String")))
    p.error(where, fmt::format("{} is neither {{\"Regex\": ...}} nor {{\"String\": ...}}", pattern.dump()));
  Pattern out;
  const std::string context = fmt::format("{}: {}", p.source(), where);
  if (pattern.contains("Regex")) {
    const std::string regex = p.string(pattern, "Regex", where);
    check_utf8_string(p, regex, where);
    out.regex = std::make_shared<TokenizerRegex>(regex, context);
  } else {
    const std::string literal = p.string(pattern, "String", where);
    check_utf8_string(p, literal, where);
    if (!literal.empty()) out.literal = literal;
    out.regex = std::make_shared<TokenizerRegex>(escape_literal(literal), context);
  }
  return out;
}

// A Rust `char` field: exactly one character.
std::string one_character(const Parser& p, const json& obj, const char* key, const std::string& component) {
  const std::string value = p.string(obj, key, component);
  check_utf8_string(p, value, component + "." + key);
  size_t i = 0;
  if (!value.empty()) tokenizer_text::next_code_point(value, i);
  if (value.empty() || i != value.size())
    p.error(component + "." + key, fmt::format("'{}' is not one character", value));
  return value;
}

size_t count(const Parser& p, const json& obj, const char* key, const std::string& component) {
  const auto it = obj.find(key);
  if (it == obj.end()) p.error(component, fmt::format("missing '{}'", key));
  if (!it->is_number_integer() || it->get<int64_t>() < 0)
    p.error(component + "." + key, "must be a non-negative integer");
  return static_cast<size_t>(it->get<int64_t>());
}

// Metaspace's prepend scheme, read as the reference does: "prepend_scheme" (default "always"), and the
// older "add_prefix_space", of which false must come with "never".
PrependScheme parse_prepend_scheme(const Parser& p, const json& obj, const std::string& component) {
  PrependScheme scheme = PrependScheme::Always;
  if (const auto it = obj.find("prepend_scheme"); it != obj.end()) {
    const std::string name = it->is_string() ? it->get<std::string>() : it->dump();
    if (name == "first") {
      scheme = PrependScheme::First;
    } else if (name == "never") {
      scheme = PrependScheme::Never;
    } else if (name == "always") {
      scheme = PrependScheme::Always;
    } else {
      p.error(component + ".prepend_scheme",
              fmt::format("unknown prepend scheme {} (first, never, always)", name));
    }
  }
  const auto add_prefix_space = obj.find("add_prefix_space");
  if (add_prefix_space != obj.end() && !add_prefix_space->is_null()) {
    if (!p.boolean(obj, "add_prefix_space", true, component) && scheme != PrependScheme::Never)
      p.error(component + ".add_prefix_space", "false does not match the prepend scheme (must be \"never\")");
  }
  return scheme;
}

void parse_normalizer(const Parser& p, const json& n, const std::string& component, Normalizer& normalizer) {
  const std::string type = p.type(n, component);
  NormalizerStep step;
  if (type == "Sequence") {
    const auto it = n.find("normalizers");
    if (it == n.end() || !it->is_array()) p.error(component + ".normalizers", "must be an array");
    for (size_t i = 0; i < it->size(); ++i)
      parse_normalizer(p, (*it)[i], fmt::format("{}.normalizers[{}]", component, i), normalizer);
    return;
  } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    step.kind = NormalizerStep::Kind::Unicode;
    step.form = type == "NFC"    ? UnicodeForm::NFC
                : type == "NFD"  ? UnicodeForm::NFD
                : type == "NFKC" ? UnicodeForm::NFKC
                                 : UnicodeForm::NFKD;
  } else if (type == "Prepend") {
    step.kind = NormalizerStep::Kind::Prepend;
    step.text = p.string(n, "prepend", component);
    check_utf8_string(p, step.text, component + ".prepend");
  } else if (type == "Replace") {
    step.kind = NormalizerStep::Kind::Replace;
    Pattern pattern = parse_pattern(p, n, component);
    step.literal = std::move(pattern.literal);
    step.pattern = std::move(pattern.regex);
    step.text = p.string(n, "content", component);
    check_utf8_string(p, step.text, component + ".content");
  } else {
    p.error(component, fmt::format("normalizer type '{}' is not supported (forge implements NFC, NFD, NFKC, "
                                   "NFKD, Prepend, Replace, Sequence)",
                                   type));
  }
  normalizer.add(std::move(step));
}

void parse_decoder(const Parser& p, const json& d, const std::string& component, Decoder& decoder) {
  const std::string type = p.type(d, component);
  DecoderStep step;
  if (type == "Sequence") {
    const auto it = d.find("decoders");
    if (it == d.end() || !it->is_array()) p.error(component + ".decoders", "must be an array");
    for (size_t i = 0; i < it->size(); ++i)
      parse_decoder(p, (*it)[i], fmt::format("{}.decoders[{}]", component, i), decoder);
    return;
  } else if (type == "ByteLevel") {
    step.kind = DecoderStep::Kind::ByteLevel;
  } else if (type == "Replace") {
    step.kind = DecoderStep::Kind::Replace;
    Pattern pattern = parse_pattern(p, d, component);
    step.literal = std::move(pattern.literal);
    step.pattern = std::move(pattern.regex);
    step.content = p.string(d, "content", component);
    check_utf8_string(p, step.content, component + ".content");
  } else if (type == "ByteFallback") {
    step.kind = DecoderStep::Kind::ByteFallback;
  } else if (type == "Fuse") {
    step.kind = DecoderStep::Kind::Fuse;
  } else if (type == "Strip") {
    step.kind = DecoderStep::Kind::Strip;
    step.content = one_character(p, d, "content", component);
    step.start = count(p, d, "start", component);
    step.stop = count(p, d, "stop", component);
  } else if (type == "Metaspace") {
    step.kind = DecoderStep::Kind::Metaspace;
    step.content = one_character(p, d, "replacement", component);
    step.prepend_scheme = parse_prepend_scheme(p, d, component);
  } else {
    p.error(component,
            fmt::format("decoder type '{}' is not supported (forge implements ByteLevel, Metaspace, "
                        "Replace, ByteFallback, Fuse, Strip, Sequence)",
                        type));
  }
  decoder.add(std::move(step));
}

SplitBehavior parse_behavior(const Parser& p, const json& step, const std::string& component) {
  const std::string name = p.string(step, "behavior", component);
  static const std::array<std::pair<const char*, SplitBehavior>, 5> kNames = {{
      {"Removed", SplitBehavior::Removed},
      {"Isolated", SplitBehavior::Isolated},
      {"MergedWithPrevious", SplitBehavior::MergedWithPrevious},
      {"MergedWithNext", SplitBehavior::MergedWithNext},
      {"Contiguous", SplitBehavior::Contiguous},
  }};
  for (const auto& [n, b] : kNames)
    if (name == n) return b;
  p.error(component + ".behavior", fmt::format("unknown split behavior '{}'", name));
}

void parse_pre_tokenizer(const Parser& p, const json& pt, const std::string& component,
                         std::vector<PreTokenizerStep>& steps) {
  const std::string type = p.type(pt, component);
  if (type == "Sequence") {
    const auto it = pt.find("pretokenizers");
    if (it == pt.end() || !it->is_array()) p.error(component + ".pretokenizers", "must be an array");
    for (size_t i = 0; i < it->size(); ++i)
      parse_pre_tokenizer(p, (*it)[i], fmt::format("{}.pretokenizers[{}]", component, i), steps);
    return;
  }
  PreTokenizerStep step;
  if (type == "ByteLevel") {
    step.kind = PreTokenizerStep::Kind::ByteLevel;
    step.add_prefix_space = p.boolean(pt, "add_prefix_space", true, component);
    step.use_regex = p.boolean(pt, "use_regex", true, component);
    if (step.use_regex)
      step.regex =
          std::make_shared<TokenizerRegex>(kGpt2SplitPattern, fmt::format("{}: {}", p.source(), component));
  } else if (type == "Split") {
    step.kind = PreTokenizerStep::Kind::Split;
    step.regex = parse_pattern(p, pt, component).regex;
    step.behavior = parse_behavior(p, pt, component);
    step.invert = p.boolean(pt, "invert", false, component);
  } else if (type == "Metaspace") {
    step.kind = PreTokenizerStep::Kind::Metaspace;
    step.replacement = one_character(p, pt, "replacement", component);
    step.prepend_scheme = parse_prepend_scheme(p, pt, component);
    step.split = p.boolean(pt, "split", true, component);
    if (step.split)
      step.regex = std::make_shared<TokenizerRegex>(escape_literal(step.replacement),
                                                    fmt::format("{}: {}", p.source(), component));
  } else {
    p.error(component,
            fmt::format("pre-tokenizer type '{}' is not supported (forge implements ByteLevel, Split, "
                        "Metaspace, Sequence)",
                        type));
  }
  steps.push_back(std::move(step));
}

// The ids of a TemplateProcessing special token, from its "special_tokens" table.
std::vector<int32_t> template_special_ids(const Parser& p, const json& pp, const std::string& name,
                                          const std::string& component) {
  const auto table = pp.find("special_tokens");
  if (table == pp.end() || !table->is_object()) p.error(component + ".special_tokens", "must be an object");
  const auto entry = table->find(name);
  if (entry == table->end())
    p.error(component, fmt::format("template names special token '{}' missing from special_tokens", name));
  const auto ids = entry->find("ids");
  if (ids == entry->end() || !ids->is_array())
    p.error(component + ".special_tokens['" + name + "']", "has no 'ids' array");
  std::vector<int32_t> out;
  for (const json& id : *ids) out.push_back(p.id(id, component + ".special_tokens['" + name + "'].ids"));
  return out;
}

// A template: a list of {"SpecialToken": {"id": ...}} and {"Sequence": {"id": "A" or "B"}} pieces (the
// reference reads no other form from tokenizer.json).
std::vector<TemplateItem> parse_template(const Parser& p, const json& pp, const char* key,
                                         const std::string& component) {
  const auto it = pp.find(key);
  if (it == pp.end()) p.error(component, fmt::format("missing '{}'", key));
  std::vector<TemplateItem> items;
  const std::string where = component + "." + key;
  auto add_sequence = [&](const std::string& id) {
    if (id == "A") {
      items.push_back({true, {}});
    } else if (id == "B") {
      if (std::string(key) == "single") p.error(where, "the single template cannot use sequence B");
      items.push_back({true, {}});
    } else {
      p.error(where, fmt::format("unknown sequence '{}'", id));
    }
  };
  if (!it->is_array()) p.error(where, "must be an array of pieces");
  for (const json& piece : *it) {
    if (piece.is_object() && piece.contains("Sequence")) {
      add_sequence(p.string(piece["Sequence"], "id", where));
    } else if (piece.is_object() && piece.contains("SpecialToken")) {
      items.push_back(
          {false, template_special_ids(p, pp, p.string(piece["SpecialToken"], "id", where), component)});
    } else {
      p.error(where, fmt::format("{} is neither a Sequence nor a SpecialToken", piece.dump()));
    }
  }
  return items;
}

void parse_post_processor(const Parser& p, const json& pp, const std::string& component,
                          std::vector<PostProcessorStep>& steps) {
  const std::string type = p.type(pp, component);
  if (type == "Sequence") {
    const auto it = pp.find("processors");
    if (it == pp.end() || !it->is_array()) p.error(component + ".processors", "must be an array");
    for (size_t i = 0; i < it->size(); ++i)
      parse_post_processor(p, (*it)[i], fmt::format("{}.processors[{}]", component, i), steps);
    return;
  }
  PostProcessorStep step;
  if (type == "ByteLevel") {
    step.is_template = false;
  } else if (type == "TemplateProcessing") {
    step.is_template = true;
    step.single = parse_template(p, pp, "single", component);
    parse_template(p, pp, "pair", component);  // validated only: forge encodes single texts
  } else {
    p.error(component, fmt::format("post-processor type '{}' is not supported (forge implements ByteLevel, "
                                   "TemplateProcessing, Sequence)",
                                   type));
  }
  steps.push_back(std::move(step));
}

}  // namespace

std::unique_ptr<TokenizerAccess::Impl> TokenizerAccess::parse(const json& root, std::string_view source) {
  const Parser p(source);
  if (!root.is_object()) p.error("tokenizer.json", "the top level must be a JSON object");
  auto impl = std::make_unique<Impl>();
  impl->source = std::string(source);

  if (const auto it = root.find("version");
      it != root.end() && !(it->is_string() && it->get<std::string>() == "1.0"))
    p.error("version", fmt::format("unknown tokenizer.json version {} (expected \"1.0\")", it->dump()));
  for (const char* key : {"truncation", "padding"}) {
    if (const auto it = root.find(key); it != root.end() && !it->is_null())
      p.error(key, "is not supported (must be null): forge encodes whole texts and never pads");
  }
  if (const auto it = root.find("normalizer"); it != root.end() && !it->is_null())
    parse_normalizer(p, *it, "normalizer", impl->normalizer);

  const auto model_it = root.find("model");
  if (model_it == root.end()) p.error("model", "missing");
  impl->model = parse_model(p, *model_it);

  if (const auto it = root.find("pre_tokenizer"); it != root.end() && !it->is_null())
    parse_pre_tokenizer(p, *it, "pre_tokenizer", impl->pre_tokenizers);
  if (const auto it = root.find("post_processor"); it != root.end() && !it->is_null())
    parse_post_processor(p, *it, "post_processor", impl->post_processors);
  if (const auto it = root.find("decoder"); it != root.end() && !it->is_null()) {
    impl->decoder.emplace();
    parse_decoder(p, *it, "decoder", *impl->decoder);
  }

  // Added tokens keep the model's id when the model has the token, and otherwise take the next id after
  // the vocabulary (the reference's rule); a file that says otherwise is rejected.
  const BpeModel& model = *impl->model;
  int64_t max_id = model.max_id();
  if (const auto it = root.find("added_tokens"); it != root.end() && !it->is_null()) {
    if (!it->is_array()) p.error("added_tokens", "must be an array");
    std::optional<int32_t> max_added;
    for (size_t i = 0; i < it->size(); ++i) {
      const json& t = (*it)[i];
      const std::string where = fmt::format("added_tokens[{}]", i);
      if (!t.is_object()) p.error(where, "must be an object");
      AddedToken token;
      token.content = p.string(t, "content", where);
      check_utf8_string(p, token.content, where);
      if (token.content.empty()) p.error(where, "has empty content");
      if (!t.contains("id")) p.error(where, "missing 'id'");
      token.id = p.id(t["id"], where + ".id");
      token.special = p.boolean(t, "special", false, where);
      token.single_word = p.boolean(t, "single_word", false, where);
      token.lstrip = p.boolean(t, "lstrip", false, where);
      token.rstrip = p.boolean(t, "rstrip", false, where);
      token.normalized = p.boolean(t, "normalized", !token.special, where);
      if (impl->added_by_content.count(token.content))
        p.error(where, fmt::format("'{}' is listed twice", token.content));
      token.form = token.normalized && !impl->normalizer.empty() ? impl->normalizer.normalize(token.content)
                                                                 : token.content;
      if (token.form.empty()) p.error(where, fmt::format("'{}' normalizes to empty text", token.content));
      int32_t expected;
      if (const auto v = model.vocab().find(token.content); v != model.vocab().end()) {
        expected = v->second;
      } else {
        const auto vocab_size = static_cast<int32_t>(model.vocab().size());
        expected = !max_added                                      ? vocab_size
                   : (*max_added >= vocab_size || vocab_size == 0) ? *max_added + 1
                                                                   : vocab_size;
      }
      if (token.id != expected)
        p.error(where, fmt::format("'{}' has id {}, but the reference would give it id {}", token.content,
                                   token.id, expected));
      max_added = std::max(max_added.value_or(expected), expected);
      for (const AddedToken& other : impl->added_tokens)
        if (other.id == token.id)
          p.error(where, fmt::format("'{}' and '{}' share id {}", other.content, token.content, token.id));
      impl->added_by_content.emplace(token.content, static_cast<int32_t>(impl->added_tokens.size()));
      impl->added_tokens.push_back(std::move(token));
      max_id = std::max<int64_t>(max_id, impl->added_tokens.back().id);
    }
  }
  // The reference's matching sets: special tokens first, then the others, split by `normalized`.
  for (bool special : {true, false})
    for (const AddedToken& token : impl->added_tokens)
      if (token.special == special)
        (token.normalized ? impl->normalized_tokens : impl->non_normalized_tokens).add(&token);

  const size_t size = static_cast<size_t>(max_id + 1);
  impl->added_index_by_id.assign(size, -1);
  for (size_t i = 0; i < impl->added_tokens.size(); ++i)
    impl->added_index_by_id[impl->added_tokens[i].id] = static_cast<int32_t>(i);
  std::unordered_set<std::string> special_contents;
  for (const AddedToken& token : impl->added_tokens)
    if (token.special) special_contents.insert(token.content);
  impl->token_string.assign(size, {});
  impl->text_bytes.assign(size, {});
  impl->is_special.assign(size, 0);
  impl->skip_as_special.assign(size, 0);
  impl->exists.assign(size, 0);
  for (size_t id = 0; id < size; ++id) {
    const auto i = static_cast<int32_t>(id);
    const std::string* token = nullptr;
    if (const AddedToken* added = impl->added_by_id(i)) {
      token = &added->form;
      impl->is_special[id] = added->special;
    } else {
      token = model.id_to_token(i);
    }
    if (!token) continue;
    impl->exists[id] = 1;
    impl->token_string[id] = *token;
    impl->text_bytes[id] = impl->decoder ? impl->decoder->token_text(*token) : *token;
    // The reference skips a token whose string is the content of a special token.
    impl->skip_as_special[id] = special_contents.count(*token) > 0;
  }

  // End and beginning of sequence: the first of these names that is a special added token.
  auto find_special = [&](std::initializer_list<const char*> names) -> std::optional<int32_t> {
    for (const char* name : names)
      if (const auto it = impl->added_by_content.find(std::string_view(name));
          it != impl->added_by_content.end())
        if (impl->added_tokens[it->second].special) return impl->added_tokens[it->second].id;
    return std::nullopt;
  };
  impl->eos = find_special({"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"});
  impl->bos = find_special({"<|begin_of_text|>", "<s>", "<bos>"});
  return impl;
}

}  // namespace forge::data
