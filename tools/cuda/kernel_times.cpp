// libringattn_kernel_times.so: every kernel's, memset's and copy's start and end on the GPU, from
// CUPTI's activity records, for any CUDA program. The CUDA driver loads it when
// CUDA_INJECTION64_PATH names it:
//
//   export CUDA_INJECTION64_PATH=build-gpu/libringattn_kernel_times.so
//   RINGATTN_KERNEL_TIMES=out/ours build-gpu/ringattn-train configs/small-32k.yaml ...
//
// At exit it writes <RINGATTN_KERNEL_TIMES>.<pid>.csv, a line a record:
// "unix_start,unix_end,device,stream,name" (seconds since the Unix epoch, from CUPTI's clock and
// the offset to the wall clock taken at load; a kernel's name as the driver gives it, mangled; a
// memset "[memset]", a copy "[memcpy HtoD]", "[memcpy DtoH]", "[memcpy DtoD]" or "[memcpy other]",
// so that the GPU's time between kernels is accounted for where it went to memory work). So
// ringattn-train and PyTorch (torch.profiler reads the same records) are measured the same way,
// and bench/kernel_times.py sums the kernels of a run's timed steps (by their wall-clock window).
#include <cupti.h>

#include <time.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace {

struct KernelRecord {
  std::uint64_t start, end;  // CUPTI's clock, ns
  std::uint32_t device, stream;
  std::string name;
};

std::mutex records_mutex;
std::vector<KernelRecord> records;
std::string output_prefix;
std::int64_t unix_minus_cupti_ns = 0;  // wall clock - CUPTI's clock at load
constexpr std::size_t kBufferBytes = 8u << 20;

void report(const char* call, CUptiResult result) {
  const char* text = nullptr;
  cuptiGetResultString(result, &text);
  std::fprintf(stderr, "ringattn kernel_times: %s failed: %s; no kernel times are recorded\n",
               call, text ? text : "unknown CUPTI error");
}

void CUPTIAPI buffer_requested(std::uint8_t** buffer, std::size_t* size,
                               std::size_t* max_records) {
  *buffer = static_cast<std::uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;  // as many as fit
}

void CUPTIAPI buffer_completed(CUcontext context, std::uint32_t stream, std::uint8_t* buffer,
                               std::size_t, std::size_t valid_bytes) {
  CUpti_Activity* record = nullptr;
  std::vector<KernelRecord> kernels;
  while (cuptiActivityGetNextRecord(buffer, valid_bytes, &record) == CUPTI_SUCCESS) {
    if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      kernels.push_back({k->start, k->end, k->deviceId, k->streamId, k->name ? k->name : "?"});
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
      kernels.push_back({m->start, m->end, m->deviceId, m->streamId, "[memset]"});
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* c = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
      const char* name = c->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_HTOD   ? "[memcpy HtoD]"
                         : c->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOH ? "[memcpy DtoH]"
                         : c->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOD ? "[memcpy DtoD]"
                                                                          : "[memcpy other]";
      kernels.push_back({c->start, c->end, c->deviceId, c->streamId, name});
    }
  }
  std::size_t dropped = 0;
  cuptiActivityGetNumDroppedRecords(context, stream, &dropped);
  if (dropped > 0) {
    std::fprintf(stderr, "ringattn kernel_times: CUPTI dropped %zu records\n", dropped);
  }
  std::free(buffer);
  const std::lock_guard<std::mutex> lock(records_mutex);
  for (KernelRecord& k : kernels) records.push_back(std::move(k));
}

std::int64_t wall_clock_ns() {
  timespec now{};
  clock_gettime(CLOCK_REALTIME, &now);
  return static_cast<std::int64_t>(now.tv_sec) * 1000000000 + now.tv_nsec;
}

// Names are written between double quotes, with any double quote doubled (CSV).
void write_records() {
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  const std::string path = output_prefix + "." + std::to_string(getpid()) + ".csv";
  std::FILE* out = std::fopen(path.c_str(), "w");
  if (out == nullptr) {
    std::fprintf(stderr, "ringattn kernel_times: cannot write %s\n", path.c_str());
    return;
  }
  const std::lock_guard<std::mutex> lock(records_mutex);
  std::fprintf(out, "unix_start,unix_end,device,stream,name\n");
  for (const KernelRecord& k : records) {
    std::string name;
    for (const char c : k.name) name += c == '"' ? std::string("\"\"") : std::string(1, c);
    const auto unix_seconds = [](std::uint64_t t) {
      return static_cast<double>(static_cast<std::int64_t>(t) + unix_minus_cupti_ns) * 1e-9;
    };
    std::fprintf(out, "%.9f,%.9f,%u,%u,\"%s\"\n", unix_seconds(k.start), unix_seconds(k.end),
                 k.device, k.stream, name.c_str());
  }
  std::fclose(out);
  std::fprintf(stderr, "ringattn kernel_times: %zu records -> %s\n", records.size(),
               path.c_str());
}

}  // namespace

// Called by the CUDA driver when CUDA_INJECTION64_PATH names this library; 1 on success.
extern "C" int InitializeInjection(void) {
  const char* prefix = std::getenv("RINGATTN_KERNEL_TIMES");
  if (prefix == nullptr || *prefix == '\0') {
    std::fprintf(stderr,
                 "ringattn kernel_times: RINGATTN_KERNEL_TIMES is not set; set it to the prefix "
                 "of the CSV file to write (<prefix>.<pid>.csv)\n");
    return 0;
  }
  output_prefix = prefix;
  std::uint64_t cupti_now = 0;
  if (const CUptiResult r = cuptiGetTimestamp(&cupti_now); r != CUPTI_SUCCESS) {
    report("cuptiGetTimestamp", r);
    return 0;
  }
  unix_minus_cupti_ns = wall_clock_ns() - static_cast<std::int64_t>(cupti_now);
  if (const CUptiResult r = cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
      r != CUPTI_SUCCESS) {
    report("cuptiActivityRegisterCallbacks", r);
    return 0;
  }
  if (const CUptiResult r = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
      r != CUPTI_SUCCESS) {
    report("cuptiActivityEnable(CONCURRENT_KERNEL)", r);
    return 0;
  }
  // Memsets and copies are worth having but not essential: without them, kernels alone.
  for (const auto& [kind, label] : {std::pair{CUPTI_ACTIVITY_KIND_MEMSET, "MEMSET"},
                                    std::pair{CUPTI_ACTIVITY_KIND_MEMCPY, "MEMCPY"}}) {
    if (const CUptiResult r = cuptiActivityEnable(kind); r != CUPTI_SUCCESS) {
      const char* text = nullptr;
      cuptiGetResultString(r, &text);
      std::fprintf(stderr,
                   "ringattn kernel_times: cuptiActivityEnable(%s) failed: %s; kernels only\n",
                   label, text ? text : "unknown CUPTI error");
    }
  }
  std::atexit(write_records);
  return 1;
}
