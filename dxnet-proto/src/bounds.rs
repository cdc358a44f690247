//! Where messages begin and end in a connection's byte stream, from the
//! length fields of their headers alone.
//!
//! A receiver reading a byte stream into fixed-size buffers uses this to
//! see, after each read, whether the stream ends inside a message, where
//! that message began and how long it is: it can then move the message's
//! first part to the start of the next buffer, so the whole message lies
//! in one buffer (lent to its receiver, never reassembled). Headers are
//! not validated here (the [`crate::decoder::Decoder`] does that when the
//! bytes are decoded): a wrong length only makes the receiver move bytes
//! it did not need to move, never changes the stream.

use crate::header::HEADER_LEN;

/// Offset of the payload length (u32, little endian) in a header.
const LEN_AT: usize = 8;

/// Walks a connection's stream from message header to message header.
#[derive(Debug, Default, Clone)]
pub struct MessageBounds {
    /// Stream bytes walked.
    pos: u64,
    /// Stream position of the message the stream ends in or next begins.
    start: u64,
    /// That message's end, once its header is complete.
    end: Option<u64>,
    /// The first bytes of its header, while the stream ends inside it
    /// (`end` is `None`).
    header: [u8; HEADER_LEN],
    have: usize,
}

/// The message a stream ends inside, as [`MessageBounds::open`] reports
/// it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenMessage {
    /// Stream position of its first byte.
    pub start: u64,
    /// Its length with the header, once the header is complete.
    pub len: Option<u64>,
}

/// A message's length with its header, from its length field.
fn message_len(l: &[u8]) -> u64 {
    (HEADER_LEN as u64) + u64::from(u32::from_le_bytes([l[0], l[1], l[2], l[3]]))
}

impl MessageBounds {
    /// A walk from the beginning of a stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Stream bytes walked so far.
    pub fn pos(&self) -> u64 {
        self.pos
    }

    /// Walks the next bytes of the stream; returns how many messages begin
    /// in them.
    pub fn feed(&mut self, data: &[u8]) -> usize {
        let base = self.pos;
        let top = base + data.len() as u64;
        self.pos = top;
        // Where the next message begins (within `data` or at its end).
        let mut at = match self.end {
            Some(end) if end > top => return 0, // still inside the message
            Some(end) => end,
            None if self.have == 0 => self.start,
            None => {
                // The rest of a header cut by the last call: it continues
                // at the start of `data`.
                let take = (HEADER_LEN - self.have).min(data.len());
                self.header[self.have..self.have + take].copy_from_slice(&data[..take]);
                self.have += take;
                if self.have < HEADER_LEN {
                    return 0;
                }
                self.have = 0;
                let end = self.start + message_len(&self.header[LEN_AT..]);
                if end > top {
                    self.end = Some(end);
                    return 0;
                }
                end
            }
        };
        let mut begun = 0;
        // Header to header: one load and one add per message (a receiver
        // walks every message it reads).
        loop {
            let i = (at - base) as usize;
            match data.get(i + LEN_AT..i + HEADER_LEN) {
                Some(l) => {
                    begun += 1;
                    let end = at + message_len(l);
                    if end > top {
                        self.start = at;
                        self.end = Some(end);
                        return begun;
                    }
                    at = end;
                }
                None => {
                    // `data` ends between messages or inside a header.
                    let rest = &data[i..];
                    self.header[..rest.len()].copy_from_slice(rest);
                    self.have = rest.len();
                    self.start = at;
                    self.end = None;
                    return begun + usize::from(!rest.is_empty());
                }
            }
        }
    }

    /// The message the bytes walked end inside, if they do not end
    /// between two messages.
    pub fn open(&self) -> Option<OpenMessage> {
        (self.start < self.pos).then(|| OpenMessage {
            start: self.start,
            len: self.end.map(|e| e - self.start),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::header::MessageHeader;

    fn message(len: usize, fill: u8) -> Vec<u8> {
        let mut h = [0u8; HEADER_LEN];
        MessageHeader {
            msg_type: 1,
            subtype: 2,
            flags: 0,
            request_id: 0,
            payload_len: len as u32,
        }
        .encode(&mut h);
        let mut v = h.to_vec();
        v.resize(HEADER_LEN + len, fill);
        v
    }

    /// A stream of messages of the given payload lengths, with the
    /// position where each begins.
    fn stream(lens: &[usize]) -> (Vec<u8>, Vec<u64>) {
        let mut s = Vec::new();
        let mut starts = Vec::new();
        for (i, &l) in lens.iter().enumerate() {
            starts.push(s.len() as u64);
            s.extend(message(l, i as u8));
        }
        (s, starts)
    }

    /// The open message after `cut` bytes, computed from the lengths.
    fn expected(lens: &[usize], starts: &[u64], cut: u64) -> Option<OpenMessage> {
        for (&s, &l) in starts.iter().zip(lens) {
            let end = s + (HEADER_LEN + l) as u64;
            if s < cut && cut < end {
                let len = (cut - s >= HEADER_LEN as u64).then_some(end - s);
                return Some(OpenMessage { start: s, len });
            }
        }
        None
    }

    #[test]
    fn finds_the_open_message_at_every_cut_and_split() {
        let lens = [0, 5, 100, 0, 12, 3, 40_000, 1, 0, 64];
        let (s, starts) = stream(&lens);
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        for piece in [1, 2, 5, 11, 12, 13, 100, 4096, s.len()] {
            let mut b = MessageBounds::new();
            let mut at = 0;
            let mut begun = 0;
            while at < s.len() {
                // Pieces of 1 to `piece` bytes.
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let n = (1 + rng as usize % piece).min(s.len() - at);
                begun += b.feed(&s[at..at + n]);
                at += n;
                assert_eq!(b.pos(), at as u64);
                assert_eq!(begun, starts.iter().filter(|&&st| st < at as u64).count());
                assert_eq!(
                    b.open(),
                    expected(&lens, &starts, at as u64),
                    "after {at} bytes"
                );
            }
            assert_eq!(b.open(), None);
        }
    }

    #[test]
    fn every_prefix_of_a_short_stream() {
        let lens = [3, 0, 20, 1];
        let (s, starts) = stream(&lens);
        for cut in 0..=s.len() {
            let mut b = MessageBounds::new();
            b.feed(&s[..cut]);
            assert_eq!(b.open(), expected(&lens, &starts, cut as u64), "cut {cut}");
            // Then the rest byte by byte.
            for i in cut..s.len() {
                b.feed(&s[i..i + 1]);
                assert_eq!(b.open(), expected(&lens, &starts, i as u64 + 1));
            }
        }
    }

    #[test]
    fn any_length_field_is_walked_without_overflow() {
        let mut h = [0xffu8; HEADER_LEN];
        h[0] = 0;
        let mut b = MessageBounds::new();
        b.feed(&h);
        b.feed(&[0; 100]);
        assert_eq!(
            b.open(),
            Some(OpenMessage {
                start: 0,
                len: Some(HEADER_LEN as u64 + u64::from(u32::MAX)),
            })
        );
    }
}
