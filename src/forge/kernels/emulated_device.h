// A GPU's memory discipline on the host, for running forge's device code paths on machines without one.
//
// While an EmulatedDevice lives, Device::cuda is "usable": its memory interface and op table are replaced by
// host implementations (the CPU kernels) under two rules a real GPU enforces and a host happily ignores:
//   - device memory is host pages mapped PROT_NONE, opened (read/write) only while an op, a device copy or a
//     device memset runs; any other host access (reading a loss straight from device memory, writing ids into
//     a device buffer, touching a freed allocation) faults at once, and the fault handler names the address
//     and the allocation and prints a backtrace before the process dies;
//   - every pointer an op is handed must be null or lie inside live device memory; a host pointer passed to a
//     device op fails with one line naming the op and the field.
// And every op's parameters must be ones the CUDA backend takes (its support predicates, ops.h's OpTable, in
// builds with that backend): what a GPU would refuse fails here with the GPU's line, and
// ops::supports_<op>(..., Device::cuda) answers for the emulation as it would for the GPU.
// So the trainer, checkpoints, generation, FP8 recipes and the optimizer run their GPU paths (staging copies,
// device scalars, device-side scales) in CI, where no GPU is lent. It says nothing about the CUDA kernels
// themselves, streams or NCCL: those need the GPU tests (ctest -L cuda).
//
// One emulation at a time. It reports 8 devices (one per rank of a node's worth of processes: every process
// has its own emulation); train/device_emulation.h adds communicators over emulated device memory for tp/dp
// > 1. Not for production: every op opens and closes every live allocation (two mprotect calls each).
#pragma once

#include <cstdint>

namespace forge {

class EmulatedDevice {
 public:
  // run: ops run the CPU kernels on the device memory. check_only: a dry run at any scale. Ops check their
  // pointers and parameters (the CUDA backend's and the CPU kernel's predicates) and return without computing
  // (sums and amaxes read as 0), copies and memsets move nothing (a read-back gives zeros), device memory is
  // never committed, so a model far larger than this machine's memory "trains" in seconds per step: every
  // parameter every op would get is checked, every host access to device memory still faults, and
  // peak_bytes() is the device memory the run allocates at most.
  enum class Mode { run, check_only };
  explicit EmulatedDevice(Mode mode = Mode::run);  // fails with one line when another emulation is active
  ~EmulatedDevice();  // restores the backend's interface and table; live allocations are released
  EmulatedDevice(const EmulatedDevice&) = delete;
  EmulatedDevice& operator=(const EmulatedDevice&) = delete;

  // Device allocations alive now, and ops run since construction (for tests of the emulation itself).
  static int64_t live_allocations();
  static int64_t ops_run();
  static bool check_only();  // the active emulation is a dry run
  // The most device memory allocated at once since construction: bytes asked for, or with count_rounded the
  // blocks the CUDA backend's caching allocator would hand out (CachingAllocator::round_size: 512 B multiples
  // below 1 MiB, 2 MiB multiples from there), which its peak counts. count_rounded returns the previous
  // setting; it may change only while no allocation is alive (the simulator's dry traces for GPUs round).
  static int64_t peak_bytes();
  static bool count_rounded(bool on);
  // Traffic between host and device since construction: copies each way, explicit synchronisations and ops
  // that return a value to the host. On a GPU each device-to-host copy, synchronisation and host result makes
  // the host wait for the device's queue, so these count the stalls a step imposes (performance tests of the
  // GPU path).
  struct Traffic {
    int64_t to_host = 0, to_device = 0, device_to_device = 0, synchronizations = 0;
    int64_t host_results =
        0;  // ops whose result the host waits for: sum_squares, amax, a cast returning amax
  };
  static Traffic traffic();
  // Host memory pinned now (DeviceMemory::pin_host), in bytes.
  static int64_t pinned_bytes();
  // Whether p lies inside live device memory (false when no emulation is active).
  static bool is_device_memory(const void* p);

  // Opens device memory to host code while it lives, for what stands in for the device's own engines: the
  // emulated communicators (train/device_emulation.h) hand device buffers to MPI. Nests with ops and copies.
  class Access {
   public:
    Access();
    ~Access();
    Access(const Access&) = delete;
    Access& operator=(const Access&) = delete;
  };
};

}  // namespace forge
