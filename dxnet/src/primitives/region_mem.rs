//! Address-stable, page-aligned memory that other nodes may write and read
//! (an exposed region's bytes).
//!
//! The bytes are never reachable through a Rust reference that outlives a
//! lock: every CPU access (the owner's local reads and writes, and
//! one-sided operations an engine emulates) copies under the block's
//! read-write lock, so CPU accesses never race. An RDMA device writes and
//! reads the memory by DMA, outside the lock and outside the Rust memory
//! model; a CPU read overlapping such a write may see any mix of old and
//! new bytes (every bit pattern is a valid `u8`), which is the documented
//! behaviour of one-sided writes everywhere.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use parking_lot::RecursiveRwLock;

/// Alignment of a block: a page, as RDMA registration prefers.
const ALIGN: usize = 4096;

/// A zeroed, page-aligned block of `len` bytes at a fixed address.
pub struct MemBlock {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
    /// Serializes CPU accesses (see the module docs); true once closed.
    /// Readers go first (see [`MemBlock::with_bytes`]).
    lock: RecursiveRwLock<bool>,
}

/// Why an access to a [`MemBlock`] did nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemError {
    /// The range is not inside the block.
    OutOfRange,
    /// The block was closed.
    Closed,
}

// SAFETY: the block owns its allocation; every access to the bytes goes
// through `&self` methods that hold `lock` (shared for reads, exclusive for
// writes), so sharing and sending the block between threads is sound.
unsafe impl Send for MemBlock {}
// SAFETY: as for `Send`.
unsafe impl Sync for MemBlock {}

impl std::fmt::Debug for MemBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemBlock")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

impl MemBlock {
    /// Allocates `len` zeroed bytes; `None` if `len` is 0 or the memory
    /// cannot be had.
    pub fn new(len: usize) -> Option<MemBlock> {
        if len == 0 {
            return None;
        }
        let layout = Layout::from_size_align(len, ALIGN).ok()?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) })?;
        Some(MemBlock {
            ptr,
            len,
            layout,
            lock: RecursiveRwLock::new(false),
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The first byte's address (for RDMA registration).
    #[cfg_attr(not(feature = "ib"), allow(dead_code))]
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Copies `buf.len()` bytes starting at `offset` into `buf`.
    pub fn read(&self, offset: usize, buf: &mut [u8]) -> Result<(), MemError> {
        self.with_bytes(offset, buf.len(), |src| buf.copy_from_slice(src))
    }

    /// Copies `data` into the block at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), MemError> {
        self.write_vectored(offset, &[data])
    }

    /// Copies `parts` one after the other into the block from `offset`,
    /// under one lock.
    pub fn write_vectored(&self, offset: usize, parts: &[&[u8]]) -> Result<(), MemError> {
        let len = parts
            .iter()
            .try_fold(0usize, |n, p| n.checked_add(p.len()))
            .ok_or(MemError::OutOfRange)?;
        if !self.contains(offset, len) {
            return Err(MemError::OutOfRange);
        }
        let closed = self.lock.write();
        if *closed {
            return Err(MemError::Closed);
        }
        let mut at = offset;
        for p in parts {
            // SAFETY: `[offset, offset + len)` is inside the allocation
            // (checked above) and the parts fill it in turn; the exclusive
            // lock keeps every other CPU access out; a part is a caller's
            // slice, which cannot overlap the block: the block's bytes are
            // never lent out past a lock (see `with_bytes`).
            unsafe {
                std::ptr::copy_nonoverlapping(p.as_ptr(), self.ptr.as_ptr().add(at), p.len())
            };
            at += p.len();
        }
        Ok(())
    }

    /// Runs `f` on the `len` bytes at `offset` under the shared lock (no CPU
    /// write meanwhile).
    ///
    /// A reader does not queue behind a writer that waits for other
    /// readers: `f` may copy the bytes into a ring buffer and wait there for
    /// space, which may need another reader to finish first (one that
    /// reserved space in the same ring before and fills it from this
    /// block). Were that reader held back by the waiting writer, which
    /// waits for `f`, none of them would go on. Writers only copy under the
    /// lock, so a reader waits at most for the copies of writers that got
    /// the lock before it. A writer (and [`MemBlock::close`]) waits until no
    /// reader holds the block, also while reads overlap without a gap.
    pub fn with_bytes<R>(
        &self,
        offset: usize,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, MemError> {
        if !self.contains(offset, len) {
            return Err(MemError::OutOfRange);
        }
        let closed = self.lock.read();
        if *closed {
            return Err(MemError::Closed);
        }
        // SAFETY: the range is inside the allocation; CPU writers need the
        // exclusive lock, so nothing the Rust model knows of writes these
        // bytes while `f` borrows them, and the borrow ends with the lock.
        // (An RDMA device may write them meanwhile: see the module docs.)
        let bytes = unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) };
        Ok(f(bytes))
    }

    /// Closes the block: later accesses fail with [`MemError::Closed`].
    /// Returns once no access runs any more.
    pub fn close(&self) {
        *self.lock.write() = true;
    }

    fn contains(&self, offset: usize, len: usize) -> bool {
        offset.checked_add(len).is_some_and(|end| end <= self.len)
    }
}

impl Drop for MemBlock {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    /// A reader that holds the block while it waits for a second reader
    /// (as one waiting for ring space that the second one's reservation
    /// holds) is not stuck when a writer queued between them: the second
    /// reader gets in past the waiting writer, and the writer writes once
    /// both are done.
    #[test]
    fn a_reader_is_not_held_behind_a_waiting_writer() {
        let m = MemBlock::new(4096).unwrap();
        let (writing, second_done) = (AtomicBool::new(false), AtomicBool::new(false));
        std::thread::scope(|s| {
            let first = m
                .with_bytes(0, 8, |_| {
                    let writer = s.spawn(|| {
                        writing.store(true, Ordering::SeqCst);
                        m.write(0, &[9; 8]).unwrap()
                    });
                    // The writer is about to lock: give it time to queue.
                    while !writing.load(Ordering::SeqCst) {
                        std::thread::yield_now();
                    }
                    std::thread::sleep(Duration::from_millis(50));
                    let second = s.spawn(|| {
                        m.with_bytes(0, 8, |b| assert_eq!(b, &[0; 8])).unwrap();
                        second_done.store(true, Ordering::SeqCst);
                    });
                    let give_up = Instant::now() + Duration::from_secs(20);
                    while !second_done.load(Ordering::SeqCst) && Instant::now() < give_up {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    (writer, second, second_done.load(Ordering::SeqCst))
                })
                .unwrap();
            let (writer, second, got_in) = first;
            assert!(got_in, "the second reader waited behind the writer");
            second.join().unwrap();
            writer.join().unwrap();
        });
        let mut b = [0u8; 8];
        m.read(0, &mut b).unwrap();
        assert_eq!(b, [9; 8], "the writer wrote after the readers");
    }

    #[test]
    fn zeroed_aligned_and_bounds_checked() {
        assert!(MemBlock::new(0).is_none());
        let m = MemBlock::new(10_000).unwrap();
        assert_eq!(m.ptr.as_ptr() as usize % ALIGN, 0);
        let mut all = vec![1u8; 10_000];
        m.read(0, &mut all).unwrap();
        assert!(all.iter().all(|&b| b == 0));
        m.write(9_990, &[7; 10]).unwrap();
        assert_eq!(m.write(9_991, &[7; 10]), Err(MemError::OutOfRange));
        m.write_vectored(0, &[&[1, 2], &[], &[3]]).unwrap();
        assert_eq!(
            m.write_vectored(9_998, &[&[1, 2], &[3]]),
            Err(MemError::OutOfRange)
        );
        let mut three = [0u8; 3];
        m.read(0, &mut three).unwrap();
        assert_eq!(three, [1, 2, 3]);
        m.write(0, &[0; 3]).unwrap();
        assert_eq!(m.write(usize::MAX, &[7; 2]), Err(MemError::OutOfRange));
        let mut b = [0u8; 11];
        assert_eq!(m.read(9_990, &mut b), Err(MemError::OutOfRange));
        m.read(9_989, &mut b).unwrap();
        assert_eq!(b, [0, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7]);
        assert_eq!(m.with_bytes(9_999, 1, |s| s[0]), Ok(7));
        assert_eq!(m.with_bytes(10_000, 0, |s| s.len()), Ok(0));
        assert_eq!(
            m.with_bytes(10_000, 1, |s| s.len()),
            Err(MemError::OutOfRange)
        );
        m.close();
        assert_eq!(m.write(0, &[1]), Err(MemError::Closed));
        assert_eq!(m.read(0, &mut b), Err(MemError::Closed));
    }

    #[test]
    fn concurrent_writers_and_readers_see_whole_writes() {
        let m = std::sync::Arc::new(MemBlock::new(4096).unwrap());
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                let m = m.clone();
                std::thread::spawn(move || {
                    for _ in 0..2000 {
                        m.write(0, &[t; 4096]).unwrap();
                        m.with_bytes(0, 4096, |s| assert!(s.iter().all(|&b| b == s[0])))
                            .unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }
}
