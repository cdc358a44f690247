//! One-sided operations carried as messages: the wire format of a write to
//! or a read from a remote node's exposed memory region, and of the
//! owner's answer.
//!
//! Engines without remote memory access (TCP, loopback) emulate one-sided
//! operations with these frames: the writer or reader sends a request of
//! message type 0 (reserved for dxnet) with subtype [`SUBTYPE_WRITE`] or
//! [`SUBTYPE_READ`]; the owner's runtime applies it to the region without
//! running application code and answers with a status byte (and, for a
//! read, the bytes read).
//!
//! ```text
//! write request:  region u32 | key u64 | offset u64 | flags u8 | imm u32 | start u64 | data ...
//! read request:   region u32 | key u64 | offset u64 | len u32
//! answer:         status u8 [| data ... (read, status ok)]
//! notification:   region u32 | key u64 | start u64 | len u64 | imm u32
//! ```
//! A write done by an RDMA device (InfiniBand) has no request at the
//! owner; a write with notification is followed by a notification message
//! on the same connection, which the owner sees after the write's data.
//! All integers little-endian. A write of several parts is several
//! requests; `start` is the offset of the whole write's first byte (the
//! notification reports the whole write, sent with its last part). `key` is the region's random 64-bit key
//! from its descriptor: a descriptor of a revoked region, of another
//! instance of the node or a guessed one names no region.

/// Message type of the emulated operations (0: dxnet's own).
pub const MSG_TYPE: u8 = 0;
/// Subtype of a write request.
pub const SUBTYPE_WRITE: u8 = 1;
/// Subtype of a read request.
pub const SUBTYPE_READ: u8 = 2;
/// Subtype of a write notification (a plain message sent after a write
/// done by the device, see [`NotifyFrame`]).
pub const SUBTYPE_NOTIFY: u8 = 3;

/// Largest part of an access one request carries: larger accesses are
/// sent as several requests, and a read request asking for more is
/// malformed (its answer must fit in one message).
pub const PART_MAX: usize = 256 << 10;

/// Bytes of a write request before its data.
pub const WRITE_HEAD_LEN: usize = 4 + 8 + 8 + 1 + 4 + 8;
/// Bytes of a read request.
pub const READ_LEN: usize = 4 + 8 + 8 + 4;

/// `flags` bit: the owner reports the write to its application once the
/// data is in place (a write with notification).
pub const FLAG_NOTIFY: u8 = 1;

/// Bytes of a write notification.
pub const NOTIFY_LEN: usize = 4 + 8 + 8 + 8 + 4;

/// A write notification sent after a write done by the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotifyFrame {
    /// The region written.
    pub region: RegionRef,
    /// Offset of the write's first byte.
    pub start: u64,
    /// Bytes written.
    pub len: u64,
    /// The writer's value.
    pub imm: u32,
}

impl NotifyFrame {
    /// The encoded notification.
    pub fn encode(&self) -> [u8; NOTIFY_LEN] {
        let mut b = [0u8; NOTIFY_LEN];
        b[0..4].copy_from_slice(&self.region.id.to_le_bytes());
        b[4..12].copy_from_slice(&self.region.key.to_le_bytes());
        b[12..20].copy_from_slice(&self.start.to_le_bytes());
        b[20..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..32].copy_from_slice(&self.imm.to_le_bytes());
        b
    }

    /// Parses a notification (exactly [`NOTIFY_LEN`] bytes).
    pub fn decode(payload: &[u8]) -> Result<NotifyFrame, FrameError> {
        let b: &[u8; NOTIFY_LEN] = payload.try_into().map_err(|_| {
            if payload.len() < NOTIFY_LEN {
                FrameError::Short
            } else {
                FrameError::Trailing
            }
        })?;
        Ok(NotifyFrame {
            region: region_ref(b),
            start: u64::from_le_bytes(b[12..20].try_into().expect("8 bytes")),
            len: u64::from_le_bytes(b[20..28].try_into().expect("8 bytes")),
            imm: u32::from_le_bytes(b[28..32].try_into().expect("4 bytes")),
        })
    }
}

/// Names a region at its owner: its id and its random key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RegionRef {
    /// The region's id at its node.
    pub id: u32,
    /// The region's random key (see the module docs).
    pub key: u64,
}

/// A write request's fields before its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteHead {
    /// The region written.
    pub region: RegionRef,
    /// Where in the region the data goes.
    pub offset: u64,
    /// A write with notification: with the part that ends the write.
    pub notify: Option<Notify>,
}

/// The notification a write asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Notify {
    /// The writer's value.
    pub imm: u32,
    /// Offset of the whole write's first byte (at most the part's offset).
    pub start: u64,
}

impl WriteHead {
    /// The encoded head; the data follows it in the request.
    pub fn encode(&self) -> [u8; WRITE_HEAD_LEN] {
        let mut b = [0u8; WRITE_HEAD_LEN];
        b[0..4].copy_from_slice(&self.region.id.to_le_bytes());
        b[4..12].copy_from_slice(&self.region.key.to_le_bytes());
        b[12..20].copy_from_slice(&self.offset.to_le_bytes());
        if let Some(n) = self.notify {
            b[20] = FLAG_NOTIFY;
            b[21..25].copy_from_slice(&n.imm.to_le_bytes());
            b[25..33].copy_from_slice(&n.start.to_le_bytes());
        }
        b
    }

    /// Splits a write request's payload into its head and its data.
    pub fn decode(payload: &[u8]) -> Result<(WriteHead, &[u8]), FrameError> {
        let (h, data) = payload
            .split_first_chunk::<WRITE_HEAD_LEN>()
            .ok_or(FrameError::Short)?;
        let flags = h[20];
        if flags & !FLAG_NOTIFY != 0 {
            return Err(FrameError::UnknownFlags(flags));
        }
        let offset = u64::from_le_bytes(h[12..20].try_into().expect("8 bytes"));
        let notify = Notify {
            imm: u32::from_le_bytes(h[21..25].try_into().expect("4 bytes")),
            start: u64::from_le_bytes(h[25..33].try_into().expect("8 bytes")),
        };
        if flags & FLAG_NOTIFY == 0 {
            if notify.imm != 0 || notify.start != 0 {
                return Err(FrameError::StrayNotify);
            }
        } else if notify.start > offset {
            return Err(FrameError::StrayNotify);
        }
        let head = WriteHead {
            region: region_ref(h),
            offset,
            notify: (flags & FLAG_NOTIFY != 0).then_some(notify),
        };
        Ok((head, data))
    }
}

/// A read request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadRequest {
    /// The region read.
    pub region: RegionRef,
    /// Where in the region the read starts.
    pub offset: u64,
    /// Bytes to read.
    pub len: u32,
}

impl ReadRequest {
    /// The encoded request.
    pub fn encode(&self) -> [u8; READ_LEN] {
        let mut b = [0u8; READ_LEN];
        b[0..4].copy_from_slice(&self.region.id.to_le_bytes());
        b[4..12].copy_from_slice(&self.region.key.to_le_bytes());
        b[12..20].copy_from_slice(&self.offset.to_le_bytes());
        b[20..24].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Parses a read request's payload (exactly [`READ_LEN`] bytes).
    pub fn decode(payload: &[u8]) -> Result<ReadRequest, FrameError> {
        let b: &[u8; READ_LEN] = payload.try_into().map_err(|_| {
            if payload.len() < READ_LEN {
                FrameError::Short
            } else {
                FrameError::Trailing
            }
        })?;
        let len = u32::from_le_bytes(b[20..24].try_into().expect("4 bytes"));
        if len as usize > PART_MAX {
            return Err(FrameError::TooLong(len));
        }
        Ok(ReadRequest {
            region: region_ref(b),
            offset: u64::from_le_bytes(b[12..20].try_into().expect("8 bytes")),
            len,
        })
    }
}

fn region_ref(b: &[u8]) -> RegionRef {
    RegionRef {
        id: u32::from_le_bytes(b[0..4].try_into().expect("4 bytes")),
        key: u64::from_le_bytes(b[4..12].try_into().expect("8 bytes")),
    }
}

/// The owner's answer to a write or read: the first byte of its response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    /// Done (a read's data follows).
    Ok = 0,
    /// No region of this id and key (revoked, never existed, or the node
    /// restarted since the descriptor was made).
    Unknown = 1,
    /// The range is not inside the region.
    OutOfBounds = 2,
    /// The region does not permit this access.
    NotPermitted = 3,
}

impl Status {
    /// Splits an answer into its status and the data after it.
    pub fn decode(answer: &[u8]) -> Result<(Status, &[u8]), FrameError> {
        let (&s, rest) = answer.split_first().ok_or(FrameError::Short)?;
        let status = match s {
            0 => Status::Ok,
            1 => Status::Unknown,
            2 => Status::OutOfBounds,
            3 => Status::NotPermitted,
            other => return Err(FrameError::UnknownStatus(other)),
        };
        if status != Status::Ok && !rest.is_empty() {
            return Err(FrameError::Trailing);
        }
        Ok((status, rest))
    }
}

/// Why a one-sided frame could not be parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Fewer bytes than the frame's fixed part.
    #[error("one-sided frame too short")]
    Short,
    /// Bytes after a frame that has none.
    #[error("bytes after the end of a one-sided frame")]
    Trailing,
    /// A flag bit this version does not know.
    #[error("unknown one-sided write flags {0:#x}")]
    UnknownFlags(u8),
    /// Notification fields without the flag, or a write's start after
    /// the part's offset.
    #[error("inconsistent notification fields in a one-sided write")]
    StrayNotify,
    /// A read of more than [`PART_MAX`] bytes in one request.
    #[error("one-sided read of {0} bytes in one request, more than one part (PART_MAX)")]
    TooLong(u32),
    /// A status this version does not know.
    #[error("unknown one-sided answer status {0}")]
    UnknownStatus(u8),
}

/// What other nodes may do with an exposed region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Access {
    /// Others may only read.
    ReadOnly,
    /// Others may only write.
    WriteOnly,
    /// Others may read and write.
    ReadWrite,
    /// Others may do nothing: the region is the local side of its own
    /// node's accesses (writes from it, reads into it), such as an
    /// outgoing buffer.
    LocalOnly,
}

impl Access {
    /// Whether others may read.
    pub fn can_read(self) -> bool {
        matches!(self, Access::ReadOnly | Access::ReadWrite)
    }

    /// Whether others may write.
    pub fn can_write(self) -> bool {
        matches!(self, Access::WriteOnly | Access::ReadWrite)
    }
}

/// A region descriptor as it travels between nodes (in any message, with
/// the payload codec): it names a region and says what it allows. A
/// receiver trusts none of it beyond the checks here: the owner checks
/// every access again against the region itself (its device does, on
/// InfiniBand), and a wrong key names nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Descriptor {
    /// The owner's node id.
    pub node: u16,
    /// The region's id at the owner.
    pub id: u32,
    /// The region's random key.
    pub key: u64,
    /// Length in bytes.
    pub len: u64,
    /// What others may do.
    pub access: Access,
    /// Address and remote key for the device path (InfiniBand).
    pub rdma: Option<RdmaKey>,
}

/// Where a region lies for an RDMA device: the owner's address of its
/// first byte and its remote key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct RdmaKey {
    /// The owner's address of the region's first byte.
    pub addr: u64,
    /// The region's remote key.
    pub rkey: u32,
}

/// Why a descriptor does not allow an access.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Not with the descriptor's rights.
    NotPermitted,
    /// Not inside its length.
    OutOfBounds,
}

impl Descriptor {
    /// Checks a write (`write`) or read of `len` bytes at `offset` against
    /// the rights and length the descriptor claims.
    pub fn check(&self, offset: u64, len: u64, write: bool) -> Result<(), Refusal> {
        let allowed = if write {
            self.access.can_write()
        } else {
            self.access.can_read()
        };
        if !allowed {
            Err(Refusal::NotPermitted)
        } else if !in_bounds(offset, len, self.len) {
            Err(Refusal::OutOfBounds)
        } else {
            Ok(())
        }
    }
}

/// Whether `[offset, offset + len)` lies inside a region of `region_len`
/// bytes (without overflow).
pub fn in_bounds(offset: u64, len: u64, region_len: u64) -> bool {
    offset.checked_add(len).is_some_and(|end| end <= region_len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_checks_rights_then_bounds_without_overflow() {
        let d = |access| Descriptor {
            node: 1,
            id: 2,
            key: 3,
            len: 100,
            access,
            rdma: None,
        };
        let rw = d(Access::ReadWrite);
        assert_eq!(rw.check(0, 100, true), Ok(()));
        assert_eq!(rw.check(100, 0, false), Ok(()));
        assert_eq!(rw.check(99, 2, true), Err(Refusal::OutOfBounds));
        assert_eq!(rw.check(u64::MAX, 2, false), Err(Refusal::OutOfBounds));
        assert_eq!(
            d(Access::ReadOnly).check(0, 1, true),
            Err(Refusal::NotPermitted)
        );
        assert_eq!(
            d(Access::WriteOnly).check(0, 1, false),
            Err(Refusal::NotPermitted)
        );
        for write in [false, true] {
            assert_eq!(
                d(Access::LocalOnly).check(0, 1, write),
                Err(Refusal::NotPermitted)
            );
        }
        // Rights first: an access without them is refused as such even
        // when it is out of bounds too.
        assert_eq!(
            d(Access::ReadOnly).check(500, 1, true),
            Err(Refusal::NotPermitted)
        );
        let with_key = Descriptor {
            rdma: Some(RdmaKey {
                addr: 1 << 40,
                rkey: 9,
            }),
            ..rw
        };
        let mut bytes = Vec::new();
        crate::codec::encode_into(&mut bytes, &with_key).unwrap();
        assert_eq!(
            crate::codec::decode::<Descriptor>(&bytes).unwrap(),
            with_key
        );
    }

    #[test]
    fn write_head_round_trip_with_and_without_notify() {
        let n = |imm, start| Some(Notify { imm, start });
        for notify in [None, n(0, 0), n(u32::MAX, u64::MAX - 3), n(5, 17)] {
            let h = WriteHead {
                region: RegionRef {
                    id: 7,
                    key: 0x0123_4567_89ab_cdef,
                },
                offset: u64::MAX - 3,
                notify,
            };
            let mut frame = h.encode().to_vec();
            frame.extend_from_slice(b"data");
            let (back, data) = WriteHead::decode(&frame).unwrap();
            assert_eq!(back, h);
            assert_eq!(data, b"data");
        }
    }

    #[test]
    fn malformed_frames_are_errors() {
        assert_eq!(
            WriteHead::decode(&[0; WRITE_HEAD_LEN - 1]),
            Err(FrameError::Short)
        );
        let mut f = [0u8; WRITE_HEAD_LEN];
        f[20] = 0x82;
        assert_eq!(WriteHead::decode(&f), Err(FrameError::UnknownFlags(0x82)));
        let mut f = [0u8; WRITE_HEAD_LEN];
        f[21] = 1;
        assert_eq!(WriteHead::decode(&f), Err(FrameError::StrayNotify));
        let mut f = [0u8; WRITE_HEAD_LEN];
        f[20] = FLAG_NOTIFY;
        f[25] = 1;
        assert_eq!(WriteHead::decode(&f), Err(FrameError::StrayNotify));
        assert_eq!(ReadRequest::decode(&[0; 23]), Err(FrameError::Short));
        assert_eq!(ReadRequest::decode(&[0; 25]), Err(FrameError::Trailing));
        assert_eq!(Status::decode(&[]), Err(FrameError::Short));
        assert_eq!(Status::decode(&[9]), Err(FrameError::UnknownStatus(9)));
        assert_eq!(Status::decode(&[2, 0]), Err(FrameError::Trailing));
        assert_eq!(Status::decode(&[0, 5]), Ok((Status::Ok, &[5u8][..])));
    }

    #[test]
    fn read_request_round_trip() {
        let r = ReadRequest {
            region: RegionRef { id: 1, key: 2 },
            offset: 3,
            len: PART_MAX as u32,
        };
        assert_eq!(ReadRequest::decode(&r.encode()), Ok(r));
        let too_long = ReadRequest {
            len: PART_MAX as u32 + 1,
            ..r
        };
        assert_eq!(
            ReadRequest::decode(&too_long.encode()),
            Err(FrameError::TooLong(PART_MAX as u32 + 1))
        );
    }

    #[test]
    fn notify_round_trip() {
        let n = NotifyFrame {
            region: RegionRef { id: 3, key: 4 },
            start: 5,
            len: u64::MAX,
            imm: 6,
        };
        assert_eq!(NotifyFrame::decode(&n.encode()), Ok(n));
        assert_eq!(
            NotifyFrame::decode(&[0; NOTIFY_LEN - 1]),
            Err(FrameError::Short)
        );
        assert_eq!(
            NotifyFrame::decode(&[0; NOTIFY_LEN + 1]),
            Err(FrameError::Trailing)
        );
    }

    #[test]
    fn bounds_never_overflow() {
        assert!(in_bounds(0, 10, 10));
        assert!(in_bounds(10, 0, 10));
        assert!(!in_bounds(10, 1, 10));
        assert!(!in_bounds(u64::MAX, 2, u64::MAX));
        assert!(!in_bounds(11, 0, 10));
    }
}
