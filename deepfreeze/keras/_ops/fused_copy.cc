// DeepFreezeFusedCopy: copies this rank's pieces of many tensors into ONE caller-owned
// host buffer in one kernel launch (the fused capture buffer of deepfreeze/fused.py).
//
// The destination is memory the caller (Python) allocated, pre-faulted and keeps alive: the
// op gets its address and capacity as an int64 pair and never allocates a TensorFlow buffer,
// so a capture costs one op and one memcpy pass over the shard whatever the tensor count.
// Every argument is validated before the first byte is written; a bad call writes nothing.
// The step stamp (bytes [0, 8)) is written after every piece.
// Large copies are split into chunks run on the device's CPU worker threads.
//
// Built by `python -m deepfreeze.keras.native build` against the installed TensorFlow's
// headers (see deepfreeze/keras/native.py).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/lib/core/threadpool.h"

namespace deepfreeze {

using ::tensorflow::DataType;
using ::tensorflow::DataTypeString;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Status;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShapeUtils;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;
namespace errors = ::tensorflow::errors;

// dest: [2] int64, step: scalar int64 -> stamp: scalar (both ops)
static Status StampShape(InferenceContext* c) {
  ShapeHandle dest, step;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &dest));
  ::tensorflow::shape_inference::DimensionHandle two;
  TF_RETURN_IF_ERROR(c->WithValue(c->Dim(dest, 0), 2, &two));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &step));
  c->set_output(0, c->Scalar());
  return ::tensorflow::OkStatus();
}

REGISTER_OP("DeepFreezeFusedCopy")
    .Input("dest: int64")  // [address of the destination buffer, its capacity in bytes]
    .Input("step: int64")  // scalar, written as int64 little-endian to dest bytes [0, 8), last
    .Input("values: T")    // N tensors of fixed-size dtypes (mixed)
    .Attr("T: list(type) >= 0")
    .Attr("src_offsets: list(int)")  // per value: byte offset of its piece in the value's buffer
    .Attr("dst_offsets: list(int)")  // per value: byte offset in dest where the piece goes
    .Attr("lengths: list(int)")      // per value: bytes to copy
    .Output("stamp: int64")          // scalar: the step written
    .SetIsStateful()                 // writes memory TensorFlow does not see: never pruned/CSE'd/folded
    .SetShapeFn(StampShape)
    .Doc(R"doc(
Copies byte ranges of N tensors into one caller-owned host buffer and writes a step stamp.

dest: [address, capacity] of the destination buffer, which the caller keeps alive.
step: written as int64 little-endian to dest bytes [0, 8), after every piece.
values: the tensors whose pieces are copied.
src_offsets: per value, the byte offset in the value where its piece starts.
dst_offsets: per value, the byte offset in dest where the piece goes (>= 8).
lengths: per value, the number of bytes copied.
stamp: the step written.
)doc");

// The same copy reading resource variables directly (as ReadVariableOp does: a reference to
// the variable's current buffer taken under its lock), so a capture of N variables is one node
// instead of N ReadVariableOp nodes and this op.
REGISTER_OP("DeepFreezeFusedCopyVars")
    .Input("dest: int64")
    .Input("step: int64")
    .Input("vars: N * resource")
    .Attr("N: int >= 0")
    .Attr("src_offsets: list(int)")
    .Attr("dst_offsets: list(int)")
    .Attr("lengths: list(int)")
    .Output("stamp: int64")
    .SetIsStateful()
    .SetShapeFn(StampShape)
    .Doc(R"doc(
DeepFreezeFusedCopy over resource variables: copies byte ranges of N variables' current values.
)doc");

namespace {

constexpr int64_t kStampBytes = 8;
// Chunk size of the parallel copy; copies below kParallelMin bytes run on the calling thread.
constexpr int64_t kChunkBytes = int64_t{2} << 20;
constexpr int64_t kParallelMin = int64_t{4} << 20;

struct Chunk {
  char* dst;
  const char* src;
  int64_t len;
};

// DEEPFREEZE_FUSED_COPY_THREADS: unset or 1 = the calling thread only (the default: measured
// faster on a 2-core machine whose other core runs the other rank), 0 = every thread of the CPU
// device's worker pool, n > 1 = at most n shards. Read when the kernel is built.
int ThreadsFromEnv() {
  const char* s = std::getenv("DEEPFREEZE_FUSED_COPY_THREADS");
  if (s == nullptr || *s == '\0') return 1;
  char* end = nullptr;
  long v = std::strtol(s, &end, 10);
  if (end == s || *end != '\0' || v < 0 || v > 1024) return 1;
  return static_cast<int>(v);
}

// DEEPFREEZE_FUSED_COPY_NT: unset or 1 = non-temporal (streaming) stores for pieces and chunks of
// [kStreamMin, kStreamMax) bytes (the default: measured faster for ResNet-50's many pieces),
// 0 = memcpy only. Read when the kernel is built.
bool StreamFromEnv() {
  const char* s = std::getenv("DEEPFREEZE_FUSED_COPY_NT");
  return s == nullptr || s[0] != '0';
}

constexpr int64_t kStreamMin = int64_t{64} << 10;
// From this size on glibc's memcpy is as fast or faster (it streams above its own threshold,
// ~100 MiB here, with wider vectors than the SSE2 loop below).
constexpr int64_t kStreamMax = int64_t{16} << 20;

// Copies with non-temporal stores where the CPU has them: the destination is read back later by
// the writer, not by this thread, so it need not be read into the cache first (no
// read-for-ownership) nor evict the variables the train step is about to use.
void CopyBytes(char* dst, const char* src, int64_t len, bool stream) {
#if defined(__SSE2__)
  if (stream && len >= kStreamMin && len < kStreamMax) {
    const int64_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
    std::memcpy(dst, src, static_cast<size_t>(head));
    dst += head, src += head, len -= head;
    const int64_t body = len & ~int64_t{63};
    for (int64_t k = 0; k < body; k += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + k + 48), d);
    }
    std::memcpy(dst + body, src + body, static_cast<size_t>(len - body));
    _mm_sfence();  // streamed stores visible before the op completes
    return;
  }
#endif
  std::memcpy(dst, src, static_cast<size_t>(len));
}

}  // namespace

class FusedCopyBase : public OpKernel {
 public:
  // ``types``: the values' dtypes when known at construction (DeepFreezeFusedCopy), else empty
  // (the variables' dtypes are checked when the op runs).
  FusedCopyBase(OpKernelConstruction* ctx, const std::vector<DataType>& types, size_t n)
      : OpKernel(ctx), threads_(ThreadsFromEnv()), stream_(StreamFromEnv()) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("src_offsets", &src_offsets_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dst_offsets", &dst_offsets_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("lengths", &lengths_));
    OP_REQUIRES(ctx, src_offsets_.size() == n && dst_offsets_.size() == n && lengths_.size() == n,
                errors::InvalidArgument(
                    "DeepFreezeFusedCopy: src_offsets, dst_offsets and lengths need one entry per "
                    "value (", n, " values), got ", src_offsets_.size(), ", ", dst_offsets_.size(),
                    " and ", lengths_.size()));
    for (size_t i = 0; i < types.size(); ++i) {
      OP_REQUIRES(ctx, ::tensorflow::DataTypeCanUseMemcpy(types[i]),
                  errors::InvalidArgument("DeepFreezeFusedCopy: value ", i, " has dtype ",
                                          DataTypeString(types[i]),
                                          ", which has no fixed-size byte representation; only "
                                          "numeric and bool tensors can be copied"));
    }
    for (size_t i = 0; i < n && i < lengths_.size(); ++i) {
      OP_REQUIRES(ctx, src_offsets_[i] >= 0 && lengths_[i] >= 0,
                  errors::InvalidArgument("DeepFreezeFusedCopy: value ", i, ": src_offset ",
                                          src_offsets_[i], " and length ", lengths_[i],
                                          " must be >= 0"));
      OP_REQUIRES(ctx, dst_offsets_[i] >= kStampBytes,
                  errors::InvalidArgument("DeepFreezeFusedCopy: value ", i, ": dst_offset ",
                                          dst_offsets_[i], " must be >= ", kStampBytes,
                                          " (dest bytes [0, 8) hold the step stamp)"));
    }
  }

  // Validates everything, then copies the pieces of ``values`` and writes the stamp.
  void Copy(OpKernelContext* ctx, const std::vector<const Tensor*>& values) {
    const Tensor& dest = ctx->input(0);
    const Tensor& step = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(dest.shape()) && dest.NumElements() == 2,
                errors::InvalidArgument("DeepFreezeFusedCopy: dest must be [address, capacity] "
                                        "(shape [2]), got shape ", dest.shape().DebugString()));
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(step.shape()),
                errors::InvalidArgument("DeepFreezeFusedCopy: step must be a scalar, got shape ",
                                        step.shape().DebugString()));
    const int64_t address = dest.flat<int64_t>()(0);
    const int64_t capacity = dest.flat<int64_t>()(1);
    OP_REQUIRES(ctx, address != 0,
                errors::InvalidArgument("DeepFreezeFusedCopy: dest address is 0 (null)"));
    OP_REQUIRES(ctx, capacity >= kStampBytes,
                errors::InvalidArgument("DeepFreezeFusedCopy: dest capacity ", capacity,
                                        " bytes is below the ", kStampBytes,
                                        "-byte step stamp"));
    const int n = static_cast<int>(values.size());
    OP_REQUIRES(ctx, static_cast<size_t>(n) == lengths_.size(),
                errors::InvalidArgument("DeepFreezeFusedCopy: ", n, " values but ", lengths_.size(),
                                        " lengths"));
    // Validate every piece before writing anything. All terms are >= 0, so the differences
    // below cannot overflow where a sum could.
    int64_t total = 0;
    for (int i = 0; i < n; ++i) {
      const Tensor& v = *values[i];
      OP_REQUIRES(ctx, ::tensorflow::DataTypeCanUseMemcpy(v.dtype()),
                  errors::InvalidArgument("DeepFreezeFusedCopy: value ", i, " has dtype ",
                                          DataTypeString(v.dtype()),
                                          ", which has no fixed-size byte representation"));
      const int64_t have = static_cast<int64_t>(v.tensor_data().size());
      const int64_t so = src_offsets_[i], d = dst_offsets_[i], len = lengths_[i];
      OP_REQUIRES(ctx, so <= have && len <= have - so,
                  errors::InvalidArgument("DeepFreezeFusedCopy: value ", i, " (",
                                          DataTypeString(v.dtype()), v.shape().DebugString(),
                                          ", ", have, " bytes): piece [", so, ", ", so, " + ", len,
                                          ") is outside the value"));
      OP_REQUIRES(ctx, d <= capacity && len <= capacity - d,
                  errors::InvalidArgument("DeepFreezeFusedCopy: value ", i, ": destination [", d,
                                          ", ", d, " + ", len, ") is outside dest's ", capacity,
                                          " bytes"));
      total = len > std::numeric_limits<int64_t>::max() - total
                  ? std::numeric_limits<int64_t>::max() : total + len;  // saturating
    }

    Tensor* out = nullptr;  // allocated before the first write: a failure here writes nothing
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, ::tensorflow::TensorShape({}), &out));

    char* base = reinterpret_cast<char*>(static_cast<uintptr_t>(address));
    const int64_t stamp = step.scalar<int64_t>()();

    auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
    const int workers = pool != nullptr && pool->workers != nullptr ? pool->num_threads : 1;
    const int shards = threads_ == 0 ? workers : std::min(threads_, workers);  // threads_ >= 0
    if (total < kParallelMin || shards <= 1) {
      for (int i = 0; i < n; ++i) {
        if (lengths_[i] == 0) continue;
        CopyBytes(base + dst_offsets_[i], values[i]->tensor_data().data() + src_offsets_[i], lengths_[i],
                  stream_);
      }
    } else {
      std::vector<Chunk> chunks;
      chunks.reserve(static_cast<size_t>(total / kChunkBytes + n));
      for (int i = 0; i < n; ++i) {
        const char* src = values[i]->tensor_data().data() + src_offsets_[i];
        char* dst = base + dst_offsets_[i];
        for (int64_t off = 0; off < lengths_[i]; off += kChunkBytes) {
          chunks.push_back({dst + off, src + off, std::min(kChunkBytes, lengths_[i] - off)});
        }
      }
      const int64_t count = static_cast<int64_t>(chunks.size());
      // Contiguous runs of chunks per shard, at most `shards` of them.
      const int64_t per = (count + shards - 1) / shards;
      const bool stream = stream_;
      auto run = [&chunks, count, per, stream](int64_t s, int64_t e) {
        for (int64_t k = s * per; k < std::min(count, e * per); ++k) {
          CopyBytes(chunks[k].dst, chunks[k].src, chunks[k].len, stream);
        }
      };
      const int64_t nshards = (count + per - 1) / per;
      // One unit of work per shard; the cost says each is worth a thread of its own.
      pool->workers->ParallelFor(nshards, int64_t{1} << 30, run);
    }

    // The stamp goes last, after every piece (streamed stores fenced, worker shards joined): a
    // buffer showing step s holds all of step s's pieces.
    std::atomic_thread_fence(std::memory_order_release);
    unsigned char le[kStampBytes];
    for (int b = 0; b < kStampBytes; ++b) {
      le[b] = static_cast<unsigned char>(static_cast<uint64_t>(stamp) >> (8 * b));
    }
    std::memcpy(base, le, kStampBytes);
    out->scalar<int64_t>()() = stamp;
  }

 private:
  const int threads_;
  const bool stream_;
  std::vector<int64_t> src_offsets_, dst_offsets_, lengths_;
};

static std::vector<DataType> TypesAttr(OpKernelConstruction* ctx) {
  std::vector<DataType> types;
  ctx->GetAttr("T", &types).IgnoreError();  // a missing attr fails the list-length check
  return types;
}

class FusedCopyOp : public FusedCopyBase {
 public:
  explicit FusedCopyOp(OpKernelConstruction* ctx) : FusedCopyBase(ctx, TypesAttr(ctx), TypesAttr(ctx).size()) {}

  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::OpInputList values;
    OP_REQUIRES_OK(ctx, ctx->input_list("values", &values));
    std::vector<const Tensor*> v;
    v.reserve(values.size());
    for (int i = 0; i < values.size(); ++i) v.push_back(&values[i]);
    Copy(ctx, v);
  }
};

static int NAttr(OpKernelConstruction* ctx) {
  int n = 0;
  ctx->GetAttr("N", &n).IgnoreError();
  return n;
}

class FusedCopyVarsOp : public FusedCopyBase {
 public:
  explicit FusedCopyVarsOp(OpKernelConstruction* ctx) : FusedCopyBase(ctx, {}, static_cast<size_t>(NAttr(ctx))) {}

  void Compute(OpKernelContext* ctx) override {
    const int n = ctx->num_inputs() - 2;
    // References to each variable's current buffer, taken under its lock as ReadVariableOp
    // does: a later update that replaces a buffer (copy-on-write) does not touch these.
    std::vector<Tensor> held(static_cast<size_t>(n));
    std::vector<const Tensor*> v(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
      ::tensorflow::core::RefCountPtr<::tensorflow::Var> var;
      OP_REQUIRES_OK(ctx, ::tensorflow::LookupResource(ctx, ::tensorflow::HandleFromInput(ctx, 2 + i), &var));
      ::tensorflow::tf_shared_lock lock(*var->mu());
      OP_REQUIRES(ctx, var->tensor()->IsInitialized(),
                  errors::FailedPrecondition("DeepFreezeFusedCopyVars: variable ", i, " is not initialized"));
      held[i] = *var->tensor();
      v[i] = &held[i];
    }
    Copy(ctx, v);
  }
};

REGISTER_KERNEL_BUILDER(Name("DeepFreezeFusedCopy").Device(::tensorflow::DEVICE_CPU), FusedCopyOp);
REGISTER_KERNEL_BUILDER(Name("DeepFreezeFusedCopyVars").Device(::tensorflow::DEVICE_CPU).HostMemory("vars"),
                        FusedCopyVarsOp);

}  // namespace deepfreeze
