// Chat templates against transformers itself (fixtures from tests/reference/chat_template_golden.py): the
// Jinja engine renders each small template as transformers' Jinja2 environment does, byte for byte, and
// refuses what Jinja2 refuses; every family's chat template renders each conversation as
// apply_chat_template(tokenize=False) does, or refuses it with the template's own message; the
// {% generation %} spans, named templates, folders and the error paths.
#include "forge/data/tokenizer/chat_template.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "data/tokenizer_test_util.h"
#include "forge/core/error.h"
#include "op_harness.h"

namespace forge::chat_template_test {
using namespace forge::data;
namespace {

using nlohmann::ordered_json;
using testing::expect_error_containing;

ordered_json read_fixture(const std::string& name) {
  return ordered_json::parse(testing::read_file(testing::fixture("chat/" + name)));
}

// What transformers' Jinja2 renders, the engine renders; what it refuses, the engine refuses.
TEST(Jinja, RendersAsTransformersJinja2Does) {
  const ordered_json cases = read_fixture("jinja_cases.json");
  ASSERT_GE(cases.size(), 30u);
  for (const ordered_json& c : cases) {
    const std::string name = c["name"].get<std::string>();
    SCOPED_TRACE(name);
    const std::string source = c["template"].get<std::string>();
    if (c.contains("error")) {
      EXPECT_THROW(jinja::Template::parse(source, name).render(c["context"]), Error) << c["error"];
      continue;
    }
    try {
      EXPECT_EQ(jinja::Template::parse(source, name).render(c["context"]).text, c["text"].get<std::string>());
    } catch (const Error& e) {
      ADD_FAILURE() << e.what();
    }
  }
}

class FamilyChatTemplates : public ::testing::TestWithParam<const char*> {};

TEST_P(FamilyChatTemplates, RenderAsApplyChatTemplateDoes) {
  const ordered_json fixture = read_fixture(std::string(GetParam()) + ".json");
  const ChatTemplate chat =
      ChatTemplate::from_tokenizer_config(fixture["tokenizer_config"], std::string(GetParam()) + ".json");
  int rendered = 0;
  for (const ordered_json& c : fixture["cases"]) {
    const std::string name = c["name"].get<std::string>();
    SCOPED_TRACE(name);
    ChatOptions options;
    options.now = fixture["now"].get<int64_t>();
    for (const auto& [key, value] : c["options"].items()) {
      if (key == "add_generation_prompt")
        options.add_generation_prompt = value.get<bool>();
      else if (key == "continue_final_message")
        options.continue_final_message = value.get<bool>();
      else if (key == "tools")
        options.tools = value;
      else
        options.variables[key] = value;
    }
    if (c.contains("error")) {
      // The template's raise_exception message reaches the user as transformers shows it.
      const std::string error = c["error"].get<std::string>();
      const std::string prefix = "TemplateError: ";
      if (error.rfind(prefix, 0) == 0)
        expect_error_containing([&] { chat.render(c["messages"], options); }, {error.substr(prefix.size())});
      else
        EXPECT_THROW(chat.render(c["messages"], options), Error) << error;
      continue;
    }
    try {
      EXPECT_EQ(chat.render(c["messages"], options).text, c["text"].get<std::string>());
      ++rendered;
    } catch (const Error& e) {
      ADD_FAILURE() << e.what();
    }
  }
  EXPECT_GE(rendered, 9);
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyChatTemplates,
                         ::testing::Values("llama3", "qwen2_5", "qwen3", "mistral_v1", "mistral_v3",
                                           "mistral_v3_tekken", "mistral_v7_tekken", "gemma2", "gemma3",
                                           "deepseek_v3", "llava", "chatml"));

// {% generation %} marks what the assistant said (transformers' return_assistant_tokens_mask reads these
// spans): the byte ranges of the rendered text, in order.
TEST(Jinja, GenerationBlocksGiveTheAssistantSpans) {
  const jinja::Template t = jinja::Template::parse(
      "{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}{{ m.content }}</s>"
      "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}",
      "spans");
  ordered_json context;
  context["messages"] = ordered_json::parse(
      R"([{"role": "user", "content": "a"}, {"role": "assistant", "content": "bc"},
          {"role": "user", "content": "d"}, {"role": "assistant", "content": "ef"}])");
  const jinja::Rendered r = t.render(context);
  EXPECT_EQ(r.text, "<user>a<assistant>bc</s><user>d<assistant>ef</s>");
  ASSERT_EQ(r.generation.size(), 2u);
  EXPECT_EQ(r.text.substr(r.generation[0].first, r.generation[0].second - r.generation[0].first), "bc</s>");
  EXPECT_EQ(r.text.substr(r.generation[1].first, r.generation[1].second - r.generation[1].first), "ef</s>");
}

// Syntax errors name the template and the line; run-time errors the line and the cause.
TEST(Jinja, ErrorsNameTheTemplateAndTheLine) {
  expect_error_containing([] { jinja::Template::parse("line one\n{% if x %}\nno end", "t.jinja"); },
                          {"t.jinja", "missing", "endif"});
  expect_error_containing([] { jinja::Template::parse("a\n\n{{ x + }}", "t.jinja"); }, {"t.jinja", "line 3"});
  expect_error_containing([] { jinja::Template::parse("{% include 'other' %}", "t.jinja"); },
                          {"t.jinja", "line 1", "unsupported statement 'include'"});
  expect_error_containing(
      [] { jinja::Template::parse("{{ x | wordwrap }}", "t.jinja").render(ordered_json::object()); },
      {"t.jinja", "unsupported filter 'wordwrap'"});
  expect_error_containing(
      [] {
        jinja::Template::parse("\n{{ raise_exception('roles must alternate') }}", "t.jinja")
            .render(ordered_json::object());
      },
      {"t.jinja", "line 2", "roles must alternate"});
  expect_error_containing(
      [] { jinja::Template::parse("{{ missing.attribute }}", "t.jinja").render(ordered_json::object()); },
      {"t.jinja", "'missing' is undefined"});
  expect_error_containing([] { jinja::Template::parse("{{ x }}", "t.jinja").render(ordered_json::array()); },
                          {"t.jinja", "must be a JSON object"});
}

// A folder's chat_template.jinja comes before tokenizer_config.json's template (transformers 5 saves it
// so); special tokens given as AddedToken objects read as their content; named templates are chosen by name.
TEST(ChatTemplate, FoldersNamedTemplatesAndSpecialTokens) {
  const testing::TokenizerTempDir temp;
  const std::filesystem::path dir = temp / "folder", empty = temp / "empty";
  std::filesystem::create_directories(dir), std::filesystem::create_directories(empty);
  std::ofstream(dir / "tokenizer_config.json")
      << R"({"bos_token": {"content": "<s>", "special": true}, "eos_token": "</s>", "pad_token": null,
            "chat_template": [{"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}{{ pad_token is defined }}"},
                              {"name": "tool_use", "template": "tools:{{ tools | length }}"}]})";
  const ordered_json messages = ordered_json::parse(R"([{"role": "user", "content": "hi"}])");
  EXPECT_EQ(ChatTemplate::from_folder(dir).render(messages).text, "<s>hi</s>False");
  ChatOptions options;
  options.tools = ordered_json::parse(R"([{"name": "a"}, {"name": "b"}])");
  EXPECT_EQ(ChatTemplate::from_folder(dir, "tool_use").render(messages, options).text, "tools:2");
  expect_error_containing([&] { ChatTemplate::from_folder(dir, "rag"); },
                          {"tokenizer_config.json", "no chat template named 'rag'", "default, tool_use"});
  std::ofstream(dir / "chat_template.jinja") << "jinja file: {{ messages | length }}{{ bos_token }}";
  EXPECT_EQ(ChatTemplate::from_folder(dir).render(messages).text, "jinja file: 1<s>");
  expect_error_containing([&] { ChatTemplate::from_folder(empty); },
                          {"no chat_template.jinja or tokenizer_config.json"});
}

// Malformed conversations are refused in one line naming the template.
TEST(ChatTemplate, RefusesMalformedConversations) {
  const ChatTemplate chat("{% for m in messages %}{{ m.content }}{% endfor %}", "t.jinja",
                          ordered_json::object());
  expect_error_containing([&] { chat.render(ordered_json::array()); }, {"t.jinja", "empty"});
  expect_error_containing([&] { chat.render(ordered_json::object()); }, {"t.jinja", "JSON array"});
  expect_error_containing([&] { chat.render(ordered_json::parse(R"([{"content": "a"}, "b"])")); },
                          {"t.jinja", "message 2", "not an object"});
  ChatOptions both;
  both.add_generation_prompt = both.continue_final_message = true;
  expect_error_containing([&] { chat.render(ordered_json::parse(R"([{"content": "a"}])"), both); },
                          {"continue_final_message and add_generation_prompt"});
  ChatOptions cont;
  cont.continue_final_message = true;
  expect_error_containing([&] { chat.render(ordered_json::parse(R"([{"role": "user"}])"), cont); },
                          {"no 'content'"});
}

}  // namespace
}  // namespace forge::chat_template_test
