//! Pooled fixed-size receive buffers.
//!
//! Transports read (or RDMA-receive) into buffers from the pool, so the
//! receive path allocates nothing in steady state and the memory a node
//! spends on received data is bounded by `recv_pool_size ×
//! recv_buffer_size`. All buffers are slices of one arena allocated at
//! start, so an RDMA engine registers the whole pool once.

use std::cell::UnsafeCell;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::Arc;

use smallvec::SmallVec;

use super::free_stack::FreeStack;

/// The memory of all buffers of a pool. Each [`RecvBuffer`] keeps it alive.
struct Arena {
    mem: Box<[UnsafeCell<u8>]>,
}

// SAFETY: the arena is only accessed through `RecvBuffer`s, each of which
// owns a disjoint slice exclusively (buffers are not `Clone`).
unsafe impl Sync for Arena {}
// SAFETY: as above; the memory itself is plain bytes.
unsafe impl Send for Arena {}

/// One pooled receive buffer: `data` holds bytes a transport received;
/// `segments` name the ranges of `data` that belong to the connection's
/// message stream (a TCP buffer may also hold chunk headers, which are not
/// message bytes).
pub struct RecvBuffer {
    ptr: NonNull<u8>,
    len: usize,
    index: u32,
    _arena: Arc<Arena>,
    /// Inline (no heap block per buffer): a received message's bookkeeping
    /// then touches the buffer handle itself, not one more cache line and
    /// page elsewhere (per message, under full CPU emulation a TLB miss is
    /// a visible cost). TCP chunks may need more: they spill to the heap.
    segments: SmallVec<[Range<u32>; 2]>,
    /// Holds whole messages outside the connection's byte stream (see
    /// [`RecvBuffer::mark_standalone`]).
    standalone: bool,
    /// When the transport handed it over (a runtime's clock reading, for
    /// latency statistics; 0: not stamped).
    arrived: u64,
}

// SAFETY: a RecvBuffer is the only handle to its slice of the arena, which
// it keeps alive; moving it between threads moves that exclusive access.
unsafe impl Send for RecvBuffer {}
// SAFETY: shared references only read the slice.
unsafe impl Sync for RecvBuffer {}

impl std::fmt::Debug for RecvBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvBuffer")
            .field("index", &self.index)
            .field("segments", &self.segments)
            .finish()
    }
}

impl RecvBuffer {
    /// The whole buffer, for a transport to receive into.
    pub fn space(&mut self) -> &mut [u8] {
        // SAFETY: `ptr..ptr+len` lies in the arena this buffer keeps alive and
        // no other RecvBuffer covers it; `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The whole buffer (received bytes and anything after them).
    pub fn bytes(&self) -> &[u8] {
        self.data()
    }

    fn data(&self) -> &[u8] {
        // SAFETY: as in `space`; shared access for reading.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// Buffer capacity.
    pub fn capacity(&self) -> usize {
        self.len
    }

    #[cfg_attr(not(feature = "ib"), allow(dead_code))]
    /// Address of the buffer (for RDMA scatter-gather entries).
    pub fn addr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Marks `range` of the buffer as message-stream bytes (in stream order).
    pub fn push_segment(&mut self, range: Range<usize>) {
        debug_assert!(range.end <= self.len);
        SegmentSink(&mut self.segments).push(range);
    }

    #[cfg_attr(not(feature = "tcp"), allow(dead_code))]
    /// The received bytes and a sink for their message-stream ranges (for
    /// parsers that mark ranges while reading the bytes).
    pub fn space_and_segments(&mut self) -> (&[u8], SegmentSink<'_>) {
        // SAFETY: as in `space`; the slice and the segment list are disjoint.
        let data = unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) };
        (data, SegmentSink(&mut self.segments))
    }

    /// The message-stream bytes, in order.
    pub fn segments(&self) -> impl Iterator<Item = &[u8]> {
        self.segments
            .iter()
            .map(|r| &self.data()[r.start as usize..r.end as usize])
    }

    #[cfg_attr(not(feature = "tcp"), allow(dead_code))]
    /// Keeps the first `keep` message-stream bytes and returns the ranges
    /// of the rest (in stream order), which are no longer marked.
    pub fn truncate_stream(&mut self, keep: usize) -> SmallVec<[Range<usize>; 2]> {
        let mut cut = SmallVec::new();
        let mut left = keep;
        let mut i = 0;
        while i < self.segments.len() {
            let r = self.segments[i].clone();
            let len = (r.end - r.start) as usize;
            if left >= len {
                left -= len;
                i += 1;
                continue;
            }
            let at = r.start as usize + left;
            cut.push(at..r.end as usize);
            if left == 0 {
                self.segments.remove(i);
            } else {
                self.segments[i].end = at as u32;
                i += 1;
            }
            left = 0;
        }
        cut
    }

    /// Number of message-stream bytes.
    pub fn data_len(&self) -> usize {
        self.segments
            .iter()
            .map(|r| (r.end - r.start) as usize)
            .sum()
    }

    /// Marks the received bytes as whole messages sent outside the
    /// connection's byte stream (an RDMA send posted directly, see
    /// `proto::wire::IMM_STANDALONE`): they are decoded on their own, and the
    /// stream's reassembly state is neither used nor changed.
    pub fn mark_standalone(&mut self) {
        self.standalone = true;
    }

    /// See [`RecvBuffer::mark_standalone`].
    pub fn is_standalone(&self) -> bool {
        self.standalone
    }

    /// Stamps the buffer's arrival (see [`RecvBuffer::arrived`]).
    pub fn set_arrived(&mut self, at: u64) {
        self.arrived = at;
    }

    /// Its arrival as stamped (0: not stamped).
    pub fn arrived(&self) -> u64 {
        self.arrived
    }

    /// Forgets the segments, the standalone mark and the arrival stamp
    /// (buffer reuse).
    pub fn clear(&mut self) {
        self.segments.clear();
        self.standalone = false;
        self.arrived = 0;
    }
}

/// Appends message-stream ranges to a buffer (adjacent ranges merge).
pub struct SegmentSink<'a>(&'a mut SmallVec<[Range<u32>; 2]>);

impl SegmentSink<'_> {
    /// Marks `range` as message-stream bytes.
    pub fn push(&mut self, range: Range<usize>) {
        if range.is_empty() {
            return;
        }
        if let Some(last) = self.0.last_mut() {
            if last.end as usize == range.start {
                last.end = range.end as u32;
                return;
            }
        }
        self.0.push(range.start as u32..range.end as u32);
    }
}

/// A fixed set of receive buffers, allocated once at start.
#[derive(Debug)]
pub struct BufferPool {
    /// Last in, first out: receives go to the buffers still in cache (see
    /// [`FreeStack`]).
    free: FreeStack<RecvBuffer>,
    buffer_size: usize,
    /// The arena (for an RDMA engine's memory registration).
    #[cfg_attr(not(feature = "ib"), allow(dead_code))]
    count: usize,
    /// The arena's address (also to check that a returned buffer is ours).
    base: usize,
}

impl BufferPool {
    /// `count` buffers of `size` bytes each, in one arena.
    pub fn new(count: usize, size: usize) -> Self {
        // Zeroed memory straight from the allocator (pages are touched only
        // when first used).
        let bytes: Box<[u8]> = vec![0u8; count * size].into_boxed_slice();
        // SAFETY: UnsafeCell<u8> is repr(transparent) over u8, so the slice
        // layouts are identical and ownership moves unchanged.
        let mem = unsafe { Box::from_raw(Box::into_raw(bytes) as *mut [UnsafeCell<u8>]) };
        let arena = Arc::new(Arena { mem });
        let base = arena.mem.as_ptr() as *mut u8;
        let free = FreeStack::new(count);
        // Pushed last to first: the first buffers are taken first.
        for i in (0..count).rev() {
            free.push(
                i,
                RecvBuffer {
                    // SAFETY: i * size < count * size, inside the arena.
                    ptr: NonNull::new(unsafe { base.add(i * size) }).expect("arena pointer"),
                    len: size,
                    index: i as u32,
                    _arena: arena.clone(),
                    segments: SmallVec::new(),
                    standalone: false,
                    arrived: 0,
                },
            );
        }
        Self {
            free,
            buffer_size: size,
            count,
            base: base as usize,
        }
    }

    #[cfg_attr(not(feature = "ib"), allow(dead_code))]
    /// The arena (address, length) holding every buffer: an RDMA engine
    /// registers it once.
    pub fn arena(&self) -> (*mut u8, usize) {
        (self.base as *mut u8, self.count * self.buffer_size)
    }

    /// A free buffer, or `None` when all are in use (the caller stops
    /// receiving until [`BufferPool::put`] reports a return).
    pub fn get(&self) -> Option<RecvBuffer> {
        self.free.pop_or_note()
    }

    /// Returns a buffer; true if a receiver was starved and must be woken.
    pub fn put(&self, mut buf: RecvBuffer) -> bool {
        buf.clear();
        // A buffer of another pool would take the slot of one of ours.
        assert_eq!(
            buf.ptr.as_ptr() as usize,
            self.base + buf.index as usize * self.buffer_size,
            "receive buffer returned to a pool it does not belong to"
        );
        self.free.push(buf.index as usize, buf)
    }

    /// Buffers currently free.
    pub fn available(&self) -> usize {
        self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_is_bounded_and_reports_starvation() {
        let p = BufferPool::new(2, 1024);
        let mut a = p.get().unwrap();
        let b = p.get().unwrap();
        assert!(p.get().is_none());
        a.push_segment(0..10);
        a.push_segment(10..20);
        a.push_segment(30..40);
        assert_eq!(a.segments().count(), 2);
        assert_eq!(a.data_len(), 30);
        assert!(p.put(a), "starved receiver must be woken");
        assert!(!p.put(b));
        let a = p.get().unwrap();
        assert_eq!(a.data_len(), 0);
    }

    #[test]
    fn truncating_the_stream_keeps_its_first_bytes() {
        let p = BufferPool::new(1, 1024);
        let mut a = p.get().unwrap();
        for keep in 0..=32 {
            a.clear();
            // Stream bytes 0..10, 18..30 and 38..48 (chunk headers between).
            a.push_segment(0..10);
            a.push_segment(18..30);
            a.push_segment(38..48);
            let cut = a.truncate_stream(keep);
            assert_eq!(a.data_len(), keep);
            let kept: Vec<usize> = a
                .segments
                .iter()
                .flat_map(|r| r.start as usize..r.end as usize)
                .collect();
            let gone: Vec<usize> = cut.iter().flat_map(|r| r.clone()).collect();
            let all: Vec<usize> = (0..10).chain(18..30).chain(38..48).collect();
            assert_eq!([kept, gone].concat(), all, "keep {keep}");
        }
    }
}
