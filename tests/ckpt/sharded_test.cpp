// Sharded checkpoints in one process: the ranks of a layout are simulated by writing each rank's shard with
// write_checkpoint_shard and the manifest with write_checkpoint_manifest, and by loading each rank's
// pieces with a one-rank communicator (loading needs no peers). Every saved layout is loaded under every
// other, element by element; then the single-process API, errors, stale files and version 1.
// Multi-process saves and loads: sharded_mpi_test.cpp.
#include "forge/ckpt/sharded.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <zlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "ckpt/sharded_test_util.h"
#include "forge/ckpt/checkpoint.h"
#include "forge/ckpt/safetensors.h"
#include "forge/models/pretrained.h"
#include "forge/optim/adamw.h"
#include "models/pretrained_test_util.h"
#include "op_harness.h"

namespace forge::sharded_test {
using namespace forge::optim;
using namespace forge::models;
using namespace forge::ckpt;
namespace {

namespace fs = std::filesystem;
using namespace sharded_testing;
using nlohmann::json;
using testing::expect_error_containing;

class ShardedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "forge_sharded_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    self_ = comm::make_self();
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // Saves the toy state as `layout` would, one simulated rank after the other. `drop(rank, name)`
  // leaves a piece out (to make holes).
  template <typename Drop>
  void save_as(const std::string& dir, const SimLayout& layout, const std::vector<SimTensor>& tensors,
               Drop drop) {
    const std::string staging = begin_checkpoint_save(dir);
    std::vector<ShardFile> shards;
    for (int r = 0; r < layout.world(); ++r) {
      std::vector<LocalTensor> locals = rank_tensors(tensors, layout, r % layout.tp, r / layout.tp, true);
      std::vector<ShardPiece> pieces;
      for (LocalTensor& l : locals)
        if (!drop(r, l.tensor.name)) pieces.push_back(l.piece());
      shards.push_back(write_checkpoint_shard(staging, r, layout.world(), pieces));
    }
    CheckpointState state;
    state.step = 7;
    state.layout = layout.json();
    state.extra = {{"tokens_seen", 1234}};
    write_checkpoint_manifest(staging, shards, state);
    commit_checkpoint(staging, dir);
  }
  void save_as(const std::string& dir, const SimLayout& layout, const std::vector<SimTensor>& tensors) {
    save_as(dir, layout, tensors, [](int, const std::string&) { return false; });
  }

  // Loads every simulated rank of `layout` and checks each element.
  void load_and_check(const std::string& dir, const SimLayout& layout, const std::vector<SimTensor>& tensors,
                      const std::string& context) {
    for (int r = 0; r < layout.world(); ++r) {
      std::vector<LocalTensor> locals = rank_tensors(tensors, layout, r % layout.tp, r / layout.tp, false);
      std::vector<ShardPiece> pieces = pieces_of(locals);
      const CheckpointState state = load_sharded_checkpoint(dir, *self_, pieces);
      EXPECT_EQ(state.step, 7);
      expect_loaded(locals, context + " rank " + std::to_string(r));
    }
  }

  // Loads the toy state as one whole-tensor rank would (tp 1, no ZeRO).
  void load_whole(const std::string& dir, const std::vector<SimTensor>& tensors) {
    std::vector<LocalTensor> locals = rank_tensors(tensors, SimLayout{}, 0, 0, false);
    std::vector<ShardPiece> pieces = pieces_of(locals);
    load_sharded_checkpoint(dir, *self_, pieces);
  }

  std::set<std::string> files_in(const std::string& dir) const {
    std::set<std::string> names;
    for (const auto& entry : fs::directory_iterator(dir)) names.insert(entry.path().filename().string());
    return names;
  }

  fs::path dir_;
  std::unique_ptr<comm::Communicator> self_;
};

// tp 2 -> 1, 1 -> 2, 2 -> 4 with dp 2 ZeRO ranges, padded vocabulary rows (10 rows over 3 or 4 ranks),
// column and middle-dimension splits: every saved layout loads under every other, bit for bit.
TEST_F(ShardedTest, EveryLayoutLoadsUnderEveryOther) {
  const std::vector<SimLayout> layouts = {{1, 1, false}, {2, 1, false}, {3, 1, false}, {4, 1, false},
                                          {2, 2, true},  {4, 2, true},  {1, 3, true},  {2, 3, false}};
  const std::vector<SimTensor> tensors = toy_tensors();
  for (const SimLayout& saved : layouts) {
    const std::string dir = path(saved.label());
    save_as(dir, saved, tensors);
    const CheckpointState state = read_checkpoint_manifest(dir);
    EXPECT_EQ(state.world_size, saved.world());
    EXPECT_EQ(state.layout, saved.json());
    EXPECT_EQ(state.extra, json({{"tokens_seen", 1234}}));
    for (const SimLayout& loaded : layouts)
      load_and_check(dir, loaded, tensors, saved.label() + " -> " + loaded.label());
  }
}

// The collective entry point with a one-rank world writes the same format.
TEST_F(ShardedTest, CollectiveSaveWithOneRank) {
  const std::vector<SimTensor> tensors = toy_tensors();
  std::vector<LocalTensor> locals = rank_tensors(tensors, SimLayout{}, 0, 0, true);
  std::vector<ShardPiece> pieces = pieces_of(locals);
  CheckpointState state;
  state.step = 7;
  save_sharded_checkpoint(path("one"), *self_, pieces, state);
  EXPECT_EQ(files_in(path("one")),
            (std::set<std::string>{"manifest.json", "shard-00000-of-00001.safetensors"}));
  for (const SimLayout& layout : {SimLayout{1, 1, false}, SimLayout{4, 2, true}})
    load_and_check(path("one"), layout, tensors, "one rank -> " + layout.label());
}

TEST_F(ShardedTest, ManifestListsFilesAndPieces) {
  const SimLayout layout{2, 2, true};
  save_as(path("m"), layout, toy_tensors());
  const json manifest = pretrained_testing::read_json(path("m") + "/manifest.json");
  EXPECT_EQ(manifest["format"], "forge-checkpoint");
  EXPECT_EQ(manifest["version"], 3);
  EXPECT_EQ(manifest["step"], 7);
  EXPECT_EQ(manifest["world_size"], 4);
  EXPECT_EQ(manifest["layout"], layout.json());
  EXPECT_FALSE(manifest.contains("optimizer_steps"));
  ASSERT_EQ(manifest["files"].size(), 4u);
  for (int r = 0; r < 4; ++r) {
    const std::string file = shard_file_name(r, 4);
    ASSERT_TRUE(manifest["files"].contains(file)) << file;
    EXPECT_EQ(manifest["files"][file]["bytes"].get<uint64_t>(), fs::file_size(path("m") + "/" + file));
  }
  const json& embed = manifest["tensors"]["model.embed_tokens.weight"];
  EXPECT_EQ(embed["shape"], json({10, 6}));
  ASSERT_EQ(embed["pieces"].size(), 4u);  // 2 tp slices x 2 ZeRO ranges
  const json& first = embed["pieces"][0];
  EXPECT_EQ(first["file"], "shard-00000-of-00004.safetensors");
  EXPECT_EQ(first["local_shape"], json({5, 6}));
  EXPECT_EQ(first["split_dim"], 0);
  EXPECT_EQ(first["split_start"], 0);
  EXPECT_EQ(first["flat_begin"], 0);
  EXPECT_EQ(first["flat_end"], 16);  // the odd ZeRO cut: 30 * 1/2 + 1
  EXPECT_EQ(embed["pieces"][3]["split_start"], 5);
  EXPECT_EQ(embed["pieces"][3]["flat_begin"], 16);
  // The replicated norm comes from tp rank 0 only (ranks 0 and 2 hold its two ZeRO ranges).
  const json& norm = manifest["tensors"]["model.norm.weight"];
  ASSERT_EQ(norm["pieces"].size(), 2u);
  EXPECT_EQ(norm["pieces"][0]["split_dim"], -1);
  EXPECT_EQ(norm["pieces"][1]["file"], "shard-00002-of-00004.safetensors");

  // Each shard holds its pieces as 1-D fp32 tensors under the tensor names.
  SafetensorsFile shard = SafetensorsFile::open(path("m") + "/shard-00003-of-00004.safetensors");
  const SafetensorsEntry* piece = shard.find("model.embed_tokens.weight");
  ASSERT_NE(piece, nullptr);
  EXPECT_EQ(piece->dtype, DType::f32);
  EXPECT_EQ(piece->shape, (Shape{30 - 16}));
  EXPECT_EQ(shard.find("model.norm.weight"), nullptr);
}

// The single-process API on the sharded format: weights, both AdamW moments and the step count come
// back bit for bit.
TEST_F(ShardedTest, ModelAndOptimizerRoundTripIsBitwise) {
  auto model = pretrained_testing::tiny_model(false, 5);
  AdamW optimizer(&model->params(), AdamWConfig{});
  for (int64_t i = 0; i < optimizer.exp_avg().numel(); ++i) {
    optimizer.exp_avg().f32()[i] = global_value("m", i);
    optimizer.exp_avg_sq().f32()[i] = std::abs(global_value("v", i));
  }
  optimizer.set_steps_taken(5);
  CheckpointState state;
  state.step = 5;
  state.model_config = model->config().to_json();
  state.extra = {{"reason", "test"}};
  save_checkpoint(path("ckpt"), model->params(), &optimizer.moments(), state);
  EXPECT_EQ(files_in(path("ckpt")),
            (std::set<std::string>{"manifest.json", "shard-00000-of-00001.safetensors"}));
  EXPECT_TRUE(checkpoint_exists(path("ckpt")));

  auto other = pretrained_testing::tiny_model(false, 6);
  AdamW other_optimizer(&other->params(), AdamWConfig{});
  const CheckpointState loaded = load_checkpoint(path("ckpt"), other->params(), &other_optimizer.moments());
  EXPECT_EQ(loaded.step, 5);
  EXPECT_EQ(loaded.optimizer_steps, 5);
  EXPECT_EQ(loaded.world_size, 1);
  EXPECT_EQ(loaded.extra, state.extra);
  EXPECT_EQ(loaded.model_config, state.model_config);
  EXPECT_EQ(other_optimizer.steps_taken(), 5);
  EXPECT_TRUE(pretrained_testing::bitwise_equal(other->params(), model->params()));
  EXPECT_EQ(
      std::memcmp(other_optimizer.exp_avg().raw(), optimizer.exp_avg().raw(), optimizer.exp_avg().bytes()),
      0);
  EXPECT_EQ(std::memcmp(other_optimizer.exp_avg_sq().raw(), optimizer.exp_avg_sq().raw(),
                        optimizer.exp_avg_sq().bytes()),
            0);

  // Saving the same state again gives the same bytes (no timestamps, no save ids).
  save_checkpoint(path("again"), model->params(), &optimizer.moments(), state);
  for (const char* file : {"manifest.json", "shard-00000-of-00001.safetensors"})
    EXPECT_EQ(pretrained_testing::read_file(path("ckpt") + "/" + file),
              pretrained_testing::read_file(path("again") + "/" + file))
        << file;

  // A save that records no AdamW count (the collective entry point, as a trainer may call it): the
  // optimizer resumes at the training step.
  state.step = 4;
  save_sharded_checkpoint(path("no_count"), *self_,
                          parameter_store_pieces(model->params(), &optimizer.moments(), true), state);
  EXPECT_EQ(read_checkpoint_manifest(path("no_count")).optimizer_steps, -1);
  load_checkpoint(path("no_count"), other->params(), &other_optimizer.moments());
  EXPECT_EQ(other_optimizer.steps_taken(), 4);

  // Weights only: no optimizer state, and asking for it says so.
  save_checkpoint(path("weights"), model->params(), nullptr, state);
  EXPECT_EQ(read_checkpoint_manifest(path("weights")).optimizer_steps, -1);
  expect_error_containing(
      [&] { load_checkpoint(path("weights"), other->params(), &other_optimizer.moments()); },
      {"weights", "holds no optimizer state"});
  load_checkpoint(path("weights"), other->params(), nullptr);
}

// A parameter store split as tensor parallelism splits it (a padded row split, a replicated non-primary
// copy) saves its primary pieces; loading into a whole store gives the model initialised unsplit.
TEST_F(ShardedTest, ParameterStoresSplitOverRanksLoadAsOneModel) {
  auto build = [](int tp_rank, int tp) {
    auto store = std::make_unique<ParameterStore>();
    if (tp == 1) {
      store->add("w", {5, 4}, true, Init::normal);
      store->add("n", {4}, false, Init::normal);
    } else {
      store->add("w", {3, 4}, true, Init::normal, 0.02f, ShardSpec{0, 3 * tp_rank, {5, 4}});
      store->add("n", {4}, false, Init::normal, 0.02f, ShardSpec{-1, 0, {}, tp_rank == 0});
    }
    store->allocate(false, false);
    return store;
  };
  std::vector<std::unique_ptr<ParameterStore>> ranks;
  ranks.push_back(build(0, 2));
  ranks.push_back(build(1, 2));
  const std::string staged_tp2 = begin_checkpoint_save(path("tp2"));
  std::vector<ShardFile> shards;
  for (int r = 0; r < 2; ++r) {
    ranks[r]->initialize(11);
    const std::vector<ShardPiece> pieces = parameter_store_pieces(*ranks[r], nullptr, true);
    EXPECT_EQ(pieces.size(), r == 0 ? 2u : 1u);  // rank 1's norm is a copy
    shards.push_back(write_checkpoint_shard(staged_tp2, r, 2, pieces));
  }
  write_checkpoint_manifest(staged_tp2, shards, CheckpointState{});
  commit_checkpoint(staged_tp2, path("tp2"));

  auto whole = build(0, 1), expected = build(0, 1);
  whole->initialize(99);
  expected->initialize(11);
  load_checkpoint(path("tp2"), *whole, nullptr);
  EXPECT_TRUE(pretrained_testing::bitwise_equal(*whole, *expected));
  // And back into the split stores, the replicated copy included.
  auto again = build(1, 2);
  again->initialize(99);
  const std::vector<ShardPiece> pieces = parameter_store_pieces(*again, nullptr, false);
  ASSERT_EQ(pieces.size(), 2u);
  load_sharded_checkpoint(path("tp2"), *self_, pieces);
  EXPECT_TRUE(pretrained_testing::bitwise_equal(*again, *ranks[1]));
}

// forge generate / eval / convert read a checkpoint saved under any layout into one process.
TEST_F(ShardedTest, PretrainedLoadingReadsAnyLayout) {
  auto model = pretrained_testing::tiny_model(false, 21);
  AdamW optimizer(&model->params(), AdamWConfig{});
  // Two "ranks" each save one flat half of every tensor (moments too, which pretrained loading skips).
  const std::string staged_zero = begin_checkpoint_save(path("zero"));
  std::vector<ShardFile> shards;
  const std::vector<ShardPiece> whole = parameter_store_pieces(model->params(), &optimizer.moments(), true);
  for (int r = 0; r < 2; ++r) {
    std::vector<ShardPiece> pieces = whole;
    for (ShardPiece& p : pieces) {
      const int64_t n = p.flat_end, cut = n / 2 + 1;
      p.flat_begin = r == 0 ? 0 : cut;
      p.flat_end = r == 0 ? cut : n;
      p.data += p.flat_begin;
    }
    shards.push_back(write_checkpoint_shard(staged_zero, r, 2, pieces));
  }
  CheckpointState state;
  state.model_config = model->config().to_json();
  state.layout = {{"dp", 2}, {"zero", true}};
  write_checkpoint_manifest(staged_zero, shards, state);
  commit_checkpoint(staged_zero, path("zero"));

  const PretrainedDir source = open_pretrained(path("zero"));
  EXPECT_EQ(source.kind, PretrainedDir::Kind::forge_checkpoint);
  auto loaded = load_pretrained_model(path("zero"), pretrained_testing::kFp32);
  EXPECT_TRUE(pretrained_testing::bitwise_equal(loaded->params(), model->params()));

  // A missing tensor is named.
  const std::string staged_no_head = begin_checkpoint_save(path("no_head"));
  std::vector<ShardPiece> pieces;
  for (const ShardPiece& p : whole)
    if (p.name != "lm_head.weight") pieces.push_back(p);
  ShardFile shard = write_checkpoint_shard(staged_no_head, 0, 1, pieces);
  write_checkpoint_manifest(staged_no_head, std::span(&shard, 1), state);
  commit_checkpoint(staged_no_head, path("no_head"));
  expect_error_containing([&] { load_pretrained_model(path("no_head"), pretrained_testing::kFp32); },
                          {"no_head", "has no tensor 'lm_head.weight'"});
}

// A rank may save several ranges of one tensor (a parameter cut by gradient-bucket boundaries): each is
// its own shard tensor, "<name>@<flat_begin>".
TEST_F(ShardedTest, SeveralRangesOfOneTensorOnOneRank) {
  std::vector<LocalTensor> locals = rank_tensors(toy_tensors(), SimLayout{}, 0, 0, true);
  std::vector<ShardPiece> whole = pieces_of(locals);
  auto range = [](ShardPiece p, int64_t begin, int64_t end) {
    p.data += begin - p.flat_begin;
    p.flat_begin = begin;
    p.flat_end = end;
    return p;
  };
  std::vector<ShardPiece> rank0 = {range(whole[0], 40, 60), range(whole[0], 0, 7)},
                          rank1 = {range(whole[0], 7, 40)};
  for (size_t i = 1; i < whole.size(); ++i) rank1.push_back(whole[i]);
  const std::string staged_c = begin_checkpoint_save(path("c"));
  const std::vector<ShardFile> shards = {write_checkpoint_shard(staged_c, 0, 2, rank0),
                                         write_checkpoint_shard(staged_c, 1, 2, rank1)};
  CheckpointState state;
  state.step = 7;
  write_checkpoint_manifest(staged_c, shards, state);
  commit_checkpoint(staged_c, path("c"));
  load_and_check(path("c"), SimLayout{3, 1, false}, toy_tensors(), "two ranges -> tp3");

  const json pieces = pretrained_testing::read_json(
      path("c") + "/manifest.json")["tensors"]["model.embed_tokens.weight"]["pieces"];
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(pieces[0]["key"], "model.embed_tokens.weight@40");
  EXPECT_EQ(pieces[1]["key"], "model.embed_tokens.weight@0");
  EXPECT_FALSE(pieces[2].contains("key"));  // rank 1's only piece: stored under the tensor name
  SafetensorsFile shard = SafetensorsFile::open(path("c") + "/shard-00000-of-00002.safetensors");
  ASSERT_NE(shard.find("model.embed_tokens.weight@0"), nullptr);
  EXPECT_EQ(shard.find("model.embed_tokens.weight@0")->shape, (Shape{7}));
}

TEST_F(ShardedTest, MissingShardIsNamed) {
  save_as(path("c"), SimLayout{2, 1, false}, toy_tensors());
  fs::remove(path("c") + "/shard-00001-of-00002.safetensors");
  expect_error_containing([&] { load_whole(path("c"), toy_tensors()); },
                          {"incomplete", "shard-00001-of-00002.safetensors", "missing"});
  expect_error_containing([&] { read_checkpoint_manifest(path("c"), false); },
                          {"incomplete", "shard-00001-of-00002.safetensors", "missing"});
}

TEST_F(ShardedTest, CorruptShardIsNamed) {
  save_as(path("c"), SimLayout{2, 1, false}, toy_tensors());
  const std::string shard = path("c") + "/shard-00001-of-00002.safetensors";
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-5, std::ios::end);
    const char c = static_cast<char>(f.get());
    f.seekp(-5, std::ios::end);
    f.put(static_cast<char>(c ^ 0x10));
  }
  expect_error_containing([&] { load_whole(path("c"), toy_tensors()); },
                          {"corrupt", "shard-00001-of-00002.safetensors", "checksum"});
  expect_error_containing([&] { read_checkpoint_manifest(path("c")); },
                          {"corrupt", "shard-00001-of-00002.safetensors", "checksum"});
  // Only files a rank reads are checked: tp rank 0 of the same layout needs shard 0 alone.
  std::vector<LocalTensor> locals = rank_tensors(toy_tensors(), SimLayout{2, 1, false}, 0, 0, false);
  std::vector<ShardPiece> pieces = pieces_of(locals);
  load_sharded_checkpoint(path("c"), *self_, pieces);
  expect_loaded(locals, "tp rank 0");

  fs::resize_file(shard, fs::file_size(shard) - 4);
  expect_error_containing([&] { load_whole(path("c"), toy_tensors()); },
                          {"corrupt", "shard-00001-of-00002.safetensors", "bytes"});
}

TEST_F(ShardedTest, NoManifestReadsAsIncomplete) {
  save_as(path("c"), SimLayout{2, 1, false}, toy_tensors());
  fs::remove(path("c") + "/manifest.json");
  EXPECT_FALSE(checkpoint_exists(path("c")));
  expect_error_containing([&] { load_whole(path("c"), toy_tensors()); }, {"incomplete", "no manifest.json"});

  // A save interrupted after its first shard (even after its manifest): it happened in the staging folder,
  // so the checkpoint already there is untouched and still loads; the next save clears the leftovers.
  save_as(path("d"), SimLayout{2, 1, false}, toy_tensors());
  const std::string staging = begin_checkpoint_save(path("d"));
  std::vector<LocalTensor> locals = rank_tensors(toy_tensors(), SimLayout{2, 1, false}, 0, 0, true);
  std::vector<ShardPiece> pieces = pieces_of(locals);
  for (float& v : locals[0].values) v = 1.0f;  // the new state differs
  write_checkpoint_shard(staging, 0, 2, pieces);
  EXPECT_TRUE(checkpoint_exists(path("d")));
  load_and_check(path("d"), SimLayout{1, 1, false}, toy_tensors(), "after an interrupted save");
  save_as(path("d"), SimLayout{2, 1, false}, toy_tensors());
  EXPECT_FALSE(fs::exists(staging));
  expect_error_containing([&] { read_checkpoint_manifest(path("absent")); }, {"absent", "does not exist"});
  expect_error_containing([&] { read_checkpoint_manifest(path("absent")); }, {"absent", "does not exist"});
}

TEST_F(ShardedTest, DifferentGlobalShapeIsNamed) {
  save_as(path("c"), SimLayout{2, 1, false}, toy_tensors());
  std::vector<SimTensor> wider = toy_tensors();
  wider[0].shape = {12, 6};
  expect_error_containing([&] { load_whole(path("c"), wider); },
                          {"'model.embed_tokens.weight'", "global shape [10, 6]", "[12, 6]"});
}

// A hole in the saved state (a rank that left a piece out) is named by tensor and element, and the load
// writes nothing: every check comes before the first copy.
TEST_F(ShardedTest, UncoveredElementIsNamedAndNothingIsWritten) {
  save_as(path("tp"), SimLayout{2, 1, false}, toy_tensors(),
          [](int rank, const std::string& name) { return rank == 1 && name == "mlp.up_proj.weight"; });
  std::vector<LocalTensor> locals = rank_tensors(toy_tensors(), SimLayout{}, 0, 0, false);
  std::vector<ShardPiece> pieces = pieces_of(locals);
  expect_error_containing([&] { load_sharded_checkpoint(path("tp"), *self_, pieces); },
                          {"'mlp.up_proj.weight'", "no saved piece covers element [4, 0]", "2 ranks"});
  for (const LocalTensor& l : locals)
    for (float v : l.values) ASSERT_EQ(v, kUnset) << l.tensor.name;
  // tp rank 0 of the same layout does not need the missing rows.
  std::vector<LocalTensor> rank0 = rank_tensors(toy_tensors(), SimLayout{2, 1, false}, 0, 0, false);
  std::vector<ShardPiece> rank0_pieces = pieces_of(rank0);
  load_sharded_checkpoint(path("tp"), *self_, rank0_pieces);
  expect_loaded(rank0, "tp rank 0");
}

TEST_F(ShardedTest, UncoveredZeroRangeIsNamed) {
  save_as(path("zero"), SimLayout{1, 2, true}, toy_tensors(),
          [](int rank, const std::string& name) { return rank == 1 && name == "mlp.down_proj.weight"; });
  // dp rank 1's range of the [6, 8] tensor starts at 48 / 2 + 1 = 25: element [3, 1].
  expect_error_containing([&] { load_whole(path("zero"), toy_tensors()); },
                          {"'mlp.down_proj.weight'", "element [3, 1]"});
}

TEST_F(ShardedTest, MissingTensorIsNamed) {
  save_as(path("c"), SimLayout{1, 1, false}, toy_tensors());
  std::vector<SimTensor> more = toy_tensors();
  more.push_back({"extra.weight", {2, 2}, 0});
  expect_error_containing([&] { load_whole(path("c"), more); }, {"has no tensor 'extra.weight'"});
}

// Saving over an older checkpoint of a bigger world replaces the folder in one step: only the new
// checkpoint's files remain (the old shards, and anything else the old folder held, go with it), and files
// handed to the save are listed and checksummed like shards.
TEST_F(ShardedTest, SavingOverAnOlderCheckpointReplacesItWhole) {
  save_as(path("c"), SimLayout{4, 1, false}, toy_tensors());
  std::ofstream(path("c") + "/shard-00007-of-00008.safetensors.tmp") << "half-written";
  std::vector<LocalTensor> locals = rank_tensors(toy_tensors(), SimLayout{}, 0, 0, true);
  const NamedFile tokenizer{"tokenizer.json", "{\"model\": {}}\n"};
  CheckpointState state;
  state.step = 7;
  save_sharded_checkpoint(path("c"), *self_, pieces_of(locals), state, std::span(&tokenizer, 1));
  EXPECT_EQ(files_in(path("c")),
            (std::set<std::string>{"manifest.json", "tokenizer.json", "shard-00000-of-00001.safetensors"}));
  const json manifest = pretrained_testing::read_json(path("c") + "/manifest.json");
  EXPECT_EQ(manifest["files"]["tokenizer.json"]["bytes"], tokenizer.bytes.size());
  load_and_check(path("c"), SimLayout{4, 1, false}, toy_tensors(), "tp1 over tp4 -> tp4");
  std::ofstream(path("c") + "/tokenizer.json") << "{}";  // an edit the manifest catches
  expect_error_containing([&] { read_checkpoint_manifest(path("c")); }, {"corrupt", "tokenizer.json"});
  // A folder that is not a checkpoint is never replaced.
  fs::create_directories(path("mine"));
  std::ofstream(path("mine") + "/notes.txt") << "keep me";
  expect_error_containing([&] { save_sharded_checkpoint(path("mine"), *self_, pieces_of(locals), state); },
                          {"mine", "holds no checkpoint; refusing to replace it"});
  EXPECT_EQ(files_in(path("mine")), (std::set<std::string>{"notes.txt"}));
}

TEST_F(ShardedTest, SavingRefusesMalformedPieces) {
  std::vector<LocalTensor> locals = rank_tensors(toy_tensors(), SimLayout{}, 0, 0, true);
  std::vector<ShardPiece> pieces = pieces_of(locals);
  fs::create_directories(path("bad"));

  std::vector<ShardPiece> twice = {pieces[0], pieces[0]};
  expect_error_containing([&] { write_checkpoint_shard(path("bad"), 0, 1, twice); },
                          {"'model.embed_tokens.weight'", "overlapping pieces [0, 60) and [0, 60)"});
  std::vector<ShardPiece> overlapping = {pieces[0], pieces[0]};
  overlapping[0].flat_end = 31;
  overlapping[1].flat_begin = 30;
  overlapping[1].data += 30;
  expect_error_containing([&] { write_checkpoint_shard(path("bad"), 0, 1, overlapping); },
                          {"'model.embed_tokens.weight'", "overlapping pieces [0, 31) and [30, 60)"});
  std::vector<ShardPiece> past_end = {pieces[1]};
  past_end[0].flat_end += 1;
  expect_error_containing([&] { write_checkpoint_shard(path("bad"), 0, 1, past_end); },
                          {"'mlp.up_proj.weight'", "flat range [0, 49)"});
  std::vector<ShardPiece> bad_split = {pieces[2]};
  bad_split[0].local_shape = {5, 8};
  expect_error_containing([&] { write_checkpoint_shard(path("bad"), 0, 1, bad_split); },
                          {"'mlp.down_proj.weight'", "differ outside the split dimension"});

  // Ranks that disagree on a global shape.
  std::vector<ShardPiece> first = {pieces[3]}, second = {pieces[3]};
  second[0].global_shape = second[0].local_shape = {7};
  std::vector<float> seven(7, 1.0f);
  second[0].data = seven.data();
  second[0].flat_end = 7;
  const std::vector<ShardFile> shards = {write_checkpoint_shard(path("bad"), 0, 2, first),
                                         write_checkpoint_shard(path("bad"), 1, 2, second)};
  expect_error_containing([&] { write_checkpoint_manifest(path("bad"), shards, CheckpointState{}); },
                          {"'model.norm.weight'", "global shape [6]", "[7]"});
  EXPECT_FALSE(checkpoint_exists(path("bad")));

  // Through the collective entry point: the error, the checkpoint already there untouched, no staging left.
  save_as(path("old"), SimLayout{}, toy_tensors());
  expect_error_containing([&] { save_sharded_checkpoint(path("old"), *self_, twice, CheckpointState{}); },
                          {"overlapping pieces"});
  EXPECT_TRUE(checkpoint_exists(path("old")));
  load_and_check(path("old"), SimLayout{}, toy_tensors(), "after a failed save");
  EXPECT_FALSE(fs::exists(checkpoint_staging_dir(path("old"))));
}

// Version 1 (one process: model.safetensors, optimizer.safetensors) is still read; saving over it leaves
// version 2 alone.
TEST_F(ShardedTest, Version1CheckpointsAreStillRead) {
  auto model = pretrained_testing::tiny_model(false, 31);
  AdamW optimizer(&model->params(), AdamWConfig{});
  for (int64_t i = 0; i < optimizer.exp_avg().numel(); ++i) {
    optimizer.exp_avg().f32()[i] = global_value("m", i);
    optimizer.exp_avg_sq().f32()[i] = global_value("v", i);
  }
  const std::string dir = path("v1");
  fs::create_directories(dir);
  std::vector<std::pair<std::string, Tensor>> weights, moments;
  for (const auto& info : model->params().infos()) {
    weights.emplace_back(info.name, model->params().param(model->params().find(info.name)));
    moments.emplace_back("exp_avg." + info.name, optimizer.exp_avg().view(info.offset, info.shape));
    moments.emplace_back("exp_avg_sq." + info.name, optimizer.exp_avg_sq().view(info.offset, info.shape));
  }
  write_safetensors(dir + "/model.safetensors", weights, {{"format", "pt"}});
  write_safetensors(dir + "/optimizer.safetensors", moments, {{"optimizer_steps", "9"}});
  json manifest = {{"format", "forge-checkpoint"},
                   {"version", 1},
                   {"step", 9},
                   {"optimizer_steps", 9},
                   {"model_config", model->config().to_json()},
                   {"extra", {{"reason", "final"}}}};
  for (const char* name : {"model.safetensors", "optimizer.safetensors"}) {
    const std::string bytes = pretrained_testing::read_file(dir + "/" + name);
    manifest["files"][name] = {
        {"bytes", bytes.size()},
        {"crc32", crc32(0, reinterpret_cast<const Bytef*>(bytes.data()), bytes.size())}};
  }
  pretrained_testing::write_json(dir + "/manifest.json", manifest);

  auto other = pretrained_testing::tiny_model(false, 32);
  AdamW other_optimizer(&other->params(), AdamWConfig{});
  const CheckpointState state = load_checkpoint(dir, other->params(), &other_optimizer.moments());
  EXPECT_EQ(state.step, 9);
  EXPECT_EQ(other_optimizer.steps_taken(), 9);
  EXPECT_TRUE(pretrained_testing::bitwise_equal(other->params(), model->params()));
  EXPECT_EQ(std::memcmp(other_optimizer.exp_avg_sq().raw(), optimizer.exp_avg_sq().raw(),
                        optimizer.exp_avg_sq().bytes()),
            0);
  auto loaded = load_pretrained_model(dir, pretrained_testing::kFp32);
  EXPECT_TRUE(pretrained_testing::bitwise_equal(loaded->params(), model->params()));

  save_checkpoint(dir, other->params(), &other_optimizer.moments(), state);
  EXPECT_EQ(files_in(dir), (std::set<std::string>{"manifest.json", "shard-00000-of-00001.safetensors"}));
  EXPECT_EQ(pretrained_testing::read_json(dir + "/manifest.json")["version"], 3);

  json future = pretrained_testing::read_json(dir + "/manifest.json");
  future["version"] = 4;
  future["checksum"] = manifest_checksum(future);
  pretrained_testing::write_json(dir + "/manifest.json", future);
  expect_error_containing([&] { read_checkpoint_manifest(dir); },
                          {"manifest.json", "unsupported checkpoint version 4"});
}

TEST_F(ShardedTest, MalformedManifestIsNamed) {
  save_as(path("c"), SimLayout{2, 1, false}, toy_tensors());
  const std::string file = path("c") + "/manifest.json";
  const json good = pretrained_testing::read_json(file);
  // Each edit is signed with a fresh checksum, so that the structural checks behind it are reached.
  auto expect_refused = [&](json manifest, std::initializer_list<std::string_view> fragments) {
    manifest["checksum"] = manifest_checksum(manifest);
    pretrained_testing::write_json(file, manifest);
    expect_error_containing([&] { load_whole(path("c"), toy_tensors()); }, fragments);
  };
  json bad = good;
  bad["tensors"]["model.norm.weight"]["pieces"][0]["file"] = "elsewhere.safetensors";
  expect_refused(bad, {"manifest.json", "'model.norm.weight'", "'elsewhere.safetensors'"});
  bad = good;
  bad["files"]["../outside.safetensors"] = {{"bytes", 1}, {"crc32", 1}};
  expect_refused(bad, {"manifest.json", "'../outside.safetensors'", "not a file name"});
  bad = good;
  bad["tensors"]["model.norm.weight"]["pieces"][0]["flat_end"] = 100;
  expect_refused(bad, {"manifest.json", "'model.norm.weight'", "flat range"});
  bad = good;
  bad["tensors"]["model.norm.weight"]["pieces"][0].erase("split_dim");
  expect_refused(bad, {"manifest.json", "malformed", "split_dim"});
  bad = good;
  bad["format"] = "something-else";
  expect_refused(bad, {"manifest.json", "not a forge checkpoint manifest"});
  // Values are validated, each error naming the checkpoint's manifest and the field.
  bad = good;
  bad["step"] = -3;
  expect_refused(bad, {"manifest.json", "'step' must be an integer in [0,", "got -3"});
  bad = good;
  bad["world_size"] = 0;
  expect_refused(bad, {"manifest.json", "'world_size'", "got 0"});
  bad = good;
  bad["files"]["shard-00000-of-00002.safetensors"]["bytes"] = "12";
  expect_refused(bad, {"manifest.json", "'bytes'", "\"12\""});
  // A tensor's pieces pointed at the data of another tensor of as many elements (up_proj [8, 6] and
  // down_proj [6, 8]): refused, whatever the checksum says.
  bad = good;
  for (json& piece : bad["tensors"]["mlp.up_proj.weight"]["pieces"]) piece["key"] = "mlp.down_proj.weight";
  expect_refused(bad, {"manifest.json", "'mlp.up_proj.weight'", "stored as 'mlp.down_proj.weight'"});
  std::ofstream(file) << "{\"format\": ";
  expect_error_containing([&] { load_whole(path("c"), toy_tensors()); }, {"manifest.json", "invalid JSON"});
}

// The manifest checksums itself: an edited step (which would resume at the wrong step with the other step's
// weights) or any other edit is refused as corrupt; a key given twice is refused by name.
TEST_F(ShardedTest, EditedManifestIsRefusedAsCorrupt) {
  save_as(path("c"), SimLayout{2, 1, false}, toy_tensors());
  const std::string file = path("c") + "/manifest.json";
  const std::string text = pretrained_testing::read_file(file);
  json edited = pretrained_testing::read_json(file);
  ASSERT_EQ(edited["version"], 3);
  ASSERT_TRUE(edited["checksum"].is_string());
  edited["step"] = 8;
  pretrained_testing::write_json(file, edited);
  expect_error_containing([&] { load_whole(path("c"), toy_tensors()); },
                          {"corrupt", "manifest.json does not match its checksum"});
  expect_error_containing([&] { read_checkpoint_manifest(path("c")); }, {"corrupt", "checksum"});
  // The checksum does not depend on layout: the same manifest re-indented still reads.
  std::ofstream(file) << json::parse(text).dump(4);
  EXPECT_EQ(read_checkpoint_manifest(path("c")).step, 7);
  // A duplicated key would silently take the last value.
  std::string twice = text;
  twice.insert(twice.find("\"step\""), "\"step\": 3,\n  ");
  std::ofstream(file) << twice;
  expect_error_containing([&] { read_checkpoint_manifest(path("c")); },
                          {"manifest.json", "key 'step' appears twice"});
  std::ofstream(file) << text;
  load_and_check(path("c"), SimLayout{1, 1, false}, toy_tensors(), "restored manifest");
}

}  // namespace
}  // namespace forge::sharded_test
