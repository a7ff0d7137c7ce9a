#include "forge/ckpt/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>

namespace forge::safetensors_test {
using namespace forge::ckpt;
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::HasSubstr;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "forge_safetensors_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string file(const std::string& name) const { return (dir_ / name).string(); }

  // Writes a file by hand: the 8-byte length (the header's size unless overridden), the header, the data.
  std::string write_raw(const std::string& name, const std::string& header, size_t data_bytes,
                        std::optional<uint64_t> header_length = std::nullopt) const {
    std::string path = file(name);
    std::ofstream out(path, std::ios::binary);
    uint64_t length = header_length.value_or(header.size());
    out.write(reinterpret_cast<const char*>(&length), 8);
    out << header << std::string(data_bytes, '\x5a');
    return path;
  }

  // Opens `path` expecting a forge::Error; returns its message.
  static std::string open_error(const std::string& path) {
    try {
      SafetensorsFile::open(path);
    } catch (const Error& e) {
      return e.what();
    }
    ADD_FAILURE() << "opening " << path << " did not throw";
    return "";
  }

  fs::path dir_;
};

Tensor patterned(Shape shape, DType dtype, uint8_t seed) {
  Tensor t = Tensor::empty(std::move(shape), dtype);
  auto* bytes = static_cast<uint8_t*>(t.raw());
  for (size_t i = 0; i < t.bytes(); ++i) bytes[i] = static_cast<uint8_t>(seed + 37 * i + (i >> 3));
  return t;
}

TEST_F(SafetensorsTest, RoundTripsEveryDTypeAndMetadata) {
  std::vector<std::pair<std::string, Tensor>> tensors = {
      {"w.f32", patterned({3, 5}, DType::f32, 1)},    {"w.bf16", patterned({7}, DType::bf16, 2)},
      {"w.f16", patterned({2, 2, 3}, DType::f16, 3)}, {"w.e4m3", patterned({9}, DType::e4m3, 4)},
      {"w.e5m2", patterned({4, 1}, DType::e5m2, 5)},  {"ids.i32", patterned({6}, DType::i32, 6)},
      {"ids.i64", patterned({2, 3}, DType::i64, 7)},  {"mask.u8", patterned({11}, DType::u8, 8)},
      {"scalar", patterned({}, DType::f32, 9)},       {"empty", patterned({0, 4}, DType::bf16, 10)},
  };
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"lr", "0.01"}};
  const std::string path = file("model.safetensors");
  write_safetensors(path, tensors, metadata);
  EXPECT_FALSE(fs::exists(path + ".tmp"));

  SafetensorsFile reader = SafetensorsFile::open(path);
  EXPECT_EQ(reader.metadata(), metadata);
  EXPECT_EQ(reader.entries().size(), tensors.size());
  for (const auto& [name, expected] : tensors) {
    SCOPED_TRACE(name);
    const SafetensorsEntry* entry = reader.find(name);
    ASSERT_NE(entry, nullptr);
    EXPECT_EQ(entry->dtype, expected.dtype());
    EXPECT_EQ(entry->shape, expected.shape());
    EXPECT_EQ(entry->end - entry->begin, expected.bytes());
    Tensor got = reader.read(name);
    EXPECT_EQ(got.dtype(), expected.dtype());
    EXPECT_EQ(got.shape(), expected.shape());
    EXPECT_EQ(std::memcmp(got.raw(), expected.raw(), expected.bytes()), 0);
  }
  EXPECT_EQ(reader.find("missing"), nullptr);
  EXPECT_THAT(
      [&] {
        try {
          reader.read("missing");
        } catch (const Error& e) {
          return std::string(e.what());
        }
        return std::string();
      }(),
      HasSubstr("'missing'"));
}

TEST_F(SafetensorsTest, FileLayoutFollowsTheFormat) {
  // Check the bytes against the format itself, not against our own reader.
  Tensor a = patterned({2, 3}, DType::f32, 1), b = patterned({5}, DType::bf16, 2);
  const std::string path = file("layout.safetensors");
  write_safetensors(path, {{"a", a}, {"b", b}}, {{"k", "v"}});
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u) << "data section should start 8-byte aligned";
  ASSERT_EQ(bytes.size(), 8 + n + a.bytes() + b.bytes());
  auto header = nlohmann::json::parse(bytes.substr(8, n));
  EXPECT_EQ(header["__metadata__"]["k"], "v");
  EXPECT_EQ(header["a"]["dtype"], "F32");
  EXPECT_EQ(header["a"]["shape"], nlohmann::json({2, 3}));
  EXPECT_EQ(header["b"]["dtype"], "BF16");
  const uint64_t b_begin = header["b"]["data_offsets"][0];
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + n + b_begin, b.raw(), b.bytes()), 0);
}

TEST_F(SafetensorsTest, ReadF32ConvertsHalfAndFp8Exactly) {
  const std::vector<float> values = {0.0f, -1.5f, 3.5f, 0.0078125f, -224.0f, 96.0f};
  const size_t n = values.size();
  Tensor bf = Tensor::empty({6}, DType::bf16), hf = Tensor::empty({6}, DType::f16);
  Tensor e4 = Tensor::empty({6}, DType::e4m3), e5 = Tensor::empty({6}, DType::e5m2);
  Tensor f = Tensor::empty({2, 3}, DType::f32), ids = Tensor::empty({6}, DType::i32);
  for (size_t i = 0; i < n; ++i) {
    bf.data<uint16_t>()[i] = f32_to_bf16_bits(values[i]);
    hf.data<uint16_t>()[i] = f32_to_f16_bits(values[i]);
    e4.data<uint8_t>()[i] = f32_to_e4m3(values[i]);
    e5.data<uint8_t>()[i] = f32_to_e5m2(values[i]);
    f.data<float>()[i] = values[i];
    ids.data<int32_t>()[i] = static_cast<int32_t>(i);
  }
  const std::string path = file("convert.safetensors");
  write_safetensors(path, {{"bf", bf}, {"hf", hf}, {"e4", e4}, {"e5", e5}, {"f", f}, {"ids", ids}});
  SafetensorsFile reader = SafetensorsFile::open(path);
  for (const char* name : {"bf", "hf", "e4", "e5", "f"}) {
    SCOPED_TRACE(name);
    Tensor got = reader.read_f32(name);
    ASSERT_EQ(got.dtype(), DType::f32);
    // Every value above is exactly representable in all five formats.
    for (size_t i = 0; i < n; ++i) EXPECT_EQ(got.data<float>()[i], values[i]) << "element " << i;
  }
  Tensor flat = Tensor::empty({6}, DType::f32);
  reader.read_into("f", flat);  // same numel, different shape: allowed for flat parameter buffers
  EXPECT_EQ(flat.data<float>()[4], values[4]);
  try {
    reader.read_f32("ids");
    ADD_FAILURE() << "int32 read as fp32";
  } catch (const Error& e) {
    EXPECT_THAT(std::string(e.what()), AllOf(HasSubstr("'ids'"), HasSubstr("I32")));
  }
  try {
    reader.read_into("f", Tensor::empty({5}, DType::f32));
    ADD_FAILURE() << "shape mismatch accepted";
  } catch (const Error& e) {
    EXPECT_THAT(std::string(e.what()), AllOf(HasSubstr("'f'"), HasSubstr("[2, 3]"), HasSubstr("[5]")));
  }
}

TEST_F(SafetensorsTest, WriteReplacesAtomicallyAndLeavesNoTmp) {
  const std::string path = file("replace.safetensors");
  write_safetensors(path, {{"x", patterned({100}, DType::f32, 1)}});
  write_safetensors(path, {{"y", patterned({3}, DType::u8, 2)}}, {{"v", "2"}});
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  SafetensorsFile reader = SafetensorsFile::open(path);
  EXPECT_EQ(reader.find("x"), nullptr);
  ASSERT_NE(reader.find("y"), nullptr);
  EXPECT_EQ(reader.metadata().at("v"), "2");

  // Writing twice with the same inputs gives the same bytes (deterministic header).
  const std::string again = file("again.safetensors");
  write_safetensors(again, {{"y", patterned({3}, DType::u8, 2)}}, {{"v", "2"}});
  std::ifstream in1(path, std::ios::binary), in2(again, std::ios::binary);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in1), {}),
            std::string(std::istreambuf_iterator<char>(in2), {}));
}

TEST_F(SafetensorsTest, WriteRejectsBadInputAndCleansUp) {
  const std::string missing_dir = file("no/such/dir/out.safetensors");
  try {
    write_safetensors(missing_dir, {{"x", patterned({2}, DType::f32, 1)}});
    ADD_FAILURE() << "write into a missing directory succeeded";
  } catch (const Error& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr(missing_dir));
  }
  const std::string path = file("dup.safetensors");
  try {
    write_safetensors(path, {{"x", patterned({2}, DType::f32, 1)}, {"x", patterned({2}, DType::f32, 2)}});
    ADD_FAILURE() << "duplicate names written";
  } catch (const Error& e) {
    EXPECT_THAT(std::string(e.what()), AllOf(HasSubstr("'x'"), HasSubstr("twice")));
  }
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

TEST_F(SafetensorsTest, RejectsTruncatedAndAbsurdLengths) {
  {
    const std::string path = file("short.safetensors");
    std::ofstream(path, std::ios::binary) << "abc";
    EXPECT_THAT(open_error(path), AllOf(HasSubstr(path), HasSubstr("shorter than")));
  }
  {
    const std::string path = write_raw("past_end.safetensors", "{}", 0, 4096);
    EXPECT_THAT(open_error(path), AllOf(HasSubstr(path), HasSubstr("4096"), HasSubstr("past the end")));
  }
  {
    const std::string path = write_raw("absurd.safetensors", "{}", 0, 1ull << 40);
    EXPECT_THAT(open_error(path), AllOf(HasSubstr(path), HasSubstr("absurd")));
  }
  EXPECT_THAT(open_error(file("does_not_exist.safetensors")), HasSubstr("does_not_exist.safetensors"));
}

struct MalformedCase {
  const char* label;
  const char* header;
  size_t data_bytes;
  std::vector<const char*> expected;  // substrings of the error, besides the file path
};

class SafetensorsMalformedTest : public SafetensorsTest,
                                 public ::testing::WithParamInterface<MalformedCase> {};

TEST_P(SafetensorsMalformedTest, RejectsWithMessageNamingTheCulprit) {
  const MalformedCase& c = GetParam();
  const std::string path = write_raw(std::string(c.label) + ".safetensors", c.header, c.data_bytes);
  const std::string message = open_error(path);
  EXPECT_THAT(message, HasSubstr(path));
  for (const char* expected : c.expected) EXPECT_THAT(message, HasSubstr(expected));
  EXPECT_EQ(message.find('\n'), std::string::npos) << "one line";
}

// A well-formed tensor "ok" (4 F32 = 16 bytes at [0, 16]) sits next to the culprit where that matters, so
// the message must single out the right one.
const MalformedCase kMalformed[] = {
    {"not_json", R"({"a": {"dtype": "F32", )", 0, {"not valid JSON"}},
    {"not_object", R"([1, 2, 3])", 0, {"not an object"}},
    {"entry_not_object", R"({"w": [1]})", 0, {"'w'", "not a JSON object"}},
    {"missing_shape", R"({"w": {"dtype": "F32", "data_offsets": [0, 4]}})", 4, {"'w'", "\"shape\""}},
    {"unknown_dtype",
     R"({"ok": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "w": {"dtype": "F4", "shape": [2], "data_offsets": [16, 17]}})",
     17,
     {"'w'", "\"F4\""}},
    {"dtype_not_string", R"({"w": {"dtype": 7, "shape": [1], "data_offsets": [0, 4]}})", 4, {"'w'", "dtype"}},
    {"negative_dim",
     R"({"w": {"dtype": "F32", "shape": [2, -3], "data_offsets": [0, 24]}})",
     24,
     {"'w'", "negative"}},
    {"shape_not_ints",
     R"({"w": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}})",
     8,
     {"'w'", "list of integers"}},
    {"offsets_one_int",
     R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})",
     4,
     {"'w'", "two non-negative integers"}},
    {"offsets_string",
     R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, "4"]}})",
     4,
     {"'w'", "two non-negative integers"}},
    {"offsets_float",
     R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4.0]}})",
     4,
     {"'w'", "two non-negative integers"}},
    {"offsets_negative",
     R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})",
     4,
     {"'w'", "two non-negative integers"}},
    {"end_before_begin",
     R"({"w": {"dtype": "U8", "shape": [0], "data_offsets": [8, 4]}})",
     8,
     {"'w'", "end before begin"}},
    {"size_mismatch",
     R"({"ok": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "w": {"dtype": "BF16", "shape": [3, 2], "data_offsets": [16, 26]}})",
     26,
     {"'w'", "10 bytes", "needs 12"}},
    {"past_data_end",
     R"({"ok": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "w": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}})",
     20,
     {"'w'", "past the end of the data section", "20 bytes"}},
    {"overlap",
     R"({"ok": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "w": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}})",
     20,
     {"'w'", "overlap", "'ok'"}},
    {"overlap_nested",
     R"({"big": {"dtype": "U8", "shape": [32], "data_offsets": [0, 32]},
        "mid": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]},
        "w": {"dtype": "U8", "shape": [4], "data_offsets": [20, 24]}})",
     32,
     {"'mid'", "overlap", "'big'"}},
    {"duplicate_name",
     R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        "w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
     8,
     {"'w'", "twice"}},
    {"metadata_not_strings", R"({"__metadata__": {"step": 3}})", 0, {"__metadata__", "'step'"}},
    {"metadata_not_object", R"({"__metadata__": ["pt"]})", 0, {"__metadata__", "not a JSON object"}},
    {"metadata_duplicate_key",
     R"({"__metadata__": {"format": "pt", "format": "np"}})",
     0,
     {"__metadata__", "'format'", "twice"}},
    {"entry_duplicate_field",
     R"({"w": {"dtype": "F32", "shape": [1], "dtype": "I32", "data_offsets": [0, 4]}})",
     4,
     {"'w'", "\"dtype\"", "twice"}},
    {"missing_dtype", R"({"w": {"shape": [1], "data_offsets": [0, 4]}})", 4, {"'w'", "\"dtype\""}},
    {"missing_offsets", R"({"w": {"dtype": "F32", "shape": [1]}})", 4, {"'w'", "\"data_offsets\""}},
    {"numel_overflow",
     R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})",
     0,
     {"'w'", "more than 2^64"}},
    {"empty_header", "", 0, {"not valid JSON"}},
    {"trailing_garbage_after_json", R"({} x)", 0, {"not valid JSON"}},
    {"invalid_utf8_name",
     "{\"w\xff\": {\"dtype\": \"U8\", \"shape\": [0], \"data_offsets\": [0, 0]}}",
     0,
     {"not valid JSON"}},
    // The tensors must tile the data section exactly, as the reference implementation requires.
    {"gap_between_tensors",
     R"({"ok": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "w": {"dtype": "U8", "shape": [4], "data_offsets": [20, 24]}})",
     24,
     {"'w'", "[16, 20)", "contiguous"}},
    {"gap_before_first",
     R"({"w": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}})",
     8,
     {"'w'", "[0, 4)", "contiguous"}},
    {"trailing_bytes",
     R"({"ok": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})",
     21,
     {"21 bytes", "first 16", "5 trailing bytes"}},
    {"data_but_no_tensors", R"({})", 3, {"3 bytes", "first 0"}},
    {"empty_tensor_inside_another",
     R"({"ok": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}})",
     16,
     {"'e'", "overlap", "'ok'"}},
};

INSTANTIATE_TEST_SUITE_P(Cases, SafetensorsMalformedTest, ::testing::ValuesIn(kMalformed),
                         [](const auto& info) { return std::string(info.param.label); });

TEST_F(SafetensorsTest, AcceptsEmptyTensorsAtBoundariesAndNullMetadata) {
  // Zero-byte tensors own no range: one may share its offset with a neighbour's boundary, as files
  // written by the reference implementation do. A null __metadata__ means no metadata.
  const std::string path = write_raw("empty_ok.safetensors", R"({"__metadata__": null,
      "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "e": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]},
      "b": {"dtype": "U8", "shape": [2], "data_offsets": [8, 10]},
      "z": {"dtype": "BF16", "shape": [3, 0], "data_offsets": [10, 10]}})",
                                     10);
  SafetensorsFile reader = SafetensorsFile::open(path);
  ASSERT_EQ(reader.entries().size(), 4u);
  EXPECT_EQ(reader.entries()[0].name, "a");  // data-section order
  EXPECT_EQ(reader.entries()[2].name, "b");
  EXPECT_EQ(reader.read("e").numel(), 0);
  EXPECT_TRUE(reader.metadata().empty());
}

TEST_F(SafetensorsTest, ReadsTensorsListedOutOfOffsetOrder) {
  // The header's key order need not follow the data order; every tensor reads its own bytes.
  std::string path = file("unordered.safetensors");
  {
    const std::string header = R"({"z": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
        "a": {"dtype": "U8", "shape": [3], "data_offsets": [2, 5]}})";
    std::ofstream out(path, std::ios::binary);
    uint64_t length = header.size();
    out.write(reinterpret_cast<const char*>(&length), 8);
    out << header << std::string("\x01\x02\x03\x04\x05", 5);
  }
  SafetensorsFile reader = SafetensorsFile::open(path);
  EXPECT_EQ(reader.entries()[0].name, "z");
  Tensor a = reader.read("a");
  EXPECT_EQ(a.data<uint8_t>()[0], 3);
  EXPECT_EQ(a.data<uint8_t>()[2], 5);
}

// ---- Golden fixtures from tests/reference/llama_twin.py --------------------------------------------------

struct FixtureCase {
  const char* name;
};

class LlamaFixtureTest : public ::testing::TestWithParam<FixtureCase> {};

TEST_P(LlamaFixtureTest, HoldsEveryExpectedTensor) {
  const std::string base = std::string(FORGE_FIXTURE_DIR) + "/" + GetParam().name;
  std::ifstream config_stream(base + ".config.json");
  ASSERT_TRUE(config_stream) << base << ".config.json";
  const auto config = nlohmann::json::parse(config_stream);
  const int64_t vocab = config["vocab_size"], hidden = config["hidden_size"];
  const int64_t inter = config["intermediate_size"], layers = config["num_hidden_layers"];
  const int64_t heads = config["num_attention_heads"], kv_heads = config["num_key_value_heads"];
  const int64_t head_dim = config["head_dim"];
  const bool tied = config["tie_word_embeddings"];
  EXPECT_EQ(config["architectures"][0], "LlamaForCausalLM");

  SafetensorsFile st = SafetensorsFile::open(base + ".safetensors");
  std::vector<std::pair<std::string, Shape>> params = {{"model.embed_tokens.weight", {vocab, hidden}},
                                                       {"model.norm.weight", {hidden}}};
  if (!tied) params.push_back({"lm_head.weight", {vocab, hidden}});
  for (int64_t i = 0; i < layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    params.push_back({p + "self_attn.q_proj.weight", {heads * head_dim, hidden}});
    params.push_back({p + "self_attn.k_proj.weight", {kv_heads * head_dim, hidden}});
    params.push_back({p + "self_attn.v_proj.weight", {kv_heads * head_dim, hidden}});
    params.push_back({p + "self_attn.o_proj.weight", {hidden, heads * head_dim}});
    params.push_back({p + "mlp.gate_proj.weight", {inter, hidden}});
    params.push_back({p + "mlp.up_proj.weight", {inter, hidden}});
    params.push_back({p + "mlp.down_proj.weight", {hidden, inter}});
    params.push_back({p + "input_layernorm.weight", {hidden}});
    params.push_back({p + "post_attention_layernorm.weight", {hidden}});
  }
  if (tied) {
    EXPECT_EQ(st.find("lm_head.weight"), nullptr);
  }
  for (const auto& [name, shape] : params)
    for (const std::string prefix : {"", "grad.", "final."}) {
      const SafetensorsEntry* entry = st.find(prefix + name);
      ASSERT_NE(entry, nullptr) << prefix + name;
      EXPECT_EQ(entry->dtype, DType::f32) << prefix + name;
      EXPECT_EQ(entry->shape, shape) << prefix + name;
    }

  const SafetensorsEntry* ids = st.find("input_ids");
  ASSERT_NE(ids, nullptr);
  ASSERT_EQ(ids->shape.size(), 2u);
  const int64_t batch = ids->shape[0], seq = ids->shape[1];
  EXPECT_EQ(ids->dtype, DType::i32);
  for (const char* name : {"labels", "step0.input_ids", "step0.labels", "step1.input_ids", "step1.labels",
                           "step2.input_ids", "step2.labels"}) {
    ASSERT_NE(st.find(name), nullptr) << name;
    EXPECT_EQ(st.find(name)->dtype, DType::i32) << name;
    EXPECT_EQ(st.find(name)->shape, Shape({batch, seq})) << name;
  }
  ASSERT_NE(st.find("logits"), nullptr);
  EXPECT_EQ(st.find("logits")->shape, Shape({batch, seq, vocab}));
  ASSERT_NE(st.find("loss"), nullptr);
  EXPECT_EQ(st.find("loss")->shape, Shape({1}));
  ASSERT_NE(st.find("adamw.losses"), nullptr);
  EXPECT_EQ(st.find("adamw.losses")->shape, Shape({3}));
  for (const char* key : {"lr", "beta1", "beta2", "eps", "weight_decay", "max_grad_norm"})
    EXPECT_TRUE(st.metadata().count(key)) << key;

  // The stored loss must be the mean cross-entropy of the stored logits over the non-ignored labels:
  // recomputed here in double, this ties the fixture's pieces together.
  Tensor logits = st.read("logits"), labels = st.read("labels");
  double total = 0;
  int64_t counted = 0;
  for (int64_t t = 0; t < batch * seq; ++t) {
    const int32_t label = labels.data<int32_t>()[t];
    if (label == -100) continue;
    ASSERT_TRUE(label >= 0 && label < vocab) << label;
    const float* row = logits.data<float>() + t * vocab;
    double max = row[0], sum = 0;
    for (int64_t v = 0; v < vocab; ++v) max = std::max<double>(max, row[v]);
    for (int64_t v = 0; v < vocab; ++v) sum += std::exp(row[v] - max);
    total += max + std::log(sum) - row[label];
    ++counted;
  }
  EXPECT_LT(counted, batch * seq) << "some labels should be ignored (-100)";
  EXPECT_NEAR(st.read("loss").data<float>()[0], total / counted, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, LlamaFixtureTest,
                         ::testing::Values(FixtureCase{"llama_tiny"}, FixtureCase{"llama_tiny_tied_llama3"}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace forge::safetensors_test
