//! Stands in for [`super::tls`] when dxnet is built without the `tls`
//! Cargo feature, so the TCP engine compiles unchanged: its types are
//! uninhabited (no TLS session can exist), and loading a TLS configuration
//! fails with a clear error at `Node::start`.

use std::io::{Read, Write};
use std::net::TcpStream;

use crate::config::TlsConfig;
use crate::{Error, NodeId, Result};

/// The error a configuration with `[tls]` gets from a build without TLS.
pub fn disabled() -> Error {
    Error::Config("tls: dxnet was built without the `tls` Cargo feature".into())
}

/// One connection's TLS state: none can exist in this build.
pub enum Session {}

/// A node's TLS configuration: none can be loaded in this build.
#[derive(Debug)]
pub enum TlsContext {}

/// A peer certificate: none can exist in this build.
pub enum Certificate {}

impl TlsContext {
    /// Always fails: TLS is not built in.
    pub fn load(_cfg: &TlsConfig) -> Result<Self> {
        Err(disabled())
    }

    /// Unreachable (no context exists).
    pub fn dial(&self, _s: &mut TcpStream, _peer: NodeId) -> std::result::Result<Session, String> {
        match *self {}
    }

    /// Unreachable (no context exists).
    pub fn accept(&self, _s: &mut TcpStream) -> std::result::Result<Session, String> {
        match *self {}
    }
}

impl Session {
    /// Unreachable (no session exists).
    pub fn reader(&mut self) -> &mut dyn Read {
        match *self {}
    }

    /// Unreachable (no session exists).
    pub fn writer(&mut self) -> &mut dyn Write {
        match *self {}
    }

    /// Unreachable (no session exists).
    pub fn wants_write(&self) -> bool {
        match *self {}
    }

    /// Unreachable (no session exists).
    pub fn read_tls(&mut self, _from: &mut dyn Read) -> std::io::Result<usize> {
        match *self {}
    }

    /// Unreachable (no session exists).
    pub fn write_tls(&mut self, _to: &mut dyn Write) -> std::io::Result<usize> {
        match *self {}
    }

    /// Unreachable (no session exists).
    pub fn process_new_packets(&mut self) -> std::io::Result<()> {
        match *self {}
    }
}

/// Unreachable (no session exists).
pub fn peer_cert(conn: &Session) -> Option<Certificate> {
    match *conn {}
}

/// Unreachable (no certificate exists).
pub fn check_cert_names(
    cert: Option<&Certificate>,
    _claimed: NodeId,
) -> std::result::Result<(), String> {
    match cert {
        Some(c) => match *c {},
        None => Err("the peer presented no certificate".into()),
    }
}

/// A TLS stream over a borrowed socket: none can exist in this build.
#[allow(dead_code)] // the fields mirror the TLS build's, for the TCP engine
pub struct TlsStream<'a> {
    /// The TLS state.
    pub conn: &'a mut Session,
    /// The socket.
    pub sock: &'a mut TcpStream,
}

impl Read for TlsStream<'_> {
    fn read(&mut self, _buf: &mut [u8]) -> std::io::Result<usize> {
        match *self.conn {}
    }
}

impl Write for TlsStream<'_> {
    fn write(&mut self, _buf: &[u8]) -> std::io::Result<usize> {
        match *self.conn {}
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match *self.conn {}
    }
}
