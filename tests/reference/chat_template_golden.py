#!/usr/bin/env python3
# Writes the chat-template fixtures of tests/data/chat_template_test.cpp with Hugging Face transformers itself.
#
#   tests/fixtures/chat/jinja_cases.json  small templates over the Jinja forge's engine implements, each rendered
#                                         by the Jinja2 environment transformers compiles chat templates in
#                                         (trim_blocks, lstrip_blocks, loop controls, its tojson and globals)
#   tests/fixtures/chat/<family>.json     a family's chat template and special tokens (a tokenizer_config.json)
#                                         with conversations rendered by transformers' apply_chat_template
#                                         (tokenize=False): system prompts, several turns, generation prompts,
#                                         empty and unusual contents, content blocks, reasoning, tool calls,
#                                         continue_final_message; a conversation the template refuses keeps
#                                         transformers' error message
#   tests/fixtures/chat/sft_masks.json    supervised fine-tuning: conversations tokenized with
#                                         apply_chat_template(tokenize=True) and their assistant-token masks:
#                                         return_assistant_tokens_mask for a template with {% generation %}
#                                         blocks; for templates without, the tokens (offsets from tokenizers)
#                                         overlapping each assistant message's prefix span (what rendering
#                                         through the message adds to rendering before it with the generation
#                                         prompt), or the refusal when a template breaks that prefix rule
#
# The families' templates are those the axolotl package ships (Apache-2.0; PyPI's axolotl 0.19.0, read from its
# wheel, which pip downloads without installing), copies of the templates the models' own tokenizer_config.json
# files carry. Needs, in a virtual environment: pip install torch transformers jinja2. Deterministic.
#   python tests/reference/chat_template_golden.py
import datetime
import json
import os
import subprocess
import sys
import tempfile
import zipfile

from transformers import PreTrainedTokenizerFast
from transformers.utils import chat_template_utils
from transformers.utils.chat_template_utils import _compile_jinja_template

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "fixtures", "chat")
AXOLOTL = "axolotl==0.19.0"
# strftime_now's clock, fixed (Mistral Small's template dates its default system prompt): 2026-01-15 09:30 UTC.
NOW = 1768469400


class FrozenClock(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return datetime.datetime.fromtimestamp(NOW, datetime.timezone.utc).replace(tzinfo=None)


chat_template_utils.datetime = FrozenClock


def render_case(name, template, context):
    try:
        text = _compile_jinja_template(template).render(**context)
        return {"name": name, "template": template, "context": context, "text": text}
    except Exception as e:  # the C++ engine must refuse too
        return {"name": name, "template": template, "context": context, "error": f"{type(e).__name__}: {e}"}


def jinja_cases():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}]
    c = []
    add = lambda n, t, ctx=None: c.append(render_case(n, t, ctx or {}))
    add("text_only", "plain text\nwith lines\n")
    add("output", "{{ 'a' }}{{ 1 }}{{ 2.5 }}{{ none }}{{ true }}{{ [1, 'x', none] }}{{ {'k': 'v', 'n': 1} }}")
    add("floats", "{{ 1.0 }} {{ 1e20 }} {{ 0.00001 }} {{ 100.0 }} {{ 1e16 }} {{ 123456789.125 }} {{ 1 / 3 }}")
    add("arithmetic", "{{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1 + 2 * 3 - 4 }} "
        "{{ 'ab' * 3 }} {{ [1] + [2] }} {{ 'x' ~ 1 ~ none }} {{ -3 | abs }}")
    add("compare", "{{ 1 == 1.0 }} {{ true == 1 }} {{ 'a' < 'b' }} {{ [1, 2] == [1, 2] }} {{ 1 < 2 < 3 }} "
        "{{ 'b' in 'abc' }} {{ 'z' not in 'abc' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ none == none }}")
    add("logic", "{{ 0 or 'x' }} {{ 1 and 'y' }} {{ not [] }} {{ 'a' if false else 'b' }} {{ 'c' if true }}"
        "[{{ 'd' if false }}]")
    add("whitespace", "  {% if true %}\n  x\n  {% endif %}\n y {{- ' z ' -}} \n w\n{# c #}\n  {#- d -#}  e")
    add("whitespace_plus", "a\n  {%+ if true %}b{% endif %}\n  {{ 'c' }}\n{% for i in [1] %}\n{{ i }}\n{% endfor %}")
    add("raw", "{% raw %}{{ not rendered }}{% endraw %} after")
    add("strings", "{{ 'a\\nb\\t\"q\"\\'s' }}|{{ \"dq'\" }}|{{ 'x' 'y' }}|{{ '\\u00e9' }}")
    add("slices", "{{ 'abcdef'[::-1] }} {{ [1, 2, 3, 4][1:] }} {{ [1, 2, 3][:-1] }} {{ 'héllo'[1:3] }} "
        "{{ [1, 2, 3, 4, 5][::2] }} {{ [1, 2, 3][-1] }} {{ 'abc'[0] }} {{ [1, 2][5] }}")
    add("scopes", "{% set x = 1 %}{% for i in range(3) %}{% set x = x + i %}{{ x }}{% endfor %}{{ x }}"
        "{% for i in range(2) %}{% if i == 0 %}{% set y = 'a' %}{% endif %}[{{ y }}]{% endfor %}"
        "{% if true %}{% set z = 'kept' %}{% endif %}{{ z }}")
    add("namespace", "{% set ns = namespace(a=1, b='x') %}{% for i in range(4) %}{% set ns.a = ns.a + i %}"
        "{% endfor %}{{ ns.a }}{{ ns.b }}")
    add("loop", "{% for x in ['a', 'b', 'c'] %}{{ loop.index }}{{ loop.index0 }}{{ loop.first }}{{ loop.last }}"
        "{{ loop.length }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.previtem }}{{ loop.nextitem }}"
        "{{ loop.cycle('o', 'e') }};{% endfor %}")
    add("loop_filter_else", "{% for x in [1, 2, 3] if x > 1 %}{{ loop.index }}/{{ loop.length }} {% endfor %}"
        "{% for x in [] %}no{% else %}empty{% endfor %}")
    add("loop_controls", "{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 5 %}"
        "{% break %}{% endif %}{{ i }}{% endfor %}")
    add("unpack", "{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}{% set p, q = 1, 2 %}"
        "{{ p }}{{ q }}{% for a, b in [[1, 2], [3, 4]] %}{{ a + b }}{% endfor %}")
    add("set_block", "{% set block %}inner {{ 1 + 1 }}{% endset %}[{{ block }}]")
    add("macro", "{% macro m(a, b='d') %}<{{ a }}{{ b }}>{% endmacro %}{{ m(1) }}{{ m(2, b=3) }}{{ m('x', 'y') }}")
    add("dict_methods", "{% set d = {'a': 1, 'b': none} %}{{ d.keys() | list }} {{ d.values() | list }} "
        "{{ d.get('a') }} {{ d.get('z', 'dflt') }} {{ d.get('z') }} {{ d.a }} {{ d['b'] }} {{ d.missing }}|"
        "{{ d | items | list }} {{ d | length }}")
    add("string_methods", "{{ '  x  '.strip() }}|{{ 'xxaxx'.strip('x') }}|{{ ' a'.lstrip() }}|{{ 'a\\n'.rstrip() }}|"
        "{{ 'a b  c'.split() }}|{{ 'a,b,,c'.split(',') }}|{{ 'a,b,c'.split(',', 1) }}|{{ 'abc'.startswith('a') }}|"
        "{{ 'abc'.endswith(('x', 'c')) }}|{{ 'ab'.upper() }}{{ 'AB'.lower() }}|{{ 'hello world'.title() }}|"
        "{{ 'aXa'.replace('a', 'b') }}|{{ 'héllo'.find('l') }}|{{ 'aaa'.count('a') }}|{{ '-'.join(['a', 'b']) }}")
    add("filters", "{{ '  x ' | trim }}|{{ 'abc' | upper }}|{{ 'ABC' | lower }}|{{ 'hello' | capitalize }}|"
        "{{ [3, 1, 2] | sort }}|{{ [3, 1, 2] | sort(reverse=true) }}|{{ ['a', 'b'] | join(', ') }}|"
        "{{ [1, 2, 3] | first }}{{ [1, 2, 3] | last }}|{{ 'abc' | list }}|{{ [1, 2, 2, 1] | unique | list }}|"
        "{{ [1, 2] | reverse | list }}|{{ 'abc' | reverse }}|{{ 2.567 | round(1) }}|{{ 2.5 | round }}|"
        "{{ 3 | float }}|{{ '4' | int + 1 }}|{{ 'x' | int }}|{{ 'a b' | replace(' ', '_') }}|{{ [1, 2, 3] | sum }}|"
        "{{ [3, 1] | min }}{{ [3, 1] | max }}|{{ undefined_name | default('dflt') }}|{{ '' | default('e', true) }}|"
        "{{ 'x' | string }}{{ 1 | string }}|{{ 'héllo' | length }}|{{ [1, 2] | count }}")
    add("map_select", "{% set items = [{'a': 1, 't': 'x'}, {'a': 2}, {'a': 3, 't': 'y'}] %}"
        "{{ items | map(attribute='a') | list }}|{{ items | selectattr('t', 'defined') | map(attribute='t') | join }}|"
        "{{ items | rejectattr('t', 'defined') | list }}|{{ [1, 2, 3, 4] | select('odd') | list }}|"
        "{{ [1, 2, 3, 4] | reject('even') | list }}|{{ items | selectattr('a', 'equalto', 2) | list }}|"
        "{{ ['a', 'b'] | map('upper') | list }}|{{ items | map(attribute='t', default='-') | list }}")
    add("tojson", "{{ [1, 2.5, 'x\u00e9\"<>&', none, true] | tojson }}|{{ {'a': [1, {'b': 2}], 'c': {}} | tojson(indent=2) }}|"
        "{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }}|{{ {'a': 1} | tojson(separators=(',', ':')) }}|"
        "{{ 'line\\nbreak\\ttab' | tojson }}|{{ [] | tojson }}|{{ 1e20 | tojson }}")
    add("indent", "{{ 'x' | indent(2) }}|{{ 'a\\nb\\n\\nc' | indent(2) }}|{{ 'a\\nb' | indent(2, true) }}|"
        "{{ 'a\\n\\nb' | indent(2, blank=true) }}|{{ 'a\\n' | indent(4) }}")
    add("tests", "{{ 3 is divisibleby 3 }}{{ 'x' is string }}{{ {} is mapping }}{{ [] is iterable }}{{ 'a' is sequence }}"
        "{{ none is none }}{{ x is defined }}{{ x is undefined }}{{ 1 is number }}{{ 1.5 is float }}{{ 1 is integer }}"
        "{{ true is boolean }}{{ false is false }}{{ 2 is even }}{{ 3 is odd }}{{ 1 is not none }}{{ 2 is gt 1 }}"
        "{{ 'ab' is lower }}{{ 2 is in [1, 2] }}{{ 1 is eq 1 }}{{ [] is sequence }}")
    add("messages", "{% for m in messages %}<{{ m.role }}|{{ m['content'] }}>{% if not loop.last %}\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<assistant|{% endif %}",
        {"messages": msgs, "add_generation_prompt": True})
    add("messages_reversed", "{% for m in messages[::-1] %}{{ loop.index0 }}{{ m.role[0] }}{% endfor %}"
        "{{ messages | length - 1 }}{{ (messages | selectattr('role', 'equalto', 'user') | list | length) }}",
        {"messages": msgs})
    add("dict_literal_call", "{{ dict(a=1, b='x') | tojson }}{{ range(2, 8, 3) | list }}{{ range(3) | list }}")
    add("generation", "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
        "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}", {"messages": msgs})
    # Refused by Jinja2 (and the engine): raise_exception, an undefined variable's attribute, a type mismatch.
    add("raise", "{{ raise_exception('Conversation roles must alternate') }}")
    add("undefined_attribute", "{{ nothing.at_all }}")
    add("type_error", "{{ 'a' + 1 }}")
    add("zero_division", "{{ 1 // 0 }}")
    add("not_iterable", "{% for x in 3 %}{% endfor %}")
    add("unclosed", "{% if true %}never closed")
    return c


FAMILIES = {
    # name: (axolotl template, special tokens as a tokenizer_config.json sets them)
    "llama3": ("llama3.jinja", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "qwen2_5": ("qwen_25.jinja", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "qwen3": ("qwen3.jinja", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "mistral_v1": ("mistral_v1.jinja", {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
    "mistral_v3": ("mistral_v2v3.jinja", {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
    "mistral_v3_tekken": ("mistral_v3_tekken.jinja", {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
    "mistral_v7_tekken": ("mistral_v7_tekken.jinja", {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
    "gemma2": ("gemma.jinja", {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}),
    "gemma3": ("gemma3.jinja", {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}),
    "deepseek_v3": ("deepseek_v3.jinja", {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}),
    "llava": ("llava.jinja", {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
    "chatml": ("chatml.jinja", {"eos_token": "<|im_end|>"}),
}

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, now.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city's name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}]


def conversations():
    sys_msg = {"role": "system", "content": "You are a careful assistant."}
    u1 = {"role": "user", "content": "Quote Genesis 1:3."}
    a1 = {"role": "assistant", "content": "And God said, Let there be light: and there was light."}
    u2 = {"role": "user", "content": "Which book has this verse?"}
    return [
        ("one_user_turn", [u1], {}),
        ("generation_prompt", [u1], {"add_generation_prompt": True}),
        ("system_and_turns", [sys_msg, u1, a1, u2], {}),
        ("system_and_turns_prompt", [sys_msg, u1, a1, u2], {"add_generation_prompt": True}),
        ("two_full_turns", [u1, a1, u2, {"role": "assistant", "content": "Genesis."}], {}),
        ("empty_contents", [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}], {}),
        ("unusual_contents", [
            {"role": "system", "content": "  padded system\n\n"},
            {"role": "user", "content": "émoji 🙂, 中文, עברית, {{ not a tag }} {% nor this %} \\ \"quotes\" 'single'\n\tindented"},
            {"role": "assistant", "content": "\n  leading and trailing whitespace  \n"},
            {"role": "user", "content": "<|im_end|> [INST] <start_of_turn> markers typed by a user"}],
         {"add_generation_prompt": True}),
        ("null_keys_dropped", [{"role": "user", "content": "Hi", "name": None},
                               {"role": "assistant", "content": "Hello", "tool_calls": None}], {}),
        ("content_blocks", [{"role": "user", "content": [{"type": "text", "text": "Describe "},
                                                         {"type": "text", "text": "this."}]},
                            {"role": "assistant", "content": [{"type": "text", "text": "A verse."}]}], {}),
        ("reasoning", [u1, {"role": "assistant", "content": "Genesis 1:3.", "reasoning_content": "The user wants a quote."},
                       u2, {"role": "assistant", "content": "Genesis.", "reasoning_content": "Same book."}], {}),
        ("thinking_off", [u1], {"add_generation_prompt": True, "enable_thinking": False}),
        ("tools", [u1, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": "call00001", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
                   {"role": "tool", "content": "{\"temperature\": 21}", "tool_call_id": "call00001"},
                   {"role": "assistant", "content": "It is 21 degrees."}], {"tools": TOOLS}),
        ("continue_final_message", [u1, {"role": "assistant", "content": "And God said,"}], {"continue_final_message": True}),
        ("roles_out_of_order", [u1, u2], {}),
    ]


def family_fixtures(templates):
    tok_file = os.path.join(ROOT, "tests", "fixtures", "tokenizer", "families", "qwen3.tokenizer.json")
    for family, (file, special) in FAMILIES.items():
        template = templates[file]
        tok = PreTrainedTokenizerFast(tokenizer_file=tok_file, **special)
        tok.chat_template = template
        config = {"chat_template": template, **special}
        cases = []
        for name, messages, opts in conversations():
            case = {"name": name, "messages": messages, "options": dict(opts)}
            opts = dict(opts)
            tools = opts.pop("tools", None)
            try:
                text = tok.apply_chat_template(messages, tools=tools, tokenize=False, **opts)
                case["text"] = text
            except Exception as e:
                case["error"] = f"{type(e).__name__}: {e}"
            cases.append(case)
        with open(os.path.join(OUT, f"{family}.json"), "w", encoding="utf-8") as f:
            json.dump({"source": f"{AXOLOTL}: axolotl/utils/chat_templates/templates/{file}", "now": NOW,
                       "tokenizer_config": config, "cases": cases}, f, ensure_ascii=False, indent=1)
            f.write("\n")
        print(family, sum("text" in c for c in cases), "rendered,", sum("error" in c for c in cases), "refused")


# A ChatML template with {% generation %} around what the assistant says (its content and end of turn), as
# templates that support return_assistant_tokens_mask write it.
CHATML_GENERATION = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}{% else %}{{ message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def sft_conversations():
    q = {"role": "user", "content": "Quote Genesis 1:3."}
    a = {"role": "assistant", "content": "And God said, Let there be light: and there was light."}
    q2 = {"role": "user", "content": "Which book? Answer in one word, 中文 or English."}
    a2 = {"role": "assistant", "content": "Genesis."}
    return [
        ("one_turn", [q, a], None),
        ("system_two_turns", [{"role": "system", "content": "Answer from the King James Bible."}, q, a, q2, a2], None),
        ("empty_answer", [q, {"role": "assistant", "content": ""}, q2, a2], None),
        ("reasoning", [q, dict(a, reasoning_content="A quote."), q2, dict(a2, reasoning_content="One word.")], None),
        ("tools", [q, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]},
                   {"role": "tool", "content": "21"}, {"role": "assistant", "content": "21 degrees."}], TOOLS),
    ]


def prefix_spans(tok, messages, tools):
    full = tok.apply_chat_template(messages, tools=tools, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tok.apply_chat_template(messages[:i], tools=tools, tokenize=False, add_generation_prompt=True) if i else ""
        through = tok.apply_chat_template(messages[: i + 1], tools=tools, tokenize=False)
        start = len(os.path.commonprefix([before, full]))
        if start == len(before) and through.startswith(before) and full.startswith(through):
            spans.append((start, len(through)))
            continue
        # Rendered otherwise once later turns follow (Qwen3): the turn ends at the first eos_token after it.
        end = full.find(tok.eos_token, start) if tok.eos_token else -1
        if end < 0:
            return full, None
        spans.append((start, end + len(tok.eos_token)))
    return full, spans


def overlap_mask(offsets, spans):
    return [int(any(s < e and a < e and b > s for s, e in spans)) for a, b in offsets]


def sft_fixture(templates):
    setups = [  # name, template, special tokens, tokenizer fixture
        ("chatml_generation", CHATML_GENERATION, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, "qwen3"),
        ("qwen2_5", templates["qwen_25.jinja"], {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, "qwen3"),
        ("qwen3", templates["qwen3.jinja"], {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, "qwen3"),
        ("mistral_v1", templates["mistral_v1.jinja"], {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
         "mistral_v1"),
    ]
    out = []
    for name, template, special, tok_name in setups:
        tok_path = os.path.join(ROOT, "tests", "fixtures", "tokenizer", "families", tok_name + ".tokenizer.json")
        tok = PreTrainedTokenizerFast(tokenizer_file=tok_path, **special)
        tok.chat_template = template
        cases = []
        for cname, messages, tools in sft_conversations():
            case = {"name": cname, "messages": messages, "tools": tools}
            try:
                if "{% generation %}" in template:
                    enc = tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                                  return_assistant_tokens_mask=True)
                    case["ids"], case["mask"] = list(enc["input_ids"]), list(enc["assistant_masks"])
                else:
                    full, spans = prefix_spans(tok, messages, tools)
                    if spans is None:
                        case["error"] = "the template breaks the prefix rule"
                    else:
                        enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
                        ids = tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)["input_ids"]
                        assert list(ids) == list(enc["input_ids"])
                        case["ids"], case["mask"] = list(enc["input_ids"]), overlap_mask(enc["offset_mapping"], spans)
            except Exception as e:
                case["error"] = f"{type(e).__name__}: {e}"
            cases.append(case)
        out.append({"name": name, "tokenizer": f"tokenizer/families/{tok_name}.tokenizer.json",
                    "tokenizer_config": {"chat_template": template, **special}, "cases": cases})
        print("sft", name, sum("ids" in c for c in cases), "masked,", sum("error" in c for c in cases), "refused")
    with open(os.path.join(OUT, "sft_masks.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")


def axolotl_templates():
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", d, AXOLOTL], check=True)
        wheel = next(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".whl"))
        prefix = "axolotl/utils/chat_templates/templates/"
        with zipfile.ZipFile(wheel) as z:
            return {n[len(prefix):]: z.read(n).decode("utf-8") for n in z.namelist() if n.startswith(prefix)}


def main():
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "jinja_cases.json"), "w", encoding="utf-8") as f:
        json.dump(jinja_cases(), f, ensure_ascii=False, indent=1)
        f.write("\n")
    templates = axolotl_templates()
    family_fixtures(templates)
    sft_fixture(templates)


if __name__ == "__main__":
    main()
