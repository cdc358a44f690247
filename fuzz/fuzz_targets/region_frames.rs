//! The one-sided operation frames (`proto::region`): a write request's
//! head, a read request, an answer and a write notification, parsed from
//! arbitrary bytes. Never
//! panics; whatever parses encodes back to the same bytes (so the parser
//! accepts exactly one form per value), and a parsed write's notification
//! never starts after its part.
//!
//! Input: [selector: u8][frame].
#![no_main]

use dxnet_proto::region::{NotifyFrame, ReadRequest, Status, WriteHead, WRITE_HEAD_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&sel, frame)) = data.split_first() else {
        return;
    };
    match sel % 4 {
        0 => {
            if let Ok((head, rest)) = WriteHead::decode(frame) {
                assert_eq!(&head.encode()[..], &frame[..WRITE_HEAD_LEN]);
                assert_eq!(rest.len(), frame.len() - WRITE_HEAD_LEN);
                if let Some(n) = head.notify {
                    assert!(n.start <= head.offset);
                }
            }
        }
        1 => {
            if let Ok(r) = ReadRequest::decode(frame) {
                assert_eq!(&r.encode()[..], frame);
            }
        }
        3 => {
            if let Ok(n) = NotifyFrame::decode(frame) {
                assert_eq!(&n.encode()[..], frame);
            }
        }
        _ => {
            if let Ok((status, rest)) = Status::decode(frame) {
                assert_eq!(frame[0], status as u8);
                assert!(status == Status::Ok || rest.is_empty());
            }
        }
    }
});
