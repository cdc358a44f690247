//! dxkv's memcached text-protocol parser (the module the front end runs,
//! included by path: it uses nothing but std) over a whole connection's
//! bytes: never panics, every command or refusal consumes at least one
//! byte and never more than it was given (except a refused value's rest,
//! which the connection drops as it arrives), and a command's data lies
//! within the bytes consumed.
#![no_main]

#[path = "../../dxkv/src/memcached/parse.rs"]
#[allow(dead_code)]
mod parse;

use libfuzzer_sys::fuzz_target;
use parse::{parse, Command, Limits, Parsed};

fuzz_target!(|data: &[u8]| {
    let limits = Limits {
        max_line: 256,
        max_value: 4096,
    };
    let mut at = 0;
    while at < data.len() {
        match parse(&data[at..], &limits) {
            Parsed::Incomplete => {
                // Only a partial line or a partial value may be waiting.
                assert!(data.len() - at <= limits.max_line + limits.max_value + 4 + 32);
                break;
            }
            Parsed::Refused { skip, close, .. } => {
                assert!(skip > 0);
                if close {
                    break;
                }
                at += skip.min(data.len() - at);
            }
            Parsed::Command { cmd, used } => {
                assert!(used > 0 && used <= data.len() - at);
                if let Command::Store { data: value, .. } = &cmd {
                    assert!(value.len() <= limits.max_value);
                    assert!(value.len() + 2 < used);
                }
                at += used;
            }
        }
    }
});
