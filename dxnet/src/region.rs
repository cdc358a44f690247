//! One-sided operations: memory a node exposes, which other nodes write
//! and read without running code of the owner's application.
//!
//! ```no_run
//! # fn demo(a: &dxnet::Node, b: &dxnet::Node) -> dxnet::Result<()> {
//! use dxnet::region::Access;
//! // Node A exposes 1 MiB that others may write and read ...
//! let region = a.expose(1 << 20, Access::ReadWrite)?;
//! let remote = region.descriptor(); // serde: send it in any message
//! // ... node B writes into it and reads it back.
//! b.write(&remote, 4096, b"hello")?;
//! let mut buf = [0u8; 5];
//! b.read(&remote, 4096, &mut buf)?;
//! # Ok(()) }
//! ```
//!
//! **Semantics.**
//! - A blocking [`Node::write`] returns once the data is in place at the
//!   owner; a blocking [`Node::read`] once the bytes are in the caller's
//!   buffer. The `_async` variants return a handle that is also a
//!   `Future`. An access not finished within `limits.request_timeout_ms`
//!   fails with [`Error::Timeout`]; one whose connection breaks fails with
//!   [`Error::Unreachable`].
//! - Bounds and rights are checked against the descriptor before anything
//!   is sent, and again by the owner: an access outside the region or not
//!   permitted by the [`Access`] chosen at expose time fails with
//!   [`RegionError`] and touches no memory.
//! - Order: accesses and messages from one thread to one node are applied
//!   in the order they were issued (as messages are delivered), so a
//!   message sent after a write is handled after the write's data is in
//!   place. Accesses from different threads, or to different nodes, are not
//!   ordered with each other. Concurrent writes to overlapping bytes leave
//!   the bytes of one of them per part (an access is applied in parts of up
//!   to 256 KiB); a read concurrent with a write may see either.
//! - A write of several parts that fails may have been applied in part.
//! - Revoking ([`Region::revoke`], or dropping the [`Region`]) waits for
//!   the accesses being applied to it; later ones fail with
//!   [`RegionError::Revoked`], as do accesses with a descriptor from
//!   before the owner restarted.
//! - [`Node::write_with_notify`]: once all of the write's data is in
//!   place, the owner's receiver set with [`Node::on_region_write`] gets a
//!   [`RegionWrite`] carrying the caller's 32-bit value, on a handler
//!   thread. The data is in place when the receiver runs; a later write
//!   to the same bytes may be too (with RDMA the device places it without
//!   waiting for the receiver), so a protocol that reuses memory waits for
//!   the owner's word first, as a circular buffer with a tail does.
//!
//! - In place: [`Node::write_from`] and [`Node::read_into`] (and their
//!   `_async` and notifying forms) move bytes between a range of one of the
//!   caller's own regions and a remote one, instead of the caller's
//!   slices. On InfiniBand the device reads or fills the own region
//!   directly, no copy. An access in flight keeps that region's memory
//!   (and registration) alive, so dropping its [`Region`] meanwhile is
//!   safe: a write still carries the bytes the range holds until it
//!   completes, a read's bytes go to memory nobody sees any more. The own
//!   range is checked first ([`RegionError::LocalOutOfBounds`]; a region
//!   of another node is [`RegionError::NotOwnRegion`]). A region exposed
//!   [`Access::LocalOnly`] serves only as such a local side.
//!
//! **How.** On InfiniBand a region is registered with the device when
//! exposed and its descriptor carries the address and remote key: an
//! access is a series of RDMA WRITE or READ work requests (parts of up to
//! 64 KiB, through registered staging memory of `ib.staging_slots`, or in
//! place from or into an own region) on the
//! connection's queue pair, posted after the data of the connection's
//! ring; the owner's CPU takes no part (a write with notification is
//! followed by a small message). Outcomes come from the connection's
//! send completions, of which only some parts ask for one (see the
//! docs/pipeline.md, InfiniBand); a blocking wait retires them itself
//! before it parks. A pending `Future` there is woken by completions and
//! by the connection's end: it fails with [`Error::Timeout`] when polled
//! after `limits.request_timeout_ms`, and an unresponsive peer's
//! connection is closed by the send watchdog (`limits.send_timeout_ms`).
//! An access the owner's device refuses (revoked region, descriptor
//! claiming more than the region allows) fails with
//! [`RegionError::Revoked`], the parts behind it with
//! [`Error::Unreachable`], and closes the connection, which the next
//! access opens again. On TCP and loopback the engine emulates
//! the accesses with messages of dxnet's own type 0 (`proto::region`),
//! applied at the owner by the runtime on the connection's handler
//! thread. Accesses to the own node are applied at once.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};

use serde::{Deserialize, Serialize};

use crate::core::regions::{ExposedRegion, RegionOp, WriteSource};
use crate::core::Core;
use crate::{Error, Node, NodeId, RegionError, Result};

/// What other nodes may do with an exposed region ([`Access::LocalOnly`]:
/// nothing; the region is the local side of the own node's
/// [`Node::write_from`] and [`Node::read_into`], such as an outgoing
/// buffer; on InfiniBand it is registered for local access only).
pub use crate::proto::region::Access;
pub(crate) use crate::proto::region::RdmaKey;
use crate::proto::region::{Descriptor, Refusal};

/// Names an exposed region to other nodes: send it in any message; the
/// receiver uses it with [`Node::write`] and [`Node::read`].
///
/// The key is random per region: a descriptor of a revoked region, or of
/// a node that restarted since, names nothing there (accesses fail with
/// [`RegionError::Revoked`]). Nothing in it is trusted beyond the checks
/// before sending: the owner checks every access against the region
/// itself (on InfiniBand its device does).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RemoteRegion(Descriptor);

impl RemoteRegion {
    /// The owner.
    pub fn node(&self) -> NodeId {
        NodeId(self.0.node)
    }

    /// The region's id at its owner.
    pub fn id(&self) -> u32 {
        self.0.id
    }

    /// The region's random key.
    pub(crate) fn key(&self) -> u64 {
        self.0.key
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.0.len
    }

    /// Whether the region is empty (never: regions have at least a byte).
    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// What others may do.
    pub fn access(&self) -> Access {
        self.0.access
    }

    /// Address and remote key for the device path.
    pub(crate) fn rdma(&self) -> Option<RdmaKey> {
        self.0.rdma
    }

    /// Checks an access against the descriptor before anything is sent.
    pub(crate) fn check(&self, offset: u64, len: u64, write: bool) -> Result<()> {
        match self.0.check(offset, len, write) {
            Ok(()) => Ok(()),
            Err(Refusal::NotPermitted) if write => {
                Err(Error::Region(RegionError::WriteNotPermitted))
            }
            Err(Refusal::NotPermitted) => Err(Error::Region(RegionError::ReadNotPermitted)),
            Err(Refusal::OutOfBounds) => Err(Error::Region(RegionError::OutOfBounds {
                offset,
                len,
                region_len: self.0.len,
            })),
        }
    }
}

/// A write with notification that arrived at one of this node's regions
/// (see [`Node::on_region_write`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RegionWrite {
    /// The writer.
    pub from: NodeId,
    /// The region's id ([`Region::id`]).
    pub region: u32,
    /// Where the data starts.
    pub offset: u64,
    /// How many bytes were written.
    pub len: u64,
    /// The writer's value.
    pub imm: u32,
}

/// A memory region this node exposes. The memory stays at its address
/// while the handle lives; dropping the handle (or [`Region::revoke`])
/// revokes it.
///
/// The owner reads and writes it with [`Region::read`] and
/// [`Region::write`], which copy: the bytes are never lent out as a Rust
/// reference, since other nodes may change them at any time.
#[derive(Debug)]
pub struct Region {
    inner: Arc<ExposedRegion>,
    core: Weak<Core>,
    node: NodeId,
}

impl Region {
    /// The region's id at this node.
    pub fn id(&self) -> u32 {
        self.inner.id()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.mem().len()
    }

    /// Whether the region is empty (never: regions have at least a byte).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What others may do.
    pub fn access(&self) -> Access {
        self.inner.access()
    }

    /// The descriptor to hand to other nodes.
    pub fn descriptor(&self) -> RemoteRegion {
        RemoteRegion(Descriptor {
            node: self.node.0,
            id: self.inner.id(),
            key: self.inner.key(),
            len: self.inner.len(),
            access: self.inner.access(),
            rdma: self.inner.rdma(),
        })
    }

    /// Copies `buf.len()` bytes at `offset` into `buf`.
    pub fn read(&self, offset: usize, buf: &mut [u8]) -> Result<()> {
        self.inner
            .mem()
            .read(offset, buf)
            .map_err(|_| self.out_of_bounds(offset, buf.len()))
    }

    /// The whole region's bytes.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len()];
        self.read(0, &mut v).expect("the whole region is in bounds");
        v
    }

    /// Copies `data` into the region at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.write_vectored(offset, &[data])
    }

    /// Copies `parts` one after the other into the region from `offset`
    /// (a header and a payload, say): one call, one lock, no gathering
    /// copy by the caller.
    pub fn write_vectored(&self, offset: usize, parts: &[&[u8]]) -> Result<()> {
        self.inner.mem().write_vectored(offset, parts).map_err(|_| {
            let len = parts.iter().map(|p| p.len() as u64).sum::<u64>();
            self.out_of_bounds(offset, len as usize)
        })
    }

    fn out_of_bounds(&self, offset: usize, len: usize) -> Error {
        Error::Region(RegionError::OutOfBounds {
            offset: offset as u64,
            len: len as u64,
            region_len: self.len() as u64,
        })
    }

    /// Revokes the region: returns once no access to it runs; later
    /// accesses by others fail with [`RegionError::Revoked`].
    pub fn revoke(self) {
        drop(self)
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        match self.core.upgrade() {
            Some(core) => core.revoke(&self.inner),
            None => self.inner.mem().close(),
        }
    }
}

/// A one-sided write in flight ([`Node::write_async`],
/// [`Node::write_from_async`]), or a read into an own region
/// ([`Node::read_into_async`]): wait for it with [`WriteHandle::wait`] or
/// `.await` it.
#[derive(Debug)]
pub struct WriteHandle(RegionOp);

impl WriteHandle {
    /// Blocks until the data is in place (at the owner; for a read, in
    /// the own region).
    pub fn wait(self) -> Result<()> {
        self.0.wait().map(drop)
    }
}

impl Future for WriteHandle {
    type Output = Result<()>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        self.get_mut().0.poll_wait(cx).map(|r| r.map(drop))
    }
}

/// A one-sided read in flight ([`Node::read_async`]): wait for its bytes
/// with [`ReadHandle::wait`] or `.await` them.
#[derive(Debug)]
pub struct ReadHandle(RegionOp);

impl ReadHandle {
    /// Blocks until the bytes are here.
    pub fn wait(self) -> Result<Vec<u8>> {
        self.0.wait()
    }
}

impl Future for ReadHandle {
    type Output = Result<Vec<u8>>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<Vec<u8>>> {
        self.get_mut().0.poll_wait(cx)
    }
}

impl Node {
    /// Exposes a new zeroed region of `len` bytes that other nodes may
    /// access as `access` says (see the [module docs](crate::region)).
    pub fn expose(&self, len: usize, access: Access) -> Result<Region> {
        let core = self.core();
        Ok(Region {
            inner: core.expose(len, access)?,
            core: Arc::downgrade(core),
            node: self.id(),
        })
    }

    /// Writes `data` at `offset` of `remote`; returns once it is in place.
    pub fn write(&self, remote: &RemoteRegion, offset: u64, data: &[u8]) -> Result<()> {
        self.core()
            .region_write(remote, offset, WriteSource::Bytes(data), None, true)?
            .wait()
            .map(drop)
    }

    /// Writes `data` at `offset` of `remote` and has the owner's
    /// [`Node::on_region_write`] receiver called with `imm` once all of it
    /// is in place; returns once it is.
    pub fn write_with_notify(
        &self,
        remote: &RemoteRegion,
        offset: u64,
        data: &[u8],
        imm: u32,
    ) -> Result<()> {
        self.core()
            .region_write(remote, offset, WriteSource::Bytes(data), Some(imm), true)?
            .wait()
            .map(drop)
    }

    /// Starts [`Node::write`]: `data` is copied before this returns; the
    /// handle says when it is in place.
    pub fn write_async(
        &self,
        remote: &RemoteRegion,
        offset: u64,
        data: &[u8],
    ) -> Result<WriteHandle> {
        Ok(WriteHandle(self.core().region_write(
            remote,
            offset,
            WriteSource::Bytes(data),
            None,
            false,
        )?))
    }

    /// Starts [`Node::write_with_notify`] (see [`Node::write_async`]).
    pub fn write_with_notify_async(
        &self,
        remote: &RemoteRegion,
        offset: u64,
        data: &[u8],
        imm: u32,
    ) -> Result<WriteHandle> {
        Ok(WriteHandle(self.core().region_write(
            remote,
            offset,
            WriteSource::Bytes(data),
            Some(imm),
            false,
        )?))
    }

    /// Reads `buf.len()` bytes at `offset` of `remote` into `buf`.
    pub fn read(&self, remote: &RemoteRegion, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.core()
            .region_read(remote, offset, buf.len(), None, true)?
            .wait_into(buf)
    }

    /// Starts a read of `len` bytes at `offset` of `remote`.
    pub fn read_async(&self, remote: &RemoteRegion, offset: u64, len: usize) -> Result<ReadHandle> {
        Ok(ReadHandle(
            self.core().region_read(remote, offset, len, None, false)?,
        ))
    }

    /// Writes `len` bytes at `local_offset` of this node's region `local`
    /// to `offset` of `remote`; returns once they are in place. On
    /// InfiniBand the device reads them from `local` in place (no copy,
    /// `local` is registered for it on first use); elsewhere they are
    /// copied out before this returns. The bytes are those of `local`
    /// while the access runs: change them only after it returned.
    pub fn write_from(
        &self,
        remote: &RemoteRegion,
        offset: u64,
        local: &Region,
        local_offset: usize,
        len: usize,
    ) -> Result<()> {
        self.write_from_async_inner(remote, offset, local, local_offset, len, None, true)?
            .wait()
    }

    /// Whether [`Node::write_from`] and its forms send the bytes of the
    /// local region to another node in place (InfiniBand: the device reads
    /// the registered memory while the write runs) rather than copying
    /// them out when the write is posted (TCP, loopback). Code that lays
    /// out bytes only to write them to other nodes saves a copy by laying
    /// them into a region when this is true and into plain memory (for
    /// [`Node::write_async`]) when it is false.
    pub fn writes_from_region_in_place(&self) -> bool {
        self.core().writes_in_place()
    }

    /// Starts [`Node::write_from`]. `local` may be dropped meanwhile (the
    /// access keeps its memory); the bytes written are those it holds
    /// until the handle reports the write done.
    pub fn write_from_async(
        &self,
        remote: &RemoteRegion,
        offset: u64,
        local: &Region,
        local_offset: usize,
        len: usize,
    ) -> Result<WriteHandle> {
        self.write_from_async_inner(remote, offset, local, local_offset, len, None, false)
    }

    /// [`Node::write_with_notify`] of bytes of this node's region `local`
    /// (see [`Node::write_from`]).
    pub fn write_with_notify_from(
        &self,
        remote: &RemoteRegion,
        offset: u64,
        local: &Region,
        local_offset: usize,
        len: usize,
        imm: u32,
    ) -> Result<()> {
        self.write_from_async_inner(remote, offset, local, local_offset, len, Some(imm), true)?
            .wait()
    }

    /// Starts [`Node::write_with_notify_from`] (see
    /// [`Node::write_from_async`]).
    pub fn write_with_notify_from_async(
        &self,
        remote: &RemoteRegion,
        offset: u64,
        local: &Region,
        local_offset: usize,
        len: usize,
        imm: u32,
    ) -> Result<WriteHandle> {
        self.write_from_async_inner(remote, offset, local, local_offset, len, Some(imm), false)
    }

    #[allow(clippy::too_many_arguments)]
    fn write_from_async_inner(
        &self,
        remote: &RemoteRegion,
        offset: u64,
        local: &Region,
        local_offset: usize,
        len: usize,
        notify: Option<u32>,
        blocking: bool,
    ) -> Result<WriteHandle> {
        let core = self.own_region(local)?;
        let src = WriteSource::Region {
            region: &local.inner,
            offset: local_offset,
            len,
        };
        Ok(WriteHandle(
            core.region_write(remote, offset, src, notify, blocking)?,
        ))
    }

    /// Reads `len` bytes at `offset` of `remote` into this node's region
    /// `local` at `local_offset`; returns once they are there. On
    /// InfiniBand the device puts them there in place (`local` is
    /// registered for it on first use); elsewhere they are copied in when
    /// they arrive.
    pub fn read_into(
        &self,
        remote: &RemoteRegion,
        offset: u64,
        local: &Region,
        local_offset: usize,
        len: usize,
    ) -> Result<()> {
        let core = self.own_region(local)?;
        core.region_read(
            remote,
            offset,
            len,
            Some((&local.inner, local_offset)),
            true,
        )?
        .wait()
        .map(drop)
    }

    /// Starts [`Node::read_into`]. `local` may be dropped meanwhile (the
    /// access keeps its memory).
    pub fn read_into_async(
        &self,
        remote: &RemoteRegion,
        offset: u64,
        local: &Region,
        local_offset: usize,
        len: usize,
    ) -> Result<WriteHandle> {
        let core = self.own_region(local)?;
        Ok(WriteHandle(core.region_read(
            remote,
            offset,
            len,
            Some((&local.inner, local_offset)),
            false,
        )?))
    }

    /// This node's core, if `local` is one of its regions.
    fn own_region(&self, local: &Region) -> Result<&Arc<Core>> {
        let core = self.core();
        if local.core.as_ptr() != Arc::as_ptr(core) {
            return Err(Error::Region(RegionError::NotOwnRegion));
        }
        Ok(core)
    }

    /// Sets the receiver of writes with notification to this node's
    /// regions (once; a second call fails with
    /// [`Error::AlreadyRegistered`]). It runs on a handler thread after the
    /// write's data is in place; without one, notifications are dropped.
    pub fn on_region_write<F>(&self, f: F) -> Result<()>
    where
        F: Fn(RegionWrite) + Send + Sync + 'static,
    {
        self.core().on_region_write(Box::new(f))
    }
}
