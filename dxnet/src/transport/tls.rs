//! Optional TLS for the TCP transport (rustls, TLS 1.3 only, mutual
//! certificate authentication).
//!
//! Every node holds a certificate signed by the cluster's CA whose DNS
//! subject alternative name is `node-<id>.dxnet` (see [`TlsConfig::node_name`]). The
//! dialer verifies that the acceptor's certificate names the node it dialed;
//! the acceptor verifies that the dialer's certificate names the node id the
//! dialer claims in its hello. So with TLS on, a member of the cluster cannot
//! claim another node's id, not even while that node is down (the HMAC
//! secret alone cannot prevent that: every member knows it).
//!
//! The cryptography is rustls with the `ring` provider; nothing here is
//! hand-written crypto.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, ClientConnection, Connection, RootCertStore, ServerConfig};

/// One connection's TLS state.
pub type Session = Connection;

use crate::config::TlsConfig;
use crate::{Error, NodeId, Result};

/// Client and server configurations of one node, built once at start.
pub struct TlsContext {
    client: Arc<ClientConfig>,
    server: Arc<ServerConfig>,
}

impl std::fmt::Debug for TlsContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsContext")
    }
}

fn cfg_err(what: &str, path: &str, e: impl std::fmt::Display) -> Error {
    Error::Config(format!("tls.{what}: {path}: {e}"))
}

impl TlsContext {
    /// Loads the PEM files named by `cfg` and builds the rustls
    /// configurations; every failure names the field and the file.
    pub fn load(cfg: &TlsConfig) -> Result<Self> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&cfg.cert)
            .map_err(|e| cfg_err("cert", &cfg.cert, e))?
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| cfg_err("cert", &cfg.cert, e))?;
        if certs.is_empty() {
            return Err(cfg_err("cert", &cfg.cert, "no certificate in the file"));
        }
        let key =
            PrivateKeyDer::from_pem_file(&cfg.key).map_err(|e| cfg_err("key", &cfg.key, e))?;
        let mut roots = RootCertStore::empty();
        let mut n = 0;
        for ca in CertificateDer::pem_file_iter(&cfg.ca).map_err(|e| cfg_err("ca", &cfg.ca, e))? {
            let ca = ca.map_err(|e| cfg_err("ca", &cfg.ca, e))?;
            roots.add(ca).map_err(|e| cfg_err("ca", &cfg.ca, e))?;
            n += 1;
        }
        if n == 0 {
            return Err(cfg_err("ca", &cfg.ca, "no certificate in the file"));
        }
        let roots = Arc::new(roots);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let versions = &[&rustls::version::TLS13];
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| cfg_err("ca", &cfg.ca, e))?;
        let mut server = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(versions)
            .map_err(|e| Error::Config(format!("tls: {e}")))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs.clone(), key.clone_key())
            .map_err(|e| cfg_err("key", &cfg.key, e))?;
        // No resumption between nodes: connections are long-lived.
        server.send_tls13_tickets = 0;
        let client = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(versions)
            .map_err(|e| Error::Config(format!("tls: {e}")))?
            .with_root_certificates(roots)
            .with_client_auth_cert(certs, key)
            .map_err(|e| cfg_err("key", &cfg.key, e))?;
        Ok(Self {
            client: Arc::new(client),
            server: Arc::new(server),
        })
    }

    /// Runs the client side of a TLS handshake on a blocking socket; the
    /// server's certificate must name `peer`.
    pub fn dial(&self, s: &mut TcpStream, peer: NodeId) -> std::result::Result<Connection, String> {
        let name = ServerName::try_from(TlsConfig::node_name(peer)).map_err(|e| e.to_string())?;
        let conn = ClientConnection::new(self.client.clone(), name)
            .map_err(|e| format!("TLS set-up: {e}"))?;
        complete_handshake(Connection::Client(conn), s)
    }

    /// Runs the server side of a TLS handshake on a blocking socket.
    pub fn accept(&self, s: &mut TcpStream) -> std::result::Result<Connection, String> {
        let conn = rustls::ServerConnection::new(self.server.clone())
            .map_err(|e| format!("TLS set-up: {e}"))?;
        complete_handshake(Connection::Server(conn), s)
    }
}

fn complete_handshake(
    mut conn: Connection,
    s: &mut TcpStream,
) -> std::result::Result<Connection, String> {
    while conn.is_handshaking() {
        conn.complete_io(s)
            .map_err(|e| format!("TLS handshake: {e}"))?;
    }
    Ok(conn)
}

/// The leaf certificate the peer presented (already verified against the
/// CA by rustls).
pub fn peer_cert(conn: &Connection) -> Option<CertificateDer<'static>> {
    conn.peer_certificates().and_then(|c| c.first()).cloned()
}

/// Checks that the (already CA-verified) client certificate of an accepted
/// connection names `claimed`, the node id the dialer says it is.
pub fn check_cert_names(
    cert: Option<&CertificateDer<'_>>,
    claimed: NodeId,
) -> std::result::Result<(), String> {
    let cert = cert.ok_or("the peer presented no certificate")?;
    let ee = webpki::EndEntityCert::try_from(cert).map_err(|e| format!("peer certificate: {e}"))?;
    let name = ServerName::try_from(TlsConfig::node_name(claimed)).map_err(|e| e.to_string())?;
    ee.verify_is_valid_for_subject_name(&name).map_err(|_| {
        format!(
            "the peer's certificate does not name {} (it claims to be {claimed})",
            TlsConfig::node_name(claimed)
        )
    })
}

/// A blocking TLS stream over a borrowed socket, for the handshake messages
/// exchanged after the TLS handshake.
pub struct TlsStream<'a> {
    /// The TLS state.
    pub conn: &'a mut Connection,
    /// The socket.
    pub sock: &'a mut TcpStream,
}

impl TlsStream<'_> {
    fn write_out(&mut self) -> std::io::Result<()> {
        while self.conn.wants_write() {
            self.conn.write_tls(self.sock)?;
        }
        Ok(())
    }
}

impl Read for TlsStream<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            match self.conn.reader().read(buf) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                r => return r,
            }
            self.write_out()?;
            if self.conn.read_tls(self.sock)? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            self.conn
                .process_new_packets()
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        }
    }
}

impl Write for TlsStream<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.conn.writer().write(buf)?;
        self.write_out()?;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.conn.writer().flush()?;
        self.write_out()
    }
}
