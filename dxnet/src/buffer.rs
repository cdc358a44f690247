//! Reusable buffers whose bytes dxnet may send from (and read into) in
//! place.
//!
//! A [`Buffer`] is an owned, address-stable byte buffer. Applications that
//! reuse the same buffers for their messages and one-sided accesses (fill,
//! send, fill again; or read, use, read again) hand them to
//! [`Node::send_buffer`], [`Node::write_buffer`], [`Node::read_buffer`]
//! and their async forms. On InfiniBand a buffer that is reused often
//! enough is registered with the device and its bytes go from or into it
//! in place; until then they are copied as for slices. On TCP a message
//! from a buffer of at least `tcp.send_in_place_from` bytes (256 KiB by
//! default) goes to the socket from the buffer itself; smaller ones, and
//! one-sided accesses, are copied, as everything on loopback. When to register is the frequent-buffer policy of `[zero_copy]`
//! ([`crate::config::ZeroCopyConfig`]): a cost model of registration
//! against copying, speculative registration, a limit on pinned memory
//! with eviction, and a fallback when buffers are not reused. `NodeStats`
//! counts what happened.
//!
//! A send in place completes when the peer's device acknowledged it, about
//! a round trip on the wire after the post (on TCP: once its bytes are
//! written to the socket): [`Node::send_buffer`] waits for that,
//! [`Node::send_buffer_async`] lets the thread go on (e.g. to wait for the
//! answer) and gives the buffer back once it is done.
//!
//! A buffer's length ([`Buffer::set_len`], up to its
//! [`Buffer::capacity`]) is what sends and writes take and reads fill: a
//! buffer reused for messages of varying size is filled and sent with the
//! length of this message.
//!
//! Safety holds in safe Rust without rules for the caller:
//! - a blocking call borrows the buffer until the device is done with it;
//! - an async call takes the buffer by value and gives it back with its
//!   outcome; dropping the handle while the access runs leaves the memory
//!   to the access until the device is done;
//! - a registration lives inside the buffer and ends before its memory is
//!   freed, so a cached registration can never name memory that was freed
//!   and reused by another allocation;
//! - writing to a buffer whose bytes a failed access might still be
//!   reading first moves the buffer to a copy of its bytes
//!   (copy-on-write), so the device never sees a change it should not.

use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::core::regions::{RegionOp, WriteSource};
use crate::core::send::PendingSend;
use crate::core::Core;
use crate::primitives::buffer_mem::BufferMem;
use crate::region::RemoteRegion;
use crate::{Node, NodeId, Result};

pub use crate::core::zero_copy::ZeroCopyCosts;

/// An owned byte buffer dxnet may access in place (see the [module
/// docs](crate::buffer)). Dereferences to `[u8]`.
pub struct Buffer {
    pub(crate) mem: Arc<BufferMem>,
}

impl Buffer {
    /// A zeroed buffer of `len` bytes.
    pub fn new(len: usize) -> Buffer {
        Buffer {
            mem: Arc::new(BufferMem::zeroed(len)),
        }
    }

    /// A zeroed buffer of `capacity` bytes, none of them in use yet
    /// (length 0; see [`Buffer::set_len`]).
    pub fn with_capacity(capacity: usize) -> Buffer {
        let b = Buffer::new(capacity);
        b.mem.set_len(0);
        b
    }

    /// Length in bytes: what sends and writes from the buffer take, and
    /// what reads into it fill.
    #[inline]
    pub fn len(&self) -> usize {
        self.mem.len()
    }

    /// Bytes allocated: the most [`Buffer::set_len`] allows. A
    /// registration covers all of them, so a registered buffer stays
    /// registered whatever its length.
    pub fn capacity(&self) -> usize {
        self.mem.capacity()
    }

    /// Sets the length to `len`, e.g. to send only the part of a reused
    /// buffer filled this time. Bytes that come into view hold what they
    /// held before (zeros at first). Panics if `len` is over the capacity.
    pub fn set_len(&mut self, len: usize) {
        assert!(
            len <= self.capacity(),
            "length {len} over the buffer's capacity {}",
            self.capacity()
        );
        // An access still reading the old memory keeps its length.
        self.make_unique();
        self.mem.set_len(len);
    }

    /// True if the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.mem.len() == 0
    }

    /// How often dxnet counted a use of this buffer (accesses of at least
    /// `zero_copy.min_bytes`).
    pub fn uses(&self) -> u32 {
        self.mem.uses()
    }

    /// True while a node's device has the buffer registered (accesses
    /// then go in place).
    pub fn is_registered(&self) -> bool {
        self.mem.is_registered()
    }

    /// The bytes as a `Vec` (copied).
    pub fn to_vec(&self) -> Vec<u8> {
        self.deref().to_vec()
    }

    /// Makes the memory this handle's alone before a write: an access in
    /// flight keeps the old memory, this handle moves to a copy.
    #[inline]
    fn make_unique(&mut self) {
        if self.mem.in_flight() > 0 {
            self.mem = Arc::new(self.mem.detach());
        }
    }
}

impl From<Vec<u8>> for Buffer {
    /// Takes over the vector's allocation (no copy).
    fn from(v: Vec<u8>) -> Buffer {
        Buffer {
            mem: Arc::new(BufferMem::from_vec(v)),
        }
    }
}

impl From<&[u8]> for Buffer {
    fn from(v: &[u8]) -> Buffer {
        Buffer::from(v.to_vec())
    }
}

impl Deref for Buffer {
    type Target = [u8];
    #[inline]
    fn deref(&self) -> &[u8] {
        // SAFETY: a device writes a buffer's memory only while an
        // operation owns (or mutably borrows) its handle, and gives the
        // handle back only once the device is done or after moving it to
        // a copy (`Buffer::make_unique`); a shared borrow of the handle
        // therefore sees no device writes.
        unsafe { self.mem.bytes() }
    }
}

impl DerefMut for Buffer {
    #[inline]
    fn deref_mut(&mut self) -> &mut [u8] {
        self.make_unique();
        // SAFETY: `&mut self` excludes other users of the handle, and
        // `make_unique` left no device access on this memory (a new one
        // needs a borrow of the handle).
        unsafe { self.mem.bytes_mut() }
    }
}

impl AsRef<[u8]> for Buffer {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl AsMut<[u8]> for Buffer {
    fn as_mut(&mut self) -> &mut [u8] {
        self
    }
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("len", &self.len())
            .field("uses", &self.uses())
            .field("registered", &self.is_registered())
            .finish()
    }
}

/// What an access from or into a [`Buffer`] does when it completes.
#[derive(Debug)]
pub(crate) enum Finish {
    /// A write: nothing.
    Write,
    /// A read in place: nothing either (the device filled the buffer).
    ReadInPlace,
    /// A read through a copy: the bytes go into the buffer.
    ReadCopy,
}

/// A one-sided access from or into a [`Buffer`] in flight
/// ([`Node::write_buffer_async`], [`Node::read_buffer_async`]): wait for it
/// with [`BufferHandle::wait`] or `.await` it; either gives the buffer back
/// with the outcome.
#[derive(Debug)]
pub struct BufferHandle {
    op: RegionOp,
    buf: Option<Buffer>,
    finish: Finish,
}

impl BufferHandle {
    pub(crate) fn new(op: RegionOp, buf: Buffer, finish: Finish) -> BufferHandle {
        BufferHandle {
            op,
            buf: Some(buf),
            finish,
        }
    }

    /// Blocks until the access is done; gives the buffer back.
    pub fn wait(self) -> (Result<()>, Buffer) {
        let BufferHandle { op, buf, finish } = self;
        let mut buf = buf.expect("a handle not polled to completion has its buffer");
        let res = match finish {
            Finish::ReadCopy => op.wait_into(&mut buf),
            _ => op.wait().map(drop),
        };
        (settle(res, &mut buf), buf)
    }
}

impl Future for BufferHandle {
    type Output = (Result<()>, Buffer);
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let res = match this.op.poll_wait(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(r) => r,
        };
        let mut buf = this.buf.take().expect("polled after completion");
        let res = match (res, &this.finish) {
            (Ok(bytes), Finish::ReadCopy) => {
                buf.copy_from_slice(&bytes);
                Ok(())
            }
            (r, _) => r.map(drop),
        };
        Poll::Ready((settle(res, &mut buf), buf))
    }
}

/// A message from a [`Buffer`] in flight ([`Node::send_buffer_async`]):
/// wait for it with [`SendHandle::wait`] or `.await` it; either gives the
/// buffer back with the outcome.
#[derive(Debug)]
pub struct SendHandle {
    core: Arc<Core>,
    /// In place: the send in flight; `None` once it was done at the start
    /// (copied, or failed) with `started`.
    pending: Option<PendingSend>,
    started: Option<Result<()>>,
    buf: Option<Buffer>,
}

impl SendHandle {
    /// Blocks until the send completed (its bytes left the buffer); gives
    /// the buffer back.
    pub fn wait(mut self) -> (Result<()>, Buffer) {
        let mut buf = self
            .buf
            .take()
            .expect("a handle not polled to completion has its buffer");
        let res = match (&self.pending, self.started.take()) {
            (Some(p), _) => self.core.wait_send(p),
            (None, r) => r.unwrap_or(Ok(())),
        };
        (settle(res, &mut buf), buf)
    }
}

impl Future for SendHandle {
    type Output = (Result<()>, Buffer);
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let res = match (&this.pending, this.started.take()) {
            (Some(p), _) => match this.core.poll_send(p, cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(r) => r,
            },
            (None, r) => r.unwrap_or(Ok(())),
        };
        let mut buf = this.buf.take().expect("polled after completion");
        Poll::Ready((settle(res, &mut buf), buf))
    }
}

/// After a failed access the device may still be using the memory: the
/// buffer moves to a copy.
pub(crate) fn settle(res: Result<()>, buf: &mut Buffer) -> Result<()> {
    if res.is_err() {
        buf.make_unique();
    }
    res
}

impl Node {
    /// Writes all of `buf` at `offset` of `remote`; returns once it is in
    /// place. On InfiniBand the device reads a buffer the zero-copy policy
    /// registered in place (see the [module docs](crate::buffer));
    /// otherwise the bytes are copied, as by [`Node::write`].
    pub fn write_buffer(&self, remote: &RemoteRegion, offset: u64, buf: &Buffer) -> Result<()> {
        self.core()
            .region_write(remote, offset, WriteSource::Buffer(&buf.mem), None, true)?
            .wait()
            .map(drop)
    }

    /// [`Node::write_buffer`] with a notification, as
    /// [`Node::write_with_notify`].
    pub fn write_with_notify_buffer(
        &self,
        remote: &RemoteRegion,
        offset: u64,
        buf: &Buffer,
        imm: u32,
    ) -> Result<()> {
        self.core()
            .region_write(
                remote,
                offset,
                WriteSource::Buffer(&buf.mem),
                Some(imm),
                true,
            )?
            .wait()
            .map(drop)
    }

    /// Starts [`Node::write_buffer`], taking the buffer until the write is
    /// done: the handle gives it back with the outcome (an error to start
    /// comes from the handle too).
    pub fn write_buffer_async(
        &self,
        remote: &RemoteRegion,
        offset: u64,
        buf: Buffer,
    ) -> BufferHandle {
        self.buffer_write(remote, offset, buf, None)
    }

    /// Starts [`Node::write_with_notify_buffer`] (see
    /// [`Node::write_buffer_async`]).
    pub fn write_with_notify_buffer_async(
        &self,
        remote: &RemoteRegion,
        offset: u64,
        buf: Buffer,
        imm: u32,
    ) -> BufferHandle {
        self.buffer_write(remote, offset, buf, Some(imm))
    }

    fn buffer_write(
        &self,
        remote: &RemoteRegion,
        offset: u64,
        buf: Buffer,
        notify: Option<u32>,
    ) -> BufferHandle {
        let core = self.core();
        let op = core
            .region_write(remote, offset, WriteSource::Buffer(&buf.mem), notify, false)
            .unwrap_or_else(|e| RegionOp::failed(core, remote, offset, e));
        BufferHandle::new(op, buf, Finish::Write)
    }

    /// Reads `buf.len()` bytes at `offset` of `remote` into `buf`. On
    /// InfiniBand the device fills a buffer the zero-copy policy
    /// registered in place; otherwise the bytes are copied in. After an
    /// error the buffer's bytes are unspecified.
    pub fn read_buffer(&self, remote: &RemoteRegion, offset: u64, buf: &mut Buffer) -> Result<()> {
        let (op, finish) = self
            .core()
            .region_read_buffer(remote, offset, &buf.mem, true)?;
        let res = match finish {
            Finish::ReadCopy => op.wait_into(buf),
            _ => op.wait().map(drop),
        };
        settle(res, buf)
    }

    /// Starts [`Node::read_buffer`], taking the buffer until the bytes are
    /// in it: the handle gives it back with the outcome.
    pub fn read_buffer_async(
        &self,
        remote: &RemoteRegion,
        offset: u64,
        buf: Buffer,
    ) -> BufferHandle {
        let core = self.core();
        match core.region_read_buffer(remote, offset, &buf.mem, false) {
            Ok((op, finish)) => BufferHandle::new(op, buf, finish),
            Err(e) => BufferHandle::new(
                RegionOp::failed(core, remote, offset, e),
                buf,
                Finish::Write,
            ),
        }
    }

    /// Sends the bytes of `buf` as a raw message of (`msg_type`,
    /// `subtype`), like [`Node::send_raw`]; returns once `buf` may change.
    /// On InfiniBand a buffer the zero-copy policy registered is sent in
    /// place: one work request gathers the message header from registered
    /// memory and the payload from `buf` (more for a payload larger than a
    /// receive), posted right behind the connection's ring data, and this
    /// waits for the device to complete the send (the message keeps its
    /// order among this thread's other sends). On TCP a buffer of at least
    /// `tcp.send_in_place_from` bytes is sent in place too: its header goes
    /// into the ring, the send thread writes the payload to the socket
    /// from `buf` right behind it, and this waits until it did. Otherwise
    /// the bytes are copied into the ring buffer and this returns at once,
    /// as `send_raw` does. Sends the first [`Buffer::len`] bytes.
    pub fn send_buffer(&self, dest: NodeId, msg_type: u8, subtype: u8, buf: &Buffer) -> Result<()> {
        self.core().send_buffer(dest, msg_type, subtype, &buf.mem)
    }

    /// Starts [`Node::send_buffer`], taking the buffer until the send
    /// completed: the handle gives it back with the outcome (at once when
    /// the bytes were copied). While a send in place is in flight the
    /// thread may go on (e.g. wait for the answer to it), instead of
    /// waiting for the device's completion as `send_buffer` does.
    pub fn send_buffer_async(
        &self,
        dest: NodeId,
        msg_type: u8,
        subtype: u8,
        buf: Buffer,
    ) -> SendHandle {
        let core = self.core();
        let (pending, started) = match core.start_send_buffer(dest, msg_type, subtype, &buf.mem) {
            Ok(Some(p)) => (Some(p), None),
            Ok(None) => (None, Some(Ok(()))),
            Err(e) => (None, Some(Err(e))),
        };
        SendHandle {
            core: core.clone(),
            pending,
            started,
            buf: Some(buf),
        }
    }

    /// Registers `buf` with this node's device now, whatever its uses so
    /// far (an application that knows it will reuse the buffer skips the
    /// policy's wait). `Ok(false)` on an engine without registered memory
    /// (TCP, loopback), where accesses copy anyway; an error
    /// ([`crate::RegionError::Registration`]) if it cannot be registered:
    /// accesses from it are then copied.
    pub fn register_buffer(&self, buf: &Buffer) -> Result<bool> {
        self.core().register_buffer(&buf.mem)
    }

    /// The costs the zero-copy policy measured on this node's device (at
    /// the first buffer access that needed them), if it did.
    pub fn zero_copy_costs(&self) -> Option<ZeroCopyCosts> {
        self.core().zero_copy_costs()
    }
}
