//! Exposed memory regions and one-sided operations on them.
//!
//! The owner side keeps the table of exposed regions and applies the
//! write and read requests that arrive as messages of type 0 (see
//! [`crate::proto::region`]) on the handler thread of their connection,
//! without running application code: so a write is applied in the
//! connection's order, before any message the writing thread sends after
//! it. The caller side splits an access into parts of at most
//! [`PART_MAX`] bytes, sends them all as requests before waiting for the
//! first answer (a large access streams), and turns the answers into
//! typed errors.
//!
//! On an engine with remote memory access (InfiniBand) a region is also
//! registered with the device when exposed, its descriptor carries the
//! address and remote key, and the caller's engine posts the parts as RDMA
//! WRITE/READ work requests ([`crate::transport::RemoteMemory`]) whose
//! completions complete the same kind of requests; a write with
//! notification is followed by a notification message.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Instant;

use parking_lot::{Mutex, RwLock};
use rustc_hash::FxHashMap;

use super::connection::Connection;
use super::requests::PendingResponse;
use super::zero_copy::{RegisterError, ZeroCopyCosts};
use super::{inline, Core, HandlerEntry, HandlerKind, REMOTE_DECODE};
use crate::buffer::Finish;
use crate::error::{Unreachable, Waited};
use crate::message::{type_key, MessageKind};
use crate::primitives::buffer_mem::{BufferMem, InFlight};
use crate::primitives::in_order::Outcome as InOrder;
use crate::primitives::region_mem::{MemBlock, MemError};
use crate::proto::region::{
    self as wire, in_bounds, Notify, NotifyFrame, ReadRequest, RegionRef, Status, WriteHead,
    NOTIFY_LEN, READ_LEN, WRITE_HEAD_LEN,
};
use crate::region::{Access, RdmaKey, RegionWrite, RemoteRegion};
use crate::transport::{
    Hold, LocalBytes, PartDest, PartSource, RdmaPart, ReadBuf, ReadBytes, RemoteMemory,
};
use crate::{Error, NodeId, RegionError, Result};

/// Largest part of a one-sided access sent as one request
/// ([`wire::PART_MAX`]): parts of a large access overlap on the wire and at
/// the owner, and one part never holds the owner's handler thread (or a
/// region's lock) for long.
pub const PART_MAX: usize = wire::PART_MAX;

/// A registration with the device (dropping it deregisters).
type Registration = Box<dyn std::any::Any + Send + Sync>;

/// An exposed region at its owner.
pub struct ExposedRegion {
    id: u32,
    key: u64,
    access: Access,
    /// Address and remote key, when registered with the device.
    rdma: Option<RdmaKey>,
    /// The device registration; dropped at revocation (and, being declared
    /// before `mem`, always before the memory is freed).
    registration: parking_lot::Mutex<Option<Registration>>,
    /// The registration for the own node's accesses from or into the
    /// region in place (`Node::write_from`, `read_into`), local access
    /// only: made on first use, kept until the memory is freed (parts in
    /// flight keep the region alive, revocation does not end them).
    local_registration: OnceLock<Registration>,
    /// Closed when revoked: accesses that found the region before fail
    /// once they get its lock.
    mem: MemBlock,
}

impl std::fmt::Debug for ExposedRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExposedRegion")
            .field("id", &self.id)
            .field("access", &self.access)
            .field("rdma", &self.rdma)
            .field("mem", &self.mem)
            .finish()
    }
}

/// A region read or filled in place stays alive while a part uses it.
impl Hold for ExposedRegion {}

/// A buffer read or filled in place: its owner may write it again once
/// the device is done.
impl Hold for InFlight {
    fn device_done(&self) {
        InFlight::device_done(self);
    }
}

impl ExposedRegion {
    /// The region's id at its node.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// The region's random key.
    pub fn key(&self) -> u64 {
        self.key
    }

    /// What others may do.
    pub fn access(&self) -> Access {
        self.access
    }

    /// Address and remote key, when registered with the device.
    pub fn rdma(&self) -> Option<RdmaKey> {
        self.rdma
    }

    /// The region's memory.
    pub fn mem(&self) -> &MemBlock {
        &self.mem
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.mem.len() as u64
    }

    /// The registration for in-place accesses by the own node, made now if
    /// it is the first.
    fn local_registration(&self, rm: &dyn RemoteMemory) -> Result<&Registration> {
        if let Some(r) = self.local_registration.get() {
            return Ok(r);
        }
        // SAFETY: the registration lives in the region next to `mem` and
        // is dropped before it (field order); the block's bytes are only
        // ever reached through raw copies, which tolerates device accesses.
        let (_, reg) = unsafe { rm.register(self.mem.as_ptr(), self.mem.len(), false, false) }?;
        // A racing first user may have won: its registration is used.
        let _ = self.local_registration.set(reg);
        Ok(self.local_registration.get().expect("just set"))
    }

    /// Checks a range of the own node's access from or into the region.
    fn check_local(&self, offset: usize, len: usize) -> Result<()> {
        if in_bounds(offset as u64, len as u64, self.len()) {
            Ok(())
        } else {
            Err(Error::Region(RegionError::LocalOutOfBounds {
                offset: offset as u64,
                len: len as u64,
                region_len: self.len(),
            }))
        }
    }

    fn check(&self, offset: u64, len: u64, write: bool) -> Status {
        if write && !self.access.can_write() || !write && !self.access.can_read() {
            Status::NotPermitted
        } else if !in_bounds(offset, len, self.len()) {
            Status::OutOfBounds
        } else {
            Status::Ok
        }
    }

    /// Applies a write (owner side); the status says why not.
    fn apply_write(&self, offset: u64, data: &[u8]) -> Status {
        match self.check(offset, data.len() as u64, true) {
            Status::Ok => mem_status(self.mem.write(offset as usize, data)),
            other => other,
        }
    }

    /// Runs `f` on the bytes of a read (owner side); the status says why
    /// not.
    fn apply_read(&self, offset: u64, len: usize, f: impl FnOnce(&[u8])) -> Status {
        match self.check(offset, len as u64, false) {
            Status::Ok => mem_status(self.mem.with_bytes(offset as usize, len, f)),
            other => other,
        }
    }
}

fn mem_status(r: std::result::Result<(), MemError>) -> Status {
    match r {
        Ok(()) => Status::Ok,
        Err(MemError::OutOfRange) => Status::OutOfBounds,
        Err(MemError::Closed) => Status::Unknown,
    }
}

type WriteFn = Box<dyn Fn(RegionWrite) + Send + Sync>;

/// The regions a node exposes.
#[derive(Default)]
pub struct RegionTable {
    map: RwLock<FxHashMap<u32, Arc<ExposedRegion>>>,
    next_id: AtomicU32,
    on_write: OnceLock<WriteFn>,
}

impl std::fmt::Debug for RegionTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionTable")
            .field("regions", &self.map.read().len())
            .finish_non_exhaustive()
    }
}

impl RegionTable {
    fn find(&self, r: RegionRef) -> Option<Arc<ExposedRegion>> {
        self.map
            .read()
            .get(&r.id)
            .filter(|e| e.key == r.key)
            .cloned()
    }
}

impl Core {
    /// Installs the owner side of the one-sided operations (type 0).
    pub(super) fn install_region_handlers(&self) {
        let write: super::RequestFn =
            Box::new(|core, src, id, payload| core.serve_region_write(src, id, payload));
        let read: super::RequestFn =
            Box::new(|core, src, id, payload| core.serve_region_read(src, id, payload));
        for (sub, f) in [(wire::SUBTYPE_WRITE, write), (wire::SUBTYPE_READ, read)] {
            let entry = HandlerEntry {
                kind: HandlerKind::Request(f),
                mode: super::Mode::Ordered,
            };
            if self.handlers[type_key(wire::MSG_TYPE, sub) as usize]
                .set(entry)
                .is_err()
            {
                unreachable!("type 0 handlers are installed once, at start");
            }
        }
        let notify = HandlerEntry {
            kind: HandlerKind::Own(|core, src, payload| core.serve_region_notify(src, payload)),
            mode: super::Mode::Ordered,
        };
        if self.handlers[type_key(wire::MSG_TYPE, wire::SUBTYPE_NOTIFY) as usize]
            .set(notify)
            .is_err()
        {
            unreachable!("type 0 handlers are installed once, at start");
        }
    }

    /// A write notification that followed a write done by the device: the
    /// receiver runs if it names a live region and a range inside it.
    pub(super) fn serve_region_notify(&self, src: NodeId, payload: &[u8]) {
        let n = match NotifyFrame::decode(payload) {
            Ok(n) => n,
            Err(e) => {
                tracing::debug!("{}: malformed write notification from {src}: {e}", self.own);
                return;
            }
        };
        match self.regions.find(n.region) {
            Some(r) if in_bounds(n.start, n.len, r.len()) => self.notify_write(RegionWrite {
                from: src,
                region: n.region.id,
                offset: n.start,
                len: n.len,
                imm: n.imm,
            }),
            _ => tracing::debug!(
                "{}: write notification from {src} names no live region range",
                self.own
            ),
        }
    }

    /// Exposes a new zeroed region of `len` bytes.
    pub fn expose(&self, len: usize, access: Access) -> Result<Arc<ExposedRegion>> {
        if self.is_shut_down() {
            return Err(Error::Shutdown);
        }
        let mem = MemBlock::new(len).ok_or(Error::Region(RegionError::Allocation(len)))?;
        let rm = self.transport().and_then(|t| t.remote_memory());
        let (rdma, registration) = match rm {
            // Registered for local use below.
            Some(_) if access == Access::LocalOnly => (None, None),
            Some(rm) => {
                // SAFETY: the registration is kept next to `mem` in the
                // region and dropped before it (revocation, or field
                // order); the block's bytes are only ever reached through
                // raw copies, which tolerates device accesses.
                let (rkey, reg) = unsafe {
                    rm.register(mem.as_ptr(), len, access.can_read(), access.can_write())
                }?;
                let key = RdmaKey {
                    addr: mem.as_ptr() as u64,
                    rkey,
                };
                (Some(key), Some(reg))
            }
            None => (None, None),
        };
        let mut map = self.regions.map.write();
        let id = loop {
            let id = self.regions.next_id.fetch_add(1, Ordering::Relaxed);
            if !map.contains_key(&id) {
                break id;
            }
        };
        let region = Arc::new(ExposedRegion {
            id,
            key: rand::random(),
            access,
            rdma,
            registration: parking_lot::Mutex::new(registration),
            local_registration: OnceLock::new(),
            mem,
        });
        if let (Some(rm), Access::LocalOnly) = (rm, access) {
            // It exists to be the local side of in-place accesses: its
            // registration is made now, not in the first access.
            region.local_registration(rm)?;
        }
        map.insert(id, region.clone());
        Ok(region)
    }

    /// Revokes a region: later accesses fail with
    /// [`RegionError::Revoked`]; returns once no access to it runs.
    pub fn revoke(&self, region: &ExposedRegion) {
        self.regions.map.write().remove(&region.id);
        region.mem.close();
        // Deregistered: the device refuses later remote accesses.
        drop(region.registration.lock().take());
    }

    /// Sets the receiver of write notifications (once).
    pub fn on_region_write(&self, f: WriteFn) -> Result<()> {
        self.regions
            .on_write
            .set(f)
            .map_err(|_| Error::AlreadyRegistered(wire::MSG_TYPE, wire::SUBTYPE_WRITE))
    }

    fn notify_write(&self, w: RegionWrite) {
        match self.regions.on_write.get() {
            Some(f) => {
                if std::panic::catch_unwind(AssertUnwindSafe(|| f(w))).is_err() {
                    tracing::error!("{}: region write receiver panicked", self.own);
                }
            }
            None => tracing::debug!(
                "{}: write notification from {} dropped: no receiver registered",
                self.own,
                w.from
            ),
        }
    }

    /// Applies a write to an own region (owner side of both paths).
    fn write_own(&self, head: &WriteHead, data: &[u8]) -> Status {
        let Some(r) = self.regions.find(head.region) else {
            return Status::Unknown;
        };
        r.apply_write(head.offset, data)
    }

    fn serve_region_write(&self, src: NodeId, id: u32, payload: &[u8]) {
        let (head, data) = match WriteHead::decode(payload) {
            Ok(v) => v,
            Err(e) => return self.refuse_region_frame(src, id, wire::SUBTYPE_WRITE, e),
        };
        let status = self.write_own(&head, data);
        self.answer(src, id, wire::SUBTYPE_WRITE, status, &[]);
        if let (Status::Ok, Some(n)) = (status, head.notify) {
            self.notify_write(RegionWrite {
                from: src,
                region: head.region.id,
                offset: n.start,
                // start <= offset (checked by the decoder) and the part is
                // inside the region (just applied): no overflow.
                len: head.offset - n.start + data.len() as u64,
                imm: n.imm,
            });
        }
    }

    fn serve_region_read(&self, src: NodeId, id: u32, payload: &[u8]) {
        let req = match ReadRequest::decode(payload) {
            Ok(v) => v,
            Err(e) => return self.refuse_region_frame(src, id, wire::SUBTYPE_READ, e),
        };
        let status = match self.regions.find(req.region) {
            Some(r) => r.apply_read(req.offset, req.len as usize, |bytes| {
                self.answer(src, id, wire::SUBTYPE_READ, Status::Ok, bytes)
            }),
            None => Status::Unknown,
        };
        if status != Status::Ok {
            self.answer(src, id, wire::SUBTYPE_READ, status, &[]);
        }
    }

    fn refuse_region_frame(&self, src: NodeId, id: u32, sub: u8, e: wire::FrameError) {
        tracing::debug!("{}: malformed one-sided request from {src}: {e}", self.own);
        self.send_error_response(src, id, REMOTE_DECODE, wire::MSG_TYPE, sub);
    }

    fn answer(&self, dest: NodeId, id: u32, sub: u8, status: Status, data: &[u8]) {
        let res = self.send_frame(
            dest,
            wire::MSG_TYPE,
            sub,
            MessageKind::Response,
            id,
            1 + data.len(),
            None,
            Some(Instant::now()),
            |w| {
                w.write_all(&[status as u8])?;
                w.write_all(data)
            },
        );
        if let Err(e) = res {
            tracing::debug!("{}: one-sided answer to {dest} not sent: {e}", self.own);
        }
    }

    // ----- caller side ---------------------------------------------------

    /// Starts a write of `src` at `offset` of `remote` (with a
    /// notification carrying `notify`, if given, once all of it is in
    /// place). Every part is sent before this returns. `blocking`: the
    /// caller waits for it at once.
    pub fn region_write(
        self: &Arc<Self>,
        remote: &RemoteRegion,
        offset: u64,
        src: WriteSource<'_>,
        notify: Option<u32>,
        blocking: bool,
    ) -> Result<RegionOp> {
        let len = src.len();
        remote.check(offset, len as u64, true)?;
        // A buffer goes in place if the zero-copy policy says so, and is
        // copied as bytes otherwise.
        let device = self.device_path(remote);
        let (src, guard) = match src {
            WriteSource::Buffer(mem) => {
                match self.zero_copy.use_buffer(device.map(|(rm, _)| rm), mem) {
                    Some(g) => (src, Some(Arc::new(g))),
                    // SAFETY: the caller borrows the buffer's handle for
                    // this call, so no device writes its memory.
                    None => (WriteSource::Bytes(unsafe { mem.bytes() }), None),
                }
            }
            other => (other, None),
        };
        if let WriteSource::Region {
            region,
            offset,
            len,
        } = src
        {
            region.check_local(offset, len)?;
        }
        let target = RegionRef {
            id: remote.id(),
            key: remote.key(),
        };
        if remote.node() == self.own {
            let head = WriteHead {
                region: target,
                offset,
                notify: notify.map(|imm| Notify { imm, start: offset }),
            };
            let status = match src {
                WriteSource::Bytes(data) => self.write_own(&head, data),
                WriteSource::Buffer(_) => unreachable!("made bytes above"),
                WriteSource::Region {
                    region,
                    offset,
                    len,
                } => {
                    // Source and target may be the same region.
                    let mut data = vec![0u8; len];
                    match region.mem().read(offset, &mut data) {
                        Ok(()) => self.write_own(&head, &data),
                        Err(_) => return Err(Error::Region(RegionError::Revoked)),
                    }
                }
            };
            let res = status_result(status, true, remote, offset, len);
            if let (Ok(()), Some(imm)) = (&res, notify) {
                self.notify_write(RegionWrite {
                    from: self.own,
                    region: target.id,
                    offset,
                    len: len as u64,
                    imm,
                });
            }
            return Ok(RegionOp::done(self, remote, offset, res));
        }
        if let Some((rm, key)) = device {
            let op =
                self.post_parts(rm, remote, key, offset, Parts::Write(src), blocking, guard)?;
            if let Some(imm) = notify {
                // Behind the write's work requests on the same queue pair:
                // the owner sees it after the data.
                let frame = NotifyFrame {
                    region: target,
                    start: offset,
                    len: len as u64,
                    imm,
                }
                .encode();
                self.send_frame(
                    remote.node(),
                    wire::MSG_TYPE,
                    wire::SUBTYPE_NOTIFY,
                    MessageKind::Plain,
                    0,
                    NOTIFY_LEN,
                    None,
                    None,
                    |w| w.write_all(&frame),
                )?;
            }
            return Ok(op);
        }
        let timeout = self.config.request_timeout();
        let mut parts = Vec::with_capacity(len.div_ceil(PART_MAX).max(1));
        let mut at = 0usize;
        while at < len || parts.is_empty() {
            let n = (len - at).min(PART_MAX);
            let head = WriteHead {
                region: target,
                offset: offset + at as u64,
                // One notification, with the last part: the parts are
                // applied in order, so all data is in place by then.
                notify: notify
                    .filter(|_| at + n >= len)
                    .map(|imm| Notify { imm, start: offset }),
            }
            .encode();
            let pending = self.send_request_frame(
                remote.node(),
                wire::MSG_TYPE,
                wire::SUBTYPE_WRITE,
                WRITE_HEAD_LEN + n,
                timeout,
                |w| {
                    w.write_all(&head)?;
                    match src {
                        WriteSource::Bytes(data) => w.write_all(&data[at..at + n]),
                        WriteSource::Buffer(_) => unreachable!("made bytes above"),
                        WriteSource::Region { region, offset, .. } => region
                            .mem()
                            .with_bytes(offset + at, n, |b| w.write_all(b))
                            .map_err(|_| std::io::Error::other("the source region is revoked"))?,
                    }
                },
            )?;
            parts.push(Part {
                wait: PartWait::Request(Some(pending)),
                at,
                len: n,
            });
            at += n;
        }
        Ok(RegionOp::in_flight(self, remote, offset, parts, None))
    }

    /// Starts a read of `len` bytes at `offset` of `remote`, into a new
    /// buffer or, with `into`, into the own region `into.0` at `into.1`
    /// (`blocking`: the caller waits for it at once).
    pub fn region_read(
        self: &Arc<Self>,
        remote: &RemoteRegion,
        offset: u64,
        len: usize,
        into: Option<(&Arc<ExposedRegion>, usize)>,
        blocking: bool,
    ) -> Result<RegionOp> {
        remote.check(offset, len as u64, false)?;
        if let Some((region, at)) = into {
            region.check_local(at, len)?;
        }
        let target = RegionRef {
            id: remote.id(),
            key: remote.key(),
        };
        if remote.node() == self.own {
            let mut out = vec![0u8; len];
            let status = match self.regions.find(target) {
                Some(r) => r.apply_read(offset, len, |b| out.copy_from_slice(b)),
                None => Status::Unknown,
            };
            let res = status_result(status, false, remote, offset, len);
            let mut op = RegionOp::done(self, remote, offset, res);
            op.read_len = Some(len);
            op.read = out;
            op.into = into.map(|(r, at)| (r.clone(), at));
            return Ok(op);
        }
        if let Some((rm, key)) = self.device_path(remote) {
            return self.post_parts(
                rm,
                remote,
                key,
                offset,
                Parts::Read(len, into),
                blocking,
                None,
            );
        }
        let timeout = self.config.request_timeout();
        let mut parts = Vec::with_capacity(len.div_ceil(PART_MAX).max(1));
        let mut at = 0usize;
        while at < len || parts.is_empty() {
            let n = (len - at).min(PART_MAX);
            let req = ReadRequest {
                region: target,
                offset: offset + at as u64,
                len: n as u32,
            }
            .encode();
            let pending = self.send_request_frame(
                remote.node(),
                wire::MSG_TYPE,
                wire::SUBTYPE_READ,
                READ_LEN,
                timeout,
                |w| w.write_all(&req),
            )?;
            parts.push(Part {
                wait: PartWait::Request(Some(pending)),
                at,
                len: n,
            });
            at += n;
        }
        let mut op = RegionOp::in_flight(self, remote, offset, parts, Some(len));
        op.into = into.map(|(r, at)| (r.clone(), at));
        Ok(op)
    }
}

impl Core {
    /// Whether region writes to other nodes leave from the local bytes in
    /// place: an engine with remote memory, whose device reads them.
    pub fn writes_in_place(&self) -> bool {
        self.transport()
            .is_some_and(|t| t.remote_memory().is_some())
    }

    /// Registers an application's buffer now (`Node::register_buffer`):
    /// false on an engine without registered memory.
    pub fn register_buffer(&self, mem: &Arc<BufferMem>) -> Result<bool> {
        let Some(rm) = self.transport().and_then(|t| t.remote_memory()) else {
            return Ok(false);
        };
        self.zero_copy.register_now(rm, mem).map_err(|e| {
            let reason = match e {
                RegisterError::OverLimit => "over zero_copy.max_pinned_bytes".to_string(),
                RegisterError::OtherNode => "registered with another node's device".to_string(),
                RegisterError::Device(why) => why,
            };
            Error::Region(RegionError::Registration {
                len: mem.len() as u64,
                reason,
            })
        })?;
        Ok(true)
    }

    /// The costs the zero-copy policy measured, once it did.
    pub fn zero_copy_costs(&self) -> Option<ZeroCopyCosts> {
        self.zero_copy.costs()
    }

    /// Starts a read of `mem.len()` bytes at `offset` of `remote` into an
    /// application's buffer: in place where the zero-copy policy
    /// registered it, into a new buffer to copy from otherwise (the
    /// `Finish` says which). The caller owns the buffer's handle
    /// exclusively until the access is done.
    pub fn region_read_buffer(
        self: &Arc<Self>,
        remote: &RemoteRegion,
        offset: u64,
        mem: &Arc<BufferMem>,
        blocking: bool,
    ) -> Result<(RegionOp, Finish)> {
        let len = mem.len();
        remote.check(offset, len as u64, false)?;
        let device = self.device_path(remote);
        if let Some(g) = self.zero_copy.use_buffer(device.map(|(rm, _)| rm), mem) {
            let (rm, key) = device.expect("in place only through the device");
            let what = Parts::Read(len, None);
            let op = self.post_parts(rm, remote, key, offset, what, blocking, Some(Arc::new(g)))?;
            return Ok((op, Finish::ReadInPlace));
        }
        let op = self.region_read(remote, offset, len, None, blocking)?;
        Ok((op, Finish::ReadCopy))
    }
}

/// The bytes a one-sided write carries.
#[derive(Debug, Clone, Copy)]
pub enum WriteSource<'a> {
    /// The caller's bytes (copied before the call returns).
    Bytes(&'a [u8]),
    /// The bytes of an application's buffer: in place where the zero-copy
    /// policy registered it (see `core::zero_copy`), copied otherwise.
    Buffer(&'a Arc<BufferMem>),
    /// `len` bytes at `offset` of one of the own node's regions: on an
    /// engine with remote memory access the device reads them in place.
    Region {
        /// The region.
        region: &'a Arc<ExposedRegion>,
        /// Where the bytes start in it.
        offset: usize,
        /// How many.
        len: usize,
    },
}

impl WriteSource<'_> {
    fn len(&self) -> usize {
        match *self {
            WriteSource::Bytes(d) => d.len(),
            WriteSource::Buffer(m) => m.len(),
            WriteSource::Region { len, .. } => len,
        }
    }
}

/// What an access posted as device work requests moves.
#[derive(Clone, Copy)]
enum Parts<'a> {
    Write(WriteSource<'a>),
    /// A read of this many bytes, into a new buffer or in place into an
    /// own region at an offset.
    Read(usize, Option<(&'a Arc<ExposedRegion>, usize)>),
}

impl Core {
    /// The engine's device path, if the access can take it: another
    /// node's region, the engine does remote memory access and the
    /// descriptor has a remote key.
    fn device_path(&self, remote: &RemoteRegion) -> Option<(&dyn RemoteMemory, RdmaKey)> {
        if remote.node() == self.own {
            return None;
        }
        let key = remote.rdma()?;
        Some((self.transport()?.remote_memory()?, key))
    }

    /// Posts an access as device work requests of at most `part_max` bytes
    /// each. With `blocking` the last part asks for its completion;
    /// otherwise the waiter has it covered ([`RemoteMemory::cover`]) when
    /// it waits.
    #[allow(clippy::too_many_arguments)]
    fn post_parts(
        self: &Arc<Self>,
        rm: &dyn RemoteMemory,
        remote: &RemoteRegion,
        key: RdmaKey,
        offset: u64,
        what: Parts<'_>,
        blocking: bool,
        buffer: Option<Arc<InFlight>>,
    ) -> Result<RegionOp> {
        let deadline = Instant::now() + self.config.request_timeout();
        let conn = self.connection(remote.node(), deadline)?;
        let step = rm.part_max();
        let (len, read_len) = match what {
            Parts::Write(src) => (src.len(), None),
            // In place: nothing to hand back.
            Parts::Read(n, into) => (n, (into.is_none() && buffer.is_none()).then_some(n)),
        };
        // An own region or registered buffer read or filled in place: its
        // registration, and a handle that keeps it alive while the device
        // uses it.
        type Keep = Arc<dyn Hold>;
        let local: Option<(&(dyn std::any::Any + Send + Sync), usize, Keep)> = match (what, &buffer)
        {
            (Parts::Write(WriteSource::Region { region, offset, .. }), _)
            | (Parts::Read(_, Some((region, offset))), _) => {
                let keep: Keep = region.clone();
                Some((&**region.local_registration(rm)?, offset, keep))
            }
            (_, Some(g)) => {
                let keep: Keep = g.clone();
                Some((&*g.registration().handle, 0, keep))
            }
            _ => None,
        };
        let parts = Vec::with_capacity(len.div_ceil(step).max(1));
        // Built first: if a post fails, dropping it frees what the parts
        // posted so far hold.
        let mut op = RegionOp::in_flight(self, remote, offset, parts, read_len);
        let read_buf: Option<ReadBuf> = match what {
            Parts::Read(n, None) if local.is_none() => {
                Some(Arc::new(Mutex::new(ReadBytes::new(n))))
            }
            _ => None,
        };
        op.device = Some(DeviceOp {
            conn: conn.clone(),
            deadline,
            uncovered: None,
            read_buf: read_buf.clone(),
        });
        let mut at = 0usize;
        while at < len || op.parts.is_empty() {
            let n = (len - at).min(step);
            let last = at + n >= len;
            // A forged descriptor may name any address: wrapping, the
            // device refuses what is not registered.
            let addr = key.addr.wrapping_add(offset).wrapping_add(at as u64);
            // A buffer's guard per part: each part gives the memory back
            // to the buffer's owner as it completes.
            let part_keep: Option<Arc<dyn Hold>> = buffer.as_ref().map(|g| {
                let k: Arc<dyn Hold> = Arc::new(g.another());
                k
            });
            let in_place = local.as_ref().map(|(reg, base, keep)| LocalBytes {
                registration: *reg,
                offset: base + at,
                len: n,
                keep: part_keep.as_ref().unwrap_or(keep),
            });
            let part = match (what, in_place) {
                (Parts::Write(_), Some(l)) => RdmaPart::Write {
                    src: PartSource::Local(l),
                    addr,
                    rkey: key.rkey,
                },
                (Parts::Write(WriteSource::Bytes(d)), None) => RdmaPart::Write {
                    src: PartSource::Bytes(&d[at..at + n]),
                    addr,
                    rkey: key.rkey,
                },
                (Parts::Read(..), Some(l)) => RdmaPart::Read {
                    len: n,
                    addr,
                    rkey: key.rkey,
                    into: PartDest::Local(l),
                },
                (Parts::Read(..), None) => RdmaPart::Read {
                    len: n,
                    addr,
                    rkey: key.rkey,
                    into: PartDest::Buf {
                        buf: read_buf.as_ref().expect("a read has its buffer"),
                        at,
                    },
                },
                (Parts::Write(WriteSource::Region { .. } | WriteSource::Buffer(_)), None) => {
                    unreachable!("a region or buffer source posted here is registered")
                }
            };
            let seq = rm.post(self, &conn, part, deadline, blocking && last)?;
            if !blocking {
                if let Some(d) = op.device.as_mut() {
                    d.uncovered = Some(seq);
                }
            }
            op.parts.push(Part {
                wait: PartWait::Device(seq),
                at,
                len: n,
            });
            at += n;
        }
        Ok(op)
    }
}

fn status_result(
    s: Status,
    write: bool,
    remote: &RemoteRegion,
    offset: u64,
    len: usize,
) -> Result<()> {
    match s {
        Status::Ok => Ok(()),
        Status::Unknown => Err(Error::Region(RegionError::Revoked)),
        Status::OutOfBounds => Err(Error::Region(RegionError::OutOfBounds {
            offset,
            len: len as u64,
            region_len: remote.len(),
        })),
        // Only a descriptor that claims more rights than the region has.
        Status::NotPermitted => Err(Error::Region(if write {
            RegionError::WriteNotPermitted
        } else {
            RegionError::ReadNotPermitted
        })),
    }
}

/// A read's bytes, or, for a read into an own region (`into`), nothing
/// once they are there (or the region is gone).
fn deliver(into: Option<(Arc<ExposedRegion>, usize)>, bytes: Vec<u8>) -> Result<Vec<u8>> {
    match into {
        None => Ok(bytes),
        Some((region, at)) => {
            // Revoked meanwhile (its handle dropped): the bytes go with it,
            // as the device's would.
            let _ = region.mem().write(at, &bytes);
            Ok(Vec::new())
        }
    }
}

impl Drop for RegionOp {
    fn drop(&mut self) {
        // Parts not waited for: their outcome must still be reported (a
        // part left unreported would look stale to the engine's watchdog).
        if self.device.as_ref().is_some_and(|d| d.uncovered.is_some()) {
            if let Some(rm) = self
                .core
                .clone()
                .transport()
                .and_then(|t| t.remote_memory())
            {
                self.cover(rm);
            }
        }
    }
}

/// Waits for device part `seq` of `dev` until it has an outcome or the
/// deadline passes (then `Pending`). `spin_until` is the end of the
/// access's spin (set at its first wait): retiring completions itself until
/// then, parked on the track after.
fn wait_part(
    core: &Arc<Core>,
    rm: &dyn RemoteMemory,
    dev: &DeviceOp,
    seq: u64,
    spin_until: &mut Option<Instant>,
) -> InOrder {
    let track = &dev.conn.parts;
    let mut outcome = track.outcome(seq);
    // Its completion may be waiting in the queue already (nobody retired
    // it): one look before anything that counts as blocking.
    if outcome == InOrder::Pending && rm.progress(core) {
        outcome = track.outcome(seq);
    }
    if outcome != InOrder::Pending {
        return outcome;
    }
    let until = *spin_until.get_or_insert_with(|| {
        inline::before_blocking();
        Instant::now() + std::time::Duration::from_micros(core.config.park.request_spin_max_us)
    });
    let mut n = 0u32;
    // `until` was just set, or this access spun before and ran out.
    let mut spinning = core.config.park.request_spin_max_us > 0;
    while outcome == InOrder::Pending && spinning {
        if !rm.progress(core) {
            std::hint::spin_loop();
        }
        outcome = track.outcome(seq);
        n = n.wrapping_add(1);
        if n.is_multiple_of(64) && outcome == InOrder::Pending {
            if Instant::now() >= until {
                spinning = false;
            } else {
                std::thread::yield_now();
            }
        }
    }
    while outcome == InOrder::Pending && Instant::now() < dev.deadline {
        // The engine retires completions for a while per call.
        rm.waiting();
        let slice = Instant::now() + std::time::Duration::from_millis(5);
        outcome = track.wait(seq, slice.min(dev.deadline));
    }
    outcome
}

impl Core {
    /// Waits for the outcome of part `seq` on `conn` (posted signalled)
    /// until `deadline`: spinning on completions first, then parked.
    pub(super) fn wait_device_part(
        self: &Arc<Self>,
        rm: &dyn RemoteMemory,
        conn: &Arc<Connection>,
        seq: u64,
        deadline: Instant,
    ) -> InOrder {
        let dev = DeviceOp {
            conn: conn.clone(),
            deadline,
            uncovered: None,
            read_buf: None,
        };
        wait_part(self, rm, &dev, seq, &mut None)
    }
}

/// How a part's outcome comes.
#[derive(Debug)]
enum PartWait {
    /// An answer to a request (the emulation); taken once answered.
    Request(Option<PendingResponse>),
    /// A device part: its number in its connection's track.
    Device(u64),
}

/// One part of a one-sided access.
#[derive(Debug)]
struct Part {
    wait: PartWait,
    /// Where the part starts, relative to the access's start.
    at: usize,
    len: usize,
}

/// The device side of an access posted as work requests.
#[derive(Debug)]
struct DeviceOp {
    /// The connection whose track reports the parts' outcomes.
    conn: Arc<Connection>,
    /// When waiting for them gives up.
    deadline: Instant,
    /// The last part's number, until its report has been asked for
    /// (`RemoteMemory::cover`): posted unsignalled, by a caller that does
    /// not wait at once.
    uncovered: Option<u64>,
    /// A read's bytes, filled by the engine as parts complete.
    read_buf: Option<ReadBuf>,
}

/// A one-sided access in flight: its parts' outcomes, checked in order.
#[derive(Debug)]
pub struct RegionOp {
    core: Arc<Core>,
    remote: RemoteRegion,
    /// The access's offset in the region.
    base: u64,
    parts: Vec<Part>,
    /// Parts checked so far.
    next: usize,
    /// The outcome once known (set at once for accesses to the own node).
    done: Option<Result<()>>,
    /// A read's length (`None`: a write).
    read_len: Option<usize>,
    /// A read's bytes: those of a read of the own node, or those collected
    /// by [`RegionOp::poll_wait`].
    read: Vec<u8>,
    /// The parts are device work requests.
    device: Option<DeviceOp>,
    /// A read into an own region that the engine does not fill in place:
    /// the bytes go there once all are here.
    into: Option<(Arc<ExposedRegion>, usize)>,
}

impl RegionOp {
    fn in_flight(
        core: &Arc<Core>,
        remote: &RemoteRegion,
        base: u64,
        parts: Vec<Part>,
        read_len: Option<usize>,
    ) -> RegionOp {
        RegionOp {
            core: core.clone(),
            remote: *remote,
            base,
            parts,
            next: 0,
            done: None,
            read_len,
            read: Vec::new(),
            device: None,
            into: None,
        }
    }

    /// An access that failed to start (its handle reports `e`).
    pub(crate) fn failed(core: &Arc<Core>, remote: &RemoteRegion, base: u64, e: Error) -> RegionOp {
        Self::done(core, remote, base, Err(e))
    }

    fn done(core: &Arc<Core>, remote: &RemoteRegion, base: u64, res: Result<()>) -> RegionOp {
        RegionOp {
            core: core.clone(),
            remote: *remote,
            base,
            parts: Vec::new(),
            next: 0,
            done: Some(res),
            read_len: None,
            read: Vec::new(),
            device: None,
            into: None,
        }
    }

    /// Checks the next part's answer; copies a read part's bytes into
    /// `dest` (the whole read's buffer).
    fn settle(&mut self, outcome: super::requests::Outcome, dest: &mut [u8]) -> Result<()> {
        let part = &self.parts[self.next];
        self.next += 1;
        let answer = outcome?;
        let (status, data) = Status::decode(&answer).map_err(|e| {
            Error::Decode(format!(
                "malformed one-sided answer from {}: {e}",
                self.remote.node()
            ))
        })?;
        if status != Status::Ok {
            return status_result(
                status,
                self.read_len.is_none(),
                &self.remote,
                self.base + part.at as u64,
                part.len,
            );
        }
        let expect = if self.read_len.is_some() { part.len } else { 0 };
        if data.len() != expect {
            return Err(Error::Decode(format!(
                "one-sided answer from {} has {} bytes, {expect} expected",
                self.remote.node(),
                data.len(),
            )));
        }
        if expect > 0 {
            dest[part.at..part.at + part.len].copy_from_slice(data);
        }
        crate::core::requests::recycle_payload(answer);
        Ok(())
    }

    /// Settles the next device part, whose outcome is `outcome`.
    fn settle_device(&mut self, outcome: InOrder) -> Result<()> {
        let dev = self.device.as_ref().expect("device parts have a device op");
        self.next += 1;
        match outcome {
            InOrder::Done => Ok(()),
            InOrder::Pending => Err(Error::Timeout(Waited::Response)),
            // The peer's device refused the key or range: a revoked region
            // or a forged descriptor.
            InOrder::Refused => Err(Error::Region(RegionError::Revoked)),
            InOrder::Lost => Err(Error::Unreachable(
                dev.conn.peer,
                Unreachable::ConnectionLost(dev.conn.close_reason()),
            )),
        }
    }

    /// A device read's bytes once every part is done (empty for a write).
    fn device_bytes(&self) -> Result<Vec<u8>> {
        let Some(buf) = self.device.as_ref().and_then(|d| d.read_buf.as_ref()) else {
            return Ok(Vec::new());
        };
        buf.lock().take().ok_or_else(|| {
            Error::Transport(format!(
                "one-sided read from {}: parts reported done without their bytes",
                self.remote.node()
            ))
        })
    }

    /// Blocks until every part is answered (a write: applied at the
    /// owner); a read's bytes go to `dest` (its length). The first failure
    /// ends the wait; parts sent after the failing one may have been
    /// applied or not.
    pub fn wait_into(mut self, dest: &mut [u8]) -> Result<()> {
        debug_assert!(self.into.is_none(), "reads into a region end in wait()");
        if let Some(res) = self.done.take() {
            if res.is_ok() && self.read_len.is_some() {
                dest.copy_from_slice(&self.read);
            }
            return res;
        }
        if self.device.is_some() {
            self.wait_device()?;
            if self.read_len.is_some() {
                dest.copy_from_slice(&self.device_bytes()?);
            }
            return Ok(());
        }
        while self.next < self.parts.len() {
            let PartWait::Request(pending) = &mut self.parts[self.next].wait else {
                unreachable!("emulated accesses have request parts")
            };
            let pending = pending.take().expect("unanswered parts keep their request");
            let outcome = self.core.wait_response(pending);
            self.settle(outcome, dest)?;
        }
        Ok(())
    }

    /// [`RegionOp::wait_into`] of device parts: the caller retires
    /// completions itself for up to `park.request_spin_max_us` (the parts
    /// are its own; a wake-up costs more than most of them take), then asks
    /// the engine to ([`RemoteMemory::waiting`]) and parks on the track
    /// until the deadline.
    fn wait_device(&mut self) -> Result<()> {
        let core = self.core.clone();
        let Some(rm) = core.transport().and_then(|t| t.remote_memory()) else {
            return Err(Error::Shutdown);
        };
        self.cover(rm);
        let mut spin_until = None;
        while self.next < self.parts.len() {
            let PartWait::Device(seq) = self.parts[self.next].wait else {
                unreachable!("device accesses have device parts")
            };
            let dev = self.device.as_ref().expect("device op");
            let outcome = wait_part(&core, rm, dev, seq, &mut spin_until);
            self.settle_device(outcome)?;
        }
        Ok(())
    }

    /// Asks the engine to report the device parts posted unsignalled (once,
    /// before the first wait).
    fn cover(&mut self, rm: &dyn RemoteMemory) {
        if let Some(dev) = self.device.as_mut() {
            if let Some(seq) = dev.uncovered.take() {
                if !dev.conn.parts.reports(seq) {
                    rm.cover(&self.core, &dev.conn, seq, dev.deadline);
                }
            }
        }
    }

    /// [`RegionOp::wait_into`] into a new buffer (empty for a write, and
    /// for a read into an own region, which has its bytes then).
    pub fn wait(mut self) -> Result<Vec<u8>> {
        let into = self.into.take();
        let bytes = if self.device.is_some() && self.done.is_none() {
            // A read's buffer is handed over as it is.
            self.wait_device()?;
            self.device_bytes()?
        } else {
            let mut buf = vec![0u8; self.read_len.unwrap_or(0)];
            self.wait_into(&mut buf)?;
            buf
        };
        deliver(into, bytes)
    }

    /// `Future` support: [`RegionOp::wait`] without blocking.
    pub fn poll_wait(&mut self, cx: &mut Context<'_>) -> Poll<Result<Vec<u8>>> {
        match self.poll_bytes(cx) {
            Poll::Ready(Ok(bytes)) => Poll::Ready(deliver(self.into.take(), bytes)),
            other => other,
        }
    }

    /// [`RegionOp::poll_wait`] up to the read's bytes.
    fn poll_bytes(&mut self, cx: &mut Context<'_>) -> Poll<Result<Vec<u8>>> {
        if let Some(res) = self.done.take() {
            return Poll::Ready(res.map(|()| std::mem::take(&mut self.read)));
        }
        if self.device.is_none() && self.read.len() != self.read_len.unwrap_or(0) {
            self.read = vec![0u8; self.read_len.unwrap_or(0)];
        }
        let core = self.core.clone();
        let rm = core.transport().and_then(|t| t.remote_memory());
        if let (Some(rm), Some(_)) = (rm, &self.device) {
            self.cover(rm);
            rm.progress(&core);
        }
        while self.next < self.parts.len() {
            let res = match &mut self.parts[self.next].wait {
                PartWait::Request(pending) => {
                    let p = pending
                        .as_mut()
                        .expect("unanswered parts keep their request");
                    match p.poll_take(cx) {
                        Poll::Ready(outcome) => {
                            self.parts[self.next].wait = PartWait::Request(None);
                            let mut dest = std::mem::take(&mut self.read);
                            let res = self.settle(outcome, &mut dest);
                            self.read = dest;
                            res
                        }
                        Poll::Pending => return Poll::Pending,
                    }
                }
                PartWait::Device(seq) => {
                    let seq = *seq;
                    let (Some(rm), Some(dev)) = (rm, &self.device) else {
                        return Poll::Ready(Err(Error::Shutdown));
                    };
                    let outcome = dev.conn.parts.register(seq, cx.waker());
                    if outcome == InOrder::Pending && Instant::now() < dev.deadline {
                        // Completions are retired by the engine now.
                        rm.waiting();
                        return Poll::Pending;
                    }
                    // Still pending here: settled as a timeout.
                    self.settle_device(outcome)
                }
            };
            if let Err(e) = res {
                return Poll::Ready(Err(e));
            }
        }
        if self.device.is_some() {
            return Poll::Ready(self.device_bytes());
        }
        Poll::Ready(Ok(std::mem::take(&mut self.read)))
    }
}
