// What both MLA kernels (mla_attention.cuh, mla_attention_sm90.cuh) share: a sequence's
// rows and positions, a row tile's keys and split-KV range, the block id of a key, and the
// addresses of a query row's and a cached token's 16-byte chunks (latent part first, then
// the rotary part, each through its own pointer and strides).
#pragma once
#include "common.cuh"
#include "ds_mla.cuh"

namespace cupaged {

// A sequence's query rows (tokens x heads, token-major) and where they sit.
struct MlaSeq {
  int seq_len;  // keys, clamped to the table's width (never overrun); negative: empty
  int q_begin;  // its first query token in q and out
  int packed;   // its rows: q_len * num_heads
  int q_shift;  // position of its first query token (seq_len - q_len)
  const int* bt_row;
};

// Sparse MLA (mla_sparse_attention): a "sequence" is one query token (its rows: its
// heads), its "block table" row the token's top-k indices (global slots of the cache,
// `max_blocks` of them), and its length the count of them that count: seq_lens[seq /
// lengths_per] (topk_length) clamped to [0, topk], or topk without it.
template <int BLOCK_SIZE, bool SPARSE = false>
__device__ __forceinline__ MlaSeq mla_seq(int seq, const int* seq_lens,
                                          const int* query_start_loc, int num_heads,
                                          const int* block_tables, long long bt_stride,
                                          int max_blocks, int lengths_per = 1) {
  MlaSeq s;
  if constexpr (SPARSE) {
    s.seq_len = seq_lens != nullptr
                    ? max(0, min(__ldg(seq_lens + seq / lengths_per), max_blocks))
                    : max_blocks;
    s.q_begin = seq;
    s.packed = num_heads;
    s.q_shift = 0;
    s.bt_row = block_tables + seq * bt_stride;
    return s;
  }
  s.seq_len = max(0, min(seq_lens[seq], max_blocks * BLOCK_SIZE));
  s.q_begin = query_start_loc != nullptr ? query_start_loc[seq] : seq;
  const int q_len = query_start_loc != nullptr ? query_start_loc[seq + 1] - s.q_begin : 1;
  s.packed = q_len * num_heads;
  s.q_shift = s.seq_len - q_len;
  s.bt_row = block_tables + seq * bt_stride;
  return s;
}

// The keys a row tile (rows row0 .. row0 + rows_here - 1) reads: up to its last row's
// position (causal) or all, the CTA's split-KV partition of them in tiles of TILE_N.
struct MlaTiles {
  int kv_end;
  int tile_lo;
  int n_tiles;
};

template <int TILE_N>
__device__ __forceinline__ MlaTiles mla_tiles(const MlaSeq& s, int row0, int rows_here,
                                              int num_heads, int causal, int split_tiles) {
  MlaTiles t;
  const int last_pos = s.q_shift + (row0 + rows_here - 1) / num_heads;
  // (max: a row before every cached token, which only a bad query_start_loc makes, reads none)
  t.kv_end = causal ? max(0, min(s.seq_len, last_pos + 1)) : s.seq_len;
  int lo = 0, hi = (t.kv_end + TILE_N - 1) / TILE_N;
  if (split_tiles > 0) {
    lo = min(hi, static_cast<int>(blockIdx.z) * split_tiles);
    if (blockIdx.z + 1 < gridDim.z) hi = min(hi, lo + split_tiles);
  }
  t.tile_lo = lo;
  t.n_tiles = hi - lo;
  return t;
}

// Keys at positions below this are seen by packed row p (0 for a row past the sequence's).
__device__ __forceinline__ int mla_key_limit(const MlaSeq& s, int p, int num_heads,
                                             int causal) {
  return p >= s.packed ? 0 : causal ? min(s.seq_len, s.q_shift + p / num_heads + 1) : s.seq_len;
}

// The block id of `key`, read through the read-only cache: -1 past kv_end (not copied),
// -2 outside the cache (never dereferenced; its rows become NaN).
template <int BLOCK_SIZE>
__device__ __forceinline__ int mla_block_id(const MlaSeq& s, int key, int kv_end,
                                            int num_blocks) {
  if (key >= kv_end) return -1;
  const int phys = __ldg(s.bt_row + key / BLOCK_SIZE);
  return static_cast<unsigned>(phys) < static_cast<unsigned>(num_blocks) ? phys : -2;
}

// Sparse MLA: the slot that index entry `key` of a token names (its block is slot /
// BLOCK_SIZE, its offset slot % BLOCK_SIZE); -1 for an entry that does not count (past the
// token's length, -1, or without `strict` anything outside [0, num_slots): FlashMLA's
// prefill rule); -2 for an index outside the cache under `strict` (FlashMLA's decode takes
// -1 only): never dereferenced, its rows NaN.
__device__ __forceinline__ int mla_sparse_slot(const MlaSeq& s, int key, int kv_end,
                                               int num_slots, int strict) {
  if (key >= kv_end) return -1;
  const int slot = __ldg(s.bt_row + key);
  if (static_cast<unsigned>(slot) < static_cast<unsigned>(num_slots)) return slot;
  return strict && slot != -1 ? -2 : -1;
}

// Sparse MLA's second cache (DeepSeek-V4's extra_k_cache), attended in the same softmax:
// the first cache's format, its own blocks of 1 << page_shift tokens and num_slots slots
// (lat and rope through one pair of strides, in elements of C), its own indices (a token's
// row of idx_stride entries, the first topk of them read) and lengths (entry token /
// lengths_per clamped to [0, topk], or null: topk). indices null: no second cache. A
// token's keys are its first cache's counted entries, then its second's. A kernel
// parameter (72 bytes: the pointers, the 64-bit strides, the ints, 4 bytes of padding).
struct MlaSparseExtra {
  const void* lat;  // (the kernel's cache type C)
  const void* rope;
  const int* indices;
  const int* lengths;
  long long block_stride;
  long long token_stride;
  long long idx_stride;
  int topk;
  int num_slots;
  int page_shift;
};
static_assert(sizeof(MlaSparseExtra) == 72 && alignof(MlaSparseExtra) == 8,
              "cupaged/launch.py's SPARSE_EXTRA packs 72 bytes (\"<QQQQqqqiii4x\")");

// A sparse token's row of the second cache's indices (null without a second cache), its
// counted entries added to s.seq_len: a token's keys are its first cache's counted
// entries, then its second's.
__device__ __forceinline__ const int* mla_extra_row(MlaSeq& s, const MlaSparseExtra& e,
                                                    int token, int lengths_per) {
  if (e.indices == nullptr) return nullptr;
  s.seq_len += e.lengths != nullptr ? max(0, min(__ldg(e.lengths + token / lengths_per), e.topk))
                                    : e.topk;
  return e.indices + token * e.idx_stride;
}

// Key `key` of a token whose first first_len keys are its first cache's: for keys from
// there on, the second cache's slot encoded as -3 - slot, or -1 (past kv_end, or an entry
// that does not count) and -2 (outside the cache under `strict`), mla_sparse_slot's rules.
__device__ __forceinline__ int mla_extra_slot(const MlaSparseExtra& e, const int* row,
                                              int key, int first_len, int kv_end, int strict) {
  if (key >= kv_end) return -1;
  const int slot = __ldg(row + (key - first_len));
  if (static_cast<unsigned>(slot) < static_cast<unsigned>(e.num_slots)) return -3 - slot;
  return strict && slot != -1 ? -2 : -1;
}

// The id a K/V copy of key `key` reads (kernels' tile_id): paged, its block id
// (mla_block_id); sparse, its slot (mla_sparse_slot), or with a second cache (EXTRA) for
// keys from first_len on -3 - its slot there (mla_extra_slot, its row extra_row).
template <int BLOCK_SIZE, bool SPARSE, bool EXTRA>
__device__ __forceinline__ int mla_key_id(const MlaSeq& s, int key, int kv_end, int num_blocks,
                                          int strict, const MlaSparseExtra& extra,
                                          const int* extra_row, int first_len) {
  if constexpr (EXTRA) {
    if (key >= first_len) return mla_extra_slot(extra, extra_row, key, first_len, kv_end, strict);
  }
  if constexpr (SPARSE) return mla_sparse_slot(s, key, kv_end, num_blocks, strict);
  return mla_block_id<BLOCK_SIZE>(s, key, kv_end, num_blocks);
}

// Chunk c (8 values of T) of packed row p's query.
template <typename T, int RANK>
__device__ __forceinline__ const T* mla_query_chunk(const T* q_lat, const T* q_rope,
                                                    long long lat_token, long long lat_head,
                                                    long long rope_token, long long rope_head,
                                                    int q_begin, int p, int num_heads, int c) {
  const long long token = q_begin + p / num_heads;
  const int head = p % num_heads;
  return c < RANK / 8 ? q_lat + token * lat_token + head * lat_head + c * 8
                      : q_rope + token * rope_token + head * rope_head + (c - RANK / 8) * 8;
}

// A row tile's query into shared memory by cp.async, ROWS rows of RANK + ROPE values over
// THREADS threads: chunk c of row r goes to shared address dst(r, c) (the kernel's layout);
// rows past the sequence's are zeros.
template <typename T, int RANK, int ROPE, int ROWS, int THREADS, typename Dst>
__device__ __forceinline__ void mla_copy_query(const T* q_lat, const T* q_rope,
                                               long long lat_token, long long lat_head,
                                               long long rope_token, long long rope_head,
                                               const MlaSeq& s, int row0, int rows_here,
                                               int num_heads, Dst dst) {
  constexpr int CH = (RANK + ROPE) / 8;
  for (int u = threadIdx.x; u < ROWS * CH; u += THREADS) {
    const int r = u / CH;
    const int c = u % CH;
    const bool real = r < rows_here;
    const T* src = mla_query_chunk<T, RANK>(q_lat, q_rope, lat_token, lat_head, rope_token,
                                            rope_head, s.q_begin, row0 + (real ? r : 0),
                                            num_heads, c);
    cp_async16_or_zero(dst(r, c), src, real);
  }
}

// A cached token's latent and rotary rows (phys >= 0: its block), for mla_cache_chunk.
template <typename C, int BLOCK_SIZE>
struct MlaToken {
  const C* lat;
  const C* rope;

  __device__ __forceinline__ MlaToken(const C* c_lat, const C* c_rope, long long lat_block,
                                      long long lat_token, long long rope_block,
                                      long long rope_token, int phys, int key)
      : MlaToken(c_lat, c_rope, lat_block, lat_token, rope_block, rope_token, phys,
                 key % BLOCK_SIZE, 0) {}

  // Token `within` of block phys, for a cache of another block size (the sparse second
  // cache's); the last argument only tells the constructors apart.
  __device__ __forceinline__ MlaToken(const C* c_lat, const C* c_rope, long long lat_block,
                                      long long lat_token, long long rope_block,
                                      long long rope_token, int phys, int within, int) {
    lat = phys >= 0 ? c_lat + phys * lat_block + within * lat_token : c_lat;
    rope = phys >= 0 ? c_rope + phys * rope_block + within * rope_token : c_lat;
  }

  // Chunk c (16 bytes: 16 / sizeof(C) values) of the token's RANK + ROPE values; of a
  // token row (fp8_ds_mla, v4_fp8, v4_fp4), its bytes 16c.. (one row holds the whole token).
  template <int RANK>
  __device__ __forceinline__ const C* chunk(int c) const {
    constexpr int CV = 16 / static_cast<int>(sizeof(C));
    if constexpr (is_sparse_row<C>::value) return lat + c * 16;
    return c < RANK / CV ? lat + c * CV : rope + (c - RANK / CV) * CV;
  }
};

// Is mla_key_id's `id` a token to copy (a block or slot of the first cache, or with a
// second cache (EXTRA) -3 - a slot of it)?
template <bool EXTRA>
__device__ __forceinline__ bool mla_copied(int id) {
  return id >= 0 || (EXTRA && id <= -3);
}

// The token a K/V copy of mla_key_id's `id` reads: paged, token `key` of the sequence in
// block id; sparse, slot id of the first cache, or with a second cache (EXTRA) slot
// -3 - id of the second, addressed through its own pointers, strides and page size. A
// token not copied (mla_copied) points at the cache's base.
template <typename C, int BLOCK_SIZE, bool SPARSE, bool EXTRA>
__device__ __forceinline__ MlaToken<C, BLOCK_SIZE> mla_kv_token(
    int id, int key, const C* c_lat, const C* c_rope, long long lat_block, long long lat_token,
    long long rope_block, long long rope_token, const MlaSparseExtra& extra) {
  const bool second = EXTRA && id <= -3;
  const bool copy = mla_copied<EXTRA>(id);
  const int slot = second ? -3 - id : id;
  const int k = SPARSE ? (copy ? slot : 0) : key;
  return MlaToken<C, BLOCK_SIZE>(second ? static_cast<const C*>(extra.lat) : c_lat,
                                 second ? static_cast<const C*>(extra.rope) : c_rope,
                                 second ? extra.block_stride : lat_block,
                                 second ? extra.token_stride : lat_token,
                                 second ? extra.block_stride : rope_block,
                                 second ? extra.token_stride : rope_token,
                                 second ? slot >> extra.page_shift
                                        : SPARSE && copy ? slot / BLOCK_SIZE : id,
                                 second ? slot & ((1 << extra.page_shift) - 1) : k % BLOCK_SIZE,
                                 0);
}

// The parameters every MLA kernel takes (mla_attention.cuh's and mla_attention_sm90.cuh's,
// paged and sparse, and their bodies), in this order, with T the query's type and C the
// cache's; MLA_ARGS passes them on. Read as:
//   out              [total_q, num_heads, RANK], unless split
//   part_*           split-KV (split_tiles > 0: grid z partitions a row tile's keys into
//                    runs of split_tiles tiles, the last running to the end): float32
//                    [total_q * num_heads, gridDim.z] partials for paged_decode_combine
//                    instead of `out`; rows of a partition with no key get max -inf, sum 0
//   row_tiles        grid x is (sequence, row tile), row tiles fastest: a sequence's row
//                    tiles run in one wave and read its keys from DRAM once
//   q_*, c_*         the query's and the cache's latent and rotary parts and strides
//   block_tables ..  the tables, their row stride, max_blocks, num_blocks
//   k_scale_ptr ..   an fp8 cache's per-tensor scale: *k_scale_ptr, or k_scale without one
//                    (1 for a cache of T); it scales keys and values alike
//   seq_lens, query_start_loc ([num_seqs + 1], or null: one each), num_heads, causal,
//   scale_log2
// The sparse kernels take lengths_per and strict after them (mla_attention.cuh), then
// their second cache (MlaSparseExtra, by value).
#define CUPAGED_MLA_PARAMS                                                                   \
  T *__restrict__ out, float *__restrict__ part_out, float *__restrict__ part_max,           \
      float *__restrict__ part_sum, int split_tiles, int row_tiles,                          \
      const T *__restrict__ q_lat, const T *__restrict__ q_rope, long long q_lat_token_stride, \
      long long q_lat_head_stride, long long q_rope_token_stride,                            \
      long long q_rope_head_stride, const C *__restrict__ c_lat, const C *__restrict__ c_rope, \
      long long c_lat_block_stride, long long c_lat_token_stride,                            \
      long long c_rope_block_stride, long long c_rope_token_stride,                          \
      const int *__restrict__ block_tables, long long bt_stride, int max_blocks,             \
      int num_blocks, const float *__restrict__ k_scale_ptr, float k_scale,                  \
      const int *__restrict__ seq_lens, const int *__restrict__ query_start_loc,             \
      int num_heads, int causal, float scale_log2
#define CUPAGED_MLA_ARGS                                                                     \
  out, part_out, part_max, part_sum, split_tiles, row_tiles, q_lat, q_rope,                  \
      q_lat_token_stride, q_lat_head_stride, q_rope_token_stride, q_rope_head_stride, c_lat, \
      c_rope, c_lat_block_stride, c_lat_token_stride, c_rope_block_stride,                   \
      c_rope_token_stride, block_tables, bt_stride, max_blocks, num_blocks, k_scale_ptr,     \
      k_scale, seq_lens, query_start_loc, num_heads, causal, scale_log2

// A CTA's start of a row tile: the previous row tile is done with shared memory (its
// bad-block flag read), and the flag is clear before any copy of this one can raise it.
__device__ __forceinline__ void begin_row_tile(int* bad_s) {
  __syncthreads();
  if (threadIdx.x == 0) *bad_s = 0;
  __syncthreads();
}

}  // namespace cupaged
