// The resharding planner: from source and destination piece tables, one rank's copy segments,
// point-to-point messages and buckets. Every rank runs it on the same global tables, so the
// messages a rank sends are exactly those its peers expect to receive.
#include <algorithm>
#include <map>
#include <numeric>

#include "common/check.h"
#include "reshard/reshard.h"

namespace vf::reshard {
namespace {

constexpr int64_t kAlign = 16;  // byte alignment of every packed region (16-byte vector copies)

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
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* r = p + i * kTensorCols;
    out[i] = {r[kRank], r[kNumel], r[kDType], r[kGroup]};
    VF_CHECK(out[i].rank >= 0 && out[i].rank < world, what, " tensor ", names[i], ": rank ", out[i].rank,
             " outside [0, ", world, ")");
    VF_CHECK(out[i].numel >= 0, what, " tensor ", names[i], ": negative numel ", out[i].numel);
    VF_CHECK(out[i].dtype >= 0 && out[i].dtype <= static_cast<int64_t>(DType::boolean), what, " tensor ",
             names[i], ": unknown dtype code ", out[i].dtype);
    VF_CHECK(out[i].group >= 0, what, " tensor ", names[i], ": negative group ", out[i].group);
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
             ": negative row/col/offset in a piece");
    if (q.logical >= 0) {
      VF_CHECK(q.row0 + q.nrows <= lrows[q.logical] && q.col0 + q.ncols <= lcols[q.logical], what, " tensor ", tn,
               ": piece rows [", q.row0, ", ", q.row0 + q.nrows, ") x cols [", q.col0, ", ", q.col0 + q.ncols,
               ") outside ", lnames[q.logical], " of shape [", lrows[q.logical], ", ", lcols[q.logical], "]");
    }
    if (q.nrows > 1) {
      VF_CHECK(q.pitch >= q.ncols, what, " tensor ", tn, ": row pitch ", q.pitch, " < ", q.ncols, " columns");
    }
    if (q.nrows > 0 && q.ncols > 0) {
      const int64_t end = q.offset + (q.nrows - 1) * q.pitch + q.ncols;
      VF_CHECK(end <= tensors[q.tensor].numel, what, " tensor ", tn, ": a piece ends at element ", end,
               " past its ", tensors[q.tensor].numel, " elements");
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

}  // namespace

const Bucket& Plan::bucket(int64_t b) const {
  VF_CHECK(b >= 0 && b < num_buckets(), "bucket ", b, " outside [0, ", num_buckets(), ")");
  return buckets_[b];
}

Plan::Plan(const PlanArgs& a) : rank_(a.rank), world_(a.world_size) {
  VF_CHECK(world_ >= 1, "world_size must be >= 1, got ", world_);
  VF_CHECK(rank_ >= 0 && rank_ < world_, "rank must be in [0, ", world_, "), got ", rank_);
  VF_CHECK(a.bucket_bytes > 0, "bucket_bytes must be > 0, got ", a.bucket_bytes);
  VF_CHECK(a.tile_bytes >= kAlign && a.tile_bytes <= (int64_t{1} << 30), "tile_bytes must be in [", kAlign,
           ", 2^30], got ", a.tile_bytes);
  plan_transfers(a);
}

void Plan::plan_transfers(const PlanArgs& a) {
  const int64_t* ls = table(a.logical_shapes, "logical_shapes", 2);
  const int64_t L = a.logical_shapes.sizes[0];
  VF_CHECK(static_cast<int64_t>(a.logical_names.size()) == L, "logical_shapes has ", L, " rows but ",
           a.logical_names.size(), " names");
  std::vector<int64_t> lrows(L), lcols(L);
  for (int64_t i = 0; i < L; ++i) {
    lrows[i] = ls[2 * i];
    lcols[i] = ls[2 * i + 1];
    VF_CHECK(lrows[i] >= 0 && lcols[i] >= 1, "logical tensor ", a.logical_names[i], ": bad 2-D shape [", lrows[i],
             ", ", lcols[i], "]");
  }
  const auto src_t = read_tensors(a.src_tensors, "source", a.src_names, world_);
  const auto dst_t = read_tensors(a.dst_tensors, "destination", a.dst_names, world_);
  const auto src_p = read_pieces(a.src_pieces, "source", src_t, a.src_names, lrows, lcols, a.logical_names, false);
  const auto dst_p = read_pieces(a.dst_pieces, "destination", dst_t, a.dst_names, lrows, lcols, a.logical_names, true);

  // Every destination element is written exactly once when the pieces (zero padding included)
  // tile each destination tensor; the layout builders guarantee no overlap, this checks the total.
  std::vector<int64_t> covered(dst_t.size(), 0);
  for (const auto& d : dst_p) covered[d.tensor] += d.nrows * d.ncols;
  for (int64_t i = 0; i < static_cast<int64_t>(dst_t.size()); ++i)
    VF_CHECK(covered[i] == dst_t[i].numel, "destination tensor ", a.dst_names[i], ": its pieces cover ", covered[i],
             " of its ", dst_t[i].numel, " elements");

  // Source pieces of each logical tensor.
  std::vector<std::vector<int64_t>> by_logical(L);
  for (int64_t i = 0; i < static_cast<int64_t>(src_p.size()); ++i) by_logical[src_p[i].logical].push_back(i);

  // Cover every destination piece, local sources first, then peers in ring order from the
  // destination rank (spreads the load when several ranks hold the same bytes).
  std::vector<Transfer> transfers;
  std::vector<int64_t> order;
  std::vector<Rect> remaining, next;
  for (int64_t j = 0; j < static_cast<int64_t>(dst_p.size()); ++j) {
    const PieceRow& d = dst_p[j];
    if (d.logical < 0 || d.nrows == 0 || d.ncols == 0) continue;
    const int64_t drank = dst_t[d.tensor].rank;
    const auto& cands = by_logical[d.logical];
    order.assign(cands.begin(), cands.end());
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
      const int64_t rx = (src_t[src_p[x].tensor].rank - drank + world_) % world_;
      const int64_t ry = (src_t[src_p[y].tensor].rank - drank + world_) % world_;
      return rx < ry;
    });
    remaining.assign(1, d.rect());
    for (int64_t s : order) {
      if (remaining.empty()) break;
      const Rect sr = src_p[s].rect();
      next.clear();
      for (const Rect& r : remaining) {
        const Rect in = intersect(r, sr);
        if (in.empty()) {
          next.push_back(r);
          continue;
        }
        const TensorRow& st = src_t[src_p[s].tensor];
        VF_CHECK(convertible(st.dtype, dst_t[d.tensor].dtype), "cannot convert ", a.src_names[src_p[s].tensor],
                 " (", dtype_name(static_cast<DType>(st.dtype)), ") to ", a.dst_names[d.tensor], " (",
                 dtype_name(static_cast<DType>(dst_t[d.tensor].dtype)), ")");
        transfers.push_back({s, j, in, st.rank, drank});
        subtract(r, in, next);
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

  // Buckets over destination groups, in group order: a bucket closes when some rank would receive
  // more than bucket_bytes in it (a group larger than that gets a bucket of its own).
  auto wire_bytes = [&](const Transfer& t) {
    return align_up(t.rect.area() * elem_size(static_cast<int32_t>(dst_t[dst_p[t.dst_piece].tensor].dtype)));
  };
  std::map<int64_t, std::map<int64_t, int64_t>> group_recv;  // group -> rank -> bytes
  for (const auto& d : dst_p) group_recv[dst_t[d.tensor].group];
  for (const auto& t : transfers)
    if (t.src_rank != t.dst_rank) group_recv[dst_t[dst_p[t.dst_piece].tensor].group][t.dst_rank] += wire_bytes(t);
  std::map<int64_t, int64_t> bucket_of;
  {
    std::map<int64_t, int64_t> running;
    int64_t b = 0;
    bool empty = true;
    for (const auto& [g, per_rank] : group_recv) {
      bool over = false;
      for (const auto& [r, bytes] : per_rank) over |= running[r] + bytes > a.bucket_bytes;
      if (over && !empty) {
        ++b;
        running.clear();
      }
      for (const auto& [r, bytes] : per_rank) running[r] += bytes;
      bucket_of[g] = b;
      empty = false;
    }
    buckets_.resize(group_recv.empty() ? 0 : b + 1);
    for (const auto& [g, bb] : bucket_of) buckets_[bb].groups.push_back(g);
  }

  // Local slots.
  std::vector<int64_t> src_slot(src_t.size(), -1), dst_slot(dst_t.size(), -1);
  for (int64_t i = 0; i < static_cast<int64_t>(src_t.size()); ++i)
    if (src_t[i].rank == rank_) {
      src_slot[i] = static_cast<int64_t>(local_src_.size());
      local_src_.push_back(i);
      src_dtype_.push_back(static_cast<int32_t>(src_t[i].dtype));
      src_numel_.push_back(src_t[i].numel);
      src_names_.push_back(a.src_names[i]);
    }
  for (int64_t i = 0; i < static_cast<int64_t>(dst_t.size()); ++i)
    if (dst_t[i].rank == rank_) {
      dst_slot[i] = static_cast<int64_t>(local_dst_.size());
      local_dst_.push_back(i);
      dst_dtype_.push_back(static_cast<int32_t>(dst_t[i].dtype));
      dst_numel_.push_back(dst_t[i].numel);
      dst_names_.push_back(a.dst_names[i]);
    }
  const int32_t S = static_cast<int32_t>(local_src_.size()), D = static_cast<int32_t>(local_dst_.size());

  // Transfers of each bucket in (destination piece, discovery) order, identical on every rank.
  std::vector<std::vector<int64_t>> in_bucket(buckets_.size());
  for (int64_t i = 0; i < static_cast<int64_t>(transfers.size()); ++i)
    in_bucket[bucket_of[dst_t[dst_p[transfers[i].dst_piece].tensor].group]].push_back(i);
  std::vector<std::vector<int64_t>> zeros(buckets_.size());
  for (int64_t j = 0; j < static_cast<int64_t>(dst_p.size()); ++j)
    if (dst_p[j].logical < 0 && dst_t[dst_p[j].tensor].rank == rank_ && dst_p[j].nrows > 0 && dst_p[j].ncols > 0)
      zeros[bucket_of[dst_t[dst_p[j].tensor].group]].push_back(j);

  for (int64_t b = 0; b < num_buckets(); ++b) {
    Bucket& bk = buckets_[b];
    const int32_t send_slot = S + D + static_cast<int32_t>(b % 2), recv_slot = S + D + 2 + static_cast<int32_t>(b % 2);
    // Messages: peers in ascending order; regions inside a message in transfer order.
    std::map<int64_t, std::vector<int64_t>> to_peer, from_peer;
    for (int64_t i : in_bucket[b]) {
      const Transfer& t = transfers[i];
      if (t.src_rank == rank_ && t.dst_rank != rank_) to_peer[t.dst_rank].push_back(i);
      if (t.dst_rank == rank_ && t.src_rank != rank_) from_peer[t.src_rank].push_back(i);
    }
    std::vector<Segment> pack, copy;
    auto src_segment = [&](const Transfer& t, Segment& s) {
      const PieceRow& p = src_p[t.src_piece];
      s.src = static_cast<int32_t>(src_slot[p.tensor]);
      s.src_dtype = static_cast<int32_t>(src_t[p.tensor].dtype);
      s.src_off = p.offset + (t.rect.r0 - p.row0) * p.pitch + (t.rect.c0 - p.col0);
      s.src_pitch = p.pitch;
    };
    auto dst_segment = [&](const Transfer& t, Segment& s) {
      const PieceRow& p = dst_p[t.dst_piece];
      s.dst = static_cast<int32_t>(S + dst_slot[p.tensor]);
      s.dst_dtype = static_cast<int32_t>(dst_t[p.tensor].dtype);
      s.dst_off = p.offset + (t.rect.r0 - p.row0) * p.pitch + (t.rect.c0 - p.col0);
      s.dst_pitch = p.pitch;
    };
    int64_t offset = 0;
    for (const auto& [peer, list] : to_peer) {
      Message m{peer, offset, 0};
      for (int64_t i : list) {
        const Transfer& t = transfers[i];
        Segment s{};
        src_segment(t, s);
        s.dst = send_slot;
        s.dst_dtype = static_cast<int32_t>(dst_t[dst_p[t.dst_piece].tensor].dtype);
        s.dst_off = offset / elem_size(s.dst_dtype);
        s.dst_pitch = t.rect.nc;
        s.rows = t.rect.nr;
        s.width = t.rect.nc;
        pack.push_back(s);
        offset += wire_bytes(t);
      }
      m.bytes = offset - m.offset;
      bk.sends.push_back(m);
    }
    bk.send_bytes = offset;
    offset = 0;
    for (const auto& [peer, list] : from_peer) {
      Message m{peer, offset, 0};
      for (int64_t i : list) {
        const Transfer& t = transfers[i];
        Segment s{};
        dst_segment(t, s);
        s.src = recv_slot;
        s.src_dtype = s.dst_dtype;
        s.src_off = offset / elem_size(s.src_dtype);
        s.src_pitch = t.rect.nc;
        s.rows = t.rect.nr;
        s.width = t.rect.nc;
        copy.push_back(s);
        received_bytes_ += t.rect.area() * elem_size(s.dst_dtype);
        offset += wire_bytes(t);
      }
      m.bytes = offset - m.offset;
      bk.recvs.push_back(m);
    }
    bk.recv_bytes = offset;
    for (int64_t i : in_bucket[b]) {
      const Transfer& t = transfers[i];
      if (t.src_rank != rank_ || t.dst_rank != rank_) continue;
      Segment s{};
      src_segment(t, s);
      dst_segment(t, s);
      s.rows = t.rect.nr;
      s.width = t.rect.nc;
      copy.push_back(s);
      local_bytes_ += t.rect.area() * elem_size(s.dst_dtype);
    }
    for (int64_t j : zeros[b]) {
      const PieceRow& p = dst_p[j];
      Segment s{};
      s.src = -1;
      s.dst = static_cast<int32_t>(S + dst_slot[p.tensor]);
      s.src_dtype = s.dst_dtype = static_cast<int32_t>(dst_t[p.tensor].dtype);
      s.dst_off = p.offset;
      s.dst_pitch = p.pitch;
      s.rows = p.nrows;
      s.width = p.ncols;
      copy.push_back(s);
      zero_bytes_ += p.nrows * p.ncols * elem_size(s.dst_dtype);
    }
    max_send_ = std::max(max_send_, bk.send_bytes);
    max_recv_ = std::max(max_recv_, bk.recv_bytes);

    // Tiles: rows of a segment grouped up to tile_bytes; rows wider than that split in columns.
    auto add_tiles = [&](std::vector<Segment>& segs) {
      for (Segment s : segs) {
        if (s.rows == 1 || (s.src_pitch == s.width && s.dst_pitch == s.width)) {  // contiguous: one long row
          s.width *= s.rows;
          s.rows = 1;
          s.src_pitch = s.dst_pitch = s.width;
        }
        const int64_t seg = static_cast<int64_t>(segments_.size());
        segments_.push_back(s);
        const int64_t esz = std::max(elem_size(s.src_dtype), elem_size(s.dst_dtype));
        const int64_t row_bytes = s.width * esz;
        if (row_bytes >= a.tile_bytes) {
          const int64_t chunk = std::max<int64_t>(kAlign, a.tile_bytes / esz / kAlign * kAlign);
          for (int64_t r = 0; r < s.rows; ++r)
            for (int64_t c = 0; c < s.width; c += chunk) tiles_.push_back({seg, r, 1, c, std::min(chunk, s.width - c)});
        } else {
          const int64_t per = std::max<int64_t>(1, a.tile_bytes / std::max<int64_t>(row_bytes, 1));
          for (int64_t r = 0; r < s.rows; r += per) tiles_.push_back({seg, r, std::min(per, s.rows - r), 0, s.width});
        }
      }
    };
    bk.pack_tiles_begin = static_cast<int64_t>(tiles_.size());
    add_tiles(pack);
    bk.pack_tiles_end = bk.copy_tiles_begin = static_cast<int64_t>(tiles_.size());
    add_tiles(copy);
    bk.copy_tiles_end = static_cast<int64_t>(tiles_.size());
  }
}

}  // namespace vf::reshard
