//! Sans-IO message decoder: turns a connection's byte stream, arriving in
//! buffers of any size, into whole messages.
//!
//! A message that lies within one buffer is handed out as a borrowed slice
//! (zero copy); one split across buffers is reassembled in a per-connection
//! scratch vector, capped by `max_message_size`. The vector takes the
//! claimed size up front only up to [`KEEP_SCRATCH`] (what the decoder may
//! keep anyway); beyond it, it grows only as bytes actually arrive. A
//! reassembled payload of at least [`GIVE_FROM`] bytes is handed over to be
//! taken rather than copied ([`Decoder::feed_pieces`], [`Piece::Given`]).

use crate::header::{HeaderError, MessageHeader, HEADER_LEN};

/// Scratch capacity kept after a large reassembled message (bytes).
pub const KEEP_SCRATCH: usize = 256 << 10;

/// Smallest reassembled payload handed over as [`Piece::Given`]: a callee
/// that keeps the payload takes the vector instead of copying it (a fresh
/// allocation per such message costs far less than a copy of its bytes);
/// smaller ones are lent from the scratch the decoder keeps.
pub const GIVE_FROM: usize = 4 << 10;

/// A completed message's payload, as [`Decoder::feed_pieces`] hands it out.
#[derive(Debug)]
pub enum Piece<'a> {
    /// The payload, lent: within the fed bytes, or reassembled in the
    /// scratch vector the decoder keeps for the next split message.
    Lent(&'a [u8]),
    /// A reassembled payload of at least [`GIVE_FROM`] bytes: the callee
    /// may take the vector (`std::mem::take`) rather than copy it.
    Given(&'a mut Vec<u8>),
}

impl Piece<'_> {
    /// The payload bytes.
    pub fn bytes(&self) -> &[u8] {
        match self {
            Piece::Lent(b) => b,
            Piece::Given(v) => v,
        }
    }
}

/// Reassembly state of one connection's incoming stream.
#[derive(Debug)]
pub struct Decoder {
    max_payload: usize,
    header_bytes: [u8; HEADER_LEN],
    header_have: usize,
    /// Header of the message being reassembled.
    current: Option<MessageHeader>,
    scratch: Vec<u8>,
    failed: bool,
}

impl Decoder {
    /// A decoder that rejects payloads above `max_payload` bytes.
    pub fn new(max_payload: usize) -> Self {
        Self {
            max_payload,
            header_bytes: [0; HEADER_LEN],
            header_have: 0,
            current: None,
            scratch: Vec::new(),
            failed: false,
        }
    }

    /// True between messages (no partial header or payload buffered).
    pub fn is_idle(&self) -> bool {
        self.header_have == 0 && self.current.is_none()
    }

    /// Feeds the next bytes of the stream; `on_message` gets every message
    /// completed by them, in order. After an error the stream is unusable and
    /// every later call fails too.
    pub fn feed<F>(&mut self, data: &[u8], mut on_message: F) -> Result<(), HeaderError>
    where
        F: FnMut(&MessageHeader, &[u8]),
    {
        self.feed_pieces(data, |h, p| on_message(h, p.bytes()))
    }

    /// Like [`Decoder::feed`], handing out each payload as a [`Piece`], so
    /// a reassembled one can be taken instead of copied.
    pub fn feed_pieces<F>(&mut self, mut data: &[u8], mut on_message: F) -> Result<(), HeaderError>
    where
        F: FnMut(&MessageHeader, Piece<'_>),
    {
        if self.failed {
            return Err(HeaderError::BadMagic(0));
        }
        while !data.is_empty() {
            if let Some(h) = self.current {
                // Continue a split payload.
                let need = h.payload_len as usize - self.scratch.len();
                let take = need.min(data.len());
                self.scratch.extend_from_slice(&data[..take]);
                data = &data[take..];
                if self.scratch.len() == h.payload_len as usize {
                    // Done with it before the callee runs (it may take the
                    // vector, or unwind).
                    self.current = None;
                    // (A scratch over `KEEP_SCRATCH` holds a payload of at
                    // least that much, so it is given too.)
                    if self.scratch.len() >= GIVE_FROM {
                        on_message(&h, Piece::Given(&mut self.scratch));
                    } else {
                        on_message(&h, Piece::Lent(&self.scratch));
                    }
                    self.scratch.clear();
                    if self.scratch.capacity() > KEEP_SCRATCH {
                        self.scratch = Vec::new();
                    }
                }
                continue;
            }
            let header = if self.header_have > 0 || data.len() < HEADER_LEN {
                // Header split across buffers.
                let take = (HEADER_LEN - self.header_have).min(data.len());
                self.header_bytes[self.header_have..self.header_have + take]
                    .copy_from_slice(&data[..take]);
                self.header_have += take;
                data = &data[take..];
                if self.header_have < HEADER_LEN {
                    return Ok(());
                }
                self.header_have = 0;
                self.decode_header(self.header_bytes)?
            } else {
                let mut b = [0u8; HEADER_LEN];
                b.copy_from_slice(&data[..HEADER_LEN]);
                data = &data[HEADER_LEN..];
                self.decode_header(b)?
            };
            let len = header.payload_len as usize;
            if data.len() >= len {
                on_message(&header, Piece::Lent(&data[..len]));
                data = &data[len..];
            } else {
                self.current = Some(header);
                self.scratch.clear();
                // At once for the rest too (no regrowth copying the first
                // part), up to what the decoder may keep anyway.
                self.scratch.reserve_exact(len.min(KEEP_SCRATCH));
                self.scratch.extend_from_slice(data);
                data = &[];
            }
        }
        Ok(())
    }

    fn decode_header(&mut self, b: [u8; HEADER_LEN]) -> Result<MessageHeader, HeaderError> {
        MessageHeader::decode(&b, self.max_payload).inspect_err(|_| self.failed = true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::header::FLAG_REQUEST;

    fn encode(t: u8, id: u32, payload: &[u8]) -> Vec<u8> {
        let h = MessageHeader {
            msg_type: t,
            subtype: 0,
            flags: FLAG_REQUEST,
            request_id: id,
            payload_len: payload.len() as u32,
        };
        let mut b = [0u8; HEADER_LEN];
        h.encode(&mut b);
        let mut v = b.to_vec();
        v.extend_from_slice(payload);
        v
    }

    #[test]
    fn reassembles_any_split() {
        let mut stream = Vec::new();
        let mut expect = Vec::new();
        for i in 0..50u32 {
            let p: Vec<u8> = (0..(i * 37 % 300)).map(|x| (x ^ i) as u8).collect();
            stream.extend(encode(1, i, &p));
            expect.push((i, p));
        }
        for chunk in [1usize, 2, 5, 11, 12, 13, 64, 1000, stream.len()] {
            let mut d = Decoder::new(1 << 20);
            let mut got = Vec::new();
            for c in stream.chunks(chunk) {
                d.feed(c, |h, p| got.push((h.request_id, p.to_vec())))
                    .unwrap();
            }
            assert!(d.is_idle());
            assert_eq!(got, expect, "chunk size {chunk}");
        }
    }

    /// Large reassembled payloads are given and taken by the callee (every
    /// other one): the decoder goes on in a new scratch vector, and every
    /// message, taken or lent, arrives intact.
    #[test]
    fn reassembled_payloads_can_be_taken() {
        let mut stream = Vec::new();
        let mut expect = Vec::new();
        for i in 0..40u32 {
            let len = if i % 3 == 0 {
                KEEP_SCRATCH + 1 + i as usize
            } else {
                (i * 53 % 700) as usize
            };
            let p: Vec<u8> = (0..len).map(|x| ((x as u32 * 7) ^ i) as u8).collect();
            stream.extend(encode(1, i, &p));
            expect.push((i, p));
        }
        for chunk in [7usize, 64, 333, 70_000] {
            let mut d = Decoder::new(1 << 20);
            let (mut got, mut taken) = (Vec::new(), 0);
            for c in stream.chunks(chunk) {
                d.feed_pieces(c, |h, piece| {
                    let bytes = match piece {
                        Piece::Given(v) if h.request_id % 2 == 0 => {
                            taken += 1;
                            std::mem::take(v)
                        }
                        p => p.bytes().to_vec(),
                    };
                    got.push((h.request_id, bytes));
                })
                .unwrap();
            }
            assert!(d.is_idle());
            assert_eq!(got, expect, "chunk size {chunk}");
            assert!(taken > 0, "chunk size {chunk}: a large payload was given");
        }
    }

    /// A split payload of at least `GIVE_FROM` bytes is given, a smaller
    /// one lent; the scratch takes a claimed size up front only up to
    /// `KEEP_SCRATCH`.
    #[test]
    fn split_payloads_from_give_from_are_given_and_claims_are_capped() {
        let small: Vec<u8> = (0..GIVE_FROM - 1).map(|x| x as u8).collect();
        let large: Vec<u8> = (0..GIVE_FROM).map(|x| (x * 3) as u8).collect();
        let mut stream = encode(1, 1, &small);
        stream.extend(encode(1, 2, &large));
        let mut d = Decoder::new(1 << 20);
        let mut got = Vec::new();
        for c in stream.chunks(1000) {
            d.feed_pieces(c, |h, piece| {
                let given = matches!(piece, Piece::Given(_));
                got.push((h.request_id, given, piece.bytes().to_vec()));
            })
            .unwrap();
        }
        assert_eq!(got, vec![(1, false, small), (2, true, large)]);

        let mut d = Decoder::new(8 << 20);
        let mut claim = encode(1, 3, &[7; 10]);
        claim[8..12].copy_from_slice(&(4u32 << 20).to_le_bytes());
        d.feed(&claim, |_, _| panic!("incomplete")).unwrap();
        assert!(!d.is_idle());
        assert!(d.scratch.capacity() <= KEEP_SCRATCH);
    }

    #[test]
    fn rejects_oversized_and_garbage_without_allocating() {
        let mut d = Decoder::new(100);
        let mut big = encode(1, 1, &[0; 10]);
        big[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            d.feed(&big, |_, _| panic!("no message")),
            Err(HeaderError::TooLong { .. })
        ));
        assert!(d.feed(&[0xD7], |_, _| ()).is_err(), "stays failed");
        let mut d = Decoder::new(100);
        assert!(d.feed(&[1; 40], |_, _| ()).is_err());
        assert_eq!(d.scratch.capacity(), 0);
    }
}
