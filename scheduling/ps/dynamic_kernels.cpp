// Compiled kernels of scheduling/ps/dynamic_index.py's SlotIndex and of the id -> slot step of
// scheduling/ps/dynamic_group.py's DynamicTableGroup.lookup_padded: same data, same results, one call
// instead of hundreds of small tensor ops. Plain C ABI over raw pointers of contiguous CPU tensors (no torch
// headers); built and loaded by scheduling/ps/dynamic_native.py. The torch code is the reference: every
// loop below mirrors one of its vectorised ops (named in the comments). Also every server's row gather and
// scatter (fx_gather_rows, fx_scatter_rows: torch's index_select / index_copy_ on dim 0, with prefetching), and
// a push's plain SGD over float32 rows in one pass (fx_sgd_rows).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

typedef int64_t i64;
typedef int32_t i32;

namespace {
const i32 EMPTY = -1, DELETED = -2;
const i64 WINDOW = 8;  // dynamic_index.WINDOW: entries probed per round of an insert
enum { INSERTS, ADMITTED, EVICTIONS, EXPIRED, REJECTED, NCOUNTERS };

inline uint64_t mix64(uint64_t z) {  // splitmix64's finaliser (mix64_torch)
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}
struct KV {  // an id as an unsigned key in signed order, and its position
  uint64_t key;
  i64 pos;
};

// Stable LSD radix sort by key, 8 bits a pass (passes where every key has the same byte skipped): a lookup's
// rows of a few hundred ids, and a rehash's home entries, sort several times faster than with comparisons.
void radix_sort(std::vector<KV>& a, std::vector<KV>& tmp) {
  const i64 n = (i64)a.size();
  if (n < 64) {
    std::stable_sort(a.begin(), a.end(), [](const KV& x, const KV& y) { return x.key < y.key; });
    return;
  }
  i64 hist[8][256] = {};
  for (const KV& e : a)
    for (int b = 0; b < 8; ++b) ++hist[b][(e.key >> (8 * b)) & 255];
  tmp.resize(n);
  KV *src = a.data(), *dst = tmp.data();
  for (int b = 0; b < 8; ++b) {
    i64* h = hist[b];
    if (h[(src[0].key >> (8 * b)) & 255] == n) continue;
    for (i64 i = 0, sum = 0; i < 256; ++i) {
      const i64 c = h[i];
      h[i] = sum;
      sum += c;
    }
    for (i64 i = 0; i < n; ++i) dst[h[(src[i].key >> (8 * b)) & 255]++] = src[i];
    std::swap(src, dst);
  }
  if (src != a.data()) std::copy(src, src + n, a.data());
}
}  // namespace

extern "C" {

// The SlotIndex's tensors and the group's slot_id / last_seen, as pointers (ctypes.Structure in Python).
struct Index {
  i32* hslot;      // (T, H)
  i32* hpos;       // (T, C)
  i64* deleted;    // (T,)
  i64* log;        // (T, L)
  i64* head;       // (T,)
  i64* tail;       // (T,)
  i64* high;       // (T,)
  i64* slot_id;    // (T, C)
  i64* last_seen;  // (T, C)
  i64 T, C, H, L;
};

int fx_version() { return 3; }

// Rows this far ahead are prefetched: a table's rows are read at random, nearly each one a cache miss; a
// plain copy loop (index_select's) waits for each miss in turn, prefetching keeps many in flight.
static inline i64 rows_ahead(i64 row_bytes) { return std::max<i64>(4, std::min<i64>(32, 8192 / row_bytes)); }

// dst[i] = src[idx[i]] for rows of row_bytes bytes (torch.index_select(src, 0, idx)); returns the position of
// the first index outside [0, rows) (nothing copied) or -1.
i64 fx_gather_rows(const char* src, i64 rows, i64 row_bytes, i64 n, const i64* idx, char* dst) {
  for (i64 i = 0; i < n; ++i)
    if (idx[i] < 0 || idx[i] >= rows) return i;
  const i64 ahead = rows_ahead(row_bytes);
  for (i64 i = 0; i < n; ++i) {
    if (i + ahead < n) {
      const char* p = src + idx[i + ahead] * row_bytes;
      for (i64 b = 0; b < row_bytes; b += 64) __builtin_prefetch(p + b, 0, 0);
    }
    std::memcpy(dst + i * row_bytes, src + idx[i] * row_bytes, row_bytes);
  }
  return -1;
}

// dst[idx[i]] = src[i] (dst.index_copy_(0, idx, src), idx without repeats); returns as fx_gather_rows.
i64 fx_scatter_rows(char* dst, i64 rows, i64 row_bytes, i64 n, const i64* idx, const char* src) {
  for (i64 i = 0; i < n; ++i)
    if (idx[i] < 0 || idx[i] >= rows) return i;
  const i64 ahead = rows_ahead(row_bytes);
  for (i64 i = 0; i < n; ++i) {
    if (i + ahead < n) {
      char* p = dst + idx[i + ahead] * row_bytes;
      for (i64 b = 0; b < row_bytes; b += 64) __builtin_prefetch(p + b, 1, 0);
    }
    std::memcpy(dst + idx[i] * row_bytes, src + i * row_bytes, row_bytes);
  }
  return -1;
}

// w = fma(s, neg_lr, w) over one row's dim floats: one rounding, as torch's vectorised add with alpha
// (Vectorized<float>::fmadd, what RowStore.apply's sub_(update, alpha=lr) runs in its AVX2 and AVX-512 builds;
// dynamic_native.sgd_rows calls this kernel only under those).
#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("fma"), optimize("O3"))) static void fma_row_hw(float* w, const float* s, i64 dim,
                                                                       float neg_lr) {
  for (i64 j = 0; j < dim; ++j) w[j] = __builtin_fmaf(s[j], neg_lr, w[j]);
}
#endif
__attribute__((optimize("O3"))) static void fma_row_sw(float* w, const float* s, i64 dim, float neg_lr) {
  for (i64 j = 0; j < dim; ++j) w[j] = std::fmaf(s[j], neg_lr, w[j]);
}

// Plain SGD on a push's rows in one pass (FusedTables.row_grads, then RowWiseSGD over float32 rows): the
// gradient rows grad[grad_row[i]] of the ids whose table row is idx[i] are summed per distinct row in the
// order of i (index_add_ into zeros), then table[r] += neg_lr * sum with one rounding. table (rows, dim)
// float32, grad (grad_rows, dim) float32. Returns the number of distinct rows, or -1 - i for the first i whose
// idx or grad_row is out of range (nothing written).
__attribute__((optimize("O3"))) i64 fx_sgd_rows(float* table, i64 rows, i64 dim, i64 n, const i64* idx,
                                                 const float* grad, i64 grad_rows, const i64* grad_row,
                                                 float neg_lr) {
  for (i64 i = 0; i < n; ++i)
    if (idx[i] < 0 || idx[i] >= rows || grad_row[i] < 0 || grad_row[i] >= grad_rows) return -1 - i;
  std::vector<KV> order(n), tmp;
  for (i64 i = 0; i < n; ++i) order[i] = KV{(uint64_t)idx[i], i};
  radix_sort(order, tmp);  // stable: a row's ids stay in the order of i
#if defined(__x86_64__) || defined(__i386__)
  void (*fma_row)(float*, const float*, i64, float) = __builtin_cpu_supports("fma") ? fma_row_hw : fma_row_sw;
#else
  void (*fma_row)(float*, const float*, i64, float) = fma_row_sw;
#endif
  std::vector<float> sum(dim);
  const i64 ahead = rows_ahead(dim * (i64)sizeof(float));
  i64 distinct = 0;
  for (i64 g = 0; g < n;) {
    const i64 r = (i64)order[g].key;
    if (g + ahead < n) {
      const char* p = (const char*)(table + order[g + ahead].key * dim);
      for (i64 b = 0; b < dim * (i64)sizeof(float); b += 64) __builtin_prefetch(p + b, 1, 0);
    }
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (; g < n && (i64)order[g].key == r; ++g) {
      const float* src = grad + grad_row[order[g].pos] * dim;
      for (i64 j = 0; j < dim; ++j) sum[j] += src[j];
    }
    fma_row(table + r * dim, sum.data(), dim, neg_lr);
    ++distinct;
  }
  return distinct;
}

// dynamic_group.initial_rows_keyed, bit for bit: element (i, j) is 53 bits of
// mix64(mix64(ids[i] + keys[i]) + (j + 1) * golden) as a double u in [0, 1), then float((2u - 1) * bound)
// (each operation rounded as torch's double ops are: the build turns off floating-point contraction).
void fx_initial_rows(i64 n, const i64* ids, const i64* keys, i64 dim, double bound, float* out) {
  const uint64_t golden = 0x9E3779B97F4A7C15ULL;
  for (i64 i = 0; i < n; ++i) {
    const uint64_t key = mix64((uint64_t)ids[i] + (uint64_t)keys[i]);
    for (i64 j = 0; j < dim; ++j) {
      const uint64_t bits = mix64(key + (uint64_t)(j + 1) * golden) >> 11;
      const double unit = (double)(i64)bits * 0x1p-53;
      out[i * dim + j] = (float)((2.0 * unit - 1.0) * bound);
    }
  }
}

// SlotIndex._find: a linear probe from the id's home entry until the id or an empty entry.
static i64 find1(const Index* x, i64 t, i64 id) {
  const i32* hs = x->hslot + t * x->H;
  const i64* sid = x->slot_id + t * x->C;
  const uint64_t mask = (uint64_t)x->H - 1;
  uint64_t p = mix64((uint64_t)id) & mask;
  for (i64 n = 0; n < x->H; ++n, p = (p + 1) & mask) {
    const i32 e = hs[p];
    if (e == EMPTY) return -1;
    if (e >= 0 && sid[e] == id) return e;
  }
  return -1;
}

void fx_find(const Index* x, i64 n, const i64* tix, const i64* q, i64* out) {
  for (i64 i = 0; i < n; ++i) out[i] = find1(x, tix[i], q[i]);
}

// SlotIndex.insert, round for round: each pending id claims the first free entry (empty or deleted, as at
// the round's start) of the WINDOW from its position; of several claiming one entry the last (largest index)
// wins, the others retry from that entry; an id without a free entry moves on by WINDOW.
void fx_insert(const Index* x, i64 n, const i64* tix, const i64* slots, const i64* ids) {
  const i64 H = x->H, C = x->C;
  const uint64_t mask = (uint64_t)H - 1;
  std::vector<i64> idx(n), pos(n), at(n);
  std::vector<i32> was(n);
  std::vector<char> some(n);
  for (i64 i = 0; i < n; ++i) {
    idx[i] = i;
    pos[i] = (i64)(mix64((uint64_t)ids[i]) & mask);
  }
  while (!idx.empty()) {
    const i64 m = (i64)idx.size();
    for (i64 i = 0; i < m; ++i) {  // cur, free, some, j, pos: read before any claim of the round
      const i64 t = tix[idx[i]];
      const i32* hs = x->hslot + t * H;
      some[i] = 0;
      for (i64 j = 0; j < WINDOW; ++j) {
        const i64 p = (pos[i] + j) & (i64)mask;
        if (hs[p] < 0) {
          some[i] = 1;
          pos[i] = p;
          was[i] = hs[p];
          break;
        }
      }
      if (!some[i]) pos[i] = (pos[i] + WINDOW) & (i64)mask;
      at[i] = t * H + pos[i];
    }
    for (i64 i = 0; i < m; ++i)  // scatter_reduce "amin" of claims -3 - i: the largest i wins
      if (some[i]) x->hslot[at[i]] = (i32)(-3 - i);
    i64 kept = 0;
    for (i64 i = 0; i < m; ++i) {
      const i64 r = idx[i];
      if (some[i] && x->hslot[at[i]] == (i32)(-3 - i)) {
        x->hslot[at[i]] = (i32)slots[r];
        if (was[i] == DELETED) x->deleted[tix[r]] -= 1;
        x->hpos[tix[r] * C + slots[r]] = (i32)pos[i];
      } else {
        idx[kept] = r;
        pos[kept] = pos[i];
        ++kept;
      }
    }
    idx.resize(kept);
  }
}

void fx_remove(const Index* x, i64 n, const i64* tix, const i64* slots) {
  for (i64 i = 0; i < n; ++i) {
    const i64 t = tix[i];
    x->hslot[t * x->H + x->hpos[t * x->C + slots[i]]] = DELETED;
    x->deleted[t] += 1;
  }
}

// SlotIndex._rehash: occupied slots (ascending) stably sorted by home entry, each at max(home, previous + 1);
// those past the end moved to the front (with home 0), again until none is past the end.
void fx_rehash(const Index* x, i64 t) {
  const i64 H = x->H, C = x->C;
  const uint64_t mask = (uint64_t)H - 1;
  const i64* sid = x->slot_id + t * C;
  std::vector<KV> hs, tmp;  // (home, slot), slots ascending, then stably by home
  for (i64 s = 0; s < C; ++s)
    if (sid[s] >= 0) hs.push_back(KV{mix64((uint64_t)sid[s]) & mask, s});
  radix_sort(hs, tmp);
  std::vector<i64> wrapped, pos;
  i64 rest = (i64)hs.size();
  for (;;) {
    const i64 w = (i64)wrapped.size(), n = w + rest;
    pos.assign(n, 0);
    i64 best = INT64_MIN, over = 0;
    for (i64 i = 0; i < n; ++i) {
      const i64 home = i < w ? 0 : (i64)hs[i - w].key;
      best = std::max(best, home - i);
      pos[i] = i + best;
      over += pos[i] >= H;
    }
    if (!over) break;
    for (i64 i = rest - over; i < rest; ++i) wrapped.push_back(hs[i].pos);
    rest -= over;
  }
  i32* row = x->hslot + t * H;
  std::fill(row, row + H, EMPTY);
  const i64 w = (i64)wrapped.size();
  for (i64 i = 0; i < w + rest; ++i) {
    const i64 s = i < w ? wrapped[i] : hs[i - w].pos;
    row[pos[i]] = (i32)s;
    x->hpos[t * C + s] = (i32)pos[i];
  }
  x->deleted[t] = 0;
}

void fx_maintain(const Index* x) {
  for (i64 t = 0; t < x->T; ++t)
    if (x->deleted[t] > x->H / 4) fx_rehash(x, t);
}

static inline bool live(const Index* x, i64 t, i64 e, i64* slot) {  // a log entry step * C + slot
  const i64 step = e / x->C;
  *slot = e - step * x->C;
  return x->last_seen[t * x->C + *slot] == step && x->slot_id[t * x->C + *slot] >= 0;
}

// SlotIndex.victims of one table: the first `need` live entries from the head, which moves past them.
static i64 victims1(const Index* x, i64 t, i64 need, i64* out) {
  i64 got = 0, h = x->head[t];
  const i64* lg = x->log + t * x->L;
  i64 slot;
  while (got < need && h < x->tail[t]) {
    if (live(x, t, lg[h++], &slot)) out[got++] = slot;
  }
  x->head[t] = h;
  return got;
}

void fx_victims(const Index* x, i64 k, const i64* tix, const i64* need, i64 width, i64* out, i64* got) {
  for (i64 r = 0; r < k; ++r) got[r] = need[r] > 0 ? victims1(x, tix[r], need[r], out + r * width) : 0;
}

// SlotIndex.expired: the live entries of steps before horizon[r] (a prefix of the log), which the head
// leaves; as (row of tix, slot) pairs. Returns how many (at most the entries between head and tail).
i64 fx_expired(const Index* x, i64 k, const i64* tix, const i64* horizon, i64* rows, i64* slots) {
  i64 n = 0;
  for (i64 r = 0; r < k; ++r) {
    const i64 t = tix[r];
    const i64* lg = x->log + t * x->L;
    i64 h = x->head[t];
    i64 slot;
    while (h < x->tail[t] && lg[h] / x->C < horizon[r]) {
      if (live(x, t, lg[h], &slot)) {
        rows[n] = r;
        slots[n++] = slot;
      }
      ++h;
    }
    x->head[t] = h;
  }
  return n;
}

static void compact(const Index* x, i64 t) {  // SlotIndex._compact
  i64* lg = x->log + t * x->L;
  i64 keep = 0, slot;
  for (i64 h = x->head[t]; h < x->tail[t]; ++h)
    if (live(x, t, lg[h], &slot)) lg[keep++] = lg[h];
  x->head[t] = 0;
  x->tail[t] = keep;
}

// SlotIndex.append: tables whose log would overflow are compacted; if one still would, nothing is appended
// and the length needed is returned (the caller grows the log and calls again), else 0.
i64 fx_append(const Index* x, i64 k, const i64* tix, i64 width, const i64* entries, const i64* n) {
  i64 over = 0;
  for (i64 r = 0; r < k; ++r)
    if (x->tail[tix[r]] + n[r] > x->L) compact(x, tix[r]);
  for (i64 r = 0; r < k; ++r) over = std::max(over, x->tail[tix[r]] + n[r]);
  if (over > x->L) return over;
  for (i64 r = 0; r < k; ++r) {
    const i64 t = tix[r];
    std::copy(entries + r * width, entries + r * width + n[r], x->log + t * x->L + x->tail[t]);
    x->tail[t] += n[r];
  }
  return 0;
}

// DynamicTableGroup.lookup_padded's id -> slot step for min_count == 1 and no candidates, table by table:
// probe each distinct id once, mark the known rows seen, take slots for the misses in ascending id order
// (free slots lowest first: freed[foff[r]:foff[r + 1]] then high; then LRU victims, their entries removed),
// enter the new ids (as fx_insert), rehash when needed, and count. Outputs: slot (k, M) in q's order (-1:
// padding or no slot), missed (k, M) 1 where the id was not admitted before, the fresh rows (global slot,
// id, row of tix) in order, the log entries (k, M) with their number n_entries, got/want per row, and the
// freed slots used per row. Returns the number of fresh rows.
i64 fx_lookup(const Index* x, i64 k, i64 M, const i64* tix, const i64* q, const uint8_t* valid, const i64* step,
              i64* rows, i64* counters, const i64* freed, const i64* foff, i64* slot, uint8_t* missed,
              i64* fresh_glob, i64* fresh_ids, i64* fresh_row, i64* entries, i64* n_entries, i64* want_out,
              i64* got_out, i64* freed_used) {
  const i64 C = x->C;
  i64 nfresh = 0;
  const uint64_t sign = 1ULL << 63;
  std::vector<KV> v, tmp;  // (id ^ sign, position): ascending ids
  std::vector<i64> gslot, gstart, miss, news, ins_tix;
  std::vector<uint8_t> gmiss;
  for (i64 r = 0; r < k; ++r) {
    const i64 t = tix[r], st = step[r];
    const i64* qr = q + r * M;
    std::fill(slot + r * M, slot + (r + 1) * M, -1);
    std::fill(missed + r * M, missed + (r + 1) * M, 0);
    v.clear();
    for (i64 j = 0; j < M; ++j)
      if (!valid || valid[r * M + j]) v.push_back(KV{(uint64_t)qr[j] ^ sign, j});
    radix_sort(v, tmp);
    gslot.clear();
    gstart.clear();
    gmiss.clear();
    miss.clear();
    const i32* hrow = x->hslot + t * x->H;
    const uint64_t hmask = (uint64_t)x->H - 1;
    for (const KV& e : v) __builtin_prefetch(hrow + (mix64(e.key ^ sign) & hmask));  // the probes' first lines
    for (i64 i = 0; i < (i64)v.size(); ++i) {
      if (i && v[i].key == v[i - 1].key) continue;
      const i64 s = find1(x, t, (i64)(v[i].key ^ sign));
      if (s >= 0) x->last_seen[t * C + s] = st;
      else miss.push_back((i64)gslot.size());
      gstart.push_back(i);
      gslot.push_back(s);
      gmiss.push_back(s < 0);
    }
    const i64 nm = (i64)miss.size();
    i64* cnt = counters + t * NCOUNTERS;
    cnt[INSERTS] += nm;
    i64 got = 0, used = 0;
    if (nm) {
      const i64 free = std::min(C - rows[t], nm);
      news.assign(nm, 0);
      used = std::min(free, foff[r + 1] - foff[r]);
      for (i64 i = 0; i < used; ++i) news[i] = freed[foff[r] + i];
      for (i64 i = used; i < free; ++i) news[i] = x->high[t] + (i - used);
      x->high[t] += free - used;
      rows[t] += free;
      i64 evicted = 0;
      if (nm > free) {
        evicted = victims1(x, t, nm - free, news.data() + free);
        ins_tix.assign(evicted, t);
        fx_remove(x, evicted, ins_tix.data(), news.data() + free);
        cnt[EVICTIONS] += evicted;
      }
      got = free + evicted;
      std::vector<i64> ids(got);
      for (i64 i = 0; i < got; ++i) {
        const i64 g = miss[i], s = news[i];
        ids[i] = (i64)(v[gstart[g]].key ^ sign);
        gslot[g] = s;
        x->slot_id[t * C + s] = ids[i];
        fresh_glob[nfresh] = t * C + s;
        fresh_ids[nfresh] = ids[i];
        fresh_row[nfresh++] = r;
      }
      ins_tix.assign(got, t);
      fx_insert(x, got, ins_tix.data(), news.data(), ids.data());
      if (x->deleted[t] > x->H / 4) fx_rehash(x, t);
      for (i64 i = 0; i < got; ++i) x->last_seen[t * C + news[i]] = st;
      cnt[ADMITTED] += got;
    }
    want_out[r] = nm;
    got_out[r] = got;
    freed_used[r] = used;
    i64 ne = 0;
    const i64 ng = (i64)gslot.size();
    for (i64 g = 0; g < ng; ++g) {
      const i64 s = gslot[g];
      if (s >= 0) entries[r * M + ne++] = st * C + s;
      const i64 end = g + 1 < ng ? gstart[g + 1] : (i64)v.size();
      for (i64 i = gstart[g]; i < end; ++i) {
        slot[r * M + v[i].pos] = s;
        missed[r * M + v[i].pos] = gmiss[g];
      }
    }
    n_entries[r] = ne;
  }
  return nfresh;
}

}  // extern "C"
