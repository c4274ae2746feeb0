// The resharding planner: from source and destination piece tables, one rank's copy segments,
// point-to-point messages and buckets. Every rank runs it on the same global tables, so the
// messages a rank sends are exactly those its peers expect to receive.
#include <algorithm>
#include <map>

#include "common/check.h"
#include "reshard/reshard.h"

namespace vf::reshard {
namespace {

constexpr int64_t kAlign = 16;  // byte alignment of every packed region (16-byte vector copies)
// Every byte count the plan derives (message offsets, slot sizes) is bounded by the bytes of one
// side's tensors; keeping those below 2^62 leaves room for alignment and sums without overflow.
constexpr int64_t kMaxBytes = int64_t{1} << 62;

int64_t align_up(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

struct Rect {
  int64_t r0, nr, c0, nc;
  bool empty() const { return nr <= 0 || nc <= 0; }
  int64_t area() const { return nr * nc; }
};

Rect intersect(const Rect& a, const Rect& b) {
  const int64_t r0 = std::max(a.r0, b.r0), r1 = std::min(a.r0 + a.nr, b.r0 + b.nr);
  const int64_t c0 = std::max(a.c0, b.c0), c1 = std::min(a.c0 + a.nc, b.c0 + b.nc);
  return {r0, r1 - r0, c0, c1 - c0};
}

// a minus b (b inside a): up to four rectangles (bands above and below, then left and right).
void subtract(const Rect& a, const Rect& b, std::vector<Rect>& out) {
  const int64_t a1 = a.r0 + a.nr, b1 = b.r0 + b.nr, ac1 = a.c0 + a.nc, bc1 = b.c0 + b.nc;
  if (b.r0 > a.r0) out.push_back({a.r0, b.r0 - a.r0, a.c0, a.nc});
  if (a1 > b1) out.push_back({b1, a1 - b1, a.c0, a.nc});
  if (b.c0 > a.c0) out.push_back({b.r0, b.nr, a.c0, b.c0 - a.c0});
  if (ac1 > bc1) out.push_back({b.r0, b.nr, bc1, ac1 - bc1});
}

struct PieceRow {
  int64_t logical, row0, nrows, col0, ncols, tensor, offset, pitch;
  Rect rect() const { return {row0, nrows, col0, ncols}; }
};

struct TensorRow {
  int64_t rank, numel, dtype, group;
};

const int64_t* table(const TensorRef& t, const char* name, int64_t cols) {
  VF_CHECK_TYPE(t.dtype == DType::i64, name, " must be an int64 tensor, got ", dtype_name(t.dtype));
  VF_CHECK(t.device == Device::cpu, name, " must be on the CPU");
  VF_CHECK(t.dim() == 2 && t.sizes[1] == cols, name, " must have shape [N, ", cols, "], got ", shape_str(t.sizes));
  VF_CHECK(t.is_contiguous(), name, " must be contiguous");
  return t.ptr<const int64_t>();
}

std::vector<TensorRow> read_tensors(const TensorRef& t, const char* what, const std::vector<std::string>& names,
                                    int64_t world) {
  const int64_t* p = table(t, what, kTensorCols);
  const int64_t n = t.sizes[0];
  VF_CHECK(static_cast<int64_t>(names.size()) == n, what, ": ", n, " tensors but ", names.size(), " names");
  std::vector<TensorRow> out(n);
  __int128 bytes = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* r = p + i * kTensorCols;
    out[i] = {r[kRank], r[kNumel], r[kDType], r[kGroup]};
    VF_CHECK(out[i].rank >= 0 && out[i].rank < world, what, " tensor ", names[i], ": rank ", out[i].rank,
             " outside [0, ", world, ")");
    VF_CHECK(out[i].numel >= 0, what, " tensor ", names[i], ": negative numel ", out[i].numel);
    VF_CHECK(out[i].dtype >= 0 && out[i].dtype <= static_cast<int64_t>(DType::boolean), what, " tensor ",
             names[i], ": unknown dtype code ", out[i].dtype);
    VF_CHECK(out[i].group >= 0, what, " tensor ", names[i], ": negative group ", out[i].group);
    bytes += static_cast<__int128>(out[i].numel) * dtype_size(static_cast<DType>(out[i].dtype));
    VF_CHECK(bytes <= kMaxBytes, what, " tensor ", names[i], ": numel ", out[i].numel, " takes the ", what,
             " tensors' bytes beyond 2^62");
  }
  return out;
}

std::vector<PieceRow> read_pieces(const TensorRef& t, const char* what, const std::vector<TensorRow>& tensors,
                                  const std::vector<std::string>& tnames, const std::vector<int64_t>& lrows,
                                  const std::vector<int64_t>& lcols, const std::vector<std::string>& lnames,
                                  bool allow_zero) {
  const int64_t* p = table(t, what, kPieceCols);
  const int64_t n = t.sizes[0], L = static_cast<int64_t>(lrows.size()), T = static_cast<int64_t>(tensors.size());
  std::vector<PieceRow> out(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* r = p + i * kPieceCols;
    PieceRow q{r[kLogical], r[kRow0], r[kNRows], r[kCol0], r[kNCols], r[kTensor], r[kOffset], r[kPitch]};
    VF_CHECK(q.tensor >= 0 && q.tensor < T, what, " piece ", i, ": tensor index ", q.tensor, " outside [0, ", T, ")");
    const std::string& tn = tnames[q.tensor];
    VF_CHECK(q.logical >= (allow_zero ? -1 : 0) && q.logical < L, what, " tensor ", tn, ": logical index ",
             q.logical, " outside [0, ", L, ")");
    VF_CHECK(q.row0 >= 0 && q.nrows >= 0 && q.col0 >= 0 && q.ncols >= 0 && q.offset >= 0, what, " tensor ", tn,
             ": negative row/col/offset in piece ", i);
    // Ends in 128-bit arithmetic: each term is below 2^63, so no sum or product here can wrap.
    using wide = __int128;
    if (q.logical >= 0) {
      VF_CHECK(wide{q.row0} + q.nrows <= lrows[q.logical] && wide{q.col0} + q.ncols <= lcols[q.logical], what,
               " tensor ", tn, ": piece ", i, " rows [", q.row0, ", +", q.nrows, ") x cols [", q.col0, ", +",
               q.ncols, ") outside ", lnames[q.logical], " of shape [", lrows[q.logical], ", ", lcols[q.logical],
               "]");
    }
    if (q.nrows > 1) {
      VF_CHECK(q.pitch >= q.ncols, what, " tensor ", tn, ": piece ", i, " has row pitch ", q.pitch, " < ", q.ncols,
               " columns");
    }
    if (q.nrows > 0 && q.ncols > 0) {
      const wide end = wide{q.offset} + wide{q.nrows - 1} * q.pitch + q.ncols;
      VF_CHECK(end <= tensors[q.tensor].numel, what, " tensor ", tn, ": piece ", i, " (offset ", q.offset,
               ", pitch ", q.pitch, ", ", q.nrows, " x ", q.ncols, ") ends past its ", tensors[q.tensor].numel,
               " elements");
    }
    out[i] = q;
  }
  return out;
}

bool convertible(int64_t a, int64_t b) {
  if (a == b) return true;
  return is_float(static_cast<DType>(a)) && is_float(static_cast<DType>(b));
}

// One rectangle moved from a source piece to a destination piece.
struct Transfer {
  int64_t src_piece, dst_piece;
  Rect rect;
  int64_t src_rank, dst_rank;
};

// The validated input tables.
struct Tables {
  std::vector<int64_t> lrows, lcols;
  std::vector<TensorRow> src_t, dst_t;
  std::vector<PieceRow> src_p, dst_p;
};

// Every destination element must be written exactly once: the pieces (zero padding included) of
// each destination tensor tile it, with no element covered twice and none left out. Each piece
// is a run of element intervals (one per row, or one in all when its rows are back to back).
void check_tiling(const Tables& in, const std::vector<std::string>& names) {
  struct Span {
    int64_t begin, end, piece;
  };
  std::vector<std::vector<Span>> spans(in.dst_t.size());
  for (size_t j = 0; j < in.dst_p.size(); ++j) {
    const PieceRow& d = in.dst_p[j];
    if (d.nrows == 0 || d.ncols == 0) continue;
    auto& out = spans[d.tensor];
    const auto piece = static_cast<int64_t>(j);
    if (d.nrows == 1 || d.pitch == d.ncols) {
      out.push_back({d.offset, d.offset + d.nrows * d.ncols, piece});  // bounds checked by read_pieces
      continue;
    }
    for (int64_t r = 0; r < d.nrows; ++r) out.push_back({d.offset + r * d.pitch, d.offset + r * d.pitch + d.ncols, piece});
  }
  for (size_t i = 0; i < spans.size(); ++i) {
    auto& s = spans[i];
    std::sort(s.begin(), s.end(), [](const Span& x, const Span& y) { return x.begin < y.begin; });
    int64_t covered = 0;  // elements [0, covered) are written by the spans so far
    for (size_t k = 0; k < s.size(); ++k) {
      VF_CHECK(s[k].begin >= covered, "destination tensor ", names[i], ": destination pieces ",
               s[k - 1].piece, " and ", s[k].piece, " both write element ", s[k].begin,
               " (pieces of a destination must not overlap)");
      VF_CHECK(s[k].begin == covered, "destination tensor ", names[i], ": elements [", covered, ", ", s[k].begin,
               ") are written by no piece (add zero padding pieces for them)");
      covered = s[k].end;
    }
    VF_CHECK(covered == in.dst_t[i].numel, "destination tensor ", names[i], ": elements [", covered, ", ",
             in.dst_t[i].numel, ") are written by no piece (add zero padding pieces for them)");
  }
}

Tables read_tables(const PlanArgs& a, int64_t world) {
  Tables in;
  const int64_t* ls = table(a.logical_shapes, "logical_shapes", 2);
  const int64_t L = a.logical_shapes.sizes[0];
  VF_CHECK(static_cast<int64_t>(a.logical_names.size()) == L, "logical_shapes has ", L, " rows but ",
           a.logical_names.size(), " names");
  in.lrows.resize(L);
  in.lcols.resize(L);
  for (int64_t i = 0; i < L; ++i) {
    in.lrows[i] = ls[2 * i];
    in.lcols[i] = ls[2 * i + 1];
    VF_CHECK(in.lrows[i] >= 0 && in.lcols[i] >= 1, "logical tensor ", a.logical_names[i], ": bad 2-D shape [",
             in.lrows[i], ", ", in.lcols[i], "]");
  }
  in.src_t = read_tensors(a.src_tensors, "source", a.src_names, world);
  in.dst_t = read_tensors(a.dst_tensors, "destination", a.dst_names, world);
  in.src_p = read_pieces(a.src_pieces, "source", in.src_t, a.src_names, in.lrows, in.lcols, a.logical_names, false);
  in.dst_p = read_pieces(a.dst_pieces, "destination", in.dst_t, a.dst_names, in.lrows, in.lcols, a.logical_names, true);
  check_tiling(in, a.dst_names);
  return in;
}

// Covers every destination piece with source pieces of its logical tensor: the destination rank's
// own pieces first, then peers in ring order from it (spreads the load when several ranks hold the
// same bytes). Throws, naming the tensor, when some rows are held by no source.
std::vector<Transfer> cover(const Tables& in, const PlanArgs& a, int64_t world) {
  std::vector<std::vector<int64_t>> by_logical(in.lrows.size());
  for (size_t i = 0; i < in.src_p.size(); ++i) by_logical[in.src_p[i].logical].push_back(static_cast<int64_t>(i));
  std::vector<Transfer> transfers;
  std::vector<int64_t> order;
  std::vector<Rect> remaining, next;
  for (size_t j = 0; j < in.dst_p.size(); ++j) {
    const PieceRow& d = in.dst_p[j];
    if (d.logical < 0 || d.nrows == 0 || d.ncols == 0) continue;
    const int64_t drank = in.dst_t[d.tensor].rank;
    const auto ring = [&](int64_t s) { return (in.src_t[in.src_p[s].tensor].rank - drank + world) % world; };
    order = by_logical[d.logical];
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return ring(x) < ring(y); });
    remaining.assign(1, d.rect());
    for (int64_t s : order) {
      if (remaining.empty()) break;
      next.clear();
      for (const Rect& r : remaining) {
        const Rect part = intersect(r, in.src_p[s].rect());
        if (part.empty()) {
          next.push_back(r);
          continue;
        }
        const TensorRow& st = in.src_t[in.src_p[s].tensor];
        VF_CHECK(convertible(st.dtype, in.dst_t[d.tensor].dtype), "cannot convert ", a.src_names[in.src_p[s].tensor],
                 " (", dtype_name(static_cast<DType>(st.dtype)), ") to ", a.dst_names[d.tensor], " (",
                 dtype_name(static_cast<DType>(in.dst_t[d.tensor].dtype)), ")");
        transfers.push_back({s, static_cast<int64_t>(j), part, st.rank, drank});
        subtract(r, part, next);
      }
      remaining.swap(next);
    }
    if (!remaining.empty()) {
      const Rect& r = remaining.front();
      throw ValueError(cat("no source holds rows [", r.r0, ", ", r.r0 + r.nr, ") x cols [", r.c0, ", ", r.c0 + r.nc,
                           ") of ", a.logical_names[d.logical], " needed by ", a.dst_names[d.tensor], " on rank ",
                           drank, " (missing shard?)"));
    }
  }
  return transfers;
}

int32_t dst_dtype(const Tables& in, const Transfer& t) {
  return static_cast<int32_t>(in.dst_t[in.dst_p[t.dst_piece].tensor].dtype);
}

int64_t group_of(const Tables& in, const Transfer& t) { return in.dst_t[in.dst_p[t.dst_piece].tensor].group; }

// Bytes of a transfer on the wire (in the destination dtype), padded to keep regions aligned.
int64_t wire_bytes(const Tables& in, const Transfer& t) {
  return align_up(t.rect.area() * elem_size(dst_dtype(in, t)));
}

// Buckets over destination groups, in group order: a bucket closes when some rank would receive
// more than bucket_bytes in it (a group larger than that gets a bucket of its own).
std::map<int64_t, int64_t> assign_buckets(const Tables& in, const std::vector<Transfer>& transfers,
                                          int64_t bucket_bytes, std::vector<Bucket>& buckets) {
  std::map<int64_t, std::map<int64_t, int64_t>> group_recv;  // group -> rank -> bytes
  for (const auto& d : in.dst_p) group_recv[in.dst_t[d.tensor].group];
  for (const auto& t : transfers)
    if (t.src_rank != t.dst_rank) group_recv[group_of(in, t)][t.dst_rank] += wire_bytes(in, t);
  std::map<int64_t, int64_t> bucket_of, running;
  int64_t b = 0;
  for (const auto& [g, per_rank] : group_recv) {
    bool over = false;
    for (const auto& [r, bytes] : per_rank) over |= running[r] + bytes > bucket_bytes;
    if (over && !bucket_of.empty()) {
      ++b;
      running.clear();
    }
    for (const auto& [r, bytes] : per_rank) running[r] += bytes;
    bucket_of[g] = b;
  }
  buckets.assign(group_recv.empty() ? 0 : b + 1, Bucket{});
  for (const auto& [g, bb] : bucket_of) buckets[bb].groups.push_back(g);
  return bucket_of;
}

// Where a rank's tensors sit in the pointer table.
struct Slots {
  std::vector<int64_t> src, dst;  // global index -> local slot (-1: another rank's)
  int32_t S = 0, D = 0;
};

// The tensors of `rank` on one side; returns each global tensor's local slot (-1: another rank's).
std::vector<int64_t> take_local(const std::vector<TensorRow>& tensors, const std::vector<std::string>& names,
                                int64_t rank, LocalTensors& out) {
  std::vector<int64_t> slot(tensors.size(), -1);
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].rank != rank) continue;
    slot[i] = out.size();
    out.ids.push_back(static_cast<int64_t>(i));
    out.dtypes.push_back(static_cast<int32_t>(tensors[i].dtype));
    out.numels.push_back(tensors[i].numel);
    out.names.push_back(names[i]);
  }
  return slot;
}

// One bucket of one rank: its messages and the segments of its two phases.
struct BucketWork {
  std::vector<Segment> pack, copy_local, copy_received;  // copy_local needs nothing from other ranks
  int64_t local_bytes = 0, received_bytes = 0, zero_bytes = 0;
};

BucketWork build_bucket(int64_t b, const Tables& in, const std::vector<Transfer>& transfers,
                        const std::vector<int64_t>& mine, const std::vector<int64_t>& zeros, const Slots& sl,
                        int64_t rank, Bucket& bk) {
  BucketWork w;
  const int32_t send_slot = sl.S + sl.D + static_cast<int32_t>(b % 2);
  const int32_t recv_slot = sl.S + sl.D + 2 + static_cast<int32_t>(b % 2);
  auto src_side = [&](const Transfer& t, Segment& s) {
    const PieceRow& p = in.src_p[t.src_piece];
    s.src = static_cast<int32_t>(sl.src[p.tensor]);
    s.src_dtype = static_cast<int32_t>(in.src_t[p.tensor].dtype);
    s.src_off = p.offset + (t.rect.r0 - p.row0) * p.pitch + (t.rect.c0 - p.col0);
    s.src_pitch = p.pitch;
  };
  auto dst_side = [&](const Transfer& t, Segment& s) {
    const PieceRow& p = in.dst_p[t.dst_piece];
    s.dst = static_cast<int32_t>(sl.S + sl.dst[p.tensor]);
    s.dst_dtype = static_cast<int32_t>(in.dst_t[p.tensor].dtype);
    s.dst_off = p.offset + (t.rect.r0 - p.row0) * p.pitch + (t.rect.c0 - p.col0);
    s.dst_pitch = p.pitch;
  };
  // Messages: peers in ascending order, regions in transfer order (the same on both ends), each
  // region packed densely in the destination dtype at a 16-byte aligned offset.
  std::map<int64_t, std::vector<int64_t>> to_peer, from_peer;
  for (int64_t i : mine) {
    const Transfer& t = transfers[i];
    if (t.src_rank == rank && t.dst_rank != rank) to_peer[t.dst_rank].push_back(i);
    if (t.dst_rank == rank && t.src_rank != rank) from_peer[t.src_rank].push_back(i);
  }
  for (int side = 0; side < 2; ++side) {
    int64_t offset = 0;
    for (const auto& [peer, list] : side == 0 ? to_peer : from_peer) {
      const int64_t start = offset;
      for (int64_t i : list) {
        const Transfer& t = transfers[i];
        Segment s{};
        const int32_t dt = dst_dtype(in, t);
        if (side == 0) {
          src_side(t, s);
          s.dst = send_slot, s.dst_dtype = dt, s.dst_off = offset / elem_size(dt), s.dst_pitch = t.rect.nc;
        } else {
          dst_side(t, s);
          s.src = recv_slot, s.src_dtype = dt, s.src_off = offset / elem_size(dt), s.src_pitch = t.rect.nc;
          w.received_bytes += t.rect.area() * elem_size(dt);
        }
        s.rows = t.rect.nr, s.width = t.rect.nc;
        (side == 0 ? w.pack : w.copy_received).push_back(s);
        offset += wire_bytes(in, t);
      }
      (side == 0 ? bk.sends : bk.recvs).push_back({peer, start, offset - start});
    }
    (side == 0 ? bk.send_bytes : bk.recv_bytes) = offset;
  }
  for (int64_t i : mine) {
    const Transfer& t = transfers[i];
    if (t.src_rank != rank || t.dst_rank != rank) continue;
    Segment s{};
    src_side(t, s);
    dst_side(t, s);
    s.rows = t.rect.nr, s.width = t.rect.nc;
    w.copy_local.push_back(s);
    w.local_bytes += t.rect.area() * elem_size(s.dst_dtype);
  }
  for (int64_t j : zeros) {
    const PieceRow& p = in.dst_p[j];
    Segment s{};
    s.src = -1;
    s.dst = static_cast<int32_t>(sl.S + sl.dst[p.tensor]);
    s.src_dtype = s.dst_dtype = static_cast<int32_t>(in.dst_t[p.tensor].dtype);
    s.dst_off = p.offset, s.dst_pitch = p.pitch, s.rows = p.nrows, s.width = p.ncols;
    w.copy_local.push_back(s);
    w.zero_bytes += p.nrows * p.ncols * elem_size(s.dst_dtype);
  }
  return w;
}

// Tiles of a segment: rows grouped up to tile_bytes; rows wider than that split in columns.
// Contiguous segments become one long row first.
void add_tiles(std::vector<Segment>& segs, int64_t tile_bytes, std::vector<Segment>& all, std::vector<Tile>& tiles) {
  for (Segment s : segs) {
    if (s.rows == 1 || (s.src_pitch == s.width && s.dst_pitch == s.width)) {
      s.width *= s.rows;
      s.rows = 1;
      s.src_pitch = s.dst_pitch = s.width;
    }
    const int64_t seg = static_cast<int64_t>(all.size());
    all.push_back(s);
    const int64_t esz = std::max(elem_size(s.src_dtype), elem_size(s.dst_dtype));
    const int64_t row_bytes = s.width * esz;
    if (row_bytes >= tile_bytes) {
      const int64_t chunk = std::max<int64_t>(kAlign, tile_bytes / esz / kAlign * kAlign);
      for (int64_t r = 0; r < s.rows; ++r)
        for (int64_t c = 0; c < s.width; c += chunk) tiles.push_back({seg, r, 1, c, std::min(chunk, s.width - c)});
    } else {
      const int64_t per = std::max<int64_t>(1, tile_bytes / std::max<int64_t>(row_bytes, 1));
      for (int64_t r = 0; r < s.rows; r += per) tiles.push_back({seg, r, std::min(per, s.rows - r), 0, s.width});
    }
  }
}

}  // namespace

const Bucket& Plan::bucket(int64_t b) const {
  VF_CHECK(b >= 0 && b < num_buckets(), "bucket ", b, " outside [0, ", num_buckets(), ")");
  return buckets_[b];
}

Plan::Plan(const PlanArgs& a) : rank_(a.rank), world_(a.world_size), tile_bytes_(a.tile_bytes) {
  VF_CHECK(world_ >= 1, "world_size must be >= 1, got ", world_);
  VF_CHECK(rank_ >= 0 && rank_ < world_, "rank must be in [0, ", world_, "), got ", rank_);
  VF_CHECK(a.bucket_bytes > 0, "bucket_bytes must be > 0, got ", a.bucket_bytes);
  VF_CHECK(a.tile_bytes >= kAlign && a.tile_bytes <= (int64_t{1} << 30), "tile_bytes must be in [", kAlign,
           ", 2^30], got ", a.tile_bytes);
  const Tables in = read_tables(a, world_);
  const std::vector<Transfer> transfers = cover(in, a, world_);
  const std::map<int64_t, int64_t> bucket_of = assign_buckets(in, transfers, a.bucket_bytes, buckets_);

  Slots sl;
  sl.src = take_local(in.src_t, a.src_names, rank_, src_);
  sl.dst = take_local(in.dst_t, a.dst_names, rank_, dst_);
  sl.S = static_cast<int32_t>(src_.size());
  sl.D = static_cast<int32_t>(dst_.size());

  // Transfers and zero padding of each bucket, in (destination piece, discovery) order.
  std::vector<std::vector<int64_t>> mine(buckets_.size()), zeros(buckets_.size());
  for (size_t i = 0; i < transfers.size(); ++i)
    if (transfers[i].src_rank == rank_ || transfers[i].dst_rank == rank_)
      mine[bucket_of.at(group_of(in, transfers[i]))].push_back(static_cast<int64_t>(i));
  for (size_t j = 0; j < in.dst_p.size(); ++j) {
    const PieceRow& p = in.dst_p[j];
    if (p.logical < 0 && in.dst_t[p.tensor].rank == rank_ && p.nrows > 0 && p.ncols > 0)
      zeros[bucket_of.at(in.dst_t[p.tensor].group)].push_back(static_cast<int64_t>(j));
  }
  for (int64_t b = 0; b < num_buckets(); ++b) {
    Bucket& bk = buckets_[b];
    BucketWork w = build_bucket(b, in, transfers, mine[b], zeros[b], sl, rank_, bk);
    local_bytes_ += w.local_bytes;
    received_bytes_ += w.received_bytes;
    zero_bytes_ += w.zero_bytes;
    max_send_ = std::max(max_send_, bk.send_bytes);
    max_recv_ = std::max(max_recv_, bk.recv_bytes);
    bk.pack_tiles_begin = static_cast<int64_t>(tiles_.size());
    add_tiles(w.pack, a.tile_bytes, segments_, tiles_);
    bk.pack_tiles_end = bk.copy_tiles_begin = static_cast<int64_t>(tiles_.size());
    add_tiles(w.copy_local, a.tile_bytes, segments_, tiles_);
    bk.copy_received_begin = static_cast<int64_t>(tiles_.size());
    add_tiles(w.copy_received, a.tile_bytes, segments_, tiles_);
    bk.copy_tiles_end = static_cast<int64_t>(tiles_.size());
    const Phase phases[3] = {Phase::pack, Phase::copy_local, Phase::copy_received};
    for (int k = 0; k < 3; ++k) {
      std::vector<char> seen(sl.S + sl.D + 4, 0);
      const auto [begin, end] = tile_range(bk, phases[k]);
      for (int64_t t = begin; t < end; ++t) {
        const Segment& s = segments_[tiles_[t].seg];
        for (int32_t slot : {s.src, s.dst})
          if (slot >= 0 && !seen[slot]) seen[slot] = 1, bk.touched[k].push_back(slot);
        bk.bytes[k] += tiles_[t].nrows * tiles_[t].ncols * elem_size(s.dst_dtype);
      }
    }
  }
}

}  // namespace vf::reshard
