//! Pooled fixed-size receive buffers.
//!
//! Transports read (or RDMA-receive) into buffers from the pool, so the
//! receive path allocates nothing in steady state and the memory a node
//! spends on received data is bounded by `recv_pool_size ×
//! recv_buffer_size`.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};

use crossbeam::queue::ArrayQueue;

/// One pooled receive buffer: `data` holds bytes a transport received;
/// `segments` name the ranges of `data` that belong to the connection's
/// message stream (a TCP buffer may also hold chunk headers, which are not
/// message bytes).
#[derive(Debug)]
pub struct RecvBuffer {
    data: Box<[u8]>,
    segments: Vec<Range<u32>>,
}

impl RecvBuffer {
    fn new(size: usize) -> Self {
        Self {
            data: vec![0u8; size].into_boxed_slice(),
            segments: Vec::new(),
        }
    }

    /// The whole buffer, for a transport to receive into.
    pub fn space(&mut self) -> &mut [u8] {
        &mut self.data
    }

    /// Buffer capacity.
    pub fn capacity(&self) -> usize {
        self.data.len()
    }

    /// Raw pointer to the memory (for RDMA registration of the pool).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.data.as_mut_ptr()
    }

    /// Marks `range` of the buffer as message-stream bytes (in stream order).
    pub fn push_segment(&mut self, range: Range<usize>) {
        debug_assert!(range.end <= self.data.len());
        SegmentSink(&mut self.segments).push(range);
    }

    /// The received bytes and a sink for their message-stream ranges (for
    /// parsers that mark ranges while reading the bytes).
    pub fn space_and_segments(&mut self) -> (&[u8], SegmentSink<'_>) {
        (&self.data, SegmentSink(&mut self.segments))
    }

    /// The message-stream bytes, in order.
    pub fn segments(&self) -> impl Iterator<Item = &[u8]> {
        self.segments
            .iter()
            .map(|r| &self.data[r.start as usize..r.end as usize])
    }

    /// Number of message-stream bytes.
    pub fn data_len(&self) -> usize {
        self.segments
            .iter()
            .map(|r| (r.end - r.start) as usize)
            .sum()
    }

    /// Forgets the segments (buffer reuse).
    pub fn clear(&mut self) {
        self.segments.clear();
    }
}

/// Appends message-stream ranges to a buffer (adjacent ranges merge).
pub struct SegmentSink<'a>(&'a mut Vec<Range<u32>>);

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
    free: ArrayQueue<RecvBuffer>,
    buffer_size: usize,
    starved: AtomicBool,
}

impl BufferPool {
    /// `count` buffers of `size` bytes each.
    pub fn new(count: usize, size: usize) -> Self {
        let free = ArrayQueue::new(count);
        for _ in 0..count {
            let _ = free.push(RecvBuffer::new(size));
        }
        Self {
            free,
            buffer_size: size,
            starved: AtomicBool::new(false),
        }
    }

    /// Size of every buffer.
    pub fn buffer_size(&self) -> usize {
        self.buffer_size
    }

    /// A free buffer, or `None` when all are in use (the caller stops
    /// receiving until [`BufferPool::put`] reports a return).
    pub fn get(&self) -> Option<RecvBuffer> {
        match self.free.pop() {
            Some(b) => Some(b),
            None => {
                self.starved.store(true, Ordering::SeqCst);
                // A buffer may have come back between the pop and the flag.
                self.free.pop()
            }
        }
    }

    /// Returns a buffer; true if a receiver was starved and must be woken.
    pub fn put(&self, mut buf: RecvBuffer) -> bool {
        buf.clear();
        debug_assert_eq!(buf.capacity(), self.buffer_size);
        let _ = self.free.push(buf);
        self.starved.swap(false, Ordering::SeqCst)
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
}
