// The resharding engine: moves model weights from one layout (HF, FSDP shards, Megatron TP/PP
// shards) to another (vLLM's fused, tensor-parallel layout) with only the bytes each rank needs.
//
// Model of a layout. Every parameter of the model is a *logical* tensor viewed as 2-D
// [rows, cols] (its last dimension is cols; 1-D tensors are [n, 1]). Every tensor a rank actually
// holds (a *physical* tensor) is described by *pieces*: a rectangle of one logical tensor
// (rows [row0, row0 + nrows) x cols [col0, col0 + ncols)) stored at element `offset` of the
// physical tensor with row pitch `pitch`. Fused, interleaved, row/column-split, flat-sharded and
// vocab-padded layouts are all lists of such pieces; a piece with logical = -1 is zero padding.
//
// The planner (planner.cpp) intersects, for one rank, every destination piece with the source
// pieces of the same logical tensor, preferring pieces the rank holds itself, and emits copy
// segments (2-D strided copies) and the minimal point-to-point messages, grouped into buckets.
// Python drives the collectives; the executors (executor.cpp on CPU threads, reshard.cu as one
// multi-segment kernel per phase) do every copy. No torch headers, no NCCL here.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/tensor.h"

namespace vf::reshard {

// Columns of the int64 piece table passed from Python: [N, kPieceCols].
enum PieceCol : int { kLogical, kRow0, kNRows, kCol0, kNCols, kTensor, kOffset, kPitch, kPieceCols };
// Columns of the int64 tensor table: [T, kTensorCols]. `group` keys the bucketing (destinations).
enum TensorCol : int { kRank, kNumel, kDType, kGroup, kTensorCols };

// PlanArgs' fields, listed once: X(type, name, default, doc); the struct and its Python binding
// (reshard/bindings.cpp) are generated from this list.
#define VF_PLAN_ARGS_FIELDS(X)                                                                        \
  X(TensorRef, logical_shapes, {}, "int64 [L, 2]: rows, cols of each logical tensor")                 \
  X(std::vector<std::string>, logical_names, {}, "[L], for messages")                                 \
  X(TensorRef, src_tensors, {}, "int64 [S, tensor_cols]")                                             \
  X(TensorRef, src_pieces, {}, "int64 [Ns, piece_cols]")                                              \
  X(TensorRef, dst_tensors, {}, "int64 [D, tensor_cols]")                                             \
  X(TensorRef, dst_pieces, {}, "int64 [Nd, piece_cols]")                                              \
  X(std::vector<std::string>, src_names, {}, "[S]")                                                   \
  X(std::vector<std::string>, dst_names, {}, "[D]")                                                   \
  X(int64_t, rank, 0, "this rank")                                                                    \
  X(int64_t, world_size, 1, "ranks the layouts span")                                                 \
  X(int64_t, bucket_bytes, 256ll << 20, "max bytes any rank receives per bucket (staging memory)")    \
  X(int64_t, tile_bytes, 256ll << 10, "work unit of the executors")

struct PlanArgs {
  VF_PLAN_ARGS_FIELDS(VF_RECORD_FIELD)
};

// Pointer-table slots: [local sources..., local destinations..., send slot 0/1, recv slot 0/1].
// A segment copies rows x width elements from table[src] + src_off (row pitch src_pitch) to
// table[dst] + dst_off (row pitch dst_pitch), converting src_dtype -> dst_dtype. Offsets and
// pitches are in elements of the respective tensor. src = -1: fill with zeros.
struct Segment {
  int32_t src, dst;
  int32_t src_dtype, dst_dtype;  // vf::DType
  int64_t src_off, dst_off;
  int64_t src_pitch, dst_pitch;
  int64_t rows, width;
};

// A contiguous share of one segment: rows [row0, row0 + nrows) x cols [col0, col0 + ncols).
struct Tile {
  int64_t seg;
  int64_t row0, nrows;
  int64_t col0, ncols;
};

struct Message {
  int64_t peer;
  int64_t offset;  // bytes, in this bucket's send or receive slot
  int64_t bytes;
};

struct Bucket {
  std::vector<Message> sends, recvs;
  int64_t send_bytes = 0, recv_bytes = 0;
  int64_t pack_tiles_begin = 0, pack_tiles_end = 0;  // into Plan::tiles (segments packing sends)
  int64_t copy_tiles_begin = 0, copy_tiles_end = 0;  // (segments writing destinations):
  int64_t copy_received_begin = 0;  // [copy_tiles_begin, here) read local data, [here, end) received
  std::vector<int64_t> groups;                       // destination groups in this bucket
  // Pointer-table slots the tiles of each phase read or write: pack, copy_local, copy_received.
  std::vector<int32_t> touched[3];
  int64_t bytes[3] = {0, 0, 0};  // bytes each phase writes (the CPU executor sizes its threads by it)
};

// copy = copy_local then copy_received; the split lets local copies overlap the exchange.
enum class Phase : int { pack = 0, copy = 1, copy_local = 2, copy_received = 3 };

struct CudaTables;  // device copies of segments/tiles/pointers (reshard.cu)
void free_cuda_tables(CudaTables* t);
struct CudaTablesDeleter {
  void operator()(CudaTables* t) const { free_cuda_tables(t); }
};

// The tensors one rank holds on one side of a plan, in pointer-table order.
struct LocalTensors {
  std::vector<int64_t> ids;        // global indices in the side's tensor table
  std::vector<int32_t> dtypes;     // vf::DType
  std::vector<int64_t> numels;
  std::vector<std::string> names;
  int64_t size() const { return static_cast<int64_t>(ids.size()); }
};

class Plan {
 public:
  // Builds the plan of `args.rank`. Throws ValueError naming the tensor on bad input.
  explicit Plan(const PlanArgs& args);

  int64_t rank() const { return rank_; }
  int64_t world_size() const { return world_; }
  int64_t num_buckets() const { return static_cast<int64_t>(buckets_.size()); }
  const Bucket& bucket(int64_t b) const;
  const std::vector<int64_t>& local_sources() const { return src_.ids; }       // global src ids
  const std::vector<int64_t>& local_destinations() const { return dst_.ids; }  // global dst ids
  int64_t max_send_bytes() const { return max_send_; }
  int64_t max_recv_bytes() const { return max_recv_; }
  // Bytes this rank copies from its own sources / receives / zero-fills, summed over buckets.
  int64_t local_bytes() const { return local_bytes_; }
  int64_t received_bytes() const { return received_bytes_; }
  int64_t zero_bytes() const { return zero_bytes_; }
  const std::vector<Segment>& segments() const { return segments_; }
  const std::vector<Tile>& tiles() const { return tiles_; }

  // Binds the tensors the next runs use: local sources and destinations in the order of
  // local_sources() / local_destinations(), two send and two receive byte buffers (slot b % 2).
  // Checks count, dtype, numel, contiguity and that all live on one device.
  void bind(std::vector<TensorRef> sources, std::vector<TensorRef> destinations,
            const std::vector<TensorRef>& send_slots, const std::vector<TensorRef>& recv_slots);
  // Runs one phase of one bucket: pack (sources -> send slot) or copy (sources, receive slot and
  // zeros -> destinations). CPU: up to `num_threads` threads (fewer for small phases); CUDA: one
  // launch on `stream`.
  void run(int64_t bucket, Phase phase, uintptr_t stream, int num_threads);
  // Binds new destinations without converting one tensor each: destination i is the bytes of
  // `buffer` (1-D, the destinations' one dtype, contiguous) from element offsets[i]; the sources
  // and slots stay as bound. Checks the dtype, the size, the alignment and the device.
  void bind_destinations_in(const TensorRef& buffer, const std::vector<int64_t>& offsets);
  // The pointer table bind() filled, and a name for each entry ("destination model.norm.weight").
  const std::vector<TensorRef>& bound() const { return bound_; }
  std::string bound_name(int64_t i) const;
  // The slots a run of `phase` on bucket `b` reads or writes (copy: copy_local's then copy_received's).
  std::vector<int32_t> touched(int64_t b, Phase phase) const;

 private:
  void check_bound(const char* what) const;
  std::pair<int64_t, int64_t> tile_range(const Bucket& bk, Phase phase) const;  // [begin, end) in tiles_
#if defined(VF_WITH_CUDA)
  void run_cuda(int64_t begin, int64_t end, const std::vector<void*>& ptrs, uintptr_t stream);  // reshard.cu
#endif

  int64_t rank_ = 0, world_ = 1;
  int64_t tile_bytes_ = 0;
  std::vector<Bucket> buckets_;
  std::vector<Segment> segments_;
  std::vector<Tile> tiles_;
  LocalTensors src_, dst_;
  int64_t max_send_ = 0, max_recv_ = 0;
  int64_t local_bytes_ = 0, received_bytes_ = 0, zero_bytes_ = 0;

  std::vector<TensorRef> bound_;  // pointer table, bound by bind()
  Device device_ = Device::cpu;
  int device_index_ = -1;
  std::unique_ptr<CudaTables, CudaTablesDeleter> cuda_;
};

// Shared by both executors: the element size of a vf::DType code.
inline int64_t elem_size(int32_t dtype) { return dtype_size(static_cast<DType>(dtype)); }

// CPU executor: runs tiles [begin, end) with the pointer table `ptrs` on `num_threads` threads.
void run_tiles_cpu(const Segment* segs, const Tile* tiles, int64_t begin, int64_t end, void* const* ptrs,
                   int num_threads);

}  // namespace vf::reshard
