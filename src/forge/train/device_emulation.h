// The whole GPU path on machines without GPUs: the device emulation of kernels/emulated_device.h
// (Device::cuda runs the CPU kernels on memory the host cannot touch outside ops and copies) plus
// communicators over that memory, which make_nccl hands out while it lives: each operation checks that its
// buffers are device memory (as NCCL needs), opens device memory to the host and runs the same operation over
// MPI (or the one-rank communicator) to completion. So tensor and data parallelism on "GPUs" (device gradient
// buckets, ZeRO-1's device shards, stream-ordered tensor-parallel collectives) run under mpirun in CI. Not
// the NCCL library, its streams or its overlap: those need GPUs (ctest -L cuda).
#pragma once

#include "forge/kernels/emulated_device.h"

namespace forge::train {

class DeviceEmulation {
 public:
  // check_only: the dry run of EmulatedDevice (communicators check their buffers and move nothing).
  explicit DeviceEmulation(EmulatedDevice::Mode mode = EmulatedDevice::Mode::run);  // one at a time
  ~DeviceEmulation();
  DeviceEmulation(const DeviceEmulation&) = delete;
  DeviceEmulation& operator=(const DeviceEmulation&) = delete;

 private:
  EmulatedDevice device_;
};

}  // namespace forge::train
