//! f32 buffers kept between calls by the inference paths that own their buffers (the experts'
//! and attention's): a prefill's buffers come to tens of MB, and fresh ones cost a page fault
//! per 4 KB on first touch (measured 4% of a bf16 prefill). A buffer is taken, used by one task
//! and given back; the pool is shared across threads behind a lock held only to take or give.

use std::sync::Mutex;

static POOL: Mutex<Vec<Vec<f32>>> = Mutex::new(Vec::new());
/// Buffers kept at most.
const KEPT: usize = 16;

/// A buffer of `len` f32 from the pool (the smallest that holds `len`, else the largest, grown),
/// or a new one. Its contents are unspecified.
pub fn take(len: usize) -> Vec<f32> {
    let found = POOL.lock().ok().and_then(|mut pool| {
        let best = (0..pool.len())
            .filter(|&i| pool[i].capacity() >= len)
            .min_by_key(|&i| pool[i].capacity())
            .or_else(|| (0..pool.len()).max_by_key(|&i| pool[i].capacity()))?;
        Some(pool.swap_remove(best))
    });
    let mut buf = found.unwrap_or_default();
    buf.resize(len, 0.0);
    buf
}

/// A buffer from [`take`] with room for `len` f32 from a 64-byte boundary, and the offset (in
/// f32) of that boundary: vectors read from there do not straddle cache lines.
pub fn take_aligned(len: usize) -> (Vec<f32>, usize) {
    let buf = take(len + 15);
    let at = buf.as_ptr().align_offset(64);
    // An f32 pointer is 4-aligned, so 64 bytes are at most 15 values away.
    assert!(
        at < 16,
        "no 64-byte boundary within 15 f32 of {:p}",
        buf.as_ptr()
    );
    (buf, at)
}

/// Gives a buffer back to the pool (dropped if the pool is full).
pub fn give(buf: Vec<f32>) {
    if let Ok(mut pool) = POOL.lock() {
        if pool.len() < KEPT {
            pool.push(buf);
        }
    }
}
