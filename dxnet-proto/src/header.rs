//! The 12-byte header in front of every message in a connection's byte
//! stream, with a `MessageKind` for its request/response bits.

/// Size of [`MessageHeader`] on the wire.
pub const HEADER_LEN: usize = 12;

/// Header flag: this message is a request; `request_id` names it.
pub const FLAG_REQUEST: u8 = 0x01;
/// Header flag: this message is the response to request `request_id`.
pub const FLAG_RESPONSE: u8 = 0x02;
/// Header flag: the response carries an error code instead of a payload.
pub const FLAG_ERROR: u8 = 0x04;
/// All flags a valid header may carry.
pub const FLAGS_KNOWN: u8 = FLAG_REQUEST | FLAG_RESPONSE | FLAG_ERROR;

/// What a message is, from its flag bits (a valid header carries one of
/// these combinations; see [`MessageHeader::decode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageKind {
    /// A plain message: handled, never answered.
    Plain,
    /// A request: `request_id` names it, a response is expected.
    Request,
    /// The response to request `request_id`, carrying a payload.
    Response,
    /// The response to request `request_id`, carrying an error code.
    ErrorResponse,
}

impl MessageKind {
    /// The flag bits of this kind.
    pub const fn flags(self) -> u8 {
        match self {
            MessageKind::Plain => 0,
            MessageKind::Request => FLAG_REQUEST,
            MessageKind::Response => FLAG_RESPONSE,
            MessageKind::ErrorResponse => FLAG_RESPONSE | FLAG_ERROR,
        }
    }

    /// Whether a response of this kind answers a request (and so travels
    /// outside the flow-control window).
    pub const fn is_response(self) -> bool {
        matches!(self, MessageKind::Response | MessageKind::ErrorResponse)
    }
}

/// Header magic byte: catches stream desynchronisation early.
pub const HEADER_MAGIC: u8 = 0xD7;

/// The header in front of every message in the byte stream of a connection.
///
/// Layout (little endian): magic u8, type u8, subtype u8, flags u8,
/// request_id u32, payload_len u32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageHeader {
    /// Message type id.
    pub msg_type: u8,
    /// Message subtype id.
    pub subtype: u8,
    /// `FLAG_*` bits.
    pub flags: u8,
    /// Request id for requests and responses, 0 otherwise.
    pub request_id: u32,
    /// Payload bytes following the header.
    pub payload_len: u32,
}

/// Why a header was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    /// The magic byte is wrong: the stream is out of sync or hostile.
    #[error("bad header magic {0:#04x}")]
    BadMagic(u8),
    /// Unknown or contradictory flag bits.
    #[error("bad header flags {0:#04x}")]
    BadFlags(u8),
    /// The payload length exceeds the receiver's `max_message_size`.
    #[error("payload length {len} exceeds max_message_size {max}")]
    TooLong {
        /// Claimed length.
        len: u32,
        /// Configured limit.
        max: usize,
    },
    /// A unit that must hold whole messages (a standalone send) ends inside
    /// one.
    #[error("standalone send ends inside a message")]
    Truncated,
}

impl MessageHeader {
    /// Encodes the header into `out`.
    pub fn encode(&self, out: &mut [u8; HEADER_LEN]) {
        out[0] = HEADER_MAGIC;
        out[1] = self.msg_type;
        out[2] = self.subtype;
        out[3] = self.flags;
        out[4..8].copy_from_slice(&self.request_id.to_le_bytes());
        out[8..12].copy_from_slice(&self.payload_len.to_le_bytes());
    }

    /// Decodes and validates a header; `max_payload` bounds `payload_len`.
    pub fn decode(b: &[u8; HEADER_LEN], max_payload: usize) -> Result<Self, HeaderError> {
        if b[0] != HEADER_MAGIC {
            return Err(HeaderError::BadMagic(b[0]));
        }
        let flags = b[3];
        if flags & !FLAGS_KNOWN != 0
            || (flags & FLAG_REQUEST != 0 && flags & FLAG_RESPONSE != 0)
            || (flags & FLAG_ERROR != 0 && flags & FLAG_RESPONSE == 0)
        {
            return Err(HeaderError::BadFlags(flags));
        }
        let payload_len = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
        if payload_len as usize > max_payload {
            return Err(HeaderError::TooLong {
                len: payload_len,
                max: max_payload,
            });
        }
        Ok(Self {
            msg_type: b[1],
            subtype: b[2],
            flags,
            request_id: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            payload_len,
        })
    }

    /// What the message is (the flags of a decoded header are valid).
    pub fn kind(&self) -> MessageKind {
        if self.flags & FLAG_REQUEST != 0 {
            MessageKind::Request
        } else if self.flags & FLAG_ERROR != 0 {
            MessageKind::ErrorResponse
        } else if self.flags & FLAG_RESPONSE != 0 {
            MessageKind::Response
        } else {
            MessageKind::Plain
        }
    }

    /// The (type, subtype) pair as one 16-bit key.
    pub fn type_key(&self) -> u16 {
        type_key(self.msg_type, self.subtype)
    }
}

/// The (type, subtype) pair as one 16-bit key.
pub const fn type_key(t: u8, s: u8) -> u16 {
    ((t as u16) << 8) | s as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_roundtrip_and_validation() {
        let h = MessageHeader {
            msg_type: 3,
            subtype: 9,
            flags: FLAG_REQUEST,
            request_id: 0xDEAD_BEEF,
            payload_len: 77,
        };
        let mut b = [0u8; HEADER_LEN];
        h.encode(&mut b);
        assert_eq!(MessageHeader::decode(&b, 100), Ok(h));
        assert_eq!(
            MessageHeader::decode(&b, 76),
            Err(HeaderError::TooLong { len: 77, max: 76 })
        );
        b[0] = 0;
        assert_eq!(
            MessageHeader::decode(&b, 100),
            Err(HeaderError::BadMagic(0))
        );
        b[0] = HEADER_MAGIC;
        b[3] = FLAG_REQUEST | FLAG_RESPONSE;
        assert!(matches!(
            MessageHeader::decode(&b, 100),
            Err(HeaderError::BadFlags(_))
        ));
        b[3] = 0x80;
        assert!(matches!(
            MessageHeader::decode(&b, 100),
            Err(HeaderError::BadFlags(_))
        ));
        for kind in [
            MessageKind::Plain,
            MessageKind::Request,
            MessageKind::Response,
            MessageKind::ErrorResponse,
        ] {
            b[3] = kind.flags();
            assert_eq!(MessageHeader::decode(&b, 100).unwrap().kind(), kind);
        }
    }
}
