//! The record format of a segment, without I/O: how a pusher lays records
//! into a circular buffer that one puller reads.
//!
//! A segment of `seg` bytes (a multiple of [`ALIGN`]) is a ring addressed
//! by positions that only grow; byte `pos` lives at offset `pos % seg`.
//! A frame is a little-endian `u32` header, then the payload, padded to
//! [`ALIGN`] bytes. Header values:
//! - `0..=MAX_LEN`: a record of that many bytes;
//! - [`WRAP`]: the rest of the segment is unused, the next frame starts at
//!   offset 0 (a frame never straddles the end);
//! - [`END`]: the writer's stream ends (no payload).
//!
//! The reader trusts nothing: a header whose record would not fit in the
//! rest of the segment is [`FrameError::Corrupt`].

/// Frames start at multiples of this (so a header never straddles the end).
pub const ALIGN: usize = 8;
/// Bytes of a frame header.
pub const HEADER: usize = 4;
/// Header of a wrap marker.
pub const WRAP: u32 = u32::MAX;
/// Header of a stream's end.
pub const END: u32 = u32::MAX - 1;
/// Largest record length a header can carry.
pub const MAX_LEN: u32 = u32::MAX - 2;

/// Bytes a frame of a `payload`-byte record takes in a segment.
pub fn frame_len(payload: usize) -> usize {
    (HEADER + payload).div_ceil(ALIGN) * ALIGN
}

/// Largest record a segment of `seg` bytes takes.
pub fn max_record(seg: usize) -> usize {
    seg.saturating_sub(HEADER).min(MAX_LEN as usize)
}

/// Where a frame of `len` bytes (a [`frame_len`]) goes when the ring's
/// head is at `head`: `(wrap, start)`, with `wrap` the position of a wrap
/// marker needed first (the frame does not fit before the segment's end).
/// The frame ends at `start + len`.
pub fn place(head: u64, seg: usize, len: usize) -> (Option<u64>, u64) {
    debug_assert!(len <= seg && head.is_multiple_of(ALIGN as u64));
    let off = (head % seg as u64) as usize;
    let room = seg - off;
    if len <= room {
        (None, head)
    } else {
        (Some(head), head + room as u64)
    }
}

/// What a header at a position says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frame {
    /// A record of this many bytes follows the header; the frame takes
    /// `frame_len(len)` bytes.
    Record(usize),
    /// Skip to the next segment start.
    Wrap,
    /// The stream ended.
    End,
}

/// A header that cannot be.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// A record that would not fit in the rest of the segment.
    #[error("record of {len} bytes at offset {off} overruns a {seg}-byte segment")]
    Corrupt {
        /// The header's length.
        len: u64,
        /// Offset of the header in the segment.
        off: usize,
        /// The segment's size.
        seg: usize,
    },
}

/// Parses the header `h` found at position `pos` of a segment of `seg`
/// bytes.
pub fn parse(h: u32, pos: u64, seg: usize) -> Result<Frame, FrameError> {
    match h {
        WRAP => Ok(Frame::Wrap),
        END => Ok(Frame::End),
        len => {
            let off = (pos % seg as u64) as usize;
            let len = len as usize;
            if len > seg || frame_len(len) > seg - off {
                return Err(FrameError::Corrupt {
                    len: len as u64,
                    off,
                    seg,
                });
            }
            Ok(Frame::Record(len))
        }
    }
}

/// The position after a wrap marker at `pos`: the next segment start.
pub fn after_wrap(pos: u64, seg: usize) -> u64 {
    let seg = seg as u64;
    pos - pos % seg + seg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_aligned_and_never_straddle_the_end() {
        assert_eq!(frame_len(0), 8);
        assert_eq!(frame_len(4), 8);
        assert_eq!(frame_len(5), 16);
        assert_eq!(max_record(64), 60);
        assert_eq!(frame_len(max_record(64)), 64);
        // Fits before the end.
        assert_eq!(place(64 + 48, 64, 16), (None, 112));
        // Does not: a wrap marker, then the next segment start.
        assert_eq!(place(64 + 56, 64, 16), (Some(120), 128));
        assert_eq!(after_wrap(120, 64), 128);
        assert_eq!(after_wrap(128, 64), 192);
    }

    #[test]
    fn headers_are_checked_against_the_segment() {
        assert_eq!(parse(WRAP, 0, 64), Ok(Frame::Wrap));
        assert_eq!(parse(END, 8, 64), Ok(Frame::End));
        assert_eq!(parse(52, 8, 64), Ok(Frame::Record(52)));
        assert!(parse(53, 8, 64).is_err(), "runs past the end");
        assert!(parse(MAX_LEN, 0, 64).is_err());
        assert_eq!(parse(60, 64, 64), Ok(Frame::Record(60)));
    }
}
