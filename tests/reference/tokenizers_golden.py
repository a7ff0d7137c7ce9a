#!/usr/bin/env python3
"""Writes forge's parity fixtures for the tokenizers the model families ship (tests/fixtures/tokenizer/families/)
with Hugging Face tokenizers (the Rust library, through its PyPI package) and transformers.

    python -m venv /tmp/venv && /tmp/venv/bin/pip install tokenizers==0.23.3 transformers==5.25.0 \\
        sentencepiece protobuf mistral-common && /tmp/venv/bin/pip install --no-deps dashscope
    /tmp/venv/bin/python tests/reference/tokenizers_golden.py             # rewrites the fixtures
    /tmp/venv/bin/python tests/reference/tokenizers_golden.py --full DIR  # also the untrimmed files, in DIR

Tokenizers (each <name>.tokenizer.json with <name>.expected.json beside it):
  mistral_v1      Mistral 7B v0.1's SentencePiece model (mistral-common's tokenizer.model.v1), as transformers
                  reads it, in the legacy form LLaMA-2 and Mistral v0.1 ship on the Hub: normalizer
                  Sequence[Prepend("▁"), Replace(" ", "▁")], no pre-tokenizer, BPE with byte_fallback,
                  decoder Sequence[Replace("▁", " "), ByteFallback, Fuse, Strip(" ", 1, 0)], "<s> $A".
  mistral_v3      Mistral v0.3's model (tokenizer.model.v3, with its control tokens [INST], ...) as transformers
                  5 converts it: Metaspace(prepend_scheme "first", split false) instead of the normalizers.
  llama2_style    a small SentencePiece BPE trained here with LLaMA-2's documented trainer settings, in the
                  legacy form, plus added tokens with every flag (lstrip, rstrip, single_word, normalized).
  gemma_style     a small SentencePiece BPE trained with Gemma's settings (no dummy prefix, user-defined
                  pieces), as transformers' GemmaConverter lays it out: normalizer Replace(" ", "▁"),
                  pre-tokenizer Split(" ", MergedWithPrevious), decoder Replace/ByteFallback/Fuse, "<bos> $A".
  qwen3           Qwen's byte-level BPE (dashscope's qwen.tiktoken, the vocabulary of Qwen 1 to 3), with
                  Qwen2/3's pipeline: NFC, Split(Qwen's regex, Isolated), ByteLevel; Qwen3's added tokens.
  metaspace_nfkc  the llama2_style vocabulary with the pieces no family above uses: NFKC, a Regex Replace,
                  Metaspace(prepend_scheme "always", split true) and the Metaspace decoder.
The committed Mistral and Qwen files are trimmed (see trim_vocab) to keep the repository small; --full
writes the whole files and their expectations, which forge's test reads from FORGE_TOKENIZER_FULL_DIR.

Expectations: every text of texts() (short hard cases, each line of the multilingual corpus, the whole
corpus, seeded random mixes) encoded with and without special tokens and decoded both ways; decodings of
id sequences that cut characters apart, mix special tokens in, or are random. unicode_forms.json holds
hashes of the reference's NFC/NFD/NFKC/NFKD over every code point and over combining-mark sequences, and
the code points its added tokens' single_word check counts as word characters.
"""
import argparse
import importlib.util
import json
import os
import random
import shutil
import tempfile
import unicodedata

import mistral_common
import sentencepiece
import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "fixtures", "tokenizer")
OUT = os.path.join(FIXTURES, "families")
REFERENCE = f"tokenizers {tokenizers.__version__} (PyPI; Hugging Face's Rust implementation)"
QWEN_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# The hard multilingual corpus, one case a line (escapes keep invisible characters visible here).
CORPUS_LINES = [
    "The quick brown fox jumps over the lazy dog. It's 3:45 p.m.; I'd say we've 12,345.67 reasons.",
    "  leading spaces, trailing spaces   ",
    "multiple    inner     spaces\tand\ttabs\t\tdouble tab",
    "windows line\r",
    "北京是中国的首都，长城非常有名。我们今天学习分词器。",
    "日本語のテキスト、カタカナとひらがな。ｶﾀｶﾅ（半角）",
    "한국어 텍스트입니다. 자모: \u1100\u1161\u11a8 and 각",
    "مرحبا بالعالم! هذا نص عربي مع تشكيل: مَرْحَبًا",
    "שָׁלוֹם עוֹלָם — עברית עם ניקוד",
    "हिन्दी में पाठ: क्षत्रिय, द्वार, ज़्यादा",
    "ภาษาไทยไม่มีช่องว่างระหว่างคำ",
    "Привет, мир! Ёлка и йогурт.",
    "Ελληνικά: καλημέρα κόσμε, ΆΈΉ",
    "Emoji: 👍 👍🏽 👨‍👩‍👧‍👦 🇫🇷🇺🇸 ❤️ 🏳️‍🌈 🚀🚀🚀",
    "Combining: e\u0301 a\u0308 o\u0302\u0323 q\u0307\u0323 \u1e9b\u0323 Å \u212b \u0041\u030a",
    "Stacked marks: a\u0301\u0300\u0302\u0303\u0304\u0305\u0306\u0307\u0308",
    "NFKC: ﬁ ﬂ ① ⑴ ＡＢＣ１２３ ｱｲｳ ㍿ ㌔ ² ½ ™ ℃ Ⅻ ﬀ",
    "Ligatures and width: ﬃ ﬄ ﬅ ｈｅｌｌｏ\u3000ｗｏｒｌｄ",
    "Hangul jamo: \u1112\u1161\u11ab\u1100\u1173\u11af",
    "Non-breaking\u00a0space, narrow\u202fspace, ideographic\u3000space, en\u2002em\u2003",
    "Zero width: a\u200bb\u200cc\u200dd\ufeffe",
    "Separators: line\u2028para\u2029next\u0085nel",
    "Controls: \u0001\u0002\u0007\u001b[0m\u007f end",
    "Private use: \ue000\uf8ff and astral \U000f0000",
    "Newer scripts: Todhri \U000105c0\U000105c9 Garay \U00010d40 Kawi \U00011f04 Nag \U0001e4d0",
    "Rare CJK: \U00020000\U0002a6d6 𠀀 𪚶 and emoji 🫠🫨",
    "The metaspace itself: ▁ ▁▁ a▁b ▁start",
    "Byte tokens as text: <0x41> <0xE4> <0xZZ> <0x+A>",
    "def square(x):\n    return x ** 2  # comment",
    "if (a && b) { return -1; } // ok => ~~~ <= >= != ===",
    "https://example.org/path?q=1&r=2#frag user@example.com",
    "Numbers: 0 1 12 123 1234 12345 3.14159 1e-10 -42 +7 ٣٤٥ ४२ ๓",
    "I'M YOU'LL She'S they're We've it'd don't 'S 'T",
    "Mixed: abc中文def العربية123🙂x",
    "tabs\t\t\tand\n\n\nnewlines",
    "\ttab first",
    " space first",
    "\u00a0nbsp first",
    "last space ",
    "Specials: <s>Hi</s> <unk> [INST] do it [/INST] <start_of_turn>user\nhi<end_of_turn>",
    "Qwen: <|im_start|>system\nYou are<|im_end|>\n<|endoftext|><think>\nhm\n</think> <tool_call>",
    "Added: <mask>  x  <sep>  y [DAY] [day] hello world <word> in<word>side <word>.",
    "Gemma pieces: <table> <h1> \t\t and\n\n twice ▁▁ run",
    "Vietnamese: Tiếng Việt có dấu: ằ ẳ ẵ ặ ệ ữ",
    "Devanagari nukta: \u0915\u093c \u0958 and Bengali \u09a1\u09bc \u09dc",
    "Long word: pneumonoultramicroscopicsilicovolcanoconiosis aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "Repeated: " + "the " * 20 + "ab" * 30,
    "Odd spaces: \u1680ogham \u180emongolian \u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a",
    "Tamil and Sinhala: தமிழ் සිංහල and Khmer ភាសាខ្មែរ",
    "Tibetan: \u0f40\u0f71\u0f72 \u0f73 \u0f75 \u0f81",
    "Half-width Hangul: ﾡﾢﾣ and fullwidth symbols ￥￦",
    "Greek tonos: \u0390 \u03ac \u1f71 \u0387 \u037e",
    "Math: ∑∫∂√∞≠≤≥ 𝔸𝕏𝒜 𝟘𝟙 x² y₃",
    "",
    "a",
    " ",
]


def corpus_text():
    return "\n".join(CORPUS_LINES) + "\n"


def texts(specials):
    """Every text the expectations cover: short cases, the corpus whole and line by line, random mixes."""
    short = [
        "", " ", "  ", "\n", "\t", "a", "▁", "▁▁", " a", "a ", "Hello world", " Hello", "Hello  world",
        "中", "中文", "ü", "e\u0301", "é", "ﬁ", "①", "👍🏽", "<0x41>", "\u0000x", "\r\n", "x\r\ny",
    ] + [t for s in specials for t in (f"a{s}b", f"x  {s}  y{s}{s}中")]
    lines = [line for line in CORPUS_LINES]
    with_newlines = [line + "\n" for line in CORPUS_LINES[:10]]
    rnd = random.Random(20250506)
    pools = [
        "abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", "     ", "\n\r\t",
        "'.,!?;:-_()[]{}<>|/\\\"@#$%^&*+=~`", "éèêàçñüößøåÉ", "中文日本語한국어", "مرحبا שלום", "Привет",
        "\u0301\u0308\u200d\u00a0\u0085\u2028\u3000▁", "👍🏽🚀❤️🇫🇷", "ﬁ①ＡＢ½ｱ", "\U00020000\U000105c9\ue000",
    ]
    fragments = list(specials) + ["▁", "<0xE4>", "'s", "'LL", "the", "ab"]
    mixes = []
    for _ in range(110):
        text = ""
        for _ in range(rnd.randrange(40)):
            if rnd.random() < 0.08:
                text += rnd.choice(fragments)
            else:
                text += rnd.choice(pools[rnd.randrange(len(pools))])
        mixes.append(text)
    return short + lines + with_newlines + [corpus_text()] + mixes


def fnv1a64(data: bytes) -> str:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def write_json(path, value):
    """One line per top-level key and per element of top-level arrays."""
    lines = []
    for key, v in value.items():
        if isinstance(v, list):
            body = ",\n".join("  " + json.dumps(e, ensure_ascii=False) for e in v)
            lines.append(f"{json.dumps(key)}: [\n{body}\n]")
        else:
            lines.append(f"{json.dumps(key)}: {json.dumps(v, ensure_ascii=False)}")
    with open(path, "w", encoding="utf-8") as f:
        f.write("{\n" + ",\n".join(lines) + "\n}\n")


def save_tokenizer(tokenizer_json, path):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(tokenizer_json, f, ensure_ascii=False, indent=1)
        f.write("\n")


# --- building the tokenizers ---------------------------------------------------------------------------


def mistral_model(name):
    return os.path.join(os.path.dirname(mistral_common.__file__), "data", name)


def transformers_llama(model_file):
    """tokenizer.json as transformers 5 makes it of a LLaMA/Mistral SentencePiece model."""
    from transformers import LlamaTokenizer

    with tempfile.TemporaryDirectory() as folder:
        shutil.copy(model_file, os.path.join(folder, "tokenizer.model"))
        tokenizer = LlamaTokenizer.from_pretrained(folder)
        return with_bos_template(json.loads(tokenizer.backend_tokenizer.to_str()), "<s>")


def with_bos_template(j, bos):
    """The post-processor LLaMA-2's and Mistral's tokenizer.json have on the Hub: "<s> $A" (transformers reads
    add_bos_token from tokenizer_config.json, which these models set)."""
    t = Tokenizer.from_str(json.dumps(j))
    t.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                     special_tokens=[(bos, t.token_to_id(bos))])
    return json.loads(t.to_str())


def legacy_form(j):
    """The form LLaMA-2's and Mistral v0.1's tokenizer.json have on the Hub (transformers' LlamaConverter with
    legacy=True): Prepend and Replace normalizers instead of the Metaspace pre-tokenizer, unk_token "<unk>"."""
    j = json.loads(json.dumps(j))
    j["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
    ]}
    j["pre_tokenizer"] = None
    j["model"]["unk_token"] = "<unk>"
    return j


def trim_vocab(j, keep_pieces, corpus_chars, keep_added=lambda t: True):
    """A smaller tokenizer of the same kind: the added tokens kept by keep_added, the byte tokens <0xNN>, the
    first keep_pieces other tokens, single characters of the corpus; merges among what is kept; ids renumbered
    in order. The reference and forge see the same file, so parity is unaffected; byte fallback gets busier."""
    vocab = j["model"]["vocab"]
    added = {t["id"]: t for t in j["added_tokens"]}
    kept, pieces = [], 0
    for token, i in sorted(vocab.items(), key=lambda item: item[1]):
        if i in added:
            keep = keep_added(added[i])
        elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            keep = True
        else:
            keep = pieces < keep_pieces or (len(token) == 1 and token in corpus_chars)
            pieces += 1
        if keep:
            kept.append((token, i))
    new_id = {i: n for n, (token, i) in enumerate(kept)}
    j["model"]["vocab"] = {token: new_id[i] for token, i in kept}
    kept_tokens = j["model"]["vocab"]
    j["model"]["merges"] = [m for m in j["model"]["merges"]
                            if m[0] in kept_tokens and m[1] in kept_tokens and m[0] + m[1] in kept_tokens]
    j["added_tokens"] = [dict(t, id=new_id[t["id"]]) for t in j["added_tokens"] if t["id"] in new_id]
    remap_post_processor(j, new_id)
    return j


def remap_post_processor(j, new_id):
    pp = j.get("post_processor")
    if pp and pp.get("type") == "TemplateProcessing":
        for entry in pp["special_tokens"].values():
            entry["ids"] = [new_id[i] for i in entry["ids"]]


def train_sentencepiece(prefix, **options):
    with tempfile.TemporaryDirectory() as folder:
        data = os.path.join(folder, "train.txt")
        with open(data, "w", encoding="utf-8") as f:
            with open(os.path.join(FIXTURES, "corpus.txt"), encoding="utf-8") as corpus:
                f.write(corpus.read())
            for _ in range(3):
                f.write(corpus_text())
        sentencepiece.SentencePieceTrainer.train(
            input=data, model_prefix=os.path.join(folder, "m"), model_type="bpe", num_threads=1,
            minloglevel=2, hard_vocab_limit=False, **options)
        shutil.copy(os.path.join(folder, "m.model"), prefix + ".model")


def llama2_style(work):
    # LLaMA-2's tokenizer.model trainer_spec: BPE, byte_fallback, split_digits, identity normalization,
    # extra whitespace kept, dummy prefix, whitespace-only pieces, unk/bos/eos 0/1/2, no pad.
    train_sentencepiece(os.path.join(work, "llama2"), vocab_size=1200, byte_fallback=True, split_digits=True,
                        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
                        allow_whitespace_only_pieces=True, character_coverage=0.9995, unk_id=0, bos_id=1,
                        eos_id=2, pad_id=-1)
    j = legacy_form(transformers_llama(os.path.join(work, "llama2.model")))
    t = Tokenizer.from_str(json.dumps(j))
    t.add_tokens([
        AddedToken("<mask>", special=True, lstrip=True, normalized=False),
        AddedToken("<sep>", special=True, rstrip=True, normalized=False),
        AddedToken("[DAY]", special=False, normalized=True),
        AddedToken("hello world", special=False, normalized=True),
        AddedToken("<word>", special=False, single_word=True, normalized=False),
        AddedToken("Hi", special=False, normalized=False),
    ])
    return json.loads(t.to_str())


def metaspace_nfkc(llama2_json):
    j = json.loads(json.dumps(llama2_json))
    j["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "NFKC"}, {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}]}
    j["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
    j["decoder"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
    t = Tokenizer.from_str(json.dumps(j))
    t.add_tokens([AddedToken("ﬁx", special=False, normalized=True)])
    return json.loads(t.to_str())


def gemma_style(work):
    user_defined = ["<mask>", "[multimodal]", "<start_of_turn>", "<end_of_turn>", "<table>", "<h1>", "\t\t", "\n\n",
                    "▁▁"]
    train_sentencepiece(os.path.join(work, "gemma"), vocab_size=1200, byte_fallback=True, split_digits=True,
                        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
                        allow_whitespace_only_pieces=True, split_by_unicode_script=True, split_by_number=True,
                        split_by_whitespace=True, character_coverage=0.9995, pad_id=0, eos_id=1, bos_id=2,
                        unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
                        user_defined_symbols=user_defined)
    # transformers' GemmaConverter: its vocabulary and merges (piece scores), unk id 3, control pieces as
    # special added tokens, user-defined pieces as non-special ones (but <start_of_turn>/<end_of_turn>),
    # all with normalized false; its normalizer, pre-tokenizer and decoder; GemmaTokenizer's "<bos> $A".
    from transformers.convert_slow_tokenizer import generate_merges

    sp = sentencepiece.SentencePieceProcessor(model_file=os.path.join(work, "gemma.model"))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    scores = {sp.id_to_piece(i): sp.get_score(i) for i in range(sp.get_piece_size())}
    merges = generate_merges(vocab, scores)
    t = Tokenizer(BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True, dropout=None))
    special = {"<start_of_turn>", "<end_of_turn>"}
    added = []
    for i in range(sp.get_piece_size()):
        if sp.is_control(i) or sp.is_unknown(i):
            added.append(AddedToken(sp.id_to_piece(i), special=True, normalized=False))
        elif sp.id_to_piece(i) in user_defined:
            added.append(AddedToken(sp.id_to_piece(i), special=sp.id_to_piece(i) in special, normalized=False))
    t.add_tokens(added)
    t.normalizer = normalizers.Replace(" ", "▁")
    t.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    t.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                     special_tokens=[("<bos>", 2)])
    return json.loads(t.to_str())


QWEN3_ADDED = [  # (content, special), from id 151643 on, as Qwen3's tokenizer_config.json lists them
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]


def qwen3(limit):
    """Qwen's vocabulary from dashscope's qwen.tiktoken (base64 token, rank), the first `limit` ranks (None:
    all). Merges as transformers' TikTokenConverter derives them: for each token, its splits into two tokens,
    ordered by the token's rank and then the parts' ranks."""
    import base64

    from transformers.convert_slow_tokenizer import bytes_to_unicode

    path = os.path.join(importlib.util.find_spec("dashscope").submodule_search_locations[0], "resources",
                        "qwen.tiktoken")
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                if limit is None or int(rank) < limit:
                    ranks[base64.b64decode(token)] = int(rank)
    byte_encoder = bytes_to_unicode()

    def to_string(b):
        return "".join(byte_encoder[x] for x in b)

    vocab, merges = {}, []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        vocab[to_string(token)] = rank
        local = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in ranks and token[k:] in ranks]
        local.sort(key=lambda pair: (ranks[pair[0]], ranks[pair[1]]))
        merges += [(to_string(a), to_string(b)) for a, b in local]
    t = Tokenizer(BPE(vocab, merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                      end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    t.normalizer = normalizers.NFC()
    t.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    t.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    t.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    t.add_tokens([AddedToken(content, special=special, normalized=False) for content, special in QWEN3_ADDED])
    return json.loads(t.to_str())


# --- expectations -----------------------------------------------------------------------------------------


def expectations(name, tokenizer_json, description, folder):
    path = os.path.join(folder, name + ".tokenizer.json")
    save_tokenizer(tokenizer_json, path)
    t = Tokenizer.from_file(path)
    specials = [a["content"] for a in tokenizer_json["added_tokens"]]
    encode = []
    for text in texts(specials):
        ids = t.encode(text, add_special_tokens=False).ids
        with_special = t.encode(text, add_special_tokens=True).ids
        encode.append({"text": text, "ids": ids, "ids_with_special_tokens": with_special,
                       "decoded": t.decode(with_special, skip_special_tokens=False),
                       "decoded_skip_special": t.decode(with_special, skip_special_tokens=True)})
    vocab = t.get_vocab(with_added_tokens=True)
    byte_id = {b: vocab.get(f"<0x{b:02X}>") for b in range(256)}
    word = t.encode("Hello world", add_special_tokens=False).ids
    inputs = [[]]
    for bytes_ in ([0x41], [0xE4], [0xE4, 0xB8], [0xE4, 0xB8, 0xAD], [0xFF], [0xC0, 0xAF], [0xED, 0xA0, 0x80],
                   [0xF0, 0x9F, 0x91, 0x8D], [0xF0, 0x9F, 0x91], [0x41, 0xE4, 0x42], [0x0A, 0x20, 0x09]):
        ids = [byte_id[b] for b in bytes_]
        if all(i is not None for i in ids):
            inputs += [ids, word + ids, ids + word, ids + word + ids]
    for s in specials[:12]:
        inputs += [[vocab[s]], [vocab[s]] + word, word + [vocab[s]] + word]
    rnd = random.Random(7)
    size = t.get_vocab_size(with_added_tokens=True)
    inputs += [[rnd.randrange(size) for _ in range(rnd.randrange(1, 17))] for _ in range(60)]
    decode = [{"ids": ids, "text": t.decode(ids, skip_special_tokens=False),
               "text_skip_special": t.decode(ids, skip_special_tokens=True)} for ids in inputs]
    write_json(os.path.join(folder, name + ".expected.json"),
               {"tokenizer": name + ".tokenizer.json", "reference": REFERENCE, "source": description,
                "vocab_size": t.get_vocab_size(with_added_tokens=True), "encode": encode, "decode": decode})
    tokens = sum(len(e["ids"]) for e in encode)
    print(f"wrote {name}: vocabulary {t.get_vocab_size(True)}, {len(encode)} texts, {tokens} tokens, "
          f"{len(decode)} decodes")


def to_ranges(code_points):
    ranges = []
    for c in code_points:
        if ranges and ranges[-1][1] == c - 1:
            ranges[-1][1] = c
        else:
            ranges.append([c, c])
    return ranges


def single_word_chars():
    """The code points the reference counts as word characters for an added token's single_word: those after
    which a single_word token "@" is not found."""
    t = Tokenizer(BPE())
    t.add_tokens([AddedToken("@", single_word=True)])
    code_points = [c for c in range(1, 0x110000) if not 0xD800 <= c <= 0xDFFF]
    word = []
    for k in range(0, len(code_points), 65536):
        chunk = code_points[k:k + 65536]
        encodings = t.encode_batch(["@" + chr(c) for c in chunk], add_special_tokens=False)
        word += [c for c, e in zip(chunk, encodings) if not e.ids]
    return to_ranges(word)


def unicode_forms(folder):
    """Hashes of the reference's four normal forms over every code point (4096 at a time) and over mark
    sequences built by a rule forge repeats: for mark i of the list, base[i % 8] + mark[i] +
    mark[(i * 7919) % n] + U+0301 + mark[i], 64 sequences a chunk joined by '|'."""
    marks = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF and
             (unicodedata.combining(chr(c)) or unicodedata.category(chr(c)) in ("Mn", "Mc", "Me"))]
    ranges = to_ranges(marks)
    bases = "aAoN\u0391\u0415\u1100\u0915"
    sequences = [bases[i % 8] + chr(m) + chr(marks[(i * 7919) % len(marks)]) + "\u0301" + chr(m)
                 for i, m in enumerate(marks)]
    out = {"reference": REFERENCE, "chunk": 4096, "bases": bases, "marks": ranges,
           "single_word_chars": single_word_chars()}
    for form in ("NFC", "NFD", "NFKC", "NFKD"):
        n = getattr(normalizers, form)()
        code_points = []
        for start in range(0, 0x110000, 4096):
            text = "".join(chr(c) for c in range(max(start, 1), start + 4096) if not 0xD800 <= c <= 0xDFFF)
            code_points.append(fnv1a64(n.normalize_str(text).encode()))
        mark_hashes = [fnv1a64(n.normalize_str("|".join(sequences[k:k + 64])).encode())
                       for k in range(0, len(sequences), 64)]
        out[form + "_code_points"] = code_points
        out[form + "_marks"] = mark_hashes
    write_json(os.path.join(folder, "unicode_forms.json"), out)
    print("wrote unicode_forms.json:", len(marks), "marks")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", metavar="DIR", help="also write the untrimmed Mistral and Qwen files to DIR")
    args = parser.parse_args()
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "multilingual.txt"), "w", encoding="utf-8", newline="") as f:
        f.write(corpus_text())
    corpus_chars = set(corpus_text())
    v3_added = lambda t: t["id"] < 10 or t["content"] in ("[control_8]", "[control_9]")  # noqa: E731
    v1 = legacy_form(transformers_llama(mistral_model("tokenizer.model.v1")))
    v3 = transformers_llama(mistral_model("mistral_instruct_tokenizer_240323.model.v3"))
    with tempfile.TemporaryDirectory() as work:
        llama2 = llama2_style(work)
        gemma = gemma_style(work)
    committed = [
        ("mistral_v1", trim_vocab(json.loads(json.dumps(v1)), 1500, corpus_chars),
         "mistral-common tokenizer.model.v1 (Mistral 7B v0.1) read by transformers, legacy LLaMA-2 form, "
         "trimmed to 1500 pieces + corpus characters"),
        ("mistral_v3", trim_vocab(json.loads(json.dumps(v3)), 1500, corpus_chars, v3_added),
         "mistral-common mistral_instruct_tokenizer_240323.model.v3 (Mistral 7B v0.3) as transformers 5 "
         "converts it, trimmed to 1500 pieces + corpus characters and 9 control tokens"),
        ("llama2_style", llama2, "SentencePiece BPE trained with LLaMA-2's settings, legacy form, extra added tokens"),
        ("gemma_style", gemma, "SentencePiece BPE trained with Gemma's settings, GemmaConverter's layout"),
        ("qwen3", qwen3(2000), "dashscope qwen.tiktoken, first 2000 ranks, Qwen2/3 pipeline, Qwen3 added tokens"),
        ("metaspace_nfkc", metaspace_nfkc(llama2), "llama2_style vocabulary with NFKC, Regex Replace, Metaspace "
         "(always, split) pre-tokenizer and decoder"),
    ]
    for name, j, description in committed:
        expectations(name, j, description, OUT)
    unicode_forms(OUT)
    if args.full:
        os.makedirs(args.full, exist_ok=True)
        for name, j, description in [
            ("mistral_v1_full", v1, "mistral-common tokenizer.model.v1, legacy LLaMA-2 form, whole"),
            ("mistral_v3_full", v3, "mistral-common model.v3 as transformers 5 converts it, whole"),
            ("qwen3_full", qwen3(None), "dashscope qwen.tiktoken, all 151643 ranks, Qwen3 added tokens"),
        ]:
            expectations(name, j, description, args.full)


if __name__ == "__main__":
    main()
