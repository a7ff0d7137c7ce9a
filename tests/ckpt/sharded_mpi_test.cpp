// Sharded checkpoints across MPI ranks (run by mpirun with 2 and 4 ranks): the collective save under
// tensor-parallel, ZeRO and mixed layouts, loads under every other layout of the same world and into
// whole tensors on every rank, and errors on one rank reach every rank.
#include <gtest/gtest.h>

#include <filesystem>

#include "ckpt/sharded_test_util.h"
#include "forge/ckpt/sharded.h"
#include "op_harness.h"

namespace forge::sharded_mpi_test {
using namespace forge::ckpt;
namespace {

namespace fs = std::filesystem;
using namespace sharded_testing;
using testing::expect_error_containing;

// A directory every rank sees, emptied by rank 0 before anyone uses it.
std::string shared_dir(const std::string& name) {
  comm::Communicator& world = comm::world();
  const fs::path dir =
      fs::path(FORGE_BINARY_DIR) / "ckpt_mpi" / (name + "-np" + std::to_string(world.size()));
  if (world.rank() == 0) {
    fs::remove_all(dir);
    fs::create_directories(dir.parent_path());
  }
  world.barrier().wait();
  return dir.string();
}

std::vector<SimLayout> layouts_of(int world) {
  std::vector<SimLayout> layouts = {{world, 1, false}, {1, world, true}};
  if (world % 2 == 0 && world > 2) layouts.push_back({2, world / 2, true});
  if (world % 2 == 0) layouts.push_back({world / 2, 2, false});
  return layouts;
}

void save_as(const std::string& dir, const SimLayout& layout, const std::vector<SimTensor>& tensors) {
  comm::Communicator& world = comm::world();
  std::vector<LocalTensor> locals =
      rank_tensors(tensors, layout, world.rank() % layout.tp, world.rank() / layout.tp, /*for_saving=*/true);
  CheckpointState state;
  state.step = 7;
  state.layout = layout.json();
  save_sharded_checkpoint(dir, world, pieces_of(locals), state);
}

TEST(ShardedMpi, EveryLayoutLoadsUnderEveryOther) {
  comm::Communicator& world = comm::world();
  const std::vector<SimTensor> tensors = toy_tensors();
  for (const SimLayout& saved : layouts_of(world.size())) {
    const std::string dir = shared_dir(saved.label());
    save_as(dir, saved, tensors);
    // Complete on return, on every rank.
    const CheckpointState state = read_checkpoint_manifest(dir);
    EXPECT_EQ(state.world_size, world.size());
    EXPECT_EQ(state.layout, saved.json());
    EXPECT_EQ(state.step, 7);
    for (const SimLayout& loaded : layouts_of(world.size())) {
      std::vector<LocalTensor> locals =
          rank_tensors(tensors, loaded, world.rank() % loaded.tp, world.rank() / loaded.tp, false);
      std::vector<ShardPiece> pieces = pieces_of(locals);
      load_sharded_checkpoint(dir, world, pieces);
      expect_loaded(locals, saved.label() + " -> " + loaded.label());
    }
    // Every rank reads the whole state (forge generate under mpirun, a reshard to one process).
    std::vector<LocalTensor> whole = rank_tensors(tensors, SimLayout{}, 0, 0, false);
    std::vector<ShardPiece> pieces = pieces_of(whole);
    load_sharded_checkpoint(dir, world, pieces);
    expect_loaded(whole, saved.label() + " -> whole");
  }
}

// Saving over an older checkpoint of the same world replaces every shard.
TEST(ShardedMpi, SavingAgainReplacesTheCheckpoint) {
  comm::Communicator& world = comm::world();
  const std::string dir = shared_dir("again");
  const std::vector<SimLayout> layouts = layouts_of(world.size());
  save_as(dir, layouts[0], toy_tensors());
  save_as(dir, layouts[1], toy_tensors());
  EXPECT_EQ(read_checkpoint_manifest(dir).layout, layouts[1].json());
  std::vector<LocalTensor> whole = rank_tensors(toy_tensors(), SimLayout{}, 0, 0, false);
  std::vector<ShardPiece> pieces = pieces_of(whole);
  load_sharded_checkpoint(dir, world, pieces);
  expect_loaded(whole, "second save");
}

// A malformed piece on the last rank fails the save on every rank, naming that rank, and leaves no
// manifest.
TEST(ShardedMpi, AnErrorOnOneRankFailsTheSaveEverywhere) {
  comm::Communicator& world = comm::world();
  const std::string dir = shared_dir("bad_save");
  const std::vector<SimTensor> tensors = toy_tensors();
  const SimLayout layout{world.size(), 1, false};
  std::vector<LocalTensor> locals = rank_tensors(tensors, layout, world.rank(), 0, true);
  std::vector<ShardPiece> pieces = pieces_of(locals);
  if (world.rank() == world.size() - 1) pieces.push_back(pieces[0]);
  expect_error_containing([&] { save_sharded_checkpoint(dir, world, pieces, CheckpointState{}); },
                          {"rank " + std::to_string(world.size() - 1) + ":", "overlapping pieces"});
  world.barrier().wait();
  EXPECT_FALSE(checkpoint_exists(dir));
}

// A shard only the last rank reads is missing: every rank's load fails, naming the file.
TEST(ShardedMpi, AMissingShardFailsTheLoadEverywhere) {
  comm::Communicator& world = comm::world();
  const std::string dir = shared_dir("missing");
  const SimLayout layout{world.size(), 1, false};
  save_as(dir, layout, toy_tensors());
  const std::string last = shard_file_name(world.size() - 1, world.size());
  if (world.rank() == 0) fs::remove(fs::path(dir) / last);
  world.barrier().wait();
  std::vector<LocalTensor> locals = rank_tensors(toy_tensors(), layout, world.rank(), 0, false);
  std::vector<ShardPiece> pieces = pieces_of(locals);
  expect_error_containing([&] { load_sharded_checkpoint(dir, world, pieces); },
                          {"rank " + std::to_string(world.size() - 1) + ":", last, "missing"});
  for (const LocalTensor& l : locals)
    for (float v : l.values) ASSERT_EQ(v, kUnset) << l.tensor.name;
}

}  // namespace
}  // namespace forge::sharded_mpi_test
