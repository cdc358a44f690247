//! memcached's text protocol, commands only, without I/O: what a front-end
//! connection's bytes say, or why they are refused (with memcached's
//! reply). Every length is checked before it is trusted: a command line is
//! at most [`Limits::max_line`] bytes, a value at most
//! [`Limits::max_value`], a key at most [`MAX_KEY`] bytes without control
//! characters.

/// Longest key memcached accepts.
pub const MAX_KEY: usize = 250;

/// Limits of the parser.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Longest command line (without its data block).
    pub max_line: usize,
    /// Largest value of a storage command.
    pub max_value: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_line: 2048,
            max_value: 1 << 20,
        }
    }
}

/// The storage commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreVerb {
    /// `set`: store unconditionally.
    Set,
    /// `add`: store only if the key is absent.
    Add,
    /// `replace`: store only if the key is present.
    Replace,
    /// `append`: add the data after the present value.
    Append,
    /// `prepend`: add the data before the present value.
    Prepend,
    /// `cas`: store only if the item's cas unique is unchanged.
    Cas,
}

/// A parsed command; keys and data borrow the input.
#[derive(Debug, PartialEq, Eq)]
pub enum Command<'a> {
    /// `get`/`gets` (with cas uniques) of one or more keys.
    Get {
        /// The keys, in request order.
        keys: Vec<&'a [u8]>,
        /// `gets`: reply with each item's cas unique.
        cas: bool,
    },
    /// A storage command with its data block.
    Store {
        /// Which storage command.
        verb: StoreVerb,
        /// The key.
        key: &'a [u8],
        /// The client's opaque flags, returned with the item.
        flags: u32,
        /// memcached's exptime (0 never, up to 30 days relative, else a
        /// Unix time; negative: expired at once).
        exptime: i64,
        /// The data block.
        data: &'a [u8],
        /// The cas unique of `cas` (0 for the others).
        unique: u64,
        /// Send no reply.
        noreply: bool,
    },
    /// `delete` of one key.
    Delete {
        /// The key.
        key: &'a [u8],
        /// Send no reply.
        noreply: bool,
    },
    /// `incr` (`incr` true) or `decr`.
    Arith {
        /// The key.
        key: &'a [u8],
        /// The amount.
        delta: u64,
        /// `incr`, else `decr`.
        incr: bool,
        /// Send no reply.
        noreply: bool,
    },
    /// `touch`: a new exptime for an item.
    Touch {
        /// The key.
        key: &'a [u8],
        /// The new exptime (as in `Store`).
        exptime: i64,
        /// Send no reply.
        noreply: bool,
    },
    /// `flush_all`: every item expires (after `delay` seconds).
    FlushAll {
        /// Seconds until the flush (0: now).
        delay: i64,
        /// Send no reply.
        noreply: bool,
    },
    /// `version`.
    Version,
    /// `verbosity` (accepted, no effect).
    Verbosity {
        /// Send no reply.
        noreply: bool,
    },
    /// `stats`.
    Stats,
    /// `quit`: close the connection.
    Quit,
}

/// What the bytes at the start of a buffer are.
#[derive(Debug, PartialEq, Eq)]
pub enum Parsed<'a> {
    /// More bytes are needed (the buffer holds less than one command).
    Incomplete,
    /// A command taking `used` bytes.
    Command {
        /// The command.
        cmd: Command<'a>,
        /// Bytes of the buffer it took.
        used: usize,
    },
    /// Refused: send `reply`, then drop `skip` bytes from the start (it may
    /// be more than the buffer holds: the rest of an oversized value is
    /// dropped as it arrives); `close` the connection if set.
    Refused {
        /// The error reply to send.
        reply: &'static str,
        /// Bytes to drop from the start of the buffer.
        skip: usize,
        /// Close the connection after the reply.
        close: bool,
    },
}

const BAD_FORMAT: &str = "CLIENT_ERROR bad command line format\r\n";

fn refused(reply: &'static str, skip: usize) -> Parsed<'static> {
    Parsed::Refused {
        reply,
        skip,
        close: false,
    }
}

fn valid_key(k: &[u8]) -> bool {
    !k.is_empty() && k.len() <= MAX_KEY && k.iter().all(|&b| b > b' ' && b != 0x7f)
}

fn num<T: std::str::FromStr>(t: &[u8]) -> Option<T> {
    std::str::from_utf8(t).ok()?.parse().ok()
}

/// Parses the first command in `buf`.
pub fn parse<'a>(buf: &'a [u8], limits: &Limits) -> Parsed<'a> {
    let Some(nl) = buf
        .iter()
        .take(limits.max_line + 2)
        .position(|&b| b == b'\n')
    else {
        if buf.len() > limits.max_line {
            // memcached closes such connections too: there is no telling
            // where the next command would start.
            return Parsed::Refused {
                reply: "CLIENT_ERROR line too long\r\n",
                skip: buf.len(),
                close: true,
            };
        }
        return Parsed::Incomplete;
    };
    let line_len = nl + 1;
    let line = buf[..nl].strip_suffix(b"\r").unwrap_or(&buf[..nl]);
    let tokens: Vec<&[u8]> = line
        .split(|&b| b == b' ')
        .filter(|t| !t.is_empty())
        .collect();
    let Some((&name, args)) = tokens.split_first() else {
        return refused("ERROR\r\n", line_len);
    };
    let noreply = args.last() == Some(&&b"noreply"[..]);
    let done = |cmd| Parsed::Command {
        cmd,
        used: line_len,
    };
    match name {
        b"get" | b"gets" => {
            if args.is_empty() || !args.iter().all(|k| valid_key(k)) {
                return refused(BAD_FORMAT, line_len);
            }
            done(Command::Get {
                keys: args.to_vec(),
                cas: name == b"gets",
            })
        }
        b"set" | b"add" | b"replace" | b"append" | b"prepend" | b"cas" => {
            let verb = match name {
                b"set" => StoreVerb::Set,
                b"add" => StoreVerb::Add,
                b"replace" => StoreVerb::Replace,
                b"append" => StoreVerb::Append,
                b"prepend" => StoreVerb::Prepend,
                _ => StoreVerb::Cas,
            };
            let want = if verb == StoreVerb::Cas { 5 } else { 4 };
            let fields = args.len() - noreply as usize;
            let parsed = (fields == want).then(|| {
                Some((
                    num::<u32>(args[1])?,
                    num::<i64>(args[2])?,
                    num::<usize>(args[3])?,
                    if verb == StoreVerb::Cas {
                        num::<u64>(args[4])?
                    } else {
                        0
                    },
                ))
            });
            let Some(Some((flags, exptime, bytes, unique))) = parsed else {
                return refused(BAD_FORMAT, line_len);
            };
            let total = line_len.saturating_add(bytes).saturating_add(2);
            if bytes > limits.max_value {
                return refused("SERVER_ERROR object too large for cache\r\n", total);
            }
            if !valid_key(args[0]) {
                return refused(BAD_FORMAT, total);
            }
            if buf.len() < total {
                return Parsed::Incomplete;
            }
            if &buf[line_len + bytes..total] != b"\r\n" {
                return refused("CLIENT_ERROR bad data chunk\r\n", total);
            }
            Parsed::Command {
                cmd: Command::Store {
                    verb,
                    key: args[0],
                    flags,
                    exptime,
                    data: &buf[line_len..line_len + bytes],
                    unique,
                    noreply,
                },
                used: total,
            }
        }
        b"delete" => {
            // `delete <key> [0] [noreply]`: old clients send a 0 time.
            let n = args.len() - noreply as usize;
            if n == 0 || n > 2 || !valid_key(args[0]) || (n == 2 && args[1] != b"0") {
                return refused(BAD_FORMAT, line_len);
            }
            done(Command::Delete {
                key: args[0],
                noreply,
            })
        }
        b"incr" | b"decr" => {
            if args.len() - noreply as usize != 2 || !valid_key(args[0]) {
                return refused(BAD_FORMAT, line_len);
            }
            let Some(delta) = num::<u64>(args[1]) else {
                return refused("CLIENT_ERROR invalid numeric delta argument\r\n", line_len);
            };
            done(Command::Arith {
                key: args[0],
                delta,
                incr: name == b"incr",
                noreply,
            })
        }
        b"touch" => {
            let exptime = (args.len() - noreply as usize == 2)
                .then(|| num::<i64>(args[1]))
                .flatten();
            match exptime {
                Some(exptime) if valid_key(args[0]) => done(Command::Touch {
                    key: args[0],
                    exptime,
                    noreply,
                }),
                _ => refused(BAD_FORMAT, line_len),
            }
        }
        b"flush_all" => {
            let n = args.len() - noreply as usize;
            let delay = match n {
                0 => Some(0),
                1 => num::<i64>(args[0]),
                _ => None,
            };
            match delay {
                Some(delay) => done(Command::FlushAll { delay, noreply }),
                None => refused(BAD_FORMAT, line_len),
            }
        }
        // No arguments (not even `noreply`), as memcached before 1.6.
        b"version" | b"stats" | b"quit" if !args.is_empty() => refused("ERROR\r\n", line_len),
        b"version" => done(Command::Version),
        b"stats" => done(Command::Stats),
        b"quit" => done(Command::Quit),
        // `verbosity <level> [noreply]`, or `verbosity noreply`.
        b"verbosity" => match args.len() - noreply as usize {
            0 if noreply => done(Command::Verbosity { noreply }),
            1 if num::<u32>(args[0]).is_some() => done(Command::Verbosity { noreply }),
            _ => refused("ERROR\r\n", line_len),
        },
        _ => refused("ERROR\r\n", line_len),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &[u8]) -> Parsed<'_> {
        parse(s, &Limits::default())
    }

    #[test]
    fn commands_and_their_lengths() {
        assert_eq!(
            p(b"get a bb\r\nrest"),
            Parsed::Command {
                cmd: Command::Get {
                    keys: vec![b"a", b"bb"],
                    cas: false
                },
                used: 10
            }
        );
        assert_eq!(
            p(b"cas k 5 -1 3 99 noreply\r\nabc\r\n"),
            Parsed::Command {
                cmd: Command::Store {
                    verb: StoreVerb::Cas,
                    key: b"k",
                    flags: 5,
                    exptime: -1,
                    data: b"abc",
                    unique: 99,
                    noreply: true
                },
                used: 30
            }
        );
        assert_eq!(p(b"set k 0 0 3\r\nab"), Parsed::Incomplete);
        assert_eq!(p(b"set k 0 0"), Parsed::Incomplete);
        assert!(matches!(
            p(b"incr k 18446744073709551615\n"),
            Parsed::Command {
                cmd: Command::Arith {
                    delta: u64::MAX,
                    incr: true,
                    ..
                },
                used: 28
            }
        ));
        assert!(matches!(
            p(b"delete k 0 noreply\r\n"),
            Parsed::Command {
                cmd: Command::Delete { noreply: true, .. },
                ..
            }
        ));
        assert!(matches!(
            p(b"flush_all 10\r\n"),
            Parsed::Command {
                cmd: Command::FlushAll {
                    delay: 10,
                    noreply: false
                },
                ..
            }
        ));
        assert!(matches!(
            p(b"touch k 100\r\n"),
            Parsed::Command {
                cmd: Command::Touch { exptime: 100, .. },
                ..
            }
        ));
        assert!(matches!(
            p(b"verbosity 1 noreply\r\n"),
            Parsed::Command {
                cmd: Command::Verbosity { noreply: true },
                ..
            }
        ));
    }

    #[test]
    fn bad_input_gets_memcached_replies() {
        let refusal = |s: &[u8]| match p(s) {
            Parsed::Refused { reply, skip, close } => (reply, skip, close),
            other => panic!("{other:?}"),
        };
        assert_eq!(refusal(b"bogus\r\n"), ("ERROR\r\n", 7, false));
        assert_eq!(refusal(b"\r\n"), ("ERROR\r\n", 2, false));
        assert_eq!(refusal(b"get\r\n").0, BAD_FORMAT);
        assert_eq!(refusal(b"set k x 0 1\r\na\r\n").0, BAD_FORMAT);
        assert_eq!(refusal(b"set k 0 0 -1\r\n").0, BAD_FORMAT);
        assert_eq!(
            refusal(b"incr k -1\r\n").0,
            "CLIENT_ERROR invalid numeric delta argument\r\n"
        );
        assert_eq!(
            refusal(b"set k 0 0 1\r\nab\r\n"),
            ("CLIENT_ERROR bad data chunk\r\n", 16, false)
        );
        // Too large: refused at once, the value dropped as it arrives.
        let (r, skip, close) = refusal(b"set k 0 0 2000000\r\n");
        assert_eq!(r, "SERVER_ERROR object too large for cache\r\n");
        assert_eq!((skip, close), (19 + 2_000_000 + 2, false));
        // Lengths that would overflow are refused, not trusted.
        assert_eq!(
            refusal(b"set k 0 0 18446744073709551615\r\n").0,
            "SERVER_ERROR object too large for cache\r\n"
        );
        let long_key = [b"get ".as_slice(), &[b'k'; 251], b"\r\n"].concat();
        assert_eq!(refusal(&long_key).0, BAD_FORMAT);
        let (r, _, close) = refusal(&[b'x'; 3000]);
        assert_eq!((r, close), ("CLIENT_ERROR line too long\r\n", true));
        assert_eq!(refusal(b"get a\x01b\r\n").0, BAD_FORMAT);
    }

    #[test]
    fn never_panics_on_any_prefix_or_mutation() {
        let good: &[&[u8]] = &[
            b"set k 1 2 3\r\nabc\r\n",
            b"cas k 1 2 3 4 noreply\r\nabc\r\n",
            b"gets a b c\r\n",
            b"incr n 5\r\n",
            b"delete k 0\r\n",
            b"touch k 1\r\n",
            b"flush_all 1 noreply\r\n",
        ];
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for g in good {
            for cut in 0..=g.len() {
                let _ = p(&g[..cut]);
            }
            for _ in 0..2000 {
                let mut m = g.to_vec();
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let i = (x as usize) % m.len();
                m[i] = (x >> 32) as u8;
                if let Parsed::Command { used, .. } = p(&m) {
                    assert!(used <= m.len());
                }
            }
        }
    }
}
