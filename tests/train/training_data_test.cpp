// The trainer's data: tokenizer choice (bytes, a BPE trained on the corpus and cached, a tokenizer.json),
// the byte accounting behind bits per byte, and a short BPE training run end to end.
#include "forge/train/training_data.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "forge/ckpt/safetensors.h"
#include "forge/data/text/indexed_dataset.h"
#include "forge/data/text/sft_data.h"
#include "forge/data/text/text_corpus.h"
#include "forge/models/llama/llama_model.h"
#include "forge/models/pretrained.h"
#include "forge/train/trainer.h"
#include "op_harness.h"
#include "train/toy_run.h"

namespace forge::training_data_test {
using namespace forge::optim;
using namespace forge::models;
using namespace forge::data;
using namespace forge::ckpt;
using namespace forge::train;
namespace {
namespace fs = std::filesystem;
using forge::testing::expect_error_containing;

class TrainingDataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = toy::fresh_test_dir("forge_training_data_test");
    std::ofstream corpus(dir_ / "corpus.txt");
    for (int i = 0; i < 300; ++i)
      corpus << "In the beginning was the word " << i % 17 << ", and the wörd was with the light — ☀.\n";
  }
  void TearDown() override { fs::remove_all(dir_); }

  TrainConfig config(const std::string& run) const {
    TrainConfig c;
    c.model.config = (dir_ / "config.json").string();
    c.data.corpus = (dir_ / "corpus.txt").string();
    c.data.tokenizer = "train";
    c.data.vocab_size = 300;
    c.data.cache_dir = (dir_ / "cache").string();
    c.data.seq_len = 32;
    c.data.heldout_fraction = 0.1;
    c.train.micro_batch = 2;
    c.train.steps = 20;
    c.train.warmup = 2;
    c.train.lr = 1e-2;
    c.train.min_lr = 1e-3;
    c.eval.every = 0;
    c.log.every = 100;
    c.log.peak_gflops = 100;
    c.log.run_dir = (dir_ / run).string();
    c.sample.tokens = 0;
    return c;
  }
  void write_model(int64_t vocab) const {
    std::ofstream model(dir_ / "config.json");
    model << R"({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "max_position_embeddings": 64, "vocab_size": )"
          << vocab << "}";
  }
  fs::path dir_;
};

int64_t byte_count(const TextCodec& codec, const std::vector<int32_t>& ids) {
  int64_t bytes = 0;
  for (int32_t id : ids) bytes += codec.byte_length(id);
  return bytes;
}

// Every byte of the text is in exactly one token, so summing token byte lengths gives the text's bytes:
// that is what turns a loss per token into bits per byte.
TEST_F(TrainingDataTest, TrainedBpeCoversEveryByteAndIsCached) {
  const TrainConfig c = config("unused");
  const std::string text = load_text_file(c.data.corpus);
  const TextSplit split = split_heldout(text, c.data.heldout_fraction, c.data.heldout_parts);
  CorpusTokens corpus = prepare_corpus(c);
  EXPECT_EQ(corpus.codec.vocab_size(), 300);
  EXPECT_EQ(corpus.codec.decode(corpus.train), split.train);
  EXPECT_EQ(corpus.codec.decode(corpus.heldout), split.heldout);
  EXPECT_EQ(byte_count(corpus.codec, corpus.train), corpus.train_bytes);
  EXPECT_EQ(byte_count(corpus.codec, corpus.heldout), corpus.heldout_bytes);
  EXPECT_EQ(corpus.train_bytes, static_cast<int64_t>(split.train.size()));
  EXPECT_LT(corpus.train.size() * 2, split.train.size());  // merges compress this repetitive text > 2x
  ASSERT_TRUE(corpus.codec.eos_id().has_value());
  EXPECT_EQ(corpus.codec.byte_length(*corpus.codec.eos_id()), 0);

  // The tokenizer is learnt on the training split only and cached under a name that fingerprints it.
  const fs::path cached = trained_tokenizer_path(c, split.train);
  ASSERT_TRUE(fs::exists(cached));
  const auto written = fs::last_write_time(cached);
  CorpusTokens again = prepare_corpus(c);
  EXPECT_EQ(fs::last_write_time(cached), written);
  EXPECT_EQ(again.train, corpus.train);
  TrainConfig other = c;
  other.data.vocab_size = 280;
  EXPECT_NE(trained_tokenizer_path(other, split.train), cached);
  EXPECT_NE(trained_tokenizer_path(c, split.train + "x"), cached);

  // A tokenizer.json given by path is used as is.
  TrainConfig by_path = c;
  by_path.data.tokenizer = cached.string();
  EXPECT_EQ(prepare_corpus(by_path).train, corpus.train);
}

TEST_F(TrainingDataTest, BytesCodecIsTheIdentity) {
  TrainConfig c = config("unused");
  c.data.tokenizer = "bytes";
  CorpusTokens corpus = prepare_corpus(c);
  EXPECT_EQ(corpus.codec.vocab_size(), 256);
  EXPECT_EQ(static_cast<int64_t>(corpus.train.size()), corpus.train_bytes);
  EXPECT_EQ(corpus.train[0], 'I');
  EXPECT_FALSE(corpus.codec.eos_id().has_value());
  EXPECT_FALSE(fs::exists(dir_ / "cache"));
}

TEST_F(TrainingDataTest, BadTokenizerSettingsAreRefused) {
  TrainConfig missing = config("unused");
  missing.data.tokenizer = (dir_ / "absent.json").string();
  expect_error_containing([&] { prepare_corpus(missing); }, {"absent.json"});

  write_model(256);  // smaller than the 300-token tokenizer
  expect_error_containing([&] { Trainer(config("small")).run(); },
                          {"vocab_size 256 is smaller than the 300 tokens"});

  TrainConfig tiny = config("unused");
  tiny.data.vocab_size = 100;
  expect_error_containing([&] { tiny.validate(); }, {"data.vocab_size"});
}

TEST_F(TrainingDataTest, TrainsOnBpeTokensAndReportsBitsPerByte) {
  write_model(300);
  TrainConfig c = config("bpe");
  c.sample.tokens = 8;
  c.sample.prompt = "In the";
  TrainResult r = Trainer(c).run();
  ASSERT_EQ(r.losses.size(), 20u);
  EXPECT_LT(r.losses.back(), r.losses.front());
  // Loss per token over bytes per token: with > 1 byte per token, bits per byte is below nats per token /
  // ln 2.
  EXPECT_GT(r.heldout_bits_per_byte, 0);
  EXPECT_LT(r.heldout_bits_per_byte, r.heldout_loss / std::log(2.0));
  EXPECT_EQ(r.sample.rfind("In the", 0), 0u);
  // The checkpoint carries its tokenizer.
  EXPECT_EQ(Tokenizer::from_file(toy::latest_checkpoint(c) / "tokenizer.json").to_json(),
            Tokenizer::from_file(
                trained_tokenizer_path(c, split_heldout(load_text_file(c.data.corpus),
                                                        c.data.heldout_fraction, c.data.heldout_parts)
                                              .train))
                .to_json());
  EXPECT_GT(r.sample.size(), 6u);
}

// model.init_from: the run starts from a Hugging Face folder's weights (and architecture). With a
// vanishing learning rate one step leaves them as they were, so the final checkpoint equals the folder.
TEST_F(TrainingDataTest, InitFromAHuggingFaceFolder) {
  write_model(300);
  LlamaModel source(LlamaConfig::from_json_file((dir_ / "config.json").string()), {});
  source.initialize(99);
  nlohmann::json config_json = source.config().to_json();
  export_hugging_face(source.params(), config_json, dir_ / "hf", {});

  TrainConfig c = config("init");
  c.model.config = (dir_ / "absent.json").string();  // ignored: the architecture comes from init_from
  c.model.init_from = (dir_ / "hf").string();
  c.train.steps = 1;
  c.train.warmup = 0;
  c.train.lr = 1e-20;
  c.train.min_lr = 0;
  Trainer(c).run();
  SafetensorsFile saved =
      SafetensorsFile::open((toy::latest_checkpoint(c) / "shard-00000-of-00001.safetensors").string());
  for (int id = 0; id < source.params().count(); ++id) {
    const std::string& name = source.params().info(id).name;
    Tensor expected = source.params().param(id), got = saved.read_f32(name);
    ASSERT_EQ(got.numel(), expected.numel()) << name;
    for (int64_t i = 0; i < got.numel(); ++i)
      ASSERT_NEAR(got.data<float>()[i], expected.data<float>()[i],
                  1e-6f * std::abs(expected.data<float>()[i]))
          << name << "[" << i << "]";
  }

  TrainConfig missing = config("init2");
  missing.model.init_from = (dir_ / "nowhere").string();
  expect_error_containing([&] { Trainer(missing).run(); }, {"nowhere"});
}

// data.dataset: training reads a blend of Megatron indexed datasets (train split), evaluation the
// valid split; byte tokens here, so bits per byte is the loss in bits.
TEST_F(TrainingDataTest, TrainsOnABlendOfMegatronDatasets) {
  write_model(256);
  for (const char* name : {"a", "b"}) {
    IndexedDatasetWriter writer((dir_ / name).string(), IndexedDType::u16);
    for (int doc = 0; doc < 40; ++doc) {
      std::string text = fmt::format("Document {} of {}: and the light shone in the darkness.\n", doc, name);
      std::vector<int32_t> tokens(text.begin(), text.end());
      writer.add_document(tokens);
    }
    writer.finalize();
  }
  TrainConfig c = config("blend");
  c.data.tokenizer = "bytes";
  c.data.dataset = fmt::format("0.75 {} 0.25 {}", (dir_ / "a").string(), (dir_ / "b").string());
  c.data.split = "90,10,0";
  TrainResult first = Trainer(c).run();
  ASSERT_EQ(first.losses.size(), 20u);
  EXPECT_LT(first.losses.back(), first.losses.front());
  EXPECT_NEAR(first.heldout_bits_per_byte, first.heldout_loss / std::log(2.0), 1e-9);
  c.log.run_dir = (dir_ / "blend2").string();
  EXPECT_EQ(Trainer(c).run().losses, first.losses);  // data order depends only on the seed

  // Shuffled, sample 0 is some window of a; in order, it is the start of a's first document.
  const std::string first_document = "Document 0 of a: and the light shone in the darkness.\n";
  auto first_window = [&](const TrainConfig& config) {
    std::unique_ptr<TrainingData> data = open_training_data(config);
    std::vector<int32_t> ids(32), targets(32);
    data->train_batch(0, 1, ids.data(), targets.data());
    return std::string(ids.begin(), ids.end());
  };
  EXPECT_NE(first_window(c), first_document.substr(0, 32));
  TrainConfig sequential = c;
  sequential.data.order = "sequential";
  EXPECT_EQ(first_window(sequential), first_document.substr(0, 32));

  TrainConfig trained_tokenizer = c;
  trained_tokenizer.data.tokenizer = "train";
  expect_error_containing([&] { Trainer(trained_tokenizer).run(); }, {"data.dataset", "data.tokenizer"});
  TrainConfig missing = c;
  missing.data.dataset = (dir_ / "nothing").string();
  expect_error_containing([&] { Trainer(missing).run(); }, {"nothing"});
}

// A token id beyond the tokenizer's vocabulary (a dataset preprocessed with another tokenizer, or a corrupt
// file) names the .bin file, the document, the position and the id, not just "token id ... at position ...".
TEST_F(TrainingDataTest, DatasetTokensOutsideTheVocabularyNameTheFile) {
  {
    IndexedDatasetWriter writer((dir_ / "wide").string(), IndexedDType::u16);
    std::vector<int32_t> tokens(200, 'a');
    tokens[77] = 300;  // outside "bytes"' 256
    writer.add_document(tokens);
    writer.add_document(std::vector<int32_t>(100, 'b'));  // the held-out part
    writer.finalize();
  }
  TrainConfig c = config("wide");
  c.data.tokenizer = "bytes";
  c.data.dataset = (dir_ / "wide").string();
  c.data.split = "50,50,0";
  c.data.order = "sequential";
  std::unique_ptr<TrainingData> data = open_training_data(c);
  std::vector<int32_t> ids(4 * 32), targets(4 * 32);
  expect_error_containing(
      [&] { data->train_batch(0, 4, ids.data(), targets.data()); },
      {(dir_ / "wide.bin").string() + ": document 0, position 77: token id 300 is outside the "
                                      "vocabulary of the tokenizer bytes",
       "[0, 256)"});
}

// Supervised fine-tuning data: a folder with the tokenizer (Qwen's vocabulary) and a ChatML template with
// {% generation %} blocks, and conversations whose answer is a function of the question.
class SftDataTest : public TrainingDataTest {
 protected:
  void SetUp() override {
    TrainingDataTest::SetUp();
    write_model(2048);
    fs::create_directories(dir_ / "tok");
    fs::copy_file(fs::path(FORGE_FIXTURE_DIR) / "tokenizer" / "families" / "qwen3.tokenizer.json",
                  dir_ / "tok" / "tokenizer.json");
    const nlohmann::ordered_json fixture =
        nlohmann::ordered_json::parse(forge::testing::read_file(testing::fixture("chat/sft_masks.json")));
    for (const auto& setup : fixture)
      if (setup["name"] == "chatml_generation")
        std::ofstream(dir_ / "tok" / "tokenizer_config.json") << setup["tokenizer_config"].dump();
    std::ofstream sft(dir_ / "sft.jsonl");
    const char* words[] = {"light", "water", "earth", "heaven", "day", "night", "sea", "tree"};
    for (int i = 0; i < 40; ++i) {
      nlohmann::ordered_json row;
      const std::string w = words[i % 8];
      row["messages"] = {{{"role", "user"}, {"content", "Which word? " + w}},
                         {{"role", "assistant"}, {"content", w}}};
      sft << row.dump() << "\n";
    }
  }
  TrainConfig sft_config(const std::string& run) const {
    TrainConfig c = config(run);
    c.data.tokenizer = (dir_ / "tok" / "tokenizer.json").string();
    c.data.sft = (dir_ / "sft.jsonl").string();
    c.data.heldout_fraction = 0.2;
    return c;
  }
};

// One conversation per sequence: each epoch serves every training conversation once, in an order drawn from
// the seed, with the held-out tail (the last 20%) kept apart; the rows are those of data::SftDataset.
TEST_F(SftDataTest, ServesEachConversationOncePerEpoch) {
  const TrainConfig c = sft_config("serve");
  const std::unique_ptr<TrainingData> data = open_training_data(c);
  EXPECT_NE(data->describe().find("32 training conversations, 8 held out"), std::string::npos)
      << data->describe();
  EXPECT_EQ(data->heldout_windows(), 8);
  const ChatTemplate chat = ChatTemplate::from_folder(dir_ / "tok");
  SftOptions o;
  o.seq_len = c.data.seq_len;
  const SftDataset set = SftDataset::from_jsonl(c.data.sft, chat, *data->codec().tokenizer(), o);
  const int64_t t = c.data.seq_len;
  std::vector<int32_t> ids(32 * t), targets(32 * t), want_ids(t), want_targets(t);
  data->train_batch(0, 32, ids.data(), targets.data());
  std::vector<int> seen(40, 0);
  for (int64_t r = 0; r < 32; ++r)
    for (int64_t k = 0; k < 40; ++k) {
      set.fill(k, want_ids.data(), want_targets.data());
      if (std::equal(want_ids.begin(), want_ids.end(), ids.begin() + r * t) &&
          std::equal(want_targets.begin(), want_targets.end(), targets.begin() + r * t)) {
        ++seen[k];
        break;
      }
    }
  // Conversations k and k + 8 are the same text: count by word.
  for (int w = 0; w < 8; ++w) EXPECT_EQ(seen[w], 4) << w;
  std::vector<int32_t> heldout(t), heldout_targets(t);
  data->heldout_batch(0, 1, heldout.data(), heldout_targets.data());
  set.fill(32, want_ids.data(), want_targets.data());
  EXPECT_EQ(heldout, want_ids);
  EXPECT_EQ(heldout_targets, want_targets);
}

// Packed, the conversations fill fewer sequences and train as well: each attends only to itself.
TEST_F(SftDataTest, PackedConversationsTrain) {
  TrainConfig c = sft_config("packed");
  c.data.sft_pack = true;
  c.data.seq_len = 64;  // several conversations a sequence
  c.train.steps = 30;
  const std::unique_ptr<TrainingData> data = open_training_data(c);
  EXPECT_NE(data->describe().find("sequences packing 32 conversations"), std::string::npos)
      << data->describe();
  std::vector<int64_t> documents;
  data->train_documents(0, 2, documents);
  int64_t rows = 0;
  for (const int64_t d : documents) rows += d;
  EXPECT_EQ(rows, 2 * c.data.seq_len);
  EXPECT_GT(documents.size(), 2u);
  const TrainResult r = Trainer(c).run();
  EXPECT_LT(r.losses.back(), 0.5 * r.losses.front());
  EXPECT_LT(r.heldout_loss, 0.5 * r.losses.front());
}

// Pretraining documents end at each end-of-sequence token (and at the end of the sequence).
TEST(DocumentMask, DocumentsEndAfterEachEos) {
  const std::vector<int32_t> ids = {1, 2, 9, 3, 9, 9, 4, 5, /**/ 9, 1, 2, 3, 4, 5, 6, 9};
  EXPECT_EQ(documents_at_eos(ids.data(), 2, 8, 9), (std::vector<int64_t>{3, 2, 1, 2, 1, 7}));
}

// Pretraining with document masks: a corpus whose documents end with <|endoftext|> (the trained BPE's
// end-of-sequence token) trains with attention cut there; a codec without an end-of-sequence token, and
// context parallelism, are refused in one line.
TEST_F(TrainingDataTest, DocumentMaskedPretraining) {
  {
    std::ofstream corpus(dir_ / "corpus.txt");
    for (int i = 0; i < 300; ++i) corpus << "The word " << i % 17 << " was with the light.<|endoftext|>\n";
  }
  write_model(300);
  TrainConfig c = config("masked");
  c.data.document_mask = true;
  c.train.steps = 10;
  const TrainResult r = Trainer(c).run();
  EXPECT_LT(r.losses.back(), r.losses.front());
  TrainConfig bytes = config("bytes");
  bytes.data.document_mask = true, bytes.data.tokenizer = "bytes";
  expect_error_containing([&] { Trainer(bytes).run(); }, {"data.document_mask", "end-of-sequence"});
}

// Training on the conversations learns the answers: the held-out loss (over the answers' tokens) falls far
// below the untrained model's; sft_loss = all trains on the questions' tokens too. Misconfigurations are one
// line naming the key.
TEST_F(SftDataTest, TrainsOnTheAnswers) {
  TrainConfig c = sft_config("sft");
  c.train.steps = 150;
  c.train.micro_batch = 8;
  c.sample.answers = 8;
  const TrainResult r = Trainer(c).run();
  ASSERT_EQ(r.losses.size(), 150u);
  EXPECT_LT(r.losses.back(), 0.5 * r.losses.front());
  EXPECT_LT(r.heldout_loss, 0.5 * r.losses.front());
  // The held-out questions' answers, greedily (the words were seen in training): most come out exactly.
  EXPECT_EQ(r.captions, 8);
  EXPECT_GE(r.captions_exact, 6);
  TrainConfig all = sft_config("all");
  all.data.sft_loss = SftLoss::all;
  EXPECT_NE(open_training_data(all)->describe().find("every token"), std::string::npos);
  // Fine-tuning a checkpoint: without data.tokenizer, the checkpoint's own tokenizer.json.
  TrainConfig again = sft_config("again");
  again.data.tokenizer = "train", again.model.init_from = (dir_ / "sft" / "checkpoint").string();
  again.data.chat_template = (dir_ / "tok").string();
  EXPECT_NE(open_training_data(again)->describe().find("checkpoint"), std::string::npos);
  TrainConfig bytes = sft_config("bytes");
  bytes.data.tokenizer = "bytes";
  expect_error_containing([&] { open_training_data(bytes); }, {"data.sft", "data.tokenizer"});
  TrainConfig missing = sft_config("missing");
  missing.data.chat_template = (dir_ / "nowhere").string();
  expect_error_containing([&] { open_training_data(missing); }, {"nowhere", "neither a folder nor a file"});
}

}  // namespace
}  // namespace forge::training_data_test
