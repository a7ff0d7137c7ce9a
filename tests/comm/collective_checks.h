// One harness for every comm backend: each check fills buffers with values that depend on (rank, index),
// runs one operation on any communicator, and compares every element with the expectation computed here
// from the definition of the operation. Memory abstracts host (self, mpi) and device (nccl) buffers.
//
// Values are small integers (|v| <= 11), so every sum over up to 11 ranks is exact in every type, bf16
// included, whatever order a backend reduces in: results are compared exactly.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "forge/comm/comm.h"
#include "forge/core/dtype.h"

namespace forge::comm::checks {

class Memory {
 public:
  virtual ~Memory() = default;
  virtual void* alloc(int64_t bytes) = 0;  // nullptr for 0 bytes
  virtual void release(void* ptr) = 0;
  virtual void upload(void* dst, const void* host_src, int64_t bytes) = 0;
  virtual void download(void* host_dst, const void* src, int64_t bytes) = 0;
};

class HostMemory final : public Memory {
 public:
  void* alloc(int64_t bytes) override {
    return bytes > 0 ? std::malloc(static_cast<size_t>(bytes)) : nullptr;
  }
  void release(void* ptr) override { std::free(ptr); }
  void upload(void* dst, const void* src, int64_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, static_cast<size_t>(bytes));
  }
  void download(void* dst, const void* src, int64_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, static_cast<size_t>(bytes));
  }
};

inline constexpr Type kTypes[] = {Type::f32, Type::f64, Type::bf16, Type::i32, Type::i64, Type::u8};
inline constexpr ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::max, ReduceOp::min};

// The value rank r contributes at index i (tag varies it between operations of one test).
inline double value(Type type, int rank, int64_t i, int tag = 0) {
  const int64_t v = ((rank + 1) * 7 + i * 13 + tag * 5) % 23;
  return type == Type::u8 ? static_cast<double>(v) : static_cast<double>(v - 11);
}

// Host array of `type` elements, read and written as doubles.
class Values {
 public:
  Values(Type type, int64_t count) : type_(type), bytes_(static_cast<size_t>(count) * type_size(type)) {}
  int64_t count() const { return static_cast<int64_t>(bytes_.size() / type_size(type_)); }
  int64_t bytes() const { return static_cast<int64_t>(bytes_.size()); }
  unsigned char* data() { return bytes_.data(); }
  const unsigned char* data() const { return bytes_.data(); }

  void set(int64_t i, double v) {
    unsigned char* p = bytes_.data() + i * type_size(type_);
    switch (type_) {
      case Type::f32:
        store(p, static_cast<float>(v));
        break;
      case Type::f64:
        store(p, v);
        break;
      case Type::bf16:
        store(p, f32_to_bf16_bits(static_cast<float>(v)));
        break;
      case Type::i32:
        store(p, static_cast<int32_t>(v));
        break;
      case Type::i64:
        store(p, static_cast<int64_t>(v));
        break;
      case Type::u8:
        store(p, static_cast<uint8_t>(v));
        break;
    }
  }
  double get(int64_t i) const {
    const unsigned char* p = bytes_.data() + i * type_size(type_);
    switch (type_) {
      case Type::f32:
        return load<float>(p);
      case Type::f64:
        return load<double>(p);
      case Type::bf16:
        return bf16_bits_to_f32(load<uint16_t>(p));
      case Type::i32:
        return load<int32_t>(p);
      case Type::i64:
        return static_cast<double>(load<int64_t>(p));
      case Type::u8:
        return load<uint8_t>(p);
    }
    return 0;
  }

 private:
  template <typename T>
  static void store(unsigned char* p, T v) {
    std::memcpy(p, &v, sizeof(T));
  }
  template <typename T>
  static T load(const unsigned char* p) {
    T v;
    std::memcpy(&v, p, sizeof(T));
    return v;
  }

  Type type_;
  std::vector<unsigned char> bytes_;
};

// A buffer in the backend's memory, filled from and read back into Values.
class Buffer {
 public:
  Buffer(Memory& memory, Type type, int64_t count)
      : memory_(memory), type_(type), count_(count), ptr_(memory.alloc(count * type_size(type))) {}
  ~Buffer() { memory_.release(ptr_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* get() { return ptr_; }
  void* at(int64_t element) { return static_cast<char*>(ptr_) + element * type_size(type_); }
  void upload(const Values& v) { memory_.upload(ptr_, v.data(), v.bytes()); }
  Values download() {
    Values v(type_, count_);
    memory_.download(v.data(), ptr_, v.bytes());
    return v;
  }

 private:
  Memory& memory_;
  Type type_;
  int64_t count_;
  void* ptr_;
};

inline std::string describe(const Communicator& c, Type type) {
  return std::string(c.backend()) + " group '" + c.name() + "' rank " + std::to_string(c.rank()) + " of " +
         std::to_string(c.size()) + ", " + type_name(type);
}

// Every element equal, reported once (the first mismatch and how many).
inline void expect_values(const Values& actual, const std::vector<double>& expected,
                          const std::string& what) {
  ASSERT_EQ(actual.count(), static_cast<int64_t>(expected.size())) << what;
  int64_t mismatches = 0, first = -1;
  for (int64_t i = 0; i < actual.count(); ++i) {
    if (actual.get(i) != expected[static_cast<size_t>(i)]) {
      if (first < 0) first = i;
      ++mismatches;
    }
  }
  if (mismatches > 0)
    ADD_FAILURE() << what << ": " << mismatches << " of " << actual.count() << " elements differ; first at "
                  << first << ": got " << actual.get(first) << ", expected "
                  << expected[static_cast<size_t>(first)];
}

inline double reduce(ReduceOp op, double a, double b) {
  switch (op) {
    case ReduceOp::sum:
      return a + b;
    case ReduceOp::max:
      return std::max(a, b);
    case ReduceOp::min:
      return std::min(a, b);
  }
  return 0;
}

// Reduction over ranks of value(type, r, i, tag).
inline double reduced_value(ReduceOp op, Type type, int ranks, int64_t i, int tag = 0) {
  double acc = value(type, 0, i, tag);
  for (int r = 1; r < ranks; ++r) acc = reduce(op, acc, value(type, r, i, tag));
  return acc;
}

inline void check_all_reduce(Communicator& c, Memory& m, Type type, ReduceOp op, int64_t count) {
  Values in(type, count);
  std::vector<double> expected(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    in.set(i, value(type, c.rank(), i));
    expected[static_cast<size_t>(i)] = reduced_value(op, type, c.size(), i);
  }
  Buffer buf(m, type, count);
  buf.upload(in);
  c.all_reduce(buf.get(), count, type, op).wait();
  expect_values(buf.download(), expected,
                "all_reduce " + std::string(reduce_op_name(op)) + " count " + std::to_string(count) + " on " +
                    describe(c, type));
}

// in_place: send is this rank's block of recv.
inline void check_all_gather(Communicator& c, Memory& m, Type type, int64_t count, bool in_place) {
  const int n = c.size();
  Values mine(type, count);
  for (int64_t i = 0; i < count; ++i) mine.set(i, value(type, c.rank(), i));
  std::vector<double> expected;
  for (int r = 0; r < n; ++r)
    for (int64_t i = 0; i < count; ++i) expected.push_back(value(type, r, i));
  Buffer recv(m, type, count * n);
  Buffer send(m, type, in_place ? 0 : count);
  const void* send_ptr = in_place ? recv.at(c.rank() * count) : send.get();
  m.upload(const_cast<void*>(send_ptr), mine.data(), mine.bytes());
  c.all_gather(send_ptr, recv.get(), count, type).wait();
  expect_values(recv.download(), expected,
                std::string("all_gather") + (in_place ? " in place" : "") + " count " +
                    std::to_string(count) + " on " + describe(c, type));
}

// Rank r contributes (r + 2) % 3 * scale elements: some ranks none.
inline void check_all_gatherv(Communicator& c, Memory& m, Type type, int64_t scale, bool in_place) {
  const int n = c.size();
  std::vector<int64_t> counts(static_cast<size_t>(n));
  int64_t total = 0, my_offset = 0;
  for (int r = 0; r < n; ++r) {
    counts[r] = (r + 2) % 3 * scale;
    if (r == c.rank()) my_offset = total;
    total += counts[r];
  }
  const int64_t mine_count = counts[c.rank()];
  Values mine(type, mine_count);
  for (int64_t i = 0; i < mine_count; ++i) mine.set(i, value(type, c.rank(), i, 1));
  std::vector<double> expected;
  for (int r = 0; r < n; ++r)
    for (int64_t i = 0; i < counts[r]; ++i) expected.push_back(value(type, r, i, 1));
  Buffer recv(m, type, total);
  Buffer send(m, type, in_place ? 0 : mine_count);
  const void* send_ptr = in_place ? recv.at(my_offset) : send.get();
  if (mine_count > 0) m.upload(const_cast<void*>(send_ptr), mine.data(), mine.bytes());
  c.all_gatherv(send_ptr, recv.get(), counts, type).wait();
  expect_values(recv.download(), expected,
                std::string("all_gatherv") + (in_place ? " in place" : "") + " scale " +
                    std::to_string(scale) + " on " + describe(c, type));
}

// in_place: recv is this rank's block of send.
inline void check_reduce_scatter(Communicator& c, Memory& m, Type type, ReduceOp op, int64_t count,
                                 bool in_place = false) {
  const int n = c.size();
  Values in(type, count * n);
  for (int64_t i = 0; i < count * n; ++i) in.set(i, value(type, c.rank(), i, 2));
  std::vector<double> expected(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i)
    expected[static_cast<size_t>(i)] = reduced_value(op, type, n, c.rank() * count + i, 2);
  Buffer send(m, type, count * n), recv(m, type, in_place ? 0 : count);
  send.upload(in);
  c.reduce_scatter(send.get(), in_place ? send.at(c.rank() * count) : recv.get(), count, type, op).wait();
  Values got = recv.download();
  if (in_place) {
    const Values all = send.download();
    got = Values(type, count);
    std::copy(all.data() + c.rank() * count * type_size(type), all.data() + (c.rank() + 1) * count * type_size(type),
              got.data());
  }
  expect_values(got, expected,
                "reduce_scatter" + std::string(in_place ? " in place " : " ") + reduce_op_name(op) + " count " +
                    std::to_string(count) + " on " + describe(c, type));
}

// Element i of the block rank `from` sends to rank `to`.
inline double exchanged_value(Type type, int from, int to, int64_t i) {
  return value(type, from, to * 1000 + i, 3);
}

inline void check_all_to_all(Communicator& c, Memory& m, Type type, int64_t count) {
  const int n = c.size();
  Values in(type, count * n);
  std::vector<double> expected;
  for (int p = 0; p < n; ++p)
    for (int64_t i = 0; i < count; ++i) {
      in.set(p * count + i, exchanged_value(type, c.rank(), p, i));
      expected.push_back(exchanged_value(type, p, c.rank(), i));
    }
  Buffer send(m, type, count * n), recv(m, type, count * n);
  send.upload(in);
  c.all_to_all(send.get(), recv.get(), count, type).wait();
  expect_values(recv.download(), expected,
                "all_to_all count " + std::to_string(count) + " on " + describe(c, type));
}

// Rank `from` sends (from + 2 * to) % 3 * scale elements to rank `to`. Blocks are laid out in reverse peer
// order with one element of gap before each, so that wrong displacements show (the gaps keep a sentinel).
inline void check_all_to_allv(Communicator& c, Memory& m, Type type, int64_t scale) {
  const int n = c.size(), me = c.rank();
  auto amount = [&](int from, int to) { return (from + 2 * to) % 3 * scale; };
  std::vector<int64_t> send_counts(n), send_displs(n), recv_counts(n), recv_displs(n);
  int64_t send_total = 0, recv_total = 0;
  for (int p = n - 1; p >= 0; --p) {
    send_counts[p] = amount(me, p);
    send_displs[p] = send_total + 1;
    send_total += 1 + send_counts[p];
    recv_counts[p] = amount(p, me);
    recv_displs[p] = recv_total + 1;
    recv_total += 1 + recv_counts[p];
  }
  constexpr double kSentinel = 99;  // outside value()'s range, exact in every type
  Values in(type, send_total), init(type, recv_total);
  std::vector<double> expected(static_cast<size_t>(recv_total), kSentinel);
  for (int64_t i = 0; i < recv_total; ++i) init.set(i, kSentinel);
  for (int p = 0; p < n; ++p) {
    for (int64_t i = 0; i < send_counts[p]; ++i) in.set(send_displs[p] + i, exchanged_value(type, me, p, i));
    for (int64_t i = 0; i < recv_counts[p]; ++i)
      expected[static_cast<size_t>(recv_displs[p] + i)] = exchanged_value(type, p, me, i);
  }
  Buffer send(m, type, send_total), recv(m, type, recv_total);
  send.upload(in);
  recv.upload(init);
  c.all_to_allv(send.get(), send_counts, send_displs, recv.get(), recv_counts, recv_displs, type).wait();
  expect_values(recv.download(), expected,
                "all_to_allv scale " + std::to_string(scale) + " on " + describe(c, type));
}

inline void check_broadcast(Communicator& c, Memory& m, Type type, int root, int64_t count) {
  Values in(type, count);
  std::vector<double> expected(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    in.set(i, value(type, c.rank(), i, 4));
    expected[static_cast<size_t>(i)] = value(type, root, i, 4);
  }
  Buffer buf(m, type, count);
  buf.upload(in);
  c.broadcast(buf.get(), count, type, root).wait();
  expect_values(buf.download(), expected,
                "broadcast from " + std::to_string(root) + " count " + std::to_string(count) + " on " +
                    describe(c, type));
}

// Every rank sends to the next and receives from the previous, both posted before either is waited on.
inline void check_send_recv_ring(Communicator& c, Memory& m, Type type, int64_t count) {
  const int n = c.size(), next = (c.rank() + 1) % n, previous = (c.rank() + n - 1) % n;
  Values out(type, count);
  std::vector<double> expected(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    out.set(i, value(type, c.rank(), i, 5));
    expected[static_cast<size_t>(i)] = value(type, previous, i, 5);
  }
  Buffer send(m, type, count), recv(m, type, count);
  send.upload(out);
  Request requests[] = {c.recv(recv.get(), count, type, previous, 7),
                        c.send(send.get(), count, type, next, 7)};
  wait_all(requests);
  expect_values(recv.download(), expected,
                "send/recv ring count " + std::to_string(count) + " on " + describe(c, type));
}

// Every collective, every type, several sizes (zero included). Point-to-point only with peers.
inline void check_every_collective(Communicator& c, Memory& m) {
  for (Type type : kTypes) {
    for (ReduceOp op : kOps) {
      for (int64_t count : {0, 1, 1000, 5000}) check_all_reduce(c, m, type, op, count);
      for (int64_t count : {0, 3, 700}) {
        check_reduce_scatter(c, m, type, op, count);
        check_reduce_scatter(c, m, type, op, count, /*in_place=*/true);
      }
    }
    for (int64_t count : {0, 1, 513}) {
      check_all_gather(c, m, type, count, false);
      check_all_gather(c, m, type, count, true);
      check_all_to_all(c, m, type, count);
    }
    for (int64_t scale : {0, 1, 300}) {
      check_all_gatherv(c, m, type, scale, false);
      check_all_gatherv(c, m, type, scale, true);
      check_all_to_allv(c, m, type, scale);
    }
    for (int root = 0; root < c.size(); ++root)
      for (int64_t count : {0, 1, 999}) check_broadcast(c, m, type, root, count);
    if (c.size() > 1)
      for (int64_t count : {0, 1, 4097}) check_send_recv_ring(c, m, type, count);
  }
  c.barrier().wait();
}

}  // namespace forge::comm::checks
