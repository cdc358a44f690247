//! TEMPORARY simple write-interest manager (replaced by the lock-free one).
use crossbeam::queue::SegQueue;
use std::sync::atomic::{AtomicBool, Ordering};
/// Write interest.
pub struct WriteInterest {
    q: SegQueue<u16>,
    flags: Box<[AtomicBool]>,
}
impl std::fmt::Debug for WriteInterest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WriteInterest")
    }
}
impl Default for WriteInterest {
    fn default() -> Self {
        Self::new()
    }
}
impl WriteInterest {
    /// New.
    pub fn new() -> Self {
        Self {
            q: SegQueue::new(),
            flags: (0..65536).map(|_| AtomicBool::new(false)).collect(),
        }
    }
    /// Push.
    pub fn push(&self, id: u16) -> bool {
        if !self.flags[id as usize].swap(true, Ordering::SeqCst) {
            self.q.push(id);
            true
        } else {
            false
        }
    }
    /// Pop.
    pub fn pop(&self) -> Option<u16> {
        let id = self.q.pop()?;
        self.flags[id as usize].store(false, Ordering::SeqCst);
        Some(id)
    }
    /// Empty.
    pub fn is_empty(&self) -> bool {
        self.q.is_empty()
    }
}
